"""TrainingRun: one durable workflow per training run; recovery is its loop of activities.

Operators steer it with updates (pause, resume, abort, drain_node, return_node, reshard,
approve, set_policy). Each validator refuses a request that does not fit before it reaches
the history; an accepted request that touches the ranks is queued and carried out by the
main loop at its next safe point (between stages, or by cancelling the watch), so operator
actions and automatic recovery never run at the same time. The update returns once its
request has been carried out.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from pydantic import ValidationError

    from lazarus.activities.recovery import RecoveryActivities
    from lazarus.schema.controls import (
        AbortRequest,
        ApproveRequest,
        DrainNodeRequest,
        FaultSignal,
        OperatorAnswer,
        PauseRequest,
        ReshardRequest,
        ResumeRequest,
        ReturnNodeRequest,
        SetPolicyRequest,
    )
    from lazarus.schema.policy import RecoveryPolicy, StagePolicy
    from lazarus.schema.records import (
        Decision,
        DetectResult,
        FaultReport,
        Incident,
        Intervention,
        RankProgress,
        RunStart,
        RunState,
        RunStatus,
        StageRecord,
    )
    from lazarus.schema.stages import (
        DetectInput,
        DrainInput,
        LaunchInput,
        ReplaceInput,
        RescheduleInput,
        ResumeInput,
        ReturnNodeInput,
        StopInput,
    )
    from lazarus.workflows.policy import nodes_for, plan_operator_reshard, plan_recovery


RESHARD_PATCH = "reshard-without-spare"
"""workflow.patched id: recovery reshards when there are too few spares (before: it waited)."""
ESCALATE_PATCH = "escalate-to-operator"
"""workflow.patched id: after the capacity wait, wait for an operator's approval (before: fail)."""

STATE_ATTRIBUTE = SearchAttributeKey.for_keyword("LazarusState")
"""The run's RunState, for the web UI's list and `temporal workflow list --query`."""
INCIDENTS_ATTRIBUTE = SearchAttributeKey.for_int("LazarusIncidents")
"""How many incidents the run has had."""

TERMINAL = {RunState.COMPLETED, RunState.FAILED, RunState.ABORTED}
RECOVERING = {
    RunState.DETECTED,
    RunState.DRAINING,
    RunState.RESCHEDULING,
    RunState.WAITING_FOR_CAPACITY,
    RunState.WAITING_FOR_APPROVAL,
    RunState.REPLACING,
    RunState.RESHARDING,
    RunState.RESUMING,
}


class RunFailed(Exception):
    """A business failure: the run cannot go on; the workflow fails with this reason."""


class RunAborted(Exception):
    """An operator aborted the run."""


class StageRefused(RunFailed):
    """An activity refused its request for good (a non-retryable error of type `kind`)."""

    def __init__(self, stage: str, kind: str, message: str):
        super().__init__(f"{stage} refused ({kind}): {message}")
        self.kind = kind


@dataclass
class Pending:
    """An accepted operator request waiting for the main loop."""

    intervention: Intervention
    request: PauseRequest | AbortRequest | DrainNodeRequest | ReshardRequest
    answer: OperatorAnswer | None = None
    error: str | None = None


def stage_options(stage: StagePolicy) -> dict:
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


def _cause(error: BaseException) -> str:
    while error.__cause__ is not None:
        error = error.__cause__
    return str(error) or type(error).__name__


@workflow.defn(name="TrainingRun")
class TrainingRun:
    """Launch the run, watch it, and on every fault run drain, reschedule, replace, resume."""

    @workflow.init
    def __init__(self, start: RunStart) -> None:
        self._start = start
        self._status = start.carried or RunStatus(
            run_id=start.run_id,
            total_steps=start.spec.trainer.steps,
            layout=start.spec.layout,
        )
        if self._status.policy is None:
            self._status.policy = start.spec.recovery
        self._reported: list[FaultSignal] = []
        self._queue: list[Pending] = []  # waiting for the main loop, in order
        self._outstanding: list[Pending] = []  # accepted and not yet answered
        self._next_fault: FaultReport | None = None  # a fault that hit an operator's restart
        self._resume_requested = False
        self._restarts = 0  # incarnations started on an operator's request
        self._approval: ApproveRequest | None = None
        self._inventory_changed = False
        self._node_lock = asyncio.Lock()

    @property
    def _policy(self) -> RecoveryPolicy:
        return self._status.policy

    # --- queries and signals -----------------------------------------------------------

    @workflow.query
    def status(self) -> RunStatus:
        """The run's state, step, layout, assignment, incidents and interventions."""
        return self._status

    @workflow.signal
    def report_fault(self, report: FaultSignal) -> None:
        """An external detector blames nodes; the watch stops and recovery starts."""
        self._reported.append(report)

    # --- updates -----------------------------------------------------------------------

    def _refuse_if_ended(self) -> None:
        if self._status.state in TERMINAL:
            raise ValueError(f"run {self._status.run_id} already ended ({self._status.state.value})")

    def _queued(self, kind: str) -> bool:
        return any(p.intervention.kind == kind for p in self._queue)

    async def _carry_out(self, kind: str, request, detail: str) -> OperatorAnswer:
        """Queue a request for the main loop and wait for its answer."""
        pending = Pending(Intervention(kind=kind, detail=detail, requested_at=workflow.now()), request)
        self._status.interventions.append(pending.intervention)
        self._queue.append(pending)
        self._outstanding.append(pending)
        await workflow.wait_condition(lambda: pending.answer is not None or pending.error is not None)
        if pending.error is not None:
            raise ApplicationError(pending.error, type="OperatorRequestRefused", non_retryable=True)
        return pending.answer

    @workflow.update
    async def pause(self, request: PauseRequest) -> OperatorAnswer:
        """Checkpoint, stop the ranks, hold the nodes; `resume` continues on the same nodes."""
        return await self._carry_out("pause", request, request.reason)

    @pause.validator
    def _validate_pause(self, request: PauseRequest) -> None:
        self._refuse_if_ended()
        if self._status.state == RunState.PAUSED or self._queued("pause"):
            raise ValueError("the run is already paused (or pausing)")
        if self._status.state != RunState.TRAINING:
            raise ValueError(f"the run is {self._status.state.value}; pause once it trains again")

    @workflow.update
    async def resume(self, request: ResumeRequest) -> OperatorAnswer:
        """Continue a paused run from its checkpoint, on the nodes it held."""
        self._resume_requested = True
        pending = Pending(Intervention(kind="resume", detail=request.reason, requested_at=workflow.now()), request)
        self._status.interventions.append(pending.intervention)
        restarts = self._restarts
        await workflow.wait_condition(lambda: self._restarts > restarts or self._status.state in TERMINAL)
        pending.intervention.done_at = workflow.now()
        pending.intervention.outcome = f"resumed: {self._status.state.value}"
        return OperatorAnswer(message=pending.intervention.outcome, state=self._status.state.value)

    @resume.validator
    def _validate_resume(self, request: ResumeRequest) -> None:
        self._refuse_if_ended()
        if self._status.state != RunState.PAUSED or self._resume_requested:
            raise ValueError(f"only a paused run can be resumed; the run is {self._status.state.value}")

    @workflow.update
    async def abort(self, request: AbortRequest) -> OperatorAnswer:
        """Stop the run cleanly (checkpoint first when it trains); the newest checkpoint is kept."""
        return await self._carry_out("abort", request, request.reason)

    @abort.validator
    def _validate_abort(self, request: AbortRequest) -> None:
        self._refuse_if_ended()
        if self._queued("abort"):
            raise ValueError("an abort is already under way")

    @workflow.update
    async def drain_node(self, request: DrainNodeRequest) -> OperatorAnswer:
        """Treat a node as faulty: the same recovery as a detected fault (after any recovery under way)."""
        return await self._carry_out("drain_node", request, f"{request.node}: {request.reason}")

    @drain_node.validator
    def _validate_drain_node(self, request: DrainNodeRequest) -> None:
        self._refuse_if_ended()
        nodes = self._status.assignment.nodes if self._status.assignment else []
        if not request.node:
            raise ValueError("drain_node needs a node")
        if request.node not in nodes:
            raise ValueError(f"{request.node} is not a node of the run's current assignment ({', '.join(nodes)})")
        if self._status.state == RunState.PAUSED:
            raise ValueError("the run is paused; resume it first, or return the node later")

    @workflow.update
    async def return_node(self, request: ReturnNodeRequest) -> OperatorAnswer:
        """A repaired node rejoins the spare pool (a run waiting for capacity sees it at once)."""
        intervention = Intervention(kind="return_node", detail=request.node or "", requested_at=workflow.now())
        self._status.interventions.append(intervention)
        async with self._node_lock:
            await self._activity(
                "return_node",
                RecoveryActivities.return_node,
                ReturnNodeInput(run_id=self._status.run_id, node=request.node),
            )
        self._status.quarantined_nodes = [n for n in self._status.quarantined_nodes if n != request.node]
        self._inventory_changed = True
        intervention.done_at = workflow.now()
        intervention.outcome = f"{request.node} is a spare again"
        return OperatorAnswer(message=intervention.outcome, state=self._status.state.value)

    @return_node.validator
    def _validate_return_node(self, request: ReturnNodeRequest) -> None:
        self._refuse_if_ended()
        if request.node not in self._status.quarantined_nodes:
            quarantined = ", ".join(self._status.quarantined_nodes) or "none"
            raise ValueError(f"{request.node} is not quarantined by this run (quarantined: {quarantined})")

    @workflow.update
    async def reshard(self, request: ReshardRequest) -> OperatorAnswer:
        """Run at `dp` replicas: checkpoint, stop, re-plan on the current nodes and free spares, resume."""
        return await self._carry_out("reshard", request, f"dp={request.dp}")

    @reshard.validator
    def _validate_reshard(self, request: ReshardRequest) -> None:
        self._refuse_if_ended()
        target = self._start.spec.layout.dp
        if request.dp is None or not 1 <= request.dp <= target:
            raise ValueError(f"reshard needs dp between 1 and the spec's layout.dp {target}")
        if request.dp == self._status.layout.dp:
            raise ValueError(f"the run already trains with dp={request.dp}")
        if nodes_for(self._status.layout, request.dp) is None:
            raise ValueError(
                f"dp={request.dp} would leave a node part-used with ranks_per_node {self._status.layout.ranks_per_node}"
            )
        if self._status.state != RunState.TRAINING:
            raise ValueError(f"the run is {self._status.state.value}; reshard once it trains")

    @workflow.update
    async def approve(self, request: ApproveRequest) -> OperatorAnswer:
        """Answer an escalation: reshard below recovery.min_dp, or wait longer for capacity."""
        self._approval = request
        intervention = Intervention(kind="approve", detail=f"{request.action}", requested_at=workflow.now())
        self._status.interventions.append(intervention)
        await workflow.wait_condition(lambda: self._approval is None)
        intervention.done_at = workflow.now()
        intervention.outcome = f"{request.action}: {self._status.state.value}"
        return OperatorAnswer(message=intervention.outcome, state=self._status.state.value)

    @approve.validator
    def _validate_approve(self, request: ApproveRequest) -> None:
        self._refuse_if_ended()
        if self._status.state != RunState.WAITING_FOR_APPROVAL or self._approval is not None:
            raise ValueError(f"nothing is waiting for approval; the run is {self._status.state.value}")
        if request.action is None:
            raise ValueError("approve needs an action: reshard_below_minimum or wait_longer")

    @workflow.update
    def set_policy(self, request: SetPolicyRequest) -> OperatorAnswer:
        """Change recovery policy fields; they apply from the next activity on."""
        self._status.policy = self._merged_policy(request)

        def dotted(changes: dict, prefix: str = "") -> list[str]:
            return [
                item
                for key, value in changes.items()
                for item in (
                    dotted(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}={value}"]
                )
            ]

        self._status.interventions.append(
            Intervention(
                kind="set_policy",
                detail=", ".join(dotted(request.changes)),
                requested_at=workflow.now(),
                done_at=workflow.now(),
                outcome="applied",
            )
        )
        return OperatorAnswer(message="policy updated", state=self._status.state.value)

    @set_policy.validator
    def _validate_set_policy(self, request: SetPolicyRequest) -> None:
        self._refuse_if_ended()
        if not request.changes:
            raise ValueError("set_policy needs changes, e.g. {hang_after_seconds: 60}")
        self._merged_policy(request)

    def _merged_policy(self, request: SetPolicyRequest) -> RecoveryPolicy:
        def merge(base: dict, changes: dict) -> dict:
            merged = dict(base)
            for key, value in changes.items():
                merged[key] = (
                    merge(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
                )
            return merged

        data = merge(self._policy.model_dump(mode="json"), request.changes)
        try:
            policy = RecoveryPolicy.model_validate(data)
        except ValidationError as error:
            first = error.errors()[0]
            raise ValueError(f"recovery.{'.'.join(map(str, first['loc']))}: {first['msg']}") from None
        if policy.min_dp > self._start.spec.layout.dp:
            raise ValueError(f"recovery.min_dp: {policy.min_dp} exceeds layout.dp {self._start.spec.layout.dp}")
        return policy

    # --- the run -----------------------------------------------------------------------

    @workflow.run
    async def run(self, start: RunStart) -> RunStatus:
        try:
            await self._train()
        except RunAborted as aborted:
            self._end(RunState.ABORTED, str(aborted))
            for pending in [p for p in self._outstanding if p.intervention.kind == "abort"]:
                self._finish(pending, str(aborted))
            await self._answer_everyone()
            return self._status
        except RunFailed as failure:
            self._end(RunState.FAILED, str(failure))
            for incident in self._status.incidents:
                if incident.outcome == "recovering":
                    incident.outcome = "failed"
            await self._answer_everyone()
            raise ApplicationError(str(failure), type="RunFailed", non_retryable=True) from None
        await self._answer_everyone()
        return self._status

    def _end(self, state: RunState, reason: str = "") -> None:
        self._status.reason = reason
        self._status.ended_at = workflow.now()
        self._set(state)

    async def _answer_everyone(self) -> None:
        """Refuse requests not carried out (the run ended) and let every handler finish."""
        for pending in self._outstanding:
            pending.error = f"the run ended ({self._status.state.value}) before this request was carried out"
            pending.intervention.outcome = "not carried out: the run ended"
        self._outstanding.clear()
        self._queue.clear()
        self._approval = None
        await workflow.wait_condition(workflow.all_handlers_finished)

    def _set(self, state: RunState) -> None:
        changed = state != self._status.state
        self._status.state = state
        if changed and self._start.search_attributes:
            workflow.upsert_search_attributes(
                [
                    STATE_ATTRIBUTE.value_set(state.value),
                    INCIDENTS_ATTRIBUTE.value_set(len(self._status.incidents)),
                ]
            )

    async def _activity(self, name: str, method, request):
        """Run one activity under its stage policy; one that exhausts its retries fails the run."""
        policy: StagePolicy = getattr(self._policy.stages, name)
        try:
            return await workflow.execute_activity_method(method, request, **stage_options(policy))
        except ActivityError as error:
            if isinstance(error.cause, ApplicationError) and error.cause.non_retryable:
                raise StageRefused(name, error.cause.type or "error", error.cause.message) from None
            attempts = "unlimited" if policy.max_attempts == 0 else policy.max_attempts
            raise RunFailed(
                f"{name} failed after its retry policy (recovery.stages.{name}: {attempts} attempts, "
                f"{policy.timeout_seconds:g} s each): {_cause(error)}"
            ) from None

    async def _stage(self, name: str, method, request, incident: Incident | None = None):
        """Run a recovery stage's activity and record its start and end on the incident."""
        if incident is not None and name not in incident.stages:
            incident.stages[name] = StageRecord(started_at=workflow.now())
        result = await self._activity(name, method, request)
        if incident is not None:
            incident.stages[name].ended_at = workflow.now()
        return result

    async def _train(self) -> None:
        status = self._status
        if status.assignment is None:
            status.started_at = workflow.now()
            self._set(RunState.LAUNCHING)
            launched = await self._stage(
                "launch", RecoveryActivities.launch, LaunchInput(run_id=status.run_id, spec=self._start.spec)
            )
            status.run_dir, status.assignment = launched.run_dir, launched.assignment
            self._set(RunState.TRAINING)

        while True:
            if self._next_fault is not None:
                fault, self._next_fault = self._next_fault, None
                if await self._recover_all(fault):
                    self._end(RunState.COMPLETED)
                    return
                continue
            if self._queue:
                if await self._operate(self._queue[0]):
                    return
                continue
            if self._time_to_continue_as_new() and not self._reported:
                await workflow.wait_condition(lambda: workflow.all_handlers_finished() or bool(self._queue))
                if not self._queue:
                    status.segments += 1
                    workflow.continue_as_new(
                        RunStart(
                            run_id=status.run_id,
                            spec=self._start.spec,
                            carried=status,
                            search_attributes=self._start.search_attributes,
                        )
                    )
                continue
            watched = await self._watch()
            if watched is None:
                continue  # an operator's request interrupted the watch
            status.step = max(status.step, watched.progress.step)
            if watched.fault is not None and await self._recover_all(watched.fault):
                watched.completed = True
            if watched.completed:
                status.step = status.total_steps
                self._end(RunState.COMPLETED)
                return

    def _time_to_continue_as_new(self) -> bool:
        info = workflow.info()
        return (
            info.is_continue_as_new_suggested()
            or info.get_current_history_length() >= self._policy.history_limit_events
        )

    async def _watch(self) -> DetectResult | None:
        """Run detect until it reports, or until a signal or an operator's request cancels it (None)."""
        status = self._status
        request = DetectInput(
            run_id=status.run_id,
            incarnation=status.assignment.incarnation,
            total_steps=status.total_steps,
            policy=self._policy,
        )
        detect = workflow.start_activity_method(
            RecoveryActivities.detect, request, **stage_options(self._policy.stages.detect)
        )
        await workflow.wait_condition(lambda: detect.done() or self._signalled_fault() is not None or bool(self._queue))
        if detect.done():
            try:
                return detect.result()
            except ActivityError as error:
                raise RunFailed(f"detect failed after its retry policy: {_cause(error)}") from None
        detect.cancel()
        try:
            await detect
        except (ActivityError, asyncio.CancelledError):
            pass
        report = self._signalled_fault()
        if report is None:
            return None
        self._reported.clear()
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

    def _signalled_fault(self) -> FaultSignal | None:
        """The first reported fault that names nodes of the current assignment; others are dropped."""
        nodes = set(self._status.assignment.nodes) if self._status.assignment else set()
        while self._reported:
            report = self._reported[0]
            relevant = [n for n in report.nodes if n in nodes]
            if relevant:
                return report.model_copy(update={"nodes": relevant})
            workflow.logger.warning("report_fault names no node of the current assignment: %s", report.nodes)
            self._reported.pop(0)
        return None

    # --- operator requests, carried out by the main loop -------------------------------

    async def _operate(self, pending: Pending) -> bool:
        """Carry out the first queued request; True when the run has ended."""
        status = self._status
        kind, request = pending.intervention.kind, pending.request
        try:
            if kind == "abort":
                stopped = await self._stop_ranks(f"abort: {request.reason}")
                kept = f"; checkpoint step-{stopped.checkpoint_step} kept" if stopped else ""
                raise RunAborted(f"aborted by an operator: {request.reason or 'no reason given'}{kept}")
            if kind == "pause":
                stopped = await self._stop_ranks(f"pause: {request.reason}")
                self._set(RunState.PAUSED)
                self._finish(pending, f"paused at step {stopped.step}, checkpoint step-{stopped.checkpoint_step}")
                await workflow.wait_condition(lambda: self._resume_requested or self._queued("abort"))
                if self._queued("abort") and not self._resume_requested:
                    return False
                self._resume_requested = False
                await self._restart(
                    Decision(
                        action="replace",
                        nodes=status.assignment.nodes,
                        layout=status.assignment.layout,
                        reason="operator resume on the held nodes",
                    )
                )
                return False
            if kind == "drain_node":
                if request.node not in status.assignment.nodes:
                    raise ValueError(f"{request.node} left the assignment before its drain ran")
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
                self._queue.remove(pending)
                completed = await self._recover_all(fault)
                if completed:
                    self._end(RunState.COMPLETED)
                self._finish(pending, f"incident {status.incidents[-1].number}: {status.incidents[-1].outcome}")
                return completed
            if kind == "reshard":
                inventory = await self._activity(
                    "reschedule", RecoveryActivities.reschedule, RescheduleInput(run_id=status.run_id)
                )
                decision = plan_operator_reshard(inventory, status.assignment, request.dp, self._start.spec.layout.dp)
                if decision.action == "wait":
                    raise ValueError(decision.reason)
                await self._stop_ranks(f"reshard to dp={request.dp}")
                await self._restart(decision)
                self._finish(pending, decision.reason)
                return False
            raise ValueError(f"unknown request {kind}")
        except ValueError as refusal:
            pending.error = str(refusal)
            pending.intervention.outcome = f"refused: {refusal}"
            for waiting in (self._queue, self._outstanding):
                if pending in waiting:
                    waiting.remove(pending)
            return False

    def _finish(self, pending: Pending, outcome: str) -> None:
        pending.intervention.done_at = workflow.now()
        pending.intervention.outcome = outcome
        pending.answer = OperatorAnswer(message=outcome, state=self._status.state.value)
        for waiting in (self._queue, self._outstanding):
            if pending in waiting:
                waiting.remove(pending)

    async def _stop_ranks(self, why: str):
        """Checkpoint and stop the current incarnation (if it runs)."""
        status = self._status
        if status.state in (RunState.PAUSED, RunState.LAUNCHING, RunState.PENDING) or status.assignment is None:
            return None
        self._set(RunState.STOPPING)
        stopped = await self._activity(
            "stop",
            RecoveryActivities.stop,
            StopInput(
                run_id=status.run_id,
                incarnation=status.assignment.incarnation,
                total_steps=status.total_steps,
                policy=self._policy,
                timeout_seconds=self._policy.stop_grace_seconds,
            ),
        )
        status.step = stopped.step
        if not stopped.clean:
            workflow.logger.warning("%s: the ranks were killed (%s)", why, stopped.reason)
        return stopped

    async def _restart(self, decision: Decision) -> None:
        """Start the next incarnation on `decision`'s nodes from the newest checkpoint."""
        status = self._status
        self._set(RunState.REPLACING if decision.action == "replace" else RunState.RESHARDING)
        assignment = await self._activity(
            "replace_or_reshard",
            RecoveryActivities.replace_or_reshard,
            ReplaceInput(run_id=status.run_id, decision=decision, old_assignment=status.assignment),
        )
        status.assignment, status.layout = assignment, assignment.layout
        self._set(RunState.RESUMING)
        resumed = await self._activity(
            "resume",
            RecoveryActivities.resume,
            ResumeInput(
                run_id=status.run_id, assignment=assignment, total_steps=status.total_steps, policy=self._policy
            ),
        )
        status.step = status.total_steps if resumed.completed else resumed.resumed_from_step
        self._set(RunState.TRAINING)
        self._next_fault = resumed.fault
        self._restarts += 1

    # --- recovery ----------------------------------------------------------------------

    def _check_abort(self) -> None:
        if self._queued("abort"):
            raise _AbortBetweenStages()

    async def _decide(self, incident: Incident, fault: FaultReport) -> Decision:
        """Read the inventory until the policy can place the next incarnation; escalate when it cannot."""
        status = self._status
        self._set(RunState.RESCHEDULING)
        waited_since = workflow.now()
        capacity_until = self._policy.capacity_wait_seconds
        min_dp = self._policy.min_dp
        while True:
            self._check_abort()
            inventory = await self._stage(
                "reschedule", RecoveryActivities.reschedule, RescheduleInput(run_id=status.run_id), incident
            )
            decision = plan_recovery(
                inventory, status.assignment, fault.nodes, target_dp=self._start.spec.layout.dp, min_dp=min_dp
            )
            if decision.action == "reshard" and not workflow.patched(RESHARD_PATCH):
                # Runs started before resharding existed keep waiting for a spare.
                decision = plan_recovery(
                    inventory,
                    status.assignment,
                    fault.nodes,
                    target_dp=self._start.spec.layout.dp,
                    min_dp=min_dp,
                    allow_reshard=False,
                )
            incident.decision = decision
            if decision.action != "wait":
                status.awaiting_approval = None
                return decision
            self._set(RunState.WAITING_FOR_CAPACITY)
            waited = (workflow.now() - waited_since).total_seconds()
            if waited < capacity_until:
                self._inventory_changed = False
                try:
                    await workflow.wait_condition(
                        lambda: self._inventory_changed or self._queued("abort"),
                        timeout=min(self._policy.capacity_poll_seconds, capacity_until - waited),
                    )
                except TimeoutError:
                    pass
                continue
            reason = (
                f"no capacity to recover from incident {incident.number}: {decision.reason}; "
                f"waited {waited:.0f} s (recovery.capacity_wait_seconds: {self._policy.capacity_wait_seconds:g})"
            )
            if not workflow.patched(ESCALATE_PATCH) or self._policy.approval_wait_seconds == 0:
                raise RunFailed(
                    reason + "; return a repaired node with `lazarus chaos return-node` and start the run again"
                )
            approval = await self._escalate(decision)
            if approval is None:
                raise RunFailed(
                    reason + f"; no operator approved within {self._policy.approval_wait_seconds:g} s "
                    f"(recovery.approval_wait_seconds); the newest checkpoint is kept"
                )
            if approval.action == "reshard_below_minimum":
                min_dp = 1
            else:
                capacity_until = waited + approval.wait_seconds

    async def _escalate(self, decision: Decision) -> ApproveRequest | None:
        """Ask a human: wait for approve or abort, up to the policy's approval wait."""
        self._status.awaiting_approval = decision
        self._set(RunState.WAITING_FOR_APPROVAL)
        try:
            await workflow.wait_condition(
                lambda: self._approval is not None or self._queued("abort"), timeout=self._policy.approval_wait_seconds
            )
        except TimeoutError:
            return None
        finally:
            self._status.awaiting_approval = None
        self._check_abort()
        approval, self._approval = self._approval, None
        self._set(RunState.RESCHEDULING)
        return approval

    async def _recover_all(self, fault: FaultReport) -> bool:
        """Recover from a fault, and from any that hits the new incarnation before it trains; True when done."""
        completed = False
        while fault is not None:
            fault, completed = await self._recover(fault)
        return completed

    async def _recover(self, fault: FaultReport) -> tuple[FaultReport | None, bool]:
        """One incident: drain, reschedule, replace, resume. Returns a fault that hit the new
        incarnation before its first step (the next incident), and whether training is done."""
        status = self._status
        if fault.kind == "program_error":
            # No node is to blame: replacing nodes would only fail the same way.
            tail = f"; last lines of rank {fault.rank}'s log:\n{fault.log_tail}" if fault.log_tail else ""
            raise RunFailed(f"the training program failed: {fault.reason}{tail}")
        if len(status.incidents) >= self._policy.max_incidents:
            raise RunFailed(f"fault after {len(status.incidents)} recoveries (recovery.max_incidents): {fault.reason}")
        incident = Incident(
            number=len(status.incidents) + 1,
            fault=fault,
            old_assignment=status.assignment,
            stages={"detect": StageRecord(started_at=fault.occurred_at, ended_at=fault.detected_at)},
        )
        status.incidents.append(incident)
        status.step = fault.step

        try:
            self._set(RunState.DRAINING)
            drained = await self._stage(
                "drain",
                RecoveryActivities.drain,
                DrainInput(
                    run_id=status.run_id,
                    incarnation=fault.incarnation,
                    nodes=fault.nodes,
                    reason=f"incident {incident.number}: {fault.kind}: {fault.reason}",
                    save_grace_seconds=self._policy.save_grace_seconds,
                    detect_seconds=max(0.0, (fault.detected_at - fault.occurred_at).total_seconds()),
                ),
                incident,
            )
            status.quarantined_nodes = sorted(set(status.quarantined_nodes) | set(drained.quarantined))
            incident.checkpoint_in_flight = drained.in_flight_checkpoint
            incident.discarded_checkpoints = drained.removed_partial_checkpoints

            while True:
                decision = await self._decide(incident, fault)
                self._check_abort()
                self._set(RunState.REPLACING if decision.action == "replace" else RunState.RESHARDING)
                try:
                    assignment = await self._stage(
                        "replace_or_reshard",
                        RecoveryActivities.replace_or_reshard,
                        ReplaceInput(
                            run_id=status.run_id,
                            decision=decision,
                            old_assignment=status.assignment,
                            fault_kind=fault.kind,
                        ),
                        incident,
                    )
                    break
                except StageRefused as refused:
                    # A spare that died or was taken since the inventory was read: decide again.
                    if refused.kind != "SpareUnavailable":
                        raise
                    workflow.logger.warning("%s; rescheduling", refused)
        except _AbortBetweenStages:
            incident.outcome = "failed"
            raise RunAborted("aborted by an operator during recovery; the newest checkpoint is kept") from None
        status.assignment = incident.new_assignment = assignment
        status.layout = assignment.layout

        self._set(RunState.RESUMING)
        resumed = await self._stage(
            "resume",
            RecoveryActivities.resume,
            ResumeInput(
                run_id=status.run_id,
                assignment=assignment,
                total_steps=status.total_steps,
                policy=self._policy,
            ),
            incident,
        )
        incident.resumed_from_step = resumed.resumed_from_step
        incident.skipped_checkpoints = resumed.skipped_checkpoints
        incident.lost_steps = max(0, fault.step - resumed.resumed_from_step)
        if resumed.fault is not None:
            incident.outcome = "interrupted"
            return resumed.fault, False
        incident.first_step_at = resumed.first_step_at
        incident.outcome = "recovered"
        status.step = status.total_steps if resumed.completed else resumed.resumed_from_step + 1
        self._set(RunState.TRAINING)
        return None, resumed.completed


class _AbortBetweenStages(Exception):
    """An operator's abort noticed between two recovery stages."""
