"""What a node's launcher reads in its ranks' output: heartbeats for a script that writes none
(trainer.progress_pattern, trainer.output_is_heartbeat), and the planned faults such a script
cannot carry out itself.

The ranks write their output straight to their log files (a pipe through the launcher would
make a slow launcher stall its ranks); a thread of the launcher reads what they appended, every
POLL_SECONDS. A line ends at `\n`, `\r\n` or a lone `\r` (a progress bar such as tqdm's
redraws itself after a `\r`); a line not yet ended is read only once it did not grow for a poll
(a rank may be half way through writing it; a bar's newest redraw stays unended until the next),
and never for a step below the newest. A rank whose own heartbeat file shows up (lazarus.session, the built-in
trainer) reports for itself from then on: the launcher never overwrites what a rank wrote.

Nothing a rank prints may end the watch: an error while reading one line or writing one
heartbeat is said once on the launcher's stderr, and the watch reads on.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from lazarus.schema.contract import Heartbeat, Phase, read_heartbeat, write_heartbeat
from lazarus.schema.run import FaultInjection, TrainerSettings
from lazarus.schema.rundir import RunDir

POLL_SECONDS = 0.02
"""How often the launcher reads what its ranks printed (seconds)."""

LINE_END = re.compile(rb"\r\n|\r|\n")
"""What ends a line of a rank's output: a newline, or a carriage return (a redrawn progress bar)."""

MAX_LINE_BYTES = 65536
"""The most of one line the launcher keeps and matches (bytes): the end of a longer one, where its
newest step is, so output without line ends cannot grow the launcher without bound."""

NO_MATCH_WARNING_SECONDS = 120.0
"""How long after a rank started, with lines printed and trainer.progress_pattern matching none
of them, its launcher warns the operator in the rank's heartbeat (seconds): long enough for a
script's start-up chatter (imports, data loading) to be over."""

NO_MATCH_REFRESH_SECONDS = 1.0
"""How often a launcher rewrites the warning heartbeat of a rank whose output says no step
(seconds), so that the heartbeat it wrote only to warn never looks stale to the hang check (a
rank that reports no step is not watched for hangs; the warning must not change that)."""


@dataclass
class RankOutput:
    """One rank's log as its launcher reads it, and what the output said so far."""

    rank: int
    pid: int
    log: Path
    offset: int  # where this process's output starts in the log (a retried launch appends)
    started: float
    partial: bytes = b""
    lines: int = 0  # lines read that were not blank
    step: int | None = None
    first_step: int | None = None
    first_step_at: float | None = None
    advanced_at: float | None = None  # when a step above first_step was first read
    partial_read: bytes = b""  # the unended line last read as it stood (a progress bar's newest redraw)
    phases: dict[str, float] = field(default_factory=dict)
    phase: Phase = "starting"  # the phase of the newest heartbeat the launcher wrote
    beat_at: float | None = None  # when the launcher last wrote the rank's heartbeat
    warning: str | None = None  # trainer.progress_pattern matched none of the rank's lines
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
        # One rank's warning per node tells the operator; more would only make the controller
        # read more ranks (a node whose heartbeats carry a warning is read rank by rank).
        self._warned = False
        self._said: set[tuple[int | None, str]] = set()  # (rank, what failed) already said on stderr
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

    def move_to(self, incarnation: int) -> None:
        """Write the ranks' heartbeats as those of `incarnation` from now on (trainer/agent/follow.py)."""
        self.incarnation = incarnation

    def start(self) -> None:
        """Start the watch's thread, if there is anything to watch."""
        if self.needed and self.ranks:
            self._thread.start()

    def finish(self, rank: int) -> None:
        """Read the rest of an ended rank's output, its last line too (its exit record takes the last
        step from it)."""
        with self._lock:
            if rank in self.ranks:
                output = self.ranks.pop(rank)
                self._guarded(output.rank, "read its output", lambda: self._read(output, time.time(), ended=True))

    def stop(self) -> None:
        """End the watch's thread (it ends on its own with the launcher, too)."""
        self._done.set()

    def poll(self, now: float | None = None) -> None:
        """Read what every rank printed since the last poll, as at `now` (default: the clock), and carry
        out the planned fault once it is due; what the thread does every POLL_SECONDS."""
        now = time.time() if now is None else now
        with self._lock:
            for output in list(self.ranks.values()):
                self._guarded(output.rank, "read its output", lambda output=output: self._read(output, now))
            self._guarded(None, "carry out the planned fault", self._carry_out_fault)

    def _loop(self) -> None:
        while not self._done.wait(POLL_SECONDS):
            self.poll()

    def _guarded(self, rank: int | None, doing: str, action) -> None:
        """Run `action`; an error in it is said once (per rank and `doing`) on stderr, and the watch goes on."""
        try:
            action()
        except Exception as error:  # noqa: BLE001 - nothing a rank prints may end the watch
            self._complain(rank, doing, error)

    def _complain(self, rank: int | None, doing: str, error: Exception) -> None:
        """Say on stderr that `doing` failed, the first time it fails for this rank (a rank that prints
        a bad line every step must not flood the launcher's log)."""
        if (rank, doing) in self._said:
            return
        self._said.add((rank, doing))
        whose = "" if rank is None else f"rank {rank}: "
        message = (f"{type(error).__name__}: {error}".splitlines() or [""])[0][:300]
        print(f"lazarus launcher: {whose}cannot {doing} ({message}); watching on", file=sys.stderr, flush=True)

    def _read(self, output: RankOutput, now: float, ended: bool = False) -> None:
        """Read what the rank appended to its log: its steps, and a heartbeat where one is due."""
        try:
            with open(output.log, "rb") as log:
                log.seek(output.offset)
                data = log.read()
        except FileNotFoundError:
            data = b""
        output.offset += len(data)
        *lines, partial = LINE_END.split(output.partial + data) if data else [output.partial]
        if ended and partial:
            lines, partial = [*lines, partial], b""  # the rank is gone: its last line is complete
        output.partial = partial[-MAX_LINE_BYTES:]
        stepped = False
        for line in lines:
            if line:  # blank: a `\r\n` split across two reads, or an empty line
                output.lines += 1
                stepped = self._read_line(output, line, now) or stepped
        if not data and output.partial and output.partial != output.partial_read:
            # An unended line that did not grow for a poll is whole: a progress bar's newest redraw,
            # which stays unended until the next one (a step later, or never after the last).
            output.partial_read = output.partial
            stepped = self._read_line(output, output.partial, now, unended=True) or stepped
        if stepped:
            output.warning = None  # the pattern fits after all
        if stepped or (lines and self.trainer.output_is_heartbeat):
            self._beat(output, "training", now)
        self._warn_of_no_match(output, now)

    def _read_line(self, output: RankOutput, line: bytes, now: float, unended: bool = False) -> bool:
        """Take the step the line names, if any; True when it names one. A line the pattern cannot
        read is said once and skipped. Of an `unended` line, a step below the rank's newest is taken
        for a line caught half written, and left."""
        try:
            step = self.trainer.step_in(line[-MAX_LINE_BYTES:].decode(errors="replace"))
        except Exception as error:  # noqa: BLE001 - a user's pattern on any line a rank prints
            self._complain(output.rank, "read a step from a line of its output", error)
            return False
        if step is None or (unended and output.step is not None and step < output.step):
            return False
        output.step = step
        if output.first_step is None:
            output.first_step, output.first_step_at = step, now
        elif step > output.first_step and output.advanced_at is None:
            output.advanced_at = now
        return True

    def _warn_of_no_match(self, output: RankOutput, now: float) -> None:
        """Warn, in the rank's heartbeat, of a progress pattern that has matched none of the lines the
        rank printed NO_MATCH_WARNING_SECONDS after its start; keep that heartbeat fresh while the rank
        reports no step."""
        if output.step is not None or output.reports_itself or not self.trainer.progress_pattern:
            return
        if output.warning is None:
            if self._warned or not output.lines or now - output.started < NO_MATCH_WARNING_SECONDS:
                return
            self._warned = True
            # The text stays as first written: the controller tells the operator of each new text.
            output.warning = (
                f"trainer.progress_pattern {self.trainer.progress_pattern!r} matched none of rank {output.rank}'s "
                f"{output.lines} lines in {now - output.started:.0f} s; check the pattern against the script's output"
            )
            # With output as heartbeat the warning rides on the newest line's heartbeat, keeping its time
            # (what the hang check goes by), and the lines after it carry it on.
            at = output.beat_at if self.trainer.output_is_heartbeat and output.beat_at else now
        elif self.trainer.output_is_heartbeat or now - (output.beat_at or 0.0) < NO_MATCH_REFRESH_SECONDS:
            return
        else:
            at = now
        self._beat(output, output.phase, at)

    def _beat(self, output: RankOutput, phase: Phase, now: float) -> None:
        """Write the rank's heartbeat, unless the rank writes its own."""
        if not self.trainer.output_heartbeats or output.reports_itself:
            return

        def write() -> None:
            own = read_heartbeat(self.run, self.incarnation, output.rank)
            if own is not None and own.by == "rank":
                output.reports_itself = True
                return
            beat = Heartbeat(
                rank=output.rank,
                step=output.step,
                phase=phase,
                time=now,
                phases={**output.phases, phase: output.phases.get(phase, now)},
                first_step_at=output.first_step_at,
                first_step=output.first_step,
                advanced_at=output.advanced_at,
                by="launcher",
                warning=output.warning,
            )
            write_heartbeat(self.run, self.incarnation, beat)
            # Only what was written counts: a heartbeat refused is tried again with the next line.
            output.phases.setdefault(phase, now)
            output.phase, output.beat_at = phase, now

        self._guarded(output.rank, "write its heartbeat", write)

    def _carry_out_fault(self) -> None:
        """SIGKILL the node's ranks once the planned fault is due: `after_seconds` from their start,
        or the step before `step` in their output (a rank that reports for itself dies on its own)."""
        fault = self.fault
        if fault is None or self._fault_done or not self.ranks:
            return
        if fault.after_seconds is not None:
            due = time.time() - min(o.started for o in self.ranks.values()) >= fault.after_seconds
        else:
            assert fault.step is not None, "a planned fault gives a step or after_seconds (FaultInjection)"
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
