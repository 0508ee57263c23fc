"""Watching an incarnation from inside an activity: look every heartbeat interval (and at once when
a process exits) until the look shows what the caller waits for.

Detect returns to the workflow only when the workflow has something to do or record: a fault,
completion, a new warning, spares for a regrow, or the safety interval
(`recovery.progress_every_seconds`). Routine progress stays out of the history: every look's step
is in the activity's heartbeat details, which the server keeps for `lazarus run status` to read.
"""

from __future__ import annotations

import inspect
import time
from datetime import UTC, datetime

from temporalio import activity

from lazarus.activities.health import Verdict
from lazarus.activities.running import in_thread, look
from lazarus.infra.backend import ClusterBackend
from lazarus.schema.records import RankProgress
from lazarus.schema.stages import DetectInput

EXIT_SETTLE_SECONDS = 0.01
"""After a process exit woke the watch, how soon it looks again (seconds): the launcher is about to
record how the rank ended."""


def progress_of(verdict: Verdict, now: float) -> RankProgress:
    """What a look says of the run's progress: the activity's heartbeat details, and detect's report."""
    return RankProgress(
        step=verdict.step, at=datetime.fromtimestamp(now, UTC), source=verdict.source, warnings=verdict.warnings
    )


async def watch(
    cluster: ClusterBackend, run_id: str, incarnation: int, policy, total_steps: int, until=None
) -> tuple[Verdict, float]:
    """Look at the incarnation until judge finds a fault, completion or a stop, or `until(verdict,
    now)` (or what it awaits) holds; returns the verdict and the time of its look."""
    last_poll = time.time()
    exited = False
    while True:
        verdict, now = await in_thread(look, cluster, run_id, incarnation, policy, last_poll, total_steps)
        if verdict.fault is not None and verdict.fault.rank is not None:
            verdict.fault.log_tail = await in_thread(cluster.log_tail, run_id, incarnation, verdict.fault.rank)
        if verdict.completed:
            if verdict.lingering:  # stuck in their teardown past the exit grace: the run is done without them
                await in_thread(cluster.stop_incarnation, run_id, incarnation)
            await in_thread(cluster.release_standbys, run_id)
        if verdict.fault or verdict.completed or verdict.stopped:
            return verdict, now
        if until is not None:
            done = until(verdict, now)
            if inspect.isawaitable(done):
                done = await done
            if done:
                return verdict, now
        last_poll = now
        activity.heartbeat(progress_of(verdict, now))
        wait = EXIT_SETTLE_SECONDS if exited else policy.heartbeat_interval_seconds
        exited = await cluster.wait_for_exit(run_id, incarnation, wait)


class _ReportDue:
    """When detect's watch has something the workflow must hear: the safety interval is over, a
    warning it does not know appeared, or (when it asks) the pool has the spares for a regrow,
    read every `capacity_poll_seconds`."""

    def __init__(self, cluster: ClusterBackend, request: DetectInput):
        self.cluster, self.request = cluster, request
        started = time.time()
        self.report_at = started + request.policy.progress_every_seconds
        self.next_capacity_check = started  # at the first look
        self.capacity = False

    async def __call__(self, verdict: Verdict, now: float) -> bool:
        if now >= self.report_at or set(verdict.warnings) - set(self.request.known_warnings):
            return True
        if self.request.regrow_nodes is not None and now >= self.next_capacity_check:
            self.next_capacity_check = now + self.request.policy.capacity_poll_seconds
            self.capacity = await in_thread(self.has_capacity)
        return self.capacity

    def has_capacity(self) -> bool:
        """The pool has the spares a regrow needs, that no other run's recovery needs, within the run's quota."""
        inventory = self.cluster.inventory(self.request.run_id)
        spares, _ = inventory.spares_for(None, self.request.node_limit)
        return len(spares) >= self.request.regrow_nodes


async def watch_until_reported(cluster: ClusterBackend, request: DetectInput) -> tuple[Verdict, float, bool]:
    """Detect's watch: the verdict that ends it, the time of its look, and whether the pool has the
    spares the request asked about."""
    due = _ReportDue(cluster, request)
    verdict, now = await watch(
        cluster, request.run_id, request.incarnation, request.policy, request.total_steps, until=due
    )
    return verdict, now, due.capacity and verdict.fault is None and not verdict.completed
