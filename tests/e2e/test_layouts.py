"""Layouts beyond DDP: the built-in trainer and a user's FSDP2 + tensor-parallel script take their
device mesh from Lazarus; a hot spare that takes a lost node's mesh coordinates keeps the losses
bit for bit, and a reshard to fewer replicas keeps them within 1e-4."""

from __future__ import annotations

import uuid

import pytest

from lazarus.client.config import Settings
from lazarus.commands.demo_run import drive_run
from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.schema import STAGES, RunState, load_spec
from lazarus.schema.rundir import RunDir
from lazarus.worker import build_worker
from tests.support.runs import REPO, SPECS, assert_restored_from_survivors, losses, with_absolute_command
from tests.support.workers import demo_json, lazarus_env

HSDP_TP_SPEC = SPECS / "hsdp-tp.yaml"
HSDP_TP_EXAMPLE = REPO / "examples" / "hsdp-tp.yaml"
PP_FSDP_TP_SPEC = SPECS / "pp-fsdp-tp.yaml"
HSDP_PP_SPEC = SPECS / "hsdp-pp.yaml"

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


async def killed_at_step(dev_env, home, spec_path, step: int = 15):
    """Run the spec with an in-process worker, a node killed at `step`; its final status, spec and run directory."""
    spec = with_absolute_command(load_spec(spec_path))
    settings = Settings(task_queue=f"layouts-{uuid.uuid4().hex[:8]}", home=home)
    cluster = LocalCluster(home)
    run_id = f"{spec.name}-{uuid.uuid4().hex[:6]}"
    async with build_worker(dev_env.client, settings.task_queue, cluster):
        status = await drive_run(dev_env.client, settings, cluster, spec, run_id, kill_at=step, say=lambda _: None)
    return status, spec, cluster.run_dir(run_id)


async def test_hsdp_and_tensor_parallel_without_a_spare_reshard_to_one_replica(dev_env, home, reference):
    status, spec, run = await killed_at_step(dev_env, home, HSDP_TP_SPEC)

    assert status.state == RunState.COMPLETED and status.step == 40, status.reason
    [incident] = status.incidents
    # node-2 holds half of replica 1 (its dp_shard 0): the whole replica is lost, node-3 goes back.
    assert incident.fault.nodes == ["node-2"] and incident.decision.action == "reshard"
    assert incident.decision.lost_replicas == [1] and incident.decision.released_nodes == ["node-3"]
    assert status.layout == spec.layout.model_copy(update={"dp": 1})
    resumed = losses(run, incarnation=1)
    assert sorted(resumed) == list(range(incident.resumed_from_step + 1, 41))
    # The example trains the same model on the same data for longer: its first 40 steps are ours.
    expected = reference(HSDP_TP_EXAMPLE)
    # Same global batch, split 2 ways instead of 4: equal up to the order of the float sums.
    worst = max(abs(loss - expected[step]) / abs(expected[step]) for step, loss in resumed.items())
    assert worst < 1e-4, f"relative difference {worst:.2e}"


async def test_the_built_in_trainer_on_four_dimensions_recovers_on_a_hot_spare_bit_for_bit(dev_env, home, reference):
    status, spec, run = await killed_at_step(dev_env, home, PP_FSDP_TP_SPEC, step=12)

    assert status.state == RunState.COMPLETED and status.step == 20, status.reason
    [incident] = status.incidents
    # node-2 holds stage 1's dp_shard 0, both its tp ranks: the spare takes exactly those coordinates.
    assert incident.fault.nodes == ["node-2"] and incident.decision.replacements == {"node-2": "node-4"}
    # dp 1: no replica outlived the fault whole, so the newest periodic checkpoint it is.
    assert status.layout == spec.layout and incident.resumed_from_step in (5, 10, 15)
    assert incident.restored_from == "checkpoint"
    resumed = losses(run, incarnation=1)
    assert sorted(resumed) == list(range(incident.resumed_from_step + 1, 21))
    expected = reference(PP_FSDP_TP_SPEC)
    assert {step: loss for step, loss in resumed.items() if loss != expected[step]} == {}
    assert all(losses(run, incarnation=0)[step] == expected[step] for step in range(1, incident.resumed_from_step + 1))


async def test_the_built_in_trainer_as_hsdp_with_a_pipeline_reshards_to_one_replica(dev_env, home, reference):
    status, spec, run = await killed_at_step(dev_env, home, HSDP_PP_SPEC, step=12)

    assert status.state == RunState.COMPLETED and status.step == 20, status.reason
    [incident] = status.incidents
    # node-2 holds replica 1's first stage: the replica is lost with it, its other node goes back.
    assert incident.fault.nodes == ["node-2"] and incident.decision.action == "reshard"
    assert incident.decision.lost_replicas == [1] and incident.decision.released_nodes == ["node-3"]
    # Replica 0 outlived it whole: its ranks saved the interrupted step for both stages.
    assert status.layout == spec.layout.model_copy(update={"dp": 1})
    assert_restored_from_survivors(run, incident)
    resumed = losses(run, incarnation=1)
    assert sorted(resumed) == list(range(incident.resumed_from_step + 1, 21))
    expected = reference(HSDP_PP_SPEC)
    # The same global batch over 2 data-parallel ranks instead of 4: equal up to the order of float sums.
    worst = max(abs(loss - expected[step]) / abs(expected[step]) for step, loss in resumed.items())
    assert worst < 1e-4, f"relative difference {worst:.2e}"


def test_the_hsdp_example_runs_as_the_demo_with_a_recovery(dev_env, home, reference):
    """`lazarus demo --spec examples/hsdp-tp.yaml`: 8 ranks on 4 nodes, a node killed mid-run, the spare
    takes its coordinates; the stage table comes with the final status, the losses with the run."""
    env = lazarus_env(dev_env, home, f"demo-{uuid.uuid4().hex[:6]}")
    final = demo_json(env, "--spec", "examples/hsdp-tp.yaml", cwd=REPO)
    assert final["state"] == "COMPLETED" and final["step"] == 60
    [incident] = final["incidents"]
    assert incident["outcome"] == "recovered" and incident["decision"]["action"] == "replace"
    assert incident["mttr_seconds"] > 0 and set(incident["stages"]) == set(STAGES)
    run = RunDir(final["run_dir"])
    resumed = losses(run, incarnation=1)
    expected = reference(HSDP_TP_EXAMPLE)
    assert sorted(resumed) == list(range(incident["resumed_from_step"] + 1, 61))
    assert {step: loss for step, loss in resumed.items() if loss != expected[step]} == {}
