"""Reading a run's status wherever it is kept, so that it answers when no worker serves the run
(a crashed controller, a demo's worker gone): the workflow itself when a worker answers, else its
result (a closed run) or its history replayed here with the workflow's own code; the step from the
pending detect's heartbeat details (kept by the server) or the run directory, whichever is newer.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from temporalio import workflow
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHistoryEventFilterType
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError
from temporalio.worker import (
    ExecuteWorkflowInput,
    Interceptor,
    Replayer,
    UnsandboxedWorkflowRunner,
    WorkflowInboundInterceptor,
    WorkflowInterceptorClassInput,
)

from lazarus.client.config import ENV_QUERY_SECONDS
from lazarus.schema.node_reports import read_node_reports
from lazarus.schema.records import RankProgress, RunStatus
from lazarus.schema.rundir import RunDir
from lazarus.schema.states import TERMINAL_STATES, RunState
from lazarus.workflows.progress import take_progress
from lazarus.workflows.training_run import TrainingRun

QUERY_SECONDS = 3.0
"""How long the status query waits for a worker to answer before the history is replayed instead
(seconds). A live worker answers in milliseconds; a worker that died moments ago still counts as
polling (POLLED_WITHIN_SECONDS), and this wait is what a status or a control costs then, out of the
10 s an operator is promised an answer in."""


def query_seconds(environ=os.environ) -> float:
    """LAZARUS_QUERY_SECONDS where set to a positive number of seconds, else QUERY_SECONDS (saying so
    on stderr for a value that is not one)."""
    value = environ.get(ENV_QUERY_SECONDS)
    if value is None:
        return QUERY_SECONDS
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if seconds > 0:
        return seconds
    print(
        f"lazarus: {ENV_QUERY_SECONDS}={value!r} is not a positive number of seconds; waiting {QUERY_SECONDS:g} s",
        file=sys.stderr,
    )
    return QUERY_SECONDS


POLLED_WITHIN_SECONDS = 90.0
"""A task queue counts as served when a worker polled it this recently (seconds): a worker's poll
is a long poll of up to a minute."""


@dataclass
class StatusReading:
    """A run's status and where it was read."""

    status: RunStatus
    source: str  # where the status came from, in words
    served: bool  # a worker answered for the run (a closed run needs none)
    note: str = ""  # what the reader should know: no worker serves the run, where the step came from

    def summary(self) -> dict:
        """The status as `run status --json` prints it, with where it was read."""
        return {**self.status.summary(), "read_from": self.source, "worker_serving": self.served, "note": self.note}


async def polled_recently(client: Client, task_queue: str) -> bool:
    """Whether a worker polled the task queue for workflow tasks within POLLED_WITHIN_SECONDS (one
    that has just gone still counts: ask_worker tells)."""
    request = DescribeTaskQueueRequest(
        namespace=client.namespace,
        task_queue=TaskQueue(name=task_queue),
        task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
    )
    response = await client.workflow_service.describe_task_queue(request)
    now = time.time()
    return any(now - poller.last_access_time.ToSeconds() < POLLED_WITHIN_SECONDS for poller in response.pollers)


async def read_status(client: Client, run_id: str, runs: Path | None = None) -> StatusReading:
    """The run's status: asked of its worker when one serves it, else read from its result or its
    history; the step overlaid with the newest one the server or the run directory holds.
    RPCError when there is no such run."""
    handle = client.get_workflow_handle(run_id, result_type=RunStatus)
    description = await handle.describe()
    task_queue = description.task_queue
    assert description.status is not None, "the server says how every workflow stands"
    if description.status == WorkflowExecutionStatus.COMPLETED:
        status = await handle.result()
        return StatusReading(status, "the workflow's result (the run is closed)", served=False)
    if description.status != WorkflowExecutionStatus.RUNNING:
        status = await replayed_status(client, run_id)
        closed = description.status.name.lower()
        reading = StatusReading(status, f"the workflow's history, replayed here (the run is {closed})", served=False)
        if status.state not in TERMINAL_STATES:
            await _ended_from_outside(client, handle, reading, closed, description.close_time, runs)
        return reading
    status, why = await ask_worker(client, run_id, task_queue)
    if status is not None:
        reading = StatusReading(status, f"the workflow (its worker on task queue {task_queue!r})", served=True)
    else:
        status = await replayed_status(client, run_id)
        reading = StatusReading(status, "the workflow's history, replayed here", served=False, note=why)
    await _overlay_step(reading, description, client, runs)
    return reading


RANKS_QUIET_FLOOR_SECONDS = 2.0
"""Ranks whose newest heartbeat is older than this (or three of the run's heartbeat intervals, if
longer) have stopped (seconds)."""


async def _ended_from_outside(
    client: Client, handle, reading: StatusReading, closed: str, close_time: datetime | None, runs: Path | None
) -> None:
    """A workflow ended by someone else (terminated, cancelled, timed out) stops where it stood, in a
    live state. Where its ranks still beat after it ended, they train on with no one to recover them,
    and the state stays, with a note that says so; else the run is over, and reads ABORTED, with how
    it ended and where it stood."""
    status = reading.status
    how = closed + await _termination_words(client, handle)
    progress = step_in_run_directory(status, runs)
    interval = status.policy.heartbeat_interval_seconds if status.policy is not None else 0.0
    quiet_after = max(RANKS_QUIET_FLOOR_SECONDS, 3 * interval)
    if (
        progress is not None
        and close_time is not None
        and progress.at > close_time
        and (datetime.now(UTC) - progress.at).total_seconds() < quiet_after
    ):
        take_progress(status, progress)
        reading.note = (
            f"the workflow was {how}, but the ranks train on with no one to recover them: "
            f"`lazarus run adopt {status.run_id}` takes them up"
        )
        return
    status.reason = f"the workflow was {how} while the run was {status.state.value}"
    status.state, status.ended_at = RunState.ABORTED, close_time


async def _termination_words(client: Client, handle) -> str:
    """What a termination said, in parentheses ("" for another ending): the server's reason and the
    terminating client's details."""
    async for event in handle.fetch_history_events(event_filter_type=WorkflowHistoryEventFilterType.CLOSE_EVENT):
        if event.HasField("workflow_execution_terminated_event_attributes"):
            ended = event.workflow_execution_terminated_event_attributes
            # What the client said comes as details; the reason is often the server's own words.
            said = await client.data_converter.decode(ended.details.payloads) if ended.details.payloads else []
            words = ": ".join(filter(None, [ended.reason, *(str(detail) for detail in said)]))
            return f" ({words})" if words else ""
    return ""


async def ask_worker(client: Client, run_id: str, task_queue: str) -> tuple[RunStatus | None, str]:
    """The running run's status as its worker answers the query; else None and why no worker did."""
    if not await polled_recently(client, task_queue):
        return None, f"no worker has polled task queue {task_queue!r} in the last {POLLED_WITHIN_SECONDS:g} s"
    handle = client.get_workflow_handle(run_id)
    try:
        timeout = timedelta(seconds=query_seconds())
        return await handle.query(TrainingRun.status, rpc_timeout=timeout), ""
    except RPCError as error:
        return None, f"no worker on task queue {task_queue!r} answered its status query ({error.message})"


async def _overlay_step(reading: StatusReading, description, client: Client, runs: Path | None) -> None:
    """Bring the step up to date: the workflow hears it only at a fault or its safety interval."""
    for pending in description.raw_description.pending_activities:
        if pending.activity_type.name == "detect" and pending.heartbeat_details.payloads:
            [progress] = await client.data_converter.decode(pending.heartbeat_details.payloads, [RankProgress])
            if isinstance(progress, RankProgress):
                take_progress(reading.status, progress)
    from_files = step_in_run_directory(reading.status, runs)
    if from_files is not None:
        before = reading.status.step
        take_progress(reading.status, from_files)
        if reading.status.step != before:
            reading.note = "; ".join(filter(None, [reading.note, "the step from the run directory"]))


def step_in_run_directory(status: RunStatus, runs: Path | None) -> RankProgress | None:
    """The step every rank of the current incarnation reported in its node's report, when the run
    directory is on this machine (`runs` is the folder of a local run's directory; a Kubernetes
    run's is its shared volume, at `status.run_dir`)."""
    if status.assignment is None:
        return None
    roots = [Path(status.run_dir)] if status.run_dir else []
    if runs is not None:
        roots.append(Path(runs) / status.run_id)
    root = next((root for root in roots if root.is_dir()), None)
    if root is None:
        return None
    nodes = range(len(status.assignment.nodes))
    readings = read_node_reports(RunDir(root), status.assignment.incarnation, nodes)
    summaries = [reading.summary for reading in readings.values() if reading.summary is not None]
    beats = [s.newest_beat for s in summaries if s.newest_beat is not None]
    steps = [s.lowest_step for s in summaries if s.lowest_step is not None]
    if not len(beats) == len(steps) == len(nodes):
        return None  # a node without a report, or ranks that report no step: nothing to say
    return RankProgress(step=min(steps), at=datetime.fromtimestamp(min(beats), UTC), source=status.steps_from)


async def replayed_status(client: Client, run_id: str) -> RunStatus:
    """The status the workflow holds at the end of its history (the current run of its chain),
    rebuilt by replaying that history here with TrainingRun's code: what a worker would answer."""
    return (await replayed_run(client, run_id)).status()


async def replayed_run(client: Client, run_id: str) -> TrainingRun:
    """The workflow as it stands at the end of its history (its input, its status), rebuilt by
    replaying that history here; RuntimeError when this version cannot replay it."""
    history = await client.get_workflow_handle(run_id).fetch_history()
    instances: list[TrainingRun] = []

    class Keep(WorkflowInboundInterceptor):
        async def execute_workflow(self, input: ExecuteWorkflowInput):
            instances.append(workflow.instance())
            return await super().execute_workflow(input)

    class KeepInstances(Interceptor):
        def workflow_interceptor_class(self, input: WorkflowInterceptorClassInput):
            return Keep

    replayer = Replayer(
        workflows=[TrainingRun],
        data_converter=pydantic_data_converter,
        interceptors=[KeepInstances()],
        workflow_runner=UnsandboxedWorkflowRunner(),
        runtime=client.service_client.config.runtime,
    )
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    if result.replay_failure is not None or not instances:
        failure = result.replay_failure
        raise RuntimeError(f"run {run_id}: its history does not replay with this version of Lazarus: {failure}")
    return instances[0]
