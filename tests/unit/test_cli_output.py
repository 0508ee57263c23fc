"""What the CLI prints: `--json` is one document on stdout whatever else writes to it; tables are plain
text when piped; the Temporal core's logs go to Python logging."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import textwrap

import pytest
from rich.console import Console

from lazarus.commands.report import run_report, summarize
from lazarus.commands.runs import follow, status_view
from lazarus.schema.records import RunState, RunStatus

NOISE = """
import os, subprocess, sys

def noise():
    print("a stray print")
    sys.stdout.flush()
    os.write(1, b"WARN temporalio_sdk_core: written to fd 1 by native code\\n")
    subprocess.run([sys.executable, "-c", "print('a child process')"], check=True)
"""
NOISE_LINES = ("a stray print", "WARN temporalio_sdk_core: written to fd 1 by native code", "a child process")


def recovered_run() -> RunStatus:
    """A finished run of 60 steps whose node-2 died at step 15 and was replaced by the spare node-4."""
    layout = {"dp": 4, "pp": 1, "tp": 1, "ranks_per_node": 1}
    old = {"incarnation": 0, "nodes": ["node-0", "node-1", "node-2", "node-3"], "layout": layout, "master_port": 29500}
    new = {**old, "incarnation": 1, "nodes": ["node-0", "node-1", "node-4", "node-3"], "master_port": 29501}
    stages = {
        "detect": ("00:00:10.000", "00:00:10.050"),
        "drain": ("00:00:10.050", "00:00:10.120"),
        "reschedule": ("00:00:10.120", "00:00:10.140"),
        "replace_or_reshard": ("00:00:10.140", "00:00:10.150"),
        "resume": ("00:00:10.150", "00:00:10.950"),
    }
    at = "2026-01-01T{}Z".format
    return RunStatus.model_validate(
        {
            "run_id": "small-20260101-000000",
            "run_dir": "/tmp/lazarus/runs/small-20260101-000000",
            "state": "COMPLETED",
            "step": 60,
            "total_steps": 60,
            "layout": layout,
            "assignment": new,
            "started_at": at("00:00:00"),
            "ended_at": at("00:00:40"),
            "incidents": [
                {
                    "number": 1,
                    "fault": {
                        "kind": "node_down",
                        "nodes": ["node-2"],
                        "incarnation": 0,
                        "occurred_at": at("00:00:10"),
                        "detected_at": at("00:00:10.050"),
                        "step": 15,
                        "reason": "backend reports node node-2 dead",
                    },
                    "stages": {name: {"started_at": at(a), "ended_at": at(b)} for name, (a, b) in stages.items()},
                    "decision": {
                        "action": "replace",
                        "nodes": new["nodes"],
                        "replacements": {"node-2": "node-4"},
                        "layout": layout,
                        "reason": "hot spare replaces lost node, world size 4 kept (node-2 -> node-4)",
                    },
                    "old_assignment": old,
                    "new_assignment": new,
                    "resumed_from_step": 10,
                    "lost_steps": 5,
                    "first_step_at": at("00:00:11"),
                    "outcome": "recovered",
                }
            ],
        }
    )


def run_script(script: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_the_guard_lets_only_the_document_reach_stdout():
    script = (
        NOISE
        + """
from lazarus.console import stdout_reserved_for_json

with stdout_reserved_for_json() as emit:
    noise()
    emit({"answer": 42})
    try:
        emit({"second": True})
    except RuntimeError as error:
        print(f"refused: {error}", file=sys.stderr)
print("after the guard")
"""
    )
    done = run_script(script)
    assert done.returncode == 0, done.stderr
    assert done.stdout == json.dumps({"answer": 42}, indent=2) + "\nafter the guard\n"
    for line in NOISE_LINES:
        assert line in done.stderr
    assert "refused: stdout carries one JSON document" in done.stderr


# Each --json command, run by lazarus.cli.main with what it calls replaced by a fake that makes noise
# on stdout (a print, a write to fd 1 as the Temporal core did, a child process) before answering.
PATCHES = {
    "status": """
import lazarus.commands.runs as runs
async def connect_client(settings): return None
async def fetch_status(client, run_id, home=None):
    from lazarus.client.reading import StatusReading
    noise()
    return StatusReading(STATUS, "a test's fake", served=True)
runs.connect_client, runs.fetch_status = connect_client, fetch_status
""",
    "demo": """
import lazarus.commands.demo_run
async def run_demo(settings, spec, kill_at, as_json=False):
    noise()
    return STATUS
lazarus.commands.demo_run.run_demo = run_demo
""",
    "simulate": """
import lazarus.planner.simulate
real_plan = lazarus.planner.simulate.plan
def plan(*args, **kwargs):
    noise()
    return real_plan(*args, **kwargs)
lazarus.planner.simulate.plan = plan
""",
}
SCENARIO = (
    "name: small\ngpus: 128\ngpus_per_node: 8\ntp: 8\npp: 2\ndp: 8\ndays: 5\nspare_nodes: 2\n"
    "failures: {interruptions_per_day: 5}\nrepetitions: 4\n"
)


@pytest.mark.parametrize(
    "patch, argv",
    [
        ("status", ["run", "status", "small-20260101-000000", "--json"]),
        ("status", ["run", "report", "small-20260101-000000", "--json"]),
        ("demo", ["demo", "--json"]),
        ("simulate", ["simulate", "SCENARIO", "--json"]),
    ],
    ids=["run status", "run report", "demo", "simulate"],
)
def test_every_json_command_prints_one_document_whatever_writes_to_stdout(tmp_path, patch, argv):
    scenario = tmp_path / "small.yaml"
    scenario.write_text(SCENARIO)
    argv = [str(scenario) if arg == "SCENARIO" else arg for arg in argv]
    status = recovered_run()
    script = (
        NOISE
        + "from lazarus.schema.records import RunStatus\nSTATUS = RunStatus.model_validate_json(sys.argv[1])\n"
        + PATCHES[patch]
        + "from lazarus.cli import main\nmain(sys.argv[2:])\n"
    )
    done = run_script(script, status.model_dump_json(), *argv, env={"LAZARUS_HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)  # the whole of stdout: one document, nothing before or after it
    for line in NOISE_LINES:
        assert line in done.stderr
    read = {"read_from": "a test's fake", "worker_serving": True}  # where the fake says it read
    if argv[:2] == ["run", "report"]:
        assert document == summarize(status) | read
    elif patch == "simulate":
        assert [p["name"] for p in document["policies"]] == ["automatic", "survivors", "reshard-only", "wait-for-human"]
    elif patch == "status":
        assert document == status.summary() | read | {"note": ""}
    else:
        assert document == status.summary()


def test_status_piped_is_plain_text_at_a_readable_width(tmp_path):
    script = (
        NOISE
        + "from lazarus.schema.records import RunStatus\nSTATUS = RunStatus.model_validate_json(sys.argv[1])\n"
        + PATCHES["status"]
        + "from lazarus.cli import main\nmain(sys.argv[2:])\n"
    )
    # FORCE_COLOR asks rich for escape codes even in a pipe; what goes to a pipe stays plain anyway.
    done = run_script(
        script, recovered_run().model_dump_json(), "run", "status", "small-20260101-000000", env={"FORCE_COLOR": "1"}
    )
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout
    assert "Incident 1: node_down on node-2 at step 15 (backend reports node node-2 dead)" in done.stdout
    assert "decision: hot spare replaces lost node, world size 4 kept (node-2 -> node-4)" in done.stdout
    assert max(len(line) for line in done.stdout.splitlines()) <= 120


def render(renderable) -> str:
    console = Console(file=io.StringIO(), force_terminal=False, width=120, markup=False, soft_wrap=True)
    console.print(renderable)
    return console.file.getvalue()


def test_status_shows_state_nodes_and_each_stage():
    text = render(status_view(recovered_run()))
    assert "COMPLETED" in text and "60/60" in text and "dp=4 (1 rank(s) per node)" in text
    assert "1 on node-0, node-1, node-4, node-3" in text
    rows = {cells[0]: cells[1] for cells in map(str.split, text.splitlines()) if len(cells) > 1}
    assert rows["detect"] == "0.05" and rows["resume"] == "0.80" and rows["MTTR"] == "1.00"
    assert "resumed from step 10, lost 5 step(s); outcome: recovered" in text


def test_an_incident_says_where_its_state_came_from():
    status = recovered_run()
    incident = status.incidents[0]
    incident.restored_from, incident.resumed_from_step, incident.lost_steps = "survivors", 15, 0
    assert "resumed from step 15 (survivors), lost 0 step(s); outcome: recovered" in render(status_view(status))


def test_an_incident_kept_in_process_says_how_long_survivors_and_new_ranks_stalled():
    status = recovered_run()
    incident = status.incidents[0]
    incident.restored_from, incident.resumed_from_step, incident.lost_steps = "in_process", 15, 0
    incident.stalls = {0: 0.21, 1: 0.23, 2: 0.25, 3: 0.22}  # rank 2 was on node-2, the lost node
    text = render(status_view(status))
    assert "resumed from step 15 (in_process), lost 0 step(s)" in text
    assert "stalls (fault to each rank's next step): survivors up to 0.23 s, new ranks 0.25 s" in text


def test_report_shows_ettr_and_where_the_time_went():
    status = recovered_run()
    summary = summarize(status)
    text = render(run_report(status, summary))
    assert f"ETTR {summary['ettr']:.1%}" in text
    assert "recomputed steps (5)" in text and "Incident 1: node_down" in text


def test_a_script_that_reports_no_steps_gets_no_made_up_restart_point_and_an_upper_bound_ettr():
    status = recovered_run()
    status.step = status.steps_from = None
    incident = status.incidents[0]
    incident.fault.step = incident.resumed_from_step = incident.lost_steps = None
    summary = summarize(status)
    text = render(run_report(status, summary))
    assert summary["lost_steps"] is None and summary["ettr_upper_bound"]
    assert f"ETTR at most {summary['ettr']:.1%} (the work lost at recoveries is unknown" in text
    assert "restart point unknown (the script reports no steps), lost work unknown" in text
    assert "own snapshot" not in text
    assert not summarize(recovered_run())["ettr_upper_bound"]


def test_a_script_whose_steps_are_read_from_its_output_is_never_said_to_report_none():
    status = recovered_run()
    status.steps_from, status.step = "output", 1
    incident = status.incidents[0]
    incident.fault.step, incident.resumed_from_step, incident.lost_steps = 1, None, None
    text = render(run_report(status, summarize(status)))
    assert "reports no steps" not in text
    assert "restart point unknown (no step was read after the restart), lost work unknown" in text
    assert "(the work lost at recoveries is unknown: a restart's point was not seen)" in text


@pytest.mark.parametrize("end, code", [(RunState.COMPLETED, 0), (RunState.FAILED, 1)])
def test_watch_follows_a_run_until_it_ends(end, code):
    done = recovered_run()
    before = done.model_copy(update={"state": RunState.TRAINING, "step": 12, "incidents": []})
    recovering = done.model_copy(update={"state": RunState.RESUMING, "step": 15})
    final = done.model_copy(update={"state": end, "reason": "" if end == RunState.COMPLETED else "no capacity"})
    statuses = iter([before, before, recovering, final])

    async def current():
        return next(statuses)

    console = Console(file=io.StringIO(), force_terminal=False, width=120)
    assert asyncio.run(follow(current, console, poll_seconds=0)) == code
    text = console.file.getvalue()
    assert text.count("TRAINING at step 12/60") == 1
    assert "incident 1: node_down on node-2 at step 15" in text
    assert text.rstrip().endswith("COMPLETED at step 60/60" if code == 0 else "FAILED at step 60/60: no capacity")
    assert text.count("COMPLETED" if code == 0 else "FAILED") == 2  # the bar's last state, then the end


def test_the_temporal_core_logs_to_python_logging_not_stdout():
    script = """
    import asyncio, logging, sys, time
    from temporalio.client import Client
    from temporalio.runtime import Runtime, TelemetryFilter
    from lazarus.client.runs import CORE_LOG_FILTER, CORE_LOGGER, core_telemetry

    forwarding = core_telemetry().logging
    assert forwarding.filter == CORE_LOG_FILTER and forwarding.forwarding.logger is CORE_LOGGER

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    CORE_LOGGER.addHandler(handler)
    CORE_LOGGER.setLevel(logging.DEBUG)
    # The same forwarding at DEBUG: a refused connection makes the core log (at WARN it stays quiet).
    runtime = Runtime(telemetry=core_telemetry(TelemetryFilter(core_level="DEBUG", other_level="DEBUG")))

    async def connect():
        try:
            await Client.connect("127.0.0.1:1", runtime=runtime)
        except RuntimeError:
            pass
        deadline = time.monotonic() + 10
        while not records and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    asyncio.run(connect())
    print(len(records), records[0].getMessage() if records else "", file=sys.stderr)
    """
    done = run_script(script)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    count, _, message = done.stderr.strip().splitlines()[-1].partition(" ")
    assert int(count) > 0 and message.startswith("[sdk_core::")


async def test_every_client_uses_the_forwarding_runtime(monkeypatch):
    from lazarus.client import runs as lazarus_client
    from lazarus.client.config import Settings

    seen = {}

    async def connect(address, **options):
        seen.update(options)

    monkeypatch.setattr(lazarus_client.Client, "connect", connect)
    await lazarus_client.connect(Settings(address="127.0.0.1:1"))
    assert seen["runtime"] is lazarus_client.core_runtime()
