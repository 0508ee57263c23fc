"""The local backend's node pool under LAZARUS_HOME, shared by every run of that home, as a
Kubernetes pool is shared by its label.

Every change is a read-modify-write of one record (schema/pool.py) under an exclusive flock of
`pool/lock`, and the record is replaced by a rename: a claim sees every claim before it, two
runs can never both take one spare, and a worker killed in the middle leaves either the old
record or the new one (the kernel drops a dead holder's lock). What changes a run's assignment
and the pool together (LocalCluster.commit_assignment) holds the lock across both.

A burst of faults across many runs asks for hundreds of changes within a second, and each write
serializes the whole pool: so the changes that threads of one process ask for while another's
commit holds the lock go in together, in one read and one write (group commit), and each is
undone alone when it fails. The record is parsed once per write (this process's own writes need
no parse at all): `read` hands out one shared snapshot whose nodes and wants are frozen, and a
change edits a shallow copy, replacing what it changes.
"""

from __future__ import annotations

import fcntl
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import pydantic_core

from lazarus.infra.backend import ClusterError
from lazarus.schema.files import write_json_atomic
from lazarus.schema.pool import PoolNode, PoolRecord, SpareWant, node_number, pool_file
from lazarus.schema.records import Inventory, NodeRecord


class LocalPool:
    """The nodes of one home: who holds which, and which are free hot spares."""

    def __init__(self, home: str | Path):
        self.file = pool_file(Path(home))
        self._snapshot: _Snapshot | None = None  # the record as last read or written by this process
        self._parsing = threading.Lock()
        self._texts: dict[str, tuple[PoolNode, str]] = {}  # each node's JSON text as last written here
        self._combining = threading.Lock()  # held by the thread that commits a batch of changes
        self._queue_lock = threading.Lock()
        self._queue: list[_Change] = []
        # Assignments whose claims are in the commit under way, not yet written (LocalCluster.commit_assignment).
        self.assigning: dict[tuple[str, int], Any] = {}

    def read(self) -> PoolRecord:
        """The record as last written (an empty pool before the first write). Shared and parsed once
        per write: its nodes and wants are frozen, and changes go through the methods below."""
        try:
            with open(self.file, "rb") as handle:
                head = handle.read(HEAD_BYTES)
                key = _version(head, os.fstat(handle.fileno()).st_size)
                snapshot = self._snapshot
                if key[0] < 0:  # not written by `save`: no version to know it by
                    return PoolRecord.model_validate_json(head + handle.read())
                if snapshot is not None and key[0] < snapshot.key[0]:
                    return snapshot.record  # a commit of this process replaced the file since it was opened
                if snapshot is None or snapshot.key != key:
                    with self._parsing:  # the threads that see a new version at once parse it once
                        snapshot = self._snapshot
                        if snapshot is None or snapshot.key != key:
                            snapshot = _parsed(key, head + handle.read(), snapshot)
                            # A file opened before a commit of this process replaced it is older than
                            # the snapshot that commit left: keep the newer.
                            if self._snapshot is None or key[0] > self._snapshot.key[0]:
                                self._snapshot = snapshot
                return snapshot.record
        except FileNotFoundError:
            return PoolRecord()

    def unhealthy(self) -> dict[str, datetime | None]:
        """The pool's dead nodes and when each died: what every look asks, worked out once per write
        (a look at a run of thousands of nodes would otherwise go through them each time)."""
        record = self.read()
        snapshot = self._snapshot
        if snapshot is None or snapshot.record is not record:
            return {n.name: n.died_at for n in record.nodes if not n.healthy}
        if snapshot.dead is None:
            snapshot.dead = {n.name: n.died_at for n in record.nodes if not n.healthy}
        return snapshot.dead

    def change(self, edit: Callable[[PoolRecord], T], then: Callable[[T], T] | None = None) -> T:
        """`edit(record)` under the pool's lock, written, and `then(result)` after the write while the
        lock is still held; returns the result, or raises edit's error (which undoes that edit alone).

        `record` is a working copy: its lists may be changed in place, a node or want only replaced
        (they are frozen). Edits that other threads ask for meanwhile join the same commit."""
        mine = _Change(edit, then)
        with self._queue_lock:
            self._queue.append(mine)
        with self._combining:
            if not mine.done:
                with self._queue_lock:
                    batch, self._queue = self._queue, []
                self._commit(batch)
        return mine.outcome()

    def _commit(self, batch: list[_Change]) -> None:
        """Apply a batch of edits to the record read under the lock, write it once, run the then-steps."""
        self.file.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(self.file.parent / "lock", "a") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX)
                try:
                    record = _working(self.read())
                    for entry in batch:
                        trial = _working(record)
                        try:
                            entry.result = entry.edit(trial)
                            record = trial
                        except Exception as error:  # noqa: BLE001 - the edit's caller gets it
                            entry.error = error
                    if any(entry.error is None for entry in batch):
                        self.save(record)
                    for entry in batch:
                        if entry.error is None and entry.then is not None:
                            try:
                                entry.result = entry.then(entry.result)
                            except Exception as error:  # noqa: BLE001 - the edit's caller gets it
                                entry.error = error
                finally:
                    fcntl.flock(handle, fcntl.LOCK_UN)
        except BaseException as error:  # the lock or the write failed: every edit of the batch did
            for entry in batch:
                if entry.error is None:
                    entry.error = error
            raise
        finally:
            self.assigning.clear()
            for entry in batch:
                entry.done = True

    def save(self, record: PoolRecord) -> None:
        """Write the record now, one generation on (only inside a commit, which holds the lock)."""
        record.generation += 1
        known, texts = self._texts, {}
        for node in record.nodes:  # a commit changes a few nodes: the others' text is the one written before
            cached = known.get(node.name)
            texts[node.name] = (node, cached[1] if cached is not None and cached[0] is node else node.model_dump_json())
        self._texts = texts
        wants = ",".join(want.model_dump_json() for want in record.wants)
        nodes = ",\n".join(text for _, text in texts.values())
        text = f'{{"generation":{record.generation},\n"nodes":[\n{nodes}],\n"wants":[{wants}]}}\n'.encode()
        # The snapshot first: a look that opens the new file at once finds it known, not to parse.
        self._snapshot = _Snapshot(_version(text[:HEAD_BYTES], len(text)), record, text=text)
        try:
            write_json_atomic(self.file, text.decode())
        except BaseException:
            self._snapshot = None
            raise

    # --- changes, each under the lock --------------------------------------------------------

    def add(self, count: int, note: str = "added") -> list[str]:
        """Add `count` free healthy nodes; returns their names."""
        return self.change(lambda record: [node.name for node in _add(record, count, note)])

    def provision(self, run_id: str, active: int, spares: int) -> list[str]:
        """Give a new run `active` nodes of its own and leave `spares` free nodes as the pool's hot
        spares: free nodes beyond those spares first, then nodes added (a local node costs nothing
        until it runs). A repeated call finds the nodes the run holds. Returns its active nodes."""

        def edit(record: PoolRecord) -> list[str]:
            mine = [node.name for node in record.held_by(run_id)]
            if not mine:
                now = datetime.now(UTC)
                free = record.free()
                wanted = [node.name for node in free[: max(0, min(active, len(free) - spares))]]
                wanted += [node.name for node in _add(record, active - len(wanted), "added for a run")]
                _hold(record, wanted, run_id, now, "launch")
                mine = wanted
            _add(record, spares - len(record.free()), "added as a hot spare")
            return mine

        return self.change(edit)

    def set_health(self, changes: dict[str, dict]) -> PoolRecord:
        """Apply field changes (healthy, died_at, note) to named nodes; ClusterError names an unknown one."""

        def edit(record: PoolRecord) -> PoolRecord:
            _known(record, changes)
            record.nodes[:] = [
                PoolNode.model_validate({**n.model_dump(), **changes[n.name]}) if n.name in changes else n
                for n in record.nodes
            ]
            return record

        return self.change(edit)

    def quarantine(self, run_id: str, names: list[str], reason: str) -> None:
        """Hold the nodes out of every run until they are returned (the run that holds them drains them)."""

        def edit(record: PoolRecord) -> None:
            nodes = _known(record, dict.fromkeys(names))
            others = [n for n in names if nodes[n].owner not in (None, run_id)]
            if others:
                raise ClusterError(f"{', '.join(others)} belongs to another run ({nodes[others[0]].owner})")
            _replace(record, names, role="quarantined", owner=run_id, since=datetime.now(UTC), note=reason)

        self.change(edit)

    def return_node(self, name: str) -> PoolNode:
        """A repaired node rejoins the pool as a free healthy spare; returns it as recorded."""

        def edit(record: PoolRecord) -> PoolNode:
            node = _known(record, {name: None})[name]
            if node.role == "active":
                raise ClusterError(f"{name} is active in run {node.owner}; only a quarantined or dead node is returned")
            fields = {"healthy": True, "died_at": None}
            return _free(record, [name], datetime.now(UTC), "returned", **fields)[0]

        return self.change(edit)

    def release(self, run_id: str) -> list[str]:
        """The run ended: its active nodes go back to the pool as free spares (what it quarantined
        stays quarantined) and its want goes; returns the nodes."""

        def edit(record: PoolRecord) -> list[str]:
            mine = [node.name for node in record.held_by(run_id)]
            _free(record, mine, datetime.now(UTC), f"released by {run_id}")
            record.wants[:] = [w for w in record.wants if w.run_id != run_id]
            return mine

        return self.change(edit)

    def want(self, want: SpareWant) -> None:
        """Lodge a run's need of spares, in place of its earlier one."""

        def edit(record: PoolRecord) -> None:
            record.wants[:] = [w for w in record.wants if w.run_id != want.run_id] + [want]

        self.change(edit)

    def drop_want(self, run_id: str) -> None:
        """The run's recovery is over: its want goes."""

        def edit(record: PoolRecord) -> None:
            record.wants[:] = [w for w in record.wants if w.run_id != run_id]

        self.change(edit)

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
    """In `record` (a working copy): make `nodes` the run's active nodes and free `releases` it held
    (but not `nodes`). ClusterError, changing nothing, when one of `nodes` is neither free and
    healthy nor already the run's (a retry of a claim that succeeded succeeds)."""
    known = _known(record, dict.fromkeys(nodes))
    taken = [n for n in nodes if not _claimable(known[n], run_id)]
    if taken:
        free = _listed([n.name for n in record.free()])
        held = "; ".join(f"{n} {_held(known[n])}" for n in taken)
        raise ClusterError(f"node {', '.join(taken)} is no longer a free spare ({held}; free: {free})")
    now = datetime.now(UTC)
    claimed = [name for name in nodes if known[name].owner != run_id or known[name].role != "active"]
    _hold(record, claimed, run_id, now, why)
    record.wants[:] = [
        w.model_copy(update={"placed": True, "got": len(claimed)}) if w.run_id == run_id and not w.placed else w
        for w in record.wants
    ]
    leftover = [n.name for n in record.held_by(run_id) if n.name in releases and n.name not in nodes]
    _free(record, leftover, now, f"released by {run_id} at {why}")


T = TypeVar("T")


@dataclass
class _Snapshot:
    """The record as this process last read or wrote it, and the file's identity then."""

    key: tuple[int, int]  # its version (_version)
    record: PoolRecord
    dead: dict[str, datetime | None] | None = None  # its unhealthy nodes, once asked for
    text: bytes | None = None  # the file's text, where the record was written here
    raw: dict[str, Any] | None = None  # each node's JSON object by name, once known

    def raw_nodes(self) -> dict[str, Any]:
        if self.raw is None:
            self.raw = {n["name"]: n for n in pydantic_core.from_json(self.text)["nodes"]} if self.text else {}
        return self.raw


def _parsed(key: tuple[int, int], text: bytes, previous: _Snapshot | None) -> _Snapshot:
    """The record of `text`, each node that is as in `previous` taken from it: one write changes a
    few nodes, and comparing thousands of JSON objects costs a fraction of validating them."""
    raw = pydantic_core.from_json(text)
    if (
        not isinstance(raw, dict)
        or set(raw) - {"generation", "nodes", "wants"}
        or not isinstance(raw.get("nodes"), list)
    ):
        return _Snapshot(key, PoolRecord.model_validate_json(text))  # not one of ours: its errors in full
    known = previous.raw_nodes() if previous is not None else {}
    reused = {n.name: n for n in previous.record.nodes} if previous is not None else {}
    nodes = [
        reused[data["name"]] if known.get(data.get("name")) == data else PoolNode.model_validate(data)
        for data in raw["nodes"]
    ]
    record = PoolRecord.model_construct(
        generation=raw.get("generation", 0),
        nodes=nodes,
        wants=[SpareWant.model_validate(want) for want in raw.get("wants", [])],
    )
    return _Snapshot(key, record, raw={n["name"]: n for n in raw["nodes"]})


@dataclass
class _Change:
    """One thread's edit of the pool, waiting for the commit that carries it."""

    edit: Callable[[PoolRecord], Any]
    then: Callable[[Any], Any] | None
    result: Any = None
    error: BaseException | None = None
    done: bool = False

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.result


HEAD_BYTES = 64
"""How much of the record's file tells its version: the generation, its first field."""
_GENERATION = re.compile(rb'\{\s*"generation":\s*(\d+)')


def _version(head: bytes, size: int) -> tuple[int, int]:
    """A version of the record's file from its first bytes and its size: its generation grows with
    every write, under the lock (-1 when the head does not show it: never kept). A file's
    identity would not do: a rename reuses freed inodes, and modification times are as coarse as
    the kernel's tick, so two writes within one can look the same."""
    found = _GENERATION.match(head)
    return (int(found[1]) if found else -1), size


def _working(record: PoolRecord) -> PoolRecord:
    """A copy an edit may change: its own lists of the same frozen nodes and wants."""
    return PoolRecord.model_construct(generation=record.generation, nodes=list(record.nodes), wants=list(record.wants))


def _listed(names: list[str], shown: int = 8) -> str:
    """Names for a message: the first few and how many more (a pool may have thousands free)."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return (", ".join(names[:shown]) + more) or "none"


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


def _replace(record: PoolRecord, names: list[str], **fields) -> list[PoolNode]:
    """Put a copy with `fields` in the place of each named node of the working record; returns the copies."""
    wanted = set(names)
    copies = []
    for index, node in enumerate(record.nodes):
        if node.name in wanted:
            record.nodes[index] = node.model_copy(update=fields)
            copies.append(record.nodes[index])
    return copies


def _hold(record: PoolRecord, names: list[str], run_id: str, now: datetime, why: str) -> None:
    _replace(record, names, role="active", owner=run_id, since=now, note=f"{run_id}: {why}")


def _free(record: PoolRecord, names: list[str], now: datetime, note: str, **fields) -> list[PoolNode]:
    return _replace(record, names, role="free", owner=None, since=now, note=note, **fields)
