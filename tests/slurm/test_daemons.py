"""The real Slurm cluster the Slurm tests run on (lazarus.infra.harness.slurm_daemons): it comes up with a
node per slurmd, runs a task on each node, drains a node with a reason the site's tools show, and
stops every daemon. Skipped with the reason where it cannot start (Slurm not installed, not root)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from lazarus.infra.harness.slurm_daemons import SlurmDaemons, why_not_startable

pytestmark = [
    pytest.mark.skipif(why_not_startable() is not None, reason=str(why_not_startable())),
    pytest.mark.timeout(120),
]


@pytest.fixture
def cluster(slurm_daemons):
    """The session's cluster (tests/support/fixtures.py), back in service after each test."""
    yield slurm_daemons
    slurm_daemons.reset()


def slurm(cluster: SlurmDaemons, *command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=cluster.env)
    assert done.returncode == 0, done.stderr
    return done.stdout


def settles_at(cluster: SlurmDaemons, node: str, state: str, timeout: float = 30.0) -> str:
    """The node's state once it is `state` (a resumed node shows idle* until slurmctld next hears it)."""
    deadline = time.monotonic() + timeout
    while (now := cluster.states().get(node)) != state and time.monotonic() < deadline:
        time.sleep(0.2)
    return now


def test_a_job_step_runs_one_task_on_each_node(cluster):
    assert set(cluster.states().values()) == {"idle"} and len(cluster.states()) == 5
    said = slurm(cluster, "srun", "-N3", "-n3", "--overcommit", "bash", "-c", "echo $SLURMD_NODENAME $SLURM_PROCID")
    assert sorted(said.split("\n")[:-1]) == ["node-0 0", "node-1 1", "node-2 2"]


def test_a_drained_node_shows_its_reason_until_resumed(cluster):
    slurm(cluster, "scontrol", "update", "nodename=node-1", "state=drain", "reason=lazarus incident 1: rank_exit")
    assert cluster.states()["node-1"] == "drained"
    assert "lazarus incident 1: rank_exit" in slurm(cluster, "sinfo", "-R", "-h", "-o", "%N %E")
    slurm(cluster, "scontrol", "update", "nodename=node-1", "state=resume")
    assert settles_at(cluster, "node-1", "idle") == "idle"


def test_stop_leaves_no_daemon(tmp_path):
    folder = Path(tempfile.mkdtemp(prefix="lazarus-slurm-"))
    cluster = SlurmDaemons(folder, nodes=1)
    try:
        cluster.start()
        pids = [int((folder / "run" / name).read_text()) for name in ("slurmctld.pid", "slurmd-node-0.pid")]
        pids.append(int((cluster.munge_home / "key" / "munged.pid").read_text()))
    finally:
        cluster.stop()
        shutil.rmtree(folder, ignore_errors=True)
    for pid in pids:
        state = (
            Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if os.path.exists(f"/proc/{pid}")
            else "gone"
        )
        assert state in ("gone", "Z"), (pid, state)
    assert not cluster.munge_home.exists()
