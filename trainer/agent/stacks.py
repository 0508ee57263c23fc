"""A launcher's side of a stack capture: when the controller asks for its incarnation's stacks
(schema/stacks.py), signal each rank of this node that registered its dump (trainer/agent/stack_dump.py).

SIGUSR1 ends a process that does not catch it, so a rank is signalled only when all three hold:
its stacks file names a process (the process wrote it when it registered), that process is still
the one that registered (same kernel start time: the pid was not reused), and it catches SIGUSR1
now (the SigCgt mask of /proc/PID/status: a script that reset the signal is left alone).

A process that cannot run the handler now (stopped by SIGSTOP or a tracer, in uninterruptible
sleep, a zombie: the state in /proc/PID/stat) would keep the controller waiting for a dump that
does not come: the launcher appends a note that says so to its stacks file instead
(schema/stacks.py NO_DUMP), so the capture ends as soon as the others' dumps are in and the
incident names the process's state. One in uninterruptible sleep is signalled all the same: it
dumps when it wakes, for a later capture.
"""

from __future__ import annotations

import os
import signal
import sys

from lazarus.schema.files import process_start_time, process_state
from lazarus.schema.rundir import RunDir
from lazarus.schema.stacks import NO_DUMP, read_stack_request
from lazarus.trainer.agent.stack_dump import registered_process

UNANSWERING_STATES = {
    "T": "stopped (SIGSTOP or SIGTSTP)",
    "t": "stopped by a tracer",
    "D": "in uninterruptible sleep (waiting on a disk, a network file system or a driver)",
    "Z": "a zombie (exited, not yet reaped)",
}
"""Process states of /proc/PID/stat in which a process runs no signal handler now, and how the note
of a missing dump names each."""


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (False when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except OSError:
        pass
    return False


def unanswering(stacks_file) -> tuple[int, str] | None:
    """The process that registered `stacks_file` and its state, where that lets it dump no stacks
    now (UNANSWERING_STATES); None when it can (or is gone, or is another process now)."""
    registered = registered_process(stacks_file)
    if registered is None:
        return None
    pid, start_time = registered
    state = process_state(pid)
    if state not in UNANSWERING_STATES or process_start_time(pid) != start_time:
        return None
    return pid, state


def note_no_dump(stacks_file, pid: int, state: str) -> None:
    """Append the note that takes the place of a dump (schema/stacks.py NO_DUMP): one write, in
    append mode, as the process's own dumps are."""
    with open(stacks_file, "a") as stacks:
        stacks.write(
            f"{NO_DUMP}its process (pid {pid}) is {state}: {UNANSWERING_STATES[state]}; it cannot dump its stacks now\n"
        )


def signal_for_stacks(stacks_file) -> bool:
    """Send SIGUSR1 to the process that registered `stacks_file`, where that is safe (module
    docstring); True if it was sent."""
    registered = registered_process(stacks_file)
    if registered is None:
        return False
    pid, start_time = registered
    if process_start_time(pid) != start_time or not catches(pid, signal.SIGUSR1):
        return False
    try:
        os.kill(pid, signal.SIGUSR1)
    except OSError:  # gone meanwhile, or not ours
        return False
    return True


class StackOrders:
    """Carries out the controller's stack requests for one node's ranks, once each."""

    def __init__(self, run: RunDir, incarnation: int, ranks: range):
        self.run, self.incarnation, self.ranks = run, incarnation, ranks
        # A request made before this launcher started was another's to carry out (or is stale).
        self._handled = self._version()

    def _version(self) -> tuple[int, int] | None:
        """Which request file is there (a new request replaces it: a new inode)."""
        try:
            stat = os.stat(self.run.stacks_request_file(self.incarnation))
        except OSError:
            return None
        return stat.st_ino, stat.st_mtime_ns

    def poll(self) -> list[int]:
        """Signal the ranks a new request names; returns those signalled. Costs one stat when
        nothing is new, so the node's reporter calls it on every poll."""
        version = self._version()
        if version is None or version == self._handled:
            return []
        self._handled = version
        request = read_stack_request(self.run, self.incarnation)
        if request is None:
            return []
        signalled, noted = [], []
        for rank in (r for r in request.ranks if r in self.ranks):
            stacks_file = self.run.stacks_file(self.incarnation, rank)
            cannot = unanswering(stacks_file)
            if cannot is not None:
                note_no_dump(stacks_file, *cannot)
                noted.append(rank)
                if cannot[1] != "D":
                    continue
            if signal_for_stacks(stacks_file):
                signalled.append(rank)
        if signalled:
            print(f"lazarus launcher: ranks {signalled} asked for their stacks", file=sys.stderr, flush=True)
        if noted:
            print(f"lazarus launcher: ranks {noted} cannot dump their stacks now", file=sys.stderr, flush=True)
        return signalled
