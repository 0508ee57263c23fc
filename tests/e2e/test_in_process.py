"""Recovery inside the surviving processes (recovery.in_process): a node is killed mid-run, the
survivors keep their processes and wait at their step boundary, the spare's new ranks join them in a
new process group and receive the state from a surviving replica in memory. Every layout the
built-in trainer runs keeps its losses bit for bit and loses no step; a survivor that never reaches
the boundary sends the recovery down the restart path, with the math kept as well."""

from __future__ import annotations

import uuid

import pytest

from lazarus.client.config import Settings
from lazarus.commands.demo_run import drive_run
from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.schema import RunState, load_spec, parse_spec
from lazarus.schema.contract import read_heartbeat
from lazarus.schema.files import read_json
from lazarus.worker import build_worker
from tests.support.runs import SMALL_SPEC, SPECS, USER_DDP_SPEC, losses, with_absolute_command

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def in_process(spec_path, faults=(), recovery=None, **trainer):
    """The spec at `spec_path` with recovery.in_process on (and `faults` planned, `recovery` and
    `trainer` fields set)."""
    data = with_absolute_command(load_spec(spec_path)).model_dump(mode="json")
    data["recovery"].update(in_process=True, **(recovery or {}))
    data["faults"] = list(faults)
    data["trainer"].update(trainer)
    return parse_spec(data)


async def killed_at_step(dev_env, home, spec, step: int | None):
    """Run `spec` with an in-process worker, its middle node killed once the run reaches `step` (None:
    only the spec's planned faults); its final status and run directory."""
    settings = Settings(task_queue=f"in-process-{uuid.uuid4().hex[:8]}", home=home)
    cluster = LocalCluster(home)
    run_id = f"{spec.name}-{uuid.uuid4().hex[:6]}"
    async with build_worker(dev_env.client, settings.task_queue, cluster):
        status = await drive_run(dev_env.client, settings, cluster, spec, run_id, kill_at=step, say=lambda _: None)
    return status, cluster.run_dir(run_id)


def why_not_in_process(run, incident) -> str:
    """What an in-process recovery that took the restart path left to say why: the incident's
    stages and fault, whether the controller told the survivors to fall back, and each old rank's
    last heartbeat."""
    old = incident.old_assignment.incarnation
    beats = {rank: read_heartbeat(run, old, rank) for rank in range(incident.old_assignment.layout.world_size)}
    return (
        f"restored from {incident.restored_from}; stages {incident.stages}; fault {incident.fault.reason!r}; "
        f"fall back ordered: {run.fall_back_file(old).exists()}; heartbeats of incarnation {old}: {beats}"
    )


def pids(run, incarnation: int, ranks) -> dict[int, int]:
    return {rank: read_json(run.pid_file(incarnation, rank))["pid"] for rank in ranks}


@pytest.mark.parametrize(
    "spec_path",
    [SMALL_SPEC, SPECS / "small-hsdp.yaml", SPECS / "small-tp.yaml", SPECS / "small-pp.yaml"],
    ids=["dp", "dp_shard", "tp", "pp"],
)
async def test_survivors_keep_their_processes_and_the_losses_bit_for_bit(dev_env, home, reference, spec_path):
    # 20 steps, node-K's ranks killed as they start step 8 (a planned fault: every survivor then breaks in
    # step 8's collectives and holds step 7; a kill at a random moment can leave one a step ahead, which
    # takes the restart path, tested below). The math does not depend on the run's length.
    killed = load_spec(spec_path).layout.nodes // 2
    spec = in_process(spec_path, [{"node": f"node-{killed}", "step": 8}], steps=20)
    status, run = await killed_at_step(dev_env, home, spec, step=None)

    assert status.state == RunState.COMPLETED and status.step == spec.trainer.steps, status.reason
    [incident] = status.incidents
    layout, world = spec.layout, spec.layout.world_size
    assert incident.fault.nodes == [f"node-{killed}"] and incident.decision.action == "replace"
    assert incident.restored_from == "in_process", why_not_in_process(run, incident)
    assert incident.resumed_from_step == 7 and incident.lost_steps == 0
    lost = set(range(killed * layout.ranks_per_node, (killed + 1) * layout.ranks_per_node))
    survivors = [rank for rank in range(world) if rank not in lost]
    # The survivors are the same processes in both incarnations; the lost node's ranks are new ones.
    assert pids(run, 1, survivors) == pids(run, 0, survivors)
    assert set(pids(run, 1, lost).values()).isdisjoint(pids(run, 0, lost).values())
    assert sorted(incident.stalls) == list(range(world)) and all(s > 0 for s in incident.stalls.values())
    # Every step after the fault's boundary is trained once more by incarnation 1, bit for bit.
    expected = reference(spec_path)
    resumed = losses(run, incarnation=1)
    assert sorted(resumed) == list(range(incident.resumed_from_step + 1, spec.trainer.steps + 1))
    assert {step: loss for step, loss in losses(run).items() if loss != expected[step]} == {}


async def test_a_survivor_that_never_reaches_the_boundary_sends_the_recovery_down_the_restart_path(
    dev_env, home, reference
):
    # node-2 dies before step 12; node-1's rank, a survivor, loops forever where it should wait.
    faults = [
        {"node": "node-2", "step": 12},
        {"node": "node-1", "step": 11, "point": "boundary", "effect": "spin"},
    ]
    # Short graces: the spinning rank holds each of them to its end.
    spec = in_process(SMALL_SPEC, faults, recovery={"boundary_grace_seconds": 0.5, "survivor_grace_seconds": 1.0})
    status, run = await killed_at_step(dev_env, home, spec, step=None)

    assert status.state == RunState.COMPLETED and status.step == 40, status.reason
    [incident] = status.incidents
    assert incident.fault.nodes == ["node-2"] and incident.decision.replacements == {"node-2": "node-4"}
    # Drain waited its boundary grace, then the other survivors saved their state and ended.
    assert incident.restored_from == "survivors" and incident.resumed_from_step == 11 and incident.lost_steps == 0
    assert run.fall_back_file(0).exists()
    assert set(pids(run, 1, range(4)).values()).isdisjoint(pids(run, 0, range(4)).values())
    expected = reference(SMALL_SPEC)
    assert {step: loss for step, loss in losses(run).items() if loss != expected[step]} == {}


async def test_a_ddp_script_of_its_own_keeps_its_survivors_through_the_session(dev_env, home, reference):
    # examples/train_ddp.py: session.keep_process where a step breaks, load_survivor_state before DDP.
    spec = in_process(USER_DDP_SPEC, [{"node": "node-2", "step": 60}], survivor_state=True)
    status, run = await killed_at_step(dev_env, home, spec, step=None)

    assert status.state == RunState.COMPLETED and status.step == 100, status.reason
    [incident] = status.incidents
    assert incident.fault.nodes == ["node-2"], incident.fault
    assert incident.restored_from == "in_process", why_not_in_process(run, incident)
    assert incident.lost_steps == 0
    assert pids(run, 1, [0, 1, 3]) == pids(run, 0, [0, 1, 3]) and pids(run, 1, [2]) != pids(run, 0, [2])
    expected = reference(USER_DDP_SPEC)
    assert sorted(losses(run, incarnation=1)) == list(range(incident.resumed_from_step + 1, 101))
    assert {step: loss for step, loss in losses(run).items() if loss != expected[step]} == {}
