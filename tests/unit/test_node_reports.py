"""A node's report: its summary line, read back, and a look that judges steady nodes by their
summaries alone reaches the verdict it reaches from every rank."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lazarus.activities.health import judge
from lazarus.infra.backend import Observation
from lazarus.schema import RecoveryPolicy
from lazarus.schema.contract import ContractError, Heartbeat, RankExit, RankObservation
from lazarus.schema.node_reports import (
    NodeReading,
    NodeReport,
    NodeSummary,
    read_node_reports,
    write_node_report,
)
from lazarus.schema.rundir import RunDir
from lazarus.trainer.agent.node_report import STEP_WINDOW_SECONDS, StepTimes

NOW = 1_000_000.0
POLICY = RecoveryPolicy(hang_after_seconds=10, startup_grace_seconds=30, heartbeat_interval_seconds=0.5)
# Few distinct ages, around the policy's limits (hang after 10 s, a process stopped after 2.5 s),
# so that draws meet at them: a heartbeat as old as an exit, a node just past a limit.
BEAT_AGES = (0.1, 1.0, 2.0, 5.0, 10.0, 11.0, 35.0)
ERRORS = ("", "Connection reset by peer [10.0.0.1]:29500", "wait timeout", "ValueError: bad")


@st.composite
def heartbeats(draw, rank: int):
    step = draw(st.one_of(st.none(), st.integers(0, 9)))
    return Heartbeat(
        rank=rank,
        step=step,
        phase=draw(st.sampled_from(["starting", "joined", "restored", "training", "done", "stopped"])),
        time=NOW - draw(st.sampled_from(BEAT_AGES)),
        first_step_at=draw(st.one_of(st.none(), st.just(NOW - 50))),
        by=draw(st.sampled_from(["rank", "launcher"])),
        warning=draw(st.one_of(st.none(), st.just("a checkpoint was lost to a full disk"))),
        alive_at=draw(st.one_of(st.none(), st.sampled_from([NOW - 0.1, NOW - 2.0, NOW - 3.0]))),
    )


@st.composite
def exits(draw, rank: int):
    killed = draw(st.booleans())
    return RankExit(
        rank=rank,
        code=-9 if killed else draw(st.sampled_from([0, 1])),
        signal="SIGKILL" if killed else None,
        step=draw(st.one_of(st.none(), st.integers(0, 9))),
        time=NOW - draw(st.sampled_from([0.5, 1.5, 3.0])),
        error="" if killed else draw(st.sampled_from(ERRORS)),
    )


@st.composite
def nodes(draw, index: int, per_node: int):
    """One node's ranks: steady (every rank trains), lost a peer (every rank failed on a peer's
    address), ended (every rank exited with code 0), or anything (each rank may lack a launch, a
    process, a heartbeat, or have an exit)."""
    kind = draw(st.sampled_from(["steady", "lost_peer", "ended", "any"]))
    ranks = []
    for rank in range(index * per_node, (index + 1) * per_node):
        beat = draw(heartbeats(rank))
        if kind == "steady":
            beat = beat.model_copy(update={"step": beat.step or 3, "phase": "training", "warning": None})
        elif kind == "any":
            beat = draw(st.one_of(st.none(), st.just(beat)))
        ended = None
        if kind == "lost_peer":
            address = draw(st.sampled_from(["10.0.0.0", "10.0.0.1", "10.0.0.2"]))
            ended = draw(exits(rank)).model_copy(
                update={"code": 1, "signal": None, "error": f"Connection reset by peer [{address}]:29500"}
            )
        elif kind == "ended":
            ended = draw(exits(rank)).model_copy(update={"code": 0, "signal": None, "error": ""})
        elif kind == "any" and not draw(st.integers(0, 3)):
            ended = draw(exits(rank))
        ranks.append(
            RankObservation(
                rank=rank,
                node=f"node-{index}",
                launched=kind != "any" or draw(st.integers(0, 6)) > 0,
                alive=ended is None and (kind != "any" or draw(st.integers(0, 6)) > 0),
                heartbeat=beat,
                exit=ended,
                launcher_alive=draw(st.booleans()),
            )
        )
    return ranks


@st.composite
def observations(draw):
    """Every node's ranks, and the rest of an observation."""
    count, per_node = draw(st.integers(1, 5)), draw(st.integers(1, 3))
    ranks = [draw(nodes(i, per_node)) for i in range(count)]
    dead = draw(st.sets(st.integers(0, count - 1), max_size=1))
    fields = {
        "incarnation": draw(st.sampled_from([0, 2])),
        "launched_at": NOW - draw(st.sampled_from([5.0, 100.0])),
        "resume_step": draw(st.sampled_from([0, 2])),
        "dead_nodes": {f"node-{i}": datetime.fromtimestamp(NOW - 1, UTC) for i in dead},
        "launchers_alive": draw(st.integers(0, count)),
        "node_addresses": {f"node-{i}": f"10.0.0.{i}" for i in range(count)},
        "steps_from": draw(st.sampled_from([None, "trainer", "output"])),
        "heartbeats_expected": draw(st.booleans()),
    }
    return ranks, fields


def reading(ranks: list[RankObservation]) -> NodeReading:
    """The node as a look reads its report: the summary, the ranks parsed on use."""
    report = NodeReport(node=ranks[0].node, time=NOW, ranks=ranks).model_dump_json(exclude_defaults=True)
    return NodeReading(NodeSummary.of(ranks[0].node, ranks), report=report.encode())


@settings(max_examples=400, deadline=None)
@given(observations())
def test_a_look_by_summaries_reaches_the_verdict_of_a_look_at_every_rank(drawn):
    ranks, fields = drawn
    every_rank = Observation(nodes=[NodeReading.of_ranks(on_node) for on_node in ranks], **fields)
    summarized = Observation(nodes=[reading(on_node) for on_node in ranks], **fields)
    by_summaries = judge(summarized, POLICY, NOW, NOW - 0.5, 10)
    # Only summaries tell that every node is steady (when to look again): the verdict is the same.
    assert dataclasses.replace(by_summaries, settled_until=None) == judge(every_rank, POLICY, NOW, NOW - 0.5, 10)


def training(node: int, step: int = 5, beat_age: float = 0.2) -> list[RankObservation]:
    beat = {"step": step, "phase": "training", "time": NOW - beat_age, "alive_at": NOW - 0.1, "first_step_at": NOW - 9}
    return [
        RankObservation(rank=r, node=f"node-{node}", launched=True, alive=True, heartbeat=Heartbeat(rank=r, **beat))
        for r in (2 * node, 2 * node + 1)
    ]


def test_a_look_reads_the_ranks_only_of_nodes_whose_summary_shows_something():
    # The steady nodes' reports are not even valid: a look that parsed them would fail.
    steady = [NodeReading(NodeSummary.of(f"node-{i}", training(i)), report=b"unread") for i in range(3)]
    lagging = reading(training(3, step=4, beat_age=12.0))  # older than hang_after: its ranks are read
    observation = Observation(0, NOW - 60, 0, nodes=[*steady, lagging], launchers_alive=4)
    verdict = judge(observation, POLICY, NOW, NOW - 0.5, 10)
    assert verdict.fault.kind == "hang" and verdict.fault.nodes == ["node-3"] and verdict.fault.rank == 6
    assert verdict.fault.step == 5
    healthy = Observation(0, NOW - 60, 0, nodes=steady, launchers_alive=3)
    assert judge(healthy, POLICY, NOW, NOW - 0.5, 10).step == 5
    with pytest.raises(ContractError, match="not a NodeReport"):
        assert healthy.ranks  # every rank, when asked for, is parsed


def test_a_report_is_read_back_as_written_and_a_torn_one_is_refused(tmp_path):
    run = RunDir(tmp_path / "run")
    ranks = training(1) + [RankObservation(rank=4, node="node-1", launched=True, alive=False)]
    write_node_report(run, 3, 1, NodeReport(node="node-1", time=NOW, ranks=ranks))
    read = read_node_reports(run, 3, [0, 1])
    assert list(read) == [1]
    assert read[1].summary == NodeSummary.of("node-1", ranks, reported_at=NOW) and not read[1].summary.steady
    assert read[1].ranks == ranks
    run.node_report_file(3, 0).write_text('{"node": "node-0"}')
    with pytest.raises(ContractError, match=r"0\.report\.json: not a node report"):
        read_node_reports(run, 3, [0])


def test_a_bad_summary_among_good_ones_is_named_by_its_file(tmp_path):
    """The summaries are parsed in one call; a line that is no summary, or two of them, is still
    refused with the file it came from, and never shifts another node's summary onto a node."""
    run = RunDir(tmp_path / "run")
    for index in range(3):
        write_node_report(run, 0, index, NodeReport(node=f"node-{index}", time=NOW, ranks=training(index)))
    read = read_node_reports(run, 0, range(3))
    assert [read[i].summary.node for i in range(3)] == ["node-0", "node-1", "node-2"]
    report = run.node_report_file(0, 1)
    summary, rest = report.read_text().split("\n", 1)
    report.write_text(f'{{"node": "node-1"}}\n{rest}')
    with pytest.raises(ContractError, match=r"/1\.report\.json: not a NodeSummary"):
        read_node_reports(run, 0, range(3))
    report.write_text(f"{summary},{summary}\n{rest}")  # two records on the line: the array would grow
    with pytest.raises(ContractError, match=r"1\.report\.json: not a NodeSummary"):
        read_node_reports(run, 0, range(3))


def test_the_newest_step_comes_from_summaries_and_ranks_alike():
    reported = reading(training(0, step=9))  # read from its report: the summary says 9
    by_rank = NodeReading.of_ranks(
        training(1, step=11)[:1] + [RankObservation(rank=3, node="node-1", launched=True, alive=True)]
    )
    silent = NodeReading.of_ranks([RankObservation(rank=4, node="node-2", launched=True, alive=False)])
    assert Observation(0, NOW, 0, nodes=[reported, by_rank, silent]).newest_step() == 11
    assert Observation(0, NOW, 0, nodes=[reported]).newest_step() == 9
    assert Observation(0, NOW, 0, nodes=[silent]).newest_step() is None


def beat(rank: int, step: int, at: float, phase: str = "training") -> RankObservation:
    heartbeat = Heartbeat(rank=rank, step=step, phase=phase, time=at, alive_at=at, first_step_at=NOW - 9)
    return RankObservation(rank=rank, node="node-0", launched=True, alive=True, heartbeat=heartbeat)


def test_a_launcher_times_its_ranks_steps_as_it_sees_them_advance():
    times = StepTimes()
    assert times.take([beat(0, 5, NOW), beat(1, 5, NOW)], NOW) == (None, None)  # where they stand: no step yet
    times.take([beat(0, 6, NOW + 0.1), beat(1, 6, NOW + 0.12)], NOW + 0.12)
    # Rank 0 was seen two steps on in 0.4 s: 0.2 s each; rank 1 took 0.3 s over step 7.
    slowest, last = times.take([beat(0, 8, NOW + 0.5), beat(1, 7, NOW + 0.42)], NOW + 0.5)
    assert (slowest.step, slowest.seconds, last.step, last.seconds) == (7, pytest.approx(0.3), 8, pytest.approx(0.2))
    # Past the window only the newer steps count: 0.1 s each from here on.
    ticks = round((STEP_WINDOW_SECONDS + 0.5) / 0.1)
    for tick in range(1, ticks + 1):
        at = NOW + 0.5 + 0.1 * tick
        slowest, last = times.take([beat(0, 8 + tick, at), beat(1, 7 + tick, at)], at)
    assert (slowest.seconds, last.step, last.seconds) == (pytest.approx(0.1), 8 + ticks, pytest.approx(0.1))
    # A rank's new process starts over: its first step after a restore is warm-up, not a step time.
    later = at + STEP_WINDOW_SECONDS + 1  # its old steps out of the window
    assert times.take([beat(0, 2, later)], later) == (None, None)


def test_a_look_at_steady_nodes_says_until_when_time_alone_cannot_change_its_verdict():
    policy = POLICY.model_copy(update={"hang_after_seconds": 5.0})
    steady = [reading(training(i, beat_age=0.2 * (i + 1))) for i in range(3)]
    verdict = judge(
        Observation(nodes=steady, incarnation=2, launched_at=NOW - 100, resume_step=0), policy, NOW, NOW - 0.1, 100
    )
    # The oldest beat (0.6 s old) reaches the hang time (5 s): no hang is found before, whatever
    # the liveness says (it ages past the stopped limit, five intervals: 2.5 s, sooner).
    assert verdict.fault is None and verdict.settled_until == pytest.approx(NOW - 0.6 + 5.0)
    uneasy = [*steady, NodeReading.of_ranks(training(3))]  # a node read rank by rank: look at the interval
    looked = judge(
        Observation(nodes=uneasy, incarnation=2, launched_at=NOW - 100, resume_step=0), policy, NOW, NOW, 100
    )
    assert looked.fault is None and looked.settled_until is None
