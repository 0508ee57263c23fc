"""The operator's updates on a real local Temporal server (fake activities): answers and refusals."""

from __future__ import annotations

import asyncio
import uuid
from contextlib import asynccontextmanager

import pytest
from temporalio import workflow
from temporalio.client import WorkflowExecutionStatus, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.service import RPCError
from temporalio.worker import Worker

from lazarus.schema import RunStart, RunState, RunStatus, controls
from lazarus.worker import queue_workers
from lazarus.workflows.training_run import TrainingRun
from tests.workflow.fakes import DRAINED_STEP, FakeStages, fake_worker, fault, make_spec

pytestmark = pytest.mark.timeout(120)


@asynccontextmanager
async def running(env, stages: FakeStages, spec=None):
    """A TrainingRun on the dev server with a worker over the fakes; yields its handle."""
    queue = f"op-{uuid.uuid4()}"
    async with fake_worker(env, stages, queue):
        handle = await env.client.start_workflow(
            TrainingRun.run, RunStart(spec=spec or make_spec()), id=f"op-{uuid.uuid4()}", task_queue=queue
        )
        yield handle


async def state_of(handle: WorkflowHandle) -> RunStatus:
    return await handle.query(TrainingRun.status)


async def until_state(handle: WorkflowHandle, *states: RunState) -> RunStatus:
    """Query until the run reaches one of `states` (the workflow moves on its own)."""
    for _ in range(2000):
        status = await state_of(handle)
        if status.state in states:
            return status
        await asyncio.sleep(0.01)
    raise AssertionError(f"run never reached {states}; it is {status.state}")


async def refused(handle: WorkflowHandle, update, request) -> str:
    with pytest.raises(WorkflowUpdateFailedError) as failure:
        await handle.execute_update(update, request)
    return str(failure.value.cause)


async def test_pause_checkpoints_and_holds_then_resume_continues(dev_env):
    stages = FakeStages(watch=["block", "block", "done"])
    async with running(dev_env, stages) as handle:
        await until_state(handle, RunState.TRAINING)
        assert "only a paused run can be resumed" in await refused(handle, TrainingRun.resume, controls.ResumeRequest())

        answer = await handle.execute_update(TrainingRun.pause, controls.PauseRequest(reason="maintenance"))
        assert answer.state == "PAUSED" and "checkpoint step-17" in answer.message
        assert stages.names().count("stop") == 1
        assert "already paused" in await refused(handle, TrainingRun.pause, controls.PauseRequest())
        assert "resume it first" in await refused(
            handle, TrainingRun.drain_node, controls.DrainNodeRequest(node="node-1")
        )

        answer = await handle.execute_update(TrainingRun.resume, controls.ResumeRequest())
        assert answer.state == "TRAINING"
        status = await state_of(handle)
        assert status.assignment.incarnation == 1 and status.assignment.nodes == [
            "node-0",
            "node-1",
            "node-2",
            "node-3",
        ]
        assert [i.kind for i in status.interventions] == ["pause", "resume"]
        assert stages.names().count("resume") == 1 and stages.names().count("replace_or_reshard") == 1


async def test_abort_stops_cleanly_and_later_updates_are_refused(dev_env):
    stages = FakeStages(watch=["block"])
    async with running(dev_env, stages) as handle:
        await until_state(handle, RunState.TRAINING)
        answer = await handle.execute_update(TrainingRun.abort, controls.AbortRequest(reason="budget cut"))
        assert "aborted by an operator: budget cut; checkpoint step-17 kept" in answer.message
        final = await handle.result()
        assert final.state == RunState.ABORTED and final.ended_at is not None
        assert stages.names().count("stop") == 1
        with pytest.raises(RPCError, match="workflow execution already completed"):
            await handle.execute_update(TrainingRun.abort, controls.AbortRequest())


async def test_drain_node_starts_the_same_recovery_and_refuses_unknown_nodes(dev_env):
    stages = FakeStages(watch=["block", "block", "done"])
    async with running(dev_env, stages) as handle:
        await until_state(handle, RunState.TRAINING)
        assert "node-9 is not a node of the run's current assignment" in await refused(
            handle, TrainingRun.drain_node, controls.DrainNodeRequest(node="node-9")
        )
        answer = await handle.execute_update(
            TrainingRun.drain_node, controls.DrainNodeRequest(node="node-1", reason="ECC")
        )
        assert answer.message == "incident 1: recovered"
        status = await state_of(handle)
        [incident] = status.incidents
        assert (
            incident.fault.kind == "operator" and incident.fault.nodes == ["node-1"] and incident.fault.reason == "ECC"
        )
        # Its step is where the ranks were when drain stopped them, not the workflow's last report.
        assert incident.fault.step == DRAINED_STEP
        assert status.assignment.nodes == ["node-0", "node-4", "node-2", "node-3"]
        assert status.quarantined_nodes == ["node-1"]


async def test_controls_are_answered_while_survivors_hold_the_drain(dev_env):
    survivors_end = asyncio.Event()
    stages = FakeStages(watch=[fault(nodes=["node-2"]), "done"], survivors_gate=survivors_end)
    async with running(dev_env, stages) as handle:
        # The survivors never end until the answers below came: each came while the drain waited.
        assert (await until_state(handle, RunState.DRAINING)).state == RunState.DRAINING
        assert "the run is DRAINING; pause once it trains again" in await refused(
            handle, TrainingRun.pause, controls.PauseRequest()
        )
        changes = controls.SetPolicyRequest(changes={"max_incidents": 5})
        assert (await handle.execute_update(TrainingRun.set_policy, changes)).message == "policy updated"
        survivors_end.set()
        status = await handle.result()
    assert stages.drains_local == [True, False]  # cut at its cap, the drain went on as an activity of its own
    first, rest = stages.drains
    assert first.wait_cap_seconds is not None and first.waited is None
    assert rest.wait_cap_seconds is None and rest.waited.survivors == first.wait_cap_seconds
    [incident] = status.incidents
    # What the drain that finished found is the incident's, not the cut call's empty result.
    assert (incident.outcome, incident.checkpoint_in_flight, incident.discarded_checkpoints) == ("recovered", 20, [20])
    assert status.quarantined_nodes == ["node-2"]
    assert status.assignment.nodes == ["node-0", "node-1", "node-4", "node-3"]
    assert status.policy.max_incidents == 5


async def test_drain_node_during_another_recovery_runs_after_it(dev_env):
    gate = asyncio.Event()
    stages = FakeStages(watch=[fault(nodes=["node-2"]), "block", "done"], spares=("node-4", "node-5"), resume_gate=gate)
    # Two spares the run may hold (cluster.spare_nodes): one for each of its two recoveries.
    async with running(dev_env, stages, make_spec(cluster={"spare_nodes": 2})) as handle:
        await until_state(handle, RunState.RESUMING)
        assert "the run is RESUMING; pause once it trains again" in await refused(
            handle, TrainingRun.pause, controls.PauseRequest()
        )
        assert "the run is RESUMING; reshard once it trains" in await refused(
            handle, TrainingRun.reshard, controls.ReshardRequest(dp=2)
        )
        drain = asyncio.ensure_future(
            handle.execute_update(TrainingRun.drain_node, controls.DrainNodeRequest(node="node-1"))
        )
        while not (await state_of(handle)).interventions:
            await asyncio.sleep(0.01)
        gate.set()  # the first recovery goes on; the operator's drain waits for it
        answer = await drain
        assert answer.message == "incident 2: recovered"
        status = await state_of(handle)
        first, second = status.incidents
        assert (first.fault.kind, first.fault.nodes, first.outcome) == ("node_down", ["node-2"], "recovered")
        assert (second.fault.kind, second.fault.nodes, second.outcome) == ("operator", ["node-1"], "recovered")
        assert second.stages["drain"].started_at >= first.stages["resume"].ended_at
        assert status.assignment.nodes == ["node-0", "node-5", "node-4", "node-3"]
        assert stages.names().count("drain") == 2


async def test_return_node_refills_the_pool_and_wakes_a_waiting_run(dev_env):
    gate = asyncio.Event()
    stages = FakeStages(watch=[fault(nodes=["node-2"]), "block", "done"], spares=(), return_gate=gate)
    spec = make_spec(min_dp=4, capacity_wait_seconds=600, capacity_poll_seconds=300)
    async with running(dev_env, stages, spec) as handle:
        assert "node-0 is not quarantined by this run (quarantined: none)" in await refused(
            handle, TrainingRun.return_node, controls.ReturnNodeRequest(node="node-0")
        )
        await until_state(handle, RunState.WAITING_FOR_CAPACITY)
        returning = asyncio.ensure_future(
            handle.execute_update(TrainingRun.return_node, controls.ReturnNodeRequest(node="node-2"))
        )
        while "return_node" not in stages.names():
            await asyncio.sleep(0.01)
        assert "node-2 is already being returned" in await refused(
            handle, TrainingRun.return_node, controls.ReturnNodeRequest(node="node-2")
        )
        gate.set()  # the first return goes on
        answer = await returning
        assert answer.message == "node-2 is a spare again"
        assert stages.names().count("return_node") == 1
        status = await until_state(handle, RunState.TRAINING)
        # Woken at once, not at the next 300 s poll: the returned node took its own place back.
        assert status.incidents[0].decision.replacements == {"node-2": "node-2"}
        assert status.quarantined_nodes == []


async def test_reshard_by_update_and_its_refusals(dev_env):
    stages = FakeStages(watch=["block", "block", "done"])
    async with running(dev_env, stages) as handle:
        await until_state(handle, RunState.TRAINING)
        assert "reshard needs dp between 1 and the spec's layout.dp 4" in await refused(
            handle, TrainingRun.reshard, controls.ReshardRequest(dp=9)
        )
        assert "already trains with dp=4" in await refused(handle, TrainingRun.reshard, controls.ReshardRequest(dp=4))
        answer = await handle.execute_update(TrainingRun.reshard, controls.ReshardRequest(dp=2))
        assert answer.message == "operator: reshard dp 4 -> 2; node-2, node-3 back to the spare pool"
        status = await state_of(handle)
        assert status.layout.dp == 2 and status.assignment.nodes == ["node-0", "node-1"]
        assert stages.nodes["node-2"] == "spare"


async def test_approve_refused_when_nothing_waits_and_set_policy(dev_env):
    stages = FakeStages(watch=["block", "done"])
    async with running(dev_env, stages) as handle:
        await until_state(handle, RunState.TRAINING)
        assert "nothing is waiting for approval; the run is TRAINING" in await refused(
            handle, TrainingRun.approve, controls.ApproveRequest(action="wait_longer")
        )
        message = await refused(
            handle, TrainingRun.set_policy, controls.SetPolicyRequest(changes={"hang_after_seconds": -5})
        )
        assert "recovery.hang_after_seconds: Input should be greater than 0" in message
        assert "needs changes" in await refused(handle, TrainingRun.set_policy, controls.SetPolicyRequest())
        await handle.execute_update(
            TrainingRun.set_policy,
            controls.SetPolicyRequest(changes={"hang_after_seconds": 90, "stages": {"drain": {"max_attempts": 9}}}),
        )
        status = await state_of(handle)
        assert status.policy.hang_after_seconds == 90 and status.policy.stages.drain.max_attempts == 9
        assert status.policy.stages.drain.timeout_seconds == 60  # untouched fields keep their values
        assert status.interventions[-1].kind == "set_policy"


async def test_search_attributes_follow_the_runs_state(dev_env):
    from lazarus.client.config import Settings
    from lazarus.client.runs import start_run

    stages = FakeStages(watch=[fault(), "done"])
    queue, run_id = f"sa-{uuid.uuid4()}", f"sa-{uuid.uuid4().hex[:8]}"
    async with queue_workers(dev_env.client, queue, stages.all(), workflows=[TrainingRun]):
        handle = await start_run(dev_env.client, Settings(task_queue=queue), make_spec(), run_id)
        await handle.result()

    async def listed() -> list[str]:
        query = "WorkflowType='TrainingRun' AND LazarusState='COMPLETED' AND LazarusIncidents=1"
        return [w.id async for w in dev_env.client.list_workflows(query)]

    for _ in range(500):  # visibility catches up with the history shortly after
        if run_id in await listed():
            break
        await asyncio.sleep(0.02)
    assert await listed() == [run_id]


@workflow.defn(name="BrokenTrainingRun", sandboxed=False)
class BrokenTrainingRun(TrainingRun):
    """TrainingRun with a bug: it trains without launching (PENDING -> TRAINING)."""

    @workflow.init
    def __init__(self, start: RunStart) -> None:
        super().__init__(start)

    @workflow.run
    async def run(self, start: RunStart) -> RunStatus:
        return await super().run(start)

    async def _launch(self) -> None:
        self._enter(RunState.TRAINING)


async def test_a_transition_the_table_forbids_stalls_the_workflow_task_instead_of_failing_the_run(dev_env):
    # On a dev server of its own: the shared time-skipping server stops skipping time after a failed workflow task.
    queue = f"wf-{uuid.uuid4()}"
    async with Worker(dev_env.client, task_queue=queue, workflows=[BrokenTrainingRun]):
        handle = await dev_env.client.start_workflow(
            BrokenTrainingRun.run,
            RunStart(spec=make_spec()),
            id=f"broken-{uuid.uuid4()}",
            task_queue=queue,
        )
        failures: list[str] = []
        while not failures:
            history = await handle.fetch_history()
            failures = [
                e.workflow_task_failed_event_attributes.failure.message
                for e in history.events
                if e.HasField("workflow_task_failed_event_attributes")
            ]
            await asyncio.sleep(0.05)
        assert "a run may not go from PENDING to TRAINING" in failures[0]
        assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING  # a fixed worker can go on
        await handle.terminate("test over")
