"""How an activity runs its work: blocking backend calls in a thread that heartbeats, and each
successful attempt timed into its stage's histogram and spans (activities/metrics.py)."""

from __future__ import annotations

import asyncio
import functools
import time

from temporalio import activity

from lazarus.activities.metrics import Span


def timed(stage: str):
    """Record the duration of each successful attempt in the stage histogram, and its span."""

    def wrap(method):
        @functools.wraps(method)
        async def run(self, request):
            started, wall = time.monotonic(), time.time()
            result = await method(self, request)
            self.metrics.stage_seconds.labels(stage).observe(time.monotonic() - started)
            info = activity.info()
            self.metrics.spans.append(Span(info.workflow_id, stage, info.attempt, wall, time.time()))
            return result

        return run

    return wrap


async def in_thread(call, *args):
    """Run a blocking backend call in a thread, heartbeating while it runs, so that a call that
    outlasts the activity's heartbeat timeout (a drain waiting for pods to go) is not taken for
    a lost worker."""
    timeout = activity.info().heartbeat_timeout
    every = timeout.total_seconds() / 3 if timeout else None
    task = asyncio.ensure_future(asyncio.to_thread(call, *args))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=every)
            if done:
                return task.result()
            activity.heartbeat()
    finally:
        task.cancel()  # on cancellation: the thread runs on, its result is dropped
