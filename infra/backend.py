"""The seam between the recovery activities and a cluster: what a backend must do, and what one
look at an incarnation returns.

The backends that implement it are registered by name in infra/registry.py; tests/backends/ runs
one behavioural suite against them. The activities (activities/recovery.py) and the commands know
only this Protocol: where a backend differs, they ask it for a capability, never its name. Every
method but wait_for_exit blocks, so the activities call them in a thread.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from lazarus.infra.stacks import STACKS_WAIT_SECONDS
from lazarus.schema.contract import LaunchRecord, RankObservation, Rejoin, SurvivorSource
from lazarus.schema.node_reports import NodeReading
from lazarus.schema.policy import RecoveryPolicy
from lazarus.schema.pool import SpareWant
from lazarus.schema.records import Assignment, Inventory, StepSource
from lazarus.schema.run import RunSpec
from lazarus.schema.rundir import RunDir

if TYPE_CHECKING:
    from lazarus.infra.ownership import OwnerRecords


class ClusterError(RuntimeError):
    """The backend cannot do what was asked (unknown run or node, a spare taken, a stuck process)."""


class QuarantineRefused(ClusterError):
    """The pool's quarantine breaker is open, or this quarantine trips it: nothing was quarantined."""


@dataclass
class Observation:
    """One look at an incarnation: its ranks and the health of its nodes."""

    incarnation: int
    launched_at: float | None  # when its first launch started the ranks (seconds since the epoch); None before
    resume_step: int  # the checkpoint step it restores
    nodes: list[NodeReading] = field(default_factory=list)  # each node's ranks, in node order
    dead_nodes: dict[str, datetime] = field(default_factory=dict)  # node -> when the backend saw it die
    launchers_alive: int = 0  # node launchers still running
    node_addresses: dict[str, str] = field(
        default_factory=dict
    )  # node -> the address its ranks' peers dial, where known
    steps_from: StepSource | None = None  # who the spec says reports steps (None: only the ranks can tell)
    heartbeats_expected: bool = False  # every rank writes heartbeats from its start (built-in trainer, output)
    sick_nodes: dict[str, str] = field(default_factory=dict)  # node -> a health agent's condition that marks it sick

    @property
    def ranks(self) -> list[RankObservation]:
        """Every rank, in rank order. This parses every node's report: a look judges by the
        summaries and reads the ranks of a node only where its summary shows something."""
        return [rank for node in self.nodes for rank in node.ranks]

    def newest_step(self) -> int | None:
        """The highest step any rank reported (None: none did); of a reported node, from its summary."""
        steps = []
        for node in self.nodes:
            if node.summary is not None:
                steps.append(node.summary.highest_step)
            else:
                steps += [rank.heartbeat.step for rank in node.ranks if rank.heartbeat is not None]
        return max((step for step in steps if step is not None), default=None)


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
"""The kernel's range for ports it picks itself: for bind to port 0 and for outgoing connections."""

LISTENER_FLOOR = 10000
"""The lowest port free_ports offers: below are the well-known and the commonly configured ones."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports on 127.0.0.1 that nothing listens on right now (all held while
    they are chosen: ports asked for one after another may come back the same), for listeners that
    another process opens later (a rank 0's store, a dev server).

    Chosen below the kernel's ephemeral range where it leaves room: a port from that range (what a
    bind to port 0 returns) can be taken, before its listener opens it, by any outgoing connection
    on this machine. gloo opens one per pair of ranks, so a run beside another run met it: its
    rank 0 failed with EADDRINUSE at step 0 and cost a recovery."""
    first, last = _listener_range()
    # A hundred picks below the range, then the kernel's own, should the range below seem full.
    picks = [random.randrange(first, last) for _ in range(100)] if first < last else []
    probes: list[socket.socket] = []
    try:
        for port in [*picks, *[0] * count]:
            if len(probes) == count:
                break
            probe = socket.socket()
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                probe.close()
                continue
            probes.append(probe)
        if len(probes) < count:
            raise OSError(f"no {count} free TCP ports on 127.0.0.1")
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def _listener_range() -> tuple[int, int]:
    """[first, last) of the ports free_ports picks from; empty where the ephemeral range is unknown
    or leaves fewer than 1,000 ports below it."""
    try:
        ephemeral_low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0, 0
    return (LISTENER_FLOOR, ephemeral_low) if ephemeral_low - LISTENER_FLOOR >= 1000 else (0, 0)


class ClusterBackend(Protocol):
    """What the recovery activities need of a cluster. Every name a method creates derives from
    (run id, incarnation, node), so a retried call finds what an earlier attempt did."""

    backend: str
    """The spec's `cluster.backend` this backend serves."""
    records_stages: bool
    """Whether record_stage writes anywhere (so callers can skip the call)."""

    @property
    def owners(self) -> OwnerRecords:
        """Who may act on each run, and the stages that act (infra/ownership.py)."""
        ...

    quick_observe: bool
    """Whether observe reads only this machine's files and memory, never waiting on another
    program: then a watch takes its looks on the worker's event loop, without a hop to a thread
    (which costs several times what a look at a small run does)."""
    shares_host: bool
    """Whether the ranks run on the worker's own machine: `python` is the worker's interpreter, a
    path is this machine's, and a run's processes can be stopped from here without a worker."""
    shares_paths: bool
    """Whether the ranks see the paths of the machine a run is started from (a script, a workdir),
    rather than the paths inside an image."""
    quarantines_in_cluster: bool
    """Whether a quarantine also marks the node in the cluster itself (drained, cordoned), so that
    returning the node must go through the backend, not only the pool's record."""
    keeps_survivors: bool
    """Whether the survivors of a fault may keep their processes and rejoin the next incarnation
    (RecoveryPolicy.in_process; rejoin_ranks)."""
    home: Path
    """The worker's own folder (LAZARUS_HOME)."""
    runs: Path
    """Where run directories live (`runs/<run id>`: LAZARUS_RUNS, by default `home/runs`)."""

    @classmethod
    def open(cls, options) -> ClusterBackend:
        """The backend, its cluster reached, from a BackendOptions (infra/registry.py); ClusterError,
        one line, where it cannot be reached."""
        ...

    @classmethod
    def placement(cls, cluster) -> str:
        """Where a run's nodes are, as words that follow "N node(s)" ("" for this machine)."""
        ...

    def run_dir(self, run_id: str) -> RunDir:
        """The run's directory (it may not exist yet)."""
        ...

    def create(self, run_id: str, spec: RunSpec) -> RunDir:
        """Create the run's state (directory, spec, inventory, claims of its active nodes), once."""
        ...

    def inventory(self, run_id: str) -> Inventory:
        """The run's nodes: active, its hot spares, and what it quarantined."""
        ...

    def assignment(self, run_id: str, incarnation: int) -> Assignment | None:
        """The recorded assignment of an incarnation, if any."""
        ...

    def claimed_assignment(self, run_id: str, incarnation: int) -> Assignment | None:
        """The incarnation's assignment if its nodes were claimed (commit_assignment), even by an
        attempt that died before recording it anywhere else; None when nothing claimed them."""
        ...

    def rendezvous_port(self, run_id: str) -> int:
        """The port rank 0's store of the run's next incarnation listens on."""
        ...

    def commit_assignment(
        self, run_id: str, assignment: Assignment, claims: Sequence[str] = (), releases: Sequence[str] = ()
    ) -> Assignment:
        """Claim the spares, record the incarnation's assignment and release leftover nodes, exactly
        once, and mark the run's want of spares placed; returns the assignment recorded first.
        Claiming a node that is neither a free spare nor already the run's raises ClusterError (a
        retry of a claim that succeeded succeeds)."""
        ...

    def vet_spare(self, run_id: str, node: str) -> str | None:
        """Check a free node before the run claims it, with the run's health check where the backend
        can run one there; a node that fails leaves the pool (quarantined, no run's). Returns why it
        failed; None when it passed, or nothing could be checked."""
        ...

    def want_spares(self, run_id: str, want: SpareWant) -> None:
        """Lodge the run's need of the pool's spares for a recovery (it replaces the run's earlier
        one), so that every run's reschedule sees it in its inventory's `wants`."""
        ...

    def drop_want(self, run_id: str) -> None:
        """The run's recovery is over (or the run is): its want goes. Idempotent."""
        ...

    def start_ranks(
        self,
        run_id: str,
        incarnation: int,
        resume_step: int,
        skipped: dict[int, str] | None = None,
        policy: RecoveryPolicy | None = None,
        survivors: SurvivorSource | None = None,
    ) -> LaunchRecord:
        """Start every rank of an incarnation that is not running; returns the launch record in
        force (the first launch's). `policy` is the recovery policy in force; `survivors`, where
        the ranks load the resume step's state from instead of its checkpoint."""
        ...

    def rejoin_ranks(
        self, run_id: str, incarnation: int, resume_step: int, rejoin: Rejoin, skipped: dict[int, str] | None = None
    ) -> LaunchRecord:
        """Start an incarnation that the survivors of the one before rejoin in their processes: its
        launch record names them (`rejoin`), their nodes' launchers follow them into it, and the
        other nodes' ranks start afresh. Only where keeps_survivors."""
        ...

    def observe(self, run_id: str, incarnation: int) -> Observation:
        """One look at the incarnation's ranks and nodes."""
        ...

    async def wait_for_exit(self, run_id: str, incarnation: int, timeout: float) -> bool:
        """Return True as soon as something of the incarnation ends (a rank, a launcher, a node),
        or False after `timeout` seconds."""
        ...

    def await_checkpoint_in_flight(self, run_id: str, incarnation: int, grace: float) -> tuple[int | None, bool]:
        """If a checkpoint was being written at the fault, give it `grace` seconds to commit while a
        rank lives; returns its step (None if none) and whether it committed."""
        ...

    def await_survivors(self, run_id: str, incarnation: int, grace: float) -> dict[int, int]:
        """Give the ranks that outlived the fault `grace` seconds to save their state and end while
        a rank lives; returns rank -> the step each saved."""
        ...

    def stop_incarnation(self, run_id: str, incarnation: int) -> list[int]:
        """End every rank of the incarnation and return once none can still write anything; returns
        the ranks that were alive. Idempotent."""
        ...

    def stop_nodes(self, run_id: str, incarnation: int, nodes: list[str]) -> list[int]:
        """End the incarnation's ranks on `nodes` only and return once none of them runs; returns
        those that were alive. A hung node's peers then see a broken collective, as for a death,
        and save what they hold. Idempotent."""
        ...

    def remove_partial_checkpoints(self, run_id: str) -> list[int]:
        """Delete checkpoint folders that never committed; returns their steps."""
        ...

    def remove_stale_survivors(self, run_id: str, incarnation: int) -> list[int]:
        """Delete the survivors' states of incarnations before `incarnation`; returns those incarnations."""
        ...

    def quarantine(self, run_id: str, nodes: list[str], reason: str, counted: bool = True) -> None:
        """Hold the nodes out of the run and of every spare pool. Where the pool has a quarantine
        breaker, it counts them unless not `counted` (an operator's own drain); QuarantineRefused,
        quarantining nothing, when it is open or these trip it."""
        ...

    def return_node(self, run_id: str, node: str) -> Inventory:
        """A repaired node rejoins the pool as a hot spare."""
        ...

    def release_standbys(self, run_id: str) -> None:
        """Stop what the backend keeps warm for the run (it has ended)."""
        ...

    def release_nodes(self, run_id: str) -> list[str]:
        """The run ended: its active nodes go back to the pool as free spares (what it quarantined
        stays out until returned); returns them. Idempotent."""
        ...

    def log_tail(self, run_id: str, incarnation: int, rank: int, lines: int = 20) -> str:
        """The last lines of a rank's log ('' if it has none)."""
        ...

    def capture_stacks(
        self, run_id: str, incarnation: int, ranks: list[int] | None = None, wait_seconds: float = STACKS_WAIT_SECONDS
    ) -> dict[int, str]:
        """Each running rank's Python stacks (all threads, faulthandler's text), dumped now: rank ->
        text, for those of `ranks` (None: every rank) whose dump came within `wait_seconds`. A rank
        that is not Python, or did not register the dump, is never signalled and is left out."""
        ...

    def record_stage(self, run_id: str, stage: str, message: str) -> None:
        """Note a recovery stage where the cluster's own tools show it."""
        ...

    def close(self) -> None:
        """Release what the backend holds for its lifetime."""
        ...
