"""Calling a stage's activity: its timeouts and retries come from the run's recovery policy, and
what a failure means for the run is decided here, once.

The stages between a fault's report and the next incarnation's start, drain, reschedule and
replace_or_reshard, run as local activities: each takes milliseconds to a few seconds on the
worker that runs the workflow, and as local activities they run one after another in the workflow
task that follows detect's report, with no round trip to the server and no task of their own. A
burst of faults across a fleet is decided in a few events a run (bench/controller_scale.py: 0.1 to
0.2 s from report to decision for 200 runs, against 0.6 s as activities of their own). They are recorded
in the history as markers, with their timeouts and retry policy from the spec as every stage; a
worker lost in one is replaced when the workflow task times out, and the stage runs again (every
stage is idempotent). A local activity holds its workflow task, and with it the run's queries and
updates, so a drain waits for the ranks at most LOCAL_WAIT_SECONDS there; a grace that runs longer
(a survivor that does not end) goes on in an activity of its own, with the task free.

A stage that refuses its request for good (a non-retryable ApplicationError) raises StageRefused,
which the recovery may answer (a spare lost before its claim is decided again); a stage that
exhausts its retry policy fails the run (RunFailed), with the policy it ran under in the reason.
Every request names the execution that sends it (schema/ownership.py); a stage that refuses it
because another execution owns the run raises OwnerChanged, which the run loop answers
(workflows/takeover.py).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from lazarus.schema.ownership import NOT_OWNER, Owner, Ownership
    from lazarus.schema.policy import RecoveryPolicy, StagePolicy
    from lazarus.schema.stages import RunRequest

from lazarus.workflows.story import activity_summary


class RunFailed(Exception):
    """A business failure: the run cannot go on; the workflow fails with this reason."""


class RunAborted(Exception):
    """An operator aborted the run; the workflow ends ABORTED with this reason."""


class StageRefused(RunFailed):
    """An activity refused its request for good (a non-retryable error of type `kind`)."""

    def __init__(self, stage: str, kind: str, message: str):
        super().__init__(f"{stage} refused ({kind}): {message}")
        self.stage = stage
        self.kind = kind

    @property
    def spare_lost(self) -> bool:
        """Whether a node the decision counted on died or was claimed by another run before its
        claim: the decision is stale, not wrong, and deciding again may succeed."""
        return (self.stage, self.kind) == ("replace_or_reshard", "SpareUnavailable")


class OwnerChanged(RunFailed):
    """A stage refused the request: another execution owns the run (`record`)."""

    def __init__(self, stage: str, message: str, record: Ownership):
        super().__init__(f"{stage} refused: {message}")
        self.record = record


def calling_execution() -> Owner:
    """This workflow execution, as it names itself to its activities."""
    info = workflow.info()
    return Owner(
        workflow_id=info.workflow_id,
        execution=info.run_id,
        lineage=info.first_execution_run_id,
        continued_from=info.continued_run_id,
    )


def stage_options(stage: StagePolicy) -> dict[str, Any]:
    """Timeouts and retry policy of one activity call, from the run's recovery policy."""
    return {
        "start_to_close_timeout": timedelta(seconds=stage.timeout_seconds),
        "heartbeat_timeout": timedelta(seconds=stage.heartbeat_timeout_seconds),
        "retry_policy": RetryPolicy(
            initial_interval=timedelta(seconds=stage.initial_retry_seconds),
            backoff_coefficient=stage.retry_backoff,
            maximum_interval=timedelta(seconds=stage.max_retry_seconds),
            maximum_attempts=stage.max_attempts,
        ),
    }


# Deprecated patches: each id's workflow.deprecate_patch stands where its workflow.patched stood, so
# that histories with the id's marker replay (the patch policy: docs/concepts/run-as-workflow.md).
LOCAL_STAGES_PATCH = "local-recovery-stages"
"""Deprecated patch id: drain, reschedule and replace_or_reshard run as local activities (before:
activities with a task of their own each)."""

LOCAL_STAGES = ("drain", "reschedule", "replace_or_reshard")
"""Stages that run as local activities (LOCAL_STAGES_PATCH)."""

LOCAL_WAIT_SECONDS = 0.5
"""The most a local drain waits for the ranks (DrainInput.wait_cap_seconds) before the rest of its
graces runs as an activity of its own: how late an operator's query or update may be answered
during a drain (seconds). A death's survivors save and end within tens of milliseconds, so most
drains end inside it."""


def root_cause(error: BaseException) -> str:
    """The innermost cause's message: what the last attempt died of, not Temporal's wrapping."""
    while error.__cause__ is not None:
        error = error.__cause__
    return str(error) or type(error).__name__


async def call_stage(policy: RecoveryPolicy, name: str, method: Any, request: Any) -> Any:
    """Run activity `method` under recovery.stages.<name>; StageRefused or RunFailed when it fails."""
    stage: StagePolicy = getattr(policy.stages, name)
    # No patch: replay compares an activity's type and id, not its input, and a run that predates
    # ownership gains an owner on its next stage.
    if isinstance(request, RunRequest) and request.owner is None:
        request = request.model_copy(update={"owner": calling_execution()})
    summary, options = activity_summary(name, request), stage_options(stage)
    try:
        if name in LOCAL_STAGES:
            workflow.deprecate_patch(LOCAL_STAGES_PATCH)
            # A local activity's liveness is its workflow task's: it has no heartbeat timeout.
            local = {key: value for key, value in options.items() if key != "heartbeat_timeout"}
            if "wait_cap_seconds" in type(request).model_fields:
                request = request.model_copy(update={"wait_cap_seconds": LOCAL_WAIT_SECONDS})
            result = await workflow.execute_local_activity_method(method, request, summary=summary, **local)
            if getattr(result, "unfinished", None) is None:
                return result
            # A local activity holds the workflow task, and with it every query and update, until it
            # ends: the rest of a long wait runs as an activity of its own, which leaves the task free.
            request = request.model_copy(update={"waited": result.unfinished, "wait_cap_seconds": None})
            summary = activity_summary(name, request)
        return await workflow.execute_activity_method(method, request, summary=summary, **options)
    except (ActivityError, ApplicationError) as error:
        # A local activity's failure comes as itself, another's inside an ActivityError.
        cause = error.cause if isinstance(error, ActivityError) else error
        if isinstance(cause, ApplicationError) and cause.type == NOT_OWNER:
            raise OwnerChanged(name, cause.message, Ownership.model_validate(cause.details[0])) from None
        if isinstance(cause, ApplicationError) and cause.non_retryable:
            raise StageRefused(name, cause.type or "error", cause.message) from None
        attempts = "unlimited" if stage.max_attempts == 0 else stage.max_attempts
        raise RunFailed(
            f"{name} failed after its retry policy (recovery.stages.{name}: {attempts} attempts, "
            f"{stage.timeout_seconds:g} s each): {root_cause(error)}"
        ) from None
