"""What the parts of TrainingRun share, declared once: its state, and the steps one part takes that
another provides.

TrainingRun is one workflow written as parts by concern (OperatorControls, Rescheduling,
Regrowing, TakingOver, Incidents, and the run loop in TrainingRun itself). Each part inherits
RunParts, so every attribute the parts share is declared here and nowhere else; TrainingRun.__init__
and OperatorControls.__init__ set them. A step below that raises NotImplementedError is provided by
the part named in its docstring, which comes earlier in TrainingRun's bases and so overrides it.
"""

from __future__ import annotations

from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from lazarus.schema.controls import ApproveRequest
    from lazarus.schema.policy import RecoveryPolicy
    from lazarus.schema.records import (
        Assignment,
        Decision,
        FaultReport,
        Incident,
        Intervention,
        InterventionKind,
        Regrowth,
        RunStart,
        RunState,
        RunStatus,
    )
    from lazarus.schema.stages import RescheduleInput, ResumeResult, StopResult
from lazarus.workflows.stage_calls import StageRefused


class RunParts:
    """The state and the steps TrainingRun's parts share."""

    _start: RunStart
    """What the run was started with (its spec, its id, what a continue-as-new carried)."""
    _status: RunStatus
    """The run as its query shows it: state, step, assignment, incidents, the policy in force."""
    _next_fault: FaultReport | None
    """A fault met while an operator's restart waited for its first step: the run loop recovers it next."""
    _approval: ApproveRequest | None
    """An operator's approval of a recovery that waits for one, until the reschedule takes it."""
    _inventory_changed: bool
    """Whether the pool changed (a node returned) since the capacity wait last looked."""

    @property
    def _policy(self) -> RecoveryPolicy:
        """The recovery policy in force: the spec's, as operators changed it."""
        policy = self._status.policy
        assert policy is not None, "TrainingRun.__init__ sets it"
        return policy

    def _reading(self) -> RescheduleInput:
        """The reschedule stage's request: the run, and the incarnation its next claim would follow
        (a claim made already is the decision: Inventory.claimed)."""
        assignment = self._status.assignment
        return RescheduleInput(run_id=self._status.run_id, incarnation=assignment and assignment.incarnation)

    def _enter(self, state: RunState) -> None:
        """Move the run to `state`, as the state machine allows (TrainingRun)."""
        raise NotImplementedError

    async def _stage(self, name: str, method, request, incident: Incident | Regrowth | None = None) -> Any:
        """Run a stage's activity, timed on `incident` (or a regrow) when given (TrainingRun)."""
        raise NotImplementedError

    async def _resume(self, assignment, record=None, fault_step=None, survivors_of=None) -> ResumeResult:
        """Start the assignment's incarnation; TRAINING unless a fault hit it first (TrainingRun)."""
        raise NotImplementedError

    async def _replace_and_resume(
        self,
        decision: Decision,
        incident: Incident | None,
        fault_kind: str,
        survivors_of: int | None = None,
        timing: Regrowth | None = None,
    ) -> ResumeResult:
        """Claim the decision's nodes and start the next incarnation (Rescheduling)."""
        raise NotImplementedError

    async def _claim(self, decision: Decision, fault_kind: str, record: Incident | Regrowth | None) -> Assignment:
        """Claim the decision's nodes and record the next incarnation's assignment (Rescheduling)."""
        raise NotImplementedError

    async def _take_up(
        self,
        assignment: Assignment,
        incident: Incident | None,
        survivors_of: int | None = None,
        timing: Regrowth | None = None,
    ) -> ResumeResult:
        """Make the claimed assignment the run's and start it (TrainingRun)."""
        raise NotImplementedError

    async def _claim_while_training(
        self, decision: Decision, kind: str, timing: Regrowth | None = None
    ) -> Assignment | StageRefused | None:
        """Claim a growing layout's new nodes while the ranks train on (Regrowing)."""
        raise NotImplementedError

    async def _restart(self, decision: Decision, claimed: Assignment | None = None) -> bool:
        """Start the next incarnation on `decision`'s nodes (claimed already: `claimed`); True when
        training is done (TrainingRun)."""
        raise NotImplementedError

    async def _recover_all(self, fault: FaultReport) -> bool:
        """Recover from `fault` as from a detected one; True when training is done (TrainingRun)."""
        raise NotImplementedError

    async def _stop_ranks(self, why: str, timing: Incident | Regrowth | None = None) -> StopResult | None:
        """Checkpoint and stop the current incarnation, the stop timed on `timing` when given; None
        when the run is paused (OperatorControls)."""
        raise NotImplementedError

    def _requested(self, kind: str) -> bool:
        """Whether an operator request of this kind is outstanding (OperatorControls)."""
        raise NotImplementedError

    def _intervene(self, kind: InterventionKind, detail: str) -> Intervention:
        """Record an operator's intervention (OperatorControls)."""
        raise NotImplementedError
