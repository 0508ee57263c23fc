"""Who drives a run: the workflow execution that owns its cluster state, and how that changes hands.

A run's id is its workflow id, so at most one execution of it is open at a time (Temporal's rule
for a workflow id). The owner record (in the store, or the run directory) says which execution that is; every
activity checks it before it acts (infra/ownership.py), so an execution that is not the owner
(one that was reset away, one of an earlier workflow under the same id, a stray activity of a
terminated one) changes nothing.

An execution names itself by its Temporal run id, its lineage (the first run of its
continue-as-new chain, which a reset keeps) and the run it continued from. The owner passes to a
later run of its chain silently; any other change of hands is a Handover: a reset (the same
lineage, another execution) or an adoption (another lineage, asked for by an operator).
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from lazarus.schema.base import Record

NOT_OWNER = "NotOwner"
"""ApplicationError type of an activity refused because another execution owns the run; its
details hold the owner record (Ownership, as JSON)."""

HANDOVERS_KEPT = 20
"""Handovers an owner record keeps, newest last (each is also an intervention in the history)."""


class Owner(Record):
    """A workflow execution, as it names itself to the activities it calls."""

    workflow_id: str = Field(description="The workflow id (the run id).")
    execution: str = Field(description="Temporal run id of the execution that sent the request.")
    lineage: str = Field(
        description="Temporal run id of the first execution of its continue-as-new chain (a reset keeps it)."
    )
    continued_from: str | None = Field(
        default=None, description="Temporal run id of the execution it continued as new from; None for a first run."
    )


class Handover(Record):
    """The run passed from one execution to another, other than by continue-as-new."""

    kind: Literal["reset", "adopt"] = Field(
        description="reset: an execution of the same chain after a workflow reset; adopt: a new workflow took the run."
    )
    from_execution: str = Field(description="Temporal run id of the execution that owned the run before.")
    to_execution: str = Field(description="Temporal run id of the execution that owns it since.")
    at: datetime = Field(description="When it changed hands (UTC).")


class Ownership(Record):
    """The owner record: a row of the store (or the run directory's `owner.json`)."""

    owner: Owner = Field(description="The execution that drives the run.")
    since: datetime = Field(description="When it took the run (UTC): its launch, continue-as-new or handover.")
    handovers: list[Handover] = Field(
        default_factory=list, description=f"Resets and adoptions, oldest first (the newest {HANDOVERS_KEPT})."
    )

    def admits(self, owner: Owner) -> bool:
        """Whether `owner` may act on the run: it is the owner, or a later run of the owner's chain
        (the owner continued as new; it never acts again)."""
        held = self.owner
        if owner.workflow_id != held.workflow_id or owner.lineage != held.lineage:
            return False
        return owner.execution == held.execution or owner.continued_from == held.execution

    def refusal(self, owner: Owner) -> str:
        """Why `owner` may not act, in one line, naming both executions and the way forward."""
        held = self.owner
        if owner.workflow_id != held.workflow_id:
            return (
                f"run {owner.workflow_id!r} is driven by workflow {held.workflow_id!r} (execution {held.execution}); "
                "a run is driven only by the workflow of its own id"
            )
        if owner.lineage == held.lineage:
            return (
                f"execution {held.execution} of this workflow drives run {owner.workflow_id!r}, not "
                f"{owner.execution}: the workflow was reset"
            )
        return (
            f"run {owner.workflow_id!r} belongs to an earlier workflow of this id (execution {held.execution}, "
            f"since {self.since:%Y-%m-%d %H:%M:%S} UTC), not to execution {owner.execution}; "
            f"to drive it from this workflow, adopt it: lazarus run adopt {owner.workflow_id}"
        )
