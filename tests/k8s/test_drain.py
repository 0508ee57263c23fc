"""Drain on Kubernetes waits for the API server to remove the incarnation's pods; when that takes
longer than the activity's heartbeat timeout, the activity keeps heartbeating and succeeds on its
first attempt instead of being taken for a lost worker."""

from __future__ import annotations

import uuid
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.worker import Worker

from lazarus.activities.recovery import RecoveryActivities
from lazarus.infra.backends.kubernetes.objects import RUN_LABEL
from lazarus.schema.stages import DrainInput, DrainResult
from tests.support.backends import every_rank_training

HEARTBEAT_TIMEOUT_SECONDS = 1.0
POD_CONFIRMATION_SECONDS = 3.0
"""How long the live node's kubelet takes to confirm its pod's deletion: past the heartbeat timeout."""


@workflow.defn(name="DrainOnce", sandboxed=False)
class DrainOnce:
    """Run the drain activity once: one attempt, a short heartbeat timeout."""

    @workflow.run
    async def run(self, request: DrainInput) -> DrainResult:
        return await workflow.execute_activity(
            "drain",
            request,
            result_type=DrainResult,
            start_to_close_timeout=timedelta(seconds=60),
            heartbeat_timeout=timedelta(seconds=HEARTBEAT_TIMEOUT_SECONDS),
            retry_policy=RetryPolicy(maximum_attempts=1),
        )


async def test_a_drain_that_outlasts_its_heartbeat_timeout_heartbeats_and_succeeds(dev_env, kubernetes_backend, admin):
    harness = kubernetes_backend
    harness.kubelet.confirm_after = POD_CONFIRMATION_SECONDS
    harness.launch("r1")
    every_rank_training(harness, "r1")
    stages = RecoveryActivities(harness.cluster)
    lost = harness.active[1]
    request = DrainInput(run_id="r1", incarnation=0, nodes=[lost], reason="test: node_down", save_grace_seconds=0)
    queue = f"drain-{uuid.uuid4()}"
    async with Worker(dev_env.client, task_queue=queue, workflows=[DrainOnce], activities=[stages.drain]):
        result = await dev_env.client.execute_workflow(DrainOnce.run, request, id=queue, task_queue=queue)
    assert result.quarantined == [lost] and result.stopped_ranks == [0, 1]
    assert admin.list_namespaced_pod("lz", label_selector=f"{RUN_LABEL}=r1").items == []
    [drain] = [span for span in stages.metrics.spans if span.stage == "drain"]
    # The healthy node's pod went only once its kubelet confirmed, after the heartbeat timeout.
    assert drain.attempt == 1 and drain.ended - drain.started > HEARTBEAT_TIMEOUT_SECONDS
