"""One run, one owner, on the real dev server and real trainer processes: a second workflow for a
run, a workflow reset to before the run's recovery and before its launch, a terminated workflow
whose run is adopted. Each time the run trains on as if nothing had happened: the same
incarnations, the same spare, every step trained once by one incarnation, the losses of the run
without a fault."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Callable

import pytest
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.api.workflowservice.v1 import ResetWorkflowExecutionRequest
from temporalio.client import Client, WorkflowFailureError
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError

from lazarus.client.history import local_activity_type
from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.schema import RunStart, RunState, RunStatus, load_spec
from lazarus.schema.contract import read_metrics
from lazarus.schema.rundir import RunDir
from lazarus.worker import build_worker
from lazarus.workflows.training_run import TrainingRun
from tests.support.runs import SMALL_SPEC, losses, trained_step
from tests.support.waiting import wait_until
from tests.support.workers import lazarus_env

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

LONG_STEPS = 200
"""The small spec trained longer: long enough to reset or terminate its workflow and act again
while the ranks train (about 0.05 s a step here, 10 s in all)."""

SPARE_FOR_NODE_2 = ["node-0", "node-1", "node-4", "node-3"]


@pytest.fixture(scope="module")
def long_spec(tmp_path_factory):
    path = tmp_path_factory.mktemp("specs") / "small-long.yaml"
    path.write_text(SMALL_SPEC.read_text().replace("steps: 40", f"steps: {LONG_STEPS}"))
    return path


def scheduled(activity: str) -> Callable[[HistoryEvent], bool]:
    """The event that starts `activity`: its scheduling, or a local activity's marker (drain is one)."""

    def test(event: HistoryEvent) -> bool:
        return local_activity_type(event) == activity or (
            event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
            and event.activity_task_scheduled_event_attributes.activity_type.name == activity
        )

    return test


async def reset_before(client: Client, workflow_id: str, first: Callable[[HistoryEvent], bool]) -> str:
    """Reset the workflow, as the web UI's Reset does, to the workflow task that scheduled the first
    event `first` matches: that task and all after it are done again. Returns the new execution."""
    events = list((await client.get_workflow_handle(workflow_id).fetch_history()).events)
    index = next(i for i, event in enumerate(events) if first(event))
    point = max(e.event_id for e in events[:index] if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED)
    request = ResetWorkflowExecutionRequest(
        namespace=client.namespace,
        workflow_execution=WorkflowExecution(workflow_id=workflow_id),
        reason="test: an operator's reset",
        workflow_task_finish_event_id=point,
        request_id=str(uuid.uuid4()),
    )
    return (await client.workflow_service.reset_workflow_execution(request)).run_id


def assert_trained_like_the_unfaulted_run(run: RunDir, reference: dict[int, float], incarnations: list[int]) -> None:
    """The run had exactly these incarnations, each step's loss was logged once per incarnation that
    trained it (no rank started twice), and every loss is the unfaulted run's, bit for bit."""
    assert run.incarnations() == incarnations
    logged = Counter((m.incarnation, m.step) for m in read_metrics(run))
    assert [key for key, count in logged.items() if count > 1] == []
    for incarnation in incarnations:
        trained = losses(run, incarnation)
        assert trained and {s: loss for s, loss in trained.items() if loss != reference[s]} == {}
    assert max(losses(run)) == max(reference)


async def wait_for_status(handle, condition: Callable[[RunStatus], bool], what: str, timeout: float = 60.0) -> None:
    """Query the run's status until `condition` holds; fail naming `what` after `timeout` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition(await handle.query(TrainingRun.status)):
        assert asyncio.get_running_loop().time() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        await asyncio.sleep(0.1)


def taken_over(kind: str) -> Callable[[RunStatus], bool]:
    """The run was taken over (`kind`: reset or adopt) and trains again."""
    return lambda status: (
        status.state == RunState.TRAINING
        and any(i.kind == kind and i.done_at is not None for i in status.interventions)
    )


async def test_one_run_is_driven_by_one_workflow(dev_env, home, reference_losses):
    """Through the plain Temporal client: a second workflow naming the run fails at once with the
    reason, a second start of the same id is refused by Temporal; a node killed gives one incident
    in one history; once the run is done, neither a new workflow under its id nor one under a new id
    naming it changes anything."""
    client, spec = dev_env.client, load_spec(SMALL_SPEC)
    queue, run_id = f"own-{uuid.uuid4().hex[:6]}", f"own-{uuid.uuid4().hex[:6]}"
    cluster = LocalCluster(home)
    run = cluster.run_dir(run_id)

    async def refused(workflow_id: str, start: RunStart) -> ApplicationError:
        handle = await client.start_workflow(TrainingRun.run, start, id=workflow_id, task_queue=queue)
        with pytest.raises(WorkflowFailureError) as failed:
            await asyncio.wait_for(handle.result(), 60)
        assert isinstance(failed.value.cause, ApplicationError) and failed.value.cause.non_retryable
        return failed.value.cause

    async with build_worker(client, queue, cluster):
        handle = await client.start_workflow(TrainingRun.run, RunStart(spec=spec), id=run_id, task_queue=queue)
        other = await refused(f"{run_id}-b", RunStart(run_id=run_id, spec=spec))
        assert (
            other.type == "InvalidInput" and f"run_id {run_id!r} is not the workflow id '{run_id}-b'" in other.message
        )
        with pytest.raises(WorkflowAlreadyStartedError):
            await client.start_workflow(TrainingRun.run, RunStart(spec=spec), id=run_id, task_queue=queue)

        await asyncio.to_thread(wait_until, lambda: trained_step(run) >= 12, "step 12", 120)
        cluster.kill_node(run_id, "node-2")
        final = await handle.result()
        assert final.state == RunState.COMPLETED and final.step == 40
        [incident] = final.incidents
        assert incident.outcome == "recovered" and incident.new_assignment.nodes == SPARE_FOR_NODE_2
        events = (await client.get_workflow_handle(f"{run_id}-b").fetch_history()).events
        assert not any(event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED for event in events)
        assert_trained_like_the_unfaulted_run(run, reference_losses, [0, 1])
        metrics_before = run.metrics_file.read_bytes()

        again = await refused(run_id, RunStart(spec=spec))  # Temporal lets a closed workflow's id be used again
        assert again.type == "RunFailed"
        assert f"run {run_id!r} belongs to an earlier workflow of this id" in again.message
        assert f"adopt it: lazarus run adopt {run_id}" in again.message
        renamed = await refused(f"{run_id}-new", RunStart(run_id=run_id, spec=spec))
        assert renamed.type == "InvalidInput"

    assert run.incarnations() == [0, 1] and run.metrics_file.read_bytes() == metrics_before
    assert cluster.owners.read(run_id).owner.workflow_id == run_id and cluster.owners.read(run_id).handovers == []
    assert cluster.live_pids(run_id) == []


async def test_a_reset_before_the_recovery_and_before_the_launch_takes_up_the_run(dev_env, home, reference, long_spec):
    """The web UI's Reset, twice on a recovered run while it trains: to before its recovery, then to
    before its launch. Each new execution takes the run over and watches the incarnation the
    cluster holds; nothing is launched, drained or claimed again."""
    client, spec = dev_env.client, load_spec(long_spec)
    queue, run_id = f"reset-{uuid.uuid4().hex[:6]}", f"reset-{uuid.uuid4().hex[:6]}"
    cluster = LocalCluster(home)
    run = cluster.run_dir(run_id)
    async with build_worker(client, queue, cluster):
        handle = await client.start_workflow(TrainingRun.run, RunStart(spec=spec), id=run_id, task_queue=queue)
        await asyncio.to_thread(wait_until, lambda: trained_step(run) >= 12, "step 12", 120)
        cluster.kill_node(run_id, "node-2")
        await wait_for_status(handle, lambda s: [i.outcome for i in s.incidents] == ["recovered"], "the recovery")

        executions = [await reset_before(client, run_id, scheduled("drain"))]
        await wait_for_status(client.get_workflow_handle(run_id), taken_over("reset"), "the take-over")
        reached = trained_step(run)
        await asyncio.to_thread(wait_until, lambda: trained_step(run) >= reached + 5, "training after a reset", 60)
        executions.append(await reset_before(client, run_id, scheduled("launch")))
        final = await client.get_workflow_handle(run_id, result_type=RunStatus).result()

    assert final.state == RunState.COMPLETED and final.step == LONG_STEPS
    assert final.assignment.incarnation == 1 and final.assignment.nodes == SPARE_FOR_NODE_2
    # The last reset went back before the launch: this execution saw no incident, and took the run over.
    assert final.incidents == []
    [taken] = [i for i in final.interventions if i.kind == "reset"]
    assert "incarnation 1 is training: watching it" in taken.outcome
    handovers = cluster.owners.read(run_id).handovers
    assert [(h.kind, h.to_execution) for h in handovers] == [("reset", e) for e in executions]
    assert_trained_like_the_unfaulted_run(run, reference(long_spec), [0, 1])
    pool = {node.name: node for node in cluster.inventory(run_id).nodes}
    assert pool["node-2"].role == "quarantined"  # quarantined once, by the recovery before the resets
    assert cluster.live_pids(run_id) == []


async def test_a_terminated_workflow_s_run_is_adopted_and_recovers(dev_env, home, reference, long_spec):
    """A workflow terminated by mistake leaves its ranks training; `lazarus run adopt` starts a
    workflow that takes the run over, recovers it from a node killed afterwards, and completes it."""
    client, spec = dev_env.client, load_spec(long_spec)
    queue, run_id = f"adopt-{uuid.uuid4().hex[:6]}", f"adopt-{uuid.uuid4().hex[:6]}"
    cluster = LocalCluster(home)
    run = cluster.run_dir(run_id)
    env = lazarus_env(dev_env, home, queue)

    def lazarus(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "lazarus.cli", *args]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)

    async with build_worker(client, queue, cluster):
        handle = await client.start_workflow(TrainingRun.run, RunStart(spec=spec), id=run_id, task_queue=queue)
        await asyncio.to_thread(wait_until, lambda: trained_step(run) >= 12, "step 12", 120)
        refused = await asyncio.to_thread(lazarus, "run", "adopt", run_id)
        assert refused.returncode == 2 and "its workflow still drives it" in refused.stderr

        await handle.terminate("by mistake")
        reached = trained_step(run)
        await asyncio.to_thread(wait_until, lambda: trained_step(run) >= reached + 3, "ranks training on", 60)
        # What the operator reads first: the terminated run, replayed by the CLI, still training.
        shown = await asyncio.to_thread(lazarus, "run", "status", run_id, "--json")
        assert shown.returncode == 0, shown.stderr
        before = json.loads(shown.stdout)
        assert before["state"] == "TRAINING" and "the run is terminated" in before["read_from"]
        adopted = await asyncio.to_thread(lazarus, "run", "adopt", run_id)
        assert adopted.returncode == 0, adopted.stderr
        assert f"adopted run {run_id} (it was TRAINING" in adopted.stdout

        handle = client.get_workflow_handle(run_id, result_type=RunStatus)
        await wait_for_status(handle, taken_over("adopt"), "the adoption")
        cluster.kill_node(run_id, "node-2")
        final = await handle.result()

    assert final.state == RunState.COMPLETED and final.step == LONG_STEPS and final.segments == 2
    [adoption] = [i for i in final.interventions if i.kind == "adopt"]
    assert "incarnation 0 is training: watching it" in adoption.outcome
    [incident] = final.incidents
    assert incident.outcome == "recovered" and incident.new_assignment.nodes == SPARE_FOR_NODE_2
    [handover] = cluster.owners.read(run_id).handovers
    assert handover.kind == "adopt" and cluster.owners.read(run_id).owner.lineage != handover.from_execution
    assert_trained_like_the_unfaulted_run(run, reference(long_spec), [0, 1])
    assert cluster.live_pids(run_id) == []
