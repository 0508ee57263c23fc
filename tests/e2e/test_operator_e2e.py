"""An operator's pause and resume on real trainer processes; metrics and the run's report after a recovery."""

from __future__ import annotations

import asyncio
import urllib.request
import uuid
from datetime import timedelta

import pytest

from lazarus.activities.metrics import Metrics
from lazarus.client.config import Settings
from lazarus.client.runs import start_run
from lazarus.commands.report import plot_timeline, summarize
from lazarus.infra.backend import free_port
from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.schema import RunState, controls, load_spec
from lazarus.worker import build_worker, serve_metrics
from lazarus.workflows.training_run import TrainingRun
from tests.support.runs import SMALL_SPEC, assert_restored_from_survivors, losses, trained_step
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


async def test_pause_resume_then_a_recovery_with_metrics_and_report(dev_env, home, reference_losses, tmp_path):
    small = load_spec(SMALL_SPEC)
    spec = small.model_copy(update={"recovery": small.recovery.model_copy(update={"workflow_task_timeout_seconds": 7})})
    cluster = LocalCluster(home)
    metrics = Metrics()
    port = free_port()
    server = serve_metrics(port, metrics)
    queue = f"op-{uuid.uuid4().hex[:6]}"
    run_id = f"op-{uuid.uuid4().hex[:6]}"
    run = cluster.run_dir(run_id)
    try:
        async with build_worker(dev_env.client, queue, cluster, metrics=metrics):
            handle = await start_run(dev_env.client, Settings(task_queue=queue), spec, run_id)
            # The server holds the run's own workflow task timeout, not Temporal's 10 s.
            config = (await handle.describe()).raw_description.execution_config
            assert config.default_workflow_task_timeout.ToTimedelta() == timedelta(seconds=7)
            await asyncio.to_thread(wait_until, lambda: trained_step(run) >= 12, "step 12", 120)

            paused = await handle.execute_update(TrainingRun.pause, controls.PauseRequest(reason="test"))
            status = await handle.query(TrainingRun.status)
            assert status.state == RunState.PAUSED and paused.state == "PAUSED"
            # The ranks checkpointed the step they stopped at (not a multiple of 10) and exited.
            assert run.newest_checkpoint()[0] == status.step and status.step % 10 != 0
            assert cluster.live_pids(run_id) == []
            await handle.execute_update(TrainingRun.resume, controls.ResumeRequest())

            await asyncio.to_thread(
                wait_until, lambda: trained_step(run) >= status.step + 15, "training after resume", 120
            )
            cluster.kill_node(run_id, "node-2")
            final = await handle.result()
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        server.shutdown()

    assert final.state == RunState.COMPLETED
    assert run.incarnations() == [0, 1, 2]
    [incident] = final.incidents
    assert incident.outcome == "recovered" and incident.new_assignment.incarnation == 2
    # Both restarts resumed exactly: the last incarnation's losses are the unfaulted run's.
    resumed = losses(run, incarnation=2)
    assert {s: loss for s, loss in resumed.items() if loss != reference_losses[s]} == {}
    assert losses(run, incarnation=1)[status.step + 1] == reference_losses[status.step + 1]

    for stage in ("detect", "drain", "reschedule", "replace_or_reshard", "resume", "stop"):
        assert f'lazarus_stage_seconds_count{{stage="{stage}"}}' in body, stage
    assert 'lazarus_stage_seconds_count{stage="resume"} 2.0' in body  # operator's resume and the recovery
    assert 'lazarus_incidents_total{decision="replace",kind="node_down"} 1.0' in body
    # The operator's resume restored a checkpoint; the recovery, what the survivors saved.
    assert_restored_from_survivors(run, incident)
    # The metrics count what the incident says it restored and lost (one step where survivors straddled two).
    checkpoints = 1 + (incident.restored_from == "checkpoint")
    assert f'lazarus_restores_total{{source="checkpoint"}} {checkpoints:.1f}' in body
    if incident.restored_from == "survivors":
        assert 'lazarus_restores_total{source="survivors"} 1.0' in body
    assert f"lazarus_lost_steps_total {float(incident.lost_steps)}" in body

    summary = summarize(final)
    assert 0 < summary["ettr"] < 1 and summary["incidents"] == 1 and summary["lost_steps"] == incident.lost_steps
    assert summary["lost_seconds"]["operator_holds"] > 0
    plot = tmp_path / "timeline.png"
    plot_timeline(final, summary, str(plot))
    assert plot.read_bytes()[:4] == b"\x89PNG"
