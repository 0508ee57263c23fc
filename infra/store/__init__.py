"""The database that holds what runs and controllers share: the node pool (infra/pool.py). One
interface, two engines, chosen by a URL:

- `sqlite:///ABSOLUTE/PATH.db` or `sqlite:RELATIVE/PATH.db`: the standard library's sqlite3 in WAL
  mode, a write as one `BEGIN IMMEDIATE` transaction. The embedded default, `<LAZARUS_HOME>/lazarus.db`:
  every process of one machine shares it; never put it on a network file system, where SQLite's
  locks do not hold.
- `postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE[?OPTIONS]` (libpq's URI, `postgres://` too):
  PostgreSQL through psycopg 3 and a connection pool, for controllers on several machines; a write
  is one transaction that locks the rows it changes (`SELECT ... FOR UPDATE`).

The URL comes from LAZARUS_STORE (`Settings.store`); docs/concepts/fleet.md says which store serves
which set-up. Code above this module writes its SQL once, with `?` for parameters, and runs it in
`store.write()` (a transaction that may change rows; `tx.lock` locks the rows a SELECT reads, where
the engine locks rows) or `store.read()` (a consistent read).
"""

from __future__ import annotations

from pathlib import Path

from lazarus.infra.store.base import Store, StoreError, StoreURLError, Transaction, shown

__all__ = ["Store", "StoreError", "StoreURLError", "Transaction", "default_url", "open_store", "shown"]

DEFAULT_FILE = "lazarus.db"
"""The embedded default's file, in LAZARUS_HOME."""


def default_url(home: str | Path) -> str:
    """The embedded default of a home: the SQLite file `<home>/lazarus.db`."""
    return f"sqlite:///{(Path(home).resolve() / DEFAULT_FILE).as_posix().lstrip('/')}"


def engine_of(url: str) -> str:
    """sqlite or postgresql: the engine a URL names; StoreURLError for any other."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "sqlite":
        return "sqlite"
    if scheme in ("postgresql", "postgres"):
        return "postgresql"
    raise StoreURLError(
        f"LAZARUS_STORE={url!r} names no store: use sqlite:///ABSOLUTE/PATH.db (one machine) or "
        "postgresql://USER@HOST:PORT/DATABASE (controllers on several machines)"
    )


def sqlite_path(url: str) -> Path:
    """The file of a sqlite: URL: sqlite:///abs/path.db is /abs/path.db, sqlite:rel/path.db is relative."""
    rest = url.split(":", 1)[1]
    path = "/" + rest[3:] if rest.startswith("///") else rest[2:] if rest.startswith("//") else rest
    if not path or path.endswith("/"):
        raise StoreURLError(f"LAZARUS_STORE={url!r} names no database file (sqlite:///ABSOLUTE/PATH.db)")
    return Path(path)


def open_store(url: str) -> Store:
    """The store a URL names, opened, its tables made where they are missing. StoreURLError for a
    URL of no known engine; StoreError where the database cannot be reached or psycopg is missing."""
    if engine_of(url) == "sqlite":
        from lazarus.infra.store.sqlite import SqliteStore

        return SqliteStore(sqlite_path(url))
    from lazarus.infra.store.postgres import PostgresStore

    return PostgresStore(url)
