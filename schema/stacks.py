"""The controller's request for a running incarnation's Python stacks (trainer/CONTRACT.md).

A hang is declared with each rank's stack, so that the operator sees where it waited. The ranks
dump their stacks on SIGUSR1 (trainer/stack_dump.py) into `incarnations/K/stacks/R.txt`; no
controller can signal a process on another machine, so it writes a StackRequest into the run
directory, and each node's launcher, which watches that file beside its ranks, signals those it
hosts (trainer/stacks.py). That works wherever the run directory is shared with the nodes: the
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
