"""`lazarus chaos slow-node`: a node's processes get the CPU 1/factor of the time, the other
nodes' are untouched, and every process runs again when the slow-down ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.infra.backends.local.slow_node import slow_node
from lazarus.schema import Assignment, parse_spec

BUSY = ["python", "-c", "while True: pass"]
FACTOR = 4.0
WINDOW_SECONDS = 2.0


@pytest.fixture
def cluster(tmp_path):
    cluster = LocalCluster(tmp_path)
    yield cluster
    for run in (tmp_path / "runs").glob("*"):
        cluster.stop_run(run.name)


def cpu_seconds(pid: int) -> float:
    """User and system CPU time the process has used (seconds)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def busy_run(cluster: LocalCluster) -> dict[str, int]:
    """A run of two nodes, one busy rank each; each node's rank pid, once both run."""
    spec = parse_spec(
        {
            "name": "r",
            "layout": {"dp": 2, "ranks_per_node": 1},
            "cluster": {"active_nodes": 2, "spare_nodes": 0, "warm_standby": False},
            "trainer": {"command": BUSY},
        }
    )
    cluster.create("r1", spec)
    nodes = ["node-0", "node-1"]
    cluster.commit_assignment("r1", Assignment(incarnation=0, nodes=nodes, layout=spec.layout, master_port=29999))
    cluster.start_ranks("r1", 0, resume_step=0)
    run = cluster.run_dir("r1")
    deadline = time.monotonic() + 30
    while not all(run.pid_file(0, rank).exists() for rank in (0, 1)):
        assert time.monotonic() < deadline, "the launchers did not start both ranks within 30 s"
        time.sleep(0.01)
    return {node: json.loads(run.pid_file(0, i).read_text())["pid"] for i, node in enumerate(nodes)}


def test_a_slowed_node_gets_at_most_its_share_and_runs_again_after(cluster):
    pids = busy_run(cluster)
    before = {node: cpu_seconds(pid) for node, pid in pids.items()}
    began = time.monotonic()
    cycles = slow_node(cluster.run_dir("r1"), "node-1", FACTOR, lambda: time.monotonic() - began < WINDOW_SECONDS)
    elapsed = time.monotonic() - began
    used = {node: cpu_seconds(pid) - before[node] for node, pid in pids.items()}

    assert cycles > 0
    # Stopped (1 - 1/FACTOR) of every cycle, it cannot have run more than 1/FACTOR of the time
    # (a tick of accounting aside); the node beside it was never stopped.
    assert used["node-1"] <= elapsed / FACTOR + 0.1, (used, elapsed)
    assert used["node-0"] > used["node-1"], used
    assert state(pids["node-1"]) != "T"  # left running


def test_the_slow_down_ends_with_every_process_running_even_when_it_fails(cluster):
    pids = busy_run(cluster)
    looks = iter([True, True, RuntimeError("the caller broke")])

    def keep_going() -> bool:
        look = next(looks)
        if isinstance(look, Exception):
            raise look
        return look

    with pytest.raises(RuntimeError):
        slow_node(cluster.run_dir("r1"), "node-1", FACTOR, keep_going)
    assert state(pids["node-1"]) != "T"


def lazarus_chaos(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LAZARUS_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "lazarus.cli", "chaos", "slow-node", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_the_command_slows_for_the_seconds_given_and_says_so(cluster, tmp_path):
    pids = busy_run(cluster)
    done = lazarus_chaos(tmp_path, "r1", "node-1", "--factor", "3", "--seconds", "0.5")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "slowing node-1 of run r1 by 3x for 0.5 s"
    assert "node-1 runs at full speed again" in done.stdout
    assert state(pids["node-1"]) != "T"


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["r1", "node-1", "--factor", "1"], "--factor must be more than 1, not 1"),
        (["r1", "node-1", "--seconds", "0"], "--seconds must be positive, not 0"),
        (["r1", "node-7"], "node-7 is not a node of run r1; its nodes: node-0 (active), node-1 (active)"),
    ],
)
def test_a_mistake_is_one_line(cluster, tmp_path, args, said):
    busy_run(cluster)
    done = lazarus_chaos(tmp_path, *args)
    assert done.returncode != 0 and said in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_slow_down_stops_on_sigterm_and_leaves_the_node_running(cluster, tmp_path):
    pids = busy_run(cluster)
    env = {**os.environ, "LAZARUS_HOME": str(tmp_path)}
    slowing = subprocess.Popen(
        [sys.executable, "-m", "lazarus.cli", "chaos", "slow-node", "r1", "node-1", "--factor", "5"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert slowing.stdout.readline().startswith("slowing node-1")
        stopped = threading.Event()

        def watch() -> None:  # the node is stopped at some moment while it is slowed
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not stopped.is_set():
                if state(pids["node-1"]) == "T":
                    stopped.set()
                time.sleep(0.005)

        watcher = threading.Thread(target=watch)
        watcher.start()
        watcher.join()
        assert stopped.is_set(), "the node was never stopped while it was slowed"
        slowing.terminate()
        assert slowing.wait(timeout=30) == 0
    finally:
        slowing.kill()
    assert state(pids["node-1"]) != "T"
