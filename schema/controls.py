"""What operators and external detectors send a run: one input model per update, the answer, the signal."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from lazarus.schema.base import MAX_SECONDS, Record
from lazarus.schema.names import NodeName

REASON_LIMIT = 1000
"""Longest reason kept from an operator or a detector (characters): it is recorded on the run's
status, which every query answers and every continue-as-new carries within Temporal's payload
limits. A longer one is cut, not refused: a detector's report must not be dropped for its prose,
and histories recorded before the limit must still replay."""


def _cut(reason: str) -> str:
    if len(reason) <= REASON_LIMIT:
        return reason
    return f"{reason[:REASON_LIMIT]}... ({len(reason) - REASON_LIMIT} more characters)"


Reason = Annotated[str, AfterValidator(_cut)]
"""A free-text reason, cut at REASON_LIMIT characters."""

LEGACY_DEFAULTS: dict[str, Any] = {
    "reason": "",
    "node": None,
    "dp": None,
    "action": None,
    "wait_seconds": 600.0,
    "changes": {},
}
"""Fields of the one request model every update took before each got its own, at their defaults.

Histories recorded then carry all of them in every update's input; a replay must still decode
those, so each model drops the ones it does not declare while they hold these values. Any other
unknown field is refused, as everywhere in the schema."""


class ControlRequest(Record):
    """Base of the update inputs."""

    @model_validator(mode="before")
    @classmethod
    def _drop_legacy_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {
            key: value
            for key, value in data.items()
            if key in cls.model_fields or key not in LEGACY_DEFAULTS or value != LEGACY_DEFAULTS[key]
        }


class PauseRequest(ControlRequest):
    """`pause`: checkpoint, stop the ranks, hold the nodes."""

    reason: Reason = Field(default="", description="Why, in the operator's words (recorded on the intervention).")


class ResumeRequest(ControlRequest):
    """`resume`: continue a paused run on the nodes it held."""

    reason: Reason = Field(default="", description="Why, in the operator's words.")


class AbortRequest(ControlRequest):
    """`abort`: stop the run cleanly; the newest checkpoint is kept."""

    reason: Reason = Field(default="", description="Why, in the operator's words (part of the run's final reason).")


class DrainNodeRequest(ControlRequest):
    """`drain_node`: treat a node as faulty, with the same recovery as a detected fault."""

    node: NodeName = Field(description="Node of the current assignment to drain.")
    reason: Reason = Field(default="", description="Why, in the operator's words (recorded on the incident).")


class ReturnNodeRequest(ControlRequest):
    """`return_node`: a repaired node rejoins the run's spare pool."""

    node: NodeName = Field(description="A node this run quarantined.")


class ReshardRequest(ControlRequest):
    """`reshard`: run at `dp` replicas (checkpoint, stop, re-plan, resume)."""

    dp: int = Field(ge=1, description="Data-parallel degree to run at (replicas), at most the spec's layout.dp.")
    reason: Reason = Field(default="", description="Why, in the operator's words.")


class ApproveRequest(ControlRequest):
    """`approve`: answer an escalation (state WAITING_FOR_APPROVAL)."""

    action: Literal["reshard_below_minimum", "wait_longer"] = Field(
        description="reshard_below_minimum: reshard below recovery.min_dp; wait_longer: keep waiting for capacity."
    )
    wait_seconds: float = Field(
        default=600.0,
        gt=0,
        le=MAX_SECONDS,
        allow_inf_nan=False,
        description="With wait_longer: how much longer to wait (seconds).",
    )


class SetPolicyRequest(ControlRequest):
    """`set_policy`: change recovery policy fields; they apply from the next activity on."""

    changes: dict = Field(
        default_factory=dict,
        description="Recovery policy fields and their new values, nested as in the spec, "
        "e.g. {hang_after_seconds: 60, stages: {drain: {max_attempts: 9}}}.",
    )


class OperatorAnswer(Record):
    """What an operator's update did."""

    message: str = Field(description="What happened, in words.")
    state: str = Field(description="The run's state afterwards.")


class FaultSignal(Record):
    """`report_fault` signal: an external detector or an operator blames nodes."""

    nodes: list[str] = Field(
        min_length=1, description="Nodes to treat as faulty; names not in the current assignment are ignored."
    )
    reason: Reason = Field(default="reported by signal", description="Why, in the reporter's words.")
    occurred_at: datetime | None = Field(
        default=None, description="When the fault happened, if the reporter knows (UTC); else when the signal arrived."
    )

    @field_validator("occurred_at")
    @classmethod
    def _utc(cls, value: datetime | None) -> datetime | None:
        # A time without a zone is taken as UTC, as documented: the workflow subtracts it from
        # its own (aware) clock, which a naive time cannot be subtracted from.
        return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value
