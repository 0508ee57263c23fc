"""With no worker serving its run (a `lazarus launch` that died took its worker along), `lazarus run
status`, `pause` and `abort` answer or refuse within ANSWER_SECONDS instead of waiting for a worker
forever: a status from the run's history, a pause refused in one line that says how to start a
worker, and an abort that terminates the workflow and stops every process of the run."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid

import pytest
from temporalio.client import WorkflowExecutionStatus

from lazarus.client.config import Settings
from lazarus.client.runs import start_run
from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.schema import RunSpec, load_spec
from lazarus.worker import build_worker
from tests.support.runs import SMALL_SPEC, trained_step, with_absolute_command
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ANSWER_SECONDS = 30
"""A command on a run no worker serves that has not answered within this hangs (users ask for an
answer within 10 s; it took 0.5 to 6.1 s here, so a loaded CI machine gets room, and a hang still
fails the test)."""


def lazarus(env, home, *args: str, timeout: float = ANSWER_SECONDS) -> tuple[int, list[str]]:
    """The CLI as an operator runs it; its exit status and its output (stdout and stderr) as lines.
    A command still running after `timeout` seconds is killed and fails the test (TimeoutExpired)."""
    environ = {**os.environ, "LAZARUS_TEMPORAL_ADDRESS": env.client.service_client.config.target_host}
    environ["LAZARUS_HOME"], environ["COLUMNS"] = str(home), "200"
    # The worker is gone: its queue still counts as polled for a while, and a status would wait out the
    # query's 3 s on every call. What is tested is the answer, not that wait.
    environ["LAZARUS_QUERY_SECONDS"] = "0.5"
    done = subprocess.run(
        [sys.executable, "-m", "lazarus.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        env=environ,
    )
    return done.returncode, done.stdout.splitlines()


def long_spec() -> RunSpec:
    """The small spec on two nodes (two ranks, not four, on a machine of two cores that the CLI's
    commands share with them), long enough to be training still when its worker is gone."""
    spec = with_absolute_command(load_spec(SMALL_SPEC)).model_dump()
    spec["trainer"]["steps"] = 100_000
    spec["layout"]["dp"], spec["cluster"]["active_nodes"] = 2, 2
    return RunSpec.model_validate(spec)


def one_line(answer: tuple[int, list[str]], code: int, start: str) -> str:
    """The answer's only line, after checking its exit status and how the line starts."""
    status, lines = answer
    assert status == code and len(lines) == 1, answer
    assert lines[0].startswith(start) and "Traceback" not in lines[0], answer
    return lines[0]


async def test_a_run_no_worker_ever_took_up(dev_env, home):
    queue, run_id = f"nobody-{uuid.uuid4().hex[:6]}", f"unserved-{uuid.uuid4().hex[:6]}"
    handle = await start_run(dev_env.client, Settings(task_queue=queue), long_spec(), run_id)

    code, lines = lazarus(dev_env, home, "run", "status", run_id)
    assert code == 0 and "no worker" in " ".join(lines), lines
    refusal = one_line(
        lazarus(dev_env, home, "run", "pause", run_id),
        2,
        f"lazarus: error: pause refused: no worker serves run {run_id}",
    )
    assert f"start one with `LAZARUS_TASK_QUEUE={queue} lazarus worker`" in refusal
    one_line(
        lazarus(dev_env, home, "run", "reshard", run_id, "2"), 2, "lazarus: error: reshard refused: no worker serves"
    )

    one_line(lazarus(dev_env, home, "run", "abort", run_id), 0, f"aborted run {run_id}: no worker had taken it up")
    assert (await handle.describe()).status == WorkflowExecutionStatus.TERMINATED
    one_line(
        lazarus(dev_env, home, "run", "abort", run_id), 2, f"lazarus: error: abort refused: run {run_id} has ended"
    )


async def test_a_run_whose_worker_is_gone_is_aborted_with_its_ranks(dev_env, home):
    cluster = LocalCluster(home)
    queue, run_id = f"gone-{uuid.uuid4().hex[:6]}", f"orphan-{uuid.uuid4().hex[:6]}"
    run = cluster.run_dir(run_id)
    async with build_worker(dev_env.client, queue, cluster):
        handle = await start_run(dev_env.client, Settings(task_queue=queue), long_spec(), run_id)
        await asyncio.to_thread(wait_until, lambda: trained_step(run) >= 12, f"{run_id}: step 12", 120)
        # Served, the controls are carried out by the worker as before (in a thread: it shares this loop).
        served = await asyncio.to_thread(lazarus, dev_env, home, "run", "pause", run_id, timeout=120)
        assert one_line(served, 0, "paused at step ").endswith("(state PAUSED)")
        served = await asyncio.to_thread(lazarus, dev_env, home, "run", "resume", run_id, timeout=120)
        assert one_line(served, 0, "resumed").endswith("(state TRAINING)")
        paused_at = trained_step(run)
        await asyncio.to_thread(wait_until, lambda: trained_step(run) > paused_at, "training after the resume", 120)
    # The worker is gone (as with a `lazarus launch` that died); the ranks train on.
    at_stop = trained_step(run)
    await asyncio.to_thread(wait_until, lambda: trained_step(run) > at_stop, "training on", 60)
    assert cluster.live_pids(run_id)

    code, lines = lazarus(dev_env, home, "run", "status", run_id)
    assert code == 0 and "TRAINING" in " ".join(lines) and "no worker" in " ".join(lines), lines
    refusal = one_line(
        lazarus(dev_env, home, "run", "pause", run_id), 2, "lazarus: error: pause refused: no worker serves"
    )
    assert f"LAZARUS_TASK_QUEUE={queue} lazarus worker" in refusal
    one_line(
        lazarus(dev_env, home, "run", "drain-node", run_id, cluster.assignment(run_id, 0).nodes[0]),
        2,
        "lazarus: error: drain-node refused:",
    )

    aborted = one_line(
        lazarus(dev_env, home, "run", "abort", run_id, "--reason", "its launcher died"), 0, f"aborted run {run_id}"
    )
    assert "every process of the run stopped; checkpoint step-" in aborted
    assert cluster.live_pids(run_id) == []
    description = await handle.describe()
    assert description.status == WorkflowExecutionStatus.TERMINATED
    code, lines = lazarus(dev_env, home, "run", "status", run_id)
    assert code == 0 and "terminated" in " ".join(lines), lines
