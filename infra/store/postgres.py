"""The store for controllers on several machines: PostgreSQL through psycopg 3 and its connection pool.

A write is one transaction under READ COMMITTED that locks the rows it goes on to change
(`SELECT ... FOR UPDATE`, the `lock` of a transaction): two claims of one spare meet on its row,
the second reads it as the first left it, and claims of other rows never wait on each other. Rows
are locked in one order (the pool's own row first, then nodes by name), so writers do not deadlock.
A connection the database dropped (a restart) is found before use and replaced; a transaction it
broke fails with StoreError, which the activity's retry policy retries.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

from lazarus.infra.store.base import StoreError, shown
from lazarus.infra.store.tables import make_tables

CONNECTIONS = 16
"""Connections one process keeps at most: the threads that run its stages at once."""
CONNECT_SECONDS = 30.0
"""How long a transaction waits for a connection (the database down, or every connection busy) before
StoreError (seconds)."""
TABLES_LOCK = 0x6C617A61
"""The advisory lock that makes one process at a time create the tables (two CREATE TABLE IF NOT
EXISTS at once can both try)."""

_PARAMETER = re.compile(r"\?")


class _Transaction:
    """A transaction on one pooled connection (infra/store Transaction)."""

    lock = " FOR UPDATE"

    def __init__(self, connection):
        self._connection = connection

    @staticmethod
    def _sql(sql: str) -> str:
        return _PARAMETER.sub("%s", sql)

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        return self._connection.execute(self._sql(sql), params).fetchall()

    def one(self, sql: str, params: Sequence[Any] = ()) -> tuple | None:
        return self._connection.execute(self._sql(sql), params).fetchone()

    def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        return self._connection.execute(self._sql(sql), params).rowcount

    def many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        with self._connection.cursor() as cursor:
            cursor.executemany(self._sql(sql), rows)


class PostgresStore:
    """A PostgreSQL database as the store (infra/store Store)."""

    engine = "postgresql"

    def __init__(self, url: str):
        try:  # here, so that only a PostgreSQL store needs them
            import psycopg
            import psycopg_pool  # noqa: F401
        except ImportError:
            raise StoreError(
                "a postgresql: store needs psycopg and psycopg_pool: pip install 'lazarus[postgresql]'"
            ) from None
        self._conninfo = url
        self.url = shown(url)
        self._pool = None
        self._pid: int | None = None
        # One connection of its own first: a database that is not there is said at once, not after the
        # pool has tried it for CONNECT_SECONDS.
        try:
            with psycopg.connect(url, connect_timeout=int(CONNECT_SECONDS)) as connection:
                tx = _Transaction(connection)
                tx.one("SELECT pg_advisory_xact_lock(?)", (TABLES_LOCK,))
                make_tables(tx, self.url)
        except psycopg.Error as error:
            raise StoreError(f"the store {self.url} does not answer: {_first_line(error)}") from None

    def _connections(self):
        pool = self._pool
        if pool is None or self._pid != os.getpid():  # a forked child never uses its parent's connections
            from psycopg_pool import ConnectionPool

            pool = ConnectionPool(
                self._conninfo,
                min_size=1,
                max_size=CONNECTIONS,
                timeout=CONNECT_SECONDS,
                check=ConnectionPool.check_connection,
                kwargs={"autocommit": False},
                open=False,
                name="lazarus-store",
            )
            try:
                pool.open(wait=True, timeout=CONNECT_SECONDS)
            except Exception as error:  # noqa: BLE001 - psycopg_pool's timeout or a connection error
                raise StoreError(f"the store {self.url} does not answer: {_first_line(error)}") from None
            self._pool, self._pid = pool, os.getpid()
        return pool

    @contextlib.contextmanager
    def _transaction(self, read_only: bool) -> Iterator[_Transaction]:
        import psycopg
        from psycopg_pool import PoolTimeout

        try:
            with self._connections().connection() as connection:  # commits at the end, rolls back on an error
                if read_only:  # one snapshot for every statement, as SQLite's read transaction
                    connection.read_only = True
                    connection.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
                try:
                    yield _Transaction(connection)
                finally:
                    if read_only:
                        connection.rollback()
                        connection.read_only = False
                        connection.isolation_level = None
        except (psycopg.OperationalError, PoolTimeout) as error:
            raise StoreError(f"the store {self.url}: {_first_line(error)}") from None

    def write(self) -> contextlib.AbstractContextManager[_Transaction]:
        return self._transaction(read_only=False)

    def read(self) -> contextlib.AbstractContextManager[_Transaction]:
        return self._transaction(read_only=True)

    def version(self) -> object | None:
        """None: a PostgreSQL database cannot tell whether it changed without a round trip."""
        return None

    def close(self) -> None:
        """Close its connections."""
        if self._pool is not None and self._pid == os.getpid():
            self._pool.close()
        self._pool, self._pid = None, None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
