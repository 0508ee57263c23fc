"""`lazarus demo`: a real run on the local backend loses a node and comes back on its own."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import time
import uuid
from datetime import datetime
from pathlib import Path

from temporalio.client import WorkflowFailureError

from lazarus import console
from lazarus.client.config import Settings
from lazarus.client.runs import run_status, start_run
from lazarus.commands.common import connect_client, local_cluster
from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.infra.harness.temporal_server import foreign_dev_server, port_answers, split_address, start_detached
from lazarus.schema.contract import MetricsLine, read_metrics
from lazarus.schema.records import RunState, RunStatus
from lazarus.schema.run import RunSpec
from lazarus.schema.rundir import RunDir
from lazarus.worker import build_worker

DEFAULT_SPEC = Path(__file__).resolve().parents[2] / "examples" / "demo.yaml"


class DemoError(RuntimeError):
    """The demo cannot run as asked (a message for the user, not a traceback)."""


def default_kill_step(spec: RunSpec) -> int:
    """Mid-run and between two checkpoints, so the recovery visibly loses and redoes steps."""
    every = spec.trainer.checkpoint_every
    step = (spec.trainer.steps // 2 // every) * every + max(1, every // 2)
    return min(step, spec.trainer.steps - 1)


def last_metric(run: RunDir) -> MetricsLine | None:
    """The newest complete line of rank 0's metrics.jsonl (None before the first step)."""
    lines = read_metrics(run)
    return lines[-1] if lines else None


async def ensure_server(settings: Settings, say) -> None:
    """Use the Temporal server at the configured address; start a local dev server if none answers."""
    host, port = split_address(settings.address)
    if port_answers(host, port):
        foreign = foreign_dev_server(settings.home, settings.address)
        if foreign:
            say(f"using the server that answers on {settings.address}; {foreign}")
        return
    if host not in ("127.0.0.1", "localhost"):
        raise DemoError(f"no Temporal server answers at {settings.address}; start it or unset LAZARUS_TEMPORAL_ADDRESS")
    say(f"starting the Temporal dev server on 127.0.0.1:{port} (web UI on :{port + 1000}, state in {settings.home})")
    pid = await asyncio.to_thread(start_detached, settings.home, port, port + 1000)
    say(f"  server pid {pid}; it stays up for the web UI; stop it with `lazarus server --stop`")


async def drive_run(
    client, settings: Settings, cluster: LocalCluster, spec: RunSpec, run_id: str, kill_at: int | None, say, kill=None
) -> RunStatus:
    """Start a run (a worker must serve settings.task_queue), follow it, kill a node at `kill_at`.

    `kill(run_id, node)` (async, returns the pids killed) does the killing; by default
    cluster.kill_node in a thread. Returns the final status; a failed run's status carries its reason.
    """
    run = cluster.run_dir(run_id)
    handle = await start_run(client, settings, spec, run_id)
    result = asyncio.ensure_future(handle.result())
    try:
        return await _follow(client, cluster, spec, run, run_id, result, kill_at, say, kill)
    finally:
        result.cancel()  # a demo cut short leaves no wait on the run behind


STAGE_STATES = {"drain": RunState.DRAINING, "reschedule": RunState.RESCHEDULING, "resume": RunState.RESUMING}
"""The state a run is in while an incident's stage runs (replace_or_reshard: by the decision)."""


def passed_states(status: RunStatus) -> list[tuple[int, RunState]]:
    """(incident, state) for every recovery state the run's incidents passed, in order, from the
    workflow's record of each stage: a poll of the status misses a state that lasts milliseconds."""
    passed = []
    for incident in status.incidents:
        for stage in incident.stages:
            if stage == "replace_or_reshard":
                reshard = incident.decision is not None and incident.decision.action == "reshard"
                passed.append((incident.number, RunState.RESHARDING if reshard else RunState.REPLACING))
            elif stage in STAGE_STATES:
                passed.append((incident.number, STAGE_STATES[stage]))
    return passed


async def _follow(client, cluster, spec, run, run_id, result, kill_at, say, kill) -> RunStatus:
    """Say the run's states and steps until `result` (its workflow's end) is done, killing at `kill_at`."""
    last_state, last_step, killed, said = None, 0, kill_at is None, 0
    report_every = max(10, spec.trainer.steps // 15 // 10 * 10)
    while not result.done():
        status = await run_status(client, run_id)
        metric = last_metric(run)
        step = metric.step if metric else 0
        passed = passed_states(status)
        for _, state in passed[said:]:
            if state != last_state:
                say(state.value)
            last_state = state
        said = len(passed)
        if status.state != last_state:
            say(status.state.value)
            last_state = status.state
        if metric and step != last_step and (step % report_every == 0 or step == spec.trainer.steps):
            say(f"  step {step}/{spec.trainer.steps}  loss {metric.loss:.4f}  incarnation {metric.incarnation}")
        last_step = step
        if not killed and status.state == RunState.TRAINING and step >= kill_at and status.assignment:
            node = status.assignment.nodes[len(status.assignment.nodes) // 2]
            # Not on this event loop: the worker shares it, and the chaos is not the controller's work.
            pids = await (kill(run_id, node) if kill else asyncio.to_thread(cluster.kill_node, run_id, node))
            say(f"chaos: killed {node} at step {step} (SIGKILL to pid {', '.join(map(str, pids))})")
            killed = True
        await asyncio.wait([result], timeout=0.05)
    try:
        return await result
    except WorkflowFailureError:
        return await run_status(client, run_id)


ABANDON_SECONDS = 5.0
"""How long the demo waits for the server to terminate the run it leaves (seconds): a server that
cannot answer (the error that ended the demo) must not hold the demo's end up."""


async def abandon(client, cluster: LocalCluster, run_id: str) -> None:
    """End a demo's run that the demo itself is leaving (Ctrl-C, a closed pipe, an error): the
    demo's worker goes with it, so the run would otherwise wait for a worker forever and its
    ranks would train for no one. The workflow is terminated (waited for ABANDON_SECONDS at most),
    then every process of the run ends."""
    terminate = client.get_workflow_handle(run_id).terminate(reason="the demo that drove this run was interrupted")
    try:
        await asyncio.wait_for(terminate, ABANDON_SECONDS)
    except Exception:  # noqa: BLE001 - the run may have ended, or never started, or the server is down
        pass
    await asyncio.to_thread(cluster.stop_run, run_id)


async def run_demo(settings: Settings, spec: RunSpec, kill_at: int | None, as_json: bool = False) -> RunStatus:
    """Run the demo, saying what happens (on stderr with `as_json`, so that stdout stays for the
    result); returns the run's final status."""
    out = console.stderr if as_json else console.stdout
    started = time.monotonic()

    def say(message: str) -> None:
        out.print(f"[{time.monotonic() - started:6.1f}s] {message}")

    if kill_at is not None and not 1 <= kill_at < spec.trainer.steps:
        raise DemoError(
            f"--kill-at-step {kill_at} must be between 1 and {spec.trainer.steps - 1} "
            f"(the run trains {spec.trainer.steps} steps)"
        )
    if kill_at is not None and spec.cluster.spare_nodes < 1:
        say("note: no hot spare in this spec; after the kill the run waits for capacity, then fails")

    await ensure_server(settings, say)
    client = await connect_client(settings)
    cluster = local_cluster(settings)
    run_id = f"{spec.name}-{datetime.now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:4]}"
    # A queue of its own: a `lazarus worker` elsewhere may use another LAZARUS_HOME.
    settings = dataclasses.replace(settings, task_queue=f"{settings.task_queue}-demo-{uuid.uuid4().hex[:8]}")

    say(
        f"run {run_id}: {spec.cluster.active_nodes} active nodes + {spec.cluster.spare_nodes} hot spare(s), "
        f"dp={spec.layout.dp}, {spec.trainer.steps} steps, checkpoint every {spec.trainer.checkpoint_every}"
    )
    say(f"web UI: {settings.workflow_url(run_id)}")
    # SIGTERM ends the demo as Ctrl-C does: the run goes with it (abandon), then the CLI exits 130.
    loop, demo_task, terminated = asyncio.get_running_loop(), asyncio.current_task(), []
    assert demo_task is not None, "a coroutine runs in a task"
    loop.add_signal_handler(signal.SIGTERM, lambda: (terminated.append(True), demo_task.cancel()))
    try:
        async with build_worker(client, settings.task_queue, cluster):
            final = await drive_run(client, settings, cluster, spec, run_id, kill_at, say)
    except BaseException as error:
        # After the worker's shutdown: an activity still at work (a launch) could start processes.
        stopped = (
            "interrupted" if isinstance(error, KeyboardInterrupt | asyncio.CancelledError) else "stopped by an error"
        )
        say(f"{stopped}: terminating the run and ending its processes")
        await abandon(client, cluster, run_id)
        if terminated:
            raise KeyboardInterrupt from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
    if final.state == RunState.FAILED:
        say(f"run FAILED: {final.reason}")
    return final
