"""What detect learns of a run's pace: the hang time derived from its step times, and stragglers."""

from __future__ import annotations

from lazarus.activities.look import Verdict
from lazarus.activities.pace import FIRST_STEPS_LOOK_SECONDS, LEARNING_LOOK_SECONDS, MIN_GAPS, STEADY_LOOK_SECONDS, Pace
from lazarus.activities.watching import learning_look, look_again_in
from lazarus.infra.backend import Observation, RankObservation
from lazarus.schema import RecoveryPolicy
from lazarus.schema.node_reports import NodeReading, NodeSummary, StepTime

POLICY = RecoveryPolicy(startup_grace_seconds=60, stragglers={"window_seconds": 5})  # factor 1.2


def node_look(step: int, work: dict[str, float]) -> Observation:
    """A look at a healthy run whose nodes report `work` seconds per step, all at `step`."""
    nodes = []
    for name, seconds in work.items():
        summary = NodeSummary(
            node=name,
            steady=True,
            lowest_step=step,
            highest_step=step,
            oldest_beat=0.0,
            newest_beat=0.0,
            oldest_alive=None,
            by_rank=True,
            trained=True,
            compute_seconds=seconds,
        )
        nodes.append(NodeReading(summary=summary))
    return Observation(incarnation=0, launched_at=0.0, resume_step=0, nodes=nodes)


def run(pace: Pace, steps: int, step_seconds: float, work, start: float = 1000.0, first_step: int = 1):
    """Feed `steps` steps of `step_seconds` each; `work(step)` gives each node's work. Returns the
    first straggler found, and the time it was found."""
    for i in range(steps):
        now = start + i * step_seconds
        found = pace.observe(node_look(first_step + i, work(first_step + i)), first_step + i, now)
        if found is not None:
            return found, now
    return None, None


def test_the_hang_time_is_the_startup_grace_until_enough_steps_then_a_multiple_of_their_p99():
    pace = Pace(POLICY)
    assert pace.hang_after() == 60
    run(pace, MIN_GAPS + 1, 0.12, lambda _: {})
    assert pace.hang_after() == 60  # the first advance ends the restore: it is not a step time
    run(pace, 200, 0.12, lambda _: {}, start=2000.0, first_step=100)
    assert abs(pace.hang_after() - 1.0) < 1e-9  # 5 x 0.12 s is under the floor
    # A checkpoint every 10 steps takes 0.4 s: the 99th percentile holds it.
    pace = Pace(POLICY)
    for i in range(201):
        now = 3000 + i * 0.12 + (i // 10) * 0.28
        pace.observe(node_look(i, {}), i, now)
    assert abs(pace.hang_after() - 5 * 0.40) < 1e-6
    assert Pace(POLICY.model_copy(update={"hang_after_seconds": 30.0})).hang_after() == 30.0


def test_a_node_twice_as_slow_as_its_peers_for_the_window_is_a_straggler_with_its_cost():
    pace = Pace(POLICY)
    fast = {"node-0": 0.1, "node-1": 0.11, "node-2": 0.1, "node-3": 0.1}
    found, _ = run(pace, 100, 0.12, lambda _: fast)
    assert found is None
    found, at = run(pace, 200, 0.22, lambda _: {**fast, "node-2": 0.2}, start=1100.0, first_step=200)
    assert found is not None and found.node == "node-2"
    assert found.work == 0.2 and abs(found.peers - 0.1) < 1e-9
    assert 5 <= at - found.since < 5 + 0.22 * 6  # the window, plus the readings to fill its median
    assert abs(found.cost_seconds - 0.1 * found.steps) < 1e-9 and found.steps >= 20
    assert "node-2's work per step took 0.200 s against its peers' 0.100 s (2.0x" in found.describe(5)


def test_a_run_slow_everywhere_or_a_node_slow_for_a_moment_has_no_straggler():
    pace = Pace(POLICY)
    assert run(pace, 500, 0.24, lambda _: {f"node-{i}": 0.2 for i in range(4)})[0] is None
    # node-1 slow for 3 s of every 6 (a noisy neighbour that comes and goes): never the whole window.
    comes_and_goes = lambda step: {"node-0": 0.1, "node-1": 0.3 if (step // 25) % 2 else 0.1, "node-2": 0.1}  # noqa: E731
    assert run(Pace(POLICY), 500, 0.12, comes_and_goes)[0] is None
    # Nodes a few percent apart, as nodes sharing a machine's cores are: none is slow.
    few_percent = {"node-0": 0.1, "node-1": 0.112, "node-2": 0.095, "node-3": 0.1}
    assert run(Pace(POLICY), 500, 0.12, lambda _: few_percent)[0] is None


def test_stragglers_off_looks_for_none():
    pace = Pace(POLICY.model_copy(update={"stragglers": POLICY.stragglers.model_copy(update={"action": "off"})}))
    assert run(pace, 300, 0.12, lambda _: {"node-0": 0.1, "node-1": 0.5})[0] is None


def quiet_look(idle_since: list[float]) -> Observation:
    """A look at a run whose ranks report no steps: each rank's idle_since (the last sample that saw it work)."""
    ranks = [
        RankObservation(rank=r, node=f"node-{r}", launched=True, alive=True, idle_since=since)
        for r, since in enumerate(idle_since)
    ]
    return Observation(incarnation=0, launched_at=0.0, resume_step=0, nodes=[NodeReading.of_ranks(ranks)])


def test_a_run_without_steps_hangs_after_a_multiple_of_its_longest_quiet_stretch_once_it_worked():
    pace = Pace(POLICY)
    # Starting: every rank waits for its peers before any was seen at work: the startup grace.
    for now in (1000.0, 1001.0, 1002.0):
        pace.observe(quiet_look([1000.0, 1000.0]), None, now)
    assert pace.quiet_after() == 60
    # Working: the newest activity moves with every look; the wait at the start counts as nothing longer.
    for i in range(30):
        pace.observe(quiet_look([1003.0 + 0.1 * i, 1002.9 + 0.1 * i]), None, 1003.0 + 0.1 * i)
    assert pace.quiet_after() == POLICY.quiet_hang_seconds  # 10 s: the stretches were short
    # A slow read: every rank idle for 3 s, then at work again: the hang time is 5 x 3 s from now on.
    for now in (1006.0, 1007.0, 1008.0, 1009.0):
        pace.observe(quiet_look([1005.9, 1005.8]), None, now)
    pace.observe(quiet_look([1008.9, 1009.0]), None, 1009.0)
    assert abs(pace.quiet_after() - 5 * 3.1) < 1e-9
    # The policy's own hang time, where set, is the hang time of every rule.
    assert Pace(POLICY.model_copy(update={"hang_after_seconds": 4.0})).quiet_after() == 4.0


def test_a_rank_whose_main_thread_shows_the_same_frames_dump_after_dump_stood_still_since_the_first():
    pace = Pace(POLICY)

    def dump(*frames: str) -> str:
        return (
            'Thread 0x1 (most recent call first):\n  File "t.py", line 1 in beat\n\n'
            + "Current thread 0x2 (most recent call first):\n"
            + "".join(f'  File "{frame}\n' for frame in frames)
        )

    pace.take_stacks({0: dump('a.py", line 5 in loop'), 1: dump('c10d.py", line 9 in all_reduce')}, 100.0)
    assert pace.still() == {}  # one dump shows nothing of movement
    pace.take_stacks(
        {0: dump('a.py", line 5 in loop'), 1: dump('c10d.py", line 9 in all_reduce', 't.py", line 3 in step')}, 105.0
    )
    assert pace.still() == {0: (100.0, '"a.py", line 5 in loop')}  # rank 1's stack moved
    pace.take_stacks(  # a loop moves between its lines: still all the same
        {0: dump('a.py", line 6 in loop'), 1: dump('c10d.py", line 9 in all_reduce', 't.py", line 3 in step')}, 110.0
    )
    assert pace.still() == {0: (100.0, '"a.py", line 6 in loop'), 1: (105.0, '"c10d.py", line 9 in all_reduce')}
    pace.observe(quiet_look([110.0]), 7, 111.0)  # the step advanced: the run went on
    assert pace.still() == {}


def timed_look(step: int, slowest: tuple[int, float], last: tuple[int, float]) -> Observation:
    """A look at a healthy run of one node whose launcher timed `slowest` and `last` (step, seconds)."""
    observation = node_look(step, {"node-0": 0.01})
    summary = observation.nodes[0].summary
    timed = {"slowest_step": StepTime(step=slowest[0], seconds=slowest[1])}
    timed["last_step"] = StepTime(step=last[0], seconds=last[1])
    observation.nodes[0] = NodeReading(summary=summary.model_copy(update=timed))
    return observation


def test_the_hang_time_comes_from_the_steps_the_launchers_timed_however_seldom_the_looks():
    # A look a second at a run of 0.12 s steps whose every 10th step takes 0.4 s (a checkpoint):
    # the gaps between looks would say 1 s; the launchers' times say what the steps took.
    pace = Pace(POLICY)
    for look in range(200):
        step = 8 * (look + 1)
        slowest = (step - step % 10, 0.4) if step % 10 < 8 else (step - 1, 0.12)
        pace.observe(timed_look(step, slowest, (step, 0.12)), step, 5000.0 + look)
    assert abs(pace.hang_after() - 5 * 0.4) < 1e-9
    # Each step is counted once, however many looks find it in a report.
    pace = Pace(POLICY)
    for look in range(MIN_GAPS + 3):
        pace.observe(timed_look(20 + look, (10, 3.0), (10, 3.0)), 20 + look, 6000.0 + 0.1 * look)
    assert list(pace.gaps) == [3.0] and pace.hang_after() == 60  # still the startup grace: one step timed


def test_a_steady_run_is_looked_at_often_only_while_its_pace_learns_its_step_times():
    verdict = Verdict(step=8, settled_until=7000.0 + 60)  # every node steady, its hang time a minute off
    policy = RecoveryPolicy(heartbeat_interval_seconds=0.1)
    timed = Pace(POLICY)
    assert timed.learning  # no step time yet: the startup grace holds the hang time
    soon = timed.learning_look
    assert look_again_in(verdict, 7000.0, policy, beat_every=5.0, learning=soon) == FIRST_STEPS_LOOK_SECONDS
    for look in range(3):  # each look's reports time two steps
        step = 4 * (look + 1)
        timed.observe(timed_look(step, (step - 1, 0.2), (step, 0.12)), step, 7000.0 + look)
    assert not timed.learning and len(timed.gaps) >= MIN_GAPS
    assert timed.learning_look is None
    assert look_again_in(verdict, 7003.0, policy, beat_every=5.0, learning=None) == STEADY_LOOK_SECONDS
    assert look_again_in(verdict, 7003.0, policy, beat_every=2.0, learning=None) == 2.0  # a heartbeat is due first
    # A progress report or a read of the pool (a regrow's) due sooner than a steady look: the look comes then.
    assert look_again_in(verdict, 7003.0, policy, beat_every=5.0, due=7003.5) == 0.5
    assert look_again_in(verdict, 7003.0, policy, beat_every=5.0, due=7002.0) == 0.0  # overdue: at once
    assert look_again_in(verdict, 7003.0, policy, beat_every=5.0, due=7100.0) == STEADY_LOOK_SECONDS
    # Where no launcher times the steps the looks do: looking seldom would stretch every step time.
    untimed = Pace(POLICY)
    run(untimed, MIN_GAPS + 3, 0.5, lambda _: {})
    assert len(untimed.gaps) >= MIN_GAPS and untimed.learning and untimed.learning_look == LEARNING_LOOK_SECONDS


def test_the_look_that_teaches_the_pace_its_hang_time_is_followed_by_a_learning_look():
    # The look judged its settled_until by the startup grace (a minute), then its reports gave the
    # pace enough step times for a hang time of a second: the next look must not wait a steady one.
    pace = Pace(POLICY)
    for look in range(2):
        step = 4 * (look + 1)
        pace.observe(timed_look(step, (step - 1, 0.2), (step, 0.12)), step, 7000.0 + look)
    judged_by = pace.hang_after()
    assert judged_by == 60 and pace.learning
    pace.observe(timed_look(12, (11, 0.2), (12, 0.12)), 12, 7002.0)
    assert not pace.learning and pace.hang_after() < judged_by
    assert learning_look(pace, judged_by) == LEARNING_LOOK_SECONDS
    assert learning_look(pace, pace.hang_after()) is None  # the next look judges by the hang time learnt
