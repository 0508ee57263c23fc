"""Operator controls of a training run: the `status` query, the `report_fault` signal, eight updates.

A mixin of TrainingRun (the SDK collects query, signal and update handlers from base classes).
Each validator refuses a request that does not fit before it reaches the history. An accepted
request that touches the ranks (pause, resume, abort, drain_node, reshard) is queued together
with the method that carries it out; the run loop carries the queue out oldest first at its next
safe point (between stages, or by cancelling the watch), so operator actions and automatic
recovery never run at the same time. The update returns once its request has been carried out,
or refused when the run got there. return_node, approve and set_policy act from their handlers:
they leave the ranks alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from lazarus.activities.recovery import RecoveryActivities
    from lazarus.schema.controls import (
        AbortRequest,
        ApproveRequest,
        ControlRequest,
        DrainNodeRequest,
        FaultSignal,
        OperatorAnswer,
        PauseRequest,
        ReshardRequest,
        ResumeRequest,
        ReturnNodeRequest,
        SetPolicyRequest,
    )
    from lazarus.schema.policy_changes import changed_policy, describe_changes
    from lazarus.schema.records import (
        Decision,
        FaultReport,
        Incident,
        Intervention,
        InterventionKind,
        OperatorUpdate,
        Regrowth,
        RunState,
        RunStatus,
    )
    from lazarus.schema.stages import ReturnNodeInput, StopInput, StopResult
    from lazarus.schema.states import TERMINAL_STATES
    from lazarus.workflows.policy import nodes_for, plan_operator_reshard
from lazarus.workflows import inputs
from lazarus.workflows.inputs import expect
from lazarus.workflows.run_parts import RunParts
from lazarus.workflows.stage_calls import RunAborted, RunFailed, StageRefused, call_stage

Request = TypeVar("Request", bound=ControlRequest)


@dataclass
class Pending(Generic[Request]):
    """An accepted operator request, waiting for the run loop to carry it out."""

    intervention: Intervention
    request: Request
    carry_out: Callable[[Pending[Request]], Awaitable[bool]]
    """The method that carries the request out; it returns True when training is done."""
    error: str | None = None
    done: bool = False


class OperatorControls(RunParts):
    """The run's query, signal and updates, and carrying out the requests they queue."""

    def __init__(self) -> None:
        self._reported: list[FaultSignal] = []
        self._queue: list[Pending[Any]] = []  # waiting for the run loop, oldest first
        self._outstanding: list[Pending[Any]] = []  # accepted and not yet answered
        self._approval: ApproveRequest | None = None
        self._inventory_changed = False
        self._returning: set[str] = set()
        # Returns run one at a time: each rewrites the run's inventory on the backend, and the
        # histories recorded so far hold a second return's activity until the first one's ended.
        self._return_lock = asyncio.Lock()

    # --- query and signal ---------------------------------------------------------------

    @workflow.query
    def status(self) -> RunStatus:
        """The run's state, step, layout, assignment, incidents and interventions."""
        return self._status

    @workflow.signal
    def report_fault(self, report: inputs.FaultSignalPayload) -> None:
        """An external detector blames nodes; the watch stops and recovery starts."""
        if not isinstance(report, FaultSignal):
            # A signal has no one to answer: a payload that is no FaultSignal at all is logged and dropped.
            workflow.logger.warning("report_fault dropped: it takes a FaultSignal, not %s", type(report).__name__)
            return
        self._reported.append(report)

    # --- updates carried out by the run loop --------------------------------------------

    @workflow.update
    async def pause(self, request: inputs.PausePayload) -> OperatorAnswer:
        """Checkpoint, stop the ranks, hold the nodes; `resume` continues on the same nodes."""
        return await self._queue_and_wait("pause", request, request.reason, self._pause_now)

    @pause.validator
    def _validate_pause(self, request: inputs.PausePayload) -> None:
        expect(request, PauseRequest, "pause")
        self._refuse_if_ended()
        if self._status.state == RunState.PAUSED or self._requested("pause"):
            raise ValueError("the run is already paused (or pausing)")
        if self._status.state != RunState.TRAINING:
            raise ValueError(f"the run is {self._status.state.value}; pause once it trains again")

    @workflow.update
    async def resume(self, request: inputs.ResumePayload) -> OperatorAnswer:
        """Continue a paused run from its checkpoint, on the nodes it held."""
        return await self._queue_and_wait("resume", request, request.reason, self._resume_now)

    @resume.validator
    def _validate_resume(self, request: inputs.ResumePayload) -> None:
        expect(request, ResumeRequest, "resume")
        self._refuse_if_ended()
        if self._status.state != RunState.PAUSED or self._requested("resume"):
            raise ValueError(f"only a paused run can be resumed; the run is {self._status.state.value}")

    @workflow.update
    async def abort(self, request: inputs.AbortPayload) -> OperatorAnswer:
        """Stop the run cleanly (checkpoint first when it trains); the newest checkpoint is kept."""
        return await self._queue_and_wait("abort", request, request.reason, self._abort_now)

    @abort.validator
    def _validate_abort(self, request: inputs.AbortPayload) -> None:
        expect(request, AbortRequest, "abort")
        self._refuse_if_ended()
        if self._requested("abort"):
            raise ValueError("an abort is already under way")

    @workflow.update
    async def drain_node(self, request: inputs.DrainNodePayload) -> OperatorAnswer:
        """Treat a node as faulty: the same recovery as a detected fault (after any recovery under way)."""
        detail = f"{request.node}: {request.reason}"
        return await self._queue_and_wait("drain_node", request, detail, self._drain_node_now)

    @drain_node.validator
    def _validate_drain_node(self, request: inputs.DrainNodePayload) -> None:
        expect(request, DrainNodeRequest, "drain_node")
        self._refuse_if_ended()
        nodes = self._status.assignment.nodes if self._status.assignment else []
        if request.node not in nodes:
            raise ValueError(f"{request.node} is not a node of the run's current assignment ({', '.join(nodes)})")
        if self._status.state == RunState.PAUSED:
            raise ValueError("the run is paused; resume it first, or return the node later")

    @workflow.update
    async def reshard(self, request: inputs.ReshardPayload) -> OperatorAnswer:
        """Run at `dp` replicas: checkpoint, stop, re-plan on the current nodes and free spares, resume."""
        return await self._queue_and_wait("reshard", request, f"dp={request.dp}", self._reshard_now)

    @reshard.validator
    def _validate_reshard(self, request: inputs.ReshardPayload) -> None:
        expect(request, ReshardRequest, "reshard")
        self._refuse_if_ended()
        target, layout = self._start.spec.layout.dp, self._status.layout
        if not 1 <= request.dp <= target:
            raise ValueError(f"reshard needs dp between 1 and the spec's layout.dp {target}")
        if request.dp == layout.dp:
            raise ValueError(f"the run already trains with dp={request.dp}")
        if nodes_for(layout, request.dp) is None:
            raise ValueError(
                f"dp={request.dp} would leave a node part-used with ranks_per_node {layout.ranks_per_node}"
            )
        if self._status.state != RunState.TRAINING:
            raise ValueError(f"the run is {self._status.state.value}; reshard once it trains")

    # --- updates that act from their handler --------------------------------------------

    @workflow.update
    async def return_node(self, request: inputs.ReturnNodePayload) -> OperatorAnswer:
        """A repaired node rejoins the spare pool (a run waiting for capacity sees it at once)."""
        intervention = self._intervene("return_node", request.node)
        self._returning.add(request.node)
        try:
            async with self._return_lock:
                returned = ReturnNodeInput(run_id=self._status.run_id, node=request.node)
                await call_stage(self._policy, "return_node", RecoveryActivities.return_node, returned)
        except RunFailed as failure:
            # The node stays quarantined and the run goes on; only this request failed.
            intervention.outcome = f"failed: {failure}"
            raise ApplicationError(str(failure), type="OperatorRequestRefused", non_retryable=True) from None
        finally:
            self._returning.discard(request.node)
        self._status.quarantined_nodes = [n for n in self._status.quarantined_nodes if n != request.node]
        self._inventory_changed = True
        return self._answered(intervention, f"{request.node} is a spare again")

    @return_node.validator
    def _validate_return_node(self, request: inputs.ReturnNodePayload) -> None:
        expect(request, ReturnNodeRequest, "return_node")
        self._refuse_if_ended()
        if request.node in self._returning:
            raise ValueError(f"{request.node} is already being returned")
        if request.node not in self._status.quarantined_nodes:
            quarantined = ", ".join(self._status.quarantined_nodes) or "none"
            raise ValueError(f"{request.node} is not quarantined by this run (quarantined: {quarantined})")

    @workflow.update
    async def approve(self, request: inputs.ApprovePayload) -> OperatorAnswer:
        """Answer an escalation: reshard below recovery.min_dp, or wait longer for capacity."""
        self._approval = request
        intervention = self._intervene("approve", request.action)
        await workflow.wait_condition(lambda: self._approval is None)  # the recovery took it
        return self._answered(intervention, f"{request.action}: {self._status.state.value}")

    @approve.validator
    def _validate_approve(self, request: inputs.ApprovePayload) -> None:
        expect(request, ApproveRequest, "approve")
        self._refuse_if_ended()
        if self._status.state != RunState.WAITING_FOR_APPROVAL or self._approval is not None:
            raise ValueError(f"nothing is waiting for approval; the run is {self._status.state.value}")

    @workflow.update
    def set_policy(self, request: inputs.SetPolicyPayload) -> OperatorAnswer:
        """Change recovery policy fields; they apply from the next activity on."""
        self._status.policy = changed_policy(self._policy, request.changes, self._start.spec.layout.dp)
        intervention = self._intervene("set_policy", describe_changes(request.changes))
        return self._answered(intervention, "applied", message="policy updated")

    @set_policy.validator
    def _validate_set_policy(self, request: inputs.SetPolicyPayload) -> None:
        expect(request, SetPolicyRequest, "set_policy")
        self._refuse_if_ended()
        if not request.changes:
            raise ValueError("set_policy needs changes, e.g. {hang_after_seconds: 60}")
        changed_policy(self._policy, request.changes, self._start.spec.layout.dp)

    # --- the queue ----------------------------------------------------------------------

    def _refuse_if_ended(self) -> None:
        if self._status.state in TERMINAL_STATES:
            raise ValueError(f"run {self._status.run_id} already ended ({self._status.state.value})")

    def _requested(self, kind: str) -> bool:
        """Whether a request of this kind was accepted and is not answered yet."""
        return any(p.intervention.kind == kind for p in self._outstanding)

    def _intervene(self, kind: InterventionKind, detail: str) -> Intervention:
        intervention = Intervention(kind=kind, detail=detail, requested_at=workflow.now())
        self._status.interventions.append(intervention)
        return intervention

    def _answered(self, intervention: Intervention, outcome: str, message: str | None = None) -> OperatorAnswer:
        intervention.done_at = workflow.now()
        intervention.outcome = outcome
        return OperatorAnswer(message=message or outcome, state=self._status.state.value)

    async def _queue_and_wait(
        self,
        kind: OperatorUpdate,
        request: Request,
        detail: str,
        carry_out: Callable[[Pending[Request]], Awaitable[bool]],
    ) -> OperatorAnswer:
        """Queue a request for the run loop and wait until it was carried out."""
        pending = Pending(self._intervene(kind, detail), request, carry_out)
        self._queue.append(pending)
        self._outstanding.append(pending)
        await workflow.wait_condition(lambda: pending.done)
        if pending.error is not None:
            raise ApplicationError(pending.error, type="OperatorRequestRefused", non_retryable=True)
        # The state once the run loop has moved on: what the request left the run in.
        return OperatorAnswer(message=pending.intervention.outcome, state=self._status.state.value)

    def _finish(self, pending: Pending[Any], outcome: str) -> None:
        pending.intervention.done_at = workflow.now()
        pending.intervention.outcome = outcome
        pending.done = True
        self._outstanding.remove(pending)

    def _refuse(self, pending: Pending[Any], why: str, outcome: str | None = None) -> bool:
        pending.error = why
        pending.intervention.outcome = outcome or f"refused: {why}"
        pending.done = True
        self._outstanding.remove(pending)
        return False

    async def _close_requests(self, aborted: str | None = None) -> None:
        """The run ended: answer the aborts (that ended it), refuse the rest, let every handler finish."""
        for pending in list(self._outstanding):
            if aborted is not None and pending.intervention.kind == "abort":
                self._finish(pending, aborted)
            else:
                ended = f"the run ended ({self._status.state.value}) before this request was carried out"
                self._refuse(pending, ended, outcome="not carried out: the run ended")
        self._queue.clear()
        self._approval = None
        await workflow.wait_condition(workflow.all_handlers_finished)

    # --- carrying out, one method per request kind (called by the run loop) ------------

    async def _carry_out_next(self) -> bool:
        """Carry out the oldest queued request; True when training is done."""
        pending = self._queue.pop(0)
        return await pending.carry_out(pending)

    async def _pause_now(self, pending: Pending[PauseRequest]) -> bool:
        stopped = await self._stop_ranks(f"pause: {pending.request.reason}")
        if stopped is None:  # paused since the request was accepted: by a crash loop's verdict
            self._finish(pending, f"the run was paused already: {self._status.reason}")
            return False
        self._enter(RunState.PAUSED)
        if stopped.step is None:
            self._finish(pending, "paused; the ranks were ended (the script reports no steps)")
        else:
            self._finish(pending, f"paused at step {stopped.step}, checkpoint step-{stopped.checkpoint_step}")
        return False

    async def _resume_now(self, pending: Pending[ResumeRequest]) -> bool:
        held = self._status.assignment
        assert held is not None, "a paused run holds its nodes"
        decision = Decision(
            action="replace", nodes=held.nodes, layout=held.layout, reason="operator resume on the held nodes"
        )
        done = await self._restart(decision)
        self._finish(pending, f"resumed: {self._status.state.value}")
        return done

    async def _abort_now(self, pending: Pending[AbortRequest]) -> bool:
        reason = pending.request.reason
        stopped = await self._stop_ranks(f"abort: {reason}")
        kept = f"; checkpoint step-{stopped.checkpoint_step} kept" if stopped else ""
        raise RunAborted(f"aborted by an operator: {reason or 'no reason given'}{kept}")

    async def _drain_node_now(self, pending: Pending[DrainNodeRequest]) -> bool:
        request, status = pending.request, self._status
        assert status.assignment is not None, "the run loop launches before it carries requests out"
        if request.node not in status.assignment.nodes:
            return self._refuse(pending, f"{request.node} left the assignment before its drain ran")
        now = workflow.now()
        fault = FaultReport(
            kind="operator",
            nodes=[request.node],
            incarnation=status.assignment.incarnation,
            occurred_at=now,
            detected_at=now,
            step=status.step,
            reason=request.reason or "drained by an operator",
        )
        done = await self._recover_all(fault)
        self._finish(pending, f"incident {status.incidents[-1].number}: {status.incidents[-1].outcome}")
        return done

    async def _reshard_now(self, pending: Pending[ReshardRequest]) -> bool:
        request, status = pending.request, self._status
        assert status.assignment is not None, "the run loop launches before it carries requests out"
        inventory = await call_stage(self._policy, "reschedule", RecoveryActivities.reschedule, self._reading())
        decision = plan_operator_reshard(inventory, status.assignment, request.dp, self._start.spec.layout.dp)
        if decision.action == "wait":
            return self._refuse(pending, decision.reason)
        claimed = await self._claim_while_training(decision, "operator")
        if isinstance(claimed, StageRefused):
            return self._refuse(pending, f"{decision.reason}; at the claim, {claimed}: trained on; ask again")
        await self._stop_ranks(f"reshard to dp={request.dp}")
        status.wanted_dp = request.dp  # a regrow grows back to the operator's dp, not past it
        done = await self._restart(decision, claimed)
        self._finish(pending, decision.reason)
        return done

    async def _stop_ranks(self, why: str, timing: Incident | Regrowth | None = None) -> StopResult | None:
        """Checkpoint and stop the current incarnation (the stage timed on `timing`: a swap's incident,
        a regrow); None when the run is paused (nothing runs)."""
        status = self._status
        if status.state == RunState.PAUSED:
            return None
        assert status.assignment is not None, "a run that is not paused runs an incarnation"
        self._enter(RunState.STOPPING)
        request = StopInput(
            run_id=status.run_id,
            incarnation=status.assignment.incarnation,
            total_steps=status.total_steps,
            policy=self._policy,
            # A script without lazarus.session cannot be asked to checkpoint: end its ranks at once.
            timeout_seconds=self._policy.stop_grace_seconds if status.steps_from == "trainer" else 1.0,
        )
        stopped = await self._stage("stop", RecoveryActivities.stop, request, timing)
        if stopped.step is not None:
            status.step = stopped.step
        if not stopped.clean:
            workflow.logger.warning("%s: the ranks were killed (%s)", why, stopped.reason)
        return stopped
