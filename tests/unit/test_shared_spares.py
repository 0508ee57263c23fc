"""The pool's spares shared by runs recovering at once: priority, then who lost more, then who lost
first; a run holds at most its spec's nodes; and runs deciding against one read of the pool never
plan to take the same spare."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from lazarus.schema import Assignment, FaultReport, Inventory, Layout, NodeRecord
from lazarus.schema.pool import SpareWant
from lazarus.workflows.policy import plan_recovery, spare_want

T0 = datetime(2026, 12, 2, 4, 0, tzinfo=UTC)
DP2 = Layout(dp=2, pp=1, tp=1, ranks_per_node=1)


def run_of(name: str, layout: Layout = DP2) -> Assignment:
    """A run's incarnation 0 on nodes of its own (`a-0`, `a-1`, ...)."""
    nodes = [f"{name}-{i}" for i in range(layout.nodes)]
    return Assignment(incarnation=0, nodes=nodes, layout=layout, master_port=1)


def fault_on(node: str, at: datetime = T0) -> FaultReport:
    return FaultReport(kind="node_down", nodes=[node], incarnation=0, occurred_at=at, detected_at=at, step=5)


def seen_by(run: Assignment, lost: list[str], spares: list[str], wants: list[SpareWant]) -> Inventory:
    """The run's inventory after its drain: its nodes, the lost ones quarantined, the pool's free
    spares, the other runs' wants."""
    nodes = [NodeRecord(name=n, role="quarantined" if n in lost else "active") for n in run.nodes]
    nodes += [NodeRecord(name=s, role="spare") for s in spares]
    return Inventory(nodes=nodes, wants=wants)


def plan(run: Assignment, lost: str, spares: list[str], mine: SpareWant, others: list[SpareWant], limit=None):
    inventory = seen_by(run, [lost], spares, others)
    return plan_recovery(inventory, run, [lost], target_dp=2, min_dp=1, want=mine, node_limit=limit)


def test_the_higher_priority_gets_the_last_spare_and_both_decisions_say_why():
    a, b = run_of("a"), run_of("b")
    want_a = spare_want("a", a, fault_on("a-1"), priority=5)
    want_b = spare_want("b", b, fault_on("b-1", T0 - timedelta(seconds=3)), priority=1)  # b failed first
    won = plan(a, "a-1", ["spare-0"], want_a, [want_b])
    lost = plan(b, "b-1", ["spare-0"], want_b, [want_a])
    assert won.action == "replace" and won.replacements == {"a-1": "spare-0"} and won.rivals == ["b"]
    assert "ahead of run b for the pool's spares (priority 5 > 1)" in won.reason
    assert lost.action == "reshard" and lost.nodes == ["b-0"] and lost.layout.dp == 1 and lost.rivals == ["a"]
    assert "run a needs 1 of the pool's spares first (priority 5 > 1)" in lost.reason


def test_on_equal_priority_the_run_that_lost_more_ranks_comes_first():
    small, big = run_of("small"), run_of("big", Layout(dp=2, pp=2, tp=1, ranks_per_node=1))
    want_small = spare_want("small", small, fault_on("small-1"), priority=0)
    want_big = spare_want("big", big, fault_on("big-3", T0 + timedelta(seconds=1)), priority=0)
    assert (want_small.lost_ranks, want_big.lost_ranks) == (1, 2)
    lost = plan(small, "small-1", ["spare-0"], want_small, [want_big])
    assert lost.action == "reshard" and "same priority, lost 2 ranks > 1" in lost.reason


def test_a_spare_the_winner_already_took_is_named_in_the_losers_reason():
    a, b = run_of("a"), run_of("b")
    want_b = spare_want("b", b, fault_on("b-1"), priority=0)
    placed = spare_want("a", a, fault_on("a-1", T0 - timedelta(seconds=1)), priority=0).model_copy(
        update={"placed": True, "got": 1}
    )
    lost = plan(b, "b-1", [], want_b, [placed])
    assert lost.action == "reshard" and "run a took 1 of the pool's spares first" in lost.reason


def test_a_run_holds_at_most_its_specs_nodes_though_spares_are_free():
    a = run_of("a")
    # It lost a-1 earlier, was given a spare, and lost that one now: two quarantined of the three
    # nodes its spec allows (two active, one spare).
    inventory = Inventory(
        nodes=[
            NodeRecord(name="a-0", role="active"),
            NodeRecord(name="a-1", role="quarantined"),
            NodeRecord(name="spare-0", role="quarantined"),
            NodeRecord(name="spare-1", role="spare"),
        ]
    )
    second = a.model_copy(update={"incarnation": 1, "nodes": ["a-0", "spare-0"]})
    want = spare_want("a", second, fault_on("spare-0"), priority=0)
    decision = plan_recovery(inventory, second, ["spare-0"], target_dp=2, min_dp=1, want=want, node_limit=3)
    assert decision.action == "reshard" and decision.nodes == ["a-0"]
    assert "this run holds 3 node(s), active and quarantined, of the 3 its spec allows" in decision.reason
    # Without the limit (runs from before the shared pool), the free spare is taken.
    unlimited = plan_recovery(inventory, second, ["spare-0"], target_dp=2, min_dp=1, want=want)
    assert unlimited.action == "replace"


@given(
    st.integers(0, 4),
    st.lists(st.tuples(st.integers(0, 3), st.integers(1, 2)), min_size=2, max_size=4),
)
def test_runs_deciding_on_one_read_of_the_pool_never_plan_the_same_spare(free, runs):
    spares = [f"spare-{i}" for i in range(free)]
    assignments, wants, lost = {}, {}, {}
    for index, (priority, lost_count) in enumerate(runs):
        name = f"r{index}"
        assignments[name] = run_of(name, Layout(dp=2, pp=1, tp=1, ranks_per_node=1))
        lost[name] = assignments[name].nodes[:lost_count]
        fault = FaultReport(kind="node_down", nodes=lost[name], incarnation=0, occurred_at=T0, detected_at=T0, step=5)
        wants[name] = spare_want(name, assignments[name], fault, priority)
    taken: list[str] = []
    for name, assignment in assignments.items():
        others = [w for other, w in wants.items() if other != name]
        nodes = [NodeRecord(name=n, role="quarantined" if n in lost[name] else "active") for n in assignment.nodes]
        inventory = Inventory(nodes=nodes + [NodeRecord(name=s, role="spare") for s in spares], wants=others)
        decision = plan_recovery(inventory, assignment, lost[name], target_dp=2, min_dp=1, want=wants[name])
        taken += [n for n in decision.nodes if n.startswith("spare-")]
    assert sorted(taken) == sorted(set(taken)), taken
    # Nothing is left idle that someone could have used: every spare went to a run while any run
    # resharded or waited short of one.
    short = sum(len(lost[name]) for name in assignments) > len(taken)
    assert not short or len(taken) == free
