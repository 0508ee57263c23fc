"""The local backend's node pool: every run of one LAZARUS_HOME takes its nodes from it.

One record (`<home>/pool/nodes.json`) says of every node whether it is free (a hot spare any
run may claim), active in a run, or quarantined by one; the controller rewrites it under the
pool's lock (infra/pool.py) and the trainer's standbys read it to refuse a dead node.
"""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field

from lazarus.schema.base import Record

NODE_NAME = re.compile(r"node-(0|[1-9][0-9]*)")
"""How the local pool names its nodes: node-0, node-1, ... in the order they were added."""


def pool_file(home: Path) -> Path:
    """Where the pool's record of a home lives."""
    return Path(home) / "pool" / "nodes.json"


def node_number(name: str) -> int:
    """The number of a pool node's name (node-7 -> 7); -1 for a name the pool never gives."""
    found = NODE_NAME.fullmatch(name)
    return int(found[1]) if found else -1


class SpareWant(Record):
    """One run's need of the pool's spares in one recovery, lodged as its drain starts, so that
    runs recovering at once share the spares by policy rather than by who claims first. Frozen: the
    pool's record is shared by readers (infra/pool.py), and a change replaces a want."""

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
        return (-self.priority, -self.lost_ranks, self.fault_at, self.run_id)


class PoolNode(Record):
    """One node of the pool and who holds it. Frozen: the pool's record is shared by readers
    (infra/pool.py), and a change replaces a node."""

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


class PoolRecord(Record):
    """Every node of the pool. `generation` grows by one with each write, so a reader can tell
    whether the pool changed between two reads."""

    generation: int = Field(default=0, ge=0, description="Writes of the record so far.")
    nodes: list[PoolNode] = Field(default_factory=list, description="Every node, in the order they were added.")
    wants: list[SpareWant] = Field(
        default_factory=list, description="Runs' needs of spares, from their drain to the end of their resume."
    )

    def node(self, name: str) -> PoolNode | None:
        """The node of that name, if the pool has one."""
        return next((n for n in self.nodes if n.name == name), None)

    def held_by(self, run_id: str, role: str = "active") -> list[PoolNode]:
        """The nodes `run_id` holds in `role` (active or quarantined), in the order they were added."""
        return [n for n in self.nodes if n.owner == run_id and n.role == role]

    def free(self) -> list[PoolNode]:
        """Healthy free nodes (the pool's hot spares), in the order they were added."""
        return [n for n in self.nodes if n.role == "free" and n.healthy]
