"""`lazarus launch`: torchrun's command line, first word changed. A run completes and recovers from
a killed node, a failing script's exit status and log come back, and a user's mistake is one line."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid

import pytest

from lazarus.infra.local import LocalCluster
from tests.support.runs import REPO
from tests.support.waiting import wait_until
from tests.support.workers import lazarus_env

SCRIPT = REPO / "tests" / "user_script" / "torchrun_snapshot.py"
LAUNCH = [sys.executable, "-m", "lazarus.cli", "launch"]
NOWHERE = "127.0.0.1:9"  # no Temporal server: a mistake must be refused before one is needed

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture
def launched(tmp_path):
    """Start `lazarus launch ARGS` in tmp_path, its stdout and stderr in files; killed at the end if it still runs."""
    started = []

    def start(args: list[str], env: dict) -> tuple[subprocess.Popen, object, object]:
        out, err = tmp_path / "launch.out", tmp_path / "launch.err"
        with open(out, "wb") as stdout, open(err, "wb") as stderr:
            process = subprocess.Popen(LAUNCH + args, env=env, cwd=tmp_path, stdout=stdout, stderr=stderr)
        started.append(process)
        return process, out, err

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)


def test_launch_completes_a_run_and_recovers_a_killed_node(dev_env, home, launched):
    run_id = f"launch-{uuid.uuid4().hex[:6]}"
    env = lazarus_env(dev_env, home, f"launch-{uuid.uuid4().hex[:6]}")
    args = ["--nnodes", "4", "--nproc-per-node", "1", "--spares", "1", "--rdzv-backend", "c10d", "--rdzv-id", run_id]
    process, out, err = launched([*args, str(SCRIPT), "--epochs", "30", "--save-every", "5"], env)
    wait_until(lambda: "epoch 12 loss" in out.read_text(), "epoch 12 on rank 0's output", timeout=120)
    killed = LocalCluster(home).kill_node(run_id, "node-2")
    assert killed
    assert process.wait(timeout=180) == 0, err.read_text()

    shown, said = out.read_text(), err.read_text()
    assert said.startswith("lazarus: ignoring --rdzv-backend (Lazarus assigns the ranks and runs the rendezvous")
    assert "incident 1: node_down on node-2" in said
    assert "incident 1: recovered (replaced node-2 by spare node-4" in said
    assert f"run {run_id} COMPLETED" in said and "Traceback" not in said
    # Rank 0's output as the script printed it, across both incarnations: from scratch, then from its snapshot.
    assert shown.startswith("[rank 0] No snapshot at snapshot.pt: training from scratch")
    assert "[rank 0] Resuming training from snapshot at epoch" in shown
    assert shown.count("epoch 30 loss") == 1


def test_a_script_that_fails_on_every_rank_gives_its_exit_status_and_log(dev_env, home, launched, tmp_path):
    script = tmp_path / "bad_config.py"
    script.write_text("import os, sys\nprint(f\"rank {os.environ['RANK']}: no dataset at /data/x\")\nsys.exit(3)\n")
    env = lazarus_env(dev_env, home, f"launch-{uuid.uuid4().hex[:6]}")
    process, out, err = launched(["--nnodes", "2", str(script), "--lr", "3e-4"], env)
    assert process.wait(timeout=120) == 3
    said = err.read_text()
    assert "FAILED: the training program failed: every rank ended before training a step" in said
    assert "exited with code 3" in said
    # The first rank to fail is blamed, and its log's tail shown.
    assert re.search(r"last lines of rank (\d)'s log \(node-\1\):\nrank \1: no dataset at /data/x\n$", said), said
    assert out.read_text() == "rank 0: no dataset at /data/x\n"
    assert "Traceback" not in said


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--nnodes", "2", "missing.py"], "no such script: missing.py"),
        (["--nnodes", "2", "--frobnicate", "3", "train.py"], "unrecognized arguments: --frobnicate"),
        (["--nnodes", "two", "train.py"], "--nnodes: 'two' is not a number of nodes"),
        (["--nnodes", "4:2", "train.py"], "--nnodes: '4:2': MIN is more than MAX"),
        (["--nproc-per-node", "auto", "train.py"], "--nproc-per-node: 'auto' is not a number of ranks per node"),
        (["--spares", "-1", "train.py"], "cluster.spare_nodes: must be greater than or equal to 0"),
        (["--progress-pattern", "step \\d+", "train.py"], "trainer.progress_pattern: 'step \\\\d+' has no group"),
        (["--rdzv-id", "a/b", "train.py"], "--rdzv-id: 'a/b' is not a run id"),
        ([], "no SCRIPT given"),
    ],
)
def test_a_mistake_is_one_line_naming_it(tmp_path, args, said):
    (tmp_path / "train.py").write_text("print('never run')\n")
    done = subprocess.run(
        LAUNCH + args,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "LAZARUS_HOME": str(tmp_path / "home"), "LAZARUS_TEMPORAL_ADDRESS": NOWHERE},
    )
    assert done.returncode == 2
    [line] = done.stderr.splitlines()
    assert line.startswith("lazarus launch: error: ") and said in line, line
    assert done.stdout == ""
    assert not (tmp_path / "home").exists()  # refused before anything started
