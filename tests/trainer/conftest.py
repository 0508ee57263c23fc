"""Fixtures of the trainer's tests."""

from __future__ import annotations

import pytest

from lazarus.infra.backends.local.cluster import LocalCluster


@pytest.fixture
def cluster(tmp_path):
    """A local backend under tmp_path; every run it started is stopped at the end, pass or fail."""
    cluster = LocalCluster(tmp_path / "home")
    yield cluster
    for run in (tmp_path / "home" / "runs").glob("*"):
        cluster.stop_run(run.name)
