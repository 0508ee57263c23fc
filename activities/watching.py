"""Watching an incarnation from inside an activity: look every heartbeat interval (and at once when
a process exits) until the look shows what the caller waits for.

Detect returns to the workflow only when the workflow has something to do or record: a fault,
completion, a new warning, spares for a regrow, or the safety interval
(`recovery.progress_every_seconds`). Routine progress stays out of the history: every look's step
is in the activity's heartbeat details, which the server keeps for `lazarus run status` to read.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from lazarus.activities.health import Verdict
from lazarus.activities.pace import LEARNING_LOOK_SECONDS, STEADY_LOOK_SECONDS, Pace
from lazarus.activities.running import heartbeat, heartbeat_spacing, in_thread, look, look_in_thread, since_heartbeat
from lazarus.infra.backend import ClusterBackend
from lazarus.schema.contract import ContractError, read_heartbeat
from lazarus.schema.records import FaultKind, FaultReport, RankProgress
from lazarus.schema.stacks import odd_ones_out, where_it_waited
from lazarus.schema.stages import DetectInput

HEARTBEAT_EVERY_SECONDS = 1.0
"""How often a watch heartbeats to Temporal when its activity has no heartbeat timeout (seconds);
with one, a third of it. A heartbeat carries the newest look's progress for `lazarus run status`,
and Temporal's core sends one at most every 0.8 heartbeat timeouts anyway: a look every 0.1 s
need not pay for one each time."""

EXIT_SETTLE_SECONDS = 0.01
"""After a process exit woke the watch, how soon it looks again (seconds): the launcher is about to
record how the rank ended."""

STACK_DUMPS_PER_STILL = 2
"""Dumps of the ranks' stacks taken over `stack_still_seconds` while the step stalls and they use
CPU: a rank found still spans three, two intervals apart (each costs every rank a signal and a
few milliseconds)."""


def last_warnings(cluster: ClusterBackend, run_id: str, incarnation: int) -> list[str]:
    """Every rank's warning in its own newest heartbeat, read once at a fault: a rank may have warned
    a moment before the fault, after the node report the look read, and a node drained or lost
    writes no report after it (a full disk's lost checkpoint went unheard so)."""
    assignment = cluster.assignment(run_id, incarnation)
    if assignment is None:
        return []
    run, found = cluster.run_dir(run_id), []
    for rank in range(assignment.layout.world_size):
        try:
            beat = read_heartbeat(run, incarnation, rank)
        except ContractError:  # torn or not a heartbeat: the look judged what it could read
            continue
        if beat is not None and beat.warning and beat.warning not in found:
            found.append(beat.warning)
    return found


def progress_of(verdict: Verdict, now: float) -> RankProgress:
    """What a look says of the run's progress: the activity's heartbeat details, and detect's report."""
    return RankProgress(
        step=verdict.step, at=datetime.fromtimestamp(now, UTC), source=verdict.source, warnings=verdict.warnings
    )


async def watch(
    cluster: ClusterBackend, run_id: str, incarnation: int, policy, total_steps: int, until=None
) -> tuple[Verdict, float]:
    """Look at the incarnation until judge finds a fault, completion or a stop, or `until(verdict,
    now)` (or what it awaits) holds; returns the verdict and the time of its look."""
    last_poll = time.time()
    exited, late = False, 0.0
    pace = Pace.of(run_id, incarnation, policy)
    beat_every = heartbeat_spacing() or HEARTBEAT_EVERY_SECONDS
    while True:
        looking = (cluster, run_id, incarnation, policy, last_poll, total_steps, pace)
        judged_by = pace.hang_after()
        verdict, now = look(*looking) if cluster.quick_observe else await look_in_thread(*looking)
        if verdict.fault is not None and verdict.fault.rank is not None:
            verdict.fault.log_tail = await in_thread(cluster.log_tail, run_id, incarnation, verdict.fault.rank)
        if verdict.fault is not None and verdict.dump_stacks:
            await keep_stacks(cluster, run_id, incarnation, verdict.fault)
        if verdict.probe_stacks and now - pace.probed_at >= policy.stack_still_seconds / STACK_DUMPS_PER_STILL:
            pace.take_stacks(await in_thread(cluster.capture_stacks, run_id, incarnation), now)
        if verdict.completed:
            if verdict.lingering:  # stuck in their teardown past the exit grace: the run is done without them
                await in_thread(cluster.stop_incarnation, run_id, incarnation)
            await in_thread(cluster.release_standbys, run_id)
        if verdict.fault or verdict.completed or verdict.stopped:
            return verdict, now
        if until is not None:
            done = until(verdict, now)
            if inspect.isawaitable(done):
                done = await done
            if done:
                return verdict, now
        last_poll = now
        if since_heartbeat() >= beat_every:
            heartbeat(progress_of(verdict, now))
        soon = learning_look(pace, judged_by)
        due_at = getattr(until, "due_at", None)  # what the caller owes at a time of its own (_ReportDue)
        due = due_at() if due_at is not None else None
        wait = EXIT_SETTLE_SECONDS if exited else look_again_in(verdict, now, policy, beat_every, soon, due) + late
        waited_from = time.monotonic()
        exited = await cluster.wait_for_exit(run_id, incarnation, wait)
        if not exited:
            # Woken late: the worker's event loop has more to do than it can. The next wait is longer
            # by about as much, so that a worker with more watches than it can serve looks less often
            # rather than falling behind on everything (its recoveries, their heartbeats).
            behind = max(0.0, time.monotonic() - waited_from - wait)
            late = min(0.5 * late + behind, beat_every / 2)


def learning_look(pace: Pace, judged_by: float) -> float | None:
    """How soon the next look should come while the pace learns the step times (Pace.learning_look;
    None: at the steady pace): also a learning look after a look that taught it a hang time shorter
    than `judged_by`, the one that look judged its settled_until by (a rank stopped just then would
    otherwise be found a steady look late)."""
    soon = pace.learning_look
    if soon is None and pace.hang_after() < judged_by:
        return LEARNING_LOOK_SECONDS
    return soon


def look_again_in(
    verdict: Verdict, now: float, policy, beat_every: float, learning: float | None = None, due: float | None = None
) -> float:
    """How long to wait before the next look (seconds): the policy's heartbeat interval, or, while
    every node is steady, until time alone could change the verdict (Look.settled_until), at most
    STEADY_LOOK_SECONDS (`learning`, the look of a pace that learns the run's step times: learning_look) and
    the heartbeat spacing; never past `due` (time.time()), when the watch owes a progress report or
    a read of the pool. A process's exit wakes the watch at once either way, and so does a death
    the backend learns of where it can tell (wait_for_exit), so a watch of a healthy run costs a look
    every few seconds instead of ten a second and is as quick to see a death."""
    interval = policy.heartbeat_interval_seconds
    owed = float("inf") if due is None else max(0.0, due - now)
    if verdict.settled_until is None:
        return min(interval, owed)
    steady = STEADY_LOOK_SECONDS if learning is None else learning
    return min(owed, max(interval, min(verdict.settled_until - now + EXIT_SETTLE_SECONDS, steady, beat_every)))


STACK_KEPT_CHARACTERS = 4000
"""How much of the blamed rank's stack dump the fault report keeps (characters, from its end: the
main thread comes last in faulthandler's dump); every rank's whole dump stays in the run directory."""


async def keep_stacks(cluster: ClusterBackend, run_id: str, incarnation: int, fault: FaultReport) -> None:
    """Dump the Python stacks of a hang's ranks (kept in incarnations/K/stacks/) and put the blamed
    rank's in its fault report, so the operator sees where it waited."""
    stacks = await in_thread(cluster.capture_stacks, run_id, incarnation)
    dumped = ", ".join(str(rank) for rank in sorted(stacks)) or "none (no rank answered)"
    fault.reason += f"; Python stacks of ranks {dumped} in incarnations/{incarnation}/stacks/"
    # Ranks stalled in one collective go idle within moments of each other, so which went first
    # is a guess; where most wait at one place and a node's ranks elsewhere, that node is the one.
    odd = odd_ones_out(stacks)
    nodes: set[str] = set()
    if odd:
        assignment = await in_thread(cluster.assignment, run_id, incarnation)
        nodes = {assignment.nodes[rank // assignment.layout.ranks_per_node] for rank in odd}
    if len(nodes) == 1:
        # The stack is the evidence, whether or not it names the rank that went idle first.
        [node] = nodes
        blamed = "blamed on" if odd[0] == fault.rank else "blamed instead on"
        fault.reason += (
            f"; {blamed} rank {odd[0]} on {node}, which waits where no other rank does: "
            f"{where_it_waited(stacks[odd[0]], frames=1)}"
        )
        fault.rank, fault.node, fault.nodes = odd[0], node, [node]
    fault.stack = stacks.get(fault.rank, "")[-STACK_KEPT_CHARACTERS:]


@dataclass(frozen=True)
class PlannedSwap:
    """A node to swap for a free spare though nothing died: sick (its health check or a health
    agent's condition) or a straggler."""

    kind: FaultKind  # one of schema/faults.py PLANNED_KINDS
    node: str
    reason: str
    cost_seconds: float | None = None  # what it cost the run before it was found (a straggler's)

    def fault(self, incarnation: int, step: int | None, now: float) -> FaultReport:
        """The swap as the fault the workflow recovers from in a planned recovery."""
        found = datetime.fromtimestamp(now, UTC)
        # Nothing stopped when it was found: what it cost so far is in cost_seconds, not the MTTR.
        return FaultReport(
            kind=self.kind,
            nodes=[self.node],
            incarnation=incarnation,
            occurred_at=found,
            detected_at=found,
            step=step,
            reason=self.reason,
            node=self.node,
            cost_seconds=self.cost_seconds,
        )


def planned_swap(verdict: Verdict, policy) -> PlannedSwap | None:
    """The node the look says to swap: a sick one first (it may crash the run), else a straggler."""
    if verdict.sick:
        node = sorted(verdict.sick)[0]
        return PlannedSwap("sick", node, f"{node} is sick: {verdict.sick[node]}")
    straggler = verdict.straggler
    if straggler is None:
        return None
    reason = straggler.describe(policy.stragglers.window_seconds)
    return PlannedSwap("straggler", straggler.node, reason, straggler.cost_seconds)


class _ReportDue:
    """When detect's watch has something the workflow must hear: the safety interval is over, a
    warning it does not know appeared, a node to swap for a free spare (sick, a straggler), or
    (when it asks) the pool has the spares for a regrow, read every `capacity_poll_seconds`. A node
    that no free spare can replace, or a straggler only to be reported, is a warning."""

    def __init__(self, cluster: ClusterBackend, request: DetectInput):
        self.cluster, self.request = cluster, request
        started = time.time()
        self.report_at = started + request.policy.progress_every_seconds
        self.next_capacity_check = started  # at the first look
        self.next_spare_check = started
        self.capacity = False
        self.swap: PlannedSwap | None = None

    def due_at(self) -> float:
        """When the watch must look next for this (time.time()): the progress report, or the next
        read of the pool where the request asks about capacity."""
        capacity = self.next_capacity_check if self.request.regrow_nodes is not None else float("inf")
        return min(self.report_at, capacity)

    async def __call__(self, verdict: Verdict, now: float) -> bool:
        swap = planned_swap(verdict, self.request.policy)
        if swap is not None and await self._swap_now(swap, verdict, now):
            return True
        if now >= self.report_at or set(verdict.warnings) - set(self.request.known_warnings):
            return True
        if self.request.regrow_nodes is not None and now >= self.next_capacity_check:
            self.next_capacity_check = now + self.request.policy.capacity_poll_seconds
            self.capacity = await in_thread(self.has_capacity)
        return self.capacity

    async def _swap_now(self, swap: PlannedSwap, verdict: Verdict, now: float) -> bool:
        """Whether to swap the node now (a free spare is there); else it joins the warnings."""
        policy = self.request.policy.stragglers
        swapping = swap.kind == "sick" or policy.action == "swap"
        if swapping and now >= self.next_spare_check:
            self.next_spare_check = now + self.request.policy.capacity_poll_seconds
            if await in_thread(self.has_spare):
                self.swap = swap
                return True
        unswapped = "; no free spare to swap it for" if swapping else ""
        if swap.kind == "sick":
            verdict.warnings.append(f"{swap.reason}{unswapped}")
        else:  # the same words while it stays slow, whatever its figures: one warning, not one per look
            verdict.warnings.append(
                f"{swap.node} is a straggler: its work per step takes {policy.factor:g}x its peers' or more "
                f"(recovery.stragglers){unswapped}"
            )
        return False

    def has_spare(self) -> bool:
        """The pool has a free spare for the run that no other run's recovery needs first."""
        spares, _ = self.cluster.inventory(self.request.run_id).spares_for(None, self.request.node_limit)
        return bool(spares)

    def has_capacity(self) -> bool:
        """The pool has the spares a regrow needs, that no other run's recovery needs, within the run's quota."""
        inventory = self.cluster.inventory(self.request.run_id)
        spares, _ = inventory.spares_for(None, self.request.node_limit)
        wanted = self.request.regrow_nodes
        assert wanted is not None, "asked only for a request that wants nodes"
        return len(spares) >= wanted


async def watch_until_reported(
    cluster: ClusterBackend, request: DetectInput
) -> tuple[Verdict, float, bool, PlannedSwap | None]:
    """Detect's watch: the verdict that ends it, the time of its look, whether the pool has the
    spares the request asked about, and a node to swap for a free spare."""
    due = _ReportDue(cluster, request)
    verdict, now = await watch(
        cluster, request.run_id, request.incarnation, request.policy, request.total_steps, until=due
    )
    healthy = verdict.fault is None and not verdict.completed
    return verdict, now, due.capacity and healthy, due.swap if healthy else None
