"""What every part of the store shares: its errors, and the shape of a store and of a transaction
(infra/store/__init__.py says which engines there are and how a URL picks one)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Protocol
from urllib.parse import urlsplit


class StoreError(RuntimeError):
    """The store cannot be opened or answered with an error. Not a ClusterError: an activity that
    meets it is retried by its policy (a database restarting answers again)."""


class StoreURLError(ValueError):
    """A store URL that names no engine this module knows, or no database: the user's to fix."""


class Transaction(Protocol):
    """One transaction of a store, as SQL written once for both engines sees it."""

    lock: str
    """Appended to a SELECT whose rows the transaction goes on to change: " FOR UPDATE" where the
    engine locks rows (PostgreSQL), "" where a write transaction holds the whole database (SQLite)."""

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        """Every row the statement returns."""
        ...

    def one(self, sql: str, params: Sequence[Any] = ()) -> tuple | None:
        """The first row the statement returns, or None."""
        ...

    def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run a statement that returns no rows; returns how many rows it changed."""
        ...

    def many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        """Run one statement once per parameter row."""
        ...


class Store(Protocol):
    """A database of shared state: an engine, and transactions on it."""

    engine: str
    """sqlite or postgresql."""
    url: str
    """Where it is, without a password: for messages."""

    def write(self) -> contextlib.AbstractContextManager[Transaction]:
        """A transaction that may change rows: committed when the block ends, rolled back when it raises."""
        ...

    def read(self) -> contextlib.AbstractContextManager[Transaction]:
        """A transaction that only reads: every statement in it sees the same state."""
        ...

    def close(self) -> None:
        """Let go of its connections."""
        ...

    def version(self) -> object | None:
        """A token that changes whenever the database may have changed since it was taken, as seen by
        the calling thread; None where the engine cannot tell cheaply (readers then keep what they
        read for a short while instead)."""
        ...


def shown(url: str) -> str:
    """The URL without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return url.replace(f":{parts.password}@", ":***@", 1)
