"""TrainingRun: one durable workflow per training run; recovery is its loop of activities."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.recovery import RecoveryActivities
    from spec.records import (
        Decision,
        DetectResult,
        FaultReport,
        Incident,
        RankProgress,
        RunStart,
        RunState,
        RunStatus,
        StageRecord,
    )
    from spec.run import RecoveryPolicy, StagePolicy
    from spec.stages import (
        DetectInput,
        DrainInput,
        FaultSignal,
        LaunchInput,
        ReplaceInput,
        RescheduleInput,
        ResumeInput,
    )
    from workflows.policy import plan_recovery


RESHARD_PATCH = "reshard-without-spare"
"""workflow.patched id: recovery reshards when there are too few spares (before: it waited)."""


class RunFailed(Exception):
    """A business failure: the run cannot go on; the workflow fails with this reason."""


class StageRefused(RunFailed):
    """An activity refused its request for good (a non-retryable error of type `kind`)."""

    def __init__(self, stage: str, kind: str, message: str):
        super().__init__(f"{stage} refused ({kind}): {message}")
        self.kind = kind


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
        self._policy: RecoveryPolicy = start.spec.recovery
        self._status = start.carried or RunStatus(
            run_id=start.run_id, total_steps=start.spec.trainer.steps, layout=start.spec.layout,
        )
        self._reported: list[FaultSignal] = []

    @workflow.query
    def status(self) -> RunStatus:
        """The run's state, step, layout, assignment and incidents."""
        return self._status

    @workflow.signal
    def report_fault(self, report: FaultSignal) -> None:
        """An external detector or operator blames nodes; the watch stops and recovery starts."""
        self._reported.append(report)

    @workflow.run
    async def run(self, start: RunStart) -> RunStatus:
        try:
            await self._train()
        except RunFailed as failure:
            self._status.state = RunState.FAILED
            self._status.reason = str(failure)
            for incident in self._status.incidents:
                if incident.outcome == "recovering":
                    incident.outcome = "failed"
            raise ApplicationError(str(failure), type="RunFailed", non_retryable=True) from None
        return self._status

    def _set(self, state: RunState) -> None:
        self._status.state = state

    async def _stage(self, name: str, method, request, incident: Incident | None = None):
        """Run one stage's activity under its policy; a stage that exhausts its retries fails the run."""
        policy: StagePolicy = getattr(self._policy.stages, name)
        if incident is not None and name not in incident.stages:
            incident.stages[name] = StageRecord(started_at=workflow.now())
        try:
            result = await workflow.execute_activity_method(method, request, **stage_options(policy))
        except ActivityError as error:
            if isinstance(error.cause, ApplicationError) and error.cause.non_retryable:
                raise StageRefused(name, error.cause.type or "error", error.cause.message) from None
            attempts = "unlimited" if policy.max_attempts == 0 else policy.max_attempts
            raise RunFailed(
                f"{name} failed after its retry policy (recovery.stages.{name}: {attempts} attempts, "
                f"{policy.timeout_seconds:g} s each): {_cause(error)}"
            ) from None
        if incident is not None:
            incident.stages[name].ended_at = workflow.now()
        return result

    async def _train(self) -> None:
        status = self._status
        if status.assignment is None:
            self._set(RunState.LAUNCHING)
            launched = await self._stage("launch", RecoveryActivities.launch,
                                         LaunchInput(run_id=status.run_id, spec=self._start.spec))
            status.run_dir, status.assignment = launched.run_dir, launched.assignment
            self._set(RunState.TRAINING)

        while True:
            watched = await self._watch()
            status.step = max(status.step, watched.progress.step)
            fault = watched.fault
            while fault is not None:
                fault, completed = await self._recover(fault)
                if completed:
                    watched.completed = True
            if watched.completed:
                status.step = status.total_steps
                self._set(RunState.COMPLETED)
                return
            if workflow.info().is_continue_as_new_suggested():
                await workflow.wait_condition(workflow.all_handlers_finished)
                workflow.continue_as_new(RunStart(run_id=status.run_id, spec=self._start.spec, carried=status))

    async def _watch(self) -> DetectResult:
        """Run detect until it reports, or until a report_fault signal cancels it."""
        status = self._status
        request = DetectInput(run_id=status.run_id, incarnation=status.assignment.incarnation,
                              total_steps=status.total_steps, policy=self._policy)
        detect = workflow.start_activity_method(RecoveryActivities.detect, request,
                                                **stage_options(self._policy.stages.detect))
        await workflow.wait_condition(lambda: detect.done() or self._signalled_fault() is not None)
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
        now = workflow.now()
        report = self._signalled_fault()
        self._reported.clear()
        fault = FaultReport(
            kind="external", nodes=report.nodes, incarnation=status.assignment.incarnation,
            occurred_at=report.occurred_at or now, detected_at=now, step=status.step, reason=report.reason,
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

    async def _decide(self, incident: Incident, fault: FaultReport) -> Decision:
        """Read the inventory until the policy can replace the lost nodes, or fail after the capacity wait."""
        status = self._status
        self._set(RunState.RESCHEDULING)
        waited_since = workflow.now()
        while True:
            inventory = await self._stage("reschedule", RecoveryActivities.reschedule,
                                          RescheduleInput(run_id=status.run_id), incident)
            decision = plan_recovery(inventory, status.assignment, fault.nodes,
                                     target_dp=self._start.spec.layout.dp, min_dp=self._policy.min_dp)
            if decision.action == "reshard" and not workflow.patched(RESHARD_PATCH):
                # Runs started before resharding existed keep waiting for a spare.
                decision = plan_recovery(inventory, status.assignment, fault.nodes, target_dp=self._start.spec.layout.dp,
                                         min_dp=self._policy.min_dp, allow_reshard=False)
            incident.decision = decision
            if decision.action != "wait":
                return decision
            self._set(RunState.WAITING_FOR_CAPACITY)
            waited = (workflow.now() - waited_since).total_seconds()
            if waited >= self._policy.capacity_wait_seconds:
                raise RunFailed(
                    f"no capacity to recover from incident {incident.number}: {decision.reason}; "
                    f"waited {waited:.0f} s (recovery.capacity_wait_seconds: {self._policy.capacity_wait_seconds:g}); "
                    f"return a repaired node with `lazarus chaos return-node` and start the run again"
                )
            await workflow.sleep(min(self._policy.capacity_poll_seconds, self._policy.capacity_wait_seconds - waited))

    async def _recover(self, fault: FaultReport) -> tuple[FaultReport | None, bool]:
        """One incident: drain, reschedule, replace, resume. Returns a fault that hit the new
        incarnation before its first step (the next incident), and whether training is done."""
        status = self._status
        if len(status.incidents) >= self._policy.max_incidents:
            raise RunFailed(f"fault after {len(status.incidents)} recoveries (recovery.max_incidents): {fault.reason}")
        incident = Incident(
            number=len(status.incidents) + 1, fault=fault, old_assignment=status.assignment,
            stages={"detect": StageRecord(started_at=fault.occurred_at, ended_at=fault.detected_at)},
        )
        status.incidents.append(incident)
        status.step = fault.step

        self._set(RunState.DRAINING)
        drained = await self._stage("drain", RecoveryActivities.drain, DrainInput(
            run_id=status.run_id, incarnation=fault.incarnation, nodes=fault.nodes,
            reason=f"incident {incident.number}: {fault.kind}: {fault.reason}",
            save_grace_seconds=self._policy.save_grace_seconds,
        ), incident)
        incident.checkpoint_in_flight = drained.in_flight_checkpoint
        incident.discarded_checkpoints = drained.removed_partial_checkpoints

        while True:
            decision = await self._decide(incident, fault)
            self._set(RunState.REPLACING if decision.action == "replace" else RunState.RESHARDING)
            try:
                assignment = await self._stage("replace_or_reshard", RecoveryActivities.replace_or_reshard, ReplaceInput(
                    run_id=status.run_id, decision=decision, old_assignment=status.assignment,
                ), incident)
                break
            except StageRefused as refused:
                # A spare that died or was taken since the inventory was read: decide again.
                if refused.kind != "SpareUnavailable":
                    raise
                workflow.logger.warning("%s; rescheduling", refused)
        status.assignment = incident.new_assignment = assignment
        status.layout = assignment.layout

        self._set(RunState.RESUMING)
        resumed = await self._stage("resume", RecoveryActivities.resume, ResumeInput(
            run_id=status.run_id, assignment=assignment, total_steps=status.total_steps, policy=self._policy,
        ), incident)
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
