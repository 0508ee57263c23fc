"""The owner records in the store (infra/ownership.py OwnerRecords), which every controller of a
fleet shares: a row of `run_owners` per run, and a row of `run_acting` per stage that acts on one.

A stage's row is a lease: the process that holds it renews it every RENEW_EVERY_SECONDS, one thread
for all of its stages, so a stage of a controller that died (SIGKILL, its machine gone) stops
holding off a take-over ACTING_LEASE_SECONDS later, where a flock on a shared disk would have
needed that disk's lock manager to notice. A take-over first marks the run (`taking_over`, until a
time, so that a take-over that died lets go too): from then on no stage starts acting; then it
waits until no lease is current, then records the new owner and lifts the mark, in one
transaction that locks the run's row. Reading the record needs no write: a stage that says it acts
before it reads cannot see the record change under it, since the take-over waits for it.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import weakref
from datetime import UTC, datetime, timedelta
from typing import Literal

from lazarus.infra.ownership import (
    ACTING_POLL_SECONDS,
    held_record,
    still_acting,
    taken_record,
)
from lazarus.infra.store import Store, StoreError, Transaction
from lazarus.schema.ownership import Owner, Ownership

log = logging.getLogger(__name__)

ACTING_LEASE_SECONDS = 10.0
"""How long a stage's word that it acts holds without renewal (seconds): how long a take-over waits
for a stage whose controller died."""

RENEW_EVERY_SECONDS = 2.5
"""How often a process renews the leases of its stages that act (seconds): a quarter of the lease,
so that a store slow to answer a renewal or two costs no lease."""

MARK_GRACE_SECONDS = 10.0
"""How long a take-over's mark outlasts its wait (seconds), after which a take-over that died no
longer holds off the run's stages."""


class StoreOwnerRecords:
    """The owner records and acting leases in a store (OwnerRecords)."""

    def __init__(self, store: Store):
        self.store = store
        self._leases = _Leases(store)

    def read(self, run_id: str) -> Ownership | None:
        with self.store.read() as tx:
            row = tx.one("SELECT record FROM run_owners WHERE run_id = ?", (run_id,))
        return Ownership.model_validate_json(row[0]) if row is not None and row[0] is not None else None

    def hold(self, run_id: str, owner: Owner) -> Ownership:
        record = self.read(run_id)
        if record is not None and held_record(record, owner, datetime.now(UTC)) is None:
            return record  # the owner acts again: the most common case, a read and no write
        with self.store.write() as tx:
            record, _ = _locked(tx, run_id)
            changed = held_record(record, owner, datetime.now(UTC))
            if changed is None:
                assert record is not None
                return record
            tx.run("UPDATE run_owners SET record = ? WHERE run_id = ?", (changed.model_dump_json(), run_id))
            return changed

    def share_acting(self, run_id: str) -> _Lease | None:
        stage, now = uuid.uuid4().hex, datetime.now(UTC)
        with self.store.write() as tx:
            _, marked_until = _locked(tx, run_id)
            if marked_until is not None and marked_until > _iso(now):
                return None
            # The leases a dead worker left on this run go with the run's next stage.
            tx.run("DELETE FROM run_acting WHERE run_id = ? AND until <= ?", (run_id, _iso(now)))
            until = _iso(now + timedelta(seconds=ACTING_LEASE_SECONDS))
            tx.run("INSERT INTO run_acting (run_id, stage, until) VALUES (?, ?, ?)", (run_id, stage, until))
        return self._leases.add(stage)

    def take_over(
        self, run_id: str, owner: Owner, previous: str, kind: Literal["reset", "adopt"], wait_seconds: float = 60.0
    ) -> tuple[Ownership, Owner | None]:
        deadline = time.monotonic() + wait_seconds
        done = self._mark(run_id, owner, deadline, wait_seconds)
        if done is not None:
            return done, None
        try:
            while self._acting(run_id):
                if time.monotonic() > deadline:
                    raise still_acting(run_id, wait_seconds)
                time.sleep(ACTING_POLL_SECONDS)
            now = datetime.now(UTC)
            with self.store.write() as tx:
                record, _ = _locked(tx, run_id)
                changed, replaced = taken_record(record, owner, previous, kind, now)
                tx.run(
                    "UPDATE run_owners SET record = COALESCE(?, record), taking_over = NULL, taking_until = NULL "
                    "WHERE run_id = ?",
                    (changed.model_dump_json() if changed is not None else None, run_id),
                )
                tx.run("DELETE FROM run_acting WHERE run_id = ? AND until <= ?", (run_id, _iso(now)))
        except BaseException:
            self._unmark(run_id, owner)
            raise
        if changed is None:
            assert record is not None
            return record, None
        return changed, replaced

    def _mark(self, run_id: str, owner: Owner, deadline: float, wait_seconds: float) -> Ownership | None:
        """Mark the run as being taken by `owner`, once no other take-over marks it; the record
        where `owner` already owns the run (a retried take-over: nothing to mark)."""
        while True:
            now = datetime.now(UTC)
            with self.store.write() as tx:
                record, marked_until = _locked(tx, run_id)
                if record is not None and record.owner.execution == owner.execution:
                    return record
                if marked_until is None or marked_until <= _iso(now):
                    until = _iso(now + timedelta(seconds=wait_seconds + MARK_GRACE_SECONDS))
                    tx.run(
                        "UPDATE run_owners SET taking_over = ?, taking_until = ? WHERE run_id = ?",
                        (owner.execution, until, run_id),
                    )
                    return None
            if time.monotonic() > deadline:
                raise still_acting(run_id, wait_seconds)
            time.sleep(ACTING_POLL_SECONDS)

    def _unmark(self, run_id: str, owner: Owner) -> None:
        try:
            with self.store.write() as tx:
                tx.run(
                    "UPDATE run_owners SET taking_over = NULL, taking_until = NULL "
                    "WHERE run_id = ? AND taking_over = ?",
                    (run_id, owner.execution),
                )
        except StoreError as error:  # the mark lapses by itself (MARK_GRACE_SECONDS)
            log.warning("could not lift the take-over mark of run %s: %s", run_id, error)

    def _acting(self, run_id: str) -> bool:
        with self.store.read() as tx:
            row = tx.one("SELECT 1 FROM run_acting WHERE run_id = ? AND until > ?", (run_id, _iso(datetime.now(UTC))))
        return row is not None


def _iso(moment: datetime) -> str:
    """A time as the store keeps it: ISO-8601 text in UTC, which sorts as the times do."""
    return moment.astimezone(UTC).isoformat(timespec="microseconds")


def _locked(tx: Transaction, run_id: str) -> tuple[Ownership | None, str | None]:
    """The run's record and the end of a take-over's mark (ISO text; None: none), its row made where
    missing and locked for the rest of the transaction."""
    tx.run("INSERT INTO run_owners (run_id) VALUES (?) ON CONFLICT (run_id) DO NOTHING", (run_id,))
    row = tx.one("SELECT record, taking_until FROM run_owners WHERE run_id = ?" + tx.lock, (run_id,))
    assert row is not None
    record = Ownership.model_validate_json(row[0]) if row[0] is not None else None
    return record, row[1]


class _Lease:
    """One stage's lease (Acting): renewed until closed."""

    def __init__(self, leases: _Leases, stage: str):
        self.stage = stage  # its row's key in run_acting
        # A lease dropped unclosed (a stage cancelled while it was being taken) ends when collected.
        self._end = weakref.finalize(self, leases.end, stage)

    def close(self) -> None:
        """End the lease: its row goes at once, on the renewing thread (a stage ends on the event loop,
        which must not wait for the store)."""
        self._end()


class _Leases:
    """The leases one process holds in one store, renewed and ended by one thread."""

    def __init__(self, store: Store):
        self.store = store
        self._held: set[str] = set()
        self._ended: list[str] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, stage: str) -> _Lease:
        with self._lock:
            self._held.add(stage)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._keep, name="acting-leases", daemon=True)
                self._thread.start()
        return _Lease(self, stage)

    def end(self, stage: str) -> None:
        with self._lock:
            if stage in self._held:
                self._held.discard(stage)
                self._ended.append(stage)
        self._wake.set()

    def _keep(self) -> None:
        renewed = time.monotonic()
        while True:
            self._wake.wait(max(0.0, renewed + RENEW_EVERY_SECONDS - time.monotonic()))
            self._wake.clear()
            with self._lock:
                ended, self._ended = self._ended, []
                held = sorted(self._held)
            renew = held and time.monotonic() - renewed >= RENEW_EVERY_SECONDS
            try:
                if ended or renew:
                    self._write(ended, held if renew else [])
            except StoreError as error:
                log.warning("acting leases not renewed or ended (tried again): %s", error)
                with self._lock:
                    self._ended.extend(ended)
                continue
            if renew or not held:
                renewed = time.monotonic()

    def _write(self, ended: list[str], renew: list[str]) -> None:
        with self.store.write() as tx:
            if ended:
                tx.many("DELETE FROM run_acting WHERE stage = ?", [(stage,) for stage in ended])
            if renew:
                until = _iso(datetime.now(UTC) + timedelta(seconds=ACTING_LEASE_SECONDS))
                tx.many("UPDATE run_acting SET until = ? WHERE stage = ?", [(until, stage) for stage in renew])
