"""TrainingRun: one durable workflow per training run; recovery is its loop of activities.

The run loop launches incarnation 0 and watches it (detect); on every fault it recovers in the
five stages of DESIGN.md (detect, drain, reschedule, replace-or-reshard, resume); between them it
carries out operators' requests (workflows/controls.py); it continues as new when the history
grows long. A recovery and an operator's restart reach the next incarnation by the same path
(_replace_and_resume). Every change of state goes through _enter, which the transitions table
beside RunState (schema/states.py, TRANSITIONS) allows or refuses.
"""

from __future__ import annotations

from temporalio import workflow
from temporalio.common import SearchAttributeKey
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from lazarus.activities.recovery import RecoveryActivities
    from lazarus.schema.faults import PLANNED_KINDS
    from lazarus.schema.records import (
        Assignment,
        Decision,
        FaultReport,
        Incident,
        Regrowth,
        RunStart,
        RunState,
        RunStatus,
        StageRecord,
    )
    from lazarus.schema.stages import (
        DrainInput,
        DrainResult,
        LaunchInput,
        ReleaseInput,
        ResumeInput,
        ResumeResult,
    )
    from lazarus.schema.states import may_move

from lazarus.workflows.controls import OperatorControls
from lazarus.workflows.incidents import CRASH_LOOP_PATCH, Incidents, crash_loop
from lazarus.workflows.inputs import INVALID_INPUT, RunStartPayload, own_run_id
from lazarus.workflows.progress import expected_source, take_completion, take_progress, take_recovery, take_resume
from lazarus.workflows.regrow import Regrowing
from lazarus.workflows.rescheduling import Rescheduling
from lazarus.workflows.stage_calls import OwnerChanged, RunAborted, RunFailed, StageRefused, call_stage
from lazarus.workflows.story import current_details
from lazarus.workflows.takeover import TakingOver
from lazarus.workflows.watch import watch

# Deprecated patches: each id's workflow.deprecate_patch stands where its workflow.patched stood, so
# that histories with the id's marker replay (the patch policy: docs/concepts/run-as-workflow.md).
RESTART_PATCH = "restart-as-recovery"
"""Deprecated patch id: an operator's restart ends as a recovery does: a fault before the first step
is the next incident at once, and a restart that finds training done completes the run (before:
back to TRAINING first, and a finished run went on being watched)."""

RELEASE_PATCH = "release-at-end"
"""Deprecated patch id: an ended run gives its nodes back to the pool (before: it kept them)."""

PASSING_PATCH = "passing-states-unlisted"
"""Deprecated patch id: the recovery states a run passes through in a moment are not upserted to
the search attributes (before: an upsert, one history event, for each)."""

PASSING_STATES = (RunState.RESCHEDULING, RunState.REPLACING, RunState.RESHARDING, RunState.RESUMING)
"""States a recovery passes through, usually within a second: the status query shows them, the
search attribute stays at DRAINING through them (each would cost an event per incident)."""

STATE_ATTRIBUTE = SearchAttributeKey.for_keyword("LazarusState")
"""The run's RunState, for the web UI's list and `temporal workflow list --query`; through a
recovery, DRAINING until the run trains again or waits (for capacity, for an approval)."""
INCIDENTS_ATTRIBUTE = SearchAttributeKey.for_int("LazarusIncidents")
"""How many incidents the run has had."""


@workflow.defn(name="TrainingRun")
class TrainingRun(OperatorControls, Rescheduling, Regrowing, TakingOver, Incidents):
    """Launch the run, watch it, and on every fault run drain, reschedule, replace-or-reshard, resume."""

    @workflow.init
    def __init__(self, start: RunStartPayload) -> None:
        if not isinstance(start, RunStart):  # a null or raw-bytes payload never reaches pydantic
            raise ApplicationError(
                f"TrainingRun takes a RunStart, not {type(start).__name__}", type=INVALID_INPUT, non_retryable=True
            )
        super().__init__()
        self._start = start
        self._status = start.carried or RunStatus(
            run_id=start.run_id or workflow.info().workflow_id,  # checked as the run starts
            total_steps=start.spec.trainer.steps,
            layout=start.spec.layout,
        )
        if self._status.policy is None:
            self._status.policy = start.spec.recovery
        if start.carried is None:
            self._status.steps_from = expected_source(start.spec.trainer)
            if self._status.steps_from is None:
                self._status.step = None
        self._next_fault: FaultReport | None = None  # hit an operator's restart before its first step

    @workflow.run
    async def run(self, start: RunStartPayload) -> RunStatus:
        """Train to the last step through every fault; the status is the result, or the failure's reason."""
        if start.carried is None:
            own_run_id(start)  # refuses, before anything is done, a start that names another run
        try:
            await self._train()
        except RunAborted as aborted:
            self._end(RunState.ABORTED, str(aborted))
            await self._close_requests(aborted=str(aborted))
            await self._release()
            return self._status
        except RunFailed as failure:
            self._end(RunState.FAILED, str(failure))
            await self._close_requests()
            await self._release()
            raise ApplicationError(str(failure), type="RunFailed", non_retryable=True) from None
        await self._close_requests()
        await self._release()
        return self._status

    async def _release(self) -> None:
        """The run ended: its nodes go back to the pool for other runs (what it quarantined stays
        out). A release that fails is logged; the run's outcome stands."""
        workflow.deprecate_patch(RELEASE_PATCH)
        try:
            releasing = ReleaseInput(run_id=self._status.run_id)
            await call_stage(self._policy, "release", RecoveryActivities.release, releasing)
        except RunFailed as failure:
            workflow.logger.warning("the run's nodes were not released: %s", failure)

    def _enter(self, state: RunState) -> None:
        """Move the run to `state`: the one place its state changes. Entering the current state does
        nothing; a move that TRANSITIONS does not allow is a bug, so it fails the workflow task."""
        current = self._status.state
        if state == current:
            return
        if not may_move(current, state):
            raise RuntimeError(f"a run may not go from {current.value} to {state.value} (schema.records.TRANSITIONS)")
        self._status.state = state
        self._show()
        if state in PASSING_STATES:
            workflow.deprecate_patch(PASSING_PATCH)
            return  # the search attribute stays DRAINING (recovering) until the run trains or waits
        if self._start.search_attributes:
            workflow.upsert_search_attributes(
                [
                    STATE_ATTRIBUTE.value_set(state.value),
                    INCIDENTS_ATTRIBUTE.value_set(self._status.incident_count),
                ]
            )

    def start_input(self) -> RunStart:
        """What this workflow run started with (read from a replay: `lazarus run adopt`)."""
        return self._start

    def _show(self) -> None:
        """Keep the run's current details (the web UI's summary of it) up to date."""
        workflow.set_current_details(current_details(self._status))

    def _end(self, state: RunState, reason: str = "") -> None:
        status = self._status
        status.reason, status.ended_at = reason, workflow.now()
        for incident in status.incidents:
            if incident.outcome == "recovering":
                incident.outcome = "failed"
        self._enter(state)

    async def _stage(self, name: str, method, request, incident: Incident | Regrowth | None = None):
        """Run a stage's activity; on an incident (or a regrow), record when the stage started and ended."""
        if incident is not None and name not in incident.stages:
            incident.stages[name] = StageRecord(started_at=workflow.now())
        result = await call_stage(self._policy, name, method, request)
        if incident is not None:
            incident.stages[name].ended_at = workflow.now()
        return result

    # --- the run loop ---------------------------------------------------------------------

    async def _train(self) -> None:
        """Launch once; then recover, carry out requests or watch, until training is done. A stage
        refused because another execution owns the run is answered by taking it over, where this
        execution may (workflows/takeover.py); an adoption takes it over first."""
        self._show()  # a continued run starts with its details
        done = await self._take_over(None) if self._start.adopt else False
        while not done:
            try:
                done = await self._turn()
            except OwnerChanged as changed:
                done = await self._take_over(changed)
        take_completion(self._status)
        self._end(RunState.COMPLETED)

    async def _turn(self) -> bool:
        """One turn of the run loop: launch, recover, carry out a request, wait while paused, continue
        as new, or watch; True when training is done."""
        if self._status.assignment is None:
            await self._launch()
            return False
        if self._next_fault is not None:
            fault, self._next_fault = self._next_fault, None
            return await self._recover_all(fault)
        if self._queue:
            return await self._carry_out_next()
        if self._status.state == RunState.PAUSED:
            await workflow.wait_condition(lambda: bool(self._queue))  # resume or abort
            return False
        if self._time_to_continue_as_new() and not self._reported:
            await self._continue_as_new()
            return False
        return await self._watch_and_recover()

    async def _launch(self) -> None:
        status = self._status
        status.started_at = workflow.now()
        self._enter(RunState.LAUNCHING)
        launching = LaunchInput(run_id=status.run_id, spec=self._start.spec)
        launched = await self._stage("launch", RecoveryActivities.launch, launching)
        status.run_dir, status.assignment = launched.run_dir, launched.assignment
        self._enter(RunState.TRAINING)

    def _time_to_continue_as_new(self) -> bool:
        info = workflow.info()
        return (
            info.is_continue_as_new_suggested()
            or info.get_current_history_length() >= self._policy.history_limit_events
        )

    async def _continue_as_new(self) -> None:
        """Carry the status into a new workflow run, once every handler has finished; returns when a
        request was queued meanwhile (it is carried out first)."""
        await workflow.wait_condition(lambda: workflow.all_handlers_finished() or bool(self._queue))
        if self._queue:
            return
        status = self._status
        status.segments += 1
        workflow.continue_as_new(
            RunStart(
                run_id=status.run_id,
                spec=self._start.spec,
                carried=status,
                search_attributes=self._start.search_attributes,
            )
        )

    async def _watch_and_recover(self) -> bool:
        """Watch the incarnation until it reports; recover from a fault. True when training is done."""
        grow = self._regrow_watch()
        limit = self._node_limit() if grow is not None else None
        watched = await watch(
            self._status, self._policy, self._reported, lambda: bool(self._queue), regrow_nodes=grow, node_limit=limit
        )
        if watched is None:
            return False  # an operator's request interrupted the watch
        take_progress(self._status, watched.progress)
        self._show()
        if watched.fault is not None and await self._recover_all(watched.fault):
            return True
        if watched.capacity and watched.fault is None and not watched.completed:
            return await self._regrow()
        return watched.completed

    # --- recovery: detect, drain, reschedule, replace-or-reshard, resume -------------------

    async def _recover_all(self, fault: FaultReport) -> bool:
        """Recover from a fault, and from each one that hits the next incarnation before it trains;
        True when training is done."""
        while True:
            resumed = await self._recover(fault)
            if resumed.fault is None:
                return resumed.completed
            fault = resumed.fault

    async def _recover(self, fault: FaultReport) -> ResumeResult:
        """One incident. Detect is done (`fault` is its result); then drain, reschedule,
        replace-or-reshard and resume. A fault in the result hit the new incarnation before its
        first step: it is the next incident."""
        looping = None
        if fault.kind == "rank_error":
            workflow.deprecate_patch(CRASH_LOOP_PATCH)
            looping = crash_loop(self._status.incidents, fault)
        incident = self._open_incident(fault)
        if fault.kind in PLANNED_KINDS:
            await self._stop_for_swap(incident, fault)
        drained = await self._drain(incident, fault)
        if looping is not None:
            return self._end_crash_loop(incident, looping)
        if drained.held_back:
            return self._hold_for_a_person(incident, drained.held_back)
        survivors_of = fault.incarnation if drained.survivors or drained.kept_survivors else None
        while True:
            decision = await self._reschedule(incident, fault)
            self._check_abort()
            try:
                resumed = await self._replace_and_resume(decision, incident, fault.kind, survivors_of)
                break
            except StageRefused as refused:
                # A spare that died or was taken since the inventory was read: decide again.
                if not refused.spare_lost:
                    raise
                workflow.logger.warning("%s; rescheduling", refused)
        take_recovery(incident, resumed)
        self._show()
        await self._archive_old_incidents()
        return resumed

    async def _drain(self, incident: Incident, fault: FaultReport) -> DrainResult:
        """Quarantine the blamed nodes and stop every rank of the failed incarnation."""
        status = self._status
        self._enter(RunState.DRAINING)
        draining = DrainInput(
            run_id=status.run_id,
            incarnation=fault.incarnation,
            nodes=fault.nodes,
            reason=f"incident {incident.number}: {fault.kind}: {fault.reason}",
            save_grace_seconds=self._policy.save_grace_seconds,
            # The peers of a hung rank wait on it in a collective: stopped, it breaks that as a death does.
            stop_first=fault.nodes if fault.kind == "hang" else [],
            # A script that does not save its state on a broken collective would only cost the grace.
            survivor_grace_seconds=(
                self._policy.survivor_grace_seconds
                if self._start.spec.trainer.saves_survivors and fault.kind not in PLANNED_KINDS
                else 0.0
            ),
            detect_seconds=max(0.0, (fault.detected_at - fault.occurred_at).total_seconds()),
            want=self._want(fault),
            # Detect's own faults carry the step of their look; the others only the last progress report.
            read_step=fault.kind in ("external", "operator"),
            breaker=fault.kind != "operator",  # an operator's own drain is a person's decision
            # A lost node's survivors (it died, its ranks were killed) may keep their processes; not others'.
            boundary_grace_seconds=self._boundary_grace(fault),
        )
        drained = await self._stage("drain", RecoveryActivities.drain, draining, incident)
        if drained.step is not None and (fault.step is None or drained.step > fault.step):
            fault.step = status.step = drained.step
        status.quarantined_nodes = sorted(set(status.quarantined_nodes) | set(drained.quarantined))
        incident.checkpoint_in_flight = drained.in_flight_checkpoint
        incident.discarded_checkpoints = drained.removed_partial_checkpoints
        return drained

    def _boundary_grace(self, fault: FaultReport) -> float:
        """How long drain waits for the survivors at their step boundary (0: the restart path)."""
        keeps = self._policy.in_process and self._start.spec.trainer.saves_survivors
        return self._policy.boundary_grace_seconds if keeps and fault.kind in ("node_down", "rank_exit") else 0.0

    async def _take_up(
        self,
        assignment: Assignment,
        incident: Incident | None,
        survivors_of: int | None = None,
        timing: Regrowth | None = None,
    ) -> ResumeResult:
        """Make the claimed `assignment` the run's and start it (resume)."""
        status = self._status
        status.assignment, status.layout = assignment, assignment.layout
        if incident is not None:
            incident.new_assignment = assignment
        fault_step = incident.fault.step if incident is not None else None
        return await self._resume(assignment, incident if incident is not None else timing, fault_step, survivors_of)

    async def _resume(self, assignment, record=None, fault_step=None, survivors_of=None) -> ResumeResult:
        """Start `assignment`'s incarnation (timed on `record`, an incident or a regrow): from what
        the survivors of `survivors_of` saved at `fault_step`, else the newest complete checkpoint.
        TRAINING again unless a fault hit it before its first step."""
        status = self._status
        self._enter(RunState.RESUMING)
        starting = ResumeInput(
            run_id=status.run_id,
            assignment=assignment,
            total_steps=status.total_steps,
            policy=self._policy,
            steps_from=status.steps_from,
            fault_step=fault_step,
            survivors_of=survivors_of,
        )
        resumed = await self._stage("resume", RecoveryActivities.resume, starting, record)
        if resumed.fault is None:
            take_resume(status, resumed)
            self._enter(RunState.TRAINING)
        return resumed

    async def _restart(self, decision: Decision, claimed: Assignment | None = None) -> bool:
        """An operator's restart (resume after a pause, reshard) on `decision`'s nodes, or on the
        assignment `claimed` for it already; True when training is done. A fault before the first
        step is recovered from next, by the run loop."""
        if claimed is None:
            resumed = await self._replace_and_resume(decision, None, fault_kind="operator")
        else:
            self._enter(RunState.REPLACING if decision.action == "replace" else RunState.RESHARDING)
            resumed = await self._take_up(claimed, None)
        self._next_fault = resumed.fault
        if resumed.fault is not None or resumed.completed:
            workflow.deprecate_patch(RESTART_PATCH)
        return resumed.completed
