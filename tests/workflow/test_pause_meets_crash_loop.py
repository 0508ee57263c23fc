"""A pause that reaches the workflow in the same workflow task as the crash-loop verdict that pauses
the run itself (recovery.crash_loop: pause): the pause finds the run paused and says so; the
workflow task does not fail over it."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import UpdateWorkflowExecutionLifecycleStage
from temporalio.api.update.v1 import UpdateRef, WaitPolicy
from temporalio.api.workflowservice.v1 import PollWorkflowExecutionUpdateRequest
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import Worker

from lazarus.schema import RunStart, RunState, controls
from lazarus.worker import queue_workers
from lazarus.workflows.training_run import TrainingRun
from tests.workflow.fakes import FakeStages, make_spec
from tests.workflow.test_program_errors import rank_error

pytestmark = pytest.mark.timeout(120)


async def admitted(client, workflow_id: str, update_id: str) -> None:
    """Return once the server holds the update (admitted), before any worker has seen it."""
    stage = UpdateWorkflowExecutionLifecycleStage.UPDATE_WORKFLOW_EXECUTION_LIFECYCLE_STAGE_ADMITTED
    request = PollWorkflowExecutionUpdateRequest(
        namespace=client.namespace,
        update_ref=UpdateRef(workflow_execution=WorkflowExecution(workflow_id=workflow_id), update_id=update_id),
        wait_policy=WaitPolicy(lifecycle_stage=stage),
    )
    while True:
        try:
            await client.workflow_service.poll_workflow_execution_update(request)
            return
        except RPCError as error:
            if error.status != RPCStatusCode.NOT_FOUND:
                raise
        await asyncio.sleep(0.05)  # the caller's request has not reached the server yet


async def test_a_pause_delivered_with_the_crash_loop_verdict_finds_the_run_paused(dev_env):
    # The restart in place trains, then fails the same way: the crash loop, which pauses the run.
    stages = FakeStages(watch=[5, rank_error(), "gate", rank_error()])
    queue, workflow_id = f"wf-{uuid.uuid4()}", f"run-{uuid.uuid4()}"
    client = dev_env.client

    def workflows() -> Worker:
        """The workflow and its local activities; the watch runs on the other worker and outlives this one."""
        return Worker(
            client, task_queue=queue, workflows=[TrainingRun], activities=stages.all(), no_remote_activities=True
        )

    async with queue_workers(client, queue, stages.all()):  # the activities, the watch on its own queue
        async with workflows():
            handle = await client.start_workflow(
                TrainingRun.run, RunStart(spec=make_spec(crash_loop="pause")), id=workflow_id, task_queue=queue
            )
            while stages.names().count("detect") < 3:  # the restart's watch waits at the gate
                await asyncio.sleep(0.05)
        # No workflow worker now: the watch's verdict and the pause wait for the same workflow task.
        stages.detect_gate.set()
        while (await handle.describe()).raw_description.pending_activities:  # the verdict is in the history
            await asyncio.sleep(0.05)
        pause = asyncio.create_task(
            handle.execute_update(TrainingRun.pause, controls.PauseRequest(reason="look at it"), id="pause-1")
        )
        await admitted(client, workflow_id, "pause-1")
        async with workflows():
            answer = await asyncio.wait_for(pause, 60)
            status = await handle.query(TrainingRun.status)
            assert status.state == RunState.PAUSED and "crash loop" in status.reason
            # The watch's verdict was not dropped for the pause: the crash loop paused the run, and the
            # pause, carried out after it, says so.
            assert answer.message.startswith("the run was paused already: crash loop, paused for an operator")
            assert answer.state == RunState.PAUSED.value
            await handle.execute_update(TrainingRun.abort, controls.AbortRequest(reason="fixing the script"))
            final = await handle.result()
    assert final.state == RunState.ABORTED
    assert stages.names().count("resume") == 1 and stages.names().count("stop") == 0
