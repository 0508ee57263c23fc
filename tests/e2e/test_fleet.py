"""A fleet on one pool: several runs on the real dev server and worker, with the real activities,
on the simulated backend (infra/backends/simulated/cluster.py: the local pool without processes, each node's
report kept by a simulated launcher, ranks that train from their launch). A rack fails under
runs of different priorities; a detector blames healthy nodes until the quarantine breaker stops
it; a spare that fails the run's health check is never handed out."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from lazarus.client.config import Settings
from lazarus.client.runs import run_status, start_run
from lazarus.infra.backends.simulated.cluster import SimulatedCluster
from lazarus.schema import RunState, controls, parse_spec
from lazarus.worker import build_worker
from lazarus.workflows.training_run import TrainingRun

pytestmark = pytest.mark.timeout(240)


def fleet_spec(name: str, priority: int = 0, min_dp: int = 1, health: dict | None = None, **recovery):
    """dp 2 on two nodes of one rank; the simulated ranks train 50 steps a second."""
    return parse_spec(
        {
            "name": name,
            "health": health or {},
            "trainer": {"steps": 10_000_000, "checkpoint_every": 1_000_000},
            "layout": {"dp": 2, "ranks_per_node": 1},
            "cluster": {"active_nodes": 2, "spare_nodes": 1, "priority": priority},
            "recovery": {"min_dp": min_dp, "capacity_wait_seconds": 600, "progress_every_seconds": 600, **recovery},
        }
    )


class Fleet:
    """Runs on one home and one worker; each `until` polls the runs' statuses (a condition, with a deadline)."""

    def __init__(self, client, cluster: StaggeredDrains, queue: str):
        self.client, self.cluster = client, cluster
        self.settings = Settings(task_queue=queue, home=cluster.home)

    async def start(self, run_id: str, spec) -> None:
        await start_run(self.client, self.settings, spec, run_id)

    async def until(self, run_id: str, holds, what: str, timeout: float = 60.0):
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            status = await run_status(self.client, run_id)
            if holds(status):
                return status
            assert status.state != RunState.FAILED, f"{run_id} failed: {status.reason}"
            assert asyncio.get_running_loop().time() < deadline, f"{run_id}: timed out waiting for {what}: {status}"
            await asyncio.sleep(0.1)

    async def training(self, run_id: str, past_step: int = 0, incarnation: int = 0):
        """The run's status once its `incarnation` trains past `past_step`, as its ranks report (the
        workflow hears of routine progress only every recovery.progress_every_seconds)."""
        return await self.until(
            run_id,
            lambda s: (
                s.state == RunState.TRAINING
                and s.assignment is not None
                and s.assignment.incarnation == incarnation
                and self.step(run_id, incarnation) > past_step
            ),
            f"incarnation {incarnation} training past step {past_step}",
        )

    def step(self, run_id: str, incarnation: int) -> int:
        """The newest step the incarnation's ranks reported (0: none yet)."""
        return self.cluster.observe(run_id, incarnation).newest_step() or 0

    def held(self, run_id: str) -> list[str]:
        return [n.name for n in self.cluster.pool.read().held_by(run_id)]


class StaggeredDrains(SimulatedCluster):
    """The simulated backend, where a run's drain takes `drain_delays[run_id]` longer (seconds):
    a burst's drains queue on busy workers and finish one after another."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.drain_delays: dict[str, float] = {}

    def want_spares(self, run_id, want):
        time.sleep(self.drain_delays.get(run_id, 0.0))  # a backend call that is slow, not a wait on a condition
        super().want_spares(run_id, want)


@pytest.fixture
async def fleet(dev_env, tmp_path):
    cluster = StaggeredDrains(tmp_path / "home", steps_per_second=50.0, startup_seconds=0.1, report_seconds=0.1)
    queue = f"fleet-{uuid.uuid4()}"
    try:
        async with build_worker(dev_env.client, queue, cluster):
            yield Fleet(dev_env.client, cluster, queue)
            for execution in [w async for w in dev_env.client.list_workflows()]:
                handle = dev_env.client.get_workflow_handle(execution.id)
                if (await handle.describe()).status.name == "RUNNING":
                    await handle.terminate("test done")
    finally:
        cluster.close()


async def test_a_rack_failure_hands_spares_out_by_priority_and_the_others_reshard_or_wait(fleet):
    # Five runs, priorities 4..0; p0 may not shrink (min_dp 2), the others may. The lowest priority
    # drains first and the highest last, 0.6 s apart: 2.4 s in all, past the 1 s gather, which
    # lasts while the others keep draining.
    runs = {
        f"p{p}": fleet_spec(f"p{p}", priority=p, min_dp=2 if p == 0 else 1, burst_gather_seconds=1.0) for p in range(5)
    }
    fleet.cluster.drain_delays = {f"p{p}": 0.6 * p for p in range(5)}
    for run_id, spec in runs.items():
        await fleet.start(run_id, spec)
    before = {run_id: await fleet.training(run_id, past_step=5) for run_id in runs}
    pool = fleet.cluster.pool
    # Rack 1 holds the first node of every run; the pool's two spares are elsewhere.
    rack = [fleet.held(run_id)[0] for run_id in runs]
    pool.set_domain(rack, "rack-1")
    pool.add(2 - len(pool.read().free()), "spare")
    spares = [n.name for n in pool.read().free()]
    assert len(spares) == 2

    killed = fleet.cluster.kill_domain("rack-1")
    assert sorted(killed) == sorted(rack) and set(killed.values()) == set(runs)

    replaced = {}
    for run_id in ("p4", "p3"):  # the two highest priorities take the two spares
        status = await fleet.training(run_id, past_step=0, incarnation=1)
        [incident] = status.incidents
        lost = rack[int(run_id[1])]  # rack holds the runs' first nodes in p0..p4 order
        assert incident.decision.action == "replace" and set(incident.decision.replacements) == {lost}
        replaced[run_id] = next(iter(incident.decision.replacements.values()))
        assert status.assignment.layout.dp == 2  # the same world trains on
    assert sorted(replaced.values()) == sorted(spares)
    for run_id in ("p2", "p1"):  # no spare left: they reshard to one replica, as their policy allows
        status = await fleet.training(run_id, past_step=0, incarnation=1)
        [incident] = status.incidents
        assert incident.decision.action == "reshard" and status.assignment.layout.dp == 1
        # Whoever decides last finds the spares claimed already; before, it reads who outranked it.
        reason = incident.decision.reason
        assert "p4" in reason or "p3" in reason or "0 free spare(s)" in reason, reason
    # p0 may not shrink: it waits for capacity.
    waiting = await fleet.until("p0", lambda s: s.state == RunState.WAITING_FOR_CAPACITY, "p0 waiting for capacity")
    assert waiting.incidents[0].decision.action == "wait"
    # Every incident names the rack and the other runs it took.
    for run_id in runs:
        status = await run_status(fleet.client, run_id)
        shared = status.incidents[0].shared
        assert shared is not None and shared.domains == ["rack-1"], (run_id, shared)
        assert set(shared.runs) == set(runs) - {run_id} and sorted(shared.nodes) == sorted(rack)
        assert before[run_id].assignment.incarnation == 0


async def test_a_detector_blaming_healthy_nodes_stops_at_the_breaker_and_the_runs_pause(fleet):
    runs = [f"r{i}" for i in range(4)]
    for run_id in runs:
        await fleet.start(run_id, fleet_spec(run_id))
    for run_id in runs:
        await fleet.training(run_id, past_step=5)
    pool = fleet.cluster.pool
    pool.add(12 - len(pool.read().nodes), "spare")
    pool.set_breaker(max_fraction=2 / 12)  # two of the pool's twelve nodes
    blamed = {run_id: fleet.held(run_id)[0] for run_id in runs}

    for run_id in runs:  # one run after another, so that which runs the breaker lets through is known
        report = controls.FaultSignal(nodes=[blamed[run_id]], reason="detector: ECC errors (wrongly)")
        await fleet.client.get_workflow_handle(run_id).signal(TrainingRun.report_fault, report)
        await fleet.until(run_id, lambda s: len(s.incidents) == 1 and s.incidents[0].outcome != "recovering", "the end")

    record = pool.read()
    for run_id in runs[:2]:  # within the cap: quarantined and replaced by a spare
        status = await fleet.training(run_id, incarnation=1)
        assert record.node(blamed[run_id]).role == "quarantined" and blamed[run_id] not in status.assignment.nodes
    for run_id in runs[2:]:  # past it: nothing quarantined, the ranks stopped, the run paused with why
        status = await run_status(fleet.client, run_id)
        assert status.state == RunState.PAUSED and status.incidents[0].outcome == "paused"
        assert "quarantine breaker is open" in status.reason and "lazarus pool breaker --reset" in status.reason
        assert record.node(blamed[run_id]).role == "active" and record.node(blamed[run_id]).owner == run_id
        assert fleet.cluster.run_dir(run_id).ended_file(0).exists()
    assert record.breaker.tripped_at is not None and len(record.breaker.quarantined) == 2
    assert sum(n.role == "quarantined" for n in record.nodes) == 2

    # A person resets the breaker and resumes a paused run: it trains again, on the nodes it held.
    pool.reset_breaker()
    handle = fleet.client.get_workflow_handle(runs[2])
    await handle.execute_update(TrainingRun.resume, controls.ResumeRequest(reason="the detector was wrong"))
    status = await fleet.training(runs[2], past_step=3, incarnation=1)
    assert blamed[runs[2]] in status.assignment.nodes


async def test_a_spare_that_fails_the_health_check_is_never_claimed(fleet):
    spec = fleet_spec("checked", health={"command": ["sh", "-c", 'test "$LAZARUS_NODE" != node-2']})
    await fleet.start("checked", spec)
    await fleet.training("checked", past_step=5)
    assert fleet.held("checked") == ["node-0", "node-1"]
    pool = fleet.cluster.pool
    pool.add(1, "spare")  # node-2 (the run's launch left it free) fails the check; node-3 passes it
    assert [n.name for n in pool.read().free()] == ["node-2", "node-3"]

    fleet.cluster.kill_node("checked", "node-1")
    status = await fleet.training("checked", incarnation=1)
    assert status.assignment.nodes == ["node-0", "node-3"]
    [incident] = status.incidents
    assert incident.decision.replacements == {"node-1": "node-3"}
    rejected = pool.read().node("node-2")
    assert rejected.role == "quarantined" and rejected.owner is None
    assert "failed run checked's health check" in rejected.note and "exited with 1" in rejected.note
    assert not any("node-2" in (fleet.cluster.assignment("checked", k) or status.assignment).nodes for k in (0, 1))
