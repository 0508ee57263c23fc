"""The Lazarus worker: the TrainingRun workflow and the recovery activities on one task queue, the
runs' watches on its watch queue."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from datetime import timedelta

from prometheus_client import start_http_server
from temporalio.client import Client
from temporalio.worker import UnsandboxedWorkflowRunner, Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner

from lazarus.activities.failpoints import Failpoints
from lazarus.activities.metrics import Metrics
from lazarus.activities.recovery import RecoveryActivities
from lazarus.infra.backend import ClusterBackend
from lazarus.schema.records import RunState
from lazarus.workflows.training_run import TrainingRun
from lazarus.workflows.watch import watch_queue

MAX_CONCURRENT_WATCHES = 10_000
"""Watches (detect activities, on the watch queue) one worker holds at once: one per run it watches,
for as long as the run trains; past it, a run's watch waits for another worker."""
WATCH_STARTS_PER_SECOND = 50.0
"""Watches one worker takes from the server a second at most. A task is the worker's, and its
heartbeat timer runs, from the moment it is taken; the SDK starts them one at a time on the event
loop, so a burst's thousand new watches taken at once would start seconds late and time out. At
this pace they wait in the server instead, where no timer runs (bench/controller_scale.py:
lazarus_activity_start_lag_seconds)."""
MAX_CONCURRENT_STAGES = 100
"""Recovery activities other than the watch (launch, resume, stop, release, take_over...) one worker
runs at once: about what it can start within their heartbeat timeout. A burst's thousand resumes
handed to one worker at once started seconds late and failed their heartbeat timeout
(bench/controller_scale.py --runs 1000: 3,088 of 3,209 attempts started over 5 s late, and 77 runs
failed, with 2,000 slots; with 100, 117 of 1,100, each retried, and none failed; 50 slots and 25
starts a second, 50 of 1,050 but the burst took half as long again). The ones beyond wait in the
server's task queue, where waiting costs nothing and counts against no timeout."""
MAX_CONCURRENT_RECOVERIES = 100
"""Workflow tasks and local activities one worker runs at once: its admission control. A
recovery's drain, reschedule and replace_or_reshard are local activities in one workflow task,
which holds a slot of each while they run; the recoveries of a burst beyond this wait in the
server's task queue, where waiting costs nothing and counts against no timeout. A thousand at
once on one worker (bench/controller_scale.py --runs 1000) starved every heartbeat: 37 of 1,000
runs recovered in 380 s with 2,000 slots, 705 with 100."""


class QueueWorkers:
    """The workers of one task queue, started and stopped together: one for TrainingRun and its
    stages on the queue, one for the watches (detect) on its watch queue (workflows/watch.py)."""

    def __init__(self, *workers: Worker):
        self.workers = workers

    async def __aenter__(self) -> QueueWorkers:
        for worker in self.workers:
            await worker.__aenter__()
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.gather(*(worker.__aexit__(*exc) for worker in self.workers))


def queue_workers(client: Client, task_queue: str, activities: list, workflows: list | None = None, **options):
    """Workers of `task_queue` for `workflows` and `activities`, the watch (the activity named detect)
    on the watch queue: what runs TrainingRun, whatever its activities (the real ones, or a test's).
    `options` go to both workers (Temporal's Worker arguments)."""
    watches = [fn for fn in activities if _activity_name(fn) == "detect"]
    stage_options = {"max_concurrent_activities": MAX_CONCURRENT_STAGES, **options}
    watch_options = {
        "max_concurrent_activities": MAX_CONCURRENT_WATCHES,
        "max_activities_per_second": WATCH_STARTS_PER_SECOND,
        **{k: v for k, v in options.items() if k not in ("workflow_runner", "max_concurrent_activities")},
    }
    return QueueWorkers(
        Worker(client, task_queue=task_queue, workflows=workflows or [], activities=activities, **stage_options),
        Worker(client, task_queue=watch_queue(task_queue), activities=watches, **watch_options),
    )


def _activity_name(fn) -> str | None:
    definition = getattr(fn, "__temporal_activity_definition", None)
    return getattr(definition, "name", None)


def build_worker(
    client: Client,
    task_queue: str,
    cluster: ClusterBackend,
    failpoints: Failpoints | None = None,
    metrics: Metrics | None = None,
    sandboxed: bool = False,
) -> QueueWorkers:
    """Workers that run TrainingRun and the activities over `cluster` (LocalCluster or KubernetesCluster):
    the workflow and its stages on `task_queue`, the watches on its watch queue (queue_workers).

    Workflow code runs outside Temporal's sandbox unless `sandboxed`: the sandbox enters itself
    (an exec of a code string) for every activation and every payload it converts, which cost a
    fleet's worker about a fifth of its CPU in a burst of faults (bench/controller_scale.py).
    What the sandbox would catch, a non-deterministic call in workflow code, the workflow tests
    and the replay of recorded histories catch in CI, where workers keep the sandbox."""
    stages = RecoveryActivities(cluster, failpoints, metrics)
    return queue_workers(
        client,
        task_queue,
        stages.every(),
        workflows=[TrainingRun],
        workflow_runner=SandboxedWorkflowRunner() if sandboxed else UnsandboxedWorkflowRunner(),
        # Shutdown waits this long for running activities; detect is cancelled and retried elsewhere.
        graceful_shutdown_timeout=timedelta(seconds=2),
        max_concurrent_workflow_tasks=MAX_CONCURRENT_RECOVERIES,
        max_concurrent_local_activities=MAX_CONCURRENT_RECOVERIES,
        # After a worker dies, the run's next workflow task waits this long on the dead
        # worker's sticky queue before any worker may take it (SDK default: 10 s). A
        # controller crash mid-recovery should cost seconds, not tens of them.
        sticky_queue_schedule_to_start_timeout=timedelta(seconds=2),
    )


async def count_runs_by_state(client: Client, metrics: Metrics, every: float = 15.0) -> None:
    """Keep the runs-by-state gauge current from the LazarusState search attribute (visibility)."""
    while True:
        for state in RunState:
            try:
                count = await client.count_workflows(f"WorkflowType='TrainingRun' AND LazarusState='{state.value}'")
            except Exception:  # noqa: BLE001 - a namespace without the attribute: no gauge, no crash
                return
            metrics.runs.labels(state.value).set(count.count)
        await asyncio.sleep(every)


LOOP_LAG_TICK_SECONDS = 0.25
"""How often the worker times its own event loop (lazarus_loop_lag_seconds)."""


async def time_the_loop(metrics: Metrics) -> None:
    """Observe, every LOOP_LAG_TICK_SECONDS, how late the event loop woke this task: the lag every
    heartbeat and look of this worker suffers then."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + LOOP_LAG_TICK_SECONDS
        await asyncio.sleep(LOOP_LAG_TICK_SECONDS)
        metrics.loop_lag.observe(max(0.0, loop.time() - due))


def serve_metrics(port: int, metrics: Metrics, address: str = "127.0.0.1"):
    """Serve /metrics on address:port (Prometheus text format); returns the server (shutdown() stops it)."""
    server, _ = start_http_server(port, addr=address, registry=metrics.registry)
    return server


async def serve(workers: QueueWorkers, *helpers: asyncio.Task) -> None:
    """Run the workers until SIGINT or SIGTERM, then shut them down, and their helper tasks. A worker
    that fails first (its server stopped answering before it started) ends the others, and its error
    is raised; one still starting when the signal comes is cancelled, not waited for, as its server
    may be gone."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        await serve_until(stop, workers, *helpers)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


async def serve_until(stop: asyncio.Event, workers: QueueWorkers, *helpers: asyncio.Task) -> None:
    """`serve`, until `stop` is set."""
    # The workers' run() rather than `async with`: a worker failing while the others shut down
    # would cancel this task from inside their shutdown (the SDK's context manager does).
    runs = {worker: asyncio.ensure_future(worker.run()) for worker in workers.workers}
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([stopping, *runs.values()], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        for worker, run in runs.items():
            if not worker.is_running and not run.done():
                run.cancel()  # still checking its namespace with the server: nothing to shut down
        await asyncio.gather(*(worker.shutdown() for worker in runs if worker.is_running))
        ended = await asyncio.gather(*runs.values(), return_exceptions=True)
        for helper in helpers:
            helper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await helper
    failures = [e for e in ended if isinstance(e, BaseException) and not isinstance(e, asyncio.CancelledError)]
    if failures and not stop.is_set():
        raise failures[0]
    for failure in failures:
        logging.getLogger(__name__).warning("a worker ended with an error as it stopped: %s", failure)
