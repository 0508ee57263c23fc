"""What detect learns of a run's pace across its looks (stateful, beside the pure judge): how long
its steps take, from which the hang time is derived, and how long each node's own work per step
takes, from which a straggler is found.

Step times are what the launchers timed: each node's report names the slowest step of its last
seconds and its newest (trainer/agent/node_report.py), each step counted once, so they hold
whatever stalls a step in this run (a checkpoint every N steps, the data loader) however seldom
detect looks. Where no launcher times them, they are the gaps between the looks that saw the
run's step advance. The hang time is `hang_step_multiple` times their 99th percentile, at least
`hang_floor_seconds`; until MIN_GAPS steps were seen after the incarnation's first, it is the
startup grace (the first steps after a start or a restore are slow: allocation, warm-up).

A node's work per step is the slowest of its ranks' `compute_seconds` (what a rank spent before it
waited for its peers). A node is a straggler when the median of its work over the policy's window
is `factor` times the median of the other nodes' medians, and has been all through the window: a
node slow for a moment is not one, and a run slow everywhere has none.
"""

from __future__ import annotations

import re
import statistics
from collections import deque
from dataclasses import dataclass

from lazarus.infra.backend import Observation
from lazarus.schema.node_reports import StepTime
from lazarus.schema.policy import RecoveryPolicy, hang_seconds
from lazarus.schema.stacks import main_thread_frames

GAP_WINDOW = 200
"""Step times the hang time is derived from: the newest this many (steps)."""

MIN_GAPS = 5
"""Step times needed before the hang time is derived from them (steps). Few suffice: a hang needs
evidence besides the stall (activities/hangs.py), so a short hang time cannot turn a slow step
into a fault; of few, the 99th percentile is the longest."""

MIN_SAMPLES = 5
"""Work readings a node needs in the window before it is compared with its peers (steps)."""

LINE = re.compile(r", line \d+")
"""The line number in a frame of faulthandler's dump, which a stack that stands still may change."""

STEADY_LOOK_SECONDS = 5.0
"""The longest a watch waits between looks at a run whose every node is steady and whose step times
it knows (activities/watching.py): what only a look can tell (a warning, a node gone sick, a
straggler) is found within this (seconds). Deaths wake the watch at once on every backend (a
process's exit, a pod or node the API server reports, a node the pool records dead), and the hang
time is looked at when it falls due, so this bounds only the slower verdicts. A look costs the
worker about half a millisecond (four nodes' reports read and judged, with the event loop's share):
at 1,000 runs a worker, a look a second cost a healthy run about 35 ms of CPU a minute, one every
2 s about 21 (bench/controller_scale.py)."""

FIRST_STEPS_LOOK_SECONDS = 0.25
"""The longest a watch waits between looks at a steady run while its pace has too few step times to
derive the hang time (MIN_GAPS; seconds): each look brings the newest step time of each node's
report, so the first second or so of a start or a restore teaches it, and a rank stopped early is
judged by the derived hang time, not the startup grace (a node stopped 1.5 s into the chaos spec's
run was found 9.6 s after it with 1 s looks, 2 of 13 sittings)."""

LEARNING_LOOK_SECONDS = 1.0
"""The longest a watch waits between looks at a steady run while its pace is learning (Pace.learning;
seconds): each look brings the two step times that the nodes' reports time, so the derived hang
time replaces the startup grace within seconds of a start or a restore; and where no launcher times
the steps, the looks do, as often as before."""

COUNTED_STEPS = 64
"""Timed steps a pace remembers having counted (steps): more than a look finds in the reports."""

KEPT_PACES = 1024
"""Incarnations whose pace a worker keeps between detect's attempts (activities/watching.py)."""


@dataclass(frozen=True)
class Straggler:
    """A node found slower than its peers."""

    node: str
    since: float  # when it was first seen that slow (seconds since the epoch)
    work: float  # the median of its work per step over the window (seconds)
    peers: float  # the median of its peers' medians (seconds)
    steps: int  # steps the run trained while it was that slow

    @property
    def cost_seconds(self) -> float:
        """What it cost the run while it was seen slow: its extra work on every step (seconds)."""
        return max(0.0, self.work - self.peers) * self.steps

    def describe(self, window: float) -> str:
        """One line for the incident and the operator."""
        return (
            f"straggler: {self.node}'s work per step took {self.work:.3f} s against its peers' {self.peers:.3f} s "
            f"({self.work / self.peers:.1f}x, median over {window:g} s); it cost the run about "
            f"{self.cost_seconds:.1f} s over {self.steps} steps"
        )


class Pace:
    """Step times and each node's work per step, over the looks of one watch of an incarnation."""

    def __init__(self, policy: RecoveryPolicy):
        self.policy = policy
        self.gaps: deque[float] = deque(maxlen=GAP_WINDOW)
        self._step: int | None = None  # the newest step seen, and when
        self._step_at = 0.0
        self._advances = 0
        self._timed_by_looks = False  # the newest step time came from two looks, not a launcher
        self._looked_at = 0.0
        self._counted: deque[int] = deque(maxlen=COUNTED_STEPS)  # the steps the launchers timed, in gaps
        self._work: dict[str, deque[tuple[float, float]]] = {}  # node -> (time, seconds) readings
        self._work_step: dict[str, int] = {}  # node -> the step of its newest reading
        self._slow_since: dict[str, float] = {}
        self._steps_at: deque[tuple[float, int]] = deque()  # (time, step) at each advance, for costs
        self._active_at: float | None = None  # of a run without steps: when a rank was last seen at work
        self._busy_seen = False  # a rank was seen active after its first sample
        self.longest_quiet = 0.0  # the longest stretch every rank sat idle together and the run went on from (s)
        self.probed_at = float("-inf")  # when the ranks' stacks were last dumped for a busy stall
        # rank -> (its main thread's functions, its innermost frame, since when they stood still)
        self._stacks: dict[int, tuple[str, str, float]] = {}

    @classmethod
    def of(cls, run_id: str, incarnation: int, policy: RecoveryPolicy) -> Pace:
        """The pace of an incarnation as this worker learnt it so far: detect returns to the workflow
        every progress interval and on each warning, and a new watch must not start over at the
        startup grace. It is soft state: a worker that restarts learns it again."""
        key = (run_id, incarnation)
        pace = _PACES.pop(key, None) or cls(policy)
        pace.policy = policy  # an operator may have changed it (set_policy)
        _PACES[key] = pace
        while len(_PACES) > KEPT_PACES:
            _PACES.pop(next(iter(_PACES)))
        return pace

    @property
    def learning(self) -> bool:
        """The watch should look often: too few step times yet to derive the hang time from (the
        startup grace holds), or the looks themselves time the steps (no launcher does), so that
        looking seldom would stretch the step times and the hang time derived from them."""
        return len(self.gaps) < MIN_GAPS or self._timed_by_looks

    @property
    def learning_look(self) -> float | None:
        """How soon the next look of a steady run should come while the pace learns (seconds): soon
        while it has too few step times, every LEARNING_LOOK_SECONDS while the looks time the steps;
        None once it has learnt them."""
        if len(self.gaps) < MIN_GAPS:
            return FIRST_STEPS_LOOK_SECONDS
        return LEARNING_LOOK_SECONDS if self._timed_by_looks else None

    def hang_after(self) -> float:
        """How long the run's step may stall before it counts as hung (seconds)."""
        if len(self.gaps) < MIN_GAPS:
            return hang_seconds(self.policy)  # too few step times yet: the startup grace
        ordered = sorted(self.gaps)
        return hang_seconds(self.policy, ordered[round(0.99 * (len(ordered) - 1))])  # their 99th percentile

    def take_stacks(self, dumps: dict[int, str], now: float) -> None:
        """Take in a dump of the ranks' stacks, taken at `now` because the step stalled while they
        used CPU: a rank whose main thread is in the same functions as in its last dump (at any line
        of them) has been still since that one was taken; a rank that did not answer is forgotten."""
        self.probed_at = now
        kept = {}
        for rank, dump in dumps.items():
            frames = main_thread_frames(dump)
            # The same functions, whatever line of them: a loop that never ends moves between its lines.
            where = "\n".join(LINE.sub("", frame) for frame in frames)
            before = self._stacks.get(rank)
            since = before[2] if before is not None and before[0] == where and where else now
            kept[rank] = (where, frames[0] if frames else "", since)
        self._stacks = kept

    def still(self) -> dict[int, tuple[float, str]]:
        """Each rank whose main thread has not moved over two dumps or more: (since when, its innermost
        frame); none once the run went on (the step advanced)."""
        return {
            rank: (since, innermost) for rank, (_, innermost, since) in self._stacks.items() if since < self.probed_at
        }

    def quiet_after(self) -> float:
        """How long every rank of a script that reports no steps may sit idle together before the run
        is hung (seconds): `hang_step_multiple` times the longest such stretch the run went on from,
        at least `quiet_hang_seconds`; the startup grace until a rank was seen busy (starting, a
        rank may wait long for its peers: busy, then every rank idle and silent, is the hang)."""
        return hang_seconds(self.policy, self.longest_quiet if self._busy_seen else None, of="idle")

    def _read_quiet(self, observation: Observation) -> None:
        """Learn how long the ranks of a run without steps sit idle together while it is well: the
        newest time any rank was seen active stands still while every rank is idle, and jumps by the
        length of that stretch when one works again."""
        running = [r for r in observation.ranks if r.launched and r.alive and r.exit is None]
        if not running or any(r.idle_since is None for r in running):
            return
        active_at = max(r.idle_since for r in running if r.idle_since is not None)
        if self._active_at is not None and active_at > self._active_at:
            if self._busy_seen:  # the wait before the first work is the start's, under its grace
                self.longest_quiet = max(self.longest_quiet, active_at - self._active_at)
            self._busy_seen = True
        self._active_at = active_at

    def observe(self, observation: Observation, step: int | None, now: float) -> Straggler | None:
        """Take in a look: its step (None: the ranks report none: then how long they sit idle together)
        and each node's work; returns the straggler, if one was found."""
        if step is None:
            self._read_quiet(observation)
        looked_at, self._looked_at = self._looked_at, now
        if now - looked_at > max(2 * STEADY_LOOK_SECONDS, 5 * self.policy.heartbeat_interval_seconds):
            self._step = None  # nobody looked meanwhile (between watches, a worker down): no step time
        timed = self._timed_steps(observation)
        if timed:
            self._timed_by_looks = False
        for step_time in timed:
            if step_time.step not in self._counted:
                self.gaps.append(step_time.seconds)  # the launchers timed it: no look needs to have seen it
                self._counted.append(step_time.step)
        if step is not None and (self._step is None or step > self._step):
            self._stacks = {}  # the run went on: what stood still before is no evidence now
            if self._step is not None:
                self._advances += 1
                if self._advances > 1 and not timed:  # the first advance ends the start or restore
                    self.gaps.append(now - self._step_at)  # no launcher times steps: the looks do
                    self._timed_by_looks = True
                self._steps_at.append((now, step))
            self._step, self._step_at = step, now
        if self.policy.stragglers.action == "off":
            return None
        self._read_work(observation, now)
        return self._straggler(now)

    @staticmethod
    def _timed_steps(observation: Observation) -> list[StepTime]:
        """The steps the nodes' launchers timed (each report's slowest and newest): for each, the
        slowest node's figure."""
        slowest: dict[int, StepTime] = {}
        for reading in observation.nodes:
            summary = reading.summary
            for timed in (summary.slowest_step, summary.last_step) if summary is not None else ():
                if timed is not None and (timed.step not in slowest or timed.seconds > slowest[timed.step].seconds):
                    slowest[timed.step] = timed
        return sorted(slowest.values(), key=lambda timed: timed.step)

    def _read_work(self, observation: Observation, now: float) -> None:
        window = self.policy.stragglers.window_seconds
        for reading in observation.nodes:
            summary = reading.summary
            if summary is not None and summary.steady:
                node, step, work = summary.node, summary.highest_step, summary.compute_seconds
            else:
                beats = [r.heartbeat for r in reading.ranks if r.heartbeat and r.heartbeat.compute_seconds is not None]
                if not beats or not reading.ranks:
                    continue
                node = reading.ranks[0].node
                step = max(beat.step for beat in beats if beat.step is not None) if beats else None
                work = max(beat.compute_seconds for beat in beats if beat.compute_seconds is not None)
            if work is None or step is None or self._work_step.get(node) == step:
                continue
            self._work_step[node] = step
            readings = self._work.setdefault(node, deque())
            readings.append((now, work))
            while readings and readings[0][0] < now - window:
                readings.popleft()
        while self._steps_at and self._steps_at[0][0] < now - 10 * window:
            self._steps_at.popleft()

    def ratios(self) -> dict[str, tuple[float, float]]:
        """Each node with enough readings in the window: (the median of its work per step, the
        median of the other nodes' medians) (seconds)."""
        medians = {
            node: statistics.median(w for _, w in readings)
            for node, readings in self._work.items()
            if len(readings) >= MIN_SAMPLES
        }
        compared = {}
        for node, work in medians.items():
            others = [m for n, m in medians.items() if n != node]
            if others:
                compared[node] = (work, statistics.median(others))
        return compared

    def _straggler(self, now: float) -> Straggler | None:
        policy = self.policy.stragglers
        found = None
        for node, (work, peers) in self.ratios().items():
            if peers <= 0 or work < policy.factor * peers:
                self._slow_since.pop(node, None)
                continue
            since = self._slow_since.setdefault(node, now)
            if now - since >= policy.window_seconds and (found is None or work / peers > found.work / found.peers):
                steps = sum(1 for at, _ in self._steps_at if at >= since)
                found = Straggler(node=node, since=since, work=work, peers=peers, steps=steps)
        return found


_PACES: dict[tuple[str, int], Pace] = {}
"""Each incarnation's pace, newest used last (Pace.of)."""
