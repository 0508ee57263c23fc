"""Rescheduling a recovery: read the inventory until the policy can place the next incarnation,
wait for capacity while it cannot (recovery.capacity_wait_seconds), then ask an operator; and
claiming the decision's nodes (replace_or_reshard), for a recovery, a regrow or an operator.

A mixin of TrainingRun, as the operator controls are (workflows/controls.py); the decision itself
is the pure function of workflows/policy.py.
"""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from lazarus.activities.recovery import RecoveryActivities
    from lazarus.schema.controls import ApproveRequest
    from lazarus.schema.pool import SpareWant
    from lazarus.schema.records import Assignment, Decision, FaultReport, Incident, Inventory, Regrowth, RunState
    from lazarus.schema.stages import ReplaceInput, ResumeResult
    from lazarus.workflows.policy import batch_said, plan_claimed, plan_recovery, spare_want
from lazarus.workflows.run_parts import RunParts
from lazarus.workflows.stage_calls import RunAborted, RunFailed

# Deprecated patches: each id's workflow.deprecate_patch stands where its workflow.patched stood, so
# that histories with the id's marker replay (the patch policy: docs/concepts/run-as-workflow.md).
RESHARD_PATCH = "reshard-without-spare"
"""Deprecated patch id: recovery reshards when there are too few spares (before: it waited)."""
SHARED_SPARES_PATCH = "shared-spares"
"""Deprecated patch id: the pool's spares go to the runs that need them by priority, and a run holds
at most cluster.active_nodes + cluster.spare_nodes nodes (before: any free spare, first come)."""
ESCALATE_PATCH = "escalate-to-operator"
"""Deprecated patch id: after the capacity wait, wait for an operator's approval (before: fail)."""
GATHER_PATCH = "gather-in-workflow"
"""Deprecated patch id: a run hit with others of its fault domain waits for them to drain on a
timer of its own, between reads of the inventory (before: inside the reschedule activity, where
it held the worker's slots that the others needed to drain)."""
GATHER_POLL_SECONDS = 1.0
"""How often a gathering run reads the inventory again (seconds)."""


class Rescheduling(RunParts):
    """The reschedule stage of TrainingRun's recovery, with its capacity wait and escalation, and the
    claim of what it decided."""

    async def _reschedule(self, incident: Incident, fault: FaultReport) -> Decision:
        """Read the inventory until the policy can place the next incarnation: without capacity,
        wait for it (recovery.capacity_wait_seconds), then ask an operator."""
        self._enter(RunState.RESCHEDULING)
        waited_since = workflow.now()
        capacity_until, min_dp = self._policy.capacity_wait_seconds, self._policy.min_dp
        workflow.deprecate_patch(GATHER_PATCH)
        while True:
            self._check_abort()
            inventory = await self._stage("reschedule", RecoveryActivities.reschedule, self._reading(), incident)
            inventory = await self._gathered(inventory, incident)
            incident.shared = inventory.shared or incident.shared
            incident.decision = decision = self._plan(inventory, fault, min_dp)
            if decision.action != "wait":
                self._status.awaiting_approval = None
                return decision
            self._enter(RunState.WAITING_FOR_CAPACITY)
            waited = (workflow.now() - waited_since).total_seconds()
            if waited < capacity_until:
                await self._wait_for_capacity(min(self._policy.capacity_poll_seconds, capacity_until - waited))
                continue
            approval = await self._escalate(incident, decision, waited)
            if approval.action == "reshard_below_minimum":
                min_dp = 1
            else:
                capacity_until = waited + approval.wait_seconds

    async def _replace_and_resume(
        self,
        decision: Decision,
        incident: Incident | None,
        fault_kind: str,
        survivors_of: int | None = None,
        timing: Regrowth | None = None,
    ) -> ResumeResult:
        """Replace-or-reshard and resume, for a fault's recovery (its incident records the stages) and
        an operator's restart (no incident): claim the decision's nodes and write the next assignment,
        start it from the newest complete checkpoint. TRAINING again unless a fault hit it first."""
        self._enter(RunState.REPLACING if decision.action == "replace" else RunState.RESHARDING)
        old = self._status.assignment
        assignment = await self._claim(decision, fault_kind, incident if incident is not None else timing)
        as_decided = (assignment.nodes, assignment.layout) == (decision.nodes, decision.layout)
        if incident is not None and old is not None and not as_decided:
            # An earlier attempt of these stages claimed first: its workflow task timed out while its
            # local activity ran on, and committed after this attempt's reschedule had read no claim.
            # The claim stands (exactly once); the incident says what it is.
            claimed = plan_claimed(old, assignment, incident.fault.nodes, self._start.spec.layout.dp)
            incident.decision = batch_said(claimed, self._status.steps_from == "trainer")
        return await self._take_up(assignment, incident, survivors_of, timing)

    async def _claim(self, decision: Decision, fault_kind: str, record: Incident | Regrowth | None) -> Assignment:
        """The replace_or_reshard stage: claim the decision's nodes and record the next incarnation's
        assignment (the stage timed on `record`)."""
        status = self._status
        assert status.assignment is not None, "the run loop launches before it replaces"
        placing = ReplaceInput(
            run_id=status.run_id,
            decision=decision,
            old_assignment=status.assignment,
            fault_kind=fault_kind,
        )
        return await self._stage("replace_or_reshard", RecoveryActivities.replace_or_reshard, placing, record)

    async def _gathered(self, inventory: Inventory, incident: Incident) -> Inventory:
        """The inventory once the runs hit with this one in its fault domain have drained (their
        needs of spares are then lodged, and the spares go by priority), read again every
        GATHER_POLL_SECONDS: the wait ends when none of them drained for
        recovery.burst_gather_seconds, and lasts at most the reschedule stage's timeout."""
        gather = self._policy.burst_gather_seconds
        started = last_drain = workflow.now()
        limit = self._policy.stages.reschedule.timeout_seconds
        undrained = len(inventory.shared.undrained) if inventory.shared else 0
        while undrained and (workflow.now() - last_drain).total_seconds() < gather:
            if (workflow.now() - started).total_seconds() >= limit:
                break
            await workflow.sleep(GATHER_POLL_SECONDS)
            inventory = await self._stage("reschedule", RecoveryActivities.reschedule, self._reading(), incident)
            now_undrained = len(inventory.shared.undrained) if inventory.shared else 0
            if now_undrained < undrained:
                last_drain = workflow.now()
            undrained = now_undrained
        return inventory

    def _want(self, fault: FaultReport) -> SpareWant:
        """What the fault makes the run need of the pool's spares."""
        workflow.deprecate_patch(SHARED_SPARES_PATCH)
        assert self._status.assignment is not None, "the run loop launches before it recovers"
        return spare_want(self._status.run_id, self._status.assignment, fault, self._start.spec.cluster.priority)

    def _plan(self, inventory: Inventory, fault: FaultReport, min_dp: int) -> Decision:
        assignment, target, cluster = self._status.assignment, self._start.spec.layout.dp, self._start.spec.cluster
        assert assignment is not None, "the run loop launches before it recovers"
        want, limit = self._want(fault), cluster.active_nodes + cluster.spare_nodes
        decision = plan_recovery(
            inventory, assignment, fault.nodes, target_dp=target, min_dp=min_dp, want=want, node_limit=limit
        )
        if decision.action == "reshard":
            workflow.deprecate_patch(RESHARD_PATCH)
        return batch_said(decision, self._status.steps_from == "trainer")

    async def _wait_for_capacity(self, seconds: float) -> None:
        """Until the next read of the inventory: a returned node or an abort ends the wait early."""
        self._inventory_changed = False
        try:
            await workflow.wait_condition(lambda: self._inventory_changed or self._requested("abort"), timeout=seconds)
        except TimeoutError:
            pass

    async def _escalate(self, incident: Incident, decision: Decision, waited: float) -> ApproveRequest:
        """The capacity wait ran out: wait for an operator's approve (or abort), up to
        recovery.approval_wait_seconds; RunFailed when the policy asks no one or no one answers."""
        reason = (
            f"no capacity to recover from incident {incident.number}: {decision.reason}; "
            f"waited {waited:.0f} s (recovery.capacity_wait_seconds: {self._policy.capacity_wait_seconds:g})"
        )
        workflow.deprecate_patch(ESCALATE_PATCH)
        if self._policy.approval_wait_seconds == 0:
            raise RunFailed(
                reason + "; return a repaired node with `lazarus chaos return-node` and start the run again"
            )
        self._status.awaiting_approval = decision
        self._enter(RunState.WAITING_FOR_APPROVAL)
        try:
            await workflow.wait_condition(
                lambda: self._approval is not None or self._requested("abort"),
                timeout=self._policy.approval_wait_seconds,
            )
        except TimeoutError:
            raise RunFailed(
                reason + f"; no operator approved within {self._policy.approval_wait_seconds:g} s "
                "(recovery.approval_wait_seconds); the newest checkpoint is kept"
            ) from None
        finally:
            self._status.awaiting_approval = None
        self._check_abort()
        approval, self._approval = self._approval, None
        assert approval is not None, "only an abort ends the wait without an approval (_check_abort)"
        self._enter(RunState.RESCHEDULING)
        return approval

    def _check_abort(self) -> None:
        """Between two stages of a recovery, an accepted abort ends the run (drain stopped the ranks)."""
        if self._requested("abort"):
            raise RunAborted("aborted by an operator during recovery; the newest checkpoint is kept")
