"""The pool's record on disk (schema/pool.py), shared by every process of a home: read once per
version, changed under an exclusive flock of `pool/lock`, replaced by a rename.

A claim sees every claim before it, two runs can never both take one spare, and a process killed in
the middle leaves either the old record or the new one (the kernel drops a dead holder's lock).

A burst of faults across many runs asks for hundreds of changes within a second, and each write
serializes the whole pool: so the changes that threads of one process ask for while another's
commit holds the lock go in together, in one read and one write (group commit), and each is
undone alone when it fails. The record is parsed once per write by another process (this
process's own writes need no parse at all, and a parse keeps every node that write left alone):
`read` hands out one shared snapshot whose nodes and wants are frozen, and an edit changes a
shallow copy, replacing what it changes. A save writes again only the nodes that changed.
"""

from __future__ import annotations

import fcntl
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import pydantic_core

from lazarus.schema.files import write_json_atomic
from lazarus.schema.pool import PoolNode, PoolRecord, QuarantineBreaker, SpareWant, pool_file


class PoolFile:
    """One home's pool record: a snapshot read once per version, and edits committed together."""

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
                if snapshot is not None and key[0] < snapshot.key[0] and snapshot.written_just_now():
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
                    read = self.read()
                    record = _working(read)
                    for entry in batch:
                        trial = _working(record)
                        try:
                            entry.result = entry.edit(trial)
                            record = trial
                        except Exception as error:  # noqa: BLE001 - the edit's caller gets it
                            entry.error = error
                    if any(entry.error is None for entry in batch) and _changed(read, record):
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
        breaker = record.breaker.model_dump_json()
        text = (
            f'{{"generation":{record.generation},\n"nodes":[\n{nodes}],\n"wants":[{wants}],\n"breaker":{breaker}}}\n'
        ).encode()
        # The snapshot first: a look that opens the new file at once finds it known, not to parse.
        self._snapshot = _Snapshot(_version(text[:HEAD_BYTES], len(text)), record, text=text, written=time.monotonic())
        try:
            write_json_atomic(self.file, text.decode())
        except BaseException:
            self._snapshot = None
            raise


T = TypeVar("T")


@dataclass
class _Snapshot:
    """The record as this process last read or wrote it, and the file's identity then."""

    key: tuple[int, int]  # its version (_version)
    record: PoolRecord
    dead: dict[str, datetime | None] | None = None  # its unhealthy nodes, once asked for
    text: bytes | None = None  # the file's text, where the record was written here
    raw: dict[str, Any] | None = None  # each node's JSON object by name, once known
    written: float | None = None  # when this process wrote it (time.monotonic()); None: read

    def written_just_now(self) -> bool:
        """Whether this process wrote it a moment ago: a file older than it, opened meanwhile, was
        replaced by it (an older file found later means someone replaced the pool's record)."""
        return self.written is not None and time.monotonic() - self.written < JUST_NOW_SECONDS

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
        or set(raw) - {"generation", "nodes", "wants", "breaker"}
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
        breaker=QuarantineBreaker.model_validate(raw.get("breaker", {})),
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


JUST_NOW_SECONDS = 1.0
"""How long after this process wrote the record a reader may take an older file for a replaced one (seconds)."""

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


def _changed(before: PoolRecord, after: PoolRecord) -> bool:
    """Whether a batch's edits changed anything: most nodes are the very same objects (compared in
    C), and a recovery's closing steps (drop a want already gone) often change nothing, which then
    costs no write of thousands of nodes and no parse by every other process."""
    return after.nodes != before.nodes or after.wants != before.wants or after.breaker != before.breaker


def _working(record: PoolRecord) -> PoolRecord:
    """A copy an edit may change: its own lists of the same frozen nodes and wants."""
    return PoolRecord.model_construct(
        generation=record.generation, nodes=list(record.nodes), wants=list(record.wants), breaker=record.breaker
    )
