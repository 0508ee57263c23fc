"""The local backend's node pool under LAZARUS_HOME, shared by every run of that home, as a
Kubernetes pool is shared by its label.

Every change is a read-modify-write of one record (schema/pool.py) under an exclusive flock of
`pool/lock`, and the record is replaced by a rename: a claim sees every claim before it, two
runs can never both take one spare, and a worker killed in the middle leaves either the old
record or the new one (the kernel drops a dead holder's lock). What changes a run's assignment
and the pool together (LocalCluster.commit_assignment) holds the lock across both.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

from lazarus.infra.backend import ClusterError
from lazarus.schema.files import write_json_atomic
from lazarus.schema.pool import PoolNode, PoolRecord, SpareWant, node_number, pool_file
from lazarus.schema.records import Inventory, NodeRecord


class LocalPool:
    """The nodes of one home: who holds which, and which are free hot spares."""

    def __init__(self, home: str | Path):
        self.file = pool_file(Path(home))
        self._unhealthy: tuple[tuple, dict[str, datetime | None]] | None = None  # (file stat, what it said)

    def unhealthy(self) -> dict[str, datetime | None]:
        """The pool's dead nodes and when each died: what every look asks, read again only when the
        record was rewritten (a look at a run of thousands of nodes would parse it each time)."""
        try:
            stat = self.file.stat()
        except FileNotFoundError:
            return {}
        key = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if self._unhealthy is None or self._unhealthy[0] != key:
            self._unhealthy = (key, {n.name: n.died_at for n in self.read().nodes if not n.healthy})
        return self._unhealthy[1]

    def read(self) -> PoolRecord:
        """The record as last written (an empty pool before the first write)."""
        try:
            return PoolRecord.model_validate_json(self.file.read_text())
        except FileNotFoundError:
            return PoolRecord()

    @contextlib.contextmanager
    def changing(self) -> Iterator[PoolRecord]:
        """The record under the pool's lock, for the caller to change in place; written back (one
        generation on) when the block ends without an exception and something changed."""
        self.file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.file.parent / "lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                record = self.read()
                yield record
                if record.model_dump_json() != self.read().model_dump_json():
                    self.save(record)
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def save(self, record: PoolRecord) -> None:
        """Write the record now, one generation on (only inside `changing`, which holds the lock)."""
        record.generation += 1
        write_json_atomic(self.file, record.model_dump_json(indent=1))

    # --- changes, each under the lock --------------------------------------------------------

    def add(self, count: int, note: str = "added") -> list[str]:
        """Add `count` free healthy nodes; returns their names."""
        with self.changing() as record:
            return [node.name for node in _add(record, count, note)]

    def provision(self, run_id: str, active: int, spares: int) -> list[str]:
        """Give a new run `active` nodes of its own and leave `spares` free nodes as the pool's hot
        spares: free nodes beyond those spares first, then nodes added (a local node costs nothing
        until it runs). A repeated call finds the nodes the run holds. Returns its active nodes."""
        with self.changing() as record:
            mine = record.held_by(run_id)
            if not mine:
                now = datetime.now(UTC)
                wanted = record.free()[: max(0, min(active, len(record.free()) - spares))]
                wanted += _add(record, active - len(wanted), "added for a run")
                for node in wanted:
                    _hold(node, run_id, now, "launch")
                mine = wanted
            _add(record, spares - len(record.free()), "added as a hot spare")
            return [node.name for node in mine]

    def set_health(self, changes: dict[str, dict]) -> PoolRecord:
        """Apply field changes (healthy, died_at, note) to named nodes; ClusterError names an unknown one."""
        with self.changing() as record:
            _known(record, changes)
            record.nodes = [
                PoolNode.model_validate({**n.model_dump(), **changes[n.name]}) if n.name in changes else n
                for n in record.nodes
            ]
            return record

    def quarantine(self, run_id: str, names: list[str], reason: str) -> None:
        """Hold the nodes out of every run until they are returned (the run that holds them drains them)."""
        with self.changing() as record:
            nodes = _known(record, dict.fromkeys(names))
            others = [n for n in names if nodes[n].owner not in (None, run_id)]
            if others:
                raise ClusterError(f"{', '.join(others)} belongs to another run ({nodes[others[0]].owner})")
            now = datetime.now(UTC)
            for name in names:
                node = nodes[name]
                node.role, node.owner, node.since, node.note = "quarantined", run_id, now, reason

    def return_node(self, name: str) -> PoolNode:
        """A repaired node rejoins the pool as a free healthy spare; returns it as recorded."""
        with self.changing() as record:
            node = _known(record, {name: None})[name]
            if node.role == "active":
                raise ClusterError(f"{name} is active in run {node.owner}; only a quarantined or dead node is returned")
            _free(node, datetime.now(UTC), "returned")
            node.healthy, node.died_at = True, None
            return node

    def release(self, run_id: str) -> list[str]:
        """The run ended: its active nodes go back to the pool as free spares (what it quarantined
        stays quarantined) and its want goes; returns the nodes."""
        with self.changing() as record:
            now = datetime.now(UTC)
            mine = record.held_by(run_id)
            for node in mine:
                _free(node, now, f"released by {run_id}")
            record.wants = [w for w in record.wants if w.run_id != run_id]
            return [node.name for node in mine]

    def want(self, want: SpareWant) -> None:
        """Lodge a run's need of spares, in place of its earlier one."""
        with self.changing() as record:
            record.wants = [w for w in record.wants if w.run_id != want.run_id] + [want]

    def drop_want(self, run_id: str) -> None:
        """The run's recovery is over: its want goes."""
        with self.changing() as record:
            record.wants = [w for w in record.wants if w.run_id != run_id]

    # --- what one run sees -------------------------------------------------------------------

    def inventory(self, run_id: str, record: PoolRecord | None = None) -> Inventory:
        """The run's view: its active nodes, what it quarantined, and every free node as a spare."""
        record = record or self.read()
        views = []
        for node in record.nodes:
            if node.role == "free":
                role, note = "spare", node.note or "hot spare of the pool"
            elif node.owner == run_id:
                role, note = node.role, node.note
            else:
                continue
            views.append(NodeRecord(name=node.name, role=role, healthy=node.healthy, died_at=node.died_at, note=note))
        return Inventory(nodes=views, wants=[w for w in record.wants if w.run_id != run_id])


def claim_and_release(record: PoolRecord, run_id: str, nodes: list[str], releases: list[str], why: str) -> None:
    """In `record`: make `nodes` the run's active nodes and free `releases` it held (but not `nodes`).
    ClusterError, changing nothing, when one of `nodes` is neither free and healthy nor already the
    run's (a retry of a claim that succeeded succeeds)."""
    known = _known(record, dict.fromkeys(nodes))
    taken = [n for n in nodes if not _claimable(known[n], run_id)]
    if taken:
        free = ", ".join(n.name for n in record.free()) or "none"
        held = "; ".join(f"{n} {_held(known[n])}" for n in taken)
        raise ClusterError(f"node {', '.join(taken)} is no longer a free spare ({held}; free: {free})")
    now = datetime.now(UTC)
    claimed = [name for name in nodes if known[name].owner != run_id or known[name].role != "active"]
    for name in claimed:
        _hold(known[name], run_id, now, why)
    for want in record.wants:
        if want.run_id == run_id and not want.placed:
            want.placed, want.got = True, len(claimed)
    for node in record.held_by(run_id):
        if node.name in releases and node.name not in nodes:
            _free(node, now, f"released by {run_id} at {why}")


def _claimable(node: PoolNode, run_id: str) -> bool:
    return (node.role == "free" and node.healthy) or (node.role == "active" and node.owner == run_id)


def _held(node: PoolNode) -> str:
    if node.role == "free":
        return "is dead"
    return f"is {node.role} in run {node.owner}" if node.role == "active" else f"is quarantined by {node.owner}"


def _known(record: PoolRecord, names: dict) -> dict[str, PoolNode]:
    nodes = {n.name: n for n in record.nodes}
    unknown = sorted(set(names) - set(nodes), key=node_number)
    if unknown:
        listed = ", ".join(n.name for n in record.nodes) or "none"
        raise ClusterError(f"the pool has no node {', '.join(unknown)}; nodes: {listed}")
    return nodes


def _add(record: PoolRecord, count: int, note: str) -> list[PoolNode]:
    first = max((node_number(n.name) for n in record.nodes), default=-1) + 1
    now = datetime.now(UTC)
    added = [PoolNode(name=f"node-{first + i}", role="free", since=now, note=note) for i in range(max(0, count))]
    record.nodes.extend(added)
    return added


def _hold(node: PoolNode, run_id: str, now: datetime, why: str) -> None:
    node.role, node.owner, node.since, node.note = "active", run_id, now, f"{run_id}: {why}"


def _free(node: PoolNode, now: datetime, note: str) -> None:
    node.role, node.owner, node.since, node.note = "free", None, now, note
