"""Compact node lists and rank lists (schema/nodelist.py), and the status's archive rule (schema/tally.py)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lazarus.schema import Assignment, FaultReport, Incident, Inventory, NodeRecord
from lazarus.schema.layout import Layout
from lazarus.schema.nodelist import (
    COMPACT_FROM,
    compress,
    compress_numbers,
    expand,
    expand_numbers,
    natural_key,
)
from lazarus.schema.stages import DrainResult
from lazarus.schema.tally import INCIDENTS_KEPT, to_archive

names = st.one_of(
    st.builds(
        lambda p, n, w: f"{p}{str(n).zfill(w)}",
        st.sampled_from(["node-", "gpu-a-", "n", ""]),
        st.integers(0, 3000),
        st.integers(0, 5),
    ),
    st.text(st.characters(codec="ascii", categories=["L", "N", "Pd"]), min_size=1, max_size=12),
)


@given(st.lists(names, max_size=300))
def test_a_compact_list_stands_for_the_same_names_in_the_same_order(listed):
    listed = [name for name in listed if name]
    assert expand(compress(listed)) == listed


def test_ranges_keep_their_order_and_their_width():
    nodes = [f"node-{i}" for i in range(2048)]
    nodes[3] = "node-2048"
    assert compress(nodes) == "node-[0-2,2048,4-2047]"
    assert compress(["gpu-0007", "gpu-0008", "gpu-0010", "x"]) == "gpu-[0007-0008,0010],x"
    assert sorted(["node-10", "node-2", "node-1"], key=natural_key) == ["node-1", "node-2", "node-10"]


@pytest.mark.parametrize("text", ["node-[3-1]", "node-[1-]", "node-[", "a,,b", "node-[0-99999999]", "node-[1]x"])
def test_a_malformed_or_huge_list_is_refused(text):
    with pytest.raises(ValueError):
        expand(text)


def test_long_lists_are_compact_in_json_and_short_ones_stay_lists():
    layout = Layout(dp=COMPACT_FROM, ranks_per_node=1)
    big = Assignment(incarnation=3, nodes=[f"node-{i}" for i in range(COMPACT_FROM)], layout=layout, master_port=1)
    data = json.loads(big.model_dump_json())
    assert data["nodes"] == f"node-[0-{COMPACT_FROM - 1}]"
    assert Assignment.model_validate_json(big.model_dump_json()) == big
    small = Assignment(incarnation=0, nodes=["node-0", "node-1"], layout=Layout(dp=2), master_port=1)
    assert json.loads(small.model_dump_json())["nodes"] == ["node-0", "node-1"]
    # Names the compact form cannot hold stay a list.
    odd = big.model_copy(update={"nodes": [f"n[{i}]" for i in range(COMPACT_FROM)]})
    assert isinstance(json.loads(odd.model_dump_json())["nodes"], list)


def test_an_inventory_of_thousands_of_nodes_is_a_few_records_in_json():
    died = datetime(2026, 12, 1, tzinfo=UTC)
    nodes = [NodeRecord(name=f"node-{i}", role="active") for i in range(2048)]
    nodes += [NodeRecord(name=f"node-{i}", role="spare") for i in range(2048, 2056)]
    nodes[5] = NodeRecord(name="node-5", role="quarantined", healthy=False, died_at=died, note="incident 1")
    inventory = Inventory(nodes=nodes)
    text = inventory.model_dump_json()
    assert len(json.loads(text)["nodes"]) == 4 and len(text) < 600
    assert Inventory.model_validate_json(text) == inventory


@given(st.lists(st.integers(0, 200), max_size=300), st.booleans())
def test_a_compact_number_list_stands_for_the_same_numbers_in_the_same_order(numbers, increasing):
    """Either path: bisection over a strictly increasing list, the loop over any other."""
    if increasing:
        numbers = sorted(set(numbers))
    assert expand_numbers(compress_numbers(numbers)) == numbers
    with pytest.raises(ValueError, match="rank -1"):
        compress_numbers([*numbers, -1])


def test_rank_lists_and_survivor_steps_are_ranges_in_json():
    alive = [r for r in range(16384) if r // 8 != 5]
    survivors = {r: 99 if r // 128 == 7 else 98 for r in alive}
    drained = DrainResult(
        quarantined=["node-5"], stopped_ranks=alive, removed_partial_checkpoints=[], survivors=survivors
    )
    data = json.loads(drained.model_dump_json())
    assert data["stopped_ranks"] == "0-39,48-16383"
    assert data["survivors"] == {"98": "0-39,48-895,1024-16383", "99": "896-1023"}
    assert DrainResult.model_validate_json(drained.model_dump_json()) == drained
    assert expand_numbers("") == []
    # Survivors at many steps (no two-step drain): grouped by the other path, read back the same.
    scattered = drained.model_copy(update={"survivors": {r: r % 20 for r in alive}})
    data = json.loads(scattered.model_dump_json())
    assert len(data["survivors"]) == 20 and data["survivors"]["3"].startswith("3,23,63,")  # 43 was on node-5
    assert DrainResult.model_validate_json(scattered.model_dump_json()) == scattered


def _incident(number: int, outcome: str = "recovered", nodes: int = 4) -> Incident:
    at = datetime(2026, 12, 1, tzinfo=UTC) + timedelta(minutes=number)
    assignment = Assignment(
        incarnation=number - 1, nodes=[f"node-{i}" for i in range(nodes)], layout=Layout(dp=nodes), master_port=1
    )
    fault = FaultReport(
        kind="node_down", nodes=["node-1"], incarnation=number - 1, occurred_at=at, detected_at=at, step=9, reason="x"
    )
    return Incident(number=number, fault=fault, old_assignment=assignment, outcome=outcome, lost_steps=1)


def test_the_status_archives_its_older_half_once_it_holds_too_many_incidents():
    assert to_archive([_incident(n) for n in range(1, INCIDENTS_KEPT + 1)]) == 0
    held = [_incident(n) for n in range(1, INCIDENTS_KEPT + 2)]
    assert to_archive(held) == len(held) - INCIDENTS_KEPT // 2
    # A recovery under way stays, and so does everything after it.
    held[3].outcome = "recovering"
    assert to_archive(held) == 3


def test_big_incidents_are_archived_by_their_size_before_their_count():
    held = [_incident(n, nodes=2048) for n in range(1, 13)]
    for incident in held:
        incident.old_assignment.nodes = list(reversed(incident.old_assignment.nodes))  # no ranges: ~10 KB each
    count = to_archive(held)
    assert 0 < count < len(held)
