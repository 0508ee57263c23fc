"""The recovery state machine (schema.records.TRANSITIONS): every state is used, every run can end."""

from __future__ import annotations

from pathlib import Path

from lazarus.schema.states import TERMINAL_STATES, TRANSITIONS, RunState, may_move


def reachable_from(start: RunState) -> set[RunState]:
    seen, frontier = {start}, [start]
    while frontier:
        for nxt in TRANSITIONS[frontier.pop()] - seen:
            seen.add(nxt)
            frontier.append(nxt)
    return seen


def test_every_state_is_reachable_from_pending():
    assert reachable_from(RunState.PENDING) == set(RunState)


def test_every_state_that_is_not_terminal_can_reach_a_terminal_one():
    for state in set(RunState) - TERMINAL_STATES:
        assert reachable_from(state) & TERMINAL_STATES, state


def test_terminal_states_have_no_way_out():
    assert TERMINAL_STATES == {RunState.COMPLETED, RunState.FAILED, RunState.ABORTED}
    for state in TERMINAL_STATES:
        assert TRANSITIONS[state] == frozenset()
        assert not any(may_move(state, other) for other in set(RunState) - {state})


def test_a_run_fails_or_is_aborted_from_any_state_that_is_not_terminal():
    for state in set(RunState) - TERMINAL_STATES:
        assert {RunState.FAILED, RunState.ABORTED} <= TRANSITIONS[state], state


def test_staying_in_a_state_is_always_allowed_and_never_listed():
    for state in RunState:
        assert may_move(state, state) and state not in TRANSITIONS[state]


def test_recovery_runs_its_stages_in_order():
    path = [
        RunState.TRAINING,
        RunState.DRAINING,
        RunState.RESCHEDULING,
        RunState.REPLACING,
        RunState.RESUMING,
        RunState.TRAINING,
    ]
    assert all(may_move(a, b) for a, b in zip(path, path[1:], strict=False))
    assert not may_move(RunState.TRAINING, RunState.RESUMING)  # no skipping drain and reschedule
    assert not may_move(RunState.PAUSED, RunState.TRAINING)  # a resume starts a new incarnation first


def test_the_readmes_diagram_is_the_table():
    """README.md draws the state machine as `STATE -> NEXT | NEXT` lines; they are TRANSITIONS."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("```\nPENDING ", 1)[1].split("```", 1)[0]
    drawn: dict[RunState, set[RunState]] = {}
    for line in ("PENDING " + block).splitlines():
        left, _, right = line.split("#")[0].partition("->")
        if not right or left.startswith("every state"):
            continue
        drawn[RunState(left.strip())] = {RunState(name.strip()) for name in right.split("|")}
    always = {RunState.FAILED, RunState.ABORTED}
    taking_over = {RunState.TAKING_OVER}
    assert drawn == {
        state: set(moves) - always - (set() if state == RunState.TAKING_OVER else taking_over)
        for state, moves in TRANSITIONS.items()
        if moves
    }
    assert "every state but COMPLETED, FAILED and ABORTED -> FAILED | ABORTED" in block
    assert "every state but COMPLETED, FAILED, ABORTED and TAKING_OVER -> TAKING_OVER" in block
    assert all(RunState.TAKING_OVER in TRANSITIONS[state] for state in drawn if state != RunState.TAKING_OVER)
