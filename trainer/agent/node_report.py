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

from lazarus.schema.contract import ContractError, RankObservation, read_exit, read_heartbeat
from lazarus.schema.files import lock_is_held
from lazarus.schema.node_reports import NodeReport, write_node_report
from lazarus.schema.rundir import RunDir
from lazarus.trainer.agent.health_check import HealthCheck
from lazarus.trainer.agent.idle import IdleWatch
from lazarus.trainer.agent.stacks import StackOrders

REPORT_POLL_SECONDS = 0.05
"""How often the reporter looks at its ranks (seconds): a change other than an exit the launcher
recorded (which wakes it) is in the report within this."""

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
        if force or (ranks, sick) != self._last or now - self._written_at >= self.interval:
            report = NodeReport(node=self.node, time=now, ranks=ranks, sick=sick)
            write_node_report(self.run, self.incarnation, self.node_index, report)
            self._last, self._written_at = (ranks, sick), now
