"""Judging an observation: who is blamed, when it happened, completion, hangs."""

from __future__ import annotations

from datetime import UTC, datetime

from lazarus.activities.health import judge
from lazarus.infra.backend import Observation, RankObservation
from lazarus.schema import RecoveryPolicy
from lazarus.schema.contract import Heartbeat, RankExit
from lazarus.schema.node_reports import NodeReading, NodeSummary

POLICY = RecoveryPolicy(hang_after_seconds=10, startup_grace_seconds=60)
NOW = 1_000_000.0


def rank(r, step=7, alive=True, exit=None, beat_age=0.5, phase="training", alive_age=None):
    """Rank r of an observation; `exit` holds the exit record's fields but the rank; `alive_age`:
    how long ago its liveness thread last wrote (None: a writer without one)."""
    alive_at = None if alive_age is None else NOW - alive_age
    heartbeat = Heartbeat(rank=r, step=step, phase=phase, time=NOW - beat_age, alive_at=alive_at)
    ended = RankExit(rank=r, **exit) if exit is not None else None
    return RankObservation(rank=r, node=f"node-{r}", launched=True, alive=alive, heartbeat=heartbeat, exit=ended)


def observe(*ranks, dead=None, incarnation=2, addresses=None):
    return Observation(
        incarnation=incarnation,
        launched_at=NOW - 100,
        resume_step=0,
        nodes=[NodeReading.of_ranks(list(ranks))],
        dead_nodes=dead or {},
        node_addresses=addresses or {},
    )


def test_healthy_ranks_report_the_slowest_step():
    verdict = judge(observe(rank(0, step=9), rank(1, step=8)), POLICY, NOW, NOW - 0.1, 40)
    assert verdict.fault is None and not verdict.completed and verdict.step == 8


def test_node_the_backend_saw_die_is_blamed_with_its_death_time():
    died = datetime.fromtimestamp(NOW - 0.3, UTC)
    verdict = judge(observe(rank(0), rank(1, alive=False), dead={"node-1": died}), POLICY, NOW, NOW - 0.1, 40)
    fault = verdict.fault
    assert fault.kind == "node_down" and fault.nodes == ["node-1"] and fault.incarnation == 2
    assert fault.occurred_at == died and fault.detected_at.timestamp() == NOW and fault.step == 7


def test_killed_rank_is_blamed_not_the_peers_that_failed_after_it():
    collateral = {"code": 1, "time": NOW - 0.05, "step": 7, "error": "Connection reset by peer"}
    sigkill = {"code": -9, "signal": "SIGKILL", "time": NOW - 0.06, "step": 7, "error": "", "by": "launcher"}
    verdict = judge(
        observe(rank(0, alive=False, exit=collateral), rank(1, alive=False, exit=sigkill), rank(2)),
        POLICY,
        NOW,
        NOW - 0.1,
        40,
    )
    assert verdict.fault.kind == "rank_exit" and verdict.fault.nodes == ["node-1"]
    assert "killed by SIGKILL" in verdict.fault.reason
    # Its launcher timed its end: the fault happened then, not at the previous look.
    assert verdict.fault.occurred_at.timestamp() == NOW - 0.06


def test_a_rank_gone_with_its_launcher_died_after_the_last_look():
    gone = rank(1, alive=False).model_copy(update={"launcher_alive": False})
    verdict = judge(observe(rank(0), gone), POLICY, NOW, NOW - 0.7, 40)
    assert verdict.fault.kind == "rank_exit" and verdict.fault.nodes == ["node-1"]
    assert verdict.fault.occurred_at.timestamp() == NOW - 0.7


def test_a_rank_that_failed_on_its_own_is_the_programs_failure_and_blames_no_node():
    first = {"code": 3, "time": NOW - 2, "step": 7, "error": "ValueError: bad batch"}
    later = {"code": 1, "time": NOW - 1, "step": 7, "error": "Connection reset by peer"}
    verdict = judge(
        observe(rank(0, alive=False, exit=later), rank(1, alive=False, exit=first)), POLICY, NOW, NOW - 0.1, 40
    )
    fault = verdict.fault
    assert fault.kind == "rank_error" and fault.nodes == [] and (fault.rank, fault.node) == (1, "node-1")
    assert "code 3: ValueError: bad batch" in fault.reason and fault.error == "ValueError: bad batch"
    assert fault.occurred_at.timestamp() == NOW - 2


def test_the_root_cause_beats_a_peers_follow_on_error_that_came_first():
    # Rank 2's broken collective is recorded 0.4 ms before rank 3's own exception.
    follow_on = {"code": 1, "time": NOW - 1.0004, "step": 7, "error": "RuntimeError: Connection closed by peer"}
    cause = {"code": 1, "time": NOW - 1, "step": 7, "error": "EOFError: Ran out of input"}
    while_raising = observe(rank(0), rank(1), rank(2, alive=False, exit=follow_on), rank(3, beat_age=1.5))
    assert judge(while_raising, POLICY, NOW, NOW - 0.1, 40).fault is None  # rank 3 may be about to record
    recorded = observe(rank(0), rank(1), rank(2, alive=False, exit=follow_on), rank(3, alive=False, exit=cause))
    fault = judge(recorded, POLICY, NOW, NOW - 0.1, 40).fault
    assert fault.kind == "rank_error" and fault.rank == 3 and fault.error == "EOFError: Ran out of input"
    assert fault.nodes == [] and "then 1 other rank(s) failed" in fault.reason


def test_ranks_still_running_past_the_exit_grace_after_another_exited_0_are_ended_and_the_run_completes():
    done = {"code": 0, "time": NOW - 1, "step": 40, "error": ""}
    stuck = rank(1, step=40, beat_age=1)
    within = judge(observe(rank(0, alive=False, exit=done), stuck), POLICY, NOW, NOW - 0.1, 40)
    assert within.fault is None and not within.completed and within.lingering == []
    past = NOW - 1 + POLICY.exit_grace_seconds + 0.1
    verdict = judge(observe(rank(0, alive=False, exit=done), rank(1, step=40, beat_age=1)), POLICY, past, past, 40)
    assert verdict.completed and verdict.fault is None and verdict.lingering == [1] and verdict.step == 40
    assert any("rank(s) 1 on node-1 did not exit" in warning for warning in verdict.warnings)
    # A trainer's rank that exited before the last step is not the end of training.
    early = {"code": 0, "time": NOW - 30, "step": 12, "error": ""}
    assert not judge(observe(rank(0, alive=False, exit=early), rank(1)), POLICY, NOW, NOW, 40).completed
    # A script that reports no steps decides its own end.
    quiet_done = {"code": 0, "time": NOW - 30}
    verdict = judge(observe(silent(0, False, quiet_done), silent(1)), POLICY, NOW, NOW, 40)
    assert verdict.completed and verdict.lingering == [1] and verdict.step is None


def test_clean_exits_of_every_rank_are_completion():
    done = {"code": 0, "time": NOW - 1, "step": 40, "error": ""}
    verdict = judge(
        observe(rank(0, alive=False, exit=done), rank(1, alive=False, exit=done)), POLICY, NOW, NOW - 0.1, 40
    )
    assert verdict.completed and verdict.fault is None and verdict.step == 40


def test_clean_exits_before_the_last_step_are_a_stop():
    stopped = {"code": 0, "time": NOW - 1, "step": 17, "error": ""}
    verdict = judge(
        observe(rank(0, alive=False, exit=stopped), rank(1, alive=False, exit=stopped)), POLICY, NOW, NOW - 0.1, 40
    )
    assert verdict.stopped and not verdict.completed and verdict.fault is None and verdict.step == 17


def test_one_rank_finished_while_another_still_runs_is_not_yet_completion():
    done = {"code": 0, "time": NOW - 1, "step": 40, "error": ""}
    verdict = judge(observe(rank(0, alive=False, exit=done), rank(1, step=40)), POLICY, NOW, NOW - 0.1, 40)
    assert not verdict.completed and verdict.fault is None
    exiting = judge(
        observe(rank(0, alive=False, exit=done), rank(1, alive=True, exit=done)), POLICY, NOW, NOW - 0.1, 40
    )
    assert not exiting.completed and exiting.fault is None


def test_stale_heartbeat_is_a_hang_blaming_the_rank_that_got_least_far():
    verdict = judge(
        observe(rank(0, step=12, beat_age=11), rank(1, step=11, beat_age=12), rank(2, step=12, beat_age=11)),
        POLICY,
        NOW,
        NOW - 0.1,
        40,
    )
    assert verdict.fault.kind == "hang" and verdict.fault.nodes == ["node-1"]
    assert "no heartbeat for 12.0 s" in verdict.fault.reason


def test_of_ranks_stalled_at_one_step_the_hang_blames_the_one_whose_process_stopped():
    # Rank 2 was stopped (SIGSTOP, a cut-off host) just after its last step's heartbeat, so its
    # heartbeat is the newest; its peers wait in the next collective, their processes running.
    waiting = [rank(r, step=12, beat_age=11.5, alive_age=0.05) for r in (0, 1, 3)]
    stopped = rank(2, step=12, beat_age=11, alive_age=11)
    verdict = judge(observe(*waiting[:2], stopped, waiting[2]), POLICY, NOW, NOW - 0.1, 40)
    assert verdict.fault.kind == "hang" and verdict.fault.nodes == ["node-2"]
    # The first look past the hang time: the waiting ranks' heartbeats, a few ms older than the
    # stopped one's, pass it first; the stopped one is blamed all the same.
    first_look = [rank(r, step=12, beat_age=10.01, alive_age=0.05) for r in (0, 1, 3)]
    stopped = rank(2, step=12, beat_age=9.99, alive_age=9.99)
    verdict = judge(observe(*first_look[:2], stopped, first_look[2]), POLICY, NOW, NOW - 0.1, 40)
    assert verdict.fault.kind == "hang" and verdict.fault.nodes == ["node-2"]
    # Every process running, every step stalled (a deadlock): the rank that got least far, as before.
    deadlocked = [rank(0, step=12, beat_age=11, alive_age=0.05), rank(1, step=11, beat_age=12, alive_age=0.05)]
    assert judge(observe(*deadlocked), POLICY, NOW, NOW - 0.1, 40).fault.nodes == ["node-1"]


def test_ranks_that_gave_up_on_a_peer_that_never_started_blame_its_node():
    timeout = "DistStoreError: wait timeout after 35000ms, keys: /default_pg/0//cpu//0/0"
    waited = [
        rank(r, step=35, alive=False, exit={"code": 1, "time": NOW - 1, "step": 35, "error": timeout}) for r in (0, 1)
    ]
    missing = RankObservation(rank=2, node="node-2", launched=False, alive=False)
    verdict = judge(observe(*waited, missing, incarnation=3), POLICY, NOW, NOW - 0.1, 40)
    assert verdict.fault.kind == "rank_exit" and verdict.fault.nodes == ["node-2"]
    assert "rank(s) 2 never started" in verdict.fault.reason
    # A rank that failed on its own is blamed, whoever has not started yet.
    own = [rank(0, step=35, alive=False, exit={"code": 1, "time": NOW - 1, "step": 35, "error": "ValueError: bad"})]
    fault = judge(observe(*own, missing, incarnation=3), POLICY, NOW, NOW - 0.1, 40).fault
    assert fault.kind == "rank_error" and fault.nodes == [] and fault.rank == 0


def test_starting_ranks_get_the_startup_grace():
    slow_start = rank(0, step=0, beat_age=30, phase="starting")
    assert judge(observe(slow_start), POLICY, NOW, NOW - 0.1, 40).fault is None
    too_slow = rank(0, step=0, beat_age=61, phase="starting")
    assert judge(observe(too_slow), POLICY, NOW, NOW - 0.1, 40).fault.kind == "hang"


def test_a_rank_gone_while_its_launcher_writes_its_record_is_not_judged_yet():
    pending = RankObservation(
        rank=1,
        node="node-1",
        launched=True,
        alive=False,
        launcher_alive=True,
        heartbeat=Heartbeat(rank=1, step=7, phase="training", time=NOW - 0.5),
    )
    assert judge(observe(rank(0), pending), POLICY, NOW, NOW - 0.1, 40).fault is None
    pending.launcher_alive = False  # the whole node went: nobody will write it
    assert judge(observe(rank(0), pending), POLICY, NOW, NOW - 0.1, 40).fault.nodes == ["node-1"]


def test_every_rank_failing_before_its_first_step_restarts_in_place_once():
    failed = {"code": 3, "time": NOW - 1, "step": 0, "error": "ValueError: no such dataset"}
    starting = dict(step=0, phase="starting")
    first_launch = dict(incarnation=0)
    both = judge(
        observe(
            rank(0, alive=False, exit=failed, **starting), rank(1, alive=False, exit=failed, **starting), **first_launch
        ),
        POLICY,
        NOW,
        NOW - 0.1,
        40,
    )
    # A first failure, even of every rank at once, may be transient: restarted in place, no node blamed
    # (the same failure again is the crash loop: tests/unit/test_crash_loop.py).
    assert both.fault.kind == "rank_error" and both.fault.exit_code == 3 and both.fault.nodes == []
    assert "before the run's first step, within 99.0 s of its start" in both.fault.reason
    # One rank failed a second ago and the other still runs: give it a moment to fail too...
    one = observe(rank(0, alive=False, exit=failed, **starting), rank(1, **starting), **first_launch)
    assert judge(one, POLICY, NOW, NOW - 0.1, 40).fault is None
    # ...past that, it is that rank's own failure: restarted in place, no node blamed.
    assert judge(one, POLICY, NOW + 5, NOW + 4.9, 40).fault.kind == "rank_error"


def test_a_node_gone_silent_while_its_peers_lost_it_is_blamed_once_they_had_time_to_report():
    # Rank 2's node died; the backend does not know it yet (its pod still looks alive), so only
    # the survivors' errors arrive: each lost its connection to a peer.
    def lost(at: float) -> dict:
        return {
            "code": 1,
            "time": at,
            "step": 7,
            "error": "RuntimeError: [pair.cc:553] Connection closed by peer [10.0.0.3]:7090",
        }

    ranks = (
        rank(0, alive=False, exit=lost(NOW - 0.5)),
        rank(1, alive=False, exit=lost(NOW - 0.4)),
        rank(2, beat_age=0.8),
    )
    early = judge(observe(*ranks), POLICY, NOW, NOW - 0.1, 40)
    assert early.fault is None  # within the settle time the silent rank may still report
    verdict = judge(observe(*ranks), POLICY, NOW + 2, NOW - 0.1, 40)
    assert verdict.fault.kind == "node_down" and verdict.fault.nodes == ["node-2"]
    assert verdict.fault.occurred_at.timestamp() == NOW - 0.5 and "went silent" in verdict.fault.reason


def test_a_rank_that_failed_on_its_own_is_blamed_though_its_peers_are_silent():
    # With NCCL the peers of a crashed rank block in the collective rather than exit: silent,
    # but the first error is not a lost peer, so its rank is the cause.
    crash = {"code": 1, "time": NOW - 3, "step": 7, "error": "RuntimeError: CUDA error: an illegal memory access"}
    verdict = judge(
        observe(rank(0, alive=False, exit=crash), rank(1, beat_age=3.5), rank(2, beat_age=3.5)),
        POLICY,
        NOW,
        NOW - 0.1,
        40,
    )
    assert verdict.fault.kind == "rank_error" and verdict.fault.nodes == [] and verdict.fault.rank == 0


def test_a_peer_that_reports_after_the_first_loss_is_not_silent():
    lost = {"code": 1, "time": NOW - 3, "step": 7, "error": "Connection reset by peer"}
    later = {"code": 1, "time": NOW - 2.9, "step": 7, "error": "Connection reset by peer"}
    verdict = judge(
        observe(rank(0, alive=False, exit=lost), rank(1, alive=False, exit=later)), POLICY, NOW, NOW - 0.1, 40
    )
    # No rank failed on its own and no node went silent: no evidence against a node.
    assert verdict.fault.kind == "rank_error" and verdict.fault.nodes == [] and verdict.fault.rank == 0


def test_of_two_silent_nodes_the_one_the_errors_name_is_blamed():
    # node-3 is a survivor slow to notice; the survivors that failed name node-2's address.
    lost = {
        "code": 1,
        "time": NOW - 3,
        "step": 7,
        "error": "RuntimeError: [pair.cc:553] Connection closed by peer [10.0.0.2]:7090. This is typically...",
    }
    ranks = (
        rank(0, alive=False, exit=lost),
        rank(1, alive=False, exit=lost),
        rank(2, beat_age=3.5),
        rank(3, beat_age=3.5),
    )
    addresses = {f"node-{i}": f"10.0.0.{i}" for i in range(4)}
    verdict = judge(observe(*ranks, addresses=addresses), POLICY, NOW, NOW - 0.1, 40)
    assert verdict.fault.kind == "node_down" and verdict.fault.nodes == ["node-2"]
    # Without addresses (or errors that name none) both silent nodes are suspects.
    verdict = judge(observe(*ranks), POLICY, NOW, NOW - 0.1, 40)
    assert verdict.fault.nodes == ["node-2", "node-3"]


def silent(r, alive=True, exit=None):
    """Rank r of a script that writes no heartbeat (a plain torchrun script)."""
    ended = RankExit(rank=r, step=None, **exit) if exit is not None else None
    return RankObservation(rank=r, node=f"node-{r}", launched=True, alive=alive, exit=ended)


def from_output(r, step, beat_age=0.5):
    """Rank r whose launcher read `step` in its output (trainer.progress_pattern)."""
    beat = Heartbeat(rank=r, step=step, phase="training", time=NOW - beat_age, first_step_at=NOW - 5, by="launcher")
    return RankObservation(rank=r, node=f"node-{r}", launched=True, alive=True, heartbeat=beat)


def test_a_script_that_reports_nothing_has_an_unknown_step_and_is_never_judged_hung():
    quiet = observe(silent(0), silent(1))
    verdict = judge(quiet, POLICY, NOW + 3600, NOW + 3599.9, 40)
    assert verdict.fault is None and verdict.step is None and verdict.source is None and verdict.up
    # Where the spec says the ranks write heartbeats (the built-in trainer), silence is a hang.
    quiet.heartbeats_expected = True
    assert judge(quiet, POLICY, NOW + 3600, NOW + 3599.9, 40).fault.kind == "hang"


def test_every_rank_of_a_script_that_reports_nothing_exiting_0_is_completion():
    done = {"code": 0, "time": NOW - 1}
    verdict = judge(observe(silent(0, False, done), silent(1, False, done)), POLICY, NOW, NOW - 0.1, 40)
    assert verdict.completed and not verdict.stopped and verdict.fault is None and verdict.step is None


def test_steps_read_from_output_count_the_ranks_that_print_them():
    verdict = judge(observe(from_output(0, 12), from_output(1, 11), silent(2)), POLICY, NOW, NOW - 0.1, 40)
    assert verdict.source == "output" and verdict.step == 11 and verdict.fault is None
    stale = judge(observe(from_output(0, 12, beat_age=11), silent(1)), POLICY, NOW, NOW - 0.1, 40)
    assert stale.fault.kind == "hang" and stale.fault.rank == 0  # no step line for hang_after_seconds


def test_a_script_that_reports_nothing_failing_says_when_not_which_step():
    failed = {"code": 3, "time": NOW - 0.5}
    everyone = observe(silent(0, False, failed), silent(1, False, failed), incarnation=0)
    everyone.launched_at = NOW - 2.6
    young = judge(everyone, POLICY, NOW, NOW - 0.1, 40).fault
    assert young.kind == "rank_error" and young.nodes == []
    assert "within 2.1 s of its start; the script reports no steps" in young.reason
    assert "before" not in young.reason  # nothing says whether it trained
    everyone.launched_at = NOW - 3600
    old = judge(everyone, POLICY, NOW, NOW - 0.1, 40).fault
    assert old.kind == "rank_error" and "3600 s after its start; the script reports no steps" in old.reason


def test_an_exception_whose_message_speaks_of_a_timeout_is_still_the_rank_s_own():
    own = {"code": 1, "time": NOW - 3, "step": 7, "error": "AttributeError: 'Config' object has no attribute 'timeout'"}
    lost = {"code": 1, "time": NOW - 2.9, "step": 7, "error": "RuntimeError: Connection closed by peer [10.0.0.3]:7090"}
    fault = judge(observe(rank(0, alive=False, exit=lost), rank(1, alive=False, exit=own)), POLICY, NOW, NOW, 40).fault
    assert fault.kind == "rank_error" and fault.rank == 1 and "AttributeError" in fault.reason
    assert "lost a peer" not in fault.reason and "no node is blamed" in fault.reason


def test_ranks_that_only_lost_their_peers_are_named_as_witnesses_never_as_failing_on_their_own():
    reset = {"code": 1, "time": NOW - 3, "step": 7, "error": "RuntimeError: Connection reset by peer"}
    later = dict(reset, time=NOW - 2.9)
    fault = judge(
        observe(rank(0, alive=False, exit=reset), rank(1, alive=False, exit=later)), POLICY, NOW, NOW, 40
    ).fault
    assert fault.kind == "rank_error" and fault.rank == 0 and fault.nodes == []
    assert "every rank that failed lost a peer or gave up waiting for one, and no node went silent" in fault.reason
    assert "for a reason of its own" not in fault.reason


def test_a_silent_node_whose_launcher_reported_after_the_loss_is_a_survivor_not_a_suspect():
    # Every node is one address (as on the Kubernetes emulator), so the errors name both silent
    # nodes; node-3's ranks block in the collective on a loaded host, but its launcher reported
    # after the first loss: it outlived the fault. node-2's last report precedes it.
    lost = {"code": 1, "time": NOW - 3, "step": 7, "error": "Connection reset by peer [127.0.0.1]:47767"}
    ranks = [rank(0, alive=False, exit=lost), rank(1, alive=False, exit=lost), rank(2, beat_age=3.5)]
    ranks.append(rank(3, beat_age=3.5))
    reported = {0: NOW - 2.9, 1: NOW - 2.9, 2: NOW - 3.4, 3: NOW - 0.2}
    nodes = [NodeReading(NodeSummary.of(r.node, [r], reported_at=reported[r.rank]), ranks=[r]) for r in ranks]
    observation = Observation(
        incarnation=2,
        launched_at=NOW - 100,
        resume_step=0,
        nodes=nodes,
        dead_nodes={},
        node_addresses={f"node-{i}": "127.0.0.1" for i in range(4)},
    )
    verdict = judge(observation, POLICY, NOW, NOW - 0.1, 40)
    assert verdict.fault.kind == "node_down" and verdict.fault.nodes == ["node-2"], verdict.fault.reason
