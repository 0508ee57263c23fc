"""One behavioural suite for every cluster backend (infra/backend.py's ClusterBackend): the local
backend and the Kubernetes backend on the emulator must behave alike wherever the activities rely
on it. Ranks are stand-ins (rank.py) that report steps through the session helper."""

from __future__ import annotations

import asyncio
import inspect
import time
from datetime import UTC, datetime

import pytest

from lazarus.activities.ownership import take_over_run
from lazarus.infra.backend import ClusterBackend, ClusterError
from lazarus.schema import FaultReport
from lazarus.schema.contract import SurvivorManifest, write_survivor
from lazarus.schema.ownership import Owner
from lazarus.schema.rundir import commit_checkpoint
from lazarus.schema.stages import TakeOverInput
from lazarus.workflows.policy import plan_recovery, spare_want
from tests.support.backends import every_rank_training
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(120)


def protocol_members() -> list[str]:
    return [
        name for name, value in vars(ClusterBackend).items() if inspect.isfunction(value) and not name.startswith("_")
    ]


def test_the_backend_implements_every_method_of_the_protocol_with_its_parameters(backend):
    for name in protocol_members():
        declared = inspect.signature(getattr(ClusterBackend, name))
        implemented = inspect.signature(getattr(type(backend.cluster), name))
        assert list(implemented.parameters) == list(declared.parameters), f"{backend.name}.{name}{implemented}"
        assert inspect.iscoroutinefunction(getattr(backend.cluster, name)) == (name == "wait_for_exit"), name
    for attribute in ("backend", "records_stages", "home"):
        assert hasattr(backend.cluster, attribute), attribute


def test_create_is_idempotent_and_refuses_another_spec_under_the_same_run(backend):
    spec = backend.spec()
    backend.cluster.create("r1", spec)
    backend.started.append("r1")
    backend.cluster.create("r1", spec)
    roles = {n.name: n.role for n in backend.cluster.inventory("r1").nodes}
    assert roles == {**{n: "active" for n in backend.active}, **{n: "spare" for n in backend.spares}}
    with pytest.raises(ClusterError, match="different spec"):
        backend.cluster.create("r1", backend.spec(steps=7))


def test_a_retried_start_runs_each_rank_once_and_keeps_the_first_launch_record(backend):
    assignment = backend.launch("r1")
    assert assignment.nodes == backend.active
    first = every_rank_training(backend, "r1")
    again = backend.cluster.start_ranks("r1", 0, resume_step=99)
    assert again.resume_step == 0 and again.launched_at == first.launched_at
    observation = backend.cluster.observe("r1", 0)
    assert [r.node for r in observation.ranks] == backend.active
    assert observation.launchers_alive == 2
    # One process per rank: a second start would show up as a second "starting" heartbeat series.
    log = backend.cluster.log_tail("r1", 0, 1)
    assert log.count("stand-in rank 1 of incarnation 0") == 1, log


def test_a_spare_is_claimed_exactly_once_and_leftovers_go_back(backend):
    old = backend.launch("r1")
    lost, spare = backend.active[1], backend.spares[0]
    backend.cluster.quarantine("r1", [lost], "test: node_down")
    proposal = old.model_copy(update={"incarnation": 1, "nodes": [backend.active[0], spare]})
    first = backend.cluster.commit_assignment("r1", proposal, claims=[spare])
    retried = backend.cluster.commit_assignment("r1", proposal.model_copy(update={"master_port": 7}), claims=[spare])
    assert retried == first and first.nodes == [backend.active[0], spare]
    assert backend.cluster.inventory("r1").free_spares() == []
    # A node that is not a free spare (here: quarantined) cannot be claimed.
    with pytest.raises(ClusterError, match="no longer a free spare"):
        backend.cluster.commit_assignment(
            "r1", proposal.model_copy(update={"incarnation": 2, "nodes": [spare, lost]}), claims=[lost]
        )
    # A reshard onto one node gives the other back to the pool as a spare.
    shrunk = first.model_copy(update={"incarnation": 2, "nodes": [spare]})
    backend.cluster.commit_assignment("r1", shrunk, releases=[backend.active[0]])
    assert backend.cluster.inventory("r1").free_spares() == [backend.active[0]]


def test_stages_that_ran_again_after_their_claim_find_it_and_decide_as_it(backend):
    """A workflow task timed out after replace_or_reshard claimed: drain lodges the fault's need again,
    reschedule reads the inventory, and the claim made is what the policy decides."""
    old = backend.launch("r1")
    lost, spare = backend.active[1], backend.spares[0]
    now = datetime.now(UTC)
    fault = FaultReport(kind="node_down", nodes=[lost], incarnation=0, occurred_at=now, detected_at=now, step=3)
    need = spare_want("r1", old, fault, priority=0)
    backend.cluster.want_spares("r1", need)
    backend.cluster.quarantine("r1", [lost], "test: node_down")
    assert backend.cluster.claimed_assignment("r1", 1) is None
    decided = plan_recovery(backend.cluster.inventory("r1"), old, [lost], target_dp=2, min_dp=1)
    proposal = old.model_copy(update={"incarnation": 1, "nodes": decided.nodes})
    claimed = backend.cluster.commit_assignment("r1", proposal, claims=[spare])
    assert backend.lodged_want("r1").placed
    backend.cluster.want_spares("r1", need)  # the stages again
    assert backend.lodged_want("r1").placed  # a need met: no other run counts it as open
    inventory = backend.cluster.inventory("r1")
    inventory.claimed = backend.cluster.claimed_assignment("r1", 1)
    assert inventory.claimed == claimed and inventory.free_spares() == []
    again = plan_recovery(inventory, old, [lost], target_dp=2, min_dp=1)
    assert (again.action, again.nodes, again.replacements) == ("replace", claimed.nodes, {lost: spare})


def test_quarantine_holds_a_node_out_until_it_is_returned(backend):
    backend.launch("r1")
    node = backend.active[1]
    backend.cluster.quarantine("r1", [node], "test: ECC errors")
    record = backend.cluster.inventory("r1").node(node)
    assert record.role == "quarantined" and "ECC errors" in record.note
    assert node not in backend.cluster.inventory("r1").free_spares()
    returned = backend.cluster.return_node("r1", node)
    assert returned.node(node).role == "spare" and returned.node(node).healthy
    assert node in backend.cluster.inventory("r1").free_spares()


def test_a_rank_that_exits_wakes_the_watch_and_its_exit_is_observed(backend):
    backend.launch("r1")
    every_rank_training(backend, "r1")
    run = backend.cluster.run_dir("r1")

    async def woken() -> bool:
        assert await backend.cluster.wait_for_exit("r1", 0, 0.2) is False  # nothing ended yet
        (run.root / "exit-1").write_text("3")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if await backend.cluster.wait_for_exit("r1", 0, 30):
                return True
        return False

    assert asyncio.run(woken())
    ended = wait_until(lambda: backend.cluster.observe("r1", 0).ranks[1].exit, "rank 1's exit record")
    assert ended.code == 3 and "asked to exit with code 3" in ended.error and ended.by == "rank"
    assert backend.cluster.observe("r1", 0).ranks[0].alive


def test_the_ranks_stacks_are_captured_and_they_run_on(backend):
    """Asked through the run directory, carried out by each node's launcher beside its ranks: no
    backend needs access to the ranks' processes from the controller."""
    backend.launch("r1")
    every_rank_training(backend, "r1")
    stacks = backend.cluster.capture_stacks("r1", 0, wait_seconds=10)
    assert sorted(stacks) == [0, 1]
    assert all("rank.py" in dump and "most recent call first" in dump for dump in stacks.values()), stacks
    observation = backend.cluster.observe("r1", 0)
    assert all(r.alive and r.exit is None for r in observation.ranks)


def test_stop_leaves_no_rank_running_and_fences_the_incarnation(backend):
    backend.launch("r1")
    every_rank_training(backend, "r1")
    assert backend.cluster.stop_incarnation("r1", 0) == [0, 1]
    observation = backend.cluster.observe("r1", 0)
    assert not any(r.alive for r in observation.ranks) and observation.launchers_alive == 0
    assert backend.cluster.stop_incarnation("r1", 0) == []  # again: nothing left
    run = backend.cluster.run_dir("r1")
    run.checkpoint(10).mkdir(parents=True)
    assert commit_checkpoint(run, 10, incarnation=0) is False  # a late commit of the stopped incarnation


def test_stop_nodes_ends_the_ranks_of_those_nodes_only(backend):
    backend.launch("r1")
    every_rank_training(backend, "r1")
    hung = backend.active[1]
    assert backend.cluster.stop_nodes("r1", 0, [hung]) == [1]
    observation = backend.cluster.observe("r1", 0)
    assert [r.rank for r in observation.ranks if r.alive] == [0]  # its peer runs on (until drain ends it)
    assert backend.cluster.stop_nodes("r1", 0, [hung]) == []  # again: nothing left there
    assert backend.cluster.stop_incarnation("r1", 0) == [0]


def test_a_dead_node_is_observed_dead(backend):
    backend.launch("r1")
    every_rank_training(backend, "r1")
    backend.kill_node("r1", backend.active[1])
    observation = wait_until(
        lambda: (o := backend.cluster.observe("r1", 0)).dead_nodes and o, f"{backend.active[1]} to be seen dead"
    )
    assert list(observation.dead_nodes) == [backend.active[1]]


def test_a_checkpoint_in_flight_gets_its_grace_and_partial_ones_are_removed(backend):
    backend.launch("r1")
    every_rank_training(backend, "r1")
    run = backend.cluster.run_dir("r1")
    for step in (10, 20):
        run.checkpoint_folder(step, 0).mkdir(parents=True)
        (run.checkpoint_folder(step, 0) / "shard").write_text("x")
    assert commit_checkpoint(run, 10, incarnation=0)
    assert backend.cluster.await_checkpoint_in_flight("r1", 0, grace=0.2) == (20, False)
    backend.cluster.stop_incarnation("r1", 0)
    assert backend.cluster.remove_partial_checkpoints("r1") == [20]
    assert run.checkpoint_steps() == [10]  # committed before drain ended its incarnation: it counts
    assert not run.checkpoint_folder(20, 0).exists()


def test_survivors_get_their_grace_and_what_they_saved_is_read(backend):
    backend.launch("r1")
    every_rank_training(backend, "r1")
    run = backend.cluster.run_dir("r1")
    coordinates = {"dp": 1, "pp": 0, "dp_shard": 0, "tp": 0}
    saved = SurvivorManifest(step=7, coordinates=coordinates, size=0, sha256="", time=time.time())
    assert write_survivor(run, 0, 1, saved)
    # The stand-in ranks keep running, as hung ones would: the grace runs out, the save counts.
    assert backend.cluster.await_survivors("r1", 0, grace=0.2) == {1: 7}
    backend.cluster.stop_incarnation("r1", 0)
    assert backend.cluster.await_survivors("r1", 0, grace=30) == {1: 7}  # no rank lives: no wait
    assert not write_survivor(run, 0, 2, saved)  # the incarnation is ended: a late save never counts
    # Drain of incarnation 0 keeps its survivors (the next one restores them); drain of 1 drops them.
    assert backend.cluster.remove_stale_survivors("r1", 0) == [] and run.survivor_manifest(0, 1).exists()
    assert backend.cluster.remove_stale_survivors("r1", 1) == [0] and not run.survivors(0).exists()


def test_stages_are_recorded_where_the_cluster_shows_them_without_failing(backend):
    backend.launch("r1")
    backend.cluster.record_stage("r1", "drained", "stopped incarnation 0")
    backend.cluster.release_standbys("r1")
    assert backend.cluster.records_stages == (backend.name == "kubernetes")


def test_a_take_over_between_a_regrow_s_claim_and_its_stop_stops_the_training_incarnation(local_backend):
    """A regrow claims incarnation 1 while incarnation 0 trains, and the workflow is reset before its
    ranks stop: the new owner finds 1 claimed and not started, and 0 stopped, so that the two never
    train at once."""
    old = local_backend.launch("r1")
    every_rank_training(local_backend, "r1")
    grown = old.model_copy(update={"incarnation": 1, "nodes": [*old.nodes, local_backend.spares[0]]})
    local_backend.cluster.commit_assignment("r1", grown, claims=[local_backend.spares[0]])
    assert sum(r.alive for r in local_backend.cluster.observe("r1", 0).ranks) == 2
    owner = Owner(workflow_id="r1", execution="reset-1", lineage="first")
    taking = TakeOverInput(run_id="r1", owner=owner, previous=None, kind="adopt")
    found = take_over_run(local_backend.cluster, taking, wait_seconds=1.0)
    assert found.assignment == grown and not found.launched
    assert not any(r.alive for r in local_backend.cluster.observe("r1", 0).ranks)
    assert local_backend.cluster.run_dir("r1").ended_file(0).exists()
