"""Warm standbys of the local backend (trainer/standby.py): one interpreter per node, torch and the
trainer imported before any fault, that forks the node's launcher when an incarnation starts.

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

from lazarus.infra.processes import KILL_WAIT_SECONDS, kill_group, start_locked, wait_released
from lazarus.infra.runfiles import Place, place_of
from lazarus.schema.contract import ENV_NODE, ENV_RUN_DIR, ENV_STANDBY_LOCK_FD
from lazarus.schema.files import lock_is_held
from lazarus.schema.records import Assignment, Inventory
from lazarus.schema.run import RunSpec
from lazarus.schema.rundir import RunDir

STANDBY_ANSWER_SECONDS = 60.0
"""How long a node's standby may take to fork its launcher after an order (it may still be
importing torch on a loaded node) before the node is started cold instead (seconds)."""

ORDER_POLL_SECONDS = 0.002
"""How often the backend looks whether the ordered launchers have started (seconds)."""


def ensure_standby(run: RunDir, spec: RunSpec, node: str, python: str) -> subprocess.Popen | None:
    """Start the node's standby unless one lives; returns the process if this call started it."""
    home = run.standby(node)
    home.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkfifo(home / "orders")
    env = {**os.environ, **spec.trainer.env, ENV_RUN_DIR: str(run.root), ENV_NODE: node}
    env.setdefault("OMP_NUM_THREADS", "1")  # as the launcher sets it for ranks; read when torch is imported
    return start_locked(
        [python, "-m", "lazarus.trainer.standby"],
        env,
        home / "lock",
        home / "pid",
        home / "log",
        lock_fd_env=ENV_STANDBY_LOCK_FD,
    )


def order_launchers(run: RunDir, assignment: Assignment, resume_step: int, start_cold: Callable[[int], None]) -> None:
    """Order each node's standby to start its launcher; return once each node's launcher exists.

    A node whose standby is gone, or does not answer within STANDBY_ANSWER_SECONDS, is started
    by `start_cold(index)` instead; should the standby answer later, its launcher finds the node
    lock taken or the ranks ended, and starts nothing.
    """
    incarnation = assignment.incarnation
    # O_RDWR keeps the FIFO's buffer alive until the standby opens it, even if it has not yet.
    writers = {}
    for index, node in enumerate(assignment.nodes):
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


def order_prefetch(run: RunDir, assignment: Assignment, inventory: Inventory, holders: dict[Place, int]) -> None:
    """Tell each healthy node's standby which survivors' states to read now, before any rank of
    the next incarnation exists: those of the places its node holds, or, for a spare, of the
    places the dead nodes held (the one it may take).

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
            order = {"prefetch": {"incarnation": assignment.incarnation, "ranks": ranks}}
            fd = os.open(run.standby(node.name) / "orders", os.O_RDWR | os.O_NONBLOCK)
            try:
                os.write(fd, json.dumps(order).encode() + b"\n")
            finally:
                os.close(fd)


def kill_standbys(run: RunDir, nodes: list[str] | None = None, wait: bool = True) -> None:
    """SIGKILL the standbys of the given nodes (default: all) and, unless `wait` is false, wait
    until they are gone."""
    base = run.root / "standby"
    homes = [base / n for n in nodes] if nodes is not None else (sorted(base.iterdir()) if base.is_dir() else [])
    deadline = time.monotonic() + KILL_WAIT_SECONDS
    for home in homes:
        kill_group(home / "lock", home / "pid", deadline)
    if wait:
        for home in homes:
            wait_released(home / "lock", f"the standby of {home.name}", deadline)


def any_standby_alive(run: RunDir) -> bool:
    """Whether a standby of the run lives (the run is live and keeps its nodes warm)."""
    return any(lock_is_held(lock) for lock in (run.root / "standby").glob("*/lock"))
