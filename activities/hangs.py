"""Judging a run whose step stalled: which rank is hung, on what evidence. Part of judge
(activities/health.py), which passes its look.

With the policy's `hang_after_seconds`, a rank whose heartbeat is older than it is hung, whatever
else is seen. Without it the hang time is derived from the run's own step times
(activities/pace.py), short enough to find a stopped rank in a second or two, and so it needs
evidence besides the stall, since a checkpoint save stalls a step too:
- a rank's process stopped: its liveness thread (Heartbeat.alive_at) fell silent while the step
  stalled (a SIGSTOPped or frozen process, a host that stopped running);
- every running rank sat idle for the hang time: next to no CPU, no output
  (RankObservation.idle_since): a collective that waits on a rank that will never come, a
  deadlock (this one also under the policy's own hang time, for a script that reports no steps,
  whose ranks have no heartbeat); the rank that went idle first is blamed, unless the ranks'
  stacks show one node's ranks waiting where no other does (activities/watching.py keep_stacks);
- the step stalled for `busy_hang_seconds`, whatever the ranks do (a rank spinning in a loop looks
  busy, as a long save does).
The first step after a start or a restore gets the startup grace: loading and warm-up are slow.
"""

from __future__ import annotations

import dataclasses

from lazarus.activities.look import Look, Verdict
from lazarus.infra.backend import RankObservation

FIRST_STEP_PHASES = ("starting", "joined", "restored")
"""Phases before a rank's first step of an incarnation: under a derived hang time they get the
startup grace (under the policy's own hang time only `starting` does, as before)."""

ENDING_PHASES = ("done", "stopped")
"""Phases of a rank that trained its last step or stopped on request: under a derived hang time it
is not judged hung (its liveness thread ends there too); one that never exits is ended by
`exit_grace_seconds` (activities/exits.py judge_lingering) or the stop's own timeout."""


def judge_hangs(look: Look) -> Verdict | None:
    """A hung rank, if the look shows one (module docstring). A rank that has written no heartbeat
    is watched only where the spec says it will (the built-in trainer, output as heartbeat): exit,
    idleness and node health are the signals of any other."""
    derived = look.policy.hang_after_seconds is None
    stale, late_start = _stalled(look, derived)
    # A rank that exited 0 finished training: those still running are in their teardown, which
    # the exit grace judges (activities/exits.py judge_lingering), not the hang time.
    ending = any(r.exit is not None and r.exit.code == 0 for r in look.ranks)
    if derived and ending:
        stale = [(r, age) for r, age in stale if age > look.policy.busy_hang_seconds]
    idle = [] if ending else _every_rank_idle(look)
    if not (stale or late_start or idle):
        return None
    frozen = _frozen(look)
    # Where the processes run, each rank's Python stack says where it waits (a stopped process
    # cannot answer the dump's signal until it runs again).
    dump = not frozen
    if late_start or (stale and not derived):
        culprit, age = min(frozen or stale or late_start, key=_lag)
        reason = f"rank {culprit.rank} on {culprit.node}: no heartbeat for {age:.1f} s"
        return dataclasses.replace(look.fault("hang", [culprit], look.now - age, reason), dump_stacks=dump)
    limit = (
        f"hang time {look.hang_after:.1f} s, derived from the run's step times"
        if derived
        else f"recovery.hang_after_seconds {look.hang_after:g}"
    )
    if frozen and stale:
        culprit, age = min(frozen, key=_lag)
        assert culprit.heartbeat is not None and culprit.heartbeat.alive_at is not None, "_frozen keeps only those"
        stopped = look.now - culprit.heartbeat.alive_at
        reason = (
            f"rank {culprit.rank} on {culprit.node}: its process has not run for {stopped:.1f} s and the run's step "
            f"stalled {max(a for _, a in stale):.1f} s ({limit})"
        )
        return look.fault("hang", [culprit], look.now - age, reason)
    if idle:
        culprit, went_idle = min(idle, key=lambda item: (_step(item[0]), item[1]))
        quiet = look.now - max(since for _, since in idle)
        reason = (
            f"every rank has sat idle (no CPU, no output) for {quiet:.1f} s or more ({limit}); rank {culprit.rank} on "
            f"{culprit.node} went idle first, {look.now - went_idle:.1f} s ago"
            + (f", at step {_step(culprit)}" if _step(culprit) >= 0 else "")
        )
        return dataclasses.replace(look.fault("hang", [culprit], went_idle, reason), dump_stacks=dump)
    busy = [(r, age) for r, age in stale if age > look.policy.busy_hang_seconds]
    if not busy:
        return None
    culprit, age = min(busy, key=_lag)
    reason = (
        f"rank {culprit.rank} on {culprit.node}: no heartbeat for {age:.1f} s though every rank runs "
        f"(recovery.busy_hang_seconds {look.policy.busy_hang_seconds:g})"
    )
    return dataclasses.replace(look.fault("hang", [culprit], look.now - age, reason), dump_stacks=dump)


def _stalled(look: Look, derived: bool) -> tuple[list, list]:
    """(rank, age) of the running ranks whose heartbeat is older than the hang time (stale), and of
    those not yet past their first step older than the startup grace (late_start)."""
    slow_start = FIRST_STEP_PHASES if derived else ("starting",)
    stale, late_start = [], []
    for r in look.ranks:
        if not r.alive or r.exit is not None:
            continue
        if r.heartbeat is None and not look.observation.heartbeats_expected:
            continue
        if derived and r.heartbeat is not None and r.heartbeat.phase in ENDING_PHASES:
            continue
        if r.heartbeat is None or r.heartbeat.phase in slow_start:
            since = r.heartbeat.time if r.heartbeat else look.observation.launched_at
            if since is not None and look.now - since > look.policy.startup_grace_seconds:
                late_start.append((r, look.now - since))
        elif look.now - r.heartbeat.time > look.hang_after:
            stale.append((r, look.now - r.heartbeat.time))
    return stale, late_start


def _step(rank: RankObservation) -> int:
    return rank.heartbeat.step if rank.heartbeat and rank.heartbeat.step is not None else -1


def _lag(item: tuple[RankObservation, float]) -> tuple[int, float]:
    """Of stalled ranks, the one that got least far: lowest step, then oldest heartbeat."""
    rank, age = item
    return (_step(rank), -age)


def _frozen(look: Look) -> list[tuple[RankObservation, float]]:
    """Ranks whose process stopped: their liveness thread has not written for `stopped_after`.

    Every rank stalls behind a hung one in the next collective; where the ranks say when their
    process last ran, the hung one is a rank whose process stopped too, while those waiting for it
    still run. Among every rank (a steady node has none), not only the stale: the stalled ranks'
    heartbeats are milliseconds apart, and the first to pass the hang time need not be the one
    that stopped."""
    return [
        (r, look.now - r.heartbeat.time)
        for r in look.ranks
        if r.alive
        and r.exit is None
        and r.heartbeat
        and r.heartbeat.alive_at
        and r.heartbeat.phase not in ENDING_PHASES
        and look.now - r.heartbeat.alive_at > look.stopped_after
    ]


def _every_rank_idle(look: Look) -> list[tuple[RankObservation, float]]:
    """(rank, idle since) of every running rank, when each has used no CPU and written no output for
    the hang time; else none. Only where every rank is read (a steady node's ranks trained a moment
    ago) and each rank's launcher says since when it sat idle."""
    if look.steady:
        return []
    running = [
        r
        for r in look.ranks
        if r.launched and r.alive and r.exit is None and not (r.heartbeat and r.heartbeat.phase in ENDING_PHASES)
    ]
    idle = [
        (r, r.idle_since) for r in running if r.idle_since is not None and look.now - r.idle_since > look.hang_after
    ]
    return idle if running and len(idle) == len(running) else []
