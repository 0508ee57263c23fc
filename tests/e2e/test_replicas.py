"""Resharding that keeps the math and trains every sample once.

A node lost on a pipeline with a hot spare, in an async save, or a second one while the survivors
save run in the chaos matrix (bench/chaos.py: node-killed, node-in-async-save,
second-node-in-survivor-save, on tests/specs/small-pp.yaml as on any spec); their mechanisms'
fast tests are tests/unit/test_survivor_source.py, test_local_backend.py and the workflow's."""

from __future__ import annotations

import json
import uuid

import pytest

from lazarus.client.config import Settings
from lazarus.commands.demo_run import drive_run
from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.schema import RunSpec, RunState, RunStatus, load_spec, parse_spec
from lazarus.schema.contract import read_metrics
from lazarus.schema.rundir import RunDir
from lazarus.worker import build_worker
from tests.support.runs import SMALL_SPEC, assert_restored_from_survivors, losses

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


async def test_without_a_spare_the_run_reshards_and_keeps_the_math(dev_env, home, reference):
    # A pipeline's reshard to one replica is tests/e2e/test_layouts.py's (hsdp-pp).
    spec = with_changes(SMALL_SPEC, cluster={"spare_nodes": 0})
    status, run = await run_to_end(dev_env, home, spec, kill_at=15)

    assert status.state == RunState.COMPLETED and status.layout.dp == 3
    [incident] = status.incidents
    decision = incident.decision
    assert decision.action == "reshard" and decision.below_target_dp
    assert decision.lost_replicas == [2] and decision.released_nodes == []
    assert decision.nodes == ["node-0", "node-1", "node-3"]
    assert incident.old_assignment.layout.dp == 4 and incident.new_assignment.layout.dp == 3
    assert LocalCluster(home).inventory(status.run_id).node("node-2").role == "quarantined"
    assert_restored_from_survivors(run, incident)

    assert_every_sample_once(run, spec)
    expected = reference(SMALL_SPEC)
    resumed = losses(run, incarnation=1)
    assert sorted(resumed) == list(range(incident.resumed_from_step + 1, spec.trainer.steps + 1))
    assert {m.dp for m in read_metrics(run) if m.incarnation == 1} == {3}
    worst = max(abs(loss - expected[s]) / abs(expected[s]) for s, loss in resumed.items())
    assert worst < 1e-4, f"largest relative loss difference after the reshard: {worst:.2e}"
