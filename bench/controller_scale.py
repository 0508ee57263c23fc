"""The controller under a fleet's load: many concurrent runs on one pool, a burst of faults across them.

    .venv/bin/python bench/controller_scale.py [--runs 200] [--spread-seconds 10] [--workers 1]
                                               [--kill-worker] [--store sqlite|postgresql] [--separate-homes]
                                               [--issue] [--json] [--markdown [PATH]]

Every run is a real TrainingRun workflow on a private Temporal dev server, served by --workers
`lazarus worker --backend simulated` processes on one task queue, with the real recovery
activities; only the nodes are simulated (infra/backends/simulated/cluster.py: a process of simulated launchers
keeps each node's report, as a real launcher does), so what is measured is the controller:
Temporal, the workflow, the activities, the pool and the run directories. Each run has 4 active
nodes, and the pool the runs share holds one free spare per run. Once every run trains, the
workers' CPU is read over --healthy-seconds (what watching healthy runs costs); then one node of
each run dies at a random moment within --spread-seconds. With --kill-worker one worker is
SIGKILLed once half the faults have landed. Printed:
  incidents/s        incidents recovered / (last recovery's first step - first fault), beside the
                     faults' own arrival rate: at most N / (spread + MTTR), below the arrival rate
                     even for a controller that keeps up
  decisions/s        decisions / (last decision - first decision), the pace the controller kept,
                     and the arrival rate, faults / (last fault - first fault), beside it
  report->decision   detect's fault report to the replace decision recorded (replace_or_reshard's
                     end, as the workflow records it): median, p99
  fault->first step  the MTTR of the simulated recovery: median, p99 (the simulated ranks take
                     0.55 s from launch to their first step)
  watch cost         the workers' CPU per healthy run per minute, and all of them as a share of a core
  exactly once       every run recovered from its one incident once, to one new incarnation
                     (the one its decision named), and no node is held by two runs
  needless reshards  incidents resharded though the pool held a spare for every run
--issue runs the fleet's sittings, one after another, into one page: one run alone, 200 and 1,000
runs on one worker (SQLite), 200 on four workers with homes of their own and a PostgreSQL store, one
SIGKILLed mid-burst, and a rack across 200 runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ is not an installed package

from bench import perf_page
from lazarus.client.config import ENV_ADDRESS, ENV_HOME, ENV_RUNS, ENV_STORE, ENV_TASK_QUEUE, Settings
from lazarus.client.history import chain_histories, incident_spans
from lazarus.client.runs import run_status, start_run
from lazarus.infra.backend import free_ports
from lazarus.infra.harness import postgres
from lazarus.infra.harness.temporal_server import local_environment, quiet_runtime
from lazarus.infra.pool import NodePool
from lazarus.infra.store import default_url, open_store
from lazarus.schema import RunState, parse_spec
from lazarus.schema.rundir import RunDir

PAGE_TITLE = "The controller under a fleet's load"
ABOUT = """Worker processes (`lazarus worker --backend simulated`, on one task queue) serve many
concurrent TrainingRun workflows on a private Temporal dev server, with the real recovery
activities; only the nodes are simulated (a process of simulated launchers keeps each node's
report, as a real launcher does), so what is measured is the controller: Temporal, the workflow,
the activities, the shared pool and the run directories, all on this machine's cores with the dev
server. Each run has 4 active nodes; the pool holds one free spare per run. *Watch cost* is the
workers' CPU while every run trains and nothing fails, per run and minute. Then one node of each
run dies at a random moment within the spread. *Incidents handled per second* is the incidents
recovered over the time from the first fault to the last recovery's first step (the faults' own
arrival rate beside it: at most N / (spread + MTTR), so below the arrival rate even for a
controller that keeps up); *decisions made per second* counts them over the span the decisions
took, first to last, the pace the controller kept against the faults' pace (faults over the
span from first fault to last); *fault report -> replace decision* runs from detect's report to
replace_or_reshard's end as the workflow records it; *fault -> first step* is the simulated
recovery's MTTR (it includes the simulated ranks' 0.55 s from launch to their first step);
*exactly once*: every run recovered from its one incident once, into one new incarnation (the one
its decision named), and no node is held by two runs; with a spare for every run, a reshard is a
needless one."""

SPEC = {
    "name": "scale",
    "trainer": {"steps": 10_000_000, "checkpoint_every": 1000},
    "cluster": {"active_nodes": 4, "spare_nodes": 1},
    "recovery": {"heartbeat_interval_seconds": 0.5, "hang_after_seconds": 30, "progress_every_seconds": 300},
}
LAZARUS = Path(sys.executable).parent / "lazarus"
RECOVERY_WAIT_SECONDS = 600.0
"""How long the bench waits for every run hit to recover; past it, the figures are of those that did."""
LAUNCH_WAVE = 100
"""Runs started at once: the next wave starts when these train."""


@dataclass(frozen=True)
class Sitting:
    """One measurement: how many runs, how the faults come, how many workers, whether one dies."""

    runs: int
    spread: float
    workers: int = 1
    kill_worker: bool = False
    rack: bool = False  # one rack with a node of every run fails at once; spares for half the runs
    task_timeout: float | None = None  # the runs' recovery.workflow_task_timeout_seconds (None: the policy's)
    store: str = "sqlite"  # the store the workers share: sqlite (a file) or postgresql (a server the bench starts)
    separate_homes: bool = False  # each worker with a LAZARUS_HOME of its own, the runs' folder shared

    def caption(self) -> str:
        workers = f"{self.workers} worker{'s' if self.workers > 1 else ''}"
        if self.kill_worker:
            workers += " (one SIGKILLed mid-burst)"
        if self.task_timeout is not None:
            workers += f", workflow task timeout {self.task_timeout:g} s"
        if self.separate_homes:
            workers += ", each with a home of its own"
        workers += f", {'PostgreSQL' if self.store == 'postgresql' else 'SQLite'} store"
        if self.rack:
            return (
                f"{workers}, {self.runs} concurrent runs of priorities 0-2, one rack holding a node of each failing "
                f"at once, spares for half of them"
            )
        return f"{workers}, {self.runs} concurrent runs, one node of each run killed within {self.spread:g} s"

    def spec(self, index: int):
        """The spec of run `index`: with a rack, priorities 0, 1, 2 in turn."""
        recovery = dict(SPEC["recovery"])
        if self.task_timeout is not None:
            recovery["workflow_task_timeout_seconds"] = self.task_timeout
        cluster = {**SPEC["cluster"], "priority": index % 3 if self.rack else 0}
        return parse_spec({**SPEC, "cluster": cluster, "recovery": recovery})

    def faults(self, pool: NodePool, ids: list[str], rng: random.Random) -> list[tuple[float, list[str]]]:
        """When which nodes die, seconds from the burst's start; the spares added first."""
        if not self.rack:
            pool.add(self.runs - len(pool.free_spares()), "a hot spare per run")
            return plan_faults(pool, ids, self.spread, rng)
        pool.add(self.runs // 2 - len(pool.free_spares()), "a hot spare for every other run")
        rack = [pool.read().held_by(run_id)[0].name for run_id in ids]
        pool.set_domain(rack, "rack-0")
        return [(0.0, rack)]


ISSUE_SITTINGS = (
    Sitting(1, 0.0),  # one run alone: what each run of the fleet's figures is set beside
    Sitting(200, 10.0),
    Sitting(1000, 10.0),
    # 1,000 runs on four workers do not fit two cores yet: four workers' watches, the dev server and
    # PostgreSQL leave the simulated nodes too little CPU to report in time (FLEET_NOTES).
    Sitting(200, 10.0, workers=4, kill_worker=True, store="postgresql", separate_homes=True),
    Sitting(200, 0.0, rack=True),
)
FLEET_NOTES = (
    "Not on this page: 1,000 runs on four workers with homes of their own and a PostgreSQL store. Tried on "
    "these two cores (last on 2026-12-07, with a watch of about 20 ms a run-minute), four workers, the dev "
    "server, PostgreSQL and the simulated nodes' process took more CPU than there is before a fault came: "
    "the dev server's own persistence calls timed out (context deadline exceeded) and runs fell out of "
    "training while the last ones started (958, then 410 of 1,000 training). Tried again the same day with "
    "a watch of about 11 ms a run-minute: all 1,000 trained, but with one worker SIGKILLed mid-burst 874 of "
    "1,000 had recovered 600 s after the faults, the dev server's persistence calls timing out all along, "
    "and a run's status could not be read (its workflow task in a failed state; the workers' logs went "
    "with the sitting: --keep-logs keeps them now). That sitting needs a machine for the server apart from "
    "the workers, as a fleet has.",
)


def cpu_seconds(pid: int) -> float:
    """User and system CPU a live process has used so far (seconds)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


class Workers:
    """`lazarus worker --backend simulated` processes on one task queue, store and runs' folder, each on
    `home` or (`separate_homes`) a home of its own, stopped by pid."""

    def __init__(
        self,
        count: int,
        home: Path,
        address: str,
        queue: str,
        store: str,
        separate_homes: bool = False,
        code: Path | None = None,
        name: str = "worker",
    ):
        env = {
            **os.environ,
            ENV_ADDRESS: address,
            ENV_TASK_QUEUE: queue,
            ENV_STORE: store,
            ENV_RUNS: str(home / "runs"),
        }
        if code is not None:  # another checkout's code (bench/upgrade.py): its package ahead of the installed one
            env["PYTHONPATH"] = str(code)
        homes = [home / f"worker-home-{i}" if separate_homes else home for i in range(count)]
        self.name = name
        self.logs = [open(home / f"{name}-{i}.log", "w") for i in range(count)]  # noqa: SIM115 - closed in stop
        self.metrics_ports = free_ports(count)
        self.processes = [
            subprocess.Popen(
                [str(LAZARUS), "worker", "--backend", "simulated", "--metrics-port", str(port)],
                env={**env, ENV_HOME: str(own)},
                stdout=log,
                stderr=log,
            )
            for log, port, own in zip(self.logs, self.metrics_ports, homes, strict=True)
        ]
        self.home = home

    async def ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        for index, process in enumerate(self.processes):
            log = self.home / f"{self.name}-{index}.log"
            while "worker pid" not in log.read_text():
                if process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"controller_scale: worker {index} did not start:\n{log.read_text()[-2000:]}")
                await asyncio.sleep(0.1)

    def stage_seconds(self) -> dict[str, float]:
        """Each stage's mean activity attempt as the live workers timed it (lazarus_stage_seconds)."""
        sums: dict[str, list[float]] = {}
        for process, port in zip(self.processes, self.metrics_ports, strict=True):
            if process.poll() is not None:
                continue
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            for line in text.splitlines():
                found = re.match(r'lazarus_stage_seconds_(sum|count)\{stage="(\w+)"\} (\S+)', line)
                if found:
                    kind, stage, value = found.groups()
                    sums.setdefault(stage, [0.0, 0.0])[kind == "count"] += float(value)
        return {stage: total / count for stage, (total, count) in sums.items() if count}

    def loop_lag(self) -> dict[float, float]:
        """The live workers' event-loop ticks by lateness: bucket bound (s) -> ticks at most that late
        (lazarus_loop_lag_seconds, cumulative, summed over the workers; inf: every tick)."""
        counts: dict[float, float] = {}
        for process, port in zip(self.processes, self.metrics_ports, strict=True):
            if process.poll() is not None:
                continue
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            for bound, value in re.findall(r'lazarus_loop_lag_seconds_bucket\{le="([^"]+)"\} (\S+)', text):
                counts[float(bound)] = counts.get(float(bound), 0.0) + float(value)
        return counts

    def start_lag(self) -> dict[str, dict[str, float]]:
        """Per stage, the activity attempts the live workers took and how many of them started their code
        more than 1 s and 5 s after (lazarus_activity_start_lag_seconds): a task a worker holds past its
        heartbeat timeout before it runs fails."""
        counts: dict[str, dict[float, float]] = {}
        for process, port in zip(self.processes, self.metrics_ports, strict=True):
            if process.poll() is not None:
                continue
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            pattern = r'lazarus_activity_start_lag_seconds_bucket\{le="([^"]+)",stage="(\w+)"\} (\S+)'
            for bound, stage, value in re.findall(pattern, text):
                by_bound = counts.setdefault(stage, {})
                by_bound[float(bound)] = by_bound.get(float(bound), 0.0) + float(value)
        return {
            stage: {
                "taken": b[float("inf")],
                "later_than_1s": b[float("inf")] - b[1.0],
                "later_than_5s": b[float("inf")] - b[5.0],
            }
            for stage, b in counts.items()
        }

    def refused_claims(self) -> int:
        """Claims refused because another run took the spare first (each decided again)."""
        return sum(log.read_text().count("ApplicationError: SpareUnavailable") for log in self.log_files())

    def log_files(self) -> list[Path]:
        return [self.home / f"{self.name}-{i}.log" for i in range(len(self.processes))]

    def live(self) -> list[subprocess.Popen]:
        return [p for p in self.processes if p.poll() is None]

    def cpu(self) -> float:
        return sum(cpu_seconds(p.pid) for p in self.live())

    def kill_one(self) -> int:
        victim = self.live()[0]
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        return victim.pid

    def stop(self) -> None:
        for process in self.live():
            process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for log in self.logs:
            log.close()


async def count(client, query: str) -> int:
    return (await client.count_workflows(f"WorkflowType='TrainingRun' AND {query}")).count


async def wait_for(client, query: str, wanted: int, say, what: str, timeout: float, give_up: bool = False) -> int:
    """Poll the server's visibility (no worker answers it) until `wanted` runs match `query`; returns
    how many do. Past `timeout`, SystemExit, or with `give_up` the count so far."""
    deadline, last = time.monotonic() + timeout, -1
    while (found := await count(client, query)) < wanted:
        failed = await count(client, "ExecutionStatus='Failed'")
        if failed and give_up and found + failed >= wanted:
            say(f"  {found} of {wanted} {what}, {failed} failed")
            return found
        if failed and not give_up:
            async for run in client.list_workflows("WorkflowType='TrainingRun' AND ExecutionStatus='Failed'"):
                try:
                    await client.get_workflow_handle(run.id).result()
                except Exception as error:  # noqa: BLE001 - what the run failed of, for the message
                    cause = getattr(error, "cause", error)
                    raise SystemExit(
                        f"controller_scale: {failed} run(s) failed while {what}; {run.id}: {cause}"
                    ) from None
            raise SystemExit(f"controller_scale: {failed} run(s) failed while {what}")
        if time.monotonic() > deadline:
            if give_up:
                say(f"  gave up after {timeout:g} s: {found} of {wanted} {what}")
                return found
            raise SystemExit(f"controller_scale: only {found} of {wanted} runs {what} after {timeout:g} s")
        if found != last:
            say(f"  {found}/{wanted} {what}")
            last = found
        await asyncio.sleep(0.5)
    return found


async def last_activity(client, run_id: str) -> str:
    """How the run's last activity went, from its history: when it was scheduled, when the worker took
    each attempt (its timers start then), how the last ended: where a timeout's time went."""
    from temporalio.api.enums.v1 import EventType

    scheduled, started, ended, kind = None, [], "", ""
    async for event in client.get_workflow_handle(run_id).fetch_history_events():
        at = event.event_time.ToDatetime()
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            scheduled, started, ended = at, [], ""
            kind = event.activity_task_scheduled_event_attributes.activity_type.name
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED and scheduled is not None:
            attempts = event.activity_task_started_event_attributes.attempt
            started.append(f"attempt {attempts} taken {(at - scheduled).total_seconds():.1f} s after scheduling")
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT and scheduled is not None:
            ended = f"timed out {(at - scheduled).total_seconds():.1f} s after scheduling"
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED and scheduled is not None:
            ended = f"failed {(at - scheduled).total_seconds():.1f} s after scheduling"
    return f"{kind}: " + "; ".join([*started, ended]) if kind else "none"


def plan_faults(pool: NodePool, ids: list[str], spread: float, rng: random.Random) -> list[tuple[float, list[str]]]:
    """When each node dies (seconds from the burst's start): a random active node of each run."""
    record = pool.read()
    held = {run_id: [n.name for n in record.held_by(run_id)] for run_id in ids}
    return sorted((rng.uniform(0, spread), [rng.choice(held[run_id])]) for run_id in ids)


async def burst(pool: NodePool, faults: list[tuple[float, list[str]]], at_half=None) -> None:
    """Kill the planned nodes on time (the pool holds them dead); `at_half()`, awaited, once half of
    them died."""
    started = time.monotonic()
    for index, (at, nodes) in enumerate(faults):
        await asyncio.sleep(max(0.0, at - (time.monotonic() - started)))
        now = datetime.now(UTC)
        await asyncio.to_thread(
            pool.set_health, {n: {"healthy": False, "died_at": now, "note": "killed (bench)"} for n in nodes}
        )
        if at_half is not None and index == len(faults) // 2:
            await at_half()


def keeping_up(incidents) -> tuple[float, float]:
    """Report -> decision of the first tenth of the faults and of the last tenth, medians (s): a
    controller that keeps pace with the burst decides the last as fast as the first."""
    by_fault = sorted(incidents, key=lambda i: i.fault.occurred_at)
    tenth = max(1, len(by_fault) // 10)

    def decided(group) -> float:
        return statistics.median(
            (i.stages["replace_or_reshard"].ended_at - i.fault.detected_at).total_seconds() for i in group
        )

    return decided(by_fault[:tenth]), decided(by_fault[-tenth:])


def spares_by_priority(statuses) -> dict:
    """Who got the rack's spares: no run went without one while a run of lower priority got one."""
    decided = [(s.incidents[0].decision.action, s.run_id) for s in statuses if s.incidents]
    priority = {s.run_id: int(s.run_id[-4:]) % 3 for s in statuses}
    replaced = [priority[run_id] for action, run_id in decided if action == "replace"]
    others = [priority[run_id] for action, run_id in decided if action != "replace"]
    return {
        "replaced": len(replaced),
        "resharded_or_waiting": len(others),
        "in_order": not replaced or not others or min(replaced) >= max(others),
    }


def check_exactly_once(home: Path, store: str, ids: list[str], statuses) -> list[str]:
    """What breaks exactly-once: a run with other than one recovered incident, an incarnation beyond
    those its incident and its regrows made, a node in two runs' assignments, the pool's holder of a
    node not the run whose assignment has it (a run that ended since gave its nodes back)."""
    problems = []
    holders: dict[str, str] = {}
    record = NodePool(open_store(store)).read()
    for run_id, status in zip(ids, statuses, strict=True):
        outcomes = [i.outcome for i in status.incidents]
        if outcomes != ["recovered"]:
            problems.append(f"{run_id}: incidents {outcomes}")
        for incident in status.incidents:
            decided, claimed = incident.decision, incident.new_assignment
            if decided and claimed and (decided.nodes, decided.layout) != (claimed.nodes, claimed.layout):
                problems.append(f"{run_id}: decided {decided.action} on {decided.nodes}, claimed {claimed.nodes}")
        incarnations = RunDir(home / "runs" / run_id).incarnations()
        # A run that resharded grows back once a spare is free: a regrow, one incarnation once it
        # claimed its nodes (a regrow whose claim another run won trains on: none).
        claimed = [g for g in status.regrowths if g.nodes and (s := g.stages.get("replace_or_reshard")) and s.ended_at]
        if incarnations != list(range(2 + len(claimed))):
            problems.append(f"{run_id}: incarnations {incarnations} (regrows that claimed: {len(claimed)})")
        if status.state in (RunState.FAILED, RunState.ABORTED, RunState.COMPLETED):
            continue
        for node in status.assignment.nodes:
            if node in holders:
                problems.append(f"{node} is in the assignments of {holders[node]} and {run_id}")
            holders[node] = run_id
            held = record.node(node)
            if held is None or held.role != "active" or held.owner != run_id:
                problems.append(f"{node} of {run_id}'s assignment is {held and held.role} of {held and held.owner}")
    return problems


async def histories_of(client, ids: list[str]) -> list[list]:
    """The first workflow run's history events of each run."""
    gate = asyncio.Semaphore(20)

    async def one(run_id: str) -> list:
        async with gate:
            return (await chain_histories(client, run_id))[0]

    return await asyncio.gather(*(one(run_id) for run_id in ids))


def workflow_task_timeouts(events) -> int:
    """Workflow tasks of one history that a worker took and did not finish in time (start to close):
    each ran its local stages again. A sticky queue's schedule-to-start timeout is not one."""
    from temporalio.api.enums.v1 import EventType, TimeoutType

    return sum(
        e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT
        and e.workflow_task_timed_out_event_attributes.timeout_type == TimeoutType.TIMEOUT_TYPE_START_TO_CLOSE
        for e in events
    )


async def statuses_of(client, ids: list[str]):
    gate = asyncio.Semaphore(20)

    async def one(run_id: str):
        async with gate:
            return await run_status(client, run_id)

    return await asyncio.gather(*(one(run_id) for run_id in ids))


@contextlib.contextmanager
def store_of(engine: str, folder: Path) -> Iterator[str]:
    """The URL of the store the sitting's workers share: a SQLite file in `folder`, or a PostgreSQL server
    started for the sitting (infra/harness/postgres.py, fsync on), stopped after it."""
    if engine == "sqlite":
        yield default_url(folder)
        return
    why = postgres.why_not_startable()
    if why is not None:
        raise SystemExit(f"controller_scale: --store postgresql: {why}")
    server = postgres.PostgresServer(folder / "postgres")
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


async def measure(sitting: Sitting, healthy_seconds: float, seed: int, say, keep_logs: Path | None = None) -> dict:
    rng = random.Random(seed)
    env = await local_environment(runtime=quiet_runtime())
    settings = Settings(task_queue="controller-scale")
    address = env.client.service_client.config.target_host
    ids = [f"scale-{i:04d}" for i in range(sitting.runs)]
    with tempfile.TemporaryDirectory() as folder, store_of(sitting.store, Path(folder)) as store:
        home = Path(folder)
        pool = NodePool(open_store(store))
        workers = Workers(sitting.workers, home, address, settings.task_queue, store, sitting.separate_homes)
        try:
            await workers.ready()
            started = time.monotonic()
            # In waves, as a fleet's runs start: a thousand launches in one second is a storm of its own.
            for first in range(0, sitting.runs, LAUNCH_WAVE):
                wave = range(first, min(first + LAUNCH_WAVE, sitting.runs))
                await asyncio.gather(*(start_run(env.client, settings, sitting.spec(i), ids[i]) for i in wave))
                await wait_for(env.client, "LazarusState='TRAINING'", first + len(wave), say, "training", 600)
            say(f"all train after {time.monotonic() - started:.1f} s; watching them healthy for {healthy_seconds:g} s")
            await asyncio.sleep(2.0)  # the launches' last activities settle
            cpu_before, at_before = workers.cpu(), time.monotonic()
            await asyncio.sleep(healthy_seconds)
            watch_cpu = (workers.cpu() - cpu_before) / (time.monotonic() - at_before)
            # The spares are added once every run holds its active nodes (before, a run's launch would
            # take them as its actives).
            faults = await asyncio.to_thread(sitting.faults, pool, ids, rng)
            say(f"{sum(len(n) for _, n in faults)} nodes die in {len(faults)} fault(s) within {sitting.spread:g} s")
            cpu_before, at_before, lag_before = workers.cpu(), time.monotonic(), workers.loop_lag()

            async def kill_one() -> None:
                say(f"  SIGKILLed worker pid {workers.kill_one()} after {len(faults) // 2 + 1} of {len(faults)} faults")

            await burst(pool, faults, kill_one if sitting.kill_worker else None)
            hit = sorted({n.owner for n in pool.read().nodes if not n.healthy and n.owner})
            recovered_query = "LazarusState='TRAINING' AND LazarusIncidents>=1"
            await wait_for(env.client, recovered_query, len(hit), say, "recovered", RECOVERY_WAIT_SECONDS, give_up=True)
            # What the incidents cost the workers beyond watching: a killed worker's share is lost.
            burst_cpu = workers.cpu() - cpu_before - watch_cpu * (time.monotonic() - at_before)
            lag = late_ticks(lag_before, workers.loop_lag())
            say(f"all recovered after {time.monotonic() - started:.1f} s; reading statuses and histories")
            statuses = await statuses_of(env.client, ids)
            timed = workers.stage_seconds()
            lagged = workers.start_lag()
            say(f"  activity tasks started late: {lagged}")
            refused = workers.refused_claims()
            done = [s for s in statuses if s.run_id in hit and s.incidents and s.incidents[0].outcome == "recovered"]
            failed = [s for s in statuses if s.state == RunState.FAILED]
            if failed:
                say(f"  {failed[0].run_id}'s last activity: {await last_activity(env.client, failed[0].run_id)}")
            problems = check_exactly_once(home, store, [s.run_id for s in done], done)
            histories = await histories_of(env.client, hit)
            task_timeouts = sum(workflow_task_timeouts(events) for events in histories)
            say(f"  workflow tasks timed out (the stages ran again): {task_timeouts}")
            logging.getLogger("temporalio").setLevel(logging.CRITICAL)  # terminating cancels every watch
            for status in statuses:
                if status.state not in (RunState.FAILED, RunState.COMPLETED, RunState.ABORTED):
                    await env.client.get_workflow_handle(status.run_id).terminate("benchmark done")
        finally:
            workers.stop()
            await env.shutdown()
            if keep_logs is not None:
                kept = keep_logs / f"{sitting.runs}-runs-{time.strftime('%Y%m%d-%H%M%S')}"
                kept.mkdir(parents=True, exist_ok=True)
                for log in workers.log_files():
                    if log.exists():
                        shutil.copy(log, kept / log.name)
                say(f"  the workers' logs kept in {kept}")
    incidents = [s.incidents[0] for s in done]
    by_priority = spares_by_priority(statuses) if sitting.rack else None
    to_decision = [(i.stages["replace_or_reshard"].ended_at - i.fault.detected_at).total_seconds() for i in incidents]
    mttr = [i.mttr_seconds for i in incidents]
    first_fault = min(i.fault.occurred_at for i in incidents)
    last_fault = max(i.fault.occurred_at for i in incidents)
    last_step = max(i.first_step_at for i in incidents)
    return {
        **sitting.__dict__,
        "decision_breakdown_s": breakdown(incidents),
        "healthy_runs_watched": sitting.runs,
        "watch_cpu_ms_per_run_minute": watch_cpu * 60_000 / sitting.runs,
        "watch_cores": watch_cpu,
        "incidents": len(incidents),
        "faults": len(hit),
        "failed": len(failed),
        "failed_after_recovery": sum(s.state == RunState.FAILED for s in done),
        "failed_first": f"{failed[0].run_id}: {failed[0].reason}" if failed else "",
        "claims_refused": refused,
        # One spare per run (not a rack's sitting): every reshard is one the pool did not call for.
        "needless_reshards": None if sitting.rack else sum(i.decision.action == "reshard" for i in incidents),
        "worker_cpu_ms_per_incident": burst_cpu * 1000 / max(len(incidents), 1),
        # Faults that all came in one write (a rack) arrived at once: no rate.
        "arrival_per_s": (
            len(incidents) / (last_fault - first_fault).total_seconds() if last_fault > first_fault else None
        ),
        "incidents_per_s": len(incidents) / (last_step - first_fault).total_seconds(),
        "decisions_per_s": decision_rate(incidents),
        "loop_late_share": lag,
        "report_to_decision_median_s": statistics.median(to_decision),
        "report_to_decision_p99_s": percentile(to_decision, 99),
        "keeping_up_s": keeping_up(incidents),
        "drained_s": drain_spread(incidents),
        "mttr_median_s": statistics.median(mttr),
        "mttr_p99_s": percentile(mttr, 99),
        "events_per_incident": statistics.median([s[0] for s in map(incident_spans, histories[:50]) if s]),
        "workflow_task_timeouts": task_timeouts,
        "start_lag": lagged,
        "stage_activity_mean_s": {stage: timed[stage] for stage in DECISION_PATH if stage in timed},
        "spares_by_priority": by_priority,
        "exactly_once": not problems,
        "problems": problems[:20],
    }


DECISION_PATH = ("drain", "reschedule", "replace_or_reshard")


def late_ticks(before: dict[float, float], after: dict[float, float]) -> dict[str, float]:
    """Of the workers' event-loop ticks from the burst to the last recovery, the share later than
    1 s and than 5 s (a killed worker's ticks drop out of the sums: they are counted up to zero)."""
    ticks = max(after.get(float("inf"), 0.0) - before.get(float("inf"), 0.0), 1.0)
    late = {}
    for bound in (1.0, 5.0):
        within = after.get(bound, 0.0) - before.get(bound, 0.0)
        late[f"{bound:g}"] = max(0.0, 1 - max(within, 0.0) / ticks)
    return late


def drain_spread(incidents) -> tuple[float, float, float]:
    """From the first fault to the first run's drain, to the median run's, to the last run's (s):
    how long a burst's runs take to lodge their needs, which a rack's gather waits out."""
    first_fault = min(i.fault.occurred_at for i in incidents)
    drained = sorted((i.stages["drain"].ended_at - first_fault).total_seconds() for i in incidents)
    return drained[0], statistics.median(drained), drained[-1]


def decision_rate(incidents) -> float | None:
    """Decisions per second over the span they were made in (first decision to last): the pace the
    controller kept, to set beside the faults' (None for a single decision)."""
    decided = sorted(i.stages["replace_or_reshard"].ended_at for i in incidents)
    span = (decided[-1] - decided[0]).total_seconds()
    return len(decided) / span if span > 0 else None


def breakdown(incidents) -> dict[str, float]:
    """Where report -> decision goes, as medians: each stage's own time, and the wait before it
    (the workflow task that schedules it, the activity task that starts it)."""
    parts: dict[str, list[float]] = {}
    for incident in incidents:
        before = incident.fault.detected_at
        for name in DECISION_PATH:
            stage = incident.stages[name]
            parts.setdefault(f"before {name}", []).append((stage.started_at - before).total_seconds())
            parts.setdefault(name, []).append(stage.seconds or 0.0)
            before = stage.ended_at
    return {name: statistics.median(values) for name, values in parts.items()}


def table(result: dict) -> perf_page.Table:
    fields = ("runs", "spread", "workers", "kill_worker", "rack", "task_timeout", "store", "separate_homes")
    sitting = Sitting(**{k: result[k] for k in fields if k in result})
    rows = [
        [
            "incidents handled per second (faults arrived per second)",
            f"{result['incidents_per_s']:.2f} ("
            + (f"{result['arrival_per_s']:.1f})" if result["arrival_per_s"] else "all at once)"),
            None,
        ],
        [
            "decisions made per second, first decision to last (faults arrived per second)",
            (f"{result['decisions_per_s']:.2f} (" if result.get("decisions_per_s") else "- (")
            + (f"{result['arrival_per_s']:.1f})" if result["arrival_per_s"] else "all at once)"),
            None,
        ],
        [
            "worker's event loop late by more than 1 s / 5 s, share of its 0.25 s ticks during the burst",
            "{:.1%} / {:.1%}".format(result["loop_late_share"]["1"], result["loop_late_share"]["5"]),
            None,
        ],
        [
            "first fault -> drained: the first run, the median run, the last run (s)",
            "{:.2f} / {:.2f} / {:.2f}".format(*result["drained_s"]),
            None,
        ],
        [
            "fault report -> replace decision (s)",
            f"{result['report_to_decision_median_s']:.3f}",
            f"{result['report_to_decision_p99_s']:.3f}",
        ],
        [
            "report -> decision of the first tenth of the faults / of the last tenth, medians (s)",
            "{:.3f} / {:.3f}".format(*result["keeping_up_s"]),
            None,
        ],
        [
            "report -> decision, medians (s): "
            + ", ".join(f"{name} {seconds:.3f}" for name, seconds in result["decision_breakdown_s"].items()),
            None,
            None,
        ],
        [
            "the same as the workers timed each activity, means (s): "
            + ", ".join(f"{name} {seconds:.3f}" for name, seconds in result["stage_activity_mean_s"].items()),
            None,
            None,
        ],
        ["fault -> first step, simulated (s)", f"{result['mttr_median_s']:.3f}", f"{result['mttr_p99_s']:.3f}"],
        [
            f"watch of a healthy run: worker CPU per run per minute (ms); {result['runs']} runs",
            f"{result['watch_cpu_ms_per_run_minute']:.0f}",
            None,
        ],
        ["all healthy runs' watch, share of one core", f"{result['watch_cores']:.1%}", None],
        ["worker CPU per incident, beyond the watch (ms)", f"{result['worker_cpu_ms_per_incident']:.0f}", None],
        ["claims refused (a spare taken by another run first; decided again)", f"{result['claims_refused']}", None],
        *(
            [["reshards with a spare for every run (needless)", f"{result['needless_reshards']}", None]]
            if result.get("needless_reshards") is not None
            else []
        ),
        ["workflow tasks timed out (their local stages ran again)", f"{result['workflow_task_timeouts']}", None],
        ["history events per incident", f"{result['events_per_incident']:.0f}", None],
        ["exactly once (incidents, incarnations, claims)", "yes" if result["exactly_once"] else "NO", None],
        *(
            [
                [
                    "spares by priority (replaced / resharded; none of higher priority went without)",
                    f"{order['replaced']} / {order['resharded_or_waiting']}, "
                    + ("in order" if order["in_order"] else "OUT OF ORDER"),
                    None,
                ]
            ]
            if (order := result["spares_by_priority"])
            else []
        ),
    ]
    caption = f"{sitting.caption()}: {result['incidents']} incidents"
    if result["incidents"] < result["faults"] or result["failed"]:
        recovered_first = result.get("failed_after_recovery", 0)
        caption += f" recovered, of {result['faults']} runs hit; {result['failed']} failed"
        caption += f" ({recovered_first} of them after recovering)" if recovered_first else ""
        caption += f", the rest did not recover within {RECOVERY_WAIT_SECONDS:g} s"
        if result["failed"]:
            caption += f" (first failure: {result['failed_first']})"
    return perf_page.Table(["figure", "median / value", "p99"], rows, caption)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200, help="concurrent runs (default 200)")
    parser.add_argument(
        "--spread-seconds",
        type=float,
        default=10.0,
        help="the faults land at random within this many seconds (default 10)",
    )
    parser.add_argument("--workers", type=int, default=1, help="worker processes on the task queue (default 1)")
    parser.add_argument("--kill-worker", action="store_true", help="SIGKILL one worker once half the faults landed")
    parser.add_argument(
        "--store",
        choices=["sqlite", "postgresql"],
        default="sqlite",
        help="the store the workers share: a SQLite file (the default), or a PostgreSQL server the bench starts "
        "on 127.0.0.1 (controllers on several machines)",
    )
    parser.add_argument(
        "--separate-homes",
        action="store_true",
        help="each worker with a LAZARUS_HOME of its own, as workers on several machines; they share the store, "
        "the Temporal server and the runs' folder (LAZARUS_RUNS)",
    )
    parser.add_argument(
        "--rack",
        action="store_true",
        help="instead: one rack holding a node of every run fails at once, with spares for half the runs "
        "(priorities 0, 1, 2 in turn): the spares must go by priority",
    )
    parser.add_argument(
        "--healthy-seconds",
        type=float,
        default=20.0,
        help="how long the watch of healthy runs is measured (default 20)",
    )
    parser.add_argument(
        "--workflow-task-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="the runs' recovery.workflow_task_timeout_seconds (default: the policy's, 10): what a worker killed "
        "inside a local stage costs its runs",
    )
    parser.add_argument("--issue", action="store_true", help="the sittings of the fleet issue, into one page")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--keep-logs",
        type=Path,
        metavar="DIR",
        help="copy each sitting's worker logs into a folder of DIR (otherwise they go with the sitting's home)",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON document")
    perf_page.add_option(parser, __file__)
    args = parser.parse_args()
    if args.runs < 1 or args.spread_seconds < 0 or args.workers < 1 or args.healthy_seconds <= 0:
        parser.error(
            "--runs and --workers must be at least 1, --spread-seconds not negative, --healthy-seconds positive"
        )
    if args.workflow_task_timeout is not None and not 1 <= args.workflow_task_timeout <= 120:
        parser.error("--workflow-task-timeout must be between 1 and 120 seconds")
    if args.kill_worker and args.workers < 2:
        parser.error("--kill-worker needs --workers 2 or more (someone must take over the runs)")
    sittings = (
        ISSUE_SITTINGS
        if args.issue
        else [
            Sitting(
                args.runs,
                args.spread_seconds,
                args.workers,
                args.kill_worker,
                args.rack,
                args.workflow_task_timeout,
                args.store,
                args.separate_homes,
            )
        ]
    )
    page = perf_page.begin()
    started = time.monotonic()
    # Stopped by a signal, the bench still stops its workers and its server (the finally clauses).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("controller_scale: stopped by SIGTERM"))

    def say(message: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    results = []
    for sitting in sittings:
        say(sitting.caption())
        results.append(asyncio.run(measure(sitting, args.healthy_seconds, args.seed, say, args.keep_logs)))
    tables = [table(result) for result in results]
    if args.markdown:
        notes = FLEET_NOTES if args.issue else ()
        perf_page.write_page(
            args.markdown, page, title=PAGE_TITLE, doc=__doc__, about=ABOUT, tables=tables, notes=notes
        )
    if args.json:
        print(json.dumps(results if args.issue else results[0], indent=2))
    else:
        for result, shown in zip(results, tables, strict=True):
            print(f"\n{shown.caption}")
            for name, value, p99 in shown.rows:
                print(f"  {name:<70} {value or '':>12}" + (f"   p99 {p99}" if p99 else ""))
            for problem in result["problems"]:
                print(f"  not exactly once: {problem}")
    if not all(r["exactly_once"] and (r["spares_by_priority"] or {"in_order": True})["in_order"] for r in results):
        sys.exit(1)


if __name__ == "__main__":
    from lazarus.client.runs import exit_after

    exit_after(main)  # past the native client's crash at interpreter exit
