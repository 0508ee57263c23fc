"""Judging an observation of an incarnation: fault, completion, or progress (pure)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cached_property

from lazarus.infra.backend import Observation, RankObservation
from lazarus.schema.contract import RankExit
from lazarus.schema.node_reports import NodeReading, NodeSummary
from lazarus.schema.policy import RecoveryPolicy
from lazarus.schema.records import FaultReport, StepSource

PROGRAM_ERROR_SETTLE_SECONDS = 2.0
"""How long after the first rank of a fresh run fails before its first step the others get to
fail the same way (then it is the program's fault); past it, the first one's node is blamed."""

PEER_LOSS_SETTLE_SECONDS = 2.0
"""How long after the first rank reports a lost peer the silent ranks get to report how they
ended (a live launcher writes its ranks' records within milliseconds) before their node is
blamed as dead, though the backend does not know it yet."""

PEER_LOST_ERRORS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "remote process exited",
    "ncclremoteerror",
    "connection refused",
    "socket closed",
)
"""Parts of the errors gloo and NCCL raise in a rank whose peer went away: the rank that
raised one is a witness of a fault elsewhere, not its cause."""


PEER_WAIT_ERRORS = ("wait timeout", "timed out", "timeout")
"""Parts of the errors of a rank that gave up waiting for its peers (a rendezvous, a store key):
a witness too, of a peer that never came."""


def waited_in_vain(ended: RankExit) -> bool:
    """Whether a rank's exit record says it gave up waiting for a peer, or lost one."""
    error = ended.error.lower()
    return lost_a_peer(ended) or any(part in error for part in PEER_WAIT_ERRORS)


def lost_a_peer(ended: RankExit) -> bool:
    """Whether a rank's exit record says it ended because a peer went away."""
    error = ended.error.lower()
    return any(part in error for part in PEER_LOST_ERRORS)


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


ALIVE_GRACE_SECONDS = 1.0
"""A rank whose liveness thread (Heartbeat.alive_at) has not written for this long, or five
heartbeat intervals if longer, counts as a stopped process (seconds): the thread writes every
interval, and a loaded node may delay it by some."""


def _at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


def _ended(rank: RankObservation) -> str:
    if rank.exit is None:
        return f"rank {rank.rank} on {rank.node} ended without an exit record (killed with its node)"
    if rank.exit.signal:
        return f"rank {rank.rank} on {rank.node} was killed by {rank.exit.signal}"
    error = f": {rank.exit.error}" if rank.exit.error else ""
    return f"rank {rank.rank} on {rank.node} exited with code {rank.exit.code}{error}"


@dataclass(frozen=True)
class _Look:
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

    @property
    def stopped_after(self) -> float:
        """How long a rank's liveness thread may be silent before its process counts as stopped (s)."""
        policy = self.policy
        return min(policy.hang_after_seconds, max(ALIVE_GRACE_SECONDS, 5 * policy.heartbeat_interval_seconds))

    @cached_property
    def _split(self) -> tuple[list[RankObservation], list[NodeReading]]:
        ranks, steady = [], []
        dead, now, hang_after, stopped_after = (
            self.observation.dead_nodes,
            self.now,
            self.policy.hang_after_seconds,
            self.stopped_after,
        )
        for node in self.observation.nodes:
            summary = node.summary
            if (
                summary is not None
                and summary.steady
                and summary.node not in dead
                and now - summary.oldest_beat <= hang_after
                and (summary.oldest_alive is None or now - summary.oldest_alive <= stopped_after)
            ):
                steady.append(node)
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
        return [node.summary for node in self._split[1]]

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
        heartbeat since `since`."""
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
        return silent | {summary.node for summary in self.steady if summary.newest_beat <= since}

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
        steps = [step for summary in self.steady for step in (summary.lowest_step, summary.highest_step)]
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

    def verdict(self, **outcome) -> Verdict:
        """A verdict of this look: its step and source, whether every rank is up, and `outcome`."""
        up = bool(self.ranks or self.steady) and all(r.launched and r.alive for r in self.ranks)
        warnings = sorted({r.heartbeat.warning for r in self.ranks if r.heartbeat and r.heartbeat.warning})
        return Verdict(outcome.pop("step", self.step), source=self.source, up=up, warnings=warnings, **outcome)

    def fault(self, kind: str, blamed: list[RankObservation], occurred: float, reason: str, nodes=None) -> Verdict:
        """A verdict of fault `kind`, blaming `blamed` (their nodes, unless `nodes` is given)."""
        beats = [r.heartbeat.time for r in blamed if r.heartbeat]
        first = blamed[0] if blamed else None
        ended = first.exit if first else None
        return self.verdict(
            fault=FaultReport(
                kind=kind,
                nodes=sorted(set(nodes or (r.node for r in blamed))),
                incarnation=self.observation.incarnation,
                occurred_at=_at(occurred),
                detected_at=_at(self.now),
                step=self.newest_step,
                last_heartbeat_at=_at(max(beats)) if beats else None,
                reason=reason,
                rank=first.rank if first else None,
                exit_code=ended.code if ended and not ended.signal else None,
                signal=ended.signal if ended else None,
                error=ended.error if ended else "",
            ),
        )


def judge(observation: Observation, policy: RecoveryPolicy, now: float, last_poll: float, total_steps: int) -> Verdict:
    """Decide what an observation shows.

    `last_poll` is when the incarnation was last seen healthy: a rank found dead now
    died after it, so that is the fault's time (MTTR errs long by at most one interval).
    Blame, in order: nodes the backend saw die; ranks gone without an exit record (a
    kill); nodes gone silent while every rank that failed lost a peer (a node whose death
    the backend has not learnt yet: its ranks cannot report, the survivors can; of several
    silent nodes, those whose address the errors name); the earliest rank that exited with
    an error (its peers fail after it); the rank with the oldest heartbeat once heartbeats
    are stale. Every rank gone with code 0 is completion at the last step, and a stop (on
    request) before it; of a script whose ranks report no steps themselves, it is completion.
    """
    look = _Look(observation, policy, now, last_poll, total_steps)
    for check in (_dead_nodes, _exits, _all_ended_cleanly, _hangs):
        verdict = check(look)
        if verdict is not None:
            return verdict
    return look.verdict()


def _dead_nodes(look: _Look) -> Verdict | None:
    dead = look.observation.dead_nodes
    if not dead:
        return None
    blamed = [r for r in look.ranks if r.node in dead]
    died = min(dead.values()).timestamp()
    return look.fault("node_down", blamed, died, f"backend reports node {', '.join(sorted(dead))} dead", sorted(dead))


def _exits(look: _Look) -> Verdict | None:
    """Ranks that ended before the last step: killed, failed on their own, or lost a peer."""
    # A rank gone without an exit record while its launcher lives: the launcher is about to
    # write one. Judge it on the next look, when the record says how it ended.
    gone = [r for r in look.ranks if r.launched and not r.alive and (r.exit is not None or not r.launcher_alive)]
    killed = [r for r in gone if r.exit is None or r.exit.signal]
    if killed:
        return look.fault("rank_exit", killed, look.last_poll, "; ".join(_ended(r) for r in killed))
    failed = sorted((r for r in gone if r.exit.code != 0), key=lambda r: r.exit.time)
    if not failed:
        return None
    first = failed[0]
    never_started = [r for r in look.ranks if not r.launched]
    if never_started and all(waited_in_vain(r.exit) for r in failed):
        # Ranks give up on a rendezvous whose peers never came: the node that did not start its
        # ranks (its standby or launcher hung) is the one at fault, not those that waited for it.
        reason = f"rank(s) {', '.join(str(r.rank) for r in never_started)} never started; then {_ended(first)}"
        return look.fault("rank_exit", never_started, first.exit.time, reason)
    if look.fresh_and_untrained:
        # The run's first launch failing before a step: if every rank ends on its own within
        # a moment of the first, it is the program (a bad flag, a missing file), not a node.
        if not look.steady and all(r.exit is not None and not r.alive for r in look.ranks):
            reason = f"every rank ended before training a step; first: {_ended(first)}"
            return look.fault("program_error", [first], first.exit.time, reason)
        if look.now - first.exit.time < PROGRAM_ERROR_SETTLE_SECONDS:
            return look.verdict()
    if all(lost_a_peer(r.exit) for r in failed):
        verdict = _silent_peer(look, failed)
        if verdict is not None:
            return verdict
    return look.fault("rank_exit", [first], first.exit.time, _ended(first))


def _silent_peer(look: _Look, failed: list[RankObservation]) -> Verdict | None:
    """Every rank that failed lost a peer: blame the nodes gone silent (once their ranks had time
    to report), those the errors name where they name any; None when no node is silent."""
    first = failed[0]
    silent_nodes = look.silent_nodes(since=first.exit.time)
    # Where the errors name the lost peer's address (gloo does), a silent node they name is the
    # dead one; one they do not name is a survivor slow to notice.
    named = {
        node
        for node, address in look.observation.node_addresses.items()
        if any(f"[{address}]" in r.exit.error for r in failed)
    }
    if silent_nodes & named:
        silent_nodes &= named
    if not silent_nodes:
        return None
    if look.now - first.exit.time < PEER_LOSS_SETTLE_SECONDS:
        return look.verdict()
    silent = look.ranks_on(silent_nodes)
    reason = (
        f"node {', '.join(sorted(silent_nodes))} went silent (no exit record, no heartbeat) "
        f"while its peers lost their connections to it; first: {_ended(first)}"
    )
    return look.fault("node_down", silent, first.exit.time, reason, sorted(silent_nodes))


def _all_ended_cleanly(look: _Look) -> Verdict | None:
    """Every rank exited with code 0: for a trainer, completion at the last step and a stop before
    it; for a script that does not report steps itself, completion (it decides when it is done)."""
    # Ended only once every process is gone too (the exit record is written just before a rank
    # exits, and each node's launcher outlives its ranks by a moment).
    ranks = look.ranks
    if not ranks or look.steady or look.observation.launchers_alive:
        return None
    if not all(r.exit is not None and r.exit.code == 0 and not r.alive for r in ranks):
        return None
    if look.source != "trainer":
        return look.verdict(completed=True)
    last = min(r.exit.step if r.exit.step is not None else look.observation.resume_step for r in ranks)
    if look.fresh_and_untrained and last < look.total_steps:
        reason = (
            f"every rank exited with code 0 at step {last} without training a step "
            f"(trainer.steps is {look.total_steps})"
        )
        return look.fault("program_error", ranks, max(r.exit.time for r in ranks), reason)
    return look.verdict(step=last, completed=last >= look.total_steps, stopped=last < look.total_steps)


def _hangs(look: _Look) -> Verdict | None:
    """A rank whose heartbeat is older than the policy allows (the startup grace before its first).
    A rank that has written none is watched only where the spec says it will (the built-in
    trainer, output as heartbeat): exit and node health are the signals of any other."""
    stale = []
    for r in look.ranks:
        if not r.alive or r.exit is not None:
            continue
        if r.heartbeat is None and not look.observation.heartbeats_expected:
            continue
        if r.heartbeat is None or r.heartbeat.phase == "starting":
            since = r.heartbeat.time if r.heartbeat else look.observation.launched_at
            if since is not None and look.now - since > look.policy.startup_grace_seconds:
                stale.append((r, look.now - since))
        elif look.now - r.heartbeat.time > look.policy.hang_after_seconds:
            stale.append((r, look.now - r.heartbeat.time))
    if not stale:
        return None

    # Every rank stalls behind a hung one in the next collective. Where the ranks say when their
    # process last ran (alive_at), the hung one is a rank whose process stopped too, while those
    # waiting for it still run; else, or of several, the one that got least far (lowest step, then
    # oldest heartbeat).
    stopped_after = look.stopped_after
    # Among every rank (a steady node has none), not only the stale: the stalled ranks' heartbeats
    # are milliseconds apart, and the first to pass the hang time need not be the one that stopped.
    frozen = [
        (r, look.now - r.heartbeat.time)
        for r in look.ranks
        if r.alive
        and r.exit is None
        and r.heartbeat
        and r.heartbeat.alive_at
        and look.now - r.heartbeat.alive_at > stopped_after
    ]

    def lag(item):
        rank, age = item
        return (rank.heartbeat.step if rank.heartbeat and rank.heartbeat.step is not None else -1, -age)

    culprit, age = min(frozen or stale, key=lag)
    reason = f"rank {culprit.rank} on {culprit.node}: no heartbeat for {age:.1f} s"
    return look.fault("hang", [culprit], look.now - age, reason)
