"""An upgrade with runs in flight: the worker of an earlier commit replaced by this checkout's in the
middle of a fleet's recoveries, the two serving side by side for a while.

    .venv/bin/python bench/upgrade.py [--from REF] [--runs 100] [--spread-seconds 10]
                                      [--overlap-seconds 10] [--json]

A worktree of REF (default: the commit before HEAD) is checked out for the sitting and removed
after. Its `lazarus worker --backend simulated` launches every run (bench/controller_scale.py's
runs: 4 simulated nodes each, a spare per run in the pool, SQLite store) and its launchers write
the nodes' reports. One node of each run dies within the spread; once half of them died, this
checkout's worker starts on the same task queue and store, both serve for the overlap, then the
earlier one is stopped (SIGTERM, as a deployment would), its launchers with it, and this
checkout's take the nodes' reports over. Once every run trains again, a second node of each run
dies, for this checkout's worker alone to recover from runs whose histories the earlier code began.

Printed: runs failed; workflow tasks that failed (a worker that met a history it cannot replay:
the earlier code, a marker or a field of the later) and their first message; every run recovered
from each fault once, into one new incarnation, its decision what it claimed, no node held by two
runs; reshards at the first burst (a spare waits for every run: none is needed; at the second, a
run holds the spec's limit of nodes, its quarantined one among them, and reshards by policy); MTTR
of each burst. Exit status 1 unless no run failed and every check held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ is not an installed package

from bench.controller_scale import (
    LAUNCH_WAVE,
    RECOVERY_WAIT_SECONDS,
    Sitting,
    Workers,
    burst,
    histories_of,
    percentile,
    statuses_of,
    wait_for,
)
from lazarus.client.config import Settings
from lazarus.client.runs import start_run
from lazarus.infra.harness.temporal_server import local_environment, quiet_runtime
from lazarus.infra.pool import NodePool
from lazarus.infra.store import default_url, open_store
from lazarus.schema import RunState
from lazarus.schema.rundir import RunDir

REPO = Path(__file__).resolve().parent.parent


def previous_checkout(ref: str, folder: Path) -> tuple[Path, str]:
    """A worktree of `ref` under `folder`; returns its path and commit. SystemExit when git cannot."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--verify", f"{ref}^{{commit}}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(folder), commit],
            check=True,
            capture_output=True,
            text=True,
        )
    except (OSError, subprocess.CalledProcessError) as error:
        said = getattr(error, "stderr", "") or str(error)
        raise SystemExit(f"bench/upgrade.py: --from {ref}: {said.strip()}") from None
    return folder, commit


def code_of(checkout: Path) -> str:
    """Where a worker given `checkout` imports Lazarus from: the checkout's, not the installed one."""
    found = subprocess.run(
        [sys.executable, "-c", "import lazarus.workflows.training_run as m; print(m.__file__)"],
        env={**os.environ, "PYTHONPATH": str(checkout)},
        cwd="/",
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not found.startswith(str(checkout)):
        raise SystemExit(f"bench/upgrade.py: a worker given {checkout} would import {found}")
    return found


def tasks_by_worker(histories, pids: dict[int, str]) -> dict[str, int]:
    """Workflow tasks completed, by which worker (its pid, in the event's identity)."""
    from temporalio.api.enums.v1 import EventType

    counts = dict.fromkeys(pids.values(), 0)
    for events in histories:
        for e in events:
            if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
                pid = e.workflow_task_completed_event_attributes.identity.split("@")[0]
                name = pids.get(int(pid)) if pid.isdigit() else None
                if name is not None:
                    counts[name] += 1
    return counts


def remove_checkout(folder: Path) -> None:
    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(folder)], capture_output=True)


def task_failures(histories) -> list[str]:
    """The message of every workflow task that failed, over the histories."""
    from temporalio.api.enums.v1 import EventType

    return [
        e.workflow_task_failed_event_attributes.failure.message
        for events in histories
        for e in events
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
    ]


def check_runs(home: Path, pool: NodePool, statuses, faults_per_run: int) -> list[str]:
    """What breaks exactly-once after the two bursts."""
    problems, holders = [], {}
    record = pool.read()
    for status in statuses:
        outcomes = [i.outcome for i in status.incidents]
        if outcomes != ["recovered"] * faults_per_run:
            problems.append(f"{status.run_id}: incidents {outcomes}")
        for incident in status.incidents:
            decided, claimed = incident.decision, incident.new_assignment
            if decided and claimed and (decided.nodes, decided.layout) != (claimed.nodes, claimed.layout):
                problems.append(
                    f"{status.run_id}: decided {decided.action} on {decided.nodes}, claimed {claimed.nodes}"
                )
        grown = [g for g in status.regrowths if g.nodes and (s := g.stages.get("replace_or_reshard")) and s.ended_at]
        incarnations = RunDir(home / "runs" / status.run_id).incarnations()
        if incarnations != list(range(1 + faults_per_run + len(grown))):
            problems.append(f"{status.run_id}: incarnations {incarnations} (regrows that claimed: {len(grown)})")
        if status.state != RunState.TRAINING or status.assignment is None:
            problems.append(f"{status.run_id}: {status.state.value}, not training")
            continue
        for node in status.assignment.nodes:
            held = record.node(node)
            if node in holders or held is None or held.owner != status.run_id or held.role != "active":
                problems.append(f"{node} of {status.run_id}: held by {holders.get(node) or (held and held.owner)}")
            holders[node] = status.run_id
    return problems


async def sit(args, say) -> dict:
    rng = random.Random(args.seed)
    sitting = Sitting(runs=args.runs, spread=args.spread_seconds)
    env = await local_environment(runtime=quiet_runtime())
    settings = Settings(task_queue="upgrade")
    address = env.client.service_client.config.target_host
    ids = [f"upgrade-{i:04d}" for i in range(args.runs)]
    with tempfile.TemporaryDirectory() as folder:
        home = Path(folder)
        code, commit = previous_checkout(args.ref, home / "previous")
        say(f"the earlier worker: {args.ref} ({commit[:10]}), imports {code_of(code)}")
        store = default_url(home)
        pool = NodePool(open_store(store))
        earlier = Workers(1, home, address, settings.task_queue, store, code=code, name="earlier")
        later: list[Workers] = []
        try:
            await earlier.ready()
            for first in range(0, args.runs, LAUNCH_WAVE):
                wave = range(first, min(first + LAUNCH_WAVE, args.runs))
                await asyncio.gather(*(start_run(env.client, settings, sitting.spec(i), ids[i]) for i in wave))
                await wait_for(env.client, "LazarusState='TRAINING'", first + len(wave), say, "training", 600)

            async def upgrade() -> None:
                later.append(Workers(1, home, address, settings.task_queue, store, name="later"))
                await later[0].ready()
                say(f"  this checkout's worker serves beside the earlier; it stops in {args.overlap_seconds:g} s")
                await asyncio.sleep(args.overlap_seconds)
                await asyncio.to_thread(earlier.stop)
                say("  the earlier worker stopped (SIGTERM)")

            results = {}
            for number in (1, 2):
                faults = await asyncio.to_thread(sitting.faults, pool, ids, rng)
                say(f"burst {number}: {len(faults)} nodes die within {args.spread_seconds:g} s")
                started = time.monotonic()
                upgrading = asyncio.create_task(asyncio.sleep(0))
                at_half = None
                if number == 1:

                    async def at_half() -> None:
                        nonlocal upgrading
                        upgrading = asyncio.create_task(upgrade())

                await burst(pool, faults, at_half)
                await upgrading
                query = f"LazarusState='TRAINING' AND LazarusIncidents>={number}"
                await wait_for(env.client, query, args.runs, say, "recovered", RECOVERY_WAIT_SECONDS, give_up=True)
                results[number] = time.monotonic() - started
            statuses = await statuses_of(env.client, ids)
            histories = await histories_of(env.client, ids)
            failures = task_failures(histories)
            pids = {p.pid: "earlier" for p in earlier.processes} | {p.pid: "later" for w in later for p in w.processes}
            served = tasks_by_worker(histories, pids)
            problems = check_runs(home, pool, statuses, faults_per_run=2)
            mttr = {n: [s.incidents[n - 1].mttr_seconds for s in statuses if len(s.incidents) >= n] for n in (1, 2)}
            for status in statuses:
                if status.state not in (RunState.FAILED, RunState.COMPLETED, RunState.ABORTED):
                    await env.client.get_workflow_handle(status.run_id).terminate("benchmark done")
        finally:
            earlier.stop()
            for workers in later:
                workers.stop()
            await env.shutdown()
            remove_checkout(home / "previous")
    return {
        "from": args.ref,
        "from_commit": commit,
        "runs": args.runs,
        "spread_seconds": args.spread_seconds,
        "overlap_seconds": args.overlap_seconds,
        "failed": sum(s.state == RunState.FAILED for s in statuses),
        "workflow_tasks_completed": served,
        "workflow_task_failures": len(failures),
        "first_task_failure": failures[0][:500] if failures else "",
        "exactly_once": not problems,
        "problems": problems[:20],
        # A spare per run for the first burst; at the second, a run holds its limit of nodes already (the
        # spec's active + spare, the first burst's quarantined node among them), so it reshards by policy.
        "needless_reshards": sum(
            bool(s.incidents) and s.incidents[0].decision is not None and s.incidents[0].decision.action == "reshard"
            for s in statuses
        ),
        "second_burst_decisions": sorted(
            {s.incidents[1].decision.action for s in statuses if len(s.incidents) > 1 and s.incidents[1].decision}
        ),
        **{
            f"burst_{n}_mttr_median_s": (
                sorted(m)[len(m) // 2] if (m := [x for x in mttr[n] if x is not None]) else None
            )
            for n in (1, 2)
        },
        **{f"burst_{n}_mttr_p99_s": percentile([x for x in mttr[n] if x is not None] or [0.0], 99) for n in (1, 2)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="ref", default="HEAD~1", help="the earlier commit (default: HEAD~1)")
    parser.add_argument("--runs", type=int, default=100, help="concurrent runs (default 100)")
    parser.add_argument(
        "--spread-seconds", type=float, default=10.0, help="each burst's faults within this (default 10)"
    )
    parser.add_argument(
        "--overlap-seconds", type=float, default=10.0, help="how long both workers serve before the earlier stops"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON document")
    args = parser.parse_args()
    if args.runs < 1 or args.spread_seconds < 0 or args.overlap_seconds < 0:
        parser.error("--runs at least 1; --spread-seconds and --overlap-seconds at least 0")
    started = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    result = asyncio.run(sit(args, say))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key:28} {value}")
    passed = result["failed"] == 0 and result["exactly_once"] and result["needless_reshards"] == 0
    raise SystemExit(0 if passed else 1)


if __name__ == "__main__":
    from lazarus.client.runs import exit_after

    exit_after(main)  # past the native client's crash at interpreter exit
