"""A node's launcher reports its ranks in one file (schema/node_reports.py), so the
controller's look at a run costs a read per node, not three per rank.

The reporter reads what the controller would otherwise read itself: each rank's liveness lock,
newest heartbeat and exit record, all files of this node, and since when each rank's process has
sat idle (trainer/agent/idle.py). It rewrites the report when any of them changed (a step, an exit: the
launcher wakes it when it records one) and at least every heartbeat interval, and once more when
the launcher ends. Between reports it carries out the controller's requests for its ranks' stacks
(trainer/agent/stacks.py).
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque

from lazarus.schema.contract import ContractError, RankObservation, read_exit, read_heartbeat
from lazarus.schema.files import lock_is_held
from lazarus.schema.node_reports import NodeReport, StepTime, write_node_report
from lazarus.schema.rundir import RunDir
from lazarus.trainer.agent.health_check import HealthCheck
from lazarus.trainer.agent.idle import IdleWatch
from lazarus.trainer.agent.stacks import StackOrders

REPORT_POLL_SECONDS = 0.05
"""How often the reporter looks at its ranks (seconds): a change other than an exit the launcher
recorded (which wakes it) is in the report within this."""

STEP_WINDOW_SECONDS = 10.0
"""The report's slowest step is the slowest of those completed this long before it (seconds): at
least twice the longest wait between detect's looks at a steady run (activities/watching.py
STEADY_LOOK_SECONDS), so every step is in some look's window however seldom it looks."""

IDLE_SAMPLE_MAX_SECONDS = 1.0
"""The longest time between two looks at a rank's CPU and output (seconds), whatever the heartbeat
interval: a derived hang time can be as short as a second or two."""


class NodeReporter:
    """The thread of a launcher that keeps its node's report current."""

    def __init__(self, run: RunDir, incarnation: int, node_index: int, node: str, ranks: range, interval: float):
        self.run, self.incarnation, self.node_index, self.node = run, incarnation, node_index, node
        self.ranks = ranks
        self.interval = interval
        self.launched: set[int] = set()  # ranks this node's launchers started
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._loop, name="node-report", daemon=True)
        self.health: HealthCheck | None = None  # where the spec names one (trainer/agent/health_check.py)
        # A busy rank's idle_since moves at every sample, and with it the report: a sample per
        # interval adds no write to those the interval makes anyway (past a 1 s interval, one a second).
        self.idle = IdleWatch(run, incarnation, min(interval, IDLE_SAMPLE_MAX_SECONDS))
        self.stacks = StackOrders(run, incarnation, ranks)
        self.step_times = StepTimes()
        self._last: tuple[list[RankObservation], str | None] | None = None
        self._written_at = 0.0
        self._complained = False
        # An earlier launcher's report of this node speaks for ranks it saw; until this one's
        # first, the controller reads the ranks' own files.
        run.node_report_file(incarnation, node_index).unlink(missing_ok=True)

    def start(self) -> None:
        self.write()
        self._thread.start()

    def move_to(self, incarnation: int) -> None:
        """Report the same ranks as those of `incarnation` from now on (their launcher followed them
        there: trainer/agent/follow.py)."""
        self.idle = IdleWatch(self.run, incarnation, self.idle.sample_seconds)
        self.stacks = StackOrders(self.run, incarnation, self.ranks)
        self.incarnation = incarnation
        self.step_times = StepTimes()
        self._last = None
        self.changed()

    def changed(self) -> None:
        """Something the report holds changed (an exit was recorded): write it now."""
        self._wake.set()

    def stop(self) -> None:
        """The launcher ends: a last report, with every exit."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()
        self.write(force=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(REPORT_POLL_SECONDS)
            self._wake.clear()
            self._carry_out_stack_requests()
            self.write()

    def _carry_out_stack_requests(self) -> None:
        try:
            self.stacks.poll()
        except (OSError, ValueError) as error:  # a request must never end the report
            print(f"lazarus launcher: a stack request failed: {error}", file=sys.stderr, flush=True)

    def _observe(self) -> list[RankObservation]:
        k, now = self.incarnation, time.time()
        ranks = []
        for rank in self.ranks:
            ended = read_exit(self.run, k, rank)
            alive = lock_is_held(self.run.lock_file(k, rank))
            ranks.append(
                RankObservation(
                    rank=rank,
                    node=self.node,
                    launched=rank in self.launched or ended is not None,
                    alive=alive,
                    heartbeat=read_heartbeat(self.run, k, rank),
                    exit=ended,
                    launcher_alive=True,
                    idle_since=self.idle.idle_since(rank, now) if alive and ended is None else None,
                    held=self.idle.held(rank) if alive and ended is None else None,
                )
            )
        return ranks

    def write(self, force: bool = False) -> None:
        """Write the report if it changed, is due, or `force`."""
        try:
            ranks = self._observe()
        except ContractError as error:
            # A rank wrote a file that is not its record: the controller, reading it itself, says so.
            if not self._complained:
                print(f"lazarus launcher: not reporting node {self.node}'s ranks: {error}", file=sys.stderr, flush=True)
                self._complained = True
            self.run.node_report_file(self.incarnation, self.node_index).unlink(missing_ok=True)
            return
        now = time.time()
        sick = self.health.failure if self.health is not None else None
        slowest, last = self.step_times.take(ranks, now)
        if force or (ranks, sick) != self._last or now - self._written_at >= self.interval:
            report = NodeReport(node=self.node, time=now, ranks=ranks, sick=sick, slowest_step=slowest, last_step=last)
            write_node_report(self.run, self.incarnation, self.node_index, report)
            self._last, self._written_at = (ranks, sick), now


class StepTimes:
    """How long the node's ranks take over each step, from their heartbeats as the reporter sees them
    (every REPORT_POLL_SECONDS): a rank seen to advance k steps in t seconds took t/k over each.
    The first step after a start or a restore is left out: it holds the warm-up."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (its newest step past its first, when)
        self._recent: deque[tuple[float, int, float]] = deque()  # (when, step, seconds), oldest first

    def take(self, ranks: list[RankObservation], now: float) -> tuple[StepTime | None, StepTime | None]:
        """Take in the ranks' newest heartbeats; returns the slowest step of the window and the newest."""
        for r in ranks:
            beat = r.heartbeat
            if beat is None or beat.step is None or beat.first_step_at is None or beat.phase != "training":
                continue
            before = self._seen.get(r.rank)
            if before is None or beat.step < before[0]:  # a new process: its first step is warm-up
                self._seen[r.rank] = (beat.step, beat.time)
                continue
            if beat.step > before[0]:
                self._recent.append((beat.time, beat.step, (beat.time - before[1]) / (beat.step - before[0])))
                self._seen[r.rank] = (beat.step, beat.time)
        while self._recent and self._recent[0][0] < now - STEP_WINDOW_SECONDS:
            self._recent.popleft()
        if not self._recent:
            return None, None
        _, step, seconds = max(self._recent, key=lambda sample: sample[2])
        _, newest, newest_seconds = max(self._recent)  # the newest heartbeat's
        return StepTime(step=step, seconds=seconds), StepTime(step=newest, seconds=newest_seconds)
