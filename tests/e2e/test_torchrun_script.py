"""A torchrun script that never imports Lazarus (its own snapshot.pt, in the style of torchrun's
elastic docs) under Lazarus: it completes, recovers from a dead node on a hot spare, and two runs
started from the same folder never read each other's snapshot."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from lazarus.client.config import Settings
from lazarus.client.runs import start_run
from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.schema import RunState, parse_spec
from lazarus.schema.rundir import RunDir
from lazarus.worker import build_worker
from tests.support.runs import REPO

SCRIPT = REPO / "examples" / "torchrun_snapshot.py"
EPOCHS, SAVE_EVERY = 30, 5
EPOCH_LINE = re.compile(r"^epoch (\d+) loss (\S+)$", re.MULTILINE)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def epoch_losses(text: str) -> dict[int, float]:
    """epoch -> loss from rank 0's output."""
    return {int(epoch): float(loss) for epoch, loss in EPOCH_LINE.findall(text)}


@pytest.fixture(scope="module")
def under_torchrun(tmp_path_factory) -> dict[int, float]:
    """The same script under plain torchrun, 4 ranks, no fault: epoch -> loss (from rank 0's own
    stdout file: on one shared pipe the ranks' lines could interleave)."""
    folder = tmp_path_factory.mktemp("torchrun")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "4"]
    done = subprocess.run(
        [*torchrun, "--log-dir", str(folder / "logs"), "--redirects", "3"]
        + [str(SCRIPT), "--epochs", str(EPOCHS), "--save-every", str(SAVE_EVERY)],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    [rank0] = (folder / "logs").glob("*/attempt_0/0/stdout.log")
    losses = epoch_losses(rank0.read_text())
    assert sorted(losses) == list(range(1, EPOCHS + 1))
    return losses


def snapshot_spec(name: str, nodes: int, spares: int, epochs: int = EPOCHS, **more):
    command = ["python", str(SCRIPT), "--epochs", str(epochs), "--save-every", str(SAVE_EVERY)]
    return parse_spec(
        {
            "name": name,
            "trainer": {"command": command, **more.pop("trainer", {})},
            "layout": {"dp": nodes, "ranks_per_node": 1},
            "cluster": {"active_nodes": nodes, "spare_nodes": spares},
            "recovery": {"heartbeat_interval_seconds": 0.05, "progress_every_seconds": 2},
            **more,
        }
    )


def rank0_output(run: RunDir, incarnation: int) -> str:
    path = run.log_file(incarnation, 0)
    return path.read_text() if path.exists() else ""


async def until(condition, what: str, timeout: float) -> None:
    """Wait on the event loop (the worker shares it) until `condition()` holds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        await asyncio.sleep(0.05)


async def test_a_script_with_its_own_snapshot_recovers_on_a_hot_spare(dev_env, home, under_torchrun):
    spec = snapshot_spec("snapshot", nodes=4, spares=1)
    queue, run_id = f"snap-{uuid.uuid4().hex[:8]}", f"snapshot-{uuid.uuid4().hex[:6]}"
    cluster = LocalCluster(home)
    run = cluster.run_dir(run_id)
    async with build_worker(dev_env.client, queue, cluster):
        handle = await start_run(dev_env.client, Settings(task_queue=queue), spec, run_id)
        await until(lambda: max(epoch_losses(rank0_output(run, 0)), default=0) >= 12, "epoch 12", timeout=120)
        await asyncio.to_thread(cluster.kill_node, run_id, "node-2")
        status = await handle.result()

    assert status.state == RunState.COMPLETED, status.reason
    [incident] = status.incidents
    assert incident.fault.kind == "node_down" and incident.fault.nodes == ["node-2"]
    assert incident.decision.action == "replace" and incident.decision.replacements == {"node-2": "node-4"}
    assert incident.outcome == "recovered"
    # The script reports no steps: Lazarus says it does not know them, and makes up nothing.
    assert status.step is None and status.steps_from is None and status.progress.startswith("unknown")
    assert incident.fault.step is None and incident.lost_steps is None and incident.resumed_from_step is None
    assert incident.mttr_seconds is None
    assert "Traceback" not in json.dumps(status.summary()) and status.reason == ""

    # What the script computed: incarnation 0 trained epochs 1..E; incarnation 1 loaded the newest
    # snapshot it had saved (in the run's own folder) and trained the rest; every epoch's loss is
    # the loss the same epoch had under plain torchrun, bit for bit.
    before, after = rank0_output(run, 0), rank0_output(run, 1)
    trained_before = epoch_losses(before)
    [resumed] = re.findall(r"Resuming training from snapshot at epoch (\d+)", after)
    resumed = int(resumed)
    assert resumed % SAVE_EVERY == 0 and 10 <= resumed <= max(trained_before)
    assert sorted(epoch_losses(after)) == list(range(resumed + 1, EPOCHS + 1))
    for epoch, loss in {**trained_before, **epoch_losses(after)}.items():
        assert loss == under_torchrun[epoch], f"epoch {epoch}: {loss} != {under_torchrun[epoch]} under torchrun"
    assert "world 4, restart 1 of 20" in after  # TORCHELASTIC_RESTART_COUNT / _MAX_RESTARTS as torchrun means them
    assert (run.work_dir / "snapshot.pt").is_file()


async def test_steps_read_from_the_output_feed_status_lost_steps_and_a_planned_fault(dev_env, home, under_torchrun):
    """trainer.progress_pattern reads the epoch every rank prints: the run's step, the restore
    point and the lost steps become known, and a planned fault at a step works for this script,
    which knows nothing of Lazarus (node-1's launcher kills its rank once it printed epoch 12)."""
    spec = snapshot_spec(
        "pattern",
        nodes=4,
        spares=1,
        trainer={"progress_pattern": r"Epoch (?P<step>\d+) \|"},
        faults=[{"node": "node-1", "step": 13}],
    )
    queue, run_id = f"pat-{uuid.uuid4().hex[:8]}", f"pattern-{uuid.uuid4().hex[:6]}"
    cluster = LocalCluster(home)
    run = cluster.run_dir(run_id)
    async with build_worker(dev_env.client, queue, cluster):
        status = await (await start_run(dev_env.client, Settings(task_queue=queue), spec, run_id)).result()

    assert status.state == RunState.COMPLETED, status.reason
    assert status.steps_from == "output" and status.step == EPOCHS and status.progress == str(EPOCHS)
    [incident] = status.incidents
    assert incident.fault.kind == "rank_exit" and incident.fault.nodes == ["node-1"]
    assert incident.fault.signal == "SIGKILL" and incident.decision.replacements == {"node-1": "node-4"}
    # The launcher kills once epoch 12 is printed; the other ranks may be an epoch on by then.
    assert 12 <= incident.fault.step <= 14
    [resumed] = re.findall(r"Resuming training from snapshot at epoch (\d+)", rank0_output(run, 1))
    assert incident.resumed_from_step == int(resumed) == 10
    assert incident.lost_steps == incident.fault.step - 10
    assert incident.mttr_seconds is not None and incident.mttr_seconds > 0
    for epoch, loss in {**epoch_losses(rank0_output(run, 0)), **epoch_losses(rank0_output(run, 1))}.items():
        assert loss == under_torchrun[epoch], f"epoch {epoch}"


async def test_two_runs_from_the_same_folder_never_share_a_snapshot(dev_env, home, tmp_path, monkeypatch):
    """The script names snapshot.pt relative to its working directory: each run has its own."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "snapshot.pt").write_bytes(b"a stale snapshot a torchrun job left here: loading it would fail")
    queue = f"pair-{uuid.uuid4().hex[:8]}"
    cluster = LocalCluster(home)
    runs = []
    async with build_worker(dev_env.client, queue, cluster):
        for index in range(2):
            run_id = f"pair-{index}-{uuid.uuid4().hex[:6]}"
            handle = await start_run(dev_env.client, Settings(task_queue=queue), snapshot_spec("pair", 2, 0, 5), run_id)
            status = await handle.result()
            assert status.state == RunState.COMPLETED, status.reason
            runs.append(cluster.run_dir(run_id))
    for run in runs:
        assert "No snapshot at snapshot.pt: training from scratch" in rank0_output(run, 0)
        assert sorted(epoch_losses(rank0_output(run, 0))) == list(range(1, 6))
        assert (run.work_dir / "snapshot.pt").is_file()
    assert runs[0].work_dir != runs[1].work_dir
    assert Path(tmp_path / "snapshot.pt").read_bytes().startswith(b"a stale snapshot")
