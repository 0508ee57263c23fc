"""The whole loop on the real dev server, real trainer processes, a node killed mid-run."""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
import urllib.request
import uuid
from datetime import datetime
from pathlib import Path

import pytest
from temporalio.client import WorkflowExecutionStatus

from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.schema import STAGES
from lazarus.schema.files import lock_is_held
from lazarus.schema.rundir import RunDir
from tests.support.runs import SMALL_SPEC, assert_restored_from_survivors, losses
from tests.support.waiting import wait_until
from tests.support.workers import demo_json, lazarus_env

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

KILL_AT_STEP = 15
DEMO_SPEC = Path(__file__).resolve().parents[2] / "examples" / "demo.yaml"


def history_in_web_ui(ui_port: int, workflow_id: str) -> list[dict]:
    """A workflow's history events, read from the web UI's own HTTP API."""
    url = f"http://127.0.0.1:{ui_port}/api/v1/namespaces/default/workflows/{workflow_id}/history"
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)["history"]["events"]


def activities_in_web_ui(ui_port: int, workflow_id: str) -> list[tuple[str, str | None]]:
    """Each activity the web UI lists: its type and the summary it shows beside it (None for a local
    activity: the marker that records it carries none)."""
    activities = []
    for event in history_in_web_ui(ui_port, workflow_id):
        if "activityTaskScheduledEventAttributes" in event:
            name = event["activityTaskScheduledEventAttributes"]["activityType"]["name"]
            payload = event.get("userMetadata", {}).get("summary", {}).get("data", "")
            activities.append((name, json.loads(base64.b64decode(payload)) if payload else ""))
        elif event.get("markerRecordedEventAttributes", {}).get("markerName") == "core_local_activity":
            [data] = event["markerRecordedEventAttributes"]["details"]["data"]["payloads"]
            activities.append((json.loads(base64.b64decode(data["data"]))["activity_type"], None))
    return activities


def assert_last_incarnation_matches(run: RunDir, incident: dict, reference: dict[int, float]) -> None:
    """Every step the resumed incarnation trained has, bit for bit, the loss of the run without a fault."""
    resumed = losses(run, incarnation=incident["new_assignment"]["incarnation"])
    start = incident["resumed_from_step"] + 1
    assert sorted(resumed) == list(range(start, max(reference) + 1))
    mismatched = {step: (loss, reference[step]) for step, loss in resumed.items() if loss != reference[step]}
    assert not mismatched, f"losses differ from the run without a fault: {mismatched}"


@pytest.mark.web_ui
def test_demo_recovers_with_a_hot_spare_and_identical_losses(dev_env, home, reference_losses):
    """`lazarus demo --json` kills a node; the spare takes over; losses equal the unfaulted run's."""
    env = lazarus_env(dev_env, home, f"demo-{uuid.uuid4().hex[:6]}")
    env["LAZARUS_UI_URL"] = f"http://127.0.0.1:{dev_env.ui_port}"
    status = demo_json(env, "--spec", str(SMALL_SPEC), "--kill-at-step", str(KILL_AT_STEP))
    for key in ("run_id", "run_dir", "state", "step", "layout", "assignment", "incidents"):
        assert key in status
    assert status["state"] == "COMPLETED" and status["step"] == 40

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
    assert_restored_from_survivors(RunDir(status["run_dir"]), incident)
    assert incident["resumed_from_step"] % 10 != 0
    # The first step is the rank's own time; resume ends when the controller has seen it, a look later.
    first_step = datetime.fromisoformat(incident["first_step_at"])
    assert incident["mttr_seconds"] > 0 and incident["stages"]["resume"]["seconds"] > 0
    assert first_step <= datetime.fromisoformat(incident["stages"]["resume"]["ended_at"])
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

    activities = activities_in_web_ui(dev_env.ui_port, status["run_id"])
    assert [(name, summary) for name, summary in activities if name != "detect"] == [
        ("launch", "launch incarnation 0: dp=4 on 4 nodes (+1 spare)"),
        ("drain", None),  # local activities, one after another in the workflow task after detect's report
        ("reschedule", None),
        ("replace_or_reshard", None),
        ("resume", "resume incarnation 1 on node-0, node-1, node-4, node-3"),
        ("release", "give the run's nodes back to the pool"),
    ]
    watches = {summary for name, summary in activities if name == "detect"}
    assert watches == {"watch incarnation 0", "watch incarnation 1"}


@pytest.mark.web_ui
def test_a_fault_free_demo_sized_run_writes_a_short_history(dev_env, home, tmp_path):
    """The demo's spec, shortened to 60 steps, without a fault: no progress reports in the history,
    only the run's own events (launch, one watch, the end)."""
    spec = tmp_path / "demo-60.yaml"
    spec.write_text(DEMO_SPEC.read_text().replace("steps: 300 ", "steps: 60 "))
    env = lazarus_env(dev_env, home, f"demo-{uuid.uuid4().hex[:6]}")
    status = demo_json(env, "--spec", str(spec), "--no-fault")
    assert status["state"] == "COMPLETED" and status["step"] == 60 and status["incidents"] == []
    events = history_in_web_ui(dev_env.ui_port, status["run_id"])
    kinds = [event["eventType"] for event in events]
    print(f"a fault-free demo-sized run: {len(events)} history events")
    assert len(events) <= 30, kinds
    assert [name for name, _ in activities_in_web_ui(dev_env.ui_port, status["run_id"])] == [
        "launch",
        "detect",
        "release",
    ]


async def test_a_demo_ended_by_sigterm_terminates_its_run_and_ends_every_process(dev_env, home):
    """The demo's worker goes with the demo: the run it leaves must not wait for a worker forever
    while its ranks and standbys train and wait for no one."""
    env = lazarus_env(dev_env, home, f"demo-{uuid.uuid4().hex[:6]}")
    demo = subprocess.Popen(
        [sys.executable, "-m", "lazarus.cli", "demo", "--spec", str(SMALL_SPEC), "--no-fault"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        run_id = None
        for line in demo.stdout:
            if run_id is None and "] run " in line:
                run_id = line.split("] run ", 1)[1].split(":", 1)[0]
            if "LAUNCHING" in line:
                break
        cluster = LocalCluster(home)
        wait_until(lambda: cluster.live_pids(run_id), "the run's launchers and ranks to start")
        demo.send_signal(signal.SIGTERM)
        rest = demo.communicate(timeout=60)[0]
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    assert demo.returncode == 130, rest
    assert "interrupted: terminating the run" in rest
    assert cluster.live_pids(run_id) == []
    standbys = sorted((cluster.run_dir(run_id).root / "standby").glob("*/lock"))
    assert standbys and not any(lock_is_held(lock) for lock in standbys)
    described = await dev_env.client.get_workflow_handle(run_id).describe()
    assert described.status == WorkflowExecutionStatus.TERMINATED
