"""The simulated backend (infra/backends/simulated/): its nodes report as launchers do, and a look
judges them."""

from __future__ import annotations

import asyncio
import time

import pytest

from lazarus.activities.health import judge
from lazarus.infra.backends.simulated.cluster import SimulatedCluster
from lazarus.schema import Assignment, parse_spec
from lazarus.schema.node_reports import NodeSummary, read_node_reports

SPEC = parse_spec(
    {
        "name": "sim",
        "layout": {"dp": 4, "tp": 8, "ranks_per_node": 8},
        "trainer": {"steps": 1_000_000, "checkpoint_every": 1000, "n_heads": 8},
        "cluster": {"active_nodes": 4, "spare_nodes": 1},
    }
)


@pytest.fixture
def cluster(tmp_path):
    cluster = SimulatedCluster(tmp_path, steps_per_second=50.0, startup_seconds=0.05, report_seconds=0.05)
    yield cluster
    cluster.close()


def training(cluster: SimulatedCluster, run_id: str = "sim"):
    """Create, assign and launch the run; return its first look once every node reports a step."""
    cluster.create(run_id, SPEC)
    nodes = [f"node-{i}" for i in range(4)]
    cluster.commit_assignment(run_id, Assignment(incarnation=0, nodes=nodes, layout=SPEC.layout, master_port=1))
    cluster.start_ranks(run_id, 0, resume_step=0)
    deadline = time.monotonic() + 10
    while True:
        observation = cluster.observe(run_id, 0)
        beats = [r.heartbeat for r in observation.ranks]
        if all(b is not None and b.step for b in beats):
            return observation
        assert time.monotonic() < deadline, "the simulated nodes reported no step within 10 s"
        time.sleep(0.01)


def test_every_node_reports_its_ranks_training(cluster):
    observation = training(cluster)
    assert [r.rank for r in observation.ranks] == list(range(32))
    assert {r.node for r in observation.ranks if r.rank // 8 == 2} == {"node-2"}
    assert observation.launchers_alive == 4 and all(r.alive and r.launcher_alive for r in observation.ranks)
    verdict = judge(observation, SPEC.recovery, time.time(), time.time(), SPEC.trainer.steps)
    assert verdict.fault is None and verdict.up and verdict.step >= 1
    assert cluster.run_dir("sim").node_report_file(0, 3).is_file()


def test_a_simulated_report_s_summary_is_what_its_ranks_sum_up_to(cluster):
    training(cluster)
    readings = read_node_reports(cluster.run_dir("sim"), 0, range(4))
    for index, reading in readings.items():
        summary = reading.summary
        timed = summary.slowest_step, summary.last_step  # what a launcher timed, not in the ranks' files
        assert summary == NodeSummary.of(f"node-{index}", reading.ranks, None, None, *timed)
        assert summary.steady
        # Past its second step a simulated node times every step at the simulated pace.
        if summary.lowest_step > 1:
            assert timed[0] is not None and timed[0].seconds == pytest.approx(1 / 50.0)


def test_a_killed_node_is_judged_down_and_its_ranks_gone(cluster):
    training(cluster)
    cluster.kill_node("sim", "node-1")
    observation = cluster.observe("sim", 0)
    gone = [r for r in observation.ranks if r.node == "node-1"]
    assert len(gone) == 8 and not any(r.alive for r in gone) and observation.launchers_alive == 3
    verdict = judge(observation, SPEC.recovery, time.time(), time.time(), SPEC.trainer.steps)
    assert verdict.fault.kind == "node_down" and verdict.fault.nodes == ["node-1"]
    assert cluster.stop_nodes("sim", 0, ["node-1", "node-2"]) == list(range(16, 24))  # node-1 died already
    assert sorted(cluster.stop_incarnation("sim", 0)) == [r for r in range(32) if r // 8 != 1]
    assert cluster.observe("sim", 0).launchers_alive == 0
    assert cluster.stop_nodes("sim", 0, ["node-2"]) == []


async def test_a_drain_asked_for_the_step_reads_the_newest_one_before_it_stops_the_ranks(cluster):
    from temporalio.testing import ActivityEnvironment

    from lazarus.activities.recovery import RecoveryActivities
    from lazarus.schema.stages import DrainInput

    observation = training(cluster)
    before = max(r.heartbeat.step for r in observation.ranks)
    request = DrainInput(run_id="sim", incarnation=0, nodes=["node-1"], reason="incident 1: operator: test")
    drained = await ActivityEnvironment().run(
        RecoveryActivities(cluster).drain, request.model_copy(update={"read_step": True})
    )
    assert drained.step >= before and drained.stopped_ranks == list(range(32))
    again = await ActivityEnvironment().run(RecoveryActivities(cluster).drain, request)
    assert again.step is None  # not asked: a detected fault carries the step of its own look


def test_a_watch_waiting_between_looks_wakes_when_the_pool_records_its_node_dead(cluster):
    training(cluster)

    async def waits() -> tuple[bool, bool, bool]:
        quiet = await cluster.wait_for_exit("sim", 0, 0.2)  # nothing died: the whole timeout
        waiting = asyncio.ensure_future(cluster.wait_for_exit("sim", 0, 60))
        await asyncio.sleep(0)  # the wait is registered before the death
        await asyncio.to_thread(cluster.kill_node, "sim", "node-2")
        woken = await waiting  # False only after 60 s: the pool's death did not wake it
        # A death just before a wait (after the look that preceded it) wakes it at once too.
        late = await cluster.wait_for_exit("sim", 0, 60)
        return quiet, woken, late

    assert asyncio.run(waits()) == (False, True, True)
