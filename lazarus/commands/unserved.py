"""A run that no worker serves (its `lazarus launch` or `lazarus worker` died): how the operator
controls find out within seconds instead of waiting for a worker forever, what they say, and how an
abort ends such a run without one.

A control never blocks on a missing worker: it asks the run's worker a status query first (a query
leaves nothing behind when it goes unanswered, unlike an update), bounds the wait for its update to
be accepted, and while the update is carried out it checks now and then that a worker still serves
the run.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from lazarus.client.config import Settings
from lazarus.commands.common import UserError, local_cluster, registered_backend

ACCEPT_SECONDS = 5.0
"""How long a control waits for a worker that answered to accept the update (seconds); past it,
the worker is taken to have gone in between."""

WATCH_SECONDS = 10.0
"""While a worker carries out an accepted request (a drain can take minutes), how often the control
checks that a worker still serves the run (seconds)."""


def start_worker_hint(task_queue: str, backend: str) -> str:
    """How to start a worker for a run on `task_queue` whose cluster is `backend`."""
    from lazarus.infra.registry import worker_flags

    return f"start one with `LAZARUS_TASK_QUEUE={task_queue} lazarus worker{worker_flags(backend)}`"


async def run_start(client, run_id: str):
    """The input of the run's (current) workflow run, and whether that workflow may have launched
    anything: it carries an earlier run's state, or its history holds an activity (read only as far
    as the first one)."""
    from temporalio.api.enums.v1 import EventType

    from lazarus.schema.records import RunStart

    start, launched = None, False
    async for event in client.get_workflow_handle(run_id).fetch_history_events():
        if start is None:
            payloads = event.workflow_execution_started_event_attributes.input.payloads
            [start] = await client.data_converter.decode(payloads, [RunStart])
            launched = start.carried is not None
        if launched or event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            return start, True
    assert start is not None, "a workflow's history begins with its start"
    return start, launched


async def why_unserved(client, run_id: str, task_queue: str) -> str | None:
    """None when a worker serves the run (it answered a status query within
    lazarus.client.reading.QUERY_SECONDS), else why not, in words."""
    from temporalio.client import WorkflowQueryFailedError

    from lazarus.client.reading import ask_worker

    try:
        answer, why = await ask_worker(client, run_id, task_queue)
    except WorkflowQueryFailedError:
        return None  # a worker took the query (and failed it): it is there to take the update
    return None if answer is not None else why


async def carried_out(update, client, run_id: str, task_queue: str):
    """The answer of an accepted update, awaited as long as a worker serves the run: (answer, "")
    or, when the worker goes before answering, (None, why). WorkflowUpdateFailedError when the
    workflow refused the request."""
    result = asyncio.ensure_future(update.result())
    try:
        while True:
            done, _ = await asyncio.wait([result], timeout=WATCH_SECONDS)
            if done:
                return result.result(), ""
            why = await why_unserved(client, run_id, task_queue)
            if why is not None and not result.done():
                return None, why
    finally:
        result.cancel()


async def without_worker(args, settings: Settings, client, task_queue: str, why: str, sent: str = "") -> str:
    """What a control does when no worker serves the run: an abort ends the run here (abort_here);
    any other control is refused with how to start a worker (UserError). `sent` says what became of
    an update already sent. Returns the line to print."""
    start, launched = await run_start(client, args.run_id)
    backend = start.spec.cluster.backend
    hint = start_worker_hint(task_queue, backend)
    if args.update == "abort":
        return await abort_here(client, settings, args, (backend, launched), why, hint)
    outcome = "not carried out" if sent else "refused"
    raise UserError(f"{args.run_command} {outcome}: no worker serves run {args.run_id} ({why}){sent}; {hint}")


async def abort_here(client, settings: Settings, args, started: tuple[str, bool], why: str, hint: str) -> str:
    """Abort a run that no worker serves, as `lazarus launch` ends one on Ctrl-C: terminate its
    workflow (so that no worker coming back restarts its ranks), then SIGKILL every process of the
    run through the local backend and give its nodes back to the pool. `started` is the run's
    backend and whether its workflow may have launched anything (run_start). Refused (UserError)
    when processes it may have are not on this machine to stop. Returns what was done, in one line."""
    from lazarus.infra.backend import ClusterError

    run_id, (backend, launched) = args.run_id, started
    cluster = local_cluster(settings)
    run = cluster.run_dir(run_id)
    on_this_machine = registered_backend(backend).shares_host
    here = on_this_machine and run.spec_file.exists()
    refused = f"abort refused: no worker serves run {run_id} ({why})"
    if launched and not on_this_machine:
        raise UserError(f"{refused} and only a worker stops its {backend} ranks; {hint}, then abort again")
    if launched and not here:
        raise UserError(
            f"{refused} and its run directory is not under LAZARUS_HOME ({settings.home}): set LAZARUS_HOME "
            f"to the run's to stop its processes from here, or {hint} and abort again"
        )
    await _terminate(client, run_id, args.reason)
    if not here:
        return f"aborted run {run_id}: no worker had taken it up ({why}), so its workflow was terminated"
    await asyncio.to_thread(cluster.stop_run, run_id)
    try:
        await asyncio.to_thread(cluster.release_nodes, run_id)
    except ClusterError:
        pass  # no pool record for the run: no node to give back
    steps = run.checkpoint_steps()
    kept = f"; checkpoint step-{steps[-1]} kept" if steps else ""
    return (
        f"aborted run {run_id}: no worker served it ({why}), so its workflow was terminated "
        f"and every process of the run stopped{kept}"
    )


async def _terminate(client, run_id: str, reason: str) -> None:
    """Terminate the run's workflow, recording why; a run that ended meanwhile is said in one line."""
    from temporalio.service import RPCError

    try:
        await client.get_workflow_handle(run_id).terminate(
            reason=f"aborted with no worker serving the run (lazarus run abort): {reason or 'no reason given'}"
        )
    except RPCError as error:
        raise UserError(f"abort: run {run_id}: {error.message}") from None


def accept_timeout() -> timedelta:
    """The RPC deadline of sending an update and waiting for its acceptance."""
    return timedelta(seconds=ACCEPT_SECONDS)
