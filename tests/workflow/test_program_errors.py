"""A rank's own failure (rank_error) in TrainingRun: restarted in place with no node blamed, and a
crash loop that ends the run (or pauses it) well before recovery.max_incidents."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.client import WorkflowFailureError

from lazarus.schema import RunState, controls
from lazarus.workflows.training_run import TrainingRun
from tests.workflow.fakes import ACTIVE, FakeStages, fault, make_spec, run_workflow

pytestmark = pytest.mark.asyncio(loop_scope="session")


def rank_error(error="FileNotFoundError: [Errno 2] No such file or directory: 'out/checkpoint-40/state.json'", step=15):
    """A rank's own exception on a healthy node, as judge reports it: no node blamed."""
    return fault(nodes=(), step=step).model_copy(
        update={"kind": "rank_error", "rank": 3, "node": "node-3", "exit_code": 1, "error": error, "reason": error}
    )


async def test_a_ranks_own_failure_restarts_in_place_without_blaming_a_node(time_skipping_env):
    stages = FakeStages(watch=[5, rank_error(), 25, "done"])
    status = await run_workflow(time_skipping_env, stages, make_spec())

    assert status.state == RunState.COMPLETED and status.quarantined_nodes == []
    [incident] = status.incidents
    assert incident.fault.kind == "rank_error" and incident.fault.nodes == []
    assert incident.decision.action == "replace" and incident.decision.replacements == {}
    assert "restart in place" in incident.decision.reason
    assert incident.new_assignment.nodes == ACTIVE and incident.new_assignment.incarnation == 1
    assert stages.nodes["node-4"] == "spare"  # the spare was not taken for it


async def test_the_same_failure_after_a_restart_in_place_is_a_crash_loop_that_fails_the_run(time_skipping_env):
    # The node killed mid-save left a half-written folder: every restart crashes on it the same way.
    stages = FakeStages(watch=[5, fault(step=15)], resumes=[rank_error(), rank_error()])
    spec = make_spec(max_incidents=20)
    with pytest.raises(WorkflowFailureError) as failure:
        await run_workflow(time_skipping_env, stages, spec)

    message = failure.value.cause.message
    assert message.startswith("crash loop: the same failure again after a restart in place (incident 2)")
    assert "FileNotFoundError: [Errno 2]" in message
    # Incident 1 replaced the dead node; incident 2 restarted in place; incident 3 is the loop.
    assert stages.names().count("resume") == 2 and stages.names().count("drain") == 3
    assert [n for n, role in stages.nodes.items() if role == "quarantined"] == ["node-2"]


async def test_a_crash_loop_pauses_the_run_where_the_policy_says(time_skipping_env):
    # The restart fails before its first step, with another message: a loop all the same.
    stages = FakeStages(watch=[5, rank_error()], resumes=[rank_error("ValueError: another message")])
    seen = []

    async def abort_once_paused(handle):
        while (status := await handle.query(TrainingRun.status)).state != RunState.PAUSED:
            await asyncio.sleep(0.05)
        seen.append(status)
        await handle.execute_update(TrainingRun.abort, controls.AbortRequest(reason="fixing the script"))

    status = await run_workflow(time_skipping_env, stages, make_spec(crash_loop="pause"), during=abort_once_paused)
    [paused] = seen
    assert paused.failure.error == "ValueError: another message" and paused.quarantined_nodes == []
    assert "crash loop" in paused.reason and "failed again before training a step" in paused.reason
    assert status.state == RunState.ABORTED and stages.names().count("resume") == 1
