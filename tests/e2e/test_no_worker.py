"""With its worker gone, a run still answers `lazarus run status`, `run report --plot` and `run
list`: a closed run from its result, a training one from its history replayed by the CLI and the
step from its run directory; each says that no worker serves it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid

import pytest

from lazarus.client.config import Settings
from lazarus.client.runs import start_run
from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.schema import RunSpec, RunState, load_spec
from lazarus.worker import build_worker
from lazarus.workflows.training_run import TrainingRun
from tests.support.runs import SMALL_SPEC, kill_rank_processes, trained_step
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def lazarus(env, home, *args: str) -> subprocess.CompletedProcess:
    """The CLI, as an operator runs it against the test's server and home."""
    environ = {**os.environ, "LAZARUS_TEMPORAL_ADDRESS": env.client.service_client.config.target_host}
    environ["LAZARUS_HOME"], environ["COLUMNS"] = str(home), "200"
    # The worker is gone: its queue still counts as polled for a while, and a status would wait out the
    # query's 3 s on every call. What is tested is the answer, not that wait.
    environ["LAZARUS_QUERY_SECONDS"] = "0.5"
    done = subprocess.run(
        [sys.executable, "-m", "lazarus.cli", *args], capture_output=True, text=True, timeout=120, env=environ
    )
    assert done.returncode == 0, done.stderr
    return done


def status_of(env, home, run_id: str) -> dict:
    return json.loads(lazarus(env, home, "run", "status", run_id, "--json").stdout)


def endless_spec():
    """The small spec, long enough to be training still when the worker is gone, with a safety
    interval past the test: the workflow hears no progress between faults."""
    spec = load_spec(SMALL_SPEC).model_dump()
    spec["trainer"]["steps"] = 100_000
    spec["recovery"]["progress_every_seconds"] = 3000
    spec["recovery"]["stages"]["detect"]["timeout_seconds"] = 6000
    return RunSpec.model_validate(spec)


async def kill_a_node_and_wait(cluster, run_id: str, then) -> None:
    """At step 12, kill the run's third node; return once `then()` holds."""
    run = cluster.run_dir(run_id)
    await asyncio.to_thread(wait_until, lambda: trained_step(run) >= 12, f"{run_id}: step 12", 120)
    cluster.kill_node(run_id, cluster.assignment(run_id, 0).nodes[2])
    await asyncio.to_thread(wait_until, then, f"{run_id} recovered", 120)


async def test_runs_answer_with_no_worker_closed_and_training_after_a_recovery(dev_env, home, tmp_path):
    cluster = LocalCluster(home)
    queue = f"nw-{uuid.uuid4().hex[:6]}"
    short_run, long_run = f"short-{uuid.uuid4().hex[:6]}", f"long-{uuid.uuid4().hex[:6]}"
    run = cluster.run_dir(long_run)
    async with build_worker(dev_env.client, queue, cluster):
        settings = Settings(task_queue=queue)
        short_handle = await start_run(dev_env.client, settings, load_spec(SMALL_SPEC), short_run)
        await kill_a_node_and_wait(cluster, short_run, lambda: True)
        closed = await short_handle.result()
        long_handle = await start_run(dev_env.client, settings, endless_spec(), long_run)
        await kill_a_node_and_wait(cluster, long_run, lambda: trained_step(run) >= 25 and len(run.incarnations()) == 2)
        served = await long_handle.query(TrainingRun.status)
    assert closed.state == RunState.COMPLETED and closed.incidents[0].outcome == "recovered"
    assert served.state == RunState.TRAINING and served.incidents[0].outcome == "recovered"

    # The worker is gone; the long run's ranks train on.
    at_stop = trained_step(run)
    await asyncio.to_thread(wait_until, lambda: trained_step(run) > at_stop + 5, "training on", 60)
    status = status_of(dev_env, home, long_run)
    assert status["worker_serving"] is False and status["note"].startswith("no worker")
    assert status["read_from"] == "the workflow's history, replayed here"
    assert status["state"] == "TRAINING" and status["assignment"]["incarnation"] == 1
    assert status["incidents"] == [json.loads(json.dumps(served.incidents[0].summary()))]
    # The step: the ranks' own, read from the run directory, past where they were when the worker went.
    assert status["step"] > at_stop + 5 and "run directory" in status["note"]

    plot = tmp_path / "timeline.png"
    report = lazarus(dev_env, home, "run", "report", long_run, "--plot", str(plot)).stdout
    assert plot.stat().st_size > 10_000 and "replayed here" in report and "no worker" in report

    status = status_of(dev_env, home, short_run)
    assert status["read_from"].startswith("the workflow's result") and status["state"] == "COMPLETED"
    assert status["incidents"] == [json.loads(json.dumps(closed.incidents[0].summary()))]
    text = lazarus(dev_env, home, "run", "status", short_run).stdout
    assert "COMPLETED" in text and "the workflow's result" in text

    listing = lazarus(dev_env, home, "run", "list").stdout
    rows = {line.split()[0]: line.split() for line in listing.splitlines() if line.split()}
    assert rows[long_run][1:3] == ["running", "TRAINING"] and rows[long_run][4] == "none"
    assert rows[short_run][1:3] == ["completed", "COMPLETED"] and rows[short_run][4] == "-"
    assert f"No worker is serving task queue '{queue}'" in " ".join(listing.split())
    await long_handle.terminate("test over")

    # Terminated from outside while its ranks train on: the state stays, and the note says that no
    # one recovers them and how to take them up.
    status = status_of(dev_env, home, long_run)
    assert status["state"] == "TRAINING" and "the workflow was terminated (" in status["note"]
    assert f"lazarus run adopt {long_run}" in status["note"] and status["step"] > at_stop + 5

    # Once its ranks are gone too (as after a launch stopped by a signal), the run is over although
    # its history stops in TRAINING: it reads ABORTED, with how it ended and where it stood.
    kill_rank_processes(home)
    await asyncio.to_thread(
        wait_until, lambda: status_of(dev_env, home, long_run)["state"] == "ABORTED", "ABORTED once quiet", 60
    )
    status = status_of(dev_env, home, long_run)
    assert status["ended_at"] is not None
    assert status["reason"].startswith("the workflow was terminated (") and status["reason"].endswith(
        ": test over) while the run was TRAINING"
    )
    assert status["read_from"] == "the workflow's history, replayed here (the run is terminated)"
    text = lazarus(dev_env, home, "run", "status", long_run).stdout
    [state_row] = [line for line in text.splitlines() if line.startswith("state")]
    assert state_row.split() == ["state", "ABORTED"] and "test over) while the run was TRAINING" in text
    report = lazarus(dev_env, home, "run", "report", long_run).stdout
    assert "ABORTED" in report and "test over) while the run was TRAINING" in report
