"""The embedded store: one SQLite file in WAL mode, shared by every process of one machine.

A write is `BEGIN IMMEDIATE`: it takes the database's one write lock before it reads, so what it
read is still true when it commits, and writers take turns (each a few milliseconds) while readers
go on reading the last commit. A process killed inside a transaction leaves the last commit, and
the next writer goes on at once. Each thread has its own connection (sqlite3's rule), and a forked
child opens its own rather than use its parent's.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from lazarus.infra.store.base import StoreError
from lazarus.infra.store.tables import make_tables

BUSY_SECONDS = 60.0
"""How long a write waits for the write lock another holds before StoreError (seconds). Writes take
milliseconds: this is only reached when a process holds the lock and hangs."""


class _Transaction:
    """A transaction on one connection (infra/store Transaction)."""

    lock = ""  # a write transaction holds the whole database

    def __init__(self, connection: sqlite3.Connection):
        self._connection = connection

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        return self._connection.execute(sql, params).fetchall()

    def one(self, sql: str, params: Sequence[Any] = ()) -> tuple | None:
        return self._connection.execute(sql, params).fetchone()

    def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        return self._connection.execute(sql, params).rowcount

    def many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        self._connection.executemany(sql, rows)


class SqliteStore:
    """A SQLite file as the store (infra/store Store)."""

    engine = "sqlite"

    def __init__(self, path: Path):
        self.path = Path(path)
        self.url = f"sqlite:///{self.path.resolve().as_posix().lstrip('/')}"
        self._local = threading.local()
        self._writes = 0  # write transactions this process committed, on any thread's connection
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise StoreError(f"the store {self.url} cannot be made: {error.strerror or error}") from None
        with self.write() as tx:
            make_tables(tx, self.url)

    def _connection(self) -> sqlite3.Connection:
        local = self._local
        if getattr(local, "pid", None) != os.getpid():
            try:
                connection = sqlite3.connect(
                    self.path, timeout=BUSY_SECONDS, isolation_level=None, check_same_thread=False
                )
                connection.execute("PRAGMA journal_mode=WAL")
                # WAL with synchronous=NORMAL survives any crash of a process; the OS crashing can lose
                # the last commits (not corrupt the file), as every other file of a home.
                connection.execute("PRAGMA synchronous=NORMAL")
                # The pool's rows and indexes in memory (64 MiB at most: a pool of 60,000 nodes takes
                # about 20): a claim then costs the same in a pool of any size.
                connection.execute("PRAGMA cache_size=-65536")
            except sqlite3.Error as error:
                raise StoreError(f"the store {self.url} cannot be opened: {error}") from None
            local.connection, local.pid = connection, os.getpid()
        return local.connection

    @contextlib.contextmanager
    def _transaction(self, begin: str) -> Iterator[_Transaction]:
        connection = self._connection()
        try:
            connection.execute(begin)
        except sqlite3.OperationalError as error:
            raise StoreError(f"the store {self.url}: {error}") from None
        try:
            yield _Transaction(connection)
        except BaseException:
            connection.execute("ROLLBACK")
            raise
        try:
            connection.execute("COMMIT")
        except sqlite3.OperationalError as error:
            connection.execute("ROLLBACK")
            raise StoreError(f"the store {self.url}: {error}") from None
        if begin != "BEGIN":
            self._writes += 1

    def write(self) -> contextlib.AbstractContextManager[_Transaction]:
        return self._transaction("BEGIN IMMEDIATE")

    def read(self) -> contextlib.AbstractContextManager[_Transaction]:
        return self._transaction("BEGIN")

    def version(self) -> object | None:
        """The thread's connection's data_version (it changes with every commit of another connection,
        this process's other threads' included) and this process's own commits: a few microseconds,
        against a query's tens."""
        return (self._connection().execute("PRAGMA data_version").fetchone()[0], self._writes)

    def close(self) -> None:
        """Close this thread's connection (the others close with their threads)."""
        if getattr(self._local, "pid", None) == os.getpid():
            self._local.connection.close()
            del self._local.connection, self._local.pid
