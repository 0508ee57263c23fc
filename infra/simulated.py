"""A backend whose nodes are records: the controller at sizes this machine cannot run.

SimulatedCluster is LocalCluster (run directories, the home's pool, claims, assignments,
quarantine) with every node's launcher and ranks replaced by the record they would write: a
process of its own rewrites each live incarnation's node reports (schema/node_reports.py,
the file a launcher keeps) every `report_seconds`, and observe reads them as the local backend does. So a
look at a simulated run of 2,048 nodes reads and parses 2,048 files, as it would on a real one;
only the processes are missing. Ranks report their first step `startup_seconds` after launch and
then train `steps_per_second`. A run ends only by being stopped or terminated (bench/large_run.py).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from lazarus.infra.backend import Observation
from lazarus.infra.local import LocalCluster
from lazarus.schema.contract import LaunchRecord, RankObservation, SurvivorSource
from lazarus.schema.node_reports import NodeReading, read_node_reports
from lazarus.schema.policy import RecoveryPolicy
from lazarus.schema.rundir import RunDir


@dataclass
class _Incarnation:
    """One simulated launch: when, from which step, on which nodes; which nodes died."""

    run: RunDir
    incarnation: int
    nodes: list[str]
    ranks_per_node: int
    resume_step: int
    launched_at: float
    dead: set[int] = field(default_factory=set)  # node indexes killed
    stopped: bool = False


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
        summary = (
            f'{{"node":{node},"steady":{json.dumps(training)},"lowest_step":{step},"highest_step":{step},'
            f'"oldest_beat":{now!r},"newest_beat":{now!r},"oldest_alive":{now!r},"by_rank":true,'
            f'"trained":{json.dumps(training)}}}'
        )
        return f'{summary}\n{{"node":{node},"time":{now!r},"ranks":[{ranks}]}}'


def _launchers(commands, pace: _Pace, parent: int) -> None:
    """The simulated launchers, in a process of their own (as real ones run on other machines, so
    their work shares neither the controller's interpreter lock nor its timing): every
    `report_seconds`, a report from every live node. `commands` brings launches, deaths and
    stops; None ends it, and so does the end of the process that started it."""
    live: dict[tuple[str, int], _Incarnation] = {}
    # They stand for other machines: on this one, the controller comes first.
    os.nice(19)
    while os.getppid() == parent:
        deadline = time.monotonic() + pace.report_seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                if not commands.poll(left):
                    break
                command = commands.recv()
            except EOFError:
                return  # the other end is gone

            if command is None:
                return
            kind, key, detail = command
            if kind == "launch":
                live[key] = detail
            elif kind == "dead" and key in live:
                live[key].dead.add(detail)
            elif kind == "stop":
                live.pop(key, None)
        now = time.time()
        for sim in live.values():
            folder = sim.run.node_report_file(sim.incarnation, 0).parent
            folder.mkdir(parents=True, exist_ok=True)
            for index in range(len(sim.nodes)):
                if index not in sim.dead:
                    _replace(f"{folder}{os.sep}{index}.report.json", pace.report(sim, index, now))


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


class SimulatedCluster(LocalCluster):
    """LocalCluster with rank processes replaced by node reports that a process of simulated
    launchers keeps current."""

    def __init__(
        self, home: str | Path, steps_per_second: float = 20.0, startup_seconds: float = 0.5, report_seconds=0.5
    ):
        super().__init__(home)
        self.launches_done: dict[tuple[str, int], float] = {}  # (run, incarnation) -> when start_ranks returned
        self._live: dict[tuple[str, int], _Incarnation] = {}
        self._guard = threading.Lock()
        self._sending = threading.Lock()
        context = multiprocessing.get_context("spawn")  # not a fork of a process with threads
        # A pipe, not a Queue: a Queue's semaphores are finalized whenever they are collected, which
        # can be inside a workflow's sandbox, where the finalizer may not import what it needs.
        theirs, self._commands = context.Pipe(duplex=False)
        pace = _Pace(steps_per_second, startup_seconds, report_seconds)
        self._writer = context.Process(
            target=_launchers, args=(theirs, pace, os.getpid()), name="simulated-launchers", daemon=True
        )
        self._writer.start()

    def _send(self, command) -> None:
        with self._sending:  # one writer at a time on the pipe
            self._commands.send(command)

    def close(self) -> None:
        """Stop the simulated launchers."""
        self._send(None)
        self._commands.close()
        self._writer.join(30)
        if self._writer.is_alive():
            self._writer.kill()
            self._writer.join()

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
        """Record the launch and have every node report its ranks started (once)."""
        run, assignment = self._incarnation(run_id, incarnation)
        record = self.record_launch(run_id, incarnation, resume_step, skipped)
        with self._guard:
            if (run_id, incarnation) not in self._live:
                per_node = assignment.layout.ranks_per_node
                sim = _Incarnation(run, incarnation, assignment.nodes, per_node, record.resume_step, time.time())
                self._live[(run_id, incarnation)] = sim
                self._send(("launch", (run_id, incarnation), sim))
        self.launches_done.setdefault((run_id, incarnation), time.time())
        return record

    def observe(self, run_id: str, incarnation: int) -> Observation:
        """What the node reports say, and the pool's dead nodes; a dead or stopped node's ranks are gone."""
        run, assignment = self._incarnation(run_id, incarnation)
        observation = self._observation(run, incarnation, self.dead_nodes(assignment))
        sim = self._live.get((run_id, incarnation))
        per_node = assignment.layout.ranks_per_node
        running = [sim is not None and not sim.stopped and i not in sim.dead for i in range(len(assignment.nodes))]
        reports = read_node_reports(run, incarnation, [i for i, up in enumerate(running) if up])
        for index, node in enumerate(assignment.nodes):
            report = reports.get(index)
            observation.launchers_alive += running[index]
            launched = sim is not None and not running[index]
            # Before a launcher's first report its ranks are not started yet; a dead or stopped
            # node's are gone.
            observation.nodes.append(
                report
                if report is not None
                else NodeReading.of_ranks(
                    [
                        RankObservation(rank=rank, node=node, launched=launched, alive=False)
                        for rank in range(index * per_node, (index + 1) * per_node)
                    ]
                )
            )
        return observation

    def stop_incarnation(self, run_id: str, incarnation: int) -> list[int]:
        sim = self._live.get((run_id, incarnation))
        run, assignment = self._incarnation(run_id, incarnation)
        run.end(incarnation)
        if sim is None or sim.stopped:
            return []
        sim.stopped = True
        self._send(("stop", (run_id, incarnation), None))
        return [r for r in range(assignment.layout.world_size) if r // sim.ranks_per_node not in sim.dead]

    def kill_node(self, run_id: str, node: str) -> list[int]:
        """The node dies: the pool marks it dead and its simulated launchers stop reporting."""
        self.update_nodes(run_id, {node: {"healthy": False, "died_at": datetime.now(UTC), "note": "killed"}})
        with self._guard:
            for key, sim in self._live.items():
                if key[0] == run_id and node in sim.nodes:
                    sim.dead.add(sim.nodes.index(node))
                    self._send(("dead", key, sim.nodes.index(node)))
        return []

    async def wait_for_exit(self, run_id: str, incarnation: int, timeout: float) -> bool:
        await asyncio.sleep(timeout)  # no process to watch: the next look tells
        return False

    def await_checkpoint_in_flight(self, run_id: str, incarnation: int, grace: float):
        return None, False

    def await_survivors(self, run_id: str, incarnation: int, grace: float) -> dict[int, int]:
        return {}

    def log_tail(self, run_id: str, incarnation: int, rank: int, lines: int = 20) -> str:
        return ""

    def release_standbys(self, run_id: str) -> None:
        pass

    def ensure_standbys(self, run_id: str) -> None:
        pass
