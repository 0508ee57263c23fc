"""The whole loop on the real dev server, real trainer processes, a node killed mid-run."""

from __future__ import annotations

import json
import urllib.request
import uuid

import pytest

from lazarus.activities.failpoints import ENV_FAILPOINT_DIR, ENV_FAILPOINTS
from lazarus.client import start_run
from lazarus.config import Settings
from lazarus.infra.local import LocalCluster
from lazarus.schema import STAGES, RunState, RunStatus, load_spec
from lazarus.schema.files import read_json
from lazarus.schema.rundir import RunDir
from tests.support.runs import SMALL_SPEC, losses, trained_step
from tests.support.waiting import wait_until
from tests.support.workers import demo_json, lazarus_env

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

KILL_AT_STEP = 15


def activity_names_in_web_ui(ui_port: int, workflow_id: str) -> list[str]:
    """Activity types of a workflow's history, read from the web UI's own HTTP API."""
    url = f"http://127.0.0.1:{ui_port}/api/v1/namespaces/default/workflows/{workflow_id}/history"
    with urllib.request.urlopen(url, timeout=10) as response:
        events = json.load(response)["history"]["events"]
    return [
        e["activityTaskScheduledEventAttributes"]["activityType"]["name"]
        for e in events
        if "activityTaskScheduledEventAttributes" in e
    ]


def assert_last_incarnation_matches(run: RunDir, incident: dict, reference: dict[int, float]) -> None:
    """Every step the resumed incarnation trained has, bit for bit, the loss of the run without a fault."""
    resumed = losses(run, incarnation=incident["new_assignment"]["incarnation"])
    start = incident["resumed_from_step"] + 1
    assert sorted(resumed) == list(range(start, max(reference) + 1))
    mismatched = {step: (loss, reference[step]) for step, loss in resumed.items() if loss != reference[step]}
    assert not mismatched, f"losses differ from the run without a fault: {mismatched}"


def test_demo_recovers_with_a_hot_spare_and_identical_losses(dev_env, home, reference_losses):
    """`lazarus demo --json` kills a node; the spare takes over; losses equal the unfaulted run's."""
    env = lazarus_env(dev_env, home, f"demo-{uuid.uuid4().hex[:6]}")
    env["LAZARUS_UI_URL"] = f"http://127.0.0.1:{dev_env.ui_port}"
    status = demo_json(env, "--spec", str(SMALL_SPEC), "--kill-at-step", str(KILL_AT_STEP))
    for key in ("run_id", "run_dir", "state", "step", "layout", "assignment", "incidents"):
        assert key in status
    assert status["state"] == "COMPLETED" and status["step"] == 60

    [incident] = status["incidents"]
    fault = incident["fault"]
    assert fault["kind"] == "node_down" and fault["nodes"] == ["node-2"]
    # The last step every rank had reported: the killed rank may not have written step 15's.
    assert fault["step"] >= KILL_AT_STEP - 1
    assert list(incident["stages"]) == list(STAGES)
    assert all(stage["seconds"] is not None and stage["seconds"] >= 0 for stage in incident["stages"].values())
    assert incident["decision"]["action"] == "replace"
    assert incident["decision"]["replacements"] == {"node-2": "node-4"}
    assert incident["new_assignment"]["nodes"] == ["node-0", "node-1", "node-4", "node-3"]
    # The survivors saved the step the fault interrupted: the spare's replica starts from it, not
    # from the newest checkpoint, and no completed step is lost.
    assert incident["restored_from"] == "survivors" and incident["lost_steps"] == 0
    assert incident["resumed_from_step"] >= fault["step"] and incident["resumed_from_step"] % 10 != 0
    assert incident["mttr_seconds"] > incident["stages"]["resume"]["seconds"] > 0
    assert status["assignment"] == incident["new_assignment"]

    run = RunDir(status["run_dir"])
    assert_last_incarnation_matches(run, incident, reference_losses)
    # Each node's warm standby had read the state its rank loads before the rank existed.
    new = incident["new_assignment"]["incarnation"]
    for rank in range(4):
        log = run.log_file(new, rank).read_text()
        assert f"restored step {incident['resumed_from_step']} from survivor" in log, log
        assert "read by the node's standby before this rank started" in log, log
    assert LocalCluster(home).live_pids(status["run_id"]) == []

    names = activity_names_in_web_ui(dev_env.ui_port, status["run_id"])
    assert [n for n in names if n != "detect"] == ["launch", "drain", "reschedule", "replace_or_reshard", "resume"]
    assert "detect" in names


async def test_worker_killed_during_drain_and_resume(dev_env, home, workers, reference_losses, tmp_path):
    """SIGKILL the worker inside drain, then inside resume; the third worker finishes the run."""
    queue = f"crash-{uuid.uuid4().hex[:6]}"
    env = lazarus_env(dev_env, home, queue)
    markers = tmp_path / "failpoints"

    def armed(name: str) -> dict:
        return {**env, ENV_FAILPOINTS: name, ENV_FAILPOINT_DIR: str(markers)}

    spec = load_spec(SMALL_SPEC)
    run_id = f"crash-{uuid.uuid4().hex[:6]}"
    cluster = LocalCluster(home)
    run = cluster.run_dir(run_id)
    first = workers(armed("drain.after_quarantine"), tmp_path / "worker-1.log")
    handle = await start_run(dev_env.client, Settings(task_queue=queue), spec, run_id)

    wait_until(lambda: trained_step(run) >= KILL_AT_STEP, f"step {KILL_AT_STEP}", timeout=120)
    cluster.kill_node(run_id, "node-1")

    marker = wait_until(
        lambda: (markers / "drain.after_quarantine").exists() and markers / "drain.after_quarantine",
        "the worker to reach drain",
    )
    assert int(marker.read_text()) == first.process.pid
    assert cluster.inventory(run_id).node("node-1").role == "quarantined"
    first.kill()

    second = workers(armed("resume.after_launch"), tmp_path / "worker-2.log")
    marker = wait_until(
        lambda: (markers / "resume.after_launch").exists() and markers / "resume.after_launch",
        "the second worker to reach resume",
    )
    assert int(marker.read_text()) == second.process.pid
    second.kill()

    workers(env, tmp_path / "worker-3.log")
    final: RunStatus = await handle.result()

    assert final.state == RunState.COMPLETED
    [incident] = final.incidents
    assert incident.fault.nodes == ["node-1"] and incident.outcome == "recovered"
    assert incident.new_assignment.incarnation == 1
    # Exactly one new incarnation, and each of its ranks was started exactly once.
    assert run.incarnations() == [0, 1]
    for rank in range(spec.layout.world_size):
        starts = [
            line for line in run.log_file(1, rank).read_text().splitlines() if line.startswith("lazarus trainer: rank")
        ]
        assert len(starts) == 1, f"rank {rank} of incarnation 1 was started {len(starts)} times"
    assert read_json(run.pid_file(1, 1))["node"] == "node-4"
    assert_last_incarnation_matches(run, incident.model_dump(mode="json"), reference_losses)
    assert cluster.live_pids(run_id) == []
