"""A fault as detect (or a signal, or an operator) reports it: which nodes are to blame, if any,
which rank failed first and how, and when (one record of schema/records.py's language)."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from lazarus.schema.base import Record
from lazarus.schema.nodelist import NodeList

FaultKind = Literal[
    "node_down", "rank_exit", "hang", "external", "operator", "program_error", "rank_error", "straggler", "sick"
]

PLANNED_KINDS = ("straggler", "sick")
"""Faults where nothing died: the run checkpoints and stops at a step boundary, then the node is
swapped for a spare, so no step is lost."""


class FaultReport(Record):
    """A fault: which nodes, what kind, when it happened and when it was seen."""

    kind: FaultKind = Field(
        description=(
            "node_down: backend saw the node die; rank_exit: a rank process ended; hang: the step stalled, with a "
            "stopped process, every rank idle, or a stack that stands still as evidence; "
            "external: reported by signal; operator: drained by an operator; rank_error: a rank failed on its own "
            "(an exception or an exit code) on a healthy node, the program's failure: restarted in place, no node "
            "blamed (a first failure, even of every rank before a step, may be transient; the same failure again is "
            "the crash loop that ends the run); program_error: the program cannot train (every rank of the built-in "
            "trainer exited 0 before its first step), no node to blame: the run ends; straggler: a node's work per "
            "step took longer than its peers' by the policy's factor over its window (recovery.stragglers); sick: its "
            "health check failed or a "
            "health agent's node condition says so (the spec's health); both swapped in a planned recovery."
        )
    )
    nodes: NodeList = Field(
        description="Nodes blamed for the fault; they are quarantined (none for the program's own failure)."
    )
    incarnation: int = Field(ge=0, description="Incarnation that was running.")
    occurred_at: datetime = Field(
        description="Best known time of the fault (UTC): the backend's death time, else when it was first seen."
    )
    detected_at: datetime = Field(description="When the detector reported it (UTC).")
    step: int | None = Field(
        ge=0,
        description=(
            "Newest step completed when the fault was detected: the highest any rank reported (in synchronous "
            "training every rank got through that step's collectives; another's heartbeat may lag by milliseconds). "
            "None when the script reports no steps."
        ),
    )
    last_heartbeat_at: datetime | None = Field(
        default=None, description="Newest heartbeat of the blamed ranks before the fault (UTC)."
    )
    reason: str = Field(
        default="", description="Human-readable cause: exit code or signal, stale heartbeat age, operator's words."
    )
    rank: int | None = Field(
        default=None,
        description=(
            "The first rank blamed: of a failure, the rank that failed first for a reason of its own (an exception "
            "or exit code beats a peer's follow-on connection error)."
        ),
    )
    node: str | None = Field(default=None, description="The node that rank ran on.")
    exit_code: int | None = Field(default=None, description="That rank's exit code, when it exited on its own.")
    signal: str | None = Field(default=None, description="The signal that ended that rank, e.g. SIGKILL.")
    error: str = Field(
        default="",
        description=(
            "That rank's exception: what torch's @record wrote (TORCHELASTIC_ERROR_FILE), else the last line of "
            "the traceback in its log."
        ),
    )
    log_tail: str = Field(default="", description="The last lines of that rank's log.")
    stack: str = Field(
        default="",
        description=(
            "Of a hang whose ranks still ran: that rank's Python stacks (every thread, faulthandler's dump, its "
            "last 4,000 characters) taken when the hang was found; every rank's dump is in the run directory's "
            "incarnations/K/stacks/."
        ),
    )
    cost_seconds: float | None = Field(
        default=None,
        ge=0,
        description=(
            "What the fault cost the run before it was found, where it ran on (a straggler: its extra work on "
            "every step while it was seen slow) (seconds); None for faults that stop the run at once."
        ),
    )
