"""Taking a run over: after a reset, or when an operator adopts a run whose workflow ended.

A reset execution replays to its reset point and would redo what follows against a cluster that
has moved on; an adopting workflow starts from its predecessor's last status. Either one learns
it is not the run's owner from the first activity it calls (NOT_OWNER, schema/ownership.py),
takes the run over (the take_over activity: recorded in the run directory and here, as an
intervention) and takes up the run as the cluster holds it: the newest incarnation and its
claims stay as they are, so no incarnation number is used twice, no spare is claimed twice and
no rank is started twice. A mixin of TrainingRun.
"""

from __future__ import annotations

from typing import Literal

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from lazarus.activities.recovery import RecoveryActivities
    from lazarus.schema.records import (
        FaultReport,
        RankProgress,
        RunState,
    )
    from lazarus.schema.stages import TakeOverInput, TakeOverResult
from lazarus.workflows.progress import take_progress
from lazarus.workflows.run_parts import RunParts
from lazarus.workflows.stage_calls import OwnerChanged, RunFailed, calling_execution


class TakingOver(RunParts):
    """Answering a NOT_OWNER refusal: take the run over when this execution may, and reconcile."""

    async def _take_over(self, changed: OwnerChanged | None) -> bool:
        """Take the run over from the execution that holds it, and take it up as the cluster holds
        it; True when training is done. `changed` is the refusal that showed another execution
        holds the run; None for an adoption asked for at start. A refusal this execution may not
        answer (the run belongs to an earlier workflow and nobody asked to adopt it) fails the run
        with the refusal's reason."""
        me = calling_execution()
        kind: Literal["reset", "adopt"]
        if changed is None:
            kind, previous = "adopt", None
        else:
            held = changed.record.owner
            if held.workflow_id == me.workflow_id and held.lineage == me.lineage:
                kind, previous = "reset", held.execution
            elif self._start.adopt and held.workflow_id == me.workflow_id:
                kind, previous = "adopt", held.execution
            else:
                raise RunFailed(str(changed))
        self._enter(RunState.TAKING_OVER)
        intervention = self._intervene(kind, f"execution {me.execution} takes the run over")
        taking = TakeOverInput(run_id=self._status.run_id, previous=previous, kind=kind)
        found: TakeOverResult = await self._stage("take_over", RecoveryActivities.take_over, taking)
        for incident in self._status.incidents:
            if incident.outcome == "recovering":
                incident.outcome = "taken over"  # its recovery's end is whatever the cluster holds now
        intervention.done_at = workflow.now()
        intervention.outcome, done = await self._reconcile(found)
        if found.previous_owner is not None:
            intervention.outcome = f"from execution {found.previous_owner.execution}: {intervention.outcome}"
        return done

    async def _reconcile(self, found: TakeOverResult) -> tuple[str, bool]:
        """Take up the run as the cluster holds it; what was found, in words, and True when training is done."""
        status = self._status
        status.run_dir, status.quarantined_nodes = found.run_dir, found.quarantined
        assignment = found.assignment
        if assignment is None:
            status.assignment = None  # the run loop launches it (launch finds what exists)
            return "the run was never launched: launching it", False
        status.assignment, status.layout = assignment, assignment.layout
        where = f"incarnation {assignment.incarnation}"
        if status.steps_from == "trainer" and found.checkpoint_step >= status.total_steps:
            return f"{where} had trained every step", True
        if not found.launched:
            resumed = await self._resume(assignment)
            self._next_fault = resumed.fault  # a fault before its first step: the next incident
            return f"{where} was assigned but not started: started it", resumed.completed
        if found.stopped:
            self._enter(RunState.PAUSED)
            return f"{where} had been stopped at an operator's or a regrow's request: paused; resume or abort", False
        if found.ended:
            # Drained by a recovery that did not get to resume it: recover, replacing what it quarantined.
            now = workflow.now()
            self._next_fault = FaultReport(
                kind="external",
                nodes=[node for node in assignment.nodes if node in found.quarantined],
                incarnation=assignment.incarnation,
                occurred_at=now,
                detected_at=now,
                step=found.step if found.step is not None else status.step,
                reason=f"{where} had been drained and no later one started (found by a take-over)",
            )
            return f"{where} had been drained: recovering", False
        if found.step is not None:
            take_progress(status, RankProgress(step=found.step, at=workflow.now(), source=status.steps_from))
        self._enter(RunState.TRAINING)
        return f"{where} is training: watching it", False
