"""The controller's request for a running incarnation's Python stacks (trainer/CONTRACT.md).

A hang is declared with each rank's stack, so that the operator sees where it waited. The ranks
dump their stacks on SIGUSR1 (trainer/agent/stack_dump.py) into `incarnations/K/stacks/R.txt`; no
controller can signal a process on another machine, so it writes a StackRequest into the run
directory, and each node's launcher, which watches that file beside its ranks, signals those it
hosts (trainer/agent/stacks.py). That works wherever the run directory is shared with the nodes: the
local backend, Slurm and Kubernetes alike.
"""

from __future__ import annotations

from pydantic import Field

from lazarus.schema.base import Record
from lazarus.schema.files import read_text, write_json_atomic
from lazarus.schema.rundir import RunDir


class StackRequest(Record):
    """`incarnations/K/stacks/request.json`: dump these ranks' stacks now. Written by the controller,
    read by every node's launcher of incarnation K, which carries out each new one once."""

    id: str = Field(description="Tells one request from the next (a new one replaces the file).")
    ranks: list[int] = Field(description="The ranks to dump; a launcher signals those of them it hosts.")
    time: float = Field(description="When it was asked (seconds since the epoch).")


def write_stack_request(run: RunDir, incarnation: int, request: StackRequest) -> None:
    """Ask the incarnation's launchers for the stacks of `request.ranks` (replacing any earlier request)."""
    write_json_atomic(run.stacks_request_file(incarnation), request.model_dump_json())


def read_stack_request(run: RunDir, incarnation: int) -> StackRequest | None:
    """The newest request for the incarnation's stacks; None when there is none, or it is not one."""
    text = read_text(run.stacks_request_file(incarnation))
    if not text:
        return None
    try:
        return StackRequest.model_validate_json(text)
    except ValueError:
        return None


NO_DUMP = "# lazarus launcher: no dump: "
"""How a launcher's note begins where it wrote one in place of a rank's dump: its process cannot
run the dump's handler (trainer/agent/stacks.py: stopped, or in uninterruptible sleep)."""


def no_dump_reason(dump: str) -> str | None:
    """Why a rank's 'dump' is its launcher's note instead (its process could not dump); None for a
    real dump."""
    for line in dump.splitlines():
        if line.startswith(NO_DUMP):
            return line.removeprefix(NO_DUMP).strip()
    return None


def main_thread_frames(dump: str) -> list[str]:
    """The frames of the thread that took the dump's signal (faulthandler's `Current thread`, the
    main one) in a dump, innermost first, as `"FILE", line N in FUNCTION`; [] when it has none."""
    block = dump.rsplit("Current thread", 1)[-1].splitlines()[1:] if "Current thread" in dump else []
    return [line.strip().removeprefix("File ") for line in block if line.strip().startswith("File ")]


def where_it_waited(dump: str, frames: int = 3) -> str:
    """The innermost frames of the main thread in a dump, innermost first, in one line (or why there
    is no dump: the launcher's note)."""
    return " <- ".join(main_thread_frames(dump)[:frames]) or no_dump_reason(dump) or "(no frame in the dump)"


def odd_ones_out(dumps: dict[int, str]) -> list[int]:
    """Of ranks stalled together, those whose main thread waits somewhere no other rank does: where
    most wait at one place (the step's collective) and a few elsewhere (the collective nobody
    joins), the few; [] when no place holds a majority over the rest."""
    where = {rank: (main_thread_frames(dump) or [""])[0] for rank, dump in dumps.items()}
    places = sorted(set(where.values()), key=lambda place: -sum(1 for w in where.values() if w == place))
    if len(places) < 2:
        return []
    common = places[0]
    odd = sorted(rank for rank, place in where.items() if place != common)
    return odd if len(odd) < len(where) - len(odd) else []
