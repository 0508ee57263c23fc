"""The detect watch: the detect activity watches one incarnation until it reports (a fault,
completion, or a progress snapshot at a bounded interval), and a fault reported by signal or an
operator's request interrupts it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from lazarus.activities.recovery import RecoveryActivities
    from lazarus.schema.controls import FaultSignal
    from lazarus.schema.policy import RecoveryPolicy
    from lazarus.schema.records import Assignment, DetectResult, FaultReport, RankProgress, RunStatus
    from lazarus.schema.stages import DetectInput

from lazarus.workflows.stage_calls import RunFailed, root_cause, stage_options
from lazarus.workflows.story import activity_summary

# Deprecated patches: each id's workflow.deprecate_patch stands where its workflow.patched stood, so
# that histories with the id's marker replay (the patch policy: docs/concepts/run-as-workflow.md).
KEPT_REPORT_PATCH = "watch-report-kept"
"""Deprecated patch id: a watch that reports in the workflow task that interrupts it returns its
report (before: dropped, and with it a fault the watch had found)."""


WATCH_QUEUE_SUFFIX = "-watch"
"""The watches (detect) of a run on task queue Q run on task queue Q + this: a watch holds its worker's
slot for as long as the run trains, so watches and the short recovery stages, on Q, never compete
for the same slots, and a worker can take only the stages it can start at once (lazarus/worker.py)."""


def watch_queue(task_queue: str) -> str:
    """The task queue of the watches of runs on `task_queue`."""
    return f"{task_queue}{WATCH_QUEUE_SUFFIX}"


async def watch(
    status: RunStatus,
    policy: RecoveryPolicy,
    reported: list[FaultSignal],
    interrupted: Callable[[], bool],
    regrow_nodes: int | None = None,
    node_limit: int | None = None,
) -> DetectResult | None:
    """Run detect on the current incarnation until it reports; cancel it when a signal in `reported`
    blames one of its nodes (that report is used up and returned as an external fault) or when
    `interrupted()` (None: the caller has something to do first). With `regrow_nodes`, its report
    says whether the pool has that many spares for the run (DetectInput)."""
    assignment = status.assignment
    assert assignment is not None, "the run loop launches before it watches"
    request = DetectInput(
        run_id=status.run_id,
        incarnation=assignment.incarnation,
        total_steps=status.total_steps,
        policy=policy,
        regrow_nodes=regrow_nodes,
        node_limit=node_limit,
        known_warnings=status.warnings,
    )
    # On a task queue of its own (no patch: replay compares an activity's type and id, not its queue).
    detect = workflow.start_activity_method(
        RecoveryActivities.detect,
        request,
        summary=activity_summary("detect", request),
        task_queue=watch_queue(workflow.info().task_queue),
        **stage_options(policy.stages.detect),
    )
    await workflow.wait_condition(
        lambda: detect.done() or signalled_fault(reported, status.assignment) is not None or interrupted()
    )
    if detect.done():
        try:
            return detect.result()
        except ActivityError as error:
            raise RunFailed(f"detect failed after its retry policy: {root_cause(error)}") from None
    detect.cancel()
    try:
        reported_anyway = await detect
        # A watch that reported in the same workflow task as the interruption (its verdict and an
        # operator's request arrive together) keeps its report: a fault is never dropped.
        workflow.deprecate_patch(KEPT_REPORT_PATCH)
        return reported_anyway
    except (ActivityError, asyncio.CancelledError):
        pass
    return _signalled(status, reported)


def _signalled(status: RunStatus, reported: list[FaultSignal]) -> DetectResult | None:
    """The watch's result for a fault reported by signal, which used it up; None when none blames a
    node of the run (an operator's request interrupted the watch)."""
    report = signalled_fault(reported, status.assignment)
    if report is None or status.assignment is None:
        return None
    reported.clear()
    now = workflow.now()
    fault = FaultReport(
        kind="external",
        nodes=report.nodes,
        incarnation=status.assignment.incarnation,
        occurred_at=report.occurred_at or now,
        detected_at=now,
        step=status.step,
        reason=report.reason,
    )
    return DetectResult(fault=fault, progress=RankProgress(step=status.step, at=now))


def signalled_fault(reported: list[FaultSignal], assignment: Assignment | None) -> FaultSignal | None:
    """The first report that blames nodes of `assignment`, narrowed to those; reports before it that
    blame none of them are dropped from `reported`."""
    nodes = set(assignment.nodes) if assignment else set()
    while reported:
        relevant = [n for n in reported[0].nodes if n in nodes]
        if relevant:
            return reported[0].model_copy(update={"nodes": relevant})
        workflow.logger.warning("report_fault names no node of the current assignment: %s", reported[0].nodes)
        reported.pop(0)
    return None
