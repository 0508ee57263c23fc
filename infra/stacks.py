"""Capturing a running incarnation's Python stacks from the controller, through the run directory.

The controller asks (schema/stacks.py StackRequest); each node's launcher signals its ranks that
registered a dump (trainer/agent/stacks.py), and each such rank's faulthandler appends its stacks to
`incarnations/K/stacks/R.txt`. Nothing here touches a process, so the same code serves every
backend whose nodes share the run directory with the controller (local, Slurm, Kubernetes): a
rank is reached on whatever machine it runs, by the launcher beside it.
"""

from __future__ import annotations

import time
import uuid

from lazarus.schema.rundir import RunDir
from lazarus.schema.stacks import StackRequest, write_stack_request

STACKS_WAIT_SECONDS = 2.0
"""How long a capture waits for the dumps by default (seconds): a launcher looks for requests every
50 ms and a dump takes milliseconds, so this leaves room for a loaded node."""

STACKS_QUIET_SECONDS = 0.1
"""A dump counts as complete once its file has not grown for this long (seconds): faulthandler
writes it in one go, from the signal handler, and leaves no end mark."""

STACKS_POLL_SECONDS = 0.02
"""How often a capture looks at the files it waits for (seconds)."""

MAX_STACK_BYTES = 65536
"""The most of one rank's dump returned (bytes): the incident that keeps it travels in workflow
history, and faulthandler's own limits (100 threads, 100 frames each) allow far more."""


def _size(path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def registered_ranks(run: RunDir, incarnation: int) -> list[int]:
    """The ranks of the incarnation whose processes registered a stack dump (their file exists)."""
    folder = run.stacks_file(incarnation, 0).parent
    return sorted(int(p.stem) for p in folder.glob("*.txt") if p.stem.isdigit()) if folder.is_dir() else []


def _read(path, start: int, end: int) -> str:
    with open(path, "rb") as stacks:
        stacks.seek(start)
        text = stacks.read(min(end - start, MAX_STACK_BYTES)).decode(errors="replace")
    return text + ("\n... (cut: the dump was longer)\n" if end - start > MAX_STACK_BYTES else "")


def capture_stacks(
    run: RunDir, incarnation: int, ranks: list[int] | None = None, wait_seconds: float = STACKS_WAIT_SECONDS
) -> dict[int, str]:
    """Each rank's stacks as it dumped them now: rank -> the text of all its Python threads'
    stacks (faulthandler's format, most recent call first). Of `ranks` (None: every rank), only
    those that registered a dump are asked; a rank whose dump did not come within `wait_seconds`
    (a stopped process, a dead launcher) is left out. Returns at once when none registered."""
    wanted = registered_ranks(run, incarnation) if ranks is None else ranks
    offsets = {r: size for r in wanted if (size := _size(run.stacks_file(incarnation, r))) is not None}
    if not offsets:
        return {}
    request = StackRequest(id=uuid.uuid4().hex, ranks=sorted(offsets), time=time.time())
    write_stack_request(run, incarnation, request)
    deadline = time.monotonic() + wait_seconds
    grown: dict[int, tuple[int, float]] = {}  # rank -> (size, when it last grew)
    while True:
        now = time.monotonic()
        for rank, offset in offsets.items():
            size = _size(run.stacks_file(incarnation, rank)) or 0
            if size > offset and size != grown.get(rank, (None,))[0]:
                grown[rank] = (size, now)
        complete = len(grown) == len(offsets) and all(now - at >= STACKS_QUIET_SECONDS for _, at in grown.values())
        if complete or now >= deadline:
            break
        time.sleep(STACKS_POLL_SECONDS)
    return {rank: _read(run.stacks_file(incarnation, rank), offsets[rank], size) for rank, (size, _) in grown.items()}
