"""`lazarus run logs`: every rank's stdout and stderr, from the run directory (local backend)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from lazarus.schema.records import Assignment
from lazarus.schema.rundir import RunDir


class LogsError(ValueError):
    """The logs asked for do not exist (a one-line message)."""


@dataclass
class RankLog:
    """One rank's log of one incarnation."""

    incarnation: int
    rank: int
    node: str
    path: Path


def select(run: RunDir, node: str | None = None, incarnation: int | None = None) -> list[RankLog]:
    """The logs of one incarnation (default: the newest one, or the newest that ran on `node`)."""
    if not run.spec_file.exists():
        raise LogsError(f"no run directory at {run.root}")
    assignments = {k: Assignment.model_validate_json(run.assignment_file(k).read_text()) for k in run.incarnations()}
    if incarnation is None:
        candidates = [k for k, a in assignments.items() if node is None or node in a.nodes]
        if not candidates:
            nodes = sorted({n for a in assignments.values() for n in a.nodes})
            raise LogsError(f"{node} never ran in this run; nodes that did: {', '.join(nodes)}")
        incarnation = candidates[-1]
    if incarnation not in assignments:
        raise LogsError(f"no incarnation {incarnation}; incarnations: {', '.join(map(str, assignments)) or 'none'}")
    assignment = assignments[incarnation]
    if node is not None and node not in assignment.nodes:
        raise LogsError(f"{node} did not run in incarnation {incarnation} (nodes: {', '.join(assignment.nodes)})")
    layout = assignment.layout
    return [
        RankLog(incarnation, rank, assignment.nodes[layout.node_of_rank(rank)], run.log_file(incarnation, rank))
        for rank in range(layout.world_size)
        if node is None or assignment.nodes[layout.node_of_rank(rank)] == node
    ]


def show(run: RunDir, logs: list[RankLog], follow: bool, write=print, poll: float = 0.2) -> None:
    """Print the logs, each line prefixed with its node and rank; with `follow`, keep printing
    what they append until every one of those ranks has ended."""
    offsets = {log.rank: 0 for log in logs}
    while True:
        for log in logs:
            try:
                with open(log.path, "rb") as handle:
                    handle.seek(offsets[log.rank])
                    data = handle.read()
            except FileNotFoundError:
                continue
            complete = data[: data.rfind(b"\n") + 1] if follow else data
            offsets[log.rank] += len(complete)
            for line in complete.decode(errors="replace").splitlines():
                write(f"{log.node} rank {log.rank} | {line}")
        if not follow or all(run.exit_file(log.incarnation, log.rank).exists() for log in logs):
            return
        time.sleep(poll)
