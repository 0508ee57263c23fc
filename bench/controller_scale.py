"""The controller under load: one worker, many concurrent runs, faults injected across them.

    .venv/bin/python bench/controller_scale.py [--runs 200] [--spread-seconds 10] [--json] [--markdown [PATH]]

Every run is a real TrainingRun workflow on a private Temporal dev server, served by one
worker (this process) with the real recovery activities; only the cluster is simulated
(SimulatedCluster below: no processes, ranks that "train" at a fixed rate from their
launch), so what is measured is the controller: Temporal, the workflow, the activities and
the run directories they read and write. Each run has 4 active nodes, and the pool the runs
share one free spare per run; once every run trains, one node of each run dies at a random
moment within --spread-seconds. Printed:
  incidents/s        incidents recovered / (last recovery's first step - first fault)
  report->decision   from detect's fault report to the replace decision being recorded
                     (replace_or_reshard's end, as the workflow records it): median, p99
  fault->first step  the MTTR of the simulated recovery: median, p99
  events/incident    history events from the detect completion that reported the fault to
                     resume's completion, inclusive (median)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ is not an installed package

from bench import perf_page
from lazarus.client import run_status, start_run
from lazarus.config import Settings
from lazarus.history import chain_histories, incident_spans
from lazarus.infra.backend import Observation, RankObservation
from lazarus.infra.local import LocalCluster
from lazarus.infra.temporal_server import local_environment, quiet_runtime
from lazarus.schema import RunState, parse_spec
from lazarus.schema.contract import Heartbeat, LaunchRecord, RankExit
from lazarus.schema.node_reports import NodeReading
from lazarus.worker import build_worker

PAGE_TITLE = "The controller under load"
ABOUT = """One worker process serves many concurrent TrainingRun workflows on a private Temporal dev
server, with the real recovery activities; only the cluster is simulated (ranks in memory, no
processes), so what is measured is the controller: Temporal, the workflow, the activities and the
run directories they read and write. Each run has 4 active nodes, and the pool the runs share holds
one free spare per run; once every run trains, one node of each run dies at a random moment within
the spread. *Incidents handled per second* is the incidents recovered over the time from the first
fault to the last recovery's first step; *fault report -> replace decision* runs from detect's
report to replace_or_reshard's end as the workflow records it; *fault -> first step* is the
simulated recovery's MTTR (it includes the simulated ranks' 0.55 s from launch to their first step);
*history events per incident* counts from the detect completion that reported the fault through
resume's completion."""


class SimulatedCluster(LocalCluster):
    """The local backend's run directories and inventory, with ranks simulated in memory.

    An incarnation's ranks are alive from start_ranks until it is stopped or their node is
    killed; they report their first step `startup_seconds` after launch and then train
    `steps_per_second`. Everything else (assignments, claims, quarantine) is LocalCluster's.
    """

    def __init__(self, home: Path, steps_per_second: float = 20.0, startup_seconds: float = 0.5):
        super().__init__(home)
        self.steps_per_second = steps_per_second
        self.startup_seconds = startup_seconds
        self._launched: dict[tuple[str, int], float] = {}
        self._stopped: set[tuple[str, int]] = set()

    def start_ranks(
        self, run_id: str, incarnation: int, resume_step: int, skipped=None, policy=None, survivors=None
    ) -> LaunchRecord:
        record = self.record_launch(run_id, incarnation, resume_step, skipped)
        self._launched.setdefault((run_id, incarnation), record.launched_at)
        return record

    def observe(self, run_id: str, incarnation: int) -> Observation:
        run, assignment = self._incarnation(run_id, incarnation)
        spec = self.spec(run_id)
        dead = {n.name: n.died_at for n in self.inventory(run_id).nodes if not n.healthy and n.name in assignment.nodes}
        observation = self._observation(run, incarnation, dead)
        now = time.time()
        launched = self._launched.get((run_id, incarnation))
        running = launched is not None and (run_id, incarnation) not in self._stopped
        trained = 0 if launched is None else int((now - launched - self.startup_seconds) * self.steps_per_second)
        step = min(observation.resume_step + max(trained, 0), spec.trainer.steps)
        finished = running and step >= spec.trainer.steps
        first = None if launched is None else launched + self.startup_seconds + 1 / self.steps_per_second
        layout = assignment.layout
        # Observation.ranks is read from its nodes: each node's ranks go into a NodeReading.
        per_node: list[list[RankObservation]] = [[] for _ in assignment.nodes]
        for rank in range(layout.world_size):
            index = layout.node_of_rank(rank)
            node = assignment.nodes[index]
            alive = running and node not in dead and not finished
            beat = None
            if running:
                phase = "training" if trained > 0 else "starting"
                beat = Heartbeat(
                    rank=rank, step=step, time=now, phase=phase, first_step_at=first if trained > 0 else None
                )
            ended = RankExit(rank=rank, code=0, step=step, time=now) if finished else None
            per_node[index].append(
                RankObservation(
                    rank=rank,
                    node=node,
                    launched=launched is not None,
                    alive=alive,
                    heartbeat=beat,
                    exit=ended,
                    launcher_alive=alive,
                )
            )
        observation.nodes = [NodeReading.of_ranks(ranks) for ranks in per_node]
        observation.launchers_alive = sum(1 for r in observation.ranks if r.launcher_alive)
        return observation

    def stop_incarnation(self, run_id: str, incarnation: int) -> list[int]:
        self._stopped.add((run_id, incarnation))
        return list(range(self.assignment(run_id, incarnation).layout.world_size))

    def kill_node(self, run_id: str, node: str) -> list[int]:
        self.update_nodes(run_id, {node: {"healthy": False, "died_at": datetime.now(UTC), "note": "killed"}})
        return []

    async def wait_for_exit(self, run_id: str, incarnation: int, timeout: float) -> bool:
        await asyncio.sleep(timeout)  # simulated ranks have no process to watch
        return False

    def await_checkpoint_in_flight(self, run_id: str, incarnation: int, grace: float):
        return None, False

    def log_tail(self, run_id: str, incarnation: int, rank: int, lines: int = 20) -> str:
        return ""

    def release_standbys(self, run_id: str) -> None:
        pass

    def ensure_standbys(self, run_id: str) -> None:
        pass


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def events_per_incident(client, run_id: str) -> int | None:
    """History events from the detect completion that reported the fault through resume's completion."""
    spans = incident_spans((await chain_histories(client, run_id))[0])
    return spans[0] if spans else None


async def bench(runs: int, spread: float, seed: int, say) -> dict:
    env = await local_environment(runtime=quiet_runtime())
    rng = random.Random(seed)
    try:
        with tempfile.TemporaryDirectory() as home:
            cluster = SimulatedCluster(Path(home))
            settings = Settings(task_queue="controller-scale")
            spec = parse_spec(
                {
                    "name": "scale",
                    "trainer": {"steps": 10_000_000, "checkpoint_every": 1000},
                    "cluster": {"active_nodes": 4, "spare_nodes": 1},
                    "recovery": {
                        "heartbeat_interval_seconds": 0.5,
                        "hang_after_seconds": 30,
                        "progress_every_seconds": 30,
                    },
                }
            )
            ids = [f"scale-{i:03d}" for i in range(runs)]
            async with build_worker(env.client, settings.task_queue, cluster):
                started = time.monotonic()
                await asyncio.gather(*(start_run(env.client, settings, spec, run_id) for run_id in ids))
                say(f"{runs} runs started in {time.monotonic() - started:.1f} s; waiting until each is launched")
                while True:
                    statuses = await asyncio.gather(*(run_status(env.client, run_id) for run_id in ids))
                    if all(s.state == RunState.TRAINING for s in statuses):
                        break
                    await asyncio.sleep(0.5)
                say(
                    f"all launched after {time.monotonic() - started:.1f} s; one node of each run dies "
                    f"within {spread:g} s"
                )

                # The runs share the home's pool, whose free nodes are every run's spares: one per run,
                # added once every run holds its active nodes (before, create would take them as actives).
                cluster.pool.add(runs - 1, "a hot spare per run")
                actives = {
                    run_id: sorted(n.name for n in cluster.inventory(run_id).nodes if n.role == "active")
                    for run_id in ids
                }

                async def fault(run_id: str) -> None:
                    await asyncio.sleep(rng.uniform(0, spread))
                    await asyncio.to_thread(cluster.kill_node, run_id, rng.choice(actives[run_id]))

                await asyncio.gather(*(fault(run_id) for run_id in ids))
                while True:
                    statuses = await asyncio.gather(*(run_status(env.client, run_id) for run_id in ids))
                    done = sum(1 for s in statuses if s.incidents and s.incidents[0].outcome == "recovered")
                    if done == runs:
                        break
                    failed = [s for s in statuses if s.state == RunState.FAILED]
                    if failed:
                        raise SystemExit(f"controller_scale: run {failed[0].run_id} failed: {failed[0].reason}")
                    await asyncio.sleep(1.0)
                say(f"all {runs} recovered after {time.monotonic() - started:.1f} s; reading histories")
                incidents = [s.incidents[0] for s in statuses]
                events = [await events_per_incident(env.client, run_id) for run_id in ids]
                # Terminating cancels the run's activities; each would log its cancellation.
                logging.getLogger("temporalio").setLevel(logging.CRITICAL)
                for run_id in ids:
                    await env.client.get_workflow_handle(run_id).terminate("benchmark done")
    finally:
        await env.shutdown()
    to_decision = [(i.stages["replace_or_reshard"].ended_at - i.fault.detected_at).total_seconds() for i in incidents]
    mttr = [i.mttr_seconds for i in incidents]
    first_fault = min(i.fault.occurred_at for i in incidents)
    last_step = max(i.first_step_at for i in incidents)
    return {
        "runs": runs,
        "incidents": len(incidents),
        "incidents_per_s": len(incidents) / (last_step - first_fault).total_seconds(),
        "report_to_decision_median_s": statistics.median(to_decision),
        "report_to_decision_p99_s": percentile(to_decision, 99),
        "mttr_median_s": statistics.median(mttr),
        "mttr_p99_s": percentile(mttr, 99),
        "events_per_incident": statistics.median([e for e in events if e is not None]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200, help="concurrent runs (default 200)")
    parser.add_argument(
        "--spread-seconds",
        type=float,
        default=10.0,
        help="the faults (one per run) land at random within this many seconds (default 10)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    perf_page.add_option(parser, __file__)
    args = parser.parse_args()
    if args.runs < 1 or args.spread_seconds < 0:
        parser.error("--runs must be at least 1 and --spread-seconds not negative")
    sitting = perf_page.begin()
    started = time.monotonic()

    def say(message: str) -> None:
        if not args.json:
            print(f"[{time.monotonic() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    result = asyncio.run(bench(args.runs, args.spread_seconds, args.seed, say))
    if args.markdown:
        write_markdown(args, sitting, result)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"\nOne worker, {result['runs']} concurrent runs, {result['incidents']} incidents "
        f"(one node of each run killed within {args.spread_seconds:g} s)"
    )
    print(f"  incidents handled per second     {result['incidents_per_s']:8.2f}")
    print(
        f"  fault report -> replace decision {result['report_to_decision_median_s']:8.3f} s median, "
        f"{result['report_to_decision_p99_s']:.3f} s p99"
    )
    print(
        f"  fault -> first step (simulated)  {result['mttr_median_s']:8.3f} s median, {result['mttr_p99_s']:.3f} s p99"
    )
    print(f"  history events per incident      {result['events_per_incident']:8.0f}")


def write_markdown(args, sitting, result: dict) -> None:
    caption = (
        f"One worker, {result['runs']} concurrent runs, {result['incidents']} incidents "
        f"(one node of each run killed within {args.spread_seconds:g} s)"
    )
    rows = [
        ["incidents handled per second", f"{result['incidents_per_s']:.2f}", None],
        [
            "fault report -> replace decision, median (s)",
            f"{result['report_to_decision_median_s']:.3f}",
            f"{result['report_to_decision_p99_s']:.3f}",
        ],
        [
            "fault -> first step (simulated), median (s)",
            f"{result['mttr_median_s']:.3f}",
            f"{result['mttr_p99_s']:.3f}",
        ],
        ["history events per incident", f"{result['events_per_incident']:.0f}", None],
    ]
    table = perf_page.Table(["figure", "value", "p99"], rows, caption)
    perf_page.write_page(args.markdown, sitting, title=PAGE_TITLE, doc=__doc__, about=ABOUT, tables=[table])


if __name__ == "__main__":
    main()
