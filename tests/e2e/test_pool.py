"""Two runs of one home share the pool's one spare: both lose a node at once, the one with the
higher priority gets the spare, the other reshards, and grows back to its dp once the first run's
dead node is returned. What the trainers computed is checked, not only the states reached."""

from __future__ import annotations

import math
import re

import pytest

from lazarus.chaos.judge import duplicate_starts
from lazarus.chaos.pool_race import local_pool, race_for_one_spare
from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.schema import RunState, load_spec
from tests.support.runs import SPECS, losses, unlogged

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

POOL_SPEC = SPECS / "pool.yaml"


def within(value: float, reference: float) -> bool:
    return math.isclose(value, reference, rel_tol=1e-4)


async def test_two_runs_share_one_spare_by_priority_and_the_loser_regrows(dev_env, home, reference):
    cluster = LocalCluster(home)
    race = await race_for_one_spare(dev_env.client, local_pool(cluster), load_spec(POOL_SPEC), priority_a=5)
    ids, runs, final_a, final_b = race.ids, race.runs, race.status["a"], race.status["b"]

    assert final_a.state == final_b.state == RunState.COMPLETED
    [incident_a], [incident_b] = final_a.incidents, final_b.incidents
    # Exactly one got the spare: a, by priority; b resharded, and both incidents say why.
    assert incident_a.decision.action == "replace" and incident_a.new_assignment.nodes == ["node-0", "node-2"]
    # a reads b's need still open (and says it goes ahead of b), or b decided first, reading a's need
    # (b's reason says so, below): which run reads the pool first is up to the worker.
    b_decided_first = f"run {ids['a']} needs 1 of the pool's spares first" in incident_b.decision.reason
    assert b_decided_first or f"ahead of run {ids['b']}" in incident_a.decision.reason
    # a names b as its rival while b's need is open; b, deciding first, may have resharded (its need
    # met) before a read the pool, and then a has none.
    assert incident_a.decision.rivals == [ids["b"]] or (b_decided_first and incident_a.decision.rivals == [])
    assert incident_b.decision.action == "reshard" and incident_b.new_assignment.nodes == ["node-4"]
    # a still needs the spare, or has taken it already, as b reads the pool: either way a comes first.
    assert re.search(
        f"run {ids['a']} (needs|took) 1 of the pool's spares first \\(priority 5 > 0\\)", incident_b.decision.reason
    )
    # b grew back to dp 2 on the returned node, at a step boundary, losing no completed step.
    [regrowth] = final_b.regrowths
    assert (regrowth.from_dp, regrowth.to_dp, regrowth.nodes, regrowth.outcome) == (1, 2, ["node-1"], "regrown")
    assert regrowth.lost_steps == 0 and final_b.layout.dp == 2
    assert cluster.run_dir(ids["b"]).incarnations() == [0, 1, 2]
    assert cluster.assignment(ids["b"], 2).nodes == ["node-4", "node-1"]
    # What the trainers computed: every step of each run within 1e-4 of the run without a fault.
    expected = reference(POOL_SPEC)
    for key, final in (("a", final_a), ("b", final_b)):
        trained = losses(runs[key])
        assert set(expected) - set(trained) <= unlogged(final), f"run {key} has no loss for some steps"
        off = {s: (trained[s], expected[s]) for s in trained if not within(trained[s], expected[s])}
        assert off == {}, f"run {key}: {off}"
        assert duplicate_starts(runs[key]) == 0
    # No node in two runs: a's nodes since the fault were never b's, and the pool agrees at the end.
    b_nodes = {n for k in (0, 1, 2) for n in cluster.assignment(ids["b"], k).nodes}
    assert not set(incident_a.new_assignment.nodes) & b_nodes
    assert all(node.role != "active" for node in cluster.pool.read().nodes)  # both ended: everything released
