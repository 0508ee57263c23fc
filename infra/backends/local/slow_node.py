"""Chaos on the local backend: a node made slow on purpose, as a GPU that runs 15% slow or a node
with a noisy neighbour looks to its run. Its processes (the launcher's process group of the run's
newest incarnation on the node: the launcher and its ranks) get the CPU only `1/factor` of the
time: each period they run for `period/factor`, then are SIGSTOPped for the rest. A node stopped
that way for milliseconds at a time is slow, not hung: its heartbeat thread still writes within
the run's liveness grace.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable

from lazarus.infra.processes import node_groups
from lazarus.schema.files import lock_is_held, read_json
from lazarus.schema.rundir import RunDir

PERIOD_SECONDS = 0.1
"""One run-then-stop cycle (seconds): short enough that a step of a tenth of a second is slowed
evenly, long enough that the signals cost nothing measurable."""


def node_process_groups(run: RunDir, node: str) -> list[int]:
    """The process groups of the node's live launchers in the run's newest incarnation."""
    incarnations = [k for k in run.incarnations() if run.assignment_file(k).exists()]
    if not incarnations:
        return []
    groups = []
    for group in node_groups(run, incarnations[-1], node):
        record = read_json(group.pid_file)
        if record and lock_is_held(group.lock):
            groups.append(int(record["pgid"]))
    return groups


def _signal_groups(groups: list[int], sig: signal.Signals) -> None:
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)


def slow_node(
    run: RunDir,
    node: str | list[str],
    factor: float,
    keep_going: Callable[[], bool],
    period: float = PERIOD_SECONDS,
) -> int:
    """Slow the node's processes by `factor` (> 1) while `keep_going()` holds, following the node
    into each new incarnation; every process is left running (SIGCONT) whatever ends it. Several
    nodes are stopped and continued together, so that they are slowed alike. Returns the number of
    cycles run."""
    nodes = [node] if isinstance(node, str) else node
    if factor <= 1:
        raise ValueError(f"the slow-down factor must exceed 1, not {factor}")
    running, stopped = period / factor, period - period / factor
    cycles = 0
    groups: list[int] = []
    try:
        while keep_going():
            groups = [group for name in nodes for group in node_process_groups(run, name)]
            time.sleep(running)
            _signal_groups(groups, signal.SIGSTOP)
            time.sleep(stopped)
            _signal_groups(groups, signal.SIGCONT)
            cycles += 1
    finally:
        _signal_groups(groups, signal.SIGCONT)
    return cycles
