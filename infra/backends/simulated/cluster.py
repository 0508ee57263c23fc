"""A backend whose nodes are records: the controller at sizes and fleets this machine cannot run.

SimulatedCluster has the local backend's run state (infra/pooled.py: run directories, the home's
pool, claims, assignments, quarantine) and, for every node's launcher and ranks, the record they would write: a
process of its own, the simulated launchers, rewrites each live incarnation's node reports
(schema/node_reports.py, the file a launcher keeps) every `report_seconds`, and observe reads them
as the local backend does. So a look at a simulated run of 2,048 nodes reads and parses 2,048
files, as it would on a real one; only the processes are missing. Ranks report their first step
`startup_seconds` after launch and then train `steps_per_second`. A run ends only by being
stopped or terminated (bench/large_run.py, bench/controller_scale.py).

The launchers learn what to report from the home alone, as real nodes would: an incarnation is
live from its launch record until its `ended` marker, and a node the pool holds dead reports
nothing. So any number of workers (`lazarus worker --backend simulated`) serve one home: each
starts a launchers process, one of them (the holder of `simulated/launchers.lock`) writes, and
another takes over within a report interval when its worker dies.
"""

from __future__ import annotations

import fcntl
import json
import multiprocessing
import os
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path

from lazarus.infra.backend import Observation
from lazarus.infra.backends.local import chaos
from lazarus.infra.pool import NodePool
from lazarus.infra.pool_deaths import PoolDeaths
from lazarus.infra.pooled import PooledRunFiles
from lazarus.infra.store import open_store
from lazarus.schema.contract import LaunchRecord, RankObservation, SurvivorSource, read_launch
from lazarus.schema.node_reports import NodeReading, read_node_reports
from lazarus.schema.policy import RecoveryPolicy
from lazarus.schema.records import Assignment
from lazarus.schema.rundir import RunDir

STEPS_PER_SECOND = 20.0
"""How fast simulated ranks train by default (steps a second)."""
STARTUP_SECONDS = 0.5
"""How long simulated ranks take from launch to the start of their first step by default (seconds)."""
REPORT_SECONDS = 0.5
"""How often the simulated launchers rewrite their reports by default (seconds)."""


@dataclass(frozen=True)
class _Incarnation:
    """One simulated launch, as its records say: where, from which step, on which nodes."""

    run: RunDir
    incarnation: int
    nodes: list[str]
    ranks_per_node: int
    resume_step: int
    launched_at: float


@dataclass(frozen=True)
class _Pace:
    """How the simulated ranks train and how often their launchers report (seconds, steps a second)."""

    steps_per_second: float
    startup_seconds: float
    report_seconds: float

    def report(self, sim: _Incarnation, index: int, now: float) -> str:
        """What node `index`'s launcher would report now, as the text of its file: the NodeSummary
        line, then the NodeReport (schema/node_reports.py). Formed as text: 2,048 of them a second
        through pydantic would cost the simulated launchers a core."""
        trained = int((now - sim.launched_at - self.startup_seconds) * self.steps_per_second)
        step, training = sim.resume_step + max(trained, 0), trained > 0
        first = sim.launched_at + self.startup_seconds + 1 / self.steps_per_second
        node = json.dumps(sim.nodes[index])
        started = f',"first_step_at":{first!r},"first_step":{sim.resume_step + 1}' if training else ""
        phase = "training" if training else "starting"
        ranks = ",".join(
            f'{{"rank":{rank},"node":{node},"launched":true,"alive":true,"heartbeat":{{"rank":{rank},'
            f'"step":{step},"phase":"{phase}","time":{now!r},"alive_at":{now!r}{started}}},"launcher_alive":true}}'
            for rank in range(index * sim.ranks_per_node, (index + 1) * sim.ranks_per_node)
        )
        timed = ""
        if trained > 1:  # a launcher times the steps after the first (trainer/agent/node_report.py)
            step_time = f'{{"step":{step},"seconds":{1 / self.steps_per_second!r}}}'
            timed = f',"slowest_step":{step_time},"last_step":{step_time}'
        summary = (
            f'{{"node":{node},"steady":{json.dumps(training)},"lowest_step":{step},"highest_step":{step},'
            f'"oldest_beat":{now!r},"newest_beat":{now!r},"oldest_alive":{now!r},"by_rank":true,'
            f'"trained":{json.dumps(training)}{timed}}}'
        )
        return f'{summary}\n{{"node":{node},"time":{now!r},"ranks":[{ranks}]}}'


class _Live:
    """The incarnations the launchers report for: found in the home's run directories, each read
    once (its assignment and launch record never change) and dropped at its `ended` marker."""

    def __init__(self, runs: Path):
        self.runs = runs
        self.live: dict[tuple[str, int], _Incarnation] = {}
        self.ended: set[tuple[str, int]] = set()

    def scan(self) -> list[_Incarnation]:
        """Every incarnation launched and not ended, now."""
        try:
            names = os.listdir(self.runs)
        except FileNotFoundError:
            return []
        for name in names:
            run = RunDir(self.runs / name)
            try:
                numbers = os.listdir(run.root / "incarnations")
            except FileNotFoundError:
                continue
            for number in numbers:
                key = (name, int(number)) if number.isdigit() else None
                if key is None or key in self.ended or key in self.live:
                    continue
                found = self._read(run, key[1])
                if found is not None:
                    self.live[key] = found
        for key, sim in list(self.live.items()):
            if sim.run.ended_file(sim.incarnation).exists():
                del self.live[key]
                self.ended.add(key)
        return list(self.live.values())

    @staticmethod
    def _read(run: RunDir, incarnation: int) -> _Incarnation | None:
        launch = read_launch(run, incarnation)
        if launch is None or run.ended_file(incarnation).exists():
            return None  # not launched yet (looked at again next time), or over
        assignment = Assignment.model_validate_json(run.assignment_file(incarnation).read_text())
        per_node = assignment.layout.ranks_per_node
        return _Incarnation(run, incarnation, assignment.nodes, per_node, launch.resume_step, launch.launched_at)


def _launchers(runs: Path, store: str, pace: _Pace, parent: int) -> None:
    """The simulated launchers, in a process of their own (as real ones run on other machines, so
    their work shares neither the controller's interpreter lock nor its timing): every
    `report_seconds`, a report from every live node. One process per home writes (the holder of
    its lock); the others wait to take over. It ends with the process that started it."""
    os.nice(19)  # they stand for other machines: on this one, the controller comes first
    lock_path = runs.parent / "simulated" / "launchers.lock"  # one writer for the runs, whichever worker's
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as lock:
        while True:
            if os.getppid() != parent:
                return
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(pace.report_seconds)
        live, pool = _Live(runs), NodePool(open_store(store))
        while os.getppid() == parent:
            started = time.monotonic()
            now, dead = time.time(), pool.unhealthy()
            for sim in live.scan():
                folder = sim.run.node_report_file(sim.incarnation, 0).parent
                folder.mkdir(parents=True, exist_ok=True)
                for index, node in enumerate(sim.nodes):
                    if node not in dead:
                        _replace(f"{folder}{os.sep}{index}.report.json", pace.report(sim, index, now))
            time.sleep(max(0.0, pace.report_seconds - (time.monotonic() - started)))


def _replace(path: str, text: str) -> None:
    """Replace a file atomically, as write_json_atomic does, with no more system calls than that
    takes: 2,048 reports a second are most of what the simulated launchers do."""
    temporary = f"{path}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(temporary, path)


class SimulatedCluster(PooledRunFiles):
    """The pool's run state with node reports, which a process of simulated launchers keeps
    current, in place of rank processes."""

    backend = "local"  # it serves the local backend's specs, at sizes this machine cannot run
    quick_observe = True  # the run directory's files and the pool's record, as the local backend
    shares_host = True  # a run's command and paths are checked as the local backend's would be
    shares_paths = True
    keeps_survivors = False  # its nodes only report: no rank keeps anything

    def __init__(
        self,
        home: str | Path,
        steps_per_second: float = STEPS_PER_SECOND,
        startup_seconds: float = STARTUP_SECONDS,
        report_seconds: float = REPORT_SECONDS,
        store: str | None = None,
        runs: str | Path | None = None,
    ):
        super().__init__(home, store, runs)
        self.launches_done: dict[tuple[str, int], float] = {}  # (run, incarnation) -> when start_ranks returned
        context = multiprocessing.get_context("spawn")  # not a fork of a process with threads
        pace = _Pace(steps_per_second, startup_seconds, report_seconds)
        self._writer = context.Process(
            target=_launchers,
            args=(self.runs, self.store_url, pace, os.getpid()),
            name="simulated-launchers",
            daemon=True,
        )
        self._writer.start()

    def close(self) -> None:
        """Stop the simulated launchers."""
        self._writer.terminate()
        self._writer.join(30)

    # --- the backend ---------------------------------------------------------------------

    def start_ranks(
        self,
        run_id: str,
        incarnation: int,
        resume_step: int,
        skipped: dict[int, str] | None = None,
        policy: RecoveryPolicy | None = None,
        survivors: SurvivorSource | None = None,
    ) -> LaunchRecord:
        """Record the launch: the simulated launchers find it and start reporting for its nodes."""
        self._incarnation(run_id, incarnation)
        record = self.record_launch(run_id, incarnation, resume_step, skipped)
        self.launches_done.setdefault((run_id, incarnation), time.time())
        return record

    def observe(self, run_id: str, incarnation: int) -> Observation:
        """What the node reports say, and the pool's dead nodes; a dead or stopped node's ranks are gone."""
        run, assignment = self._incarnation(run_id, incarnation)
        dead = self.dead_nodes(assignment)
        observation = self._observation(run, incarnation, dead)
        launched = observation.launched_at is not None
        ended = launched and run.ended_file(incarnation).exists()
        running = [launched and not ended and node not in dead for node in assignment.nodes]
        reports = read_node_reports(run, incarnation, [i for i, up in enumerate(running) if up])
        per_node = assignment.layout.ranks_per_node
        for index, node in enumerate(assignment.nodes):
            report = reports.get(index)
            observation.launchers_alive += running[index]
            # Before a launcher's first report its ranks are not started yet; a dead or stopped
            # node's are gone.
            observation.nodes.append(
                report
                if report is not None
                else NodeReading.of_ranks(
                    [
                        RankObservation(rank=rank, node=node, launched=launched and not running[index], alive=False)
                        for rank in range(index * per_node, (index + 1) * per_node)
                    ]
                )
            )
        return observation

    def stop_incarnation(self, run_id: str, incarnation: int) -> list[int]:
        """Mark the incarnation ended (its launchers stop reporting); returns the ranks of its live
        nodes, none when it had ended already."""
        run, assignment = self._incarnation(run_id, incarnation)
        if run.ended_file(incarnation).exists() or self.launch(run, incarnation) is None:
            run.end(incarnation)
            return []
        run.end(incarnation)
        dead = self.dead_nodes(assignment)
        per_node = assignment.layout.ranks_per_node
        return [r for r in range(assignment.layout.world_size) if assignment.nodes[r // per_node] not in dead]

    def stop_nodes(self, run_id: str, incarnation: int, nodes: list[str]) -> list[int]:
        """No process to stop: returns the ranks of `nodes` while the incarnation runs and they live."""
        run, assignment = self._incarnation(run_id, incarnation)
        if run.ended_file(incarnation).exists() or self.launch(run, incarnation) is None:
            return []
        dead, per_node = self.dead_nodes(assignment), assignment.layout.ranks_per_node
        live = [i for i, node in enumerate(assignment.nodes) if node in nodes and node not in dead]
        return [i * per_node + r for i in live for r in range(per_node)]

    def kill_node(self, run_id: str, node: str) -> list[int]:
        """The node dies: the pool marks it dead and its simulated launchers stop reporting."""
        self.update_nodes(run_id, {node: {"healthy": False, "died_at": datetime.now(UTC), "note": "killed"}})
        return []

    def kill_domain(self, domain: str) -> dict[str, str | None]:
        """Every node of the fault domain dies at once: the pool marks them dead, their launchers stop."""
        held = chaos.nodes_of_domain(self, domain)
        dead = {"healthy": False, "died_at": datetime.now(UTC), "note": f"killed with {domain}"}
        self.pool.set_health(dict.fromkeys(held, dead))
        return held

    async def wait_for_exit(self, run_id: str, incarnation: int, timeout: float) -> bool:
        """No process to watch: True as soon as the pool records one of the incarnation's nodes dead."""
        return await self.deaths.wait(self._incarnation(run_id, incarnation)[1].nodes, timeout)

    @cached_property
    def deaths(self) -> PoolDeaths:
        """The watcher of the pool's deaths that every watch of this process shares."""
        return PoolDeaths(self.pool)

    def await_checkpoint_in_flight(self, run_id: str, incarnation: int, grace: float):
        return None, False

    def await_survivors(self, run_id: str, incarnation: int, grace: float) -> dict[int, int]:
        return {}

    def log_tail(self, run_id: str, incarnation: int, rank: int, lines: int = 20) -> str:
        return ""

    def release_standbys(self, run_id: str) -> None:
        pass  # simulated nodes have no standbys

    def stop_run(self, run_id: str) -> None:
        """End every incarnation of the run: its launchers stop reporting."""
        run = self.run_dir(run_id)
        for incarnation in run.incarnations():
            run.end(incarnation)

    def repair_after(self, run_id: str) -> list[str]:
        """Clean-up of an ended run: the pool whole again (chaos.repair_after)."""
        return chaos.repair_after(self, run_id)
