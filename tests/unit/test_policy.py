"""The recovery decision: a hot spare per lost node, same place, same world; else wait."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from spec import Assignment, Inventory, Layout, NodeRecord
from workflows.policy import plan_recovery


def world(active: int, spares: int, dead_spares: int = 0) -> tuple[Inventory, Assignment]:
    names = [f"node-{i}" for i in range(active + spares + dead_spares)]
    nodes = [NodeRecord(name=n, role="active") for n in names[:active]]
    nodes += [NodeRecord(name=n, role="spare") for n in names[active:active + spares]]
    nodes += [NodeRecord(name=n, role="spare", healthy=False) for n in names[active + spares:]]
    layout = Layout(dp=active, pp=1, tp=1, ranks_per_node=1)
    return Inventory(nodes=nodes), Assignment(incarnation=0, nodes=names[:active], layout=layout, master_port=1)


def test_one_lost_node_is_replaced_in_place():
    inventory, assignment = world(4, 1)
    decision = plan_recovery(inventory, assignment, ["node-2"])
    assert decision.action == "replace"
    assert decision.replacements == {"node-2": "node-4"}
    assert decision.layout == assignment.layout


def test_no_free_spare_means_wait():
    inventory, assignment = world(4, 0, dead_spares=1)
    decision = plan_recovery(inventory, assignment, ["node-1"])
    assert decision.action == "wait" and decision.replacements == {}
    assert "0 free spare(s)" in decision.reason


@given(active=st.integers(1, 16), spares=st.integers(0, 6), dead=st.integers(0, 3), data=st.data())
def test_replacements_are_distinct_free_spares_for_exactly_the_lost_nodes(active, spares, dead, data):
    inventory, assignment = world(active, spares, dead)
    lost = data.draw(st.lists(st.sampled_from(assignment.nodes), min_size=1, unique=True))
    decision = plan_recovery(inventory, assignment, lost + ["not-in-assignment"])
    if len(lost) > spares:
        assert decision.action == "wait"
        return
    assert decision.action == "replace"
    assert set(decision.replacements) == set(lost)
    assert len(set(decision.replacements.values())) == len(lost)
    assert set(decision.replacements.values()) <= set(inventory.free_spares())
    assert decision.layout.world_size == assignment.layout.world_size
