"""A user's own DDP script under Lazarus: recovery from its own checkpoint, logs, bad commands."""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from lazarus.client.config import Settings
from lazarus.client.runs import start_run
from lazarus.commands.demo_run import drive_run
from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.schema import RunState, load_spec, parse_spec
from lazarus.worker import build_worker
from tests.support.runs import (
    REPO,
    USER_DDP_SPEC,
    assert_restored_from_survivors,
    losses,
    trained_step,
    with_absolute_command,
)
from tests.support.waiting import wait_until
from tests.support.workers import lazarus_env

SHADOWS = ("trainer.py", "spec/__init__.py", "infra/__init__.py", "schema/__init__.py", "workflows/__init__.py")
"""Modules a user's project commonly has, named like Lazarus's floors."""

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


async def run_spec(dev_env, home, spec, kill_at):
    settings = Settings(task_queue=f"byo-{uuid.uuid4().hex[:8]}", home=home)
    cluster = LocalCluster(home)
    run_id = f"{spec.name}-{uuid.uuid4().hex[:6]}"
    async with build_worker(dev_env.client, settings.task_queue, cluster):
        status = await drive_run(dev_env.client, settings, cluster, spec, run_id, kill_at, say=lambda _: None)
    return status, cluster, run_id


async def test_user_ddp_script_resumes_from_its_own_checkpoint(dev_env, home, reference):
    spec = with_absolute_command(load_spec(USER_DDP_SPEC))
    status, cluster, run_id = await run_spec(dev_env, home, spec, kill_at=60)

    assert status.state == RunState.COMPLETED and status.step == 100
    assert len(status.incidents) == 1, [
        (i.fault.kind, i.fault.nodes, i.fault.step, i.fault.reason) for i in status.incidents
    ]
    [incident] = status.incidents
    assert incident.fault.kind == "node_down" and incident.resumed_from_step == 50
    run = cluster.run_dir(run_id)
    # The script restored its own state.pt of step 50, then trained 51..100 as if nothing happened.
    assert (run.checkpoint(100) / "state.pt").exists()
    resumed = losses(run, incarnation=1)
    assert sorted(resumed) == list(range(51, 101))
    expected = reference(USER_DDP_SPEC)
    assert {s: loss for s, loss in resumed.items() if loss != expected[s]} == {}

    # The killed node's logs are kept and shown by `lazarus run logs`.
    killed = incident.fault.nodes[0]
    shown = subprocess.run(
        [sys.executable, "-m", "lazarus.cli", "run", "logs", run_id, "--node", killed],
        env={"LAZARUS_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    rank = incident.old_assignment.nodes.index(killed)
    lines = shown.stdout.splitlines()
    assert lines[0] == f"{killed} rank {rank} | rank {rank} of 4: training steps 1..100"
    assert all(line.startswith(f"{killed} rank {rank} | ") for line in lines)


async def test_a_command_that_exits_at_once_restarts_in_place_once_then_fails_as_a_crash_loop(dev_env, home):
    spec = parse_spec(
        {
            "name": "bad-exit",
            "trainer": {"command": ["python", "-c", "import sys; print('bad config: no such dataset'); sys.exit(3)"]},
        }
    )
    status, _, _ = await run_spec(dev_env, home, spec, kill_at=None)
    assert status.state == RunState.FAILED
    # Restarted in place once (a first failure may be transient), then the same failure is a crash loop.
    assert "crash loop: the same failure again after a restart in place (incident 1)" in status.reason
    assert "exited with code 3" in status.reason and "bad config: no such dataset" in status.reason
    assert "the script reports no steps" in status.reason and "before" not in status.reason.split(";")[0]
    [first, second] = status.incidents
    assert first.new_assignment.nodes == first.old_assignment.nodes  # in place
    assert status.quarantined_nodes == [] and first.fault.nodes == second.fault.nodes == []  # no spare spent


async def test_a_command_that_does_not_exist_is_refused(dev_env, home, tmp_path):
    spec = parse_spec({"name": "no-cmd", "trainer": {"command": ["no-such-trainer-binary", "--steps", "5"]}})
    status, _, _ = await run_spec(dev_env, home, spec, kill_at=None)
    assert status.state == RunState.FAILED
    assert (
        "launch refused (CommandNotFound): trainer.command: 'no-such-trainer-binary' is not an executable"
        in status.reason
    )
    path = tmp_path / "no-cmd.yaml"
    path.write_text("name: no-cmd\ntrainer:\n  command: [no-such-trainer-binary]\n")
    done = subprocess.run(
        [sys.executable, "-m", "lazarus.cli", "run", "start", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "'no-such-trainer-binary' is not an executable on this node" in done.stderr


def user_project(folder: Path) -> None:
    """A user's project: the DDP script as `train.py` beside modules named like Lazarus's floors,
    each of which fails loudly if anything imports it."""
    folder.mkdir()
    shutil.copy(REPO / "examples" / "train_ddp.py", folder / "train.py")
    for name in SHADOWS:
        path = folder / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"raise ImportError('the project\\'s own {name} was imported instead of Lazarus\\'s')\n")


async def test_a_script_beside_its_own_modules_recovers_from_its_survivors(dev_env, home, workers, reference, tmp_path):
    """The worker runs in the project's folder (its launchers and standbys too) and the ranks run
    the project's train.py (its folder first on sys.path): nothing of Lazarus may import the
    project's modules instead. The script saves its state through the session when its process
    group breaks (trainer.survivor_state), so the recovery loses no completed step."""
    project = tmp_path / "project"
    user_project(project)
    spec = load_spec(USER_DDP_SPEC)
    command = ["python", str(project / "train.py")]  # the ranks run in the run's own folder, not the project's
    trainer = spec.trainer.model_copy(update={"command": command, "survivor_state": True})
    spec = spec.model_copy(update={"trainer": trainer})
    queue = f"shadow-{uuid.uuid4().hex[:6]}"
    workers(lazarus_env(dev_env, home, queue), tmp_path / "worker.log", cwd=project)
    run_id = f"shadow-{uuid.uuid4().hex[:6]}"
    cluster = LocalCluster(home)
    run = cluster.run_dir(run_id)
    handle = await start_run(dev_env.client, Settings(task_queue=queue), spec, run_id)
    wait_until(lambda: trained_step(run) >= 60, "step 60", timeout=120)
    cluster.kill_node(run_id, "node-2")
    status = await handle.result()

    assert status.state == RunState.COMPLETED and status.step == 100, status.reason
    [incident] = status.incidents
    assert incident.fault.nodes == ["node-2"] and incident.outcome == "recovered"
    # Restored from the survivors' state of the interrupted step, not the checkpoint of step 50.
    assert_restored_from_survivors(run, incident)
    assert incident.resumed_from_step > 50
    resumed = losses(run, incarnation=1)
    assert sorted(resumed) == list(range(incident.resumed_from_step + 1, 101))
    expected = reference(USER_DDP_SPEC)
    assert {s: loss for s, loss in resumed.items() if loss != expected[s]} == {}
    logs = [path.read_text() for path in run.root.rglob("*log") if path.is_file()]
    assert logs and not any("imported instead of Lazarus" in log for log in logs)
