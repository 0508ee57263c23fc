"""What an activity's heartbeats to Temporal cost the worker that runs it: the part of a healthy
run's watch that no look can save.

    .venv/bin/python bench/heartbeat_cost.py [--activities 300] [--seconds 25] [--every 1.67]
                                             [--timeout 5] [--json]

A worker (the Temporal CLI's dev server on 127.0.0.1, the Python SDK as `lazarus worker` runs it)
holds --activities activities open, each waking every --every seconds (detect's spacing: a third of
its heartbeat timeout), in three sittings of --seconds:
  asleep      the activities wake and heartbeat nothing (their heartbeat timeout long enough)
  local       they heartbeat at each wake under a 600 s heartbeat timeout: Temporal's core keeps
              the newest and sends one a minute, so this is the SDK's own cost of a call
  sent        they heartbeat under a --timeout heartbeat timeout: core sends the newest every 0.8
              timeouts, so this adds the sends
The worker process's CPU (every thread, core's too) is read over each sitting's middle. Printed:
microseconds of CPU per heartbeat call and per heartbeat sent, and what a watch's heartbeats cost
per run-minute at that spacing and timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ is not an installed package

from temporalio import activity, workflow
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from lazarus.infra.harness.temporal_server import local_environment, quiet_runtime

SETTLE_SECONDS = 3.0
"""Left out at each end of a sitting (seconds): the activities starting, and ending."""


@activity.defn
async def wake(seconds: float, every: float, beat: bool) -> int:
    """Wake every `every` seconds for `seconds`, heartbeating a watch's details if `beat`."""
    wakes, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        await asyncio.sleep(every)
        if beat:
            activity.heartbeat({"step": wakes, "at": time.time(), "source": "trainer", "warnings": []})
        wakes += 1
    return wakes


@workflow.defn
class Holder:
    """Holds one `wake` activity open."""

    @workflow.run
    async def run(self, seconds: float, every: float, beat: bool, timeout: float) -> int:
        return await workflow.execute_activity(
            wake,
            args=[seconds, every, beat],
            start_to_close_timeout=timedelta(seconds=seconds + 60),
            heartbeat_timeout=timedelta(seconds=timeout),
        )


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def sitting(client, activities: int, seconds: float, every: float, beat: bool, timeout: float) -> float:
    """Worker CPU over the sitting's middle, in seconds of CPU a second."""
    queue = f"heartbeat-cost-{time.monotonic_ns()}"
    runner = UnsandboxedWorkflowRunner()
    async with Worker(
        client,
        task_queue=queue,
        workflows=[Holder],
        activities=[wake],
        max_concurrent_activities=activities + 10,
        workflow_runner=runner,
    ):
        handles = [
            await client.start_workflow(
                Holder.run, args=[seconds, every, beat, timeout], id=f"{queue}-{i}", task_queue=queue
            )
            for i in range(activities)
        ]
        await asyncio.sleep(SETTLE_SECONDS)
        cpu, at = cpu_seconds(), time.monotonic()
        await asyncio.sleep(max(1.0, seconds - 2 * SETTLE_SECONDS))
        used = (cpu_seconds() - cpu) / (time.monotonic() - at)
        await asyncio.gather(*(handle.result() for handle in handles))
    return used


async def measure(activities: int, seconds: float, every: float, timeout: float, say) -> dict:
    env = await local_environment(runtime=quiet_runtime())
    try:
        figures = {}
        for name, beat, beat_timeout in (("asleep", False, 600.0), ("local", True, 600.0), ("sent", True, timeout)):
            say(f"{name}: {activities} activities waking every {every:g} s for {seconds:g} s")
            figures[name] = await sitting(env.client, activities, seconds, every, beat, beat_timeout)
    finally:
        await env.shutdown()
    calls_per_s = activities / every
    sends_per_s = activities / max(every, 0.8 * timeout)  # core sends the newest at most every 0.8 timeouts
    per_call = (figures["local"] - figures["asleep"]) / calls_per_s
    per_send = (figures["sent"] - figures["local"]) / sends_per_s
    per_run_minute = 60 * (per_call / every + per_send / max(every, 0.8 * timeout))
    return {
        "activities": activities,
        "every_s": every,
        "heartbeat_timeout_s": timeout,
        "worker_cpu_ms_per_s": {name: 1000 * value for name, value in figures.items()},
        "cpu_us_per_heartbeat_call": 1e6 * per_call,
        "cpu_us_per_heartbeat_sent": 1e6 * per_send,
        "heartbeat_cpu_ms_per_run_minute": 1000 * per_run_minute,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--activities", type=int, default=300, help="activities held open (default 300)")
    parser.add_argument("--seconds", type=float, default=25.0, help="each sitting's length (default 25)")
    parser.add_argument("--every", type=float, default=5 / 3, help="seconds between heartbeats (default 5/3)")
    parser.add_argument("--timeout", type=float, default=5.0, help="the heartbeat timeout (default 5: detect's)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON document")
    args = parser.parse_args()
    if args.activities < 1 or args.seconds < 2 * SETTLE_SECONDS + 1 or args.every <= 0 or args.timeout <= 0:
        parser.error(f"--activities at least 1, --seconds at least {2 * SETTLE_SECONDS + 1:g}, the rest positive")
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else print
    result = asyncio.run(measure(args.activities, args.seconds, args.every, args.timeout, say))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"worker CPU (ms a second): {', '.join(f'{k} {v:.1f}' for k, v in result['worker_cpu_ms_per_s'].items())}")
    print(f"a heartbeat call: {result['cpu_us_per_heartbeat_call']:.0f} us of worker CPU")
    print(f"a heartbeat sent: {result['cpu_us_per_heartbeat_sent']:.0f} us of worker CPU")
    print(
        f"a watch's heartbeats, every {args.every:.2f} s under a {args.timeout:g} s heartbeat timeout: "
        f"{result['heartbeat_cpu_ms_per_run_minute']:.1f} ms of worker CPU a run-minute"
    )


if __name__ == "__main__":
    main()
