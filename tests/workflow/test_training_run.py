"""TrainingRun in the time-skipping environment, with fake activities under the real names."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from temporalio.client import WorkflowFailureError, WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.worker import Replayer

from lazarus.schema import RunStart, RunState, controls
from lazarus.schema.controls import FaultSignal
from lazarus.worker import queue_workers
from lazarus.workflows.training_run import RESTART_PATCH, TrainingRun
from tests.workflow.fakes import FakeStages, fake_worker, fault, make_spec, run_workflow

# The time-skipping environment is shared by the session, so these tests run in its event loop.
pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_stages_run_in_order_and_the_incident_is_recorded(time_skipping_env):
    stages = FakeStages(watch=[5, fault(step=15), 25, "done"])
    status = await run_workflow(time_skipping_env, stages, make_spec())

    assert stages.names() == [
        "launch",
        "detect",
        "detect",
        "drain",
        "reschedule",
        "replace_or_reshard",
        "resume",
        "detect",
        "detect",
        "release",  # the ended run gives its nodes back to the pool
    ]
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


async def test_a_hung_node_is_stopped_first_so_its_peers_save_as_for_a_death(time_skipping_env):
    hang = fault(nodes=("node-1",), step=27).model_copy(update={"kind": "hang"})
    stages = FakeStages(watch=[5, fault(step=15), 25, hang, 30, "done"])
    status = await run_workflow(time_skipping_env, stages, make_spec(max_incidents=5))

    assert status.state == RunState.COMPLETED
    died, hung = stages.drains
    assert died.stop_first == [] and hung.stop_first == ["node-1"] == hung.nodes
    assert died.survivor_grace_seconds == hung.survivor_grace_seconds > 0  # both give the survivors their grace


async def test_with_in_process_only_a_lost_node_s_survivors_are_waited_for_at_their_boundary(time_skipping_env):
    hang = fault(nodes=("node-1",), step=27).model_copy(update={"kind": "hang"})
    stages = FakeStages(watch=[5, fault(step=15), 25, hang, 30, "done"])
    status = await run_workflow(time_skipping_env, stages, make_spec(max_incidents=5, in_process=True))

    assert status.state == RunState.COMPLETED
    died, hung = stages.drains
    # A lost node's survivors may keep their processes; a hang takes the restart path.
    assert died.boundary_grace_seconds == 2.0 and hung.boundary_grace_seconds == 0.0
    # Without in_process, no fault waits for a boundary.
    stages = FakeStages(watch=[5, fault(step=15), "done"])
    await run_workflow(time_skipping_env, stages, make_spec())
    assert [drain.boundary_grace_seconds for drain in stages.drains] == [0.0]


async def test_transient_drain_failure_is_retried_per_policy(time_skipping_env):
    stages = FakeStages(watch=[fault(), "done"], drain_failures=2)
    spec = make_spec(
        stages={
            "drain": {
                "timeout_seconds": 10,
                "heartbeat_timeout_seconds": 5,
                "max_attempts": 3,
                "initial_retry_seconds": 0.1,
            }
        }
    )
    status = await run_workflow(time_skipping_env, stages, spec)

    assert [attempt for name, attempt in stages.calls if name == "drain"] == [1, 2, 3]
    assert status.state == RunState.COMPLETED
    assert status.incidents[0].outcome == "recovered"


async def test_drain_failing_past_its_attempts_fails_the_run_with_the_reason(time_skipping_env):
    stages = FakeStages(watch=[fault(), "done"], drain_failures=5)
    spec = make_spec(
        stages={
            "drain": {
                "timeout_seconds": 10,
                "heartbeat_timeout_seconds": 5,
                "max_attempts": 2,
                "initial_retry_seconds": 0.1,
            }
        }
    )
    with pytest.raises(WorkflowFailureError) as failure:
        await run_workflow(time_skipping_env, stages, spec)

    assert [attempt for name, attempt in stages.calls if name == "drain"] == [1, 2]
    assert isinstance(failure.value.cause, ApplicationError) and failure.value.cause.type == "RunFailed"
    assert "drain failed after its retry policy (recovery.stages.drain: 2 attempts" in failure.value.cause.message
    assert "transient drain failure on attempt 2" in failure.value.cause.message


async def test_spare_lost_before_its_claim_is_rescheduled(time_skipping_env):
    stages = FakeStages(watch=[fault(), "done"], spares=("node-4", "node-5"), spare_dies_before_claim=True)
    status = await run_workflow(time_skipping_env, stages, make_spec())

    assert stages.names()[2:8] == [
        "drain",
        "reschedule",
        "replace_or_reshard",
        "reschedule",
        "replace_or_reshard",
        "resume",
    ]
    assert status.incidents[0].decision.replacements == {"node-2": "node-5"}
    assert status.incidents[0].new_assignment.nodes == ["node-0", "node-1", "node-5", "node-3"]


async def test_resume_past_its_timeout_is_retried(time_skipping_env):
    stages = FakeStages(watch=[fault(), "done"], resume_timeouts=1, resume_sleep=3)
    spec = make_spec(
        stages={
            "resume": {
                "timeout_seconds": 1,
                "heartbeat_timeout_seconds": 1,
                "max_attempts": 3,
                "initial_retry_seconds": 0.1,
            }
        }
    )
    status = await run_workflow(time_skipping_env, stages, spec)

    assert [attempt for name, attempt in stages.calls if name == "resume"] == [1, 2]
    assert status.state == RunState.COMPLETED and status.incidents[0].outcome == "recovered"


async def test_resume_that_always_times_out_fails_the_run(time_skipping_env):
    stages = FakeStages(watch=[fault(), "done"], resume_timeouts=9, resume_sleep=3)
    spec = make_spec(
        stages={
            "resume": {
                "timeout_seconds": 1,
                "heartbeat_timeout_seconds": 1,
                "max_attempts": 2,
                "initial_retry_seconds": 0.1,
            }
        }
    )
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
    from lazarus.infra.harness.temporal_server import local_environment

    env = await local_environment(extra_args=("--dynamic-config-value", "limit.historyCount.suggestContinueAsNew=20"))
    try:
        stages = FakeStages(watch=[fault(step=15), *range(16, 40), "done"])
        queue = f"wf-{uuid.uuid4()}"
        async with queue_workers(env.client, queue, stages.all(), workflows=[TrainingRun]):
            handle = await env.client.start_workflow(
                TrainingRun.run, RunStart(spec=make_spec()), id=f"long-{uuid.uuid4()}", task_queue=queue
            )
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


async def start_on(env, stages: FakeStages, spec):
    queue = f"wf-{uuid.uuid4()}"
    worker = fake_worker(env, stages, queue)
    handle = await env.client.start_workflow(
        TrainingRun.run, RunStart(spec=spec), id=f"esc-{uuid.uuid4()}", task_queue=queue
    )
    return worker, handle


ESCALATING = dict(min_dp=4, capacity_wait_seconds=60, capacity_poll_seconds=10, approval_wait_seconds=3600)


async def test_escalation_waits_for_approval_then_reshards_below_the_minimum(time_skipping_env):
    stages = FakeStages(watch=[fault(), "done"], spares=())
    worker, handle = await start_on(time_skipping_env, stages, make_spec(**ESCALATING))
    async with worker:
        await time_skipping_env.sleep(120)  # past the capacity wait, well inside the approval wait
        status = await handle.query(TrainingRun.status)
        assert status.state == RunState.WAITING_FOR_APPROVAL
        assert (
            status.awaiting_approval.action == "wait" and "below recovery.min_dp=4" in status.awaiting_approval.reason
        )
        answer = await handle.execute_update(
            TrainingRun.approve, controls.ApproveRequest(action="reshard_below_minimum")
        )
        assert answer.message.startswith("reshard_below_minimum")
        final = await handle.result()
    assert final.state == RunState.COMPLETED
    decision = final.incidents[0].decision
    assert decision.action == "reshard" and decision.layout.dp == 3 and decision.below_target_dp
    assert final.interventions[0].kind == "approve"


async def test_escalation_wait_longer_then_capacity_returns(time_skipping_env):
    stages = FakeStages(watch=[fault(), "done"], spares=(), spare_returns_at_read=9)
    worker, handle = await start_on(time_skipping_env, stages, make_spec(**ESCALATING))
    async with worker:
        await time_skipping_env.sleep(120)
        assert (await handle.query(TrainingRun.status)).state == RunState.WAITING_FOR_APPROVAL
        await handle.execute_update(
            TrainingRun.approve, controls.ApproveRequest(action="wait_longer", wait_seconds=600)
        )
        final = await handle.result()
    assert final.state == RunState.COMPLETED
    assert final.incidents[0].decision.replacements == {"node-2": "node-9"}
    assert stages.names().count("reschedule") == 9


async def test_escalation_without_an_answer_stops_the_run(time_skipping_env):
    stages = FakeStages(watch=[fault(), "done"], spares=())
    worker, handle = await start_on(time_skipping_env, stages, make_spec(**ESCALATING))
    async with worker:
        with pytest.raises(WorkflowFailureError) as failure:
            await handle.result()
    message = failure.value.cause.message
    assert "no operator approved within 3600 s (recovery.approval_wait_seconds)" in message
    assert "the newest checkpoint is kept" in message


async def test_abort_while_waiting_for_approval(time_skipping_env):
    stages = FakeStages(watch=[fault(), "done"], spares=())
    worker, handle = await start_on(time_skipping_env, stages, make_spec(**ESCALATING))
    async with worker:
        await time_skipping_env.sleep(120)
        answer = await handle.execute_update(TrainingRun.abort, controls.AbortRequest(reason="give up"))
        final = await handle.result()
    assert "aborted by an operator during recovery" in answer.message
    assert final.state == RunState.ABORTED and final.incidents[0].outcome == "failed"
    assert "stop" not in stages.names()  # nothing was running: drain had stopped the ranks


async def test_two_hundred_faults_keep_every_history_segment_bounded(time_skipping_env):
    faults = [fault(step=i) for i in range(200)]
    stages = FakeStages(watch=[*faults, "done"], spares=[f"spare-{i}" for i in range(200)])
    spec = make_spec(max_incidents=500, history_limit_events=400)
    worker, handle = await start_on(time_skipping_env, stages, spec)
    async with worker:
        final = await handle.result()
        lengths, run_id = [], handle.first_execution_run_id
        while run_id:
            history = await time_skipping_env.client.get_workflow_handle(handle.id, run_id=run_id).fetch_history()
            lengths.append(len(history.events))
            last = history.events[-1]
            run_id = (
                last.workflow_execution_continued_as_new_event_attributes.new_execution_run_id
                if last.HasField("workflow_execution_continued_as_new_event_attributes")
                else None
            )
    assert len(final.incidents) == 200 and [i.number for i in final.incidents] == list(range(1, 201))
    assert all(i.outcome == "recovered" for i in final.incidents)
    assert final.segments == len(lengths) > 5
    # A segment ends at the first check past the limit: at most one incident's events beyond it.
    assert max(lengths) < 400 + 40, lengths


async def pause_and_resume(stages: FakeStages, handle: WorkflowHandle) -> None:
    while "detect" not in stages.names():
        await asyncio.sleep(0.01)
    await handle.execute_update(TrainingRun.pause, controls.PauseRequest(reason="test"))
    await handle.execute_update(TrainingRun.resume, controls.ResumeRequest())


async def replays_with_patch(handle: WorkflowHandle, patch: str) -> bool:
    """The run's history replays against TrainingRun, and passed `patch`'s gate (its marker, deprecated or
    not, is in the history)."""
    history = await handle.fetch_history()
    replayer = Replayer(workflows=[TrainingRun], data_converter=pydantic_data_converter)
    await replayer.replay_workflow(history, raise_on_replay_failure=True)
    return any(patch.encode() in e.marker_recorded_event_attributes.SerializeToString() for e in history.events)


async def test_a_restart_that_finds_training_done_completes_the_run(time_skipping_env):
    # The checkpoint the pause wrote was the last step: nothing is left to train or to watch
    # (before RESTART_PATCH, the run went back to TRAINING and watched the ranks it never started).
    stages = FakeStages(watch=["block", "done"], resumes=["done"])
    worker, handle = await start_on(time_skipping_env, stages, make_spec())
    async with worker:
        await pause_and_resume(stages, handle)
        final = await handle.result()
        assert await replays_with_patch(handle, RESTART_PATCH)
    assert final.state == RunState.COMPLETED and final.step == 40 and final.incidents == []
    assert stages.names() == ["launch", "detect", "stop", "replace_or_reshard", "resume", "release"]


async def test_a_fault_before_a_restarts_first_step_is_the_next_incident(time_skipping_env):
    stages = FakeStages(watch=["block", "done"], resumes=[fault(nodes=["node-2"], step=17)])
    worker, handle = await start_on(time_skipping_env, stages, make_spec())
    async with worker:
        await pause_and_resume(stages, handle)
        final = await handle.result()
        assert await replays_with_patch(handle, RESTART_PATCH)
    assert final.state == RunState.COMPLETED
    [incident] = final.incidents
    assert (incident.fault.nodes, incident.fault.incarnation, incident.outcome) == (["node-2"], 1, "recovered")
    assert incident.new_assignment.nodes == ["node-0", "node-1", "node-4", "node-3"]
    assert stages.names()[2:] == [
        "stop",
        "replace_or_reshard",
        "resume",
        "drain",
        "reschedule",
        "replace_or_reshard",
        "resume",
        "detect",
        "release",
    ]


async def test_a_claim_an_earlier_attempt_of_the_stages_made_is_what_the_incident_says(time_skipping_env):
    """The earlier attempt's workflow task timed out while its replace_or_reshard ran on and claimed
    node-5 after this attempt read the pool and decided on node-4: the claim stands, and the
    incident's decision is the claim, not the stale choice."""
    stages = FakeStages(watch=[fault(), "done"], spares=("node-4", "node-5"), claimed_before="node-5")
    status = await run_workflow(time_skipping_env, stages, make_spec())

    assert status.state == RunState.COMPLETED, status.reason
    [incident] = status.incidents
    assert incident.new_assignment.nodes == ["node-0", "node-1", "node-5", "node-3"]
    assert incident.decision.nodes == incident.new_assignment.nodes
    assert incident.decision.action == "replace" and incident.decision.replacements == {"node-2": "node-5"}
    assert "before these stages ran again" in incident.decision.reason, incident.decision.reason


async def test_a_regrow_whose_node_another_run_claimed_first_trains_on_and_backs_off(time_skipping_env):
    """The pool offered node-9 and another run claimed it first: the regrow claims before it stops
    the ranks, so they train on untouched (no stop, no new incarnation), and the watch looks for
    nodes again only after a backoff."""
    stages = FakeStages(watch=[fault(), "capacity", "capacity", "done"], spares=(), claim_lost_at=2)
    status = await run_workflow(time_skipping_env, stages, make_spec(min_dp=1))

    assert status.state == RunState.COMPLETED, status.reason
    [regrowth] = status.regrowths
    assert (regrowth.from_dp, regrowth.to_dp, regrowth.nodes) == (3, 3, [])
    assert regrowth.outcome == "capacity gone"
    assert "at the claim, replace_or_reshard refused (SpareUnavailable)" in regrowth.reason, regrowth.reason
    assert "trained on, next look in" in regrowth.reason, regrowth.reason
    assert status.layout.dp == 3 and status.assignment.nodes == ["node-0", "node-1", "node-3"]
    assert status.assignment.incarnation == 1  # the fault's; the lost claim started nothing
    after_fault = stages.names()[stages.names().index("resume") + 1 :]
    assert after_fault == ["detect", "reschedule", "replace_or_reshard", "detect", "detect", "release"]
    # The watch right after the lost claim does not look for nodes (the backoff); the next may.
    assert stages.regrow_asks[0] == 1 and stages.regrow_asks[1] is None


@pytest.mark.parametrize("regrow", [True, False], ids=["regrows", "held-by-policy"])
async def test_a_resharded_run_grows_back_when_the_pool_has_the_nodes_unless_the_policy_holds_it(
    time_skipping_env, regrow
):
    stages = FakeStages(watch=[fault(), "capacity", "done"], spares=())
    status = await run_workflow(time_skipping_env, stages, make_spec(min_dp=1, regrow=regrow))

    [incident] = status.incidents
    assert incident.decision.action == "reshard" and incident.new_assignment.layout.dp == 3
    if not regrow:
        # The watch never asked about capacity: the run stays small.
        assert stages.regrow_asks == [None] and status.regrowths == [] and status.layout.dp == 3
        return
    assert stages.regrow_asks == [1]  # dp 3 -> 4 needs one more node
    [regrowth] = status.regrowths
    assert (regrowth.from_dp, regrowth.to_dp, regrowth.nodes, regrowth.outcome) == (3, 4, ["node-9"], "regrown")
    # The nodes are claimed while the ranks train on; then they stop and start on the larger layout.
    assert list(regrowth.stages) == ["reschedule", "replace_or_reshard", "stop", "resume"]
    assert status.layout.dp == 4 and status.assignment.nodes == ["node-0", "node-1", "node-3", "node-9"]
    after_fault = stages.names()[stages.names().index("resume") + 1 :]
    assert after_fault[:6] == ["detect", "reschedule", "replace_or_reshard", "stop", "resume", "detect"]
