"""What a node's launcher reads in its ranks' output: heartbeats for a script that writes none
(trainer.progress_pattern, trainer.output_is_heartbeat), and the planned faults such a script
cannot carry out itself.

The ranks write their output straight to their log files (a pipe through the launcher would
make a slow launcher stall its ranks); a thread of the launcher reads what they appended, every
POLL_SECONDS. A rank whose own heartbeat file shows up (lazarus.session, the built-in trainer)
reports for itself from then on: the launcher never overwrites what a rank wrote.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from lazarus.schema.contract import Heartbeat, read_heartbeat, write_heartbeat
from lazarus.schema.run import FaultInjection, TrainerSettings
from lazarus.schema.rundir import RunDir

POLL_SECONDS = 0.02
"""How often the launcher reads what its ranks printed (seconds)."""


@dataclass
class RankOutput:
    """One rank's log as its launcher reads it, and what the output said so far."""

    rank: int
    pid: int
    log: Path
    offset: int  # where this process's output starts in the log (a retried launch appends)
    started: float
    partial: bytes = b""
    step: int | None = None
    first_step: int | None = None
    first_step_at: float | None = None
    phases: dict[str, float] = field(default_factory=dict)
    reports_itself: bool = False


class OutputWatch:
    """A launcher's thread that turns its ranks' output into heartbeats and carries out a planned
    fault of its node that the ranks do not carry out themselves."""

    def __init__(self, run: RunDir, incarnation: int, trainer: TrainerSettings, fault: FaultInjection | None):
        self.run, self.incarnation, self.trainer, self.fault = run, incarnation, trainer, fault
        self.ranks: dict[int, RankOutput] = {}
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._fault_done = False
        self._thread = threading.Thread(target=self._loop, name="output-watch", daemon=True)

    @property
    def needed(self) -> bool:
        """Whether there is anything to watch: output heartbeats, or a fault only the launcher can carry out
        (after a time; at a step, only where the output names steps)."""
        fault = self.fault
        timed_or_read = fault is not None and (fault.after_seconds is not None or self.trainer.progress_pattern)
        return self.trainer.output_heartbeats or bool(timed_or_read)

    def add(self, rank: int, pid: int, log: Path, offset: int) -> None:
        """Watch a rank just started; with output as heartbeat, it is `starting` from now."""
        output = RankOutput(rank, pid, log, offset, time.time())
        with self._lock:
            self.ranks[rank] = output
            if self.trainer.output_is_heartbeat:
                self._beat(output, "starting", output.started)

    def start(self) -> None:
        if self.needed and self.ranks:
            self._thread.start()

    def finish(self, rank: int) -> None:
        """Read the rest of an ended rank's output (its exit record takes the last step from it)."""
        with self._lock:
            if rank in self.ranks:
                self._read(self.ranks.pop(rank))

    def stop(self) -> None:
        self._done.set()

    def _loop(self) -> None:
        while not self._done.wait(POLL_SECONDS):
            with self._lock:
                for output in list(self.ranks.values()):
                    self._read(output)
                self._carry_out_fault()

    def _read(self, output: RankOutput) -> None:
        try:
            with open(output.log, "rb") as log:
                log.seek(output.offset)
                data = log.read()
        except FileNotFoundError:
            return
        if not data:
            return
        output.offset += len(data)
        *lines, output.partial = (output.partial + data).split(b"\n")
        if not lines:
            return
        now = time.time()
        stepped = False
        for line in lines:
            step = self.trainer.step_in(line.decode(errors="replace"))
            if step is not None:
                stepped = True
                output.step = step
                if output.first_step is None:
                    output.first_step, output.first_step_at = step, now
        if stepped or self.trainer.output_is_heartbeat:
            self._beat(output, "training", now)

    def _beat(self, output: RankOutput, phase: str, now: float) -> None:
        """Write the rank's heartbeat, unless the rank writes its own."""
        if not self.trainer.output_heartbeats or output.reports_itself:
            return
        own = read_heartbeat(self.run, self.incarnation, output.rank)
        if own is not None and own.by == "rank":
            output.reports_itself = True
            return
        output.phases.setdefault(phase, now)
        beat = Heartbeat(
            rank=output.rank,
            step=output.step,
            phase=phase,
            time=now,
            phases=output.phases,
            first_step_at=output.first_step_at,
            first_step=output.first_step,
            by="launcher",
        )
        write_heartbeat(self.run, self.incarnation, beat)

    def _carry_out_fault(self) -> None:
        """SIGKILL the node's ranks once the planned fault is due: `after_seconds` from their start,
        or the step before `step` in their output (a rank that reports for itself dies on its own)."""
        fault = self.fault
        if fault is None or self._fault_done or not self.ranks:
            return
        if fault.after_seconds is not None:
            due = time.time() - min(o.started for o in self.ranks.values()) >= fault.after_seconds
        else:
            due = fault.point == "step" and any(
                not o.reports_itself and o.step is not None and o.step >= fault.step - 1 for o in self.ranks.values()
            )
        if not due:
            return
        self._fault_done = True
        for output in self.ranks.values():
            try:
                os.kill(output.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
