"""Pipeline replicas, resharding that keeps the math, and checkpoints that are never half-used."""

from __future__ import annotations

import json
import uuid

import pytest

from lazarus.config import Settings
from lazarus.demo import drive_run
from lazarus.infra.local import LocalCluster
from lazarus.schema import RunSpec, RunState, RunStatus, load_spec, parse_spec
from lazarus.schema.contract import read_metrics
from lazarus.schema.rundir import RunDir
from lazarus.worker import build_worker
from tests.support.runs import SMALL_PP_SPEC, SMALL_SPEC, assert_restored_from_survivors, losses

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def with_changes(path, **sections) -> RunSpec:
    """The spec at `path` with some sections' fields replaced."""
    data = load_spec(path).model_dump(mode="json")
    for section, fields in sections.items():
        if isinstance(fields, dict):
            data[section].update(fields)
        else:
            data[section] = fields
    return parse_spec(data)


async def run_to_end(dev_env, home, spec: RunSpec, kill_at: int | None) -> tuple[RunStatus, RunDir]:
    """Run a spec on the dev server with an in-process worker; kill the middle node at `kill_at`."""
    settings = Settings(task_queue=f"e2e-{uuid.uuid4().hex[:8]}", home=home)
    cluster = LocalCluster(home)
    run_id = f"{spec.name}-{uuid.uuid4().hex[:6]}"
    async with build_worker(dev_env.client, settings.task_queue, cluster):
        status = await drive_run(dev_env.client, settings, cluster, spec, run_id, kill_at, say=lambda _: None)
    assert cluster.live_pids(run_id) == []
    return status, cluster.run_dir(run_id)


def consumed_samples(run: RunDir) -> dict[int, list[tuple[int, int]]]:
    """step -> sample ranges trained in it, taking each step from the last incarnation that trained it."""
    by_step: dict[int, tuple[int, list]] = {}
    for incarnation in run.incarnations():
        for path in sorted((run.incarnation(incarnation) / "samples").glob("*.jsonl")):
            for line in path.read_text().splitlines():
                row = json.loads(line)
                seen_in, ranges = by_step.get(row["step"], (-1, []))
                if incarnation > seen_in:
                    seen_in, ranges = incarnation, []
                ranges.append((row["start"], row["stop"]))
                by_step[row["step"]] = (seen_in, ranges)
    return {step: ranges for step, (_, ranges) in by_step.items()}


def assert_every_sample_once(run: RunDir, spec: RunSpec) -> None:
    consumed = consumed_samples(run)
    assert sorted(consumed) == list(range(1, spec.trainer.steps + 1))
    ids = sorted(i for ranges in consumed.values() for start, stop in ranges for i in range(start, stop))
    assert ids == list(range(spec.trainer.steps * spec.trainer.global_batch))


async def test_dp2_pp2_hot_spare_replaces_the_dead_node_with_identical_losses(dev_env, home, reference):
    spec = load_spec(SMALL_PP_SPEC)
    status, run = await run_to_end(dev_env, home, spec, kill_at=15)

    assert status.state == RunState.COMPLETED
    [incident] = status.incidents
    assert incident.fault.nodes == ["node-2"] and incident.decision.action == "replace"
    assert incident.decision.lost_replicas == [1] and not incident.decision.below_target_dp
    assert incident.new_assignment.nodes == ["node-0", "node-1", "node-4", "node-3"]
    assert incident.new_assignment.layout == spec.layout
    # Replica 0 outlived the fault whole: its ranks saved the interrupted step for both stages.
    assert_restored_from_survivors(run, incident)
    expected = reference(SMALL_PP_SPEC)
    resumed = losses(run, incarnation=1)
    assert sorted(resumed) == list(range(incident.resumed_from_step + 1, spec.trainer.steps + 1))
    assert {s: loss for s, loss in resumed.items() if loss != expected[s]} == {}
    assert_every_sample_once(run, spec)


@pytest.mark.parametrize(
    "spec_path, new_dp, nodes, released",
    [
        (SMALL_PP_SPEC, 1, ["node-0", "node-1"], ["node-3"]),
        (SMALL_SPEC, 3, ["node-0", "node-1", "node-3"], []),
    ],
    ids=["dp2xpp2-to-dp1", "dp4-to-dp3"],
)
async def test_without_a_spare_the_run_reshards_and_keeps_the_math(
    dev_env, home, reference, spec_path, new_dp, nodes, released
):
    spec = with_changes(spec_path, cluster={"spare_nodes": 0})
    status, run = await run_to_end(dev_env, home, spec, kill_at=15)

    assert status.state == RunState.COMPLETED and status.layout.dp == new_dp
    [incident] = status.incidents
    decision = incident.decision
    assert decision.action == "reshard" and decision.below_target_dp
    assert decision.lost_replicas == [1 if spec.layout.pp == 2 else 2]
    assert decision.nodes == nodes and decision.released_nodes == released
    assert incident.old_assignment.layout.dp == spec.layout.dp and incident.new_assignment.layout.dp == new_dp
    inventory = LocalCluster(home).inventory(status.run_id)
    assert all(inventory.node(n).role == "spare" for n in released)
    assert inventory.node("node-2").role == "quarantined"
    assert_restored_from_survivors(run, incident)

    assert_every_sample_once(run, spec)
    expected = reference(spec_path)
    resumed = losses(run, incarnation=1)
    assert sorted(resumed) == list(range(incident.resumed_from_step + 1, spec.trainer.steps + 1))
    assert {m.dp for m in read_metrics(run) if m.incarnation == 1} == {new_dp}
    worst = max(abs(loss - expected[s]) / abs(expected[s]) for s, loss in resumed.items())
    assert worst < 1e-4, f"largest relative loss difference after the reshard: {worst:.2e}"


async def test_node_killed_during_an_async_save_never_loads_the_half_written_checkpoint(
    dev_env, home, reference_losses
):
    spec = with_changes(SMALL_SPEC, faults=[{"node": "node-1", "step": 20, "point": "checkpoint"}])
    status, run = await run_to_end(dev_env, home, spec, kill_at=None)

    assert status.state == RunState.COMPLETED
    [incident] = status.incidents
    assert incident.fault.kind == "rank_exit" and incident.fault.nodes == ["node-1"]
    # Drain found the step-20 save in flight, gave it its grace, and deleted it half-written; the
    # survivors had saved step 20 themselves when the save's collective broke.
    assert incident.checkpoint_in_flight == 20 and incident.discarded_checkpoints == [20]
    assert incident.restored_from == "survivors" and incident.resumed_from_step == 20
    assert (incident.fault.step, incident.lost_steps) == (20, 0)
    resumed = losses(run, incarnation=1)
    assert sorted(resumed) == list(range(21, spec.trainer.steps + 1))
    assert {s: loss for s, loss in resumed.items() if loss != reference_losses[s]} == {}
    # The step-20 save of the dead incarnation never committed; incarnation 1 wrote its own.
    marker = json.loads((run.checkpoint(60) / "COMMITTED").read_text())
    assert marker["incarnation"] == 1
    assert_every_sample_once(run, spec)


async def test_a_second_node_lost_while_the_survivors_save_falls_back_to_the_checkpoint(dev_env, home, reference):
    # node-2 (replica 1, stage 0) dies before step 15; node-0 (replica 0, stage 0) dies while it
    # saves step 14 as a survivor: no survivor holds stage 0's state, so step 10's checkpoint it is.
    faults = [{"node": "node-2", "step": 15}, {"node": "node-0", "step": 14, "point": "survivor_save"}]
    spec = with_changes(SMALL_PP_SPEC, faults=faults)
    status, run = await run_to_end(dev_env, home, spec, kill_at=None)

    assert status.state == RunState.COMPLETED, status.reason
    [incident] = status.incidents
    assert incident.restored_from == "checkpoint" and incident.resumed_from_step == 10
    assert incident.lost_steps == 4
    # node-0's ranks died with their state half written: a partial file and no manifest.
    assert run.survivor_state(0, 0).with_suffix(".partial").exists() and not run.survivor_manifest(0, 0).exists()
    assert {rank for rank in range(4) if run.survivor_manifest(0, rank).exists()} == {1, 3}
    expected = reference(SMALL_PP_SPEC)
    resumed = losses(run, incarnation=1)
    assert sorted(resumed) == list(range(11, spec.trainer.steps + 1))
    # A hot spare keeps the layout and the losses bit for bit; should both nodes have been
    # blamed, the run reshards and keeps them within 1e-4.
    tolerance = 0.0 if incident.decision.action == "replace" else 1e-4
    worst = max(abs(loss - expected[s]) / abs(expected[s]) for s, loss in resumed.items())
    assert worst <= tolerance, f"relative difference {worst:.2e} after {incident.decision.action}"
