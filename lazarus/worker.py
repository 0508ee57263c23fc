"""The Lazarus worker: the TrainingRun workflow and the recovery activities on one task queue."""

from __future__ import annotations

import asyncio
import signal
from datetime import timedelta

from temporalio.client import Client
from temporalio.worker import Worker

from activities.failpoints import Failpoints
from activities.recovery import RecoveryActivities
from infra.local import LocalCluster
from workflows.training_run import TrainingRun


def build_worker(client: Client, task_queue: str, cluster: LocalCluster, failpoints: Failpoints | None = None) -> Worker:
    """A worker that runs TrainingRun and the activities over `cluster`."""
    stages = RecoveryActivities(cluster, failpoints)
    return Worker(
        client,
        task_queue=task_queue,
        workflows=[TrainingRun],
        activities=[stages.launch, stages.detect, stages.drain, stages.reschedule,
                    stages.replace_or_reshard, stages.resume],
        # Shutdown waits this long for running activities; detect is cancelled and retried elsewhere.
        graceful_shutdown_timeout=timedelta(seconds=2),
        # After a worker dies, the run's next workflow task waits this long on the dead
        # worker's sticky queue before any worker may take it (SDK default: 10 s). A
        # controller crash mid-recovery should cost seconds, not tens of them.
        sticky_queue_schedule_to_start_timeout=timedelta(seconds=2),
    )


async def serve(worker: Worker) -> None:
    """Run the worker until SIGINT or SIGTERM, then shut it down cleanly."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    async with worker:
        await stop.wait()
