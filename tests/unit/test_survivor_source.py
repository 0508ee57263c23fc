"""Which survivors a new incarnation restores from: the last step every survivor completed, saved
for every (pp, dp_shard, tp) place of its layout, past the newest checkpoint, from files that
match their manifests; none when no full replica survived."""

from __future__ import annotations

import json
import os
import time

from lazarus.infra.standbys import order_prefetch
from lazarus.infra.survivors import survivor_holders, survivor_source
from lazarus.schema.contract import SurvivorManifest, read_survivor, read_survivors, write_survivor
from lazarus.schema.files import file_sha256, take_lock, write_json_atomic
from lazarus.schema.layout import Layout
from lazarus.schema.records import Assignment, Inventory, NodeRecord
from lazarus.schema.rundir import RunDir

DP2_PP2 = Layout(dp=2, pp=2)


def failed_incarnation(run: RunDir, layout: Layout = DP2_PP2) -> None:
    nodes = [f"node-{i}" for i in range(layout.nodes)]
    assignment = Assignment(incarnation=0, nodes=nodes, layout=layout, master_addr="127.0.0.1", master_port=1)
    run.assignment_file(0).parent.mkdir(parents=True, exist_ok=True)
    run.assignment_file(0).write_text(assignment.model_dump_json())


def survivor(
    run: RunDir, rank: int, step: int, layout: Layout = DP2_PP2, corrupt: bool = False, late: bool = False
) -> None:
    """Survivor `rank`'s state and manifest; `late`: written past write_survivor's check (its
    check passed just before the controller ended the incarnation)."""
    path = run.survivor_state(0, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes([rank, step]) * 100)
    manifest = SurvivorManifest(
        step=step, coordinates=layout.coordinates(rank), size=200, sha256=file_sha256(path), time=time.time()
    )
    if late:
        write_json_atomic(run.survivor_manifest(0, rank), manifest.model_dump_json())
    else:
        assert write_survivor(run, 0, rank, manifest)
    if corrupt:
        path.write_bytes(bytes([255, step]) * 100)


def test_the_surviving_replica_covers_every_place_of_the_same_layout(tmp_path):
    run = RunDir(tmp_path)
    failed_incarnation(run)
    survivor(run, 0, 7)
    survivor(run, 1, 7)  # replica 0, both stages; replica 1 lost a node
    step, source = survivor_source(run, 0, DP2_PP2, after_step=5)
    assert step == 7 and source.incarnation == 0 and source.ranks == {0: 0, 1: 1, 2: 0, 3: 1}
    # After a reshard to one replica, the same places.
    assert survivor_source(run, 0, Layout(dp=1, pp=2), after_step=5)[1].ranks == {0: 0, 1: 1}


def test_nothing_newer_than_the_checkpoint_or_a_place_uncovered_falls_back(tmp_path):
    run = RunDir(tmp_path)
    failed_incarnation(run)
    survivor(run, 0, 7)
    assert survivor_source(run, 0, DP2_PP2, after_step=5) is None  # stage 1 saved by nobody
    survivor(run, 3, 7)  # stage 1 of the other replica: any replica's rank at the place will do
    assert survivor_source(run, 0, DP2_PP2, after_step=5)[1].ranks == {0: 0, 1: 3, 2: 0, 3: 3}
    assert survivor_source(run, 0, DP2_PP2, after_step=7) is None  # the checkpoint is as new


def test_a_file_that_does_not_match_its_manifest_is_passed_over(tmp_path):
    run = RunDir(tmp_path)
    failed_incarnation(run)
    survivor(run, 0, 7, corrupt=True)
    survivor(run, 1, 7)
    assert survivor_source(run, 0, DP2_PP2, after_step=5) is None
    survivor(run, 2, 7)
    assert survivor_source(run, 0, DP2_PP2, after_step=5)[1].ranks == {0: 2, 1: 1, 2: 2, 3: 1}


def test_the_step_every_survivor_completed_wins(tmp_path):
    run = RunDir(tmp_path)
    failed_incarnation(run, Layout(dp=3))
    survivor(run, 0, 8, Layout(dp=3))  # its all-reduce of step 8 completed before the fault broke rank 1's
    survivor(run, 1, 7, Layout(dp=3))
    step, source = survivor_source(run, 0, Layout(dp=3), after_step=5)
    assert step == 7 and source.ranks == {0: 1, 1: 1, 2: 1}


def test_an_ended_incarnation_records_no_survivor(tmp_path):
    run = RunDir(tmp_path)
    failed_incarnation(run)
    run.ended_file(0).write_text("")
    manifest = SurvivorManifest(step=7, coordinates=DP2_PP2.coordinates(0), size=0, sha256="", time=0.0)
    assert write_survivor(run, 0, 0, manifest) is False
    assert survivor_source(run, 0, DP2_PP2, after_step=0) is None


def test_a_survivor_save_that_raced_the_end_does_not_count(tmp_path):
    """The end names the survivors that had saved; a manifest written after it (its writer's
    check passed just before the end) is not read, and those named still are."""
    run = RunDir(tmp_path)
    failed_incarnation(run)
    survivor(run, 0, 7)  # stage 0 of replica 0
    run.end(0)
    survivor(run, 1, 7, late=True)  # stage 1 of replica 0
    assert read_survivors(run, 0, 4).keys() == {0} and read_survivor(run, 0, 1) is None
    assert read_survivor(run, 0, 0).step == 7
    # Counted, rank 1 would make replica 0 whole; without it stage 1 has no state: the checkpoint.
    assert survivor_source(run, 0, DP2_PP2, after_step=5) is None


def test_each_standby_is_told_to_read_the_states_its_node_may_load(tmp_path):
    """Drain's prefetch: an active node reads its own places' states, the spare those of the
    node it may replace, the dead node nothing; so the next ranks need not read them."""
    run = RunDir(tmp_path)
    failed_incarnation(run)
    for rank in (0, 1, 2):  # node-3 (replica 1, stage 1) died
        survivor(run, rank, 7)
    names = ["node-0", "node-1", "node-2", "node-3", "node-4"]
    inventory = Inventory(
        nodes=[
            NodeRecord(name=n, role="quarantined" if n == "node-3" else "spare" if n == "node-4" else "active")
            for n in names
        ]
    )
    readers, locks = {}, []
    for name in names:
        home = run.standby(name)
        home.mkdir(parents=True)
        os.mkfifo(home / "orders")
        readers[name] = os.open(home / "orders", os.O_RDONLY | os.O_NONBLOCK)
        locks.append(take_lock(home / "lock"))
    try:
        assignment = Assignment.model_validate_json(run.assignment_file(0).read_text())
        _, holders = survivor_holders(run, 0, DP2_PP2)
        order_prefetch(run, assignment, inventory, holders)
        told = {}
        for name, fd in readers.items():
            try:
                told[name] = [json.loads(line)["prefetch"]["ranks"] for line in os.read(fd, 65536).splitlines()]
            except BlockingIOError:
                told[name] = []
        assert told == {"node-0": [[0]], "node-1": [[1]], "node-2": [[0]], "node-3": [], "node-4": [[1]]}
    finally:
        for fd in [*readers.values(), *locks]:
            os.close(fd)
