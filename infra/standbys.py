"""Warm standbys of the local backend (trainer/agent/standby/): one interpreter per node, torch and the
trainer imported before any fault, that forks the node's launcher when an incarnation starts.
The standbys started together are forks of one interpreter that did the imports once.

A standby lives in `standby/<node>/` of the run directory: `lock` (held while it lives), `pid`,
`orders` (a FIFO of JSON lines: an incarnation to start, or survivors' states to read ahead),
`ready` and `log`.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Callable
from functools import partial

from lazarus.infra.processes import KILL_WAIT_SECONDS, kill_group, start_in_session, wait_released
from lazarus.infra.survivors import Place, place_of
from lazarus.schema.contract import ENV_RUN_DIR, ENV_STANDBY_LOCK_FDS, ENV_STANDBY_NODES
from lazarus.schema.files import lock_is_held, process_start_time, read_json, take_lock, write_json_atomic
from lazarus.schema.records import Assignment, Inventory
from lazarus.schema.run import RunSpec
from lazarus.schema.rundir import RunDir

STANDBY_ANSWER_SECONDS = 60.0
"""How long a node's standby may take to fork its launcher after an order (it may still be
importing torch on a loaded node) before the node is started cold instead (seconds)."""

ORDER_POLL_SECONDS = 0.002
"""How often the backend looks whether the ordered launchers have started (seconds)."""


def ensure_standbys(run: RunDir, spec: RunSpec, nodes: list[str], python: str) -> subprocess.Popen | None:
    """Start the standbys of those of `nodes` that have no live one, all from one interpreter
    that imports torch once and forks one per node (trainer/agent/standby/fork.py): the local
    backend's nodes share this machine, so N imports would only cost N times the CPU. Returns
    that interpreter if one was started.

    Each node's lock is taken here and passed on, and the interpreter is recorded as each node's
    standby until its fork records itself: from the moment this returns, a node's standby
    lives as far as every other caller can tell, and a kill reaches it.
    """
    taken: list[tuple[str, int]] = []
    for node in nodes:
        home = run.standby(node)
        home.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkfifo(home / "orders")
        fd = take_lock(home / "lock")
        if fd is not None:
            taken.append((node, fd))
    if not taken:
        return None
    env = {
        **os.environ,
        **spec.trainer.env,
        ENV_RUN_DIR: str(run.root),
        ENV_STANDBY_NODES: ",".join(node for node, _ in taken),
        ENV_STANDBY_LOCK_FDS: ",".join(str(fd) for _, fd in taken),
    }
    env.setdefault("OMP_NUM_THREADS", "1")  # as the launcher sets it for ranks; read when torch is imported
    try:
        # Until it forks, the interpreter writes to the first node's log (each fork, to its own).
        child = start_in_session(
            [python, "-m", "lazarus.trainer.agent.standby"],
            env,
            run.standby(taken[0][0]) / "log",
            tuple(fd for _, fd in taken),
        )
        record = {"pid": child.pid, "pgid": child.pid, "start_time": process_start_time(child.pid)}
        for node, _ in taken:
            write_json_atomic(run.standby(node) / "pid", record)
    finally:
        for _, fd in taken:
            os.close(fd)  # the interpreter holds each lock through its inherited descriptor
    return child


def order_launchers(
    run: RunDir, assignment: Assignment, resume_step: int, start_cold: Callable[[int], None], indexes=None
) -> None:
    """Order each node's standby (or those at `indexes` of the assignment) to start its launcher;
    return once each such node's launcher exists.

    A node whose standby is gone, or does not answer within STANDBY_ANSWER_SECONDS, is started
    by `start_cold(index)` instead; should the standby answer later, its launcher finds the node
    lock taken or the ranks ended, and starts nothing.
    """
    incarnation = assignment.incarnation
    # O_RDWR keeps the FIFO's buffer alive until the standby opens it, even if it has not yet.
    writers = {}
    for index, node in enumerate(assignment.nodes):
        if indexes is not None and index not in indexes:
            continue
        fd = os.open(run.standby(node) / "orders", os.O_RDWR | os.O_NONBLOCK)
        order = {"incarnation": incarnation, "node_index": index, "resume_step": resume_step}
        os.write(fd, json.dumps(order).encode() + b"\n")
        writers[index] = fd
    deadline = time.monotonic() + STANDBY_ANSWER_SECONDS
    try:
        while writers:
            for index, fd in list(writers.items()):
                launched = (
                    lock_is_held(run.node_lock_file(incarnation, index))
                    or run.node_pid_file(incarnation, index).exists()
                )
                standby_gone = not lock_is_held(run.standby(assignment.nodes[index]) / "lock")
                if launched or standby_gone or time.monotonic() > deadline:
                    del writers[index]
                    os.close(fd)
                    if not launched:
                        start_cold(index)
            time.sleep(ORDER_POLL_SECONDS)
    finally:
        for fd in writers.values():
            os.close(fd)


def order_prefetch(
    run: RunDir,
    assignment: Assignment,
    inventory: Inventory,
    holders: dict[Place, int],
    send: Callable[[str, dict], object] | None = None,
) -> None:
    """Tell each healthy node's standby which survivors' states to read now, before any rank of
    the next incarnation exists: those of the places its node holds, or, for a spare, of the
    places the dead nodes held (the one it may take). `send(node, order)` delivers an order
    (default: a line in the node's FIFO).

    A replica fills whole nodes, so a node keeps its places when a reshard renumbers it: the
    guess is right for a hot spare and for a reshard alike; a wrong one only costs the rank a
    read of its own.
    """
    per_node = assignment.layout.ranks_per_node

    def places(index: int) -> set[Place]:
        return {place_of(assignment.layout, rank) for rank in range(index * per_node, (index + 1) * per_node)}

    dead = {node.name for node in inventory.nodes if not node.healthy or node.role == "quarantined"}
    lost = set().union(*(places(i) for i, name in enumerate(assignment.nodes) if name in dead))
    for node in inventory.nodes:
        if node.name in dead or not lock_is_held(run.standby(node.name) / "lock"):
            continue
        wanted = places(assignment.nodes.index(node.name)) if node.name in assignment.nodes else lost
        ranks = sorted({holders[place] for place in wanted if holders.get(place) is not None})
        if ranks:
            (send or partial(_write_order, run))(
                node.name, {"prefetch": {"incarnation": assignment.incarnation, "ranks": ranks}}
            )


def _write_order(run: RunDir, node: str, order: dict) -> None:
    fd = os.open(run.standby(node) / "orders", os.O_RDWR | os.O_NONBLOCK)
    try:
        os.write(fd, json.dumps(order).encode() + b"\n")
    finally:
        os.close(fd)


def kill_standbys(run: RunDir, nodes: list[str] | None = None, wait: bool = True) -> None:
    """SIGKILL the standbys of the given nodes (default: all) and, unless `wait` is false, wait
    until they are gone."""
    base = run.root / "standby"
    homes = [base / n for n in nodes] if nodes is not None else run.standbys()
    deadline = time.monotonic() + KILL_WAIT_SECONDS
    killed = {home: kill_group(home / "lock", home / "pid", deadline) for home in homes}
    if wait:
        for home in homes:
            # A fork of the shared interpreter may record itself after the kill read the
            # interpreter's record (and after the interpreter died): kill what it recorded.
            while lock_is_held(home / "lock") and time.monotonic() < deadline:
                record = read_json(home / "pid") or {}
                if record.get("pgid") not in (None, killed[home]):
                    killed[home] = kill_group(home / "lock", home / "pid", deadline)
                time.sleep(0.005)
            wait_released(home / "lock", f"the standby of {home.name}", deadline)


def any_standby_alive(run: RunDir) -> bool:
    """Whether a standby of the run lives (the run is live and keeps its nodes warm)."""
    return any(lock_is_held(lock) for lock in (run.root / "standby").glob("*/lock"))
