"""How an activity runs its work: blocking backend calls in a thread that heartbeats, and each
successful attempt timed into its stage's histogram and spans (activities/metrics.py)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import dataclasses
import functools
import gc
import threading
import time

from temporalio import activity

from lazarus.activities.health import Verdict, judge
from lazarus.activities.metrics import Span
from lazarus.activities.pace import Pace


def timed(stage: str):
    """Record the duration of each successful attempt in the stage histogram, and its span."""

    def wrap(method):
        @functools.wraps(method)
        async def run(self, request):
            started, wall = time.monotonic(), time.time()
            observe_start_lag(self.metrics, stage, wall)
            result = await method(self, request)
            # A drain cut at its cap is counted once, by the call that finishes it.
            if getattr(result, "unfinished", None) is None:
                self.metrics.stage_seconds.labels(stage).observe(time.monotonic() - started)
            info = activity.info()
            self.metrics.spans.append(Span(info.workflow_id, stage, info.attempt, wall, time.time()))
            return result

        return run

    return wrap


def observe_start_lag(metrics, stage: str, now: float) -> None:
    """Record how long after the worker took the running activity's task its code started
    (lazarus_activity_start_lag_seconds); a local activity has no task taken, and is not counted."""
    info = activity.info()
    if not info.is_local:
        metrics.start_lag.labels(stage).observe(max(0.0, now - info.started_time.timestamp()))


THREADS_OF_STAGE: contextvars.ContextVar[list[threading.Event] | None] = contextvars.ContextVar(
    "threads_of_stage", default=None
)
"""Where a stage that acts on a run (activities/ownership.py) collects its threads' ends: a
cancelled stage's thread runs on, and the stage counts as acting until that thread ends."""


LAST_HEARTBEAT: contextvars.ContextVar[list[float] | None] = contextvars.ContextVar("last_heartbeat", default=None)
"""When the running activity last heartbeat (time.monotonic(), in a list the activity's calls share)."""


def heartbeat(*details) -> None:
    """Heartbeat the running activity, and remember when (since_heartbeat)."""
    held = LAST_HEARTBEAT.get()
    if held is None:
        LAST_HEARTBEAT.set(held := [0.0])
    held[0] = time.monotonic()
    activity.heartbeat(*details)


def since_heartbeat() -> float:
    """Seconds since the running activity last heartbeat through `heartbeat` (infinite before its
    first: an attempt that starts late in a busy worker beats at its first chance). One count for
    the whole attempt: a stage of several backend calls, each queued for less than its heartbeat
    spacing in a busy worker, would otherwise never beat (a 1,000-run burst failed resumes so)."""
    held = LAST_HEARTBEAT.get()
    return time.monotonic() - held[0] if held is not None else float("inf")


def heartbeat_spacing() -> float | None:
    """How often the running activity heartbeats: a third of its heartbeat timeout (seconds; None
    without a timeout)."""
    timeout = activity.info().heartbeat_timeout
    return timeout.total_seconds() / 3 if timeout else None


async def in_thread(call, *args):
    """Run a blocking backend call in a thread, heartbeating while it runs, so that a call that
    outlasts the activity's heartbeat timeout (a drain waiting for pods to go) is not taken for
    a lost worker."""
    every = heartbeat_spacing()
    ended, threads = threading.Event(), THREADS_OF_STAGE.get()
    if threads is not None:
        threads.append(ended)

    def run():
        try:
            return call(*args)
        finally:
            ended.set()

    task = asyncio.ensure_future(asyncio.to_thread(run))
    try:
        while True:
            wait = None if every is None else max(0.0, every - since_heartbeat())
            done, _ = await asyncio.wait({task}, timeout=wait)
            if done:
                return task.result()
            heartbeat()
    finally:
        task.cancel()  # on cancellation: the thread runs on, its result is dropped


LOOKS = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="look")
"""Where every watch of this worker takes its looks: apart from the stages' backend calls, so that a
burst's drains and claims never queue behind a fleet's routine looks, and without the heartbeating
wrapper of `in_thread` (a look at a small run takes well under a millisecond, less than that
wrapper costs). Two threads: one look held up (slurmctld slow to answer sinfo) does not hold up
every other run's."""


async def look_in_thread(*args) -> tuple[Verdict, float]:
    """`look(*args)` on the looks' thread."""
    return await asyncio.get_running_loop().run_in_executor(LOOKS, look, *args)


_collection_paused = threading.Lock()
_looks = 0  # looks under way, in any thread: the collector runs again when the last one ends


def look(
    cluster, run_id: str, incarnation: int, policy, last_poll: float, total_steps: int, pace: Pace | None = None
) -> tuple[Verdict, float]:
    """One look at an incarnation, as detect takes it: observe, then judge as of the time after
    the observation (a node that died while it was taken must not be seen before it died);
    returns the verdict and that time. `pace` carries what earlier looks learnt of the run's step
    times (the hang time derived from them) and each node's work (a straggler, while nothing failed).

    Python's cyclic garbage collector waits while looks run: a look at a run of 2,048 nodes makes
    about 100,000 short-lived objects, all freed by reference counting, and the collections they
    would trigger cost more than the look itself (bench/large_run.py)."""
    global _looks
    with _collection_paused:
        _looks += 1
        if _looks == 1:
            gc.disable()
    try:
        observation = cluster.observe(run_id, incarnation)
        now = time.time()
        paced = (pace.hang_after(), pace.quiet_after(), pace.still()) if pace is not None else (None, None, None)
        verdict = judge(observation, policy, now, last_poll, total_steps, *paced)
        if pace is not None and verdict.fault is None and not (verdict.completed or verdict.stopped):
            straggler = pace.observe(observation, verdict.step, now)
            if straggler is not None:
                verdict = dataclasses.replace(verdict, straggler=straggler)
        return verdict, now
    finally:
        with _collection_paused:
            _looks -= 1
            if _looks == 0:
                gc.enable()
