"""The store's tables, the same on both engines (portable types: TEXT, INTEGER; times as ISO-8601
text in UTC, which both compare and sort as written), made where they are missing.

Each index is there for a question the controller asks on its hot path, so that its cost does not
grow with the pool: the free spares in the order they were added, a run's holdings, a fault
domain's nodes, the dead nodes (few, so a partial index), an incarnation's claim.
"""

from __future__ import annotations

from lazarus.infra.store.base import StoreError

SCHEMA_VERSION = 2
"""Bumped with every change to the tables below; a store of a newer version is refused."""

TABLES = (
    # Settings of the store itself: its schema version, where an old pool file was imported from.
    "CREATE TABLE IF NOT EXISTS lazarus_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    # One row per node of the pool (schema/pool.py PoolNode); seq is the order it was added in.
    """CREATE TABLE IF NOT EXISTS pool_nodes (
        name TEXT PRIMARY KEY,
        seq INTEGER NOT NULL UNIQUE,
        role TEXT NOT NULL,
        owner TEXT,
        healthy INTEGER NOT NULL,
        died_at TEXT,
        since TEXT NOT NULL,
        note TEXT NOT NULL,
        domain TEXT
    )""",
    # The free nodes in the order they were added (a run's view lists the first few of thousands),
    # a run's holdings, a fault domain's nodes, the dead nodes. Partial where only some rows are
    # asked for, and no index on what a claim changes but no query asks: a claim rewrites the
    # entries of each index that holds the columns it changes.
    "CREATE INDEX IF NOT EXISTS pool_nodes_free ON pool_nodes (seq) WHERE role = 'free'",
    "CREATE INDEX IF NOT EXISTS pool_nodes_owner ON pool_nodes (owner, role, seq) WHERE owner IS NOT NULL",
    "CREATE INDEX IF NOT EXISTS pool_nodes_domain ON pool_nodes (domain) WHERE domain IS NOT NULL",
    "CREATE INDEX IF NOT EXISTS pool_nodes_dead ON pool_nodes (died_at) WHERE healthy = 0",
    # The pool as a whole, one row: its size, the next node's number, the quarantine breaker's
    # settings and trip (schema/pool.py QuarantineBreaker, as JSON, its window apart). A write that
    # changes these locks the row: adds and counted quarantines take turns, claims do not wait on them.
    """CREATE TABLE IF NOT EXISTS pool_state (
        id INTEGER PRIMARY KEY,
        nodes INTEGER NOT NULL,
        next_seq INTEGER NOT NULL,
        breaker TEXT NOT NULL
    )""",
    # The breaker's window: nodes faults quarantined, and when.
    "CREATE TABLE IF NOT EXISTS pool_quarantines (node TEXT PRIMARY KEY, at TEXT NOT NULL)",
    "CREATE INDEX IF NOT EXISTS pool_quarantines_at ON pool_quarantines (at)",
    # Runs' needs of spares during their recoveries (schema/pool.py SpareWant, as JSON), with the
    # fields that order them (SpareWant.sort_key) as columns: a run's view counts in the store the
    # spares that the needs before its own take, instead of reading a burst's thousand needs.
    """CREATE TABLE IF NOT EXISTS pool_wants (
        run_id TEXT PRIMARY KEY,
        want TEXT NOT NULL,
        needed INTEGER NOT NULL,
        placed INTEGER NOT NULL,
        priority INTEGER NOT NULL,
        lost_ranks INTEGER NOT NULL,
        fault_at TEXT NOT NULL
    )""",
    # The assignment each incarnation claimed its nodes for, written in the claim's transaction: a
    # claim retried after a crash finds it (exactly once).
    """CREATE TABLE IF NOT EXISTS run_claims (
        run_id TEXT NOT NULL,
        incarnation INTEGER NOT NULL,
        assignment TEXT NOT NULL,
        PRIMARY KEY (run_id, incarnation)
    )""",
    # Who may act on each run (infra/ownership_rows.py): its owner record (schema/ownership.py
    # Ownership, as JSON; NULL until an execution acted on it) and the mark of a take-over under way
    # (the execution taking it, and until when the mark holds).
    """CREATE TABLE IF NOT EXISTS run_owners (
        run_id TEXT PRIMARY KEY,
        record TEXT,
        taking_over TEXT,
        taking_until TEXT
    )""",
    # The stages acting on a run, each a lease that its process renews until the stage ends.
    """CREATE TABLE IF NOT EXISTS run_acting (
        run_id TEXT NOT NULL,
        stage TEXT NOT NULL,
        until TEXT NOT NULL,
        PRIMARY KEY (run_id, stage)
    )""",
    "CREATE INDEX IF NOT EXISTS run_acting_stage ON run_acting (stage)",
    "INSERT INTO pool_state (id, nodes, next_seq, breaker) VALUES (1, 0, 0, '{}') ON CONFLICT (id) DO NOTHING",
)


def make_tables(tx, shown_url: str) -> None:
    """Make the tables that are missing and record the schema version; StoreError for a store a
    newer Lazarus wrote."""
    for statement in TABLES:
        tx.run(statement)
    found = tx.one("SELECT value FROM lazarus_meta WHERE key = 'schema_version'")
    if found is None:
        tx.run("INSERT INTO lazarus_meta (key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
    elif int(found[0]) < SCHEMA_VERSION:  # an older store: the tables it lacked were made above
        tx.run("UPDATE lazarus_meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))
    elif int(found[0]) > SCHEMA_VERSION:
        raise StoreError(
            f"the store {shown_url} has schema version {found[0]}, written by a newer Lazarus than this one "
            f"(version {SCHEMA_VERSION}): upgrade this controller"
        )
