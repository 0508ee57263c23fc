"""The commands on a real Slurm cluster (tests/support/fixtures.py slurm_daemons): a node a Slurm
run drained comes back with `lazarus pool return` after that run has ended, resumed in Slurm too."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lazarus.infra.backends.slurm.cluster import SlurmCluster
from lazarus.schema.load import parse_spec

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def test_pool_return_resumes_a_node_an_ended_slurm_run_drained(slurm_daemons, tmp_path):
    home = tmp_path / "home"
    cluster = SlurmCluster(home, environ=slurm_daemons.env)
    spec = parse_spec(
        {"name": "r", "layout": {"dp": 2, "ranks_per_node": 1}, "cluster": {"backend": "slurm", "active_nodes": 2}}
    )
    try:
        cluster.create("r1", spec)
        cluster.quarantine("r1", ["node-1"], "incident 1: node_down")
        cluster.release_nodes("r1")  # the run ended; what it quarantined stays out, drained in Slurm
        assert slurm_daemons.states()["node-1"].startswith("drain")

        env = {**slurm_daemons.env, "LAZARUS_HOME": str(home), "LAZARUS_TEMPORAL_ADDRESS": "127.0.0.1:9"}
        done = subprocess.run(
            [sys.executable, "-m", "lazarus.cli", "pool", "return", "node-1"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout == "node-1 is a free spare again (returned in its slurm cluster)\n"
        assert slurm_daemons.states()["node-1"].startswith("idle")  # `idle*` until slurmctld pings it again
        assert cluster.pool.read().node("node-1").role == "free"
    finally:
        slurm_daemons.reset()
