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
  deadlock (this one also for a script that reports no steps, whose ranks have no heartbeat:
  under a hang time derived from how long its ranks sat idle together while it was well, at
  least `quiet_hang_seconds`, activities/pace.py); the rank that went idle first is blamed,
  unless the ranks' stacks show one node's ranks waiting where no other does
  (activities/watching.py keep_stacks);
- a rank's Python stack stood still: the step stalled past `busy_probe_seconds` while the ranks
  used CPU, and dumps of their stacks some seconds apart show its main thread in the same
  functions for `stack_still_seconds` (a rank in an endless loop, a busy wait; a save or a long
  computation moves through its calls);
- the step stalled for `busy_hang_seconds`, whatever the ranks do (the last resort: a rank that
  registered no stack dump, a stack that moves in a loop that never ends).
The first step after a start or a restore gets the startup grace: loading and warm-up are slow.
"""

from __future__ import annotations

import dataclasses

from lazarus.activities.look import Look, Verdict
from lazarus.infra.backend import RankObservation
from lazarus.schema.policy import hang_seconds

FIRST_STEP_PHASES = ("starting", "joined", "restored")
"""Phases before a rank's first step of an incarnation: under a derived hang time they get the
startup grace (under the policy's own hang time only `starting` does, as before)."""

ENDING_PHASES = ("done", "stopped")
"""Phases of a rank that trained its last step or stopped on request: under a derived hang time it
is not judged hung (its liveness thread ends there too); one that never exits is ended by
`exit_grace_seconds` (activities/exits.py judge_lingering) or the stop's own timeout."""

WORKING_SECONDS = 2.0
"""A rank whose launcher saw it use CPU or write within this long is at work (seconds): the launcher
samples every rank at least every second (trainer/agent/node_report.py)."""


def judge_hangs(look: Look) -> Verdict | None:
    """A hung rank, if the look shows one (module docstring). A rank that has written no heartbeat
    is watched only where the spec says it will (the built-in trainer, output as heartbeat): exit,
    idleness and node health are the signals of any other."""
    derived = look.policy.hang_after_seconds is None
    # Under a derived hang time a stall alone is no hang until it lasts this long (busy_hang_seconds).
    longest = hang_seconds(look.policy, of="longest")
    stale, late_start = _stalled(look, derived)
    # A rank that exited 0 finished training: those still running are in their teardown, which
    # the exit grace judges (activities/exits.py judge_lingering), not the hang time.
    ending = any(r.exit is not None and r.exit.code == 0 for r in look.ranks)
    if derived and ending:
        stale = [(r, age) for r, age in stale if age > longest]
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
    limit = _limit(look, derived, idle=bool(idle))
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
        # Every rank idles behind a hung one; a process that cannot run (stopped, uninterruptible) is
        # the culprit before the one that happened to idle first.
        held = [item for item in idle if item[0].held]
        culprit, went_idle = min(held or idle, key=lambda item: (_step(item[0]), item[1]))
        quiet = look.now - max(since for _, since in idle)
        why = f"cannot run (process state {culprit.held}), idle since" if culprit.held else "went idle first,"
        reason = (
            f"every rank has sat idle (no CPU, no output) for {quiet:.1f} s or more ({limit}); rank {culprit.rank} on "
            f"{culprit.node} {why} {look.now - went_idle:.1f} s ago"
            + (f", at step {_step(culprit)}" if _step(culprit) >= 0 else "")
        )
        return dataclasses.replace(look.fault("hang", [culprit], went_idle, reason), dump_stacks=dump)
    busy = [(r, age) for r, age in stale if age > longest]  # stale here only under a derived hang time
    if not busy:
        return _stood_still(look, stale)
    culprit, age = min(busy, key=_lag)
    reason = (
        f"rank {culprit.rank} on {culprit.node}: no heartbeat for {age:.1f} s though every rank runs "
        f"(recovery.busy_hang_seconds {longest:g})"
    )
    return dataclasses.replace(look.fault("hang", [culprit], look.now - age, reason), dump_stacks=dump)


def _stood_still(look: Look, stale: list[tuple[RankObservation, float]]) -> Verdict | None:
    """The step stalled past `busy_probe_seconds` while the ranks still run and use CPU: ask for
    their stacks (the watch dumps them every few seconds, activities/watching.py); a stalled rank
    whose main thread stood still for `stack_still_seconds` is hung. Of those, one that waits where
    most ranks do not (the step's collective holds the others) is blamed, else one still busy (its
    peers sleep in the collective), else the one that got least far."""
    policy = look.policy
    long = [(r, age) for r, age in stale if age > policy.busy_probe_seconds]
    if not long:
        return None
    seen = look.still or {}
    still = [(r, age) for r, age in long if r.rank in seen and look.now - seen[r.rank][0] >= policy.stack_still_seconds]
    if not still:
        return dataclasses.replace(look.verdict(), probe_stacks=True)
    places = [where for _, where in seen.values()]
    odd = [(r, age) for r, age in still if 2 * places.count(seen[r.rank][1]) < len(places)]
    working = [(r, age) for r, age in still if r.idle_since is not None and look.now - r.idle_since < WORKING_SECONDS]
    culprit, age = min(odd or working or still, key=_lag)
    since, where = seen[culprit.rank]
    reason = (
        f"rank {culprit.rank} on {culprit.node}: the run's step stalled {age:.1f} s while its ranks still ran, and its "
        f"Python stack has not moved in {look.now - since:.1f} s (recovery.stack_still_seconds "
        f"{policy.stack_still_seconds:g}): {where}"
    )
    return dataclasses.replace(look.fault("hang", [culprit], look.now - age, reason), dump_stacks=True)


def _limit(look: Look, derived: bool, idle: bool) -> str:
    """The hang time a verdict went by, and where it came from, in the words of its reason."""
    if not derived:
        return f"recovery.hang_after_seconds {look.hang_after:g}"
    if idle and look.idle_after != look.hang_after:
        quiet, grace = look.policy.quiet_hang_seconds, look.policy.startup_grace_seconds
        if look.idle_after == grace:
            return f"recovery.startup_grace_seconds {grace:g}: no rank was seen at work yet"
        if look.idle_after == quiet:
            return f"recovery.quiet_hang_seconds {quiet:g}: the script reports no steps"
        return f"hang time {look.idle_after:.1f} s, derived from how long the ranks sat idle together before"
    return f"hang time {look.hang_after:.1f} s, derived from the run's step times"


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
        (r, r.idle_since) for r in running if r.idle_since is not None and look.now - r.idle_since > look.idle_after
    ]
    return idle if running and len(idle) == len(running) else []
