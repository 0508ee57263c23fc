"""The local backend with stand-in rank processes: idempotent launch, liveness, kill, claims."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from lazarus.infra import runfiles
from lazarus.infra.backend import ClusterError
from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.schema import Assignment, parse_spec
from lazarus.schema.files import read_json
from lazarus.schema.node_reports import read_node_reports

SLEEPER = ["python", "-c", "import time; time.sleep(600)"]


@pytest.fixture
def cluster(tmp_path):
    cluster = LocalCluster(tmp_path)
    yield cluster
    for run in (tmp_path / "runs").glob("*"):
        cluster.stop_run(run.name)


def launch(cluster: LocalCluster, run_id="r1") -> Assignment:
    spec = parse_spec({"name": "r", "cluster": {"active_nodes": 4, "spare_nodes": 1}, "trainer": {"command": SLEEPER}})
    cluster.create(run_id, spec)
    assignment = cluster.commit_assignment(
        run_id,
        Assignment(
            incarnation=0, nodes=["node-0", "node-1", "node-2", "node-3"], layout=spec.layout, master_port=29999
        ),
    )
    cluster.start_ranks(run_id, 0, resume_step=0)
    every_rank_alive(cluster, run_id)
    return assignment


def every_rank_alive(cluster: LocalCluster, run_id: str, incarnation: int = 0) -> None:
    """Wait until the launchers have started every rank (they do so in the background)."""
    deadline = time.monotonic() + 30
    run = cluster.run_dir(run_id)
    while not all(
        r.alive and run.pid_file(incarnation, r.rank).exists() for r in cluster.observe(run_id, incarnation).ranks
    ):
        assert time.monotonic() < deadline, "the launchers did not start every rank within 30 s"
        time.sleep(0.01)


def test_launch_twice_starts_each_rank_once(cluster):
    launch(cluster)
    first = sorted(cluster.live_pids("r1"))
    assert len(first) == 8  # a launcher and a rank per node
    assert cluster.start_ranks("r1", 0, resume_step=99).resume_step == 0  # the first launch's stays
    assert sorted(cluster.live_pids("r1")) == first


def test_kill_node_kills_its_ranks_and_marks_it_dead(cluster):
    launch(cluster)
    before = cluster.observe("r1", 0)
    [victim] = [r for r in before.ranks if r.node == "node-2"]
    run = cluster.run_dir("r1")
    launcher = read_json(run.node_pid_file(0, 2))
    assert launcher["pgid"] == launcher["pid"]  # the launcher leads its node's process group
    assert cluster.kill_node("r1", "node-2") == [launcher["pgid"]]
    after = cluster.observe("r1", 0)
    assert [r.alive for r in after.ranks] == [True, True, False, True]
    assert list(after.dead_nodes) == ["node-2"]
    assert cluster.inventory("r1").node("node-2").healthy is False


def reports(cluster: LocalCluster, run_id: str = "r1") -> list:
    """Every node's report of incarnation 0 (None where there is none yet)."""
    run = cluster.run_dir(run_id)
    nodes = range(len(cluster.assignment(run_id, 0).nodes))
    found = read_node_reports(run, 0, nodes)
    return [found.get(i) for i in nodes]


def test_a_look_reads_each_node_s_report_while_its_launcher_runs(cluster, monkeypatch):
    launch(cluster)
    deadline = time.monotonic() + 30
    while not all(r is not None and all(rank.alive for rank in r.ranks) for r in reports(cluster)):
        assert time.monotonic() < deadline, f"the launchers reported no live ranks within 30 s: {reports(cluster)}"
        time.sleep(0.01)

    def not_read(*args):
        raise AssertionError("a rank's own file was read though its launcher reports it")

    for reader in ("read_heartbeat", "read_exit"):
        monkeypatch.setattr(runfiles, reader, not_read)
    observation = cluster.observe("r1", 0)
    assert [(r.rank, r.node, r.launched, r.alive) for r in observation.ranks] == [
        (i, f"node-{i}", True, True) for i in range(4)
    ]


def test_a_rank_killed_alone_shows_in_its_node_s_report_with_its_exit(cluster):
    launch(cluster)
    run = cluster.run_dir("r1")
    os.kill(read_json(run.pid_file(0, 2))["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while (report := reports(cluster)[2]) is None or report.ranks[0].exit is None:
        assert time.monotonic() < deadline, f"node-2's launcher did not report its rank's end: {report}"
        time.sleep(0.01)
    ended = report.ranks[0]
    assert not ended.alive and ended.exit.signal == "SIGKILL" and ended.exit.by == "launcher"
    seen = cluster.observe("r1", 0).ranks[2]
    assert seen.exit == ended.exit and not seen.alive


def test_kill_unknown_node_is_a_clear_error(cluster):
    launch(cluster)
    with pytest.raises(ClusterError, match="the pool has no node node-9; nodes: node-0, node-1"):
        cluster.kill_node("r1", "node-9")


def test_a_new_controller_sees_and_stops_ranks_it_did_not_start(cluster, tmp_path):
    launch(cluster)
    restarted = LocalCluster(tmp_path)
    assert all(r.alive for r in restarted.observe("r1", 0).ranks)
    assert sorted(restarted.stop_incarnation("r1", 0)) == [0, 1, 2, 3]
    assert not any(r.alive for r in restarted.observe("r1", 0).ranks)
    assert restarted.live_pids("r1") == []


def test_stop_nodes_ends_only_the_ranks_of_those_nodes(cluster):
    launch(cluster)
    run = cluster.run_dir("r1")
    os.kill(read_json(run.pid_file(0, 2))["pid"], signal.SIGSTOP)  # a stopped process is ended all the same
    assert cluster.stop_nodes("r1", 0, ["node-2"]) == [2]
    assert [r.rank for r in cluster.observe("r1", 0).ranks if r.alive] == [0, 1, 3]
    assert cluster.stop_nodes("r1", 0, ["node-2"]) == []  # again: nothing left there
    assert sorted(cluster.stop_incarnation("r1", 0)) == [0, 1, 3]


def test_spares_are_claimed_exactly_once(cluster):
    old = launch(cluster)
    cluster.quarantine("r1", ["node-1"], "test")
    proposal = old.model_copy(update={"incarnation": 1, "nodes": ["node-0", "node-4", "node-2", "node-3"]})
    claimed = cluster.commit_assignment("r1", proposal, claims=["node-4"])
    # A retry (say, after a worker crash) gets the recorded assignment back, even with another port.
    retry = cluster.commit_assignment("r1", proposal.model_copy(update={"master_port": 1234}), claims=["node-4"])
    assert retry == claimed
    assert cluster.inventory("r1").node("node-4").role == "active"
    # Another run of the home cannot claim a node this one holds, and is told who holds it.
    spec = parse_spec(
        {
            "name": "r",
            "layout": {"dp": 1},
            "cluster": {"active_nodes": 1, "spare_nodes": 0},
            "trainer": {"command": SLEEPER},
        }
    )
    cluster.create("r2", spec)
    taken = Assignment(incarnation=1, nodes=["node-4"], layout=spec.layout, master_port=29999)
    with pytest.raises(ClusterError, match="node-4 is no longer a free spare .node-4 is active in run r1"):
        cluster.commit_assignment("r2", taken, claims=["node-4"])
    assert cluster.assignment("r2", 1) is None and "node-4" not in cluster.inventory("r2").free_spares()


def test_stop_right_after_start_leaves_no_process(cluster):
    # Before the launchers have recorded anything: the process groups still catch every rank.
    for attempt in range(3):
        run_id = f"early-{attempt}"
        spec = parse_spec({"name": "r", "trainer": {"command": SLEEPER}})
        cluster.create(run_id, spec)
        nodes = [n.name for n in cluster.inventory(run_id).nodes if n.role == "active"]
        cluster.commit_assignment(run_id, Assignment(incarnation=0, nodes=nodes, layout=spec.layout, master_port=29999))
        cluster.start_ranks(run_id, 0, resume_step=0)
        cluster.stop_incarnation(run_id, 0)
        assert cluster.live_pids(run_id) == [] and not any(r.alive for r in cluster.observe(run_id, 0).ranks)


def test_a_rank_that_ended_is_not_restarted(cluster):
    spec = parse_spec({"name": "r", "cluster": {"active_nodes": 4, "spare_nodes": 1}, "trainer": {"command": SLEEPER}})
    cluster.create("r1", spec)
    cluster.commit_assignment(
        "r1",
        Assignment(
            incarnation=0, nodes=["node-0", "node-1", "node-2", "node-3"], layout=spec.layout, master_port=29999
        ),
    )
    run = cluster.run_dir("r1")
    run.exit_file(0, 1).parent.mkdir(parents=True, exist_ok=True)
    run.exit_file(0, 1).write_text('{"rank": 1, "code": 0, "time": 0, "step": 5, "error": ""}')
    cluster.start_ranks("r1", 0, resume_step=0)
    deadline = time.monotonic() + 30
    while sum(r.alive for r in cluster.observe("r1", 0).ranks) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert [r.alive for r in cluster.observe("r1", 0).ranks] == [True, False, True, True]


def test_partial_checkpoints_are_removed_complete_ones_kept(cluster):
    launch(cluster)
    run = cluster.run_dir("r1")
    for step, complete in ((10, True), (20, False)):
        folder = run.checkpoint(step)
        folder.mkdir(parents=True)
        (folder / ".metadata").write_text("x")
        if complete:
            (folder / "COMMITTED").write_text("{}")
    assert cluster.remove_partial_checkpoints("r1") == [20]
    assert run.checkpoint_steps() == [10] and not run.checkpoint(20).exists()


def test_drain_gives_an_in_flight_checkpoint_its_grace(cluster):
    launch(cluster)
    run = cluster.run_dir("r1")
    assert cluster.await_checkpoint_in_flight("r1", 0, grace=0.1) == (None, False)
    for step in (10, 20):
        run.checkpoint(step).mkdir(parents=True)
        (run.checkpoint(step) / ".metadata").write_text("x")
    (run.checkpoint(10) / "COMMITTED").write_text("{}")
    # Ranks are alive but nobody commits step 20: after the grace it is reported as not committed.
    assert cluster.await_checkpoint_in_flight("r1", 0, grace=0.2) == (20, False)
    # A commit that lands during the grace is waited for.
    committer = threading.Timer(0.05, (run.checkpoint(20) / "COMMITTED").write_text, args=("{}",))
    committer.start()
    assert cluster.await_checkpoint_in_flight("r1", 0, grace=30) == (20, True)
    committer.join()
    assert cluster.await_checkpoint_in_flight("r1", 0, grace=0.1) == (None, False)
