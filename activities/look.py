"""One observation of an incarnation with what judging it needs, and the verdict it comes to: what
judge (activities/health.py) and the checks it runs (activities/exits.py, activities/hangs.py) share."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cached_property

from lazarus.activities.pace import Straggler
from lazarus.infra.backend import Observation, RankObservation
from lazarus.schema.faults import FaultKind
from lazarus.schema.node_reports import NodeSummary
from lazarus.schema.policy import RecoveryPolicy
from lazarus.schema.records import FaultReport, StepSource


@dataclass(frozen=True)
class Verdict:
    """What one observation means."""

    step: int | None  # None: no rank reports steps
    fault: FaultReport | None = None
    completed: bool = False
    stopped: bool = False
    source: StepSource | None = None  # who reports the step
    up: bool = False  # every rank is launched and its process runs
    warnings: list[str] = field(default_factory=list)  # what the ranks' heartbeats ask the operator to know
    lingering: list[int] = field(default_factory=list)  # ranks still running past the exit grace, to be ended
    straggler: Straggler | None = None  # a node slower than its peers (activities/pace.py), while nothing failed
    sick: dict[str, str] = field(default_factory=dict)  # node -> why its health check or condition says sick
    dump_stacks: bool = False  # a hang whose processes run: every rank's Python stack says where it waits
    probe_stacks: bool = False  # the step stalls while the ranks use CPU: dump their stacks, to see which stands still
    settled_until: float | None = None  # all steady: the same verdict until then, unless a report changes


ALIVE_GRACE_SECONDS = 1.0
"""A rank whose liveness thread (Heartbeat.alive_at) has not written for this long, or five
heartbeat intervals if longer, counts as a stopped process (seconds): the thread writes every
interval, and a loaded node may delay it by some."""


def _at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


@dataclass(frozen=True)
class Look:
    """One observation with what judging it needs: the policy, the clock, the run's length.

    A node whose report's summary is steady and within the policy's limits is judged by its
    summary alone (`steady`); every other node's ranks are read (`ranks`). A steady node has no
    exit, no stale or frozen rank and no warning, so the checks that look for those need only the
    ranks; the rest take the summaries into account."""

    observation: Observation
    policy: RecoveryPolicy
    now: float
    last_poll: float
    total_steps: int
    hang_after: float  # how long a step may stall (the policy's, or derived from step times: activities/pace.py)
    quiet_after: float | None = None  # of a run without steps: how long every rank may sit idle (Pace.quiet_after)
    still: Mapping[int, tuple[float, str]] | None = None  # rank -> (still since, where): Pace.still

    @property
    def idle_after(self) -> float:
        """How long every rank may sit idle together before the run is hung (seconds): of a run whose
        ranks report no steps, derived from its idle stretches where known; else the hang time."""
        if self.quiet_after is not None and self.source is None:
            return self.quiet_after
        return self.hang_after

    @property
    def stopped_after(self) -> float:
        """How long a rank's liveness thread may be silent before its process counts as stopped (s)."""
        policy = self.policy
        return min(self.hang_after, max(ALIVE_GRACE_SECONDS, 5 * policy.heartbeat_interval_seconds))

    @cached_property
    def _split(self) -> tuple[list[RankObservation], list[NodeSummary]]:
        ranks, steady = [], []
        dead, now, hang_after, stopped_after = (
            self.observation.dead_nodes,
            self.now,
            self.hang_after,
            self.stopped_after,
        )
        for node in self.observation.nodes:
            summary = node.summary
            if (
                summary is not None
                and summary.steady
                and summary.node not in dead
                and summary.oldest_beat is not None  # a steady node's ranks have heartbeats
                and now - summary.oldest_beat <= hang_after
                and (summary.oldest_alive is None or now - summary.oldest_alive <= stopped_after)
            ):
                steady.append(summary)
            else:
                ranks += node.ranks
        return ranks, steady

    @property
    def ranks(self) -> list[RankObservation]:
        """The ranks of every node that is not steady."""
        return self._split[0]

    @cached_property
    def steady(self) -> list[NodeSummary]:
        """The summaries of the nodes judged by their summary alone."""
        return self._split[1]

    def ranks_on(self, nodes) -> list[RankObservation]:
        """Every rank on `nodes`, steady or not, in rank order (reading only those nodes' ranks)."""
        return [
            r
            for node in self.observation.nodes
            if node.summary is None or node.summary.node in nodes
            for r in node.ranks
            if r.node in nodes
        ]

    def silent_nodes(self, since: float) -> set[str]:
        """Nodes whose every rank looks alive to the backend yet has neither an exit record nor a
        heartbeat since `since`, and whose launcher has not reported since either: a survivor whose
        ranks block in a collective on a loaded host still has a launcher that reports."""
        return self._silent_ranks_or_beats(since) - {
            node.summary.node
            for node in self.observation.nodes
            if node.summary is not None and node.summary.reported_at is not None and node.summary.reported_at > since
        }

    def _silent_ranks_or_beats(self, since: float) -> set[str]:
        by_node: dict[str, list[RankObservation]] = {}
        for r in self.ranks:
            by_node.setdefault(r.node, []).append(r)
        silent = {
            node
            for node, on_node in by_node.items()
            if all(
                r.launched and r.alive and r.exit is None and (r.heartbeat is None or r.heartbeat.time <= since)
                for r in on_node
            )
        }
        return silent | {
            summary.node
            for summary in self.steady
            if summary.newest_beat is not None and summary.newest_beat <= since  # a steady node has one
        }

    @cached_property
    def source(self) -> StepSource | None:
        """Who reports the step: a rank's own heartbeat (lazarus.session, the built-in trainer) makes
        it the trainer; the launcher's, from the output, makes it the output; else what the spec says."""
        beats = [r.heartbeat for r in self.ranks if r.heartbeat and r.heartbeat.step is not None]
        if any(beat.by == "rank" for beat in beats) or any(summary.by_rank for summary in self.steady):
            return "trainer"
        return "output" if beats or self.steady else self.observation.steps_from

    @cached_property
    def steps(self) -> list[int]:
        """Each reporting rank's step (of a steady node, its lowest and highest). A trainer's rank
        restores the resume step before its first heartbeat; a rank that reports by output has no
        step until it prints one."""
        # A steady node's figures are set (its every rank has a heartbeat with a step).
        steps = [
            step for summary in self.steady for step in (summary.lowest_step, summary.highest_step) if step is not None
        ]
        if self.source == "trainer":
            resumed = self.observation.resume_step
            return steps + [
                r.heartbeat.step if r.heartbeat and r.heartbeat.step is not None else resumed for r in self.ranks
            ]
        return steps + [r.heartbeat.step for r in self.ranks if r.heartbeat and r.heartbeat.step is not None]

    @property
    def step(self) -> int | None:
        """Progress: the step every reporting rank has completed; None when none reports one."""
        return min(self.steps, default=self.observation.resume_step if self.source == "trainer" else None)

    @property
    def newest_step(self) -> int | None:
        """The highest step any rank reported (None when none does)."""
        return max(self.steps, default=self.step)

    @property
    def fresh_and_untrained(self) -> bool:
        """The run's first launch, before any rank completed a step. Of a script that reports no
        steps only its age can tell: it counts as untrained for its startup grace."""
        if self.observation.incarnation != 0:
            return False
        if any(r.heartbeat and r.heartbeat.first_step_at for r in self.ranks) or any(s.trained for s in self.steady):
            return False
        launched = self.observation.launched_at
        young = launched is None or self.now - launched <= self.policy.startup_grace_seconds
        return self.source == "trainer" or young

    @property
    def settled_until(self) -> float | None:
        """Of a look at a run whose every node is steady: the first moment time alone could change its
        verdict (seconds since the epoch); None while some node's ranks are read. Only a new report
        (a death, an exit, a warning) can change it sooner.

        That moment is when a node's oldest heartbeat ages past the hang time (or the startup grace,
        if shorter: a rank before its first step of the incarnation may be steady): every hang
        verdict needs a stale heartbeat (activities/hangs.py), and a process's stopped liveness is
        only evidence beside one, so it need not be looked at before."""
        if self.ranks or not self.steady:
            return None
        limit = min(self.hang_after, self.policy.startup_grace_seconds)
        return min((s.oldest_beat + limit for s in self.steady if s.oldest_beat is not None), default=None)

    def verdict(self, **outcome) -> Verdict:
        """A verdict of this look: its step and source, whether every rank is up, and `outcome`."""
        up = bool(self.ranks or self.steady) and all(r.launched and r.alive for r in self.ranks)
        warnings = sorted({r.heartbeat.warning for r in self.ranks if r.heartbeat and r.heartbeat.warning})
        sick = {n.summary.node: n.summary.sick for n in self.observation.nodes if n.summary and n.summary.sick}
        sick |= self.observation.sick_nodes
        if not outcome:
            outcome["settled_until"] = self.settled_until
        return Verdict(
            outcome.pop("step", self.step), source=self.source, up=up, warnings=warnings, sick=sick, **outcome
        )

    def fault(
        self, kind: FaultKind, blamed: list[RankObservation], occurred: float, reason: str, nodes=None
    ) -> Verdict:
        """A verdict of fault `kind`, blaming `blamed` (their nodes, unless `nodes` is given: [] blames
        no node)."""
        beats = [r.heartbeat.time for r in blamed if r.heartbeat]
        first = blamed[0] if blamed else None
        ended = first.exit if first else None
        return self.verdict(
            fault=FaultReport(
                kind=kind,
                nodes=sorted(set(nodes if nodes is not None else (r.node for r in blamed))),
                incarnation=self.observation.incarnation,
                occurred_at=_at(occurred),
                detected_at=_at(self.now),
                step=self.newest_step,
                last_heartbeat_at=_at(max(beats)) if beats else None,
                reason=reason,
                rank=first.rank if first else None,
                node=first.node if first else None,
                exit_code=ended.code if ended and not ended.signal else None,
                signal=ended.signal if ended else None,
                error=ended.error if ended else "",
            ),
        )
