"""The node pool of the local, simulated and Slurm backends: every run of a fleet takes its nodes from it.

The pool says of every node whether it is free (a hot spare any run may claim), active in a run, or
quarantined by one; it lives in the store (infra/pool.py: a row per node), and these are its
records as the controller reads them. The local backend's standbys learn that a node is dead or
quarantined from a marker file (`unusable_marker`), not from the store.
"""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field

from lazarus.schema.base import MAX_SECONDS, Record
from lazarus.schema.nodelist import NodeList

NODE_NAME = re.compile(r"node-(0|[1-9][0-9]*)")
"""How the local pool names its nodes: node-0, node-1, ... in the order they were added."""


def old_pool_file(home: Path) -> Path:
    """Where a home kept its pool's record before the pool moved into the store: imported once."""
    return Path(home) / "pool" / "nodes.json"


def unusable_marker(home: Path, node: str) -> Path:
    """Present while the node is dead or quarantined (written by the pool before any of its processes
    is ended): a warm standby on it starts no ranks."""
    return Path(home) / "pool" / "unusable" / node


def node_number(name: str) -> int:
    """The number of a pool node's name (node-7 -> 7); -1 for a name the pool never gives."""
    found = NODE_NAME.fullmatch(name)
    return int(found[1]) if found else -1


class SpareWant(Record):
    """One run's need of the pool's spares in one recovery, lodged as its drain starts, so that
    runs recovering at once share the spares by policy rather than by who claims first. Frozen: a
    change replaces a want."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str = Field(description="Run that needs the spares.")
    incarnation: int = Field(ge=0, description="Incarnation the fault ended.")
    needed: int = Field(ge=0, description="Spares that would replace every node it lost (nodes).")
    priority: int = Field(default=0, description="The run's cluster.priority: the higher comes first.")
    lost_ranks: int = Field(ge=0, description="Ranks of the replicas the fault broke: what it loses until it recovers.")
    fault_at: datetime = Field(description="When the fault happened (UTC): the earlier comes first on a tie.")
    placed: bool = Field(default=False, description="Its recovery has claimed what it got: it no longer competes.")
    got: int = Field(default=0, ge=0, description="Spares it claimed, once placed (nodes).")

    def outranks(self, other: SpareWant) -> bool:
        """Whether this need comes before `other`'s: priority, then who lost more, then who lost first."""
        return self._order() < other._order()

    def why_before(self, other: SpareWant) -> str:
        """Why this need comes before `other`'s, in words."""
        if self.priority != other.priority:
            return f"priority {self.priority} > {other.priority}"
        if self.lost_ranks != other.lost_ranks:
            return f"same priority, lost {self.lost_ranks} ranks > {other.lost_ranks}"
        return "same priority and loss, its fault came first"

    def _order(self) -> tuple:
        return self.sort_key()

    def sort_key(self) -> tuple:
        """Needs sorted by this come in the order they are served: the first outranks the rest."""
        return (-self.priority, -self.lost_ranks, self.fault_at, self.run_id)


class PoolNode(Record):
    """One node of the pool and who holds it. Frozen: a change replaces a node."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Node name, unique in the pool (node-N).")
    role: Literal["free", "active", "quarantined"] = Field(
        description=(
            "free: a hot spare of the pool, any run may claim it; active: in `owner`'s assignment; "
            "quarantined: held out of every run after `owner`'s fault, until returned."
        )
    )
    owner: str | None = Field(
        default=None, description="Run id that holds the node (active) or quarantined it; None if free."
    )
    healthy: bool = Field(default=True, description="False once the node was seen to die.")
    died_at: datetime | None = Field(default=None, description="When the node was seen to die (UTC).")
    since: datetime = Field(description="When the node took its role (UTC).")
    note: str = Field(default="", description="Why the node has its role (for quarantine: the fault).")
    domain: str | None = Field(
        default=None,
        description="Its fault domain: the rack, switch or power domain whose failure takes it with the others.",
    )


class QuarantineBreaker(Record):
    """A cap on how many of the pool's nodes faults may quarantine within a sliding window: past it the
    breaker trips, and nothing more is quarantined until a person resets it, so a detector that
    blames healthy nodes cannot drain a fleet (NVSentinel's default: half the cluster in five
    minutes). An operator's own drain of a node is not counted, nor refused. Frozen: a change
    replaces it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_fraction: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="Share of the pool's nodes that faults may quarantine within window_seconds (fraction).",
    )
    window_seconds: float = Field(
        default=300.0, gt=0, le=MAX_SECONDS, description="The sliding window the quarantines are counted in (seconds)."
    )
    quarantined: dict[str, datetime] = Field(
        default_factory=dict,
        description=(
            "Nodes faults quarantined within the last window, and when (UTC); a node returned since (repaired: a "
            "person saw to it) no longer counts."
        ),
    )
    tripped_at: datetime | None = Field(default=None, description="When the breaker tripped (UTC); None: closed.")
    tripped_reason: str = Field(default="", description="What tripped it, in one line.")

    def cap(self, pool_nodes: int) -> int:
        """How many nodes the window may hold for a pool of `pool_nodes` (at least one)."""
        return max(1, int(self.max_fraction * pool_nodes))

    def recent(self, now: datetime, still_out: set[str]) -> dict[str, datetime]:
        """The quarantines within the window at `now` of nodes `still_out` (quarantined still)."""
        window = self.window_seconds
        return {n: at for n, at in self.quarantined.items() if (now - at).total_seconds() <= window and n in still_out}

    def counting(self, nodes: list[str], now: datetime, still_out: set[str]) -> QuarantineBreaker:
        """The breaker with `nodes` quarantined at `now` counted, and what left the window dropped."""
        return self.model_copy(update={"quarantined": {**self.recent(now, still_out), **dict.fromkeys(nodes, now)}})

    def describe(self, pool_nodes: int, now: datetime, still_out: set[str]) -> str:
        """Its state in one line."""
        held = f"{len(self.recent(now, still_out))} of at most {self.cap(pool_nodes)} node(s) quarantined in the last "
        held += f"{self.window_seconds:g} s ({self.max_fraction:.0%} of {pool_nodes})"
        if self.tripped_at is None:
            return f"closed: {held}"
        return f"OPEN since {self.tripped_at:%Y-%m-%d %H:%M:%S} UTC: {self.tripped_reason}"


TOGETHER_SECONDS = 1.0
"""Nodes that die within this many seconds of each other failed together (one cause: a rack, a
switch, a power domain), as far as an incident's report goes (seconds)."""


class SharedFault(Record):
    """The nodes of the pool that failed together with the run's own (within TOGETHER_SECONDS): one
    cause taking nodes of many runs at once."""

    nodes: NodeList = Field(description="Every node of the pool that failed then, the run's own included.")
    domains: list[str] = Field(default_factory=list, description="Their fault domains, where the pool names them.")
    runs: list[str] = Field(default_factory=list, description="The other runs that lost nodes then.")
    undrained: list[str] = Field(
        default_factory=list,
        description=(
            "Of those runs, the ones whose nodes in the run's own fault domain are still active: they have not "
            "drained, so their need of the pool's spares is not lodged yet."
        ),
    )

    def describe(self) -> str:
        """In one line, for the incident's report."""
        domains = f"{', '.join(self.domains)}: " if self.domains else ""
        runs = f" of {len(self.runs)} other run(s) ({', '.join(self.runs[:8])}{', ...' if len(self.runs) > 8 else ''})"
        return f"{domains}{len(self.nodes)} node(s){runs if self.runs else ''} failed within {TOGETHER_SECONDS:g} s"


class PoolRecord(Record):
    """Every node of the pool, the runs' needs of spares and the quarantine breaker, as read at once."""

    nodes: list[PoolNode] = Field(default_factory=list, description="Every node, in the order they were added.")
    wants: list[SpareWant] = Field(
        default_factory=list, description="Runs' needs of spares, from their drain to the end of their resume."
    )
    breaker: QuarantineBreaker = Field(
        default_factory=QuarantineBreaker, description="The cap on quarantines within a window, and whether it tripped."
    )

    def node(self, name: str) -> PoolNode | None:
        """The node of that name, if the pool has one."""
        return next((n for n in self.nodes if n.name == name), None)

    def out(self) -> set[str]:
        """The nodes quarantined now."""
        return {n.name for n in self.nodes if n.role == "quarantined"}

    def held_by(self, run_id: str, role: str = "active") -> list[PoolNode]:
        """The nodes `run_id` holds in `role` (active or quarantined), in the order they were added."""
        return [n for n in self.nodes if n.owner == run_id and n.role == role]

    def free(self) -> list[PoolNode]:
        """Healthy free nodes (the pool's hot spares), in the order they were added."""
        return [n for n in self.nodes if n.role == "free" and n.healthy]
