"""The recovery decision: hot spares first, else the largest dp that fits, else wait."""

from __future__ import annotations

from hypothesis import assume, given
from hypothesis import strategies as st

from lazarus.schema import Assignment, Inventory, Layout, NodeRecord
from lazarus.workflows.policy import nodes_for, plan_claimed, plan_recovery


def world(layout: Layout, spares: int, dead_spares: int = 0) -> tuple[Inventory, Assignment]:
    active = layout.nodes
    names = [f"node-{i}" for i in range(active + spares + dead_spares)]
    nodes = [NodeRecord(name=n, role="active") for n in names[:active]]
    nodes += [NodeRecord(name=n, role="spare") for n in names[active : active + spares]]
    nodes += [NodeRecord(name=n, role="spare", healthy=False) for n in names[active + spares :]]
    return Inventory(nodes=nodes), Assignment(incarnation=0, nodes=names[:active], layout=layout, master_port=1)


DP4 = Layout(dp=4, pp=1, tp=1, ranks_per_node=1)
DP2_PP2 = Layout(dp=2, pp=2, tp=1, ranks_per_node=1)


def test_one_lost_node_is_replaced_in_place():
    inventory, assignment = world(DP4, spares=1)
    decision = plan_recovery(inventory, assignment, ["node-2"], target_dp=4, min_dp=1)
    assert decision.action == "replace"
    assert decision.replacements == {"node-2": "node-4"}
    assert decision.nodes == ["node-0", "node-1", "node-4", "node-3"]
    assert decision.layout == DP4 and decision.lost_replicas == [2] and not decision.below_target_dp


def test_pipeline_replica_with_a_spare_replaces_only_the_dead_node():
    inventory, assignment = world(DP2_PP2, spares=1)
    decision = plan_recovery(inventory, assignment, ["node-1"], target_dp=2, min_dp=1)
    assert decision.action == "replace" and decision.nodes == ["node-0", "node-4", "node-2", "node-3"]
    assert decision.lost_replicas == [0]


def test_pipeline_replica_without_a_spare_reshards_and_frees_its_healthy_node():
    inventory, assignment = world(DP2_PP2, spares=0)
    decision = plan_recovery(inventory, assignment, ["node-1"], target_dp=2, min_dp=1)
    assert decision.action == "reshard"
    assert decision.layout == Layout(dp=1, pp=2, tp=1, ranks_per_node=1)
    assert decision.nodes == ["node-2", "node-3"]
    assert decision.lost_replicas == [0] and decision.released_nodes == ["node-0"]
    assert decision.below_target_dp


def test_data_parallel_without_a_spare_reshards_to_the_survivors():
    inventory, assignment = world(DP4, spares=0, dead_spares=1)
    decision = plan_recovery(inventory, assignment, ["node-1"], target_dp=4, min_dp=2)
    assert decision.action == "reshard" and decision.layout.dp == 3
    assert decision.nodes == ["node-0", "node-2", "node-3"] and decision.released_nodes == []


# Two replicas of 2 FSDP shards x 2 tensor-parallel ranks on nodes of 2 ranks: a replica is 4 ranks, 2 nodes.
DP2_SHARD2_TP2 = Layout(dp=2, dp_shard=2, tp=2, ranks_per_node=2)


def test_a_lost_node_takes_its_whole_fsdp_and_tensor_parallel_replica():
    inventory, assignment = world(DP2_SHARD2_TP2, spares=1)
    assert assignment.nodes == ["node-0", "node-1", "node-2", "node-3"]
    decision = plan_recovery(inventory, assignment, ["node-3"], target_dp=2, min_dp=1)
    assert decision.action == "replace" and decision.lost_replicas == [1]
    assert decision.nodes == ["node-0", "node-1", "node-2", "node-4"] and decision.layout == DP2_SHARD2_TP2
    inventory, assignment = world(DP2_SHARD2_TP2, spares=0)
    decision = plan_recovery(inventory, assignment, ["node-3"], target_dp=2, min_dp=1)
    assert decision.action == "reshard" and decision.layout == DP2_SHARD2_TP2.model_copy(update={"dp": 1})
    assert decision.nodes == ["node-0", "node-1"] and decision.released_nodes == ["node-2"]


def test_below_the_minimum_dp_means_wait():
    inventory, assignment = world(DP2_PP2, spares=0)
    decision = plan_recovery(inventory, assignment, ["node-1"], target_dp=2, min_dp=2)
    assert decision.action == "wait" and decision.nodes == []
    assert "below recovery.min_dp=2" in decision.reason


def fits(layout: Layout, dp: int, nodes: int) -> bool:
    needed = nodes_for(layout, dp)
    return needed is not None and needed <= nodes


def layout_or_none(**sizes) -> Layout | None:
    try:
        return Layout(**sizes)
    except ValueError:
        return None  # e.g. a tensor-parallel group that would span nodes


layouts = st.builds(
    layout_or_none,
    dp=st.integers(1, 8),
    pp=st.sampled_from([1, 2, 4]),
    dp_shard=st.sampled_from([1, 2]),
    tp=st.sampled_from([1, 2]),
    ranks_per_node=st.sampled_from([1, 2, 4]),
).filter(lambda layout: layout is not None and layout.world_size % layout.ranks_per_node == 0)


@given(layout=layouts, spares=st.integers(0, 4), dead=st.integers(0, 2), min_dp=st.integers(1, 8), data=st.data())
def test_every_decision_keeps_the_invariants(layout, spares, dead, min_dp, data):
    inventory, assignment = world(layout, spares, dead)
    lost = data.draw(st.lists(st.sampled_from(assignment.nodes), min_size=1, unique=True))
    min_dp = min(min_dp, layout.dp)
    decision = plan_recovery(inventory, assignment, lost + ["not-in-assignment"], target_dp=layout.dp, min_dp=min_dp)
    healthy = [n for n in assignment.nodes if n not in lost]
    free = inventory.free_spares()

    if decision.action == "wait":
        assert decision.nodes == [] and len(free) < len(lost)
        assert not [d for d in range(min_dp, layout.dp) if fits(layout, d, len(healthy) + len(free))]
        return
    new = decision.layout
    assert (new.pp, new.dp_shard, new.tp, new.ranks_per_node) == (
        layout.pp,
        layout.dp_shard,
        layout.tp,
        layout.ranks_per_node,
    )
    assert len(decision.nodes) == nodes_for(layout, new.dp) == len(set(decision.nodes))
    assert not set(decision.nodes) & set(lost)
    assert set(decision.nodes) <= set(healthy) | set(free)
    if decision.action == "replace":
        assert len(free) >= len(lost) and new.dp == layout.dp
        assert set(decision.replacements) == set(lost)
        assert [decision.replacements.get(n, n) for n in assignment.nodes] == decision.nodes
        return
    assert len(free) < len(lost) and min_dp <= new.dp < layout.dp
    assert decision.released_nodes == [n for n in healthy if n not in decision.nodes]
    # The largest that fits: no bigger dp below the old one fits the healthy nodes and spares.
    assert not [d for d in range(new.dp + 1, layout.dp) if fits(layout, d, len(healthy) + len(free))]


def test_global_batch_kept_is_said_only_where_lazarus_keeps_it():
    from lazarus.schema.layout import Layout
    from lazarus.schema.records import Decision
    from lazarus.workflows.policy import batch_said

    reshard = Decision(action="reshard", layout=Layout(dp=2), reason="reshard dp 4 -> 2 (global batch kept)")
    assert batch_said(reshard, lazarus_keeps_batch=True) == reshard
    said = batch_said(reshard, lazarus_keeps_batch=False).reason
    assert said == "reshard dp 4 -> 2 (the script's own arithmetic decides its global batch)"


DECIDED = ("action", "nodes", "layout", "replacements", "released_nodes", "lost_replicas", "below_target_dp")


@given(layout=layouts, spares=st.integers(0, 4), data=st.data())
def test_a_claim_made_before_the_stages_ran_again_is_the_decision_again(layout, spares, data):
    """After a workflow task timed out inside the stages, they run again on a pool that holds the
    spare they claimed as the run's own: the decision is still the one the claim carried out."""
    inventory, assignment = world(layout, spares)
    lost = data.draw(st.lists(st.sampled_from(assignment.nodes), unique=True))
    first = plan_recovery(inventory, assignment, lost, target_dp=layout.dp, min_dp=1)
    assume(first.action != "wait")
    claimed = Assignment(incarnation=1, nodes=first.nodes, layout=first.layout, master_port=2)
    again = plan_claimed(assignment, claimed, lost, target_dp=layout.dp)
    assert {f: getattr(again, f) for f in DECIDED} == {f: getattr(first, f) for f in DECIDED}
    assert "before these stages ran again" in again.reason


def test_deciding_afresh_after_the_claim_would_reshard_a_run_whose_spare_is_in_hand():
    """Why the claim is the decision: the pool after the claim lists no free spare."""
    inventory, assignment = world(DP4, spares=1)
    first = plan_recovery(inventory, assignment, ["node-2"], target_dp=4, min_dp=1)
    roles = {"node-2": "quarantined", "node-4": "active"}
    after = Inventory(nodes=[NodeRecord(name=n.name, role=roles.get(n.name, n.role)) for n in inventory.nodes])
    assert first.action == "replace" and after.free_spares() == []
    assert plan_recovery(after, assignment, ["node-2"], target_dp=4, min_dp=1).action == "reshard"
    claimed = Assignment(incarnation=1, nodes=first.nodes, layout=DP4, master_port=2)
    again = plan_claimed(assignment, claimed, ["node-2"], target_dp=4)
    assert again.action == "replace" and again.replacements == {"node-2": "node-4"}
