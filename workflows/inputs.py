"""What a run is sent, as the workflow decodes it: a payload that does not fit its model is the
sender's mistake, so it fails the workflow (start), is refused (update) or dropped (signal), with
one line naming the field; it never fails a workflow task, which would retry it forever.

The SDK wraps a decoding error in RuntimeError("Failed decoding arguments"), which fails the
task, unless the error is a Temporal failure: so the models the handlers declare are subclasses
that turn pydantic's ValidationError into a non-retryable ApplicationError. A payload that is no
model at all (null, raw bytes) never reaches pydantic; `expect` refuses it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from pydantic import BaseModel, ValidationError, create_model, model_validator

    from lazarus.schema.controls import (
        AbortRequest,
        ApproveRequest,
        DrainNodeRequest,
        FaultSignal,
        PauseRequest,
        ReshardRequest,
        ResumeRequest,
        ReturnNodeRequest,
        SetPolicyRequest,
    )
    from lazarus.schema.load import validation_message
    from lazarus.schema.names import check_run_id
    from lazarus.schema.records import RunStart

# Deprecated patches: each id's workflow.deprecate_patch stands where its workflow.patched stood, so
# that histories with the id's marker replay (the patch policy: docs/concepts/run-as-workflow.md).
OWNER_PATCH = "one-owner"
"""Deprecated patch id: a start whose input names another run than its workflow id is refused
(before: the input's run_id named the run)."""

INVALID_INPUT = "InvalidInput"
"""ApplicationError type of a payload that does not fit its model."""

Model = TypeVar("Model", bound=BaseModel)


def refusing(model: type[Model]) -> type[Model]:
    """`model` as a handler's parameter type: decoding a payload that does not validate raises a
    non-retryable ApplicationError (type INVALID_INPUT) naming the model and the field."""

    def refuse(cls, data: Any, handler):
        try:
            return handler(data)
        except ValidationError as error:
            raise ApplicationError(
                f"{model.__name__}: {validation_message(error, whole='input')}", type=INVALID_INPUT, non_retryable=True
            ) from None

    return create_model(
        model.__name__,
        __base__=model,
        __module__=__name__,
        # pydantic takes a decorated validator here; its stub says a plain callable.
        __validators__={"_refuse_invalid": cast(Callable[..., Any], model_validator(mode="wrap")(refuse))},
    )


def expect(value: Any, model: type[BaseModel], what: str) -> None:
    """ValueError in one line unless `value` is a `model` (a null or raw-bytes payload is not)."""
    if not isinstance(value, model):
        raise ValueError(f"{what} takes a {model.__name__} (a mapping of its fields), not {type(value).__name__}")


# The types the workflow's handlers decode their payloads as.
if TYPE_CHECKING:
    # A class made by a call is no type to a type checker; each is a subclass of its model that
    # only validates differently, so it checks as the model.
    RunStartPayload = RunStart
    PausePayload = PauseRequest
    ResumePayload = ResumeRequest
    AbortPayload = AbortRequest
    DrainNodePayload = DrainNodeRequest
    ReshardPayload = ReshardRequest
    ReturnNodePayload = ReturnNodeRequest
    ApprovePayload = ApproveRequest
    SetPolicyPayload = SetPolicyRequest
    FaultSignalPayload = FaultSignal
else:
    RunStartPayload = refusing(RunStart)
    """A bad run id or spec fails the run before it touches a file (a plain client can send anything)."""
    PausePayload = refusing(PauseRequest)
    ResumePayload = refusing(ResumeRequest)
    AbortPayload = refusing(AbortRequest)
    DrainNodePayload = refusing(DrainNodeRequest)
    ReshardPayload = refusing(ReshardRequest)
    ReturnNodePayload = refusing(ReturnNodeRequest)
    ApprovePayload = refusing(ApproveRequest)
    SetPolicyPayload = refusing(SetPolicyRequest)
    FaultSignalPayload = refusing(FaultSignal)


def own_run_id(start: RunStart) -> str:
    """The run's id: its workflow id. A start whose input names another run is refused (two
    workflows would drive one run directory)."""
    workflow_id = workflow.info().workflow_id
    if start.run_id is not None and start.run_id != workflow_id:
        workflow.deprecate_patch(OWNER_PATCH)
        raise ApplicationError(
            f"the input's run_id {start.run_id!r} is not the workflow id {workflow_id!r}: a run's id is its "
            f"workflow id; start workflow {start.run_id!r}, or leave run_id out",
            type=INVALID_INPUT,
            non_retryable=True,
        )
    try:
        return check_run_id(workflow_id)
    except ValueError as error:
        raise ApplicationError(
            f"the workflow id {workflow_id!r} cannot name a run: {error}", type=INVALID_INPUT, non_retryable=True
        ) from None
