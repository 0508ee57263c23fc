"""Liveness of the worker. An activity heartbeats on one count for its whole attempt: a stage
made of several backend calls, each shorter than the heartbeat spacing (queued in a busy worker's
threads), still heartbeats, where a count restarted by every call would never beat and time the
attempt out. The worker times its own event loop (lazarus_loop_lag_seconds)."""

from __future__ import annotations

import dataclasses
import threading
from datetime import timedelta

import pytest
from temporalio.testing import ActivityEnvironment

from lazarus.activities.running import heartbeat_spacing, in_thread


def environment(heartbeat_timeout: float) -> tuple[ActivityEnvironment, list]:
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, heartbeat_timeout=timedelta(seconds=heartbeat_timeout))
    beats: list = []
    env.on_heartbeat = lambda *details: beats.append(details)
    return env, beats


async def test_a_stage_of_short_calls_heartbeats_across_them():
    env, beats = environment(heartbeat_timeout=0.6)  # a beat every 0.2 s
    released = [threading.Event() for _ in range(6)]

    async def stage() -> int:
        assert heartbeat_spacing() == pytest.approx(0.2)
        for gate in released:
            # Each call ends once it has been waited on for 0.15 s: under the spacing, as a call queued
            # behind a busy pool's other calls would be.
            await in_thread(gate.wait, 0.15)
        return len(beats)

    during = await env.run(stage)
    # Six calls of 0.15 s each: 0.9 s of work with a beat due every 0.2 s. The first call beats at once
    # (nothing beat before in this attempt), and the count runs on across calls.
    assert during >= 3, beats


async def test_an_activity_without_a_heartbeat_timeout_never_beats():
    env = ActivityEnvironment()
    beats: list = []
    env.on_heartbeat = lambda *details: beats.append(details)

    async def stage() -> None:
        assert heartbeat_spacing() is None
        await in_thread(threading.Event().wait, 0.05)

    await env.run(stage)
    assert beats == []


async def test_the_worker_times_its_own_event_loop():
    import asyncio
    import contextlib
    import time

    from lazarus.activities.metrics import Metrics
    from lazarus.worker import LOOP_LAG_TICK_SECONDS, time_the_loop

    metrics = Metrics()
    timer = asyncio.ensure_future(time_the_loop(metrics))
    await asyncio.sleep(LOOP_LAG_TICK_SECONDS * 2)  # a tick or two on an idle loop
    time.sleep(0.6)  # the loop held up: a backend call made on it by mistake, a burst's work
    await asyncio.sleep(LOOP_LAG_TICK_SECONDS * 2)
    timer.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await timer
    sample = metrics.registry.get_sample_value
    ticks = sample("lazarus_loop_lag_seconds_count")
    within = sample("lazarus_loop_lag_seconds_bucket", {"le": "0.1"})
    assert ticks is not None and ticks >= 2 and within is not None
    assert ticks - within >= 1  # the held-up tick, more than 0.1 s late
    assert sample("lazarus_loop_lag_seconds_bucket", {"le": "1.0"}) == ticks  # and less than a second
