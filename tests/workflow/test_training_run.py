"""TrainingRun in the time-skipping environment, with fake activities under the real names."""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timedelta, timezone

import pytest
from temporalio import activity
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

from spec import (
    Assignment,
    DetectResult,
    FaultReport,
    Inventory,
    NodeRecord,
    RankProgress,
    RunStart,
    RunState,
    RunStatus,
    parse_spec,
)
from spec.stages import (
    DetectInput,
    DrainInput,
    DrainResult,
    FaultSignal,
    LaunchInput,
    LaunchResult,
    ReplaceInput,
    RescheduleInput,
    ResumeInput,
    ResumeResult,
)
from workflows.training_run import TrainingRun

ACTIVE = ["node-0", "node-1", "node-2", "node-3"]


def _now() -> datetime:
    return datetime.now(timezone.utc)


def make_spec(stages: dict | None = None, **recovery):
    return parse_spec({
        "name": "wf",
        "trainer": {"steps": 40},
        "recovery": {"progress_every_seconds": 1, "capacity_poll_seconds": 5, **recovery, "stages": stages or {}},
    })


def fault(nodes=("node-2",), step=15, incarnation=0) -> FaultReport:
    at = _now()
    return FaultReport(kind="node_down", nodes=list(nodes), incarnation=incarnation,
                       occurred_at=at - timedelta(seconds=0.5), detected_at=at, step=step, reason="test fault")


class FakeStages:
    """The recovery activities, scripted: detect plays `watch` in order; records each call."""

    def __init__(self, watch: list, spares=("node-4",), drain_failures=0, resume_timeouts=0, resume_sleep=0.0,
                 spare_returns_at_read: int | None = None, spare_dies_before_claim: bool = False):
        self.watch = list(watch)
        self.spare_dies_before_claim = spare_dies_before_claim
        self.spare_returns_at_read = spare_returns_at_read
        self.spares = list(spares)
        self.drain_failures = drain_failures
        self.resume_timeouts = resume_timeouts
        self.resume_sleep = resume_sleep
        self.calls: list[tuple[str, int]] = []
        self.detect_cancelled = asyncio.Event()
        self.nodes = {name: "active" for name in ACTIVE}
        self.nodes.update({name: "spare" for name in spares})

    def _called(self, name: str) -> int:
        attempt = activity.info().attempt
        self.calls.append((name, attempt))
        return attempt

    def names(self) -> list[str]:
        """Activity names in call order, one entry per call (retries included)."""
        return [name for name, _ in self.calls]

    @activity.defn(name="launch")
    async def launch(self, request: LaunchInput) -> LaunchResult:
        self._called("launch")
        return LaunchResult(run_dir="/nowhere", assignment=Assignment(
            incarnation=0, nodes=ACTIVE, layout=request.spec.layout, master_port=29400))

    @activity.defn(name="detect")
    async def detect(self, request: DetectInput) -> DetectResult:
        self._called("detect")
        step = self.watch.pop(0) if self.watch else "block"
        if step == "block":
            # Watch until cancelled, as the real detect does.
            try:
                while True:
                    activity.heartbeat()
                    await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                self.detect_cancelled.set()
                raise
        if step == "done":
            return DetectResult(completed=True, progress=RankProgress(step=request.total_steps, at=_now()))
        if isinstance(step, FaultReport):
            return DetectResult(fault=step.model_copy(update={"incarnation": request.incarnation}),
                                progress=RankProgress(step=step.step, at=_now()))
        return DetectResult(progress=RankProgress(step=step, at=_now()))

    @activity.defn(name="drain")
    async def drain(self, request: DrainInput) -> DrainResult:
        attempt = self._called("drain")
        if attempt <= self.drain_failures:
            raise RuntimeError(f"transient drain failure on attempt {attempt}")
        for node in request.nodes:
            self.nodes[node] = "quarantined"
        return DrainResult(quarantined=request.nodes, stopped_ranks=[0, 1, 2, 3], removed_partial_checkpoints=[20],
                           in_flight_checkpoint=20)

    @activity.defn(name="reschedule")
    async def reschedule(self, request: RescheduleInput) -> Inventory:
        self._called("reschedule")
        if self.names().count("reschedule") == self.spare_returns_at_read:
            self.nodes["node-9"] = "spare"  # a repaired node comes back while the run waits
        return Inventory(nodes=[NodeRecord(name=n, role=role) for n, role in sorted(self.nodes.items())])

    @activity.defn(name="replace_or_reshard")
    async def replace_or_reshard(self, request: ReplaceInput) -> Assignment:
        self._called("replace_or_reshard")
        if self.spare_dies_before_claim:
            self.spare_dies_before_claim = False
            for spare in request.decision.replacements.values():
                self.nodes[spare] = "quarantined"
            raise ApplicationError("node-4 is no longer a free spare", type="SpareUnavailable", non_retryable=True)
        decision, old = request.decision, request.old_assignment
        for node in decision.nodes:
            self.nodes[node] = "active"
        for node in decision.released_nodes:
            self.nodes[node] = "spare"
        return old.model_copy(update={"incarnation": old.incarnation + 1, "nodes": decision.nodes,
                                      "layout": decision.layout})

    @activity.defn(name="resume")
    async def resume(self, request: ResumeInput) -> ResumeResult:
        attempt = self._called("resume")
        if attempt <= self.resume_timeouts:
            await asyncio.sleep(self.resume_sleep)  # longer than the stage's timeout
        return ResumeResult(resumed_from_step=10, first_step_at=_now())

    def all(self) -> list:
        return [self.launch, self.detect, self.drain, self.reschedule, self.replace_or_reshard, self.resume]


async def run_workflow(env, stages: FakeStages, spec, during=None) -> RunStatus:
    """Run TrainingRun on a fresh task queue against the fakes; `during(handle)` runs alongside."""
    queue = f"wf-{uuid.uuid4()}"
    async with Worker(env.client, task_queue=queue, workflows=[TrainingRun], activities=stages.all()):
        handle = await env.client.start_workflow(
            TrainingRun.run, RunStart(run_id=f"run-{uuid.uuid4().hex[:8]}", spec=spec),
            id=f"run-{uuid.uuid4()}", task_queue=queue)
        if during is not None:
            await during(handle)
        return await handle.result()


async def test_stages_run_in_order_and_the_incident_is_recorded(time_skipping_env):
    stages = FakeStages(watch=[5, fault(step=15), 25, "done"])
    status = await run_workflow(time_skipping_env, stages, make_spec())

    assert stages.names() == ["launch", "detect", "detect", "drain", "reschedule", "replace_or_reshard",
                              "resume", "detect", "detect"]
    assert status.state == RunState.COMPLETED and status.step == 40
    [incident] = status.incidents
    assert list(incident.stages) == ["detect", "drain", "reschedule", "replace_or_reshard", "resume"]
    assert all(stage.ended_at >= stage.started_at for stage in incident.stages.values())
    assert incident.decision.action == "replace" and incident.decision.replacements == {"node-2": "node-4"}
    assert incident.new_assignment.nodes == ["node-0", "node-1", "node-4", "node-3"]
    assert incident.new_assignment.incarnation == 1
    assert (incident.resumed_from_step, incident.lost_steps, incident.outcome) == (10, 5, "recovered")
    assert incident.checkpoint_in_flight == 20 and incident.discarded_checkpoints == [20]
    assert incident.mttr_seconds > 0


async def test_transient_drain_failure_is_retried_per_policy(time_skipping_env):
    stages = FakeStages(watch=[fault(), "done"], drain_failures=2)
    spec = make_spec(stages={"drain": {"timeout_seconds": 10, "heartbeat_timeout_seconds": 5,
                                       "max_attempts": 3, "initial_retry_seconds": 0.1}})
    status = await run_workflow(time_skipping_env, stages, spec)

    assert [attempt for name, attempt in stages.calls if name == "drain"] == [1, 2, 3]
    assert status.state == RunState.COMPLETED
    assert status.incidents[0].outcome == "recovered"


async def test_drain_failing_past_its_attempts_fails_the_run_with_the_reason(time_skipping_env):
    stages = FakeStages(watch=[fault(), "done"], drain_failures=5)
    spec = make_spec(stages={"drain": {"timeout_seconds": 10, "heartbeat_timeout_seconds": 5,
                                       "max_attempts": 2, "initial_retry_seconds": 0.1}})
    with pytest.raises(WorkflowFailureError) as failure:
        await run_workflow(time_skipping_env, stages, spec)

    assert [attempt for name, attempt in stages.calls if name == "drain"] == [1, 2]
    assert isinstance(failure.value.cause, ApplicationError) and failure.value.cause.type == "RunFailed"
    assert "drain failed after its retry policy (recovery.stages.drain: 2 attempts" in failure.value.cause.message
    assert "transient drain failure on attempt 2" in failure.value.cause.message


async def test_spare_lost_before_its_claim_is_rescheduled(time_skipping_env):
    stages = FakeStages(watch=[fault(), "done"], spares=("node-4", "node-5"), spare_dies_before_claim=True)
    status = await run_workflow(time_skipping_env, stages, make_spec())

    assert stages.names()[2:8] == ["drain", "reschedule", "replace_or_reshard", "reschedule", "replace_or_reshard", "resume"]
    assert status.incidents[0].decision.replacements == {"node-2": "node-5"}
    assert status.incidents[0].new_assignment.nodes == ["node-0", "node-1", "node-5", "node-3"]


async def test_resume_past_its_timeout_is_retried(time_skipping_env):
    stages = FakeStages(watch=[fault(), "done"], resume_timeouts=1, resume_sleep=3)
    spec = make_spec(stages={"resume": {"timeout_seconds": 1, "heartbeat_timeout_seconds": 1,
                                        "max_attempts": 3, "initial_retry_seconds": 0.1}})
    status = await run_workflow(time_skipping_env, stages, spec)

    assert [attempt for name, attempt in stages.calls if name == "resume"] == [1, 2]
    assert status.state == RunState.COMPLETED and status.incidents[0].outcome == "recovered"


async def test_resume_that_always_times_out_fails_the_run(time_skipping_env):
    stages = FakeStages(watch=[fault(), "done"], resume_timeouts=9, resume_sleep=3)
    spec = make_spec(stages={"resume": {"timeout_seconds": 1, "heartbeat_timeout_seconds": 1,
                                        "max_attempts": 2, "initial_retry_seconds": 0.1}})
    with pytest.raises(WorkflowFailureError) as failure:
        await run_workflow(time_skipping_env, stages, spec)

    assert [attempt for name, attempt in stages.calls if name == "resume"] == [1, 2]
    message = failure.value.cause.message
    assert "resume failed after its retry policy (recovery.stages.resume: 2 attempts, 1 s each)" in message
    assert "timeout" in message.lower()


async def test_no_spare_and_no_smaller_dp_allowed_waits_then_fails_with_the_reason(time_skipping_env):
    stages = FakeStages(watch=[fault(), "done"], spares=())
    spec = make_spec(capacity_wait_seconds=60, capacity_poll_seconds=10, min_dp=4)
    with pytest.raises(WorkflowFailureError) as failure:
        await run_workflow(time_skipping_env, stages, spec)

    # Read at 0, 10, ..., 60 s of (skipped) workflow time, then gave up.
    assert stages.names().count("reschedule") == 7
    assert "replace_or_reshard" not in stages.names() and "resume" not in stages.names()
    message = failure.value.cause.message
    assert "no capacity to recover from incident 1" in message
    assert "0 free spare(s)" in message and "below recovery.min_dp=4" in message
    assert "recovery.capacity_wait_seconds: 60" in message


async def test_no_spare_reshards_to_the_survivors(time_skipping_env):
    stages = FakeStages(watch=[fault(), "done"], spares=())
    status = await run_workflow(time_skipping_env, stages, make_spec(min_dp=2))

    [incident] = status.incidents
    assert incident.decision.action == "reshard" and incident.decision.below_target_dp
    assert incident.new_assignment.nodes == ["node-0", "node-1", "node-3"]
    assert incident.new_assignment.layout.dp == 3 and status.layout.dp == 3
    assert status.state == RunState.COMPLETED


async def test_capacity_returning_while_waiting_recovers(time_skipping_env):
    stages = FakeStages(watch=[fault(), "done"], spares=(), spare_returns_at_read=4)
    spec = make_spec(capacity_wait_seconds=600, capacity_poll_seconds=10, min_dp=4)
    status = await run_workflow(time_skipping_env, stages, spec)

    assert stages.names().count("reschedule") == 4
    assert status.state == RunState.COMPLETED
    assert status.incidents[0].decision.replacements == {"node-2": "node-9"}


async def test_report_fault_signal_cancels_detect_and_recovers(time_skipping_env):
    stages = FakeStages(watch=["block", "done"])

    async def report(handle):
        while "detect" not in stages.names():
            await asyncio.sleep(0.01)
        await handle.signal(TrainingRun.report_fault, FaultSignal(nodes=["node-1", "node-77"], reason="ECC errors"))

    status = await run_workflow(time_skipping_env, stages, make_spec(), during=report)
    assert stages.detect_cancelled.is_set()
    [incident] = status.incidents
    assert incident.fault.kind == "external" and incident.fault.nodes == ["node-1"]
    assert incident.fault.reason == "ECC errors"
    assert incident.new_assignment.nodes == ["node-0", "node-4", "node-2", "node-3"]
    assert status.state == RunState.COMPLETED


async def test_long_run_continues_as_new_and_carries_its_incidents(tmp_path):
    """On a dev server that suggests continue-as-new after 20 events, the run keeps its state."""
    from temporalio.contrib.pydantic import pydantic_data_converter
    from temporalio.testing import WorkflowEnvironment

    from infra.local import free_port
    from infra.temporal_server import temporal_cli

    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_cli(), data_converter=pydantic_data_converter, port=free_port(),
        dev_server_extra_args=["--dynamic-config-value", "limit.historyCount.suggestContinueAsNew=20"])
    try:
        stages = FakeStages(watch=[fault(step=15), *range(16, 40), "done"])
        queue = f"wf-{uuid.uuid4()}"
        async with Worker(env.client, task_queue=queue, workflows=[TrainingRun], activities=stages.all()):
            handle = await env.client.start_workflow(
                TrainingRun.run, RunStart(run_id="long", spec=make_spec()), id=f"long-{uuid.uuid4()}", task_queue=queue)
            status = await handle.result()
            first_run = env.client.get_workflow_handle(handle.id, run_id=handle.first_execution_run_id)
            first_history = await first_run.fetch_history()
    finally:
        await env.shutdown()

    assert any(e.HasField("workflow_execution_continued_as_new_event_attributes") for e in first_history.events)
    # Launched once; the incident from before the continue-as-new is still in the final status.
    assert stages.names().count("launch") == 1
    assert status.state == RunState.COMPLETED
    [incident] = status.incidents
    assert incident.outcome == "recovered" and incident.new_assignment.incarnation == 1
