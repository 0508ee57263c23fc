"""Processes of the local backend: starting one behind a liveness lock, killing a node's process
group, watching exits.

A node of an incarnation is one launcher process (trainer/agent/launcher.py) leading a process group
that holds the node's ranks. Every process holds an exclusive lock (schema/files.take_lock) for
its whole life (the starter takes it and hands the locked descriptor down), so "is it alive?"
is answered by the kernel, immune to pid reuse and zombies, and a retried start cannot run a
second copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from lazarus.infra.backend import ClusterError
from lazarus.schema.files import lock_is_held, process_start_time, read_json, take_lock, write_json_atomic
from lazarus.schema.records import Assignment
from lazarus.schema.rundir import RunDir

KILL_WAIT_SECONDS = 30.0
"""How long processes sent SIGKILL may take to be gone. The kernel ends them in milliseconds; one
still holding its lock after this long is stuck (say, on a hung filesystem), and the stage fails
to be retried rather than wait forever."""

LOCK_POLL_SECONDS = 0.005
"""How often a wait for a lock to be released looks again (seconds)."""


@dataclass
class NodeGroup:
    """One node of an incarnation: its launcher (a process group with the node's ranks) and their locks."""

    incarnation: int
    index: int
    node: str
    lock: Path
    pid_file: Path
    rank_locks: list[tuple[int, Path]]


def node_groups(run: RunDir, incarnation: int, node: str | None = None) -> list[NodeGroup]:
    """Every node (or one) of an incarnation: its launcher's lock and its ranks' locks."""
    assignment = Assignment.model_validate_json(run.assignment_file(incarnation).read_text())
    per_node = assignment.layout.ranks_per_node
    return [
        NodeGroup(
            incarnation,
            index,
            name,
            run.node_lock_file(incarnation, index),
            run.node_pid_file(incarnation, index),
            [(rank, run.lock_file(incarnation, rank)) for rank in range(index * per_node, (index + 1) * per_node)],
        )
        for index, name in enumerate(assignment.nodes)
        if node is None or name == node
    ]


def processes_of(run: RunDir, group: NodeGroup) -> list[tuple[Path, Path]]:
    """(lock, pid file) of the group's launcher and of each of its ranks."""
    return [(group.lock, group.pid_file)] + [(lock, run.pid_file(group.incarnation, r)) for r, lock in group.rank_locks]


def start_in_session(command: list[str], env: dict, log: Path, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    """Start `command` with `env` in a session of its own (a node outlives a crashed worker, as a
    real one would), its output appended to `log`, holding the descriptors `pass_fds`: how the
    local backend starts every process of a node, launcher or standby."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as output:
        return subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            pass_fds=pass_fds,
            start_new_session=True,
        )


def start_locked(
    command: list[str],
    env: dict,
    lock: Path,
    pid_file: Path,
    log: Path,
    record: dict | None = None,
) -> subprocess.Popen | None:
    """Start `command` in a session of its own holding the lock on `lock`, unless a live process
    holds it (then None); records its pid, process group and start time (plus `record`).

    From the moment this returns the lock says the process lives, so no second one can start.
    """
    fd = take_lock(lock)
    if fd is None:
        return None
    try:
        child = start_in_session(command, env, log, (fd,))
        write_json_atomic(
            pid_file,
            {"pid": child.pid, "pgid": child.pid, "start_time": process_start_time(child.pid), **(record or {})},
        )
    finally:
        # The child holds the lock through its inherited copy of the descriptor.
        os.close(fd)
    return child


def wait_released(lock: Path, what: str, deadline: float) -> None:
    """Return once nothing holds `lock`; ClusterError naming `what` past `deadline` (monotonic)."""
    while lock_is_held(lock):
        if time.monotonic() > deadline:
            raise ClusterError(f"{what} is still alive {KILL_WAIT_SECONDS:.0f} s after SIGKILL")
        time.sleep(LOCK_POLL_SECONDS)


def kill_group(lock: Path, pid_file: Path, deadline: float) -> int | None:
    """SIGKILL the process group recorded in `pid_file` while `lock` is held; returns its id.

    A process records its group as its first act, so while its lock is held and no record exists
    yet, it is about to write one: wait for it. A held lock means the group still has members,
    so its id cannot have been reused.
    """
    record = read_json(pid_file)
    while record is None and lock_is_held(lock) and time.monotonic() < deadline:
        time.sleep(LOCK_POLL_SECONDS)
        record = read_json(pid_file)
    if record is None or not lock_is_held(lock):
        return None
    with contextlib.suppress(ProcessLookupError):
        os.killpg(record["pgid"], signal.SIGKILL)
    # The process itself too: a standby forked from a shared interpreter records the group it
    # is about to lead a moment before it leads it (trainer/standby_fork.serve_nodes).
    with contextlib.suppress(ProcessLookupError):
        os.kill(record["pid"], signal.SIGKILL)
    return record["pgid"]


def kill_and_wait(groups: list[NodeGroup]) -> list[tuple[NodeGroup, list[int], int | None]]:
    """SIGKILL every live node group (its launcher's process group: it and all its ranks), then
    wait until every lock is released; returns each group killed with its live ranks and its
    process group.

    Killing the process group rather than recorded pids leaves no gap: a rank holds its lock
    from the moment it is forked, before anyone could record its pid, and it is in its
    launcher's group from that moment too.
    """
    deadline = time.monotonic() + KILL_WAIT_SECONDS
    killed = []
    for group in groups:
        ranks = [rank for rank, lock in group.rank_locks if lock_is_held(lock)]
        if ranks or lock_is_held(group.lock):
            killed.append((group, ranks, kill_group(group.lock, group.pid_file, deadline)))
    for group in groups:
        wait_released(group.lock, f"the launcher of {group.node} (incarnation {group.incarnation})", deadline)
        for rank, lock in group.rank_locks:
            wait_released(lock, f"rank {rank} of {group.node} (incarnation {group.incarnation})", deadline)
    return killed


def live_pids(run: RunDir) -> list[int]:
    """Pids of every live process of the run with a pid record (launchers and ranks, any incarnation)."""
    pids = []
    for k in run.incarnations():
        for group in node_groups(run, k):
            for lock, pid_file in processes_of(run, group):
                record = read_json(pid_file)
                if lock_is_held(lock) and record:
                    pids.append(record["pid"])
    return pids


def open_pidfds(run: RunDir, incarnation: int) -> list[int]:
    """A pidfd for every live launcher and rank of the incarnation that has recorded its pid."""
    fds = []
    for group in node_groups(run, incarnation):
        for lock, pid_file in processes_of(run, group):
            record = read_json(pid_file)
            if record is None or not lock_is_held(lock):
                continue  # not started yet, or gone (the caller's next look sees that)
            try:
                fd = os.pidfd_open(record["pid"])
            except OSError:
                continue
            if process_start_time(record["pid"]) != record.get("start_time"):
                os.close(fd)  # the pid was reused
                continue
            fds.append(fd)
    return fds


async def any_exit(fds: list[int], timeout: float) -> bool:
    """Wait until one of the pidfds' processes exits (True) or `timeout` seconds pass (False);
    closes the descriptors. With none, it just waits."""
    if not fds:
        await asyncio.sleep(timeout)
        return False
    loop = asyncio.get_running_loop()
    exited = asyncio.Event()
    for fd in fds:
        loop.add_reader(fd, exited.set)
    try:
        await asyncio.wait_for(exited.wait(), timeout)
        return True
    except TimeoutError:
        return False
    finally:
        for fd in fds:
            loop.remove_reader(fd)
            os.close(fd)
