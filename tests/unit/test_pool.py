"""The pool every run of a store shares, on SQLite and on PostgreSQL: spares claimed exactly once
across runs and processes, quarantine that holds for every run, release at the end, and a claimer
killed at any point, or the database restarted under a claim, leaving the pool consistent."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
from datetime import UTC, datetime, timedelta

import pytest

from lazarus.infra import pool_rows
from lazarus.infra.backend import ClusterError, QuarantineRefused
from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.infra.pool import NodePool
from lazarus.infra.store import StoreError, open_store
from lazarus.schema import Assignment, parse_spec
from lazarus.schema.pool import PoolNode, PoolRecord, QuarantineBreaker, SpareWant

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
def two_runs(tmp_path, store_url) -> LocalCluster:
    """Runs a and b of one store, two active nodes each; node-2 is the one spare both see."""
    cluster = LocalCluster(tmp_path, store=store_url)
    launched(cluster, "a")
    launched(cluster, "b")
    return cluster


def test_two_runs_of_a_store_hold_their_own_nodes_and_share_the_spare(two_runs):
    assert active(two_runs, "a") == ["node-0", "node-1"]
    assert active(two_runs, "b") == ["node-3", "node-4"]  # b's launch found node-2 free and left it as the spare
    assert two_runs.inventory("a").free_spares() == two_runs.inventory("b").free_spares() == ["node-2"]
    # A launch retried after a crash finds the nodes it holds, and adds none.
    two_runs.pool.provision("b", 2, 1)
    assert active(two_runs, "b") == ["node-3", "node-4"] and len(two_runs.pool.read().nodes) == 5


def _claim_every_spare(home, store_url, run_id: str, spares: list[str], go, results) -> None:
    """Try to claim each of `spares` for `run_id`, one incarnation each; report the ones won."""
    cluster = LocalCluster(home, store=store_url)
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


def _race(tmp_path, store_url, runs: list[str], spares: list[str]) -> dict[str, list[str]]:
    """Each run, in a process of its own, claims every one of `spares` as soon as all may start."""
    go, results = FORK.Event(), FORK.Queue()
    racers = [FORK.Process(target=_claim_every_spare, args=(tmp_path, store_url, r, spares, go, results)) for r in runs]
    for racer in racers:
        racer.start()
    try:
        go.set()
        return dict(results.get(timeout=120) for _ in racers)
    finally:
        for racer in racers:
            racer.join(timeout=30)
            if racer.is_alive():
                racer.kill()


def test_runs_racing_from_many_processes_claim_every_spare_exactly_once(tmp_path, store_url):
    cluster = LocalCluster(tmp_path, store=store_url)
    runs = ["a", "b", "c", "d"]
    for run_id in runs:
        cluster.create(run_id, spec(active=1, spares=0))
    spares = cluster.pool.add(30)
    won = _race(tmp_path, store_url, runs, spares)
    claims = sorted(node for nodes in won.values() for node in nodes)
    assert claims == sorted(spares)  # each spare won once, by one run: none lost, none twice
    record = cluster.pool.read()
    assert all(record.node(node).owner == run_id for run_id, nodes in won.items() for node in nodes)
    # Each run's assignments name only what it won.
    for run_id, nodes in won.items():
        assigned = [cluster.assignment(run_id, k).nodes[0] for k in range(1, 31) if cluster.assignment(run_id, k)]
        assert assigned == nodes


def test_two_processes_racing_for_the_last_spare_one_wins_and_the_other_is_told_who_holds_it(tmp_path, store_url):
    cluster = LocalCluster(tmp_path, store=store_url)
    for run_id in ("a", "b"):
        cluster.create(run_id, spec(active=1, spares=0))
    [last] = cluster.pool.add(1)
    won = _race(tmp_path, store_url, ["a", "b"], [last])
    [winner] = [run_id for run_id, nodes in won.items() if nodes == [last]]
    [loser] = {"a", "b"} - {winner}
    assert won[loser] == [] and cluster.pool.node(last).owner == winner
    assert cluster.assignment(loser, 1) is None
    with pytest.raises(ClusterError, match=f"{last} is no longer a free spare .{last} is active in run {winner}"):
        proposal = Assignment(incarnation=1, nodes=[last], layout=spec(active=1).layout, master_port=1)
        cluster.commit_assignment(loser, proposal, claims=[last])


def test_a_quarantined_node_stays_out_of_every_run_until_returned(two_runs):
    two_runs.quarantine("a", ["node-1"], "incident 1: node_down")
    assert two_runs.inventory("a").node("node-1").role == "quarantined"
    assert "node-1" not in {n.name for n in two_runs.inventory("b").nodes}
    assert two_runs.run_dir("a").unusable_marker("node-1").exists()  # the standbys' word for it
    with pytest.raises(ClusterError, match="node-1 is no longer a free spare .node-1 is quarantined by a"):
        two_runs.commit_assignment("b", replacing(two_runs, "b", "node-3", "node-1"), claims=["node-1"])
    # b cannot quarantine what a holds either.
    with pytest.raises(ClusterError, match="node-0 belongs to another run .a."):
        two_runs.quarantine("b", ["node-0"], "wrong run")
    two_runs.pool.return_node("node-1")
    assert two_runs.inventory("b").free_spares() == ["node-1", "node-2"]
    assert not two_runs.run_dir("a").unusable_marker("node-1").exists()


def test_an_ended_run_gives_its_active_nodes_back_and_keeps_what_it_quarantined_out(two_runs):
    two_runs.quarantine("a", ["node-1"], "incident 1")
    assert two_runs.release_nodes("a") == ["node-0"]
    assert two_runs.release_nodes("a") == []  # a second release finds nothing
    assert two_runs.inventory("b").free_spares() == ["node-0", "node-2"]
    assert two_runs.pool.node("node-1").role == "quarantined"


def _killed_at(home, store_url, point: str) -> None:
    """Claim node-2 for run a and die by SIGKILL at `point` of the commit."""
    cluster = LocalCluster(home, store=store_url)

    def die(*_args, **_kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "inside the claim's transaction":
        claim = pool_rows.claim_and_release

        def claim_then_die(*args, **kwargs):
            claim(*args, **kwargs)  # the rows are changed, not committed
            die()

        pool_rows.claim_and_release = claim_then_die
    else:
        cluster.record_assignment = die
    cluster.commit_assignment("a", replacing(cluster, "a", "node-1", "node-2"), claims=["node-2"])


@pytest.mark.parametrize("point", ["inside the claim's transaction", "between the claim and the assignment"])
def test_a_claimer_killed_mid_claim_leaves_the_pool_consistent(two_runs, store_url, point):
    home = two_runs.home
    two_runs.quarantine("a", ["node-1"], "incident 1")  # as drain does before the claim
    before = two_runs.pool.read()
    claimer = FORK.Process(target=_killed_at, args=(home, store_url, point))
    claimer.start()
    claimer.join(timeout=60)
    assert claimer.exitcode == -signal.SIGKILL
    record = two_runs.pool.read()
    # What the dead process held of the database went with it: another change goes through at once.
    NodePool(open_store(store_url)).add(1)
    assert two_runs.assignment("a", 1) is None
    if point == "inside the claim's transaction":
        assert record == before  # nothing of the claim reached the pool: the spare is free for b
        assert two_runs.commit_assignment("b", replacing(two_runs, "b", "node-3", "node-2"), claims=["node-2"])
        return
    # The claim is on record though the assignment's file is not: no other run can take the node,
    # and a's retry of the same commit completes it.
    assert record.node("node-2").owner == "a" and record.node("node-2").role == "active"
    with pytest.raises(ClusterError, match="node-2 is no longer a free spare .node-2 is active in run a"):
        two_runs.commit_assignment("b", replacing(two_runs, "b", "node-3", "node-2"), claims=["node-2"])
    retry = two_runs.commit_assignment("a", replacing(two_runs, "a", "node-1", "node-2"), claims=["node-2"])
    assert retry.nodes == ["node-0", "node-2"] and active(two_runs, "a") == ["node-0", "node-2"]
    assert two_runs.assignment("a", 1) == retry
    assert active(two_runs, "b") == ["node-3", "node-4"]


def test_a_claim_retried_with_another_proposal_gets_the_assignment_its_first_attempt_claimed(two_runs):
    """An attempt that claimed node-2 died before it wrote the file; the retry, deciding again, proposes
    another spare: the incarnation keeps what it claimed, and the other spare stays free."""
    extra = two_runs.pool.add(1)[0]
    first = replacing(two_runs, "a", "node-1", "node-2")
    assert two_runs.pool.claim("a", first) == first  # the claim and its record, as the dead attempt left them
    retry = two_runs.commit_assignment("a", replacing(two_runs, "a", "node-1", extra), claims=[extra])
    assert retry == first == two_runs.assignment("a", 1)
    assert two_runs.pool.node(extra).role == "free" and two_runs.pool.node("node-2").owner == "a"


def test_a_need_lodged_again_by_stages_that_ran_again_stays_placed_and_finds_its_claim(two_runs):
    """The stages ran again after their claim (a workflow task timed out inside them): drain lodges
    the same fault's need again, unplaced. The pool keeps it placed, so a run behind it does not
    count a spare that a holds already, and reschedule finds the assignment a claimed."""
    now = datetime.now(UTC)
    need = SpareWant(run_id="a", incarnation=0, needed=1, lost_ranks=1, fault_at=now)
    two_runs.want_spares("a", need)
    assert two_runs.claimed_assignment("a", 1) is None
    first = replacing(two_runs, "a", "node-1", "node-2")
    two_runs.commit_assignment("a", first, claims=["node-2"])
    two_runs.want_spares("a", need)
    [lodged] = two_runs.pool.read().wants
    assert (lodged.placed, lodged.got) == (True, 1)
    assert two_runs.pool.inventory("b", allowance=3).needed_first == 0
    assert two_runs.claimed_assignment("a", 1) == first
    # The next fault's need is a need again.
    later = need.model_copy(update={"incarnation": 1, "fault_at": now + timedelta(seconds=5)})
    two_runs.want_spares("a", later)
    [lodged] = two_runs.pool.read().wants
    assert not lodged.placed and lodged.incarnation == 1


def test_a_database_restarted_under_a_claim_fails_it_whole_and_its_retry_claims_once(tmp_path, postgres_server):
    from tests.support.fixtures import schema_of_its_own

    _, url = schema_of_its_own(postgres_server)
    cluster = LocalCluster(tmp_path, store=url)
    launched(cluster, "a")
    cluster.quarantine("a", ["node-1"], "incident 1")
    claim = pool_rows.claim_and_release
    restarted = []

    def claim_then_restart(*args, **kwargs):
        claim(*args, **kwargs)
        if not restarted:  # the rows are changed and locked, the commit not sent: the server goes down
            postgres_server.restart()
            restarted.append(True)

    proposal = replacing(cluster, "a", "node-1", "node-2")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pool_rows, "claim_and_release", claim_then_restart)
        with pytest.raises(StoreError, match="the store postgresql://lazarus@127.0.0.1"):
            cluster.commit_assignment("a", proposal, claims=["node-2"])
        assert cluster.pool.node("node-2").role == "free" and cluster.assignment("a", 1) is None
        # The activity's retry: a new connection, the claim made once.
        assert cluster.commit_assignment("a", proposal, claims=["node-2"]) == proposal
    assert active(cluster, "a") == ["node-0", "node-2"] and cluster.assignment("a", 1) == proposal


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
    assert not two_runs.run_dir("b").unusable_marker("node-3").exists()  # refused: nothing of it happened
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


def test_a_spare_that_fails_the_run_s_health_check_leaves_the_pool_unclaimed(tmp_path, store_url):
    cluster = LocalCluster(tmp_path, store=store_url)
    checked = spec().model_copy(
        update={"health": spec().health.model_copy(update={"command": ["sh", "-c", 'test "$LAZARUS_NODE" != node-2']})}
    )
    cluster.create("a", checked)
    assert cluster.vet_spare("a", "node-2").startswith("health check `sh -c")
    assert cluster.vet_spare("a", "node-2") is None  # no longer a spare: nothing to vet
    node = cluster.pool.node("node-2")
    assert node.role == "quarantined" and node.owner is None and "before it was handed out" in node.note
    assert "node-2" not in cluster.inventory("a").free_spares()
    cluster.pool.add(1)
    assert cluster.vet_spare("a", "node-3") is None and cluster.pool.node("node-3").role == "free"


def test_a_run_sees_only_the_spares_it_could_take_past_the_needs_that_come_first(tmp_path, store_url):
    """A burst across a fleet lodges a need per run: a run's view counts the needs before its own in the
    store and lists only the spares past them, as many as it may hold, and a few needs by name."""
    pool = NodePool(open_store(store_url))
    pool.add(100)
    now = datetime.now(UTC)
    pool.want(SpareWant(run_id="x", incarnation=0, needed=3, lost_ranks=1, fault_at=now))
    pool.want(SpareWant(run_id="y", incarnation=0, needed=2, lost_ranks=1, fault_at=now, placed=True))
    for i in range(30):  # a burst's needs, each after the others
        pool.want(SpareWant(run_id=f"z{i:02d}", incarnation=0, needed=1, lost_ranks=1, fault_at=now + timedelta(i + 1)))
    # A run with no need lodged (a regrow): every unplaced recovery comes first.
    regrow = pool.inventory("a", allowance=5)
    assert regrow.spares_before == regrow.needed_first == regrow.needed_by_recoveries == 3 + 30
    assert regrow.free_spares() == [f"node-{i}" for i in range(33, 38)]
    assert regrow.spares_for(None, None)[0] == regrow.free_spares()
    assert [w.run_id for w in regrow.wants] == ["x", "y", "z00", "z01", "z02", "z03", "z04", "z05"]
    # Run a's own need, of a higher priority than all: nothing comes before it.
    pool.want(SpareWant(run_id="a", incarnation=0, needed=1, lost_ranks=1, fault_at=now, priority=5))
    first = pool.inventory("a", allowance=5)
    assert first.needed_first == 0 and first.needed_by_recoveries == 33
    assert first.free_spares() == [f"node-{i}" for i in range(5)]
    mine = SpareWant(run_id="a", incarnation=0, needed=1, lost_ranks=1, fault_at=now, priority=5)
    assert first.spares_for(mine, None)[0] == first.free_spares()
    # Its reason names the runs it comes before: the first few of them.
    assert [w.run_id for w in first.wants] == ["x", "z00", "z01", "z02", "z03", "z04", "z05", "z06"]
    # Ranked among the burst: after x and the first ten.
    pool.want(SpareWant(run_id="a", incarnation=0, needed=1, lost_ranks=1, fault_at=now + timedelta(10.5)))
    middle = pool.inventory("a", allowance=5)
    assert middle.needed_first == 3 + 10 and middle.free_spares() == [f"node-{i}" for i in range(13, 18)]
    later = SpareWant(run_id="a", incarnation=0, needed=1, lost_ranks=1, fault_at=now + timedelta(10.5))
    assert middle.spares_for(later, None)[0] == middle.free_spares()
    pool.drop_want("x")
    assert pool.inventory("a", allowance=5).needed_first == 10


def test_an_old_pool_file_is_imported_once_with_a_line_that_says_so(tmp_path, caplog):
    old = PoolRecord(
        nodes=[
            PoolNode(name="node-0", role="active", owner="a", since=datetime.now(UTC), note="a: launch"),
            PoolNode(name="node-3", role="quarantined", owner="a", since=datetime.now(UTC), healthy=False),
            PoolNode(name="node-4", role="free", since=datetime.now(UTC), domain="rack-1"),
        ],
        breaker=QuarantineBreaker(max_fraction=0.25),
    )
    (tmp_path / "pool").mkdir()
    (tmp_path / "pool" / "nodes.json").write_text('{"generation": 7, ' + old.model_dump_json()[1:])
    cluster = LocalCluster(tmp_path)
    assert (tmp_path / "pool" / "nodes.json").exists()  # a backend made and not used touches nothing
    with caplog.at_level(logging.WARNING):
        cluster.pool.read()
    assert "imported the pool's 3 node(s)" in caplog.text and "nodes.json.imported" in caplog.text
    assert cluster.pool.read() == old
    assert not (tmp_path / "pool" / "nodes.json").exists() and (tmp_path / "pool" / "nodes.json.imported").exists()
    assert cluster.pool.add(1) == ["node-5"]  # numbered after the imported ones
    caplog.clear()
    LocalCluster(tmp_path).pool.read()  # nothing to import the second time
    assert "imported" not in caplog.text


def test_workers_with_homes_of_their_own_share_the_runs_folder_and_the_store(tmp_path, store_url):
    """Two workers' backends, each with a home of its own (LAZARUS_HOME), on one runs' folder
    (LAZARUS_RUNS) and one store: each sees the other's runs and pool, and nothing lands in a home."""
    shared = tmp_path / "shared" / "runs"
    first = LocalCluster(tmp_path / "home-1", store=store_url, runs=shared)
    second = LocalCluster(tmp_path / "home-2", store=store_url, runs=shared)
    launched(first, "a")
    assert first.run_dir("a").root == shared / "a" and second.assignment("a", 0).nodes == ["node-0", "node-1"]
    assert second.inventory("a").free_spares() == ["node-2"]
    second.quarantine("a", ["node-1"], "incident 1")  # the standbys' marker lies beside the runs, for every home
    assert first.run_dir("a").unusable_marker("node-1") == shared.parent / "pool" / "unusable" / "node-1"
    assert first.run_dir("a").unusable_marker("node-1").exists()
    claimed = first.commit_assignment("a", replacing(first, "a", "node-1", "node-2"), claims=["node-2"])
    assert second.assignment("a", 1) == claimed
    for home in ("home-1", "home-2"):
        assert not (tmp_path / home / "runs").exists()
