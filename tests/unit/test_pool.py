"""The local pool shared by every run of a home: spares claimed exactly once across runs and
processes, quarantine that holds for every run, release at the end, and a claimer killed at any
point leaving the pool consistent."""

from __future__ import annotations

import multiprocessing
import os
import signal
from datetime import UTC, datetime

import pytest

from lazarus.infra.backend import ClusterError, QuarantineRefused
from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.infra.pool import LocalPool
from lazarus.schema import Assignment, parse_spec

SLEEPER = ["python", "-c", "import time; time.sleep(600)"]
FORK = multiprocessing.get_context("fork")


def spec(active: int = 2, spares: int = 1):
    return parse_spec(
        {
            "name": "r",
            "layout": {"dp": active},
            "cluster": {"active_nodes": active, "spare_nodes": spares},
            "trainer": {"command": SLEEPER},
        }
    )


def active(cluster: LocalCluster, run_id: str) -> list[str]:
    return [n.name for n in cluster.inventory(run_id).nodes if n.role == "active"]


def replacing(cluster: LocalCluster, run_id: str, lost: str, spare: str, incarnation: int = 1) -> Assignment:
    """The assignment that puts `spare` in the place of `lost`."""
    nodes = [spare if n == lost else n for n in cluster.assignment(run_id, incarnation - 1).nodes]
    return Assignment(incarnation=incarnation, nodes=nodes, layout=spec().layout, master_port=29999)


def launched(cluster: LocalCluster, run_id: str) -> None:
    cluster.create(run_id, spec())
    layout = spec().layout
    cluster.commit_assignment(
        run_id, Assignment(incarnation=0, nodes=active(cluster, run_id), layout=layout, master_port=29999)
    )


@pytest.fixture
def two_runs(tmp_path) -> LocalCluster:
    """Runs a and b of one home, two active nodes each; node-2 is the one spare both see."""
    cluster = LocalCluster(tmp_path)
    launched(cluster, "a")
    launched(cluster, "b")
    return cluster


def test_two_runs_of_a_home_hold_their_own_nodes_and_share_the_spare(two_runs):
    assert active(two_runs, "a") == ["node-0", "node-1"]
    assert active(two_runs, "b") == ["node-3", "node-4"]  # b's launch found node-2 free and left it as the spare
    assert two_runs.inventory("a").free_spares() == two_runs.inventory("b").free_spares() == ["node-2"]
    # A launch retried after a crash finds the nodes it holds, and adds none.
    two_runs.pool.provision("b", 2, 1)
    assert active(two_runs, "b") == ["node-3", "node-4"] and len(two_runs.pool.read().nodes) == 5


def _claim_every_spare(home, run_id: str, spares: list[str], go, results) -> None:
    """Try to claim each of `spares` for `run_id`, one incarnation each; report the ones won."""
    cluster = LocalCluster(home)
    layout = cluster.spec(run_id).layout
    won = []
    go.wait()
    for incarnation, node in enumerate(spares, start=1):
        proposal = Assignment(incarnation=incarnation, nodes=[node], layout=layout, master_port=29999)
        try:
            cluster.commit_assignment(run_id, proposal, claims=[node])
            won.append(node)
        except ClusterError:
            pass
    results.put((run_id, won))


def test_runs_racing_from_many_processes_claim_every_spare_exactly_once(tmp_path):
    cluster = LocalCluster(tmp_path)
    runs = ["a", "b", "c", "d"]
    for run_id in runs:
        cluster.create(run_id, spec(active=1, spares=0))
    spares = cluster.pool.add(30)
    go, results = FORK.Event(), FORK.Queue()
    racers = [FORK.Process(target=_claim_every_spare, args=(tmp_path, r, spares, go, results)) for r in runs]
    for racer in racers:
        racer.start()
    go.set()
    won = dict(results.get(timeout=60) for _ in racers)
    for racer in racers:
        racer.join(timeout=30)
    claims = sorted(node for nodes in won.values() for node in nodes)
    assert claims == sorted(spares)  # each spare won once, by one run: none lost, none twice
    record = cluster.pool.read()
    assert all(record.node(node).owner == run_id for run_id, nodes in won.items() for node in nodes)
    # Each run's assignments name only what it won.
    for run_id, nodes in won.items():
        assigned = [cluster.assignment(run_id, k).nodes[0] for k in range(1, 31) if cluster.assignment(run_id, k)]
        assert assigned == nodes


def test_a_quarantined_node_stays_out_of_every_run_until_returned(two_runs):
    two_runs.quarantine("a", ["node-1"], "incident 1: node_down")
    assert two_runs.inventory("a").node("node-1").role == "quarantined"
    assert "node-1" not in {n.name for n in two_runs.inventory("b").nodes}
    with pytest.raises(ClusterError, match="node-1 is no longer a free spare .node-1 is quarantined by a"):
        two_runs.commit_assignment("b", replacing(two_runs, "b", "node-3", "node-1"), claims=["node-1"])
    # b cannot quarantine what a holds either.
    with pytest.raises(ClusterError, match="node-0 belongs to another run .a."):
        two_runs.quarantine("b", ["node-0"], "wrong run")
    two_runs.pool.return_node("node-1")
    assert two_runs.inventory("b").free_spares() == ["node-1", "node-2"]


def test_an_ended_run_gives_its_active_nodes_back_and_keeps_what_it_quarantined_out(two_runs):
    two_runs.quarantine("a", ["node-1"], "incident 1")
    assert two_runs.release_nodes("a") == ["node-0"]
    assert two_runs.release_nodes("a") == []  # a second release finds nothing
    assert two_runs.inventory("b").free_spares() == ["node-0", "node-2"]
    assert two_runs.pool.read().node("node-1").role == "quarantined"


def _killed_at(home, point: str) -> None:
    """Claim node-2 for run a and die by SIGKILL at `point` of the commit."""
    cluster = LocalCluster(home)

    def die(*_args, **_kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "before the claim is written":
        cluster.pool.save = die
    else:
        cluster.record_assignment = die
    cluster.commit_assignment("a", replacing(cluster, "a", "node-1", "node-2"), claims=["node-2"])


@pytest.mark.parametrize("point", ["before the claim is written", "between the claim and the assignment"])
def test_a_claimer_killed_mid_claim_leaves_the_pool_consistent(two_runs, point):
    home = two_runs.home
    two_runs.quarantine("a", ["node-1"], "incident 1")  # as drain does before the claim
    before = two_runs.pool.read()
    claimer = FORK.Process(target=_killed_at, args=(home, point))
    claimer.start()
    claimer.join(timeout=30)
    assert claimer.exitcode == -signal.SIGKILL
    record = two_runs.pool.read()
    owners = {n.name: n.owner for n in record.nodes}
    # The lock died with its holder: another run's change goes through at once.
    LocalPool(home).add(1)
    assert two_runs.assignment("a", 1) is None
    if point == "before the claim is written":
        assert record == before  # nothing of the claim reached the pool: the spare is free for b
        assert two_runs.commit_assignment("b", replacing(two_runs, "b", "node-3", "node-2"), claims=["node-2"])
        return
    # The claim is on record though its assignment is not: no other run can take the node, and
    # a's retry of the same commit completes it.
    assert owners["node-2"] == "a" and record.generation == before.generation + 1
    with pytest.raises(ClusterError, match="node-2 is no longer a free spare .node-2 is active in run a"):
        two_runs.commit_assignment("b", replacing(two_runs, "b", "node-3", "node-2"), claims=["node-2"])
    retry = two_runs.commit_assignment("a", replacing(two_runs, "a", "node-1", "node-2"), claims=["node-2"])
    assert retry.nodes == ["node-0", "node-2"] and active(two_runs, "a") == ["node-0", "node-2"]
    assert active(two_runs, "b") == ["node-3", "node-4"]


def test_claims_asked_for_together_are_written_together_and_a_refused_one_alone_fails(tmp_path):
    """Group commit: while the pool's lock is held elsewhere, the claims that threads of one process
    ask for queue up; they go in one write, and the one refused (its spare taken) changes nothing."""
    import fcntl
    import threading
    import time

    cluster = LocalCluster(tmp_path)
    runs = [f"r{i}" for i in range(6)]
    for run_id in runs:
        launched(cluster, run_id)
    spares = cluster.pool.add(5)
    before = cluster.pool.read().generation
    wanted = {run_id: spares[min(i, 4)] for i, run_id in enumerate(runs)}  # r4 and r5 both want the last
    outcomes: dict[str, object] = {}

    def claim(run_id: str) -> None:
        old = cluster.assignment(run_id, 0)
        proposal = Assignment(incarnation=1, nodes=[wanted[run_id], old.nodes[1]], layout=old.layout, master_port=1)
        try:
            outcomes[run_id] = cluster.commit_assignment(run_id, proposal, claims=[wanted[run_id]])
        except ClusterError as error:
            outcomes[run_id] = error

    with open(cluster.pool.file.parent / "lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process's commit, as far as the threads can tell
        threads = [threading.Thread(target=claim, args=(run_id,)) for run_id in runs]
        threads[0].start()
        deadline = time.monotonic() + 10
        while not cluster.pool._combining.locked():  # the first took its own change and waits for the lock
            assert time.monotonic() < deadline
        for thread in threads[1:]:
            thread.start()
        while len(cluster.pool._queue) < len(runs) - 1:  # the rest wait behind it
            assert time.monotonic() < deadline, "the claims did not queue"
        fcntl.flock(held, fcntl.LOCK_UN)
        for thread in threads:
            thread.join(timeout=30)
    refused = [run_id for run_id, outcome in outcomes.items() if isinstance(outcome, ClusterError)]
    assert len(refused) == 1 and refused[0] in ("r4", "r5")  # whichever queued second for the last spare
    assert f"{spares[4]} is no longer a free spare" in str(outcomes[refused[0]])
    record = cluster.pool.read()
    assert record.generation == before + 2  # two writes: the first claim's, then the five queued behind it
    for run_id in set(runs) - set(refused):
        assert record.node(wanted[run_id]).owner == run_id
        assert cluster.assignment(run_id, 1).nodes[0] == wanted[run_id]
    assert cluster.assignment(refused[0], 1) is None


def test_a_write_by_another_process_is_read_once_and_what_it_left_alone_is_kept(tmp_path):
    """Another process's write is parsed once, and only the nodes it changed are validated anew: the
    others are the very objects this process had (a look at a fleet reads the pool each time)."""
    mine, theirs = LocalPool(tmp_path), LocalPool(tmp_path)
    mine.add(50)
    before = mine.read()
    theirs.set_health({"node-7": {"healthy": False, "note": "killed"}})
    after = mine.read()
    assert after is mine.read()  # parsed once, then the same snapshot
    assert after.generation == before.generation + 1 and after == theirs.read()
    assert not after.node("node-7").healthy and mine.unhealthy() == {"node-7": None}
    assert all(after.node(n.name) is n for n in before.nodes if n.name != "node-7")
    assert after.node("node-7") is not before.node("node-7")
    mine.file.write_text('{"generation": 99, "nodes": [{"name": "node-0"}]}')  # not a pool's record
    with pytest.raises(ValueError, match="role"):
        mine.read()


def test_a_change_that_changes_nothing_writes_nothing(tmp_path):
    """Dropping a want that is gone already (every recovery's last step) leaves the file alone: at a
    fleet's size each write costs thousands of nodes' text, and a parse in every other process."""
    pool, other = LocalPool(tmp_path), LocalPool(tmp_path)
    pool.add(3)
    written = pool.read()
    mtime = pool.file.stat().st_mtime_ns
    pool.drop_want("a")
    assert pool.read() is written and pool.file.stat().st_mtime_ns == mtime
    other.drop_want("a")
    assert other.read().generation == written.generation and pool.read() is written
    pool.set_health({"node-1": {"healthy": False, "note": "killed"}})  # a change is still written
    assert other.read().generation == written.generation + 1 and not other.read().node("node-1").healthy


def test_the_breaker_trips_at_its_cap_counts_a_node_once_and_lets_an_operator_s_drain_through(two_runs):
    pool = two_runs.pool
    pool.set_breaker(max_fraction=0.4)  # two of the pool's five nodes
    two_runs.quarantine("a", ["node-1"], "incident 1: node_down")
    two_runs.quarantine("a", ["node-1"], "incident 1: node_down")  # a retried drain: counted once
    two_runs.quarantine("b", ["node-4"], "incident 1: external")
    assert sorted(pool.read().breaker.quarantined) == ["node-1", "node-4"] and pool.read().breaker.tripped_at is None
    with pytest.raises(QuarantineRefused, match="3 nodes quarantined within 300 s would pass its cap of 2"):
        two_runs.quarantine("b", ["node-3"], "incident 2: external")
    record = pool.read()
    assert record.node("node-3").role == "active" and record.breaker.tripped_at is not None
    with pytest.raises(QuarantineRefused, match="the pool's quarantine breaker is open"):
        two_runs.quarantine("a", ["node-0"], "incident 2: node_down")  # open: refused, whatever the count
    two_runs.quarantine("b", ["node-3"], "operator: drain node-3", counted=False)  # a person's own drain
    assert pool.read().node("node-3").role == "quarantined"
    pool.reset_breaker()
    two_runs.quarantine("a", ["node-0"], "incident 2: node_down")
    assert pool.read().breaker.tripped_at is None and len(pool.read().breaker.quarantined) == 1
    # A node a person returned no longer counts: the window holds what is still out.
    pool.return_node("node-0")
    two_runs.quarantine("b", ["node-3"], "incident 3: node_down")  # already out (the operator's drain): not new
    assert sorted(pool.read().breaker.recent(datetime.now(UTC), pool.read().out())) == []


def test_a_spare_that_fails_the_run_s_health_check_leaves_the_pool_unclaimed(tmp_path):
    cluster = LocalCluster(tmp_path)
    checked = spec().model_copy(
        update={"health": spec().health.model_copy(update={"command": ["sh", "-c", 'test "$LAZARUS_NODE" != node-2']})}
    )
    cluster.create("a", checked)
    assert cluster.vet_spare("a", "node-2").startswith("health check `sh -c")
    assert cluster.vet_spare("a", "node-2") is None  # no longer a spare: nothing to vet
    node = cluster.pool.read().node("node-2")
    assert node.role == "quarantined" and node.owner is None and "before it was handed out" in node.note
    assert "node-2" not in cluster.inventory("a").free_spares()
    cluster.pool.add(1)
    assert cluster.vet_spare("a", "node-3") is None and cluster.pool.read().node("node-3").role == "free"
