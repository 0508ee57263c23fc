"""Since when each rank of a node has sat idle: used no CPU and written no output
(RankObservation.idle_since), read from the process by its node's launcher (trainer/agent/node_report.py).

That is the evidence of a hang in a script that reports no steps: a rank waiting in a collective
for a peer that will never come sleeps in the kernel and prints nothing, while a rank that trains,
loads data or saves a checkpoint uses CPU or writes. What a rank counts as, per sample:
- CPU: utime + stime + cutime + cstime of /proc/PID/stat (all its threads, and the children it
  has reaped), plus the same of each live child and their children (/proc/PID/task/PID/children).
  The rank's tree, not the rank alone: a rank waiting on its data-loader workers is not hung while
  they work, and a worker's CPU moves into the rank's cutime when it is reaped, so the sum does not
  jump back then. Children forked by a thread other than the main one are seen only once reaped.
- output: the size and modification time of its log (its stdout and stderr, children's included).
The clock ticks of /proc are 10 ms, and a rank waiting in a collective still has threads that wake
now and then: a rank stays idle while its CPU time since it went idle stays under 2% of one core
and two ticks (IDLE_CPU_SHARE, IDLE_CPU_TICKS).

A sample costs two /proc reads per process of the rank's tree (stat and children) and a stat of
its log, taken at most every `sample_seconds`. idle_since is the time of the sample that last saw
the rank active (the first sample of a process counts as one): a time in the past that stays put
while the rank is idle, so an idle rank does not make its node's report be rewritten.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from lazarus.schema.files import read_json
from lazarus.schema.rundir import RunDir

MAX_TREE_PROCESSES = 64
"""The most processes of one rank's tree read per sample: a rank that forks more is rare, and its
first 64 show its activity as well."""


IDLE_CPU_SHARE = 0.02
"""A rank counts as idle while its tree's CPU time since it went idle stays under this share of one
core (dimensionless), plus IDLE_CPU_TICKS: a rank that waits in a collective still has threads
that wake now and then (lazarus.session's liveness thread, gloo's), which add a tick every few
seconds; a rank that trains, loads data or saves uses far more."""
IDLE_CPU_TICKS = 2
"""Clock ticks (10 ms each) an idle rank may use besides IDLE_CPU_SHARE."""
TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")


@dataclass
class _Seen:
    pid: int
    start_time: int
    output: tuple | None = None  # (log size, log mtime) at the last sample
    ticks: int | None = None  # CPU ticks when it went idle
    since: float | None = None  # idle_since
    sampled_at: float = float("-inf")
    held: str | None = None  # its state letter at the last sample where it could not run (HELD_STATES)


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (field 3 first), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].decode().split()
    except (OSError, IndexError):
        return None


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children", "rb") as children:
            return [int(child) for child in children.read().split()]
    except OSError:
        return []


def _cpu_ticks(fields: list[str]) -> int:
    """utime + stime + cutime + cstime (fields 14 to 17) in clock ticks."""
    return sum(int(value) for value in fields[11:15])


HELD_STATES = frozenset("TtD")
"""Process states (/proc/PID/stat) of a process that cannot run on its own: stopped (SIGSTOP),
stopped by a tracer, in uninterruptible sleep (a stuck disk or network file system)."""


def process_held(pid: int, start_time: int) -> str | None:
    """The state letter of process `pid` (started at `start_time`) where it is one of HELD_STATES;
    None where it runs, sleeps as a waiting process does, or is gone."""
    fields = _stat_fields(pid)
    if fields is None or int(fields[19]) != start_time:
        return None
    return fields[0] if fields[0] in HELD_STATES else None


def tree_cpu_ticks(pid: int, start_time: int) -> int | None:
    """CPU time used by process `pid` and its live descendants (and the children each reaped), in
    clock ticks; None when `pid` is gone, a zombie, or another process than the one started at
    `start_time` (kernel clock ticks since boot)."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X") or int(fields[19]) != start_time:
        return None
    total, pending, seen = _cpu_ticks(fields), _children(pid), 1
    while pending and seen < MAX_TREE_PROCESSES:
        child = pending.pop()
        seen += 1
        if (child_fields := _stat_fields(child)) is not None:
            total += _cpu_ticks(child_fields)
            pending += _children(child)
    return total


def _log_state(path) -> tuple[int, int] | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_size, stat.st_mtime_ns


class IdleWatch:
    """Idle times of a node's ranks of one incarnation, by the pids their launchers recorded
    (`RunDir.pid_file`: cold-started and forked ranks alike)."""

    def __init__(self, run: RunDir, incarnation: int, sample_seconds: float):
        self.run, self.incarnation, self.sample_seconds = run, incarnation, sample_seconds
        self._seen: dict[int, _Seen] = {}

    def _process(self, rank: int) -> _Seen | None:
        """The rank's process as its launcher recorded it (once read, kept: a rank runs once per incarnation)."""
        seen = self._seen.get(rank)
        if seen is None:
            record = read_json(self.run.pid_file(self.incarnation, rank))
            if not record or record.get("start_time") is None:
                return None
            seen = self._seen[rank] = _Seen(int(record["pid"]), int(record["start_time"]))
        return seen

    def idle_since(self, rank: int, now: float) -> float | None:
        """Since when `rank` has used no CPU and written no output (seconds since the epoch), as
        of `now`; None while it has not started or once its process is gone."""
        seen = self._process(rank)
        if seen is None:
            return None
        if now - seen.sampled_at < self.sample_seconds:
            return seen.since
        seen.sampled_at = now
        ticks = tree_cpu_ticks(seen.pid, seen.start_time)
        if ticks is None:
            seen.output = seen.ticks = seen.since = None
            return None
        output = _log_state(self.run.log_file(self.incarnation, rank))
        idle_for = now - seen.since if seen.since is not None else 0.0
        allowed = IDLE_CPU_TICKS + IDLE_CPU_SHARE * idle_for * TICKS_PER_SECOND
        if seen.since is None or seen.ticks is None or output != seen.output or ticks - seen.ticks > allowed:
            seen.output, seen.ticks, seen.since = output, ticks, now
        # Only an idle rank's state is read: every rank behind a hung one idles too, and the one whose
        # process cannot run is the likelier culprit than the one that happened to idle first.
        seen.held = process_held(seen.pid, seen.start_time) if seen.since < now else None
        return seen.since

    def held(self, rank: int) -> str | None:
        """The state letter of the rank's process at the last sample, where it could not run (HELD_STATES)."""
        seen = self._seen.get(rank)
        return seen.held if seen is not None else None
