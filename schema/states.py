"""The recovery state machine: a run's states, and where each may go next (DESIGN.md)."""

from __future__ import annotations

from enum import Enum


class RunState(str, Enum):
    """The run's place in the recovery state machine; TRANSITIONS says where each state may go."""

    PENDING = "PENDING"
    LAUNCHING = "LAUNCHING"
    TRAINING = "TRAINING"
    DRAINING = "DRAINING"
    RESCHEDULING = "RESCHEDULING"
    WAITING_FOR_CAPACITY = "WAITING_FOR_CAPACITY"
    WAITING_FOR_APPROVAL = "WAITING_FOR_APPROVAL"
    STOPPING = "STOPPING"
    PAUSED = "PAUSED"
    REPLACING = "REPLACING"
    RESHARDING = "RESHARDING"
    RESUMING = "RESUMING"
    TAKING_OVER = "TAKING_OVER"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    ABORTED = "ABORTED"


TERMINAL_STATES = frozenset({RunState.COMPLETED, RunState.FAILED, RunState.ABORTED})
"""States a run never leaves."""

_MOVES: dict[RunState, set[RunState]] = {
    RunState.PENDING: {RunState.LAUNCHING},
    RunState.LAUNCHING: {RunState.TRAINING},
    # A fault (detected, signalled or an operator's drain_node) drains at once: the fault
    # report is the detect stage's result, so there is no state between.
    RunState.TRAINING: {RunState.DRAINING, RunState.STOPPING, RunState.COMPLETED},
    # PAUSED: a crash loop, where the policy asks an operator to fix the program (recovery.crash_loop).
    RunState.DRAINING: {RunState.RESCHEDULING, RunState.PAUSED},
    RunState.RESCHEDULING: {RunState.WAITING_FOR_CAPACITY, RunState.REPLACING, RunState.RESHARDING},
    # While waiting, each new read of the inventory stays in WAITING_FOR_CAPACITY.
    RunState.WAITING_FOR_CAPACITY: {RunState.WAITING_FOR_APPROVAL, RunState.REPLACING, RunState.RESHARDING},
    RunState.WAITING_FOR_APPROVAL: {RunState.RESCHEDULING},
    # Back to RESCHEDULING when the spare decided on was lost before its claim.
    RunState.REPLACING: {RunState.RESUMING, RunState.RESCHEDULING},
    RunState.RESHARDING: {RunState.RESUMING, RunState.RESCHEDULING},
    # DRAINING: a fault hit the new incarnation before its first step (the next incident).
    RunState.RESUMING: {RunState.TRAINING, RunState.DRAINING},
    # pause, abort and an operator's reshard checkpoint and stop the ranks first.
    # DRAINING: a planned swap (a straggler) stops at a step boundary, then drains the node.
    RunState.STOPPING: {RunState.PAUSED, RunState.RESHARDING, RunState.DRAINING},
    # resume starts the next incarnation on the held nodes.
    RunState.PAUSED: {RunState.REPLACING},
    # A reset or an adoption found the run as the cluster holds it: never launched, an incarnation
    # assigned but not started, one training, one drained (a recovery), one stopped (an operator
    # decides), training done.
    RunState.TAKING_OVER: {
        RunState.LAUNCHING,
        RunState.RESUMING,
        RunState.TRAINING,
        RunState.DRAINING,
        RunState.PAUSED,
        RunState.COMPLETED,
    },
}
# A reset can land anywhere, and an adoption starts from the state its predecessor carried.
for _state in set(_MOVES) - {RunState.TAKING_OVER}:
    _MOVES[_state].add(RunState.TAKING_OVER)

TRANSITIONS: dict[RunState, frozenset[RunState]] = {
    state: frozenset() if state in TERMINAL_STATES else frozenset(_MOVES[state] | {RunState.FAILED, RunState.ABORTED})
    for state in RunState
}
"""For each state, the states the run may go to next. A run fails or is aborted from any state
that is not terminal; a terminal state has no way out. Staying in a state is not a transition."""


def may_move(current: RunState, new: RunState) -> bool:
    """Whether the state machine lets a run in `current` enter `new` (staying put always may)."""
    return new == current or new in TRANSITIONS[current]
