"""Survivors that keep their processes (recovery.in_process), as the controller reads them: which
ranks wait at one step boundary, and whether the next incarnation can take them in (the same
layout, their nodes at their places, a whole replica of them to send the state)."""

from __future__ import annotations

import os
import time

from lazarus.infra.survivors import rejoin_of, wait_at_boundary, waiting_survivors
from lazarus.schema.contract import Heartbeat, Rejoin, write_heartbeat
from lazarus.schema.files import take_lock
from lazarus.schema.layout import Layout
from lazarus.schema.records import Assignment
from lazarus.schema.rundir import RunDir

DP4 = Layout(dp=4)
DP2_PP2 = Layout(dp=2, pp=2)


def assignment(layout: Layout, nodes: list[str], incarnation: int = 0) -> Assignment:
    return Assignment(incarnation=incarnation, nodes=nodes, layout=layout, master_addr="127.0.0.1", master_port=1)


def test_a_spare_in_the_lost_nodes_place_takes_the_survivors_in_with_a_whole_replica_as_the_source():
    old = assignment(DP4, ["node-0", "node-1", "node-2", "node-3"])
    new = assignment(DP4, ["node-0", "node-1", "node-4", "node-3"], 1)
    assert rejoin_of(old, new, {0: 11, 1: 11, 3: 11}) == Rejoin(incarnation=0, ranks=[0, 1, 3], source_replica=0)
    # Replica 0 lost its first stage: replica 1 is the one that survived whole.
    old = assignment(DP2_PP2, ["node-0", "node-1", "node-2", "node-3"])
    new = assignment(DP2_PP2, ["node-4", "node-1", "node-2", "node-3"], 1)
    assert rejoin_of(old, new, {1: 11, 2: 11, 3: 11}).source_replica == 1


def test_no_rejoin_without_a_whole_replica_with_a_survivor_moved_or_on_another_layout():
    old = assignment(DP2_PP2, ["node-0", "node-1", "node-2", "node-3"])
    # A node of each replica lost: no replica can send every stage's state.
    assert rejoin_of(old, assignment(DP2_PP2, ["node-0", "node-4", "node-5", "node-3"], 1), {0: 11, 3: 11}) is None
    # A survivor's node elsewhere in the new assignment.
    moved = assignment(DP2_PP2, ["node-1", "node-0", "node-4", "node-3"], 1)
    assert rejoin_of(old, moved, {0: 11, 1: 11, 3: 11}) is None
    # A reshard: the layout changed.
    smaller = assignment(Layout(dp=1, pp=2), ["node-0", "node-1"], 1)
    assert rejoin_of(old, smaller, {0: 11, 1: 11, 3: 11}) is None
    assert rejoin_of(old, assignment(DP2_PP2, old.nodes, 1), {}) is None


def waiting(run: RunDir, rank: int, step: int, phase: str = "waiting") -> int:
    """Rank `rank` of incarnation 0 at `phase` with `step`, its process alive (its lock held here)."""
    write_heartbeat(run, 0, Heartbeat(rank=rank, step=step, phase=phase, time=time.time()))
    fd = take_lock(run.lock_file(0, rank))
    assert fd is not None
    return fd


def test_the_survivors_wait_at_one_boundary_or_not_at_all(tmp_path):
    run = RunDir(tmp_path)
    old = assignment(DP4, ["node-0", "node-1", "node-2", "node-3"])
    locks = [waiting(run, 0, 11), waiting(run, 1, 11), waiting(run, 3, 11)]
    assert waiting_survivors(run, old) == {0: 11, 1: 11, 3: 11}
    # Asked for ranks of which one does not wait (rank 2: no heartbeat), none counts.
    assert waiting_survivors(run, old, [0, 1, 2, 3]) == {}
    # One a step ahead (its all-reduce completed before the fault broke its peers'): no common state.
    locks.append(waiting(run, 2, 12))
    assert waiting_survivors(run, old) == {}
    os.close(locks.pop())
    # A survivor still training, not at the boundary.
    write_heartbeat(run, 0, Heartbeat(rank=3, step=12, phase="training", time=time.time()))
    assert waiting_survivors(run, old) == {}
    write_heartbeat(run, 0, Heartbeat(rank=3, step=11, phase="waiting", time=time.time()))
    assert waiting_survivors(run, old) == {0: 11, 1: 11, 3: 11}
    # The controller told them to fall back: they save and end, none is kept.
    run.fall_back_file(0).touch()
    assert waiting_survivors(run, old) == {}
    for fd in locks:
        os.close(fd)


def test_a_backend_that_restarts_every_rank_refuses_in_process_with_a_sentence():
    from lazarus.activities.preflight import unkept_survivors
    from lazarus.infra.registry import backend_class
    from lazarus.schema import parse_spec

    spec = parse_spec({"name": "r", "recovery": {"in_process": True}, "cluster": {"backend": "slurm"}})
    assert unkept_survivors(spec, backend_class("slurm").keeps_survivors) == (
        "recovery.in_process: the slurm backend restarts every rank at a recovery (survivors keep their "
        "processes on the local backend); set it to false"
    )
    local = spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"backend": "local"})})
    assert unkept_survivors(local, backend_class("local").keeps_survivors) is None
    assert (
        unkept_survivors(
            spec.model_copy(update={"recovery": local.recovery.model_copy(update={"in_process": False})}), False
        )
        is None
    )


def test_drain_gives_up_on_the_boundary_at_once_when_a_survivor_has_ended(tmp_path):
    """A second node lost while the first's survivors reach their boundary: no need to wait out the
    grace (an hour here; the per-test timeout would fail a wait) for a rank that is gone."""
    run = RunDir(tmp_path)
    old = assignment(DP4, ["node-0", "node-1", "node-2", "node-3"])
    locks = [waiting(run, 1, 11), waiting(run, 3, 11)]
    # Rank 0 trained its step and ended (its lock is free): it will never wait.
    write_heartbeat(run, 0, Heartbeat(rank=0, step=11, phase="training", time=time.time()))
    assert wait_at_boundary(run, old, ["node-2"], grace=3600) == {}
    for fd in locks:
        os.close(fd)
