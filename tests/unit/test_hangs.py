"""A stalled step under a derived hang time: hung only on evidence besides the stall (a stopped
process, every rank idle) or past busy_hang_seconds; the policy's own hang time works as before."""

from __future__ import annotations

from lazarus.activities.health import judge
from lazarus.schema import RecoveryPolicy
from lazarus.schema.stacks import odd_ones_out, where_it_waited
from tests.unit.test_health import NOW, observe, rank

DERIVED = RecoveryPolicy(startup_grace_seconds=60, busy_hang_seconds=100)
HANG_AFTER = 1.5  # what activities/pace.py derived from the run's step times


def look(*ranks, policy=DERIVED):
    return judge(observe(*ranks), policy, NOW, NOW - 0.1, 400, hang_after=HANG_AFTER)


def idle(r, step=12, beat_age=2.0, idle_age=2.0):
    quiet = rank(r, step=step, beat_age=beat_age, alive_age=0.05)
    return quiet.model_copy(update={"idle_since": NOW - idle_age})


def test_a_stopped_process_is_found_at_the_derived_hang_time_and_its_node_blamed():
    waiting = [rank(r, step=120, beat_age=1.6, alive_age=0.05) for r in (0, 1, 3)]
    stopped = rank(2, step=120, beat_age=1.55, alive_age=1.55)
    verdict = look(*waiting[:2], stopped, waiting[2])
    fault = verdict.fault
    assert fault.kind == "hang" and fault.nodes == ["node-2"] and fault.rank == 2
    assert not verdict.dump_stacks  # a stopped process cannot answer a dump
    assert "its process has not run for 1.6 s" in fault.reason and "hang time 1.5 s" in fault.reason
    # Before the hang time nothing is judged, stopped or not.
    early = [rank(r, step=120, beat_age=1.2, alive_age=0.05) for r in (0, 1)] + [rank(2, step=120, alive_age=1.2)]
    assert look(*early).fault is None


def test_a_stall_with_every_process_running_and_busy_is_a_save_until_busy_hang_seconds():
    # Rank 0 writes a large checkpoint (CPU busy) while the others wait for it: not a hang.
    saving = rank(0, step=500, beat_age=30, alive_age=0.05)
    waiting = [idle(r, step=500, beat_age=30, idle_age=29) for r in (1, 2)]
    assert look(saving, *waiting).fault is None
    past = [rank(0, step=500, beat_age=101, alive_age=0.05), *(idle(r, step=500, beat_age=101) for r in (1, 2))]
    fault = look(*past).fault
    assert fault.kind == "hang" and "busy_hang_seconds 100" in fault.reason


def test_a_busy_stall_asks_for_stacks_and_a_rank_whose_stack_stood_still_is_hung():
    # Rank 2 loops forever before the step's all-reduce (busy); its peers sleep in the all-reduce.
    spinning = rank(2, step=500, beat_age=16, alive_age=0.05).model_copy(update={"idle_since": NOW - 0.3})
    waiting = [idle(r, step=500, beat_age=16, idle_age=15.5) for r in (0, 1, 3)]
    first = judge(observe(*waiting[:2], spinning, waiting[2]), DERIVED, NOW, NOW - 0.1, 400, hang_after=HANG_AFTER)
    assert first.fault is None and first.probe_stacks  # past busy_probe_seconds (15 s): dump the stacks
    in_reduce = "'/torch/distributed/distributed_c10d.py', line 2806 in all_reduce"
    in_loop = "'/work/train.py', line 41 in spin"
    still = {
        0: (NOW - 10.5, in_reduce),
        1: (NOW - 10.5, in_reduce),
        3: (NOW - 10.5, in_reduce),
        2: (NOW - 10.5, in_loop),
    }
    ranks = (*waiting[:2], spinning, waiting[2])
    verdict = judge(observe(*ranks), DERIVED, NOW, NOW - 0.1, 400, hang_after=HANG_AFTER, still=still)
    fault = verdict.fault
    assert fault.kind == "hang" and fault.rank == 2 and fault.nodes == ["node-2"] and verdict.dump_stacks
    assert "its Python stack has not moved in 10.5 s (recovery.stack_still_seconds 10)" in fault.reason
    assert fault.reason.endswith(in_loop)
    # Still for less than stack_still_seconds: keep dumping.
    young = {r: (NOW - 4, where) for r, (_, where) in still.items()}
    again = judge(observe(*ranks), DERIVED, NOW, NOW - 0.1, 400, hang_after=HANG_AFTER, still=young)
    assert again.fault is None and again.probe_stacks
    # Two ranks, both still, one at work and one asleep: the one at work is blamed.
    pair = {0: (NOW - 11, in_reduce), 2: (NOW - 11, in_loop)}
    both = judge(observe(waiting[0], spinning), DERIVED, NOW, NOW - 0.1, 400, hang_after=HANG_AFTER, still=pair)
    assert both.fault.rank == 2


def test_every_rank_idle_for_the_hang_time_is_a_hang_blaming_the_one_that_went_idle_first():
    # Rank 1 entered a collective the others never join (or deadlocked) first; they followed.
    ranks = [idle(0, idle_age=1.7), idle(1, step=11, idle_age=2.4), idle(2, idle_age=1.6)]
    verdict = look(*ranks)
    fault = verdict.fault
    assert verdict.dump_stacks  # every process runs: each one's stack says where it waits
    assert fault.kind == "hang" and fault.nodes == ["node-1"]
    assert "every rank has sat idle" in fault.reason and "went idle first" in fault.reason
    # One rank still working (no idle_since past the hang time): not every rank is idle.
    assert look(idle(0), idle(1, idle_age=0.3)).fault is None


def test_among_ranks_all_idle_one_whose_process_cannot_run_is_blamed_before_the_first_to_idle():
    # A script without heartbeats (steps from its output): rank 2 was SIGSTOPped, the others wait for
    # it in the next collective, and rank 0's launcher happened to sample it idle first.
    quiet = [
        rank(r, step=None, beat_age=5, alive_age=None).model_copy(update={"idle_since": NOW - age})
        for r, age in ((0, 2.4), (1, 2.0), (2, 1.9), (3, 2.0))
    ]
    assert look(*quiet).fault.nodes == ["node-0"]  # nothing tells them apart but the order they idled in
    quiet[2] = quiet[2].model_copy(update={"held": "T"})
    fault = look(*quiet).fault
    assert fault.kind == "hang" and fault.nodes == ["node-2"] and fault.rank == 2
    assert "rank 2 on node-2 cannot run (process state T)" in fault.reason


def test_a_rank_that_reports_no_steps_is_judged_by_idleness_alone():
    quiet = [
        rank(r, step=None, beat_age=5, alive_age=None).model_copy(update={"idle_since": NOW - 5}) for r in range(2)
    ]
    fault = look(*quiet).fault
    assert fault.kind == "hang" and "every rank has sat idle" in fault.reason
    busy = [quiet[0], quiet[1].model_copy(update={"idle_since": NOW - 0.2})]
    assert look(*busy).fault is None


def test_the_first_step_after_a_restore_gets_the_startup_grace():
    restoring = [rank(r, step=40, beat_age=30, phase="restored", alive_age=0.05) for r in range(2)]
    assert look(*restoring).fault is None
    stopped = [rank(0, step=40, beat_age=30, phase="restored", alive_age=30), restoring[1]]
    assert look(*stopped).fault is None  # loading a checkpoint may hold the GIL: the grace holds
    late = [rank(r, step=40, beat_age=61, phase="restored", alive_age=0.05) for r in range(2)]
    assert look(*late).fault.kind == "hang"


def test_the_policys_own_hang_time_blames_a_stale_rank_whatever_else_is_seen():
    explicit = RecoveryPolicy(hang_after_seconds=10, startup_grace_seconds=60)
    busy = [rank(r, step=12, beat_age=9, alive_age=0.05) for r in range(2)]
    assert judge(observe(*busy), explicit, NOW, NOW - 0.1, 400).fault is None
    busy = [rank(r, step=12, beat_age=11, alive_age=0.05) for r in range(2)]
    verdict = judge(observe(*busy), explicit, NOW, NOW - 0.1, 400)
    assert verdict.fault.kind == "hang" and "no heartbeat for 11.0 s" in verdict.fault.reason


def test_a_rank_done_or_stopped_is_not_hung_however_long_it_takes_to_exit():
    # Rank 1 trained its last step and sits in its teardown (its liveness thread ended with it):
    # the exit grace deals with it, not the hang time.
    done = rank(1, step=8, beat_age=5, phase="done", alive_age=5)
    exited = rank(0, step=8, beat_age=5, phase="done", alive_age=5)
    assert look(exited, done).fault is None
    stopping = [rank(r, step=30, beat_age=5, phase="stopped", alive_age=5) for r in range(2)]
    assert look(*stopping).fault is None


def test_once_a_rank_exited_0_the_ranks_left_are_in_their_teardown_not_hung():
    # A script that reports by its output (no phases): rank 0 is done, rank 1 sits idle forever.
    exited = rank(0, step=8, alive=False, beat_age=3, exit={"code": 0, "time": NOW - 1.5, "step": 8})
    stuck = idle(1, step=8, beat_age=3, idle_age=3)
    assert look(exited, stuck).fault is None


def test_the_report_names_where_the_blamed_rank_waited_innermost_first():
    dump = (
        "Thread 0x00007f0000000001 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n\n'
        "Current thread 0x00007f0000000002 (most recent call first):\n"
        '  File "/venv/torch/distributed/distributed_c10d.py", line 2300 in recv\n'
        '  File "/job/train.py", line 70 in wait_for_the_peer_that_never_comes\n'
        '  File "/job/train.py", line 100 in main\n'
        '  File "/job/train.py", line 130 in <module>\n'
    )
    assert where_it_waited(dump) == (
        '"/venv/torch/distributed/distributed_c10d.py", line 2300 in recv <- '
        '"/job/train.py", line 70 in wait_for_the_peer_that_never_comes <- "/job/train.py", line 100 in main'
    )
    assert where_it_waited("Fatal Python error: Segmentation fault") == "(no frame in the dump)"


def test_of_ranks_stalled_together_the_one_that_waits_elsewhere_is_the_odd_one_out():
    def dump(*frames):
        return "Current thread 0x1 (most recent call first):\n" + "".join(f"  File {f}\n" for f in frames)

    in_step = dump('"/t/c10d.py", line 2500 in all_reduce', '"/t/train.py", line 190 in _sum_over_replicas')
    stuck = dump('"/t/c10d.py", line 2300 in recv', '"/t/session.py", line 80 in wait_for_the_peer_that_never_comes')
    assert odd_ones_out({0: in_step, 1: in_step, 2: stuck, 3: in_step}) == [2]
    assert odd_ones_out({0: in_step, 1: in_step, 2: in_step}) == []  # all at one place: no odd one
    assert odd_ones_out({0: in_step, 1: stuck}) == []  # one against one: no majority
    assert odd_ones_out({0: in_step, 1: in_step, 2: stuck, 3: stuck}) == []
