"""A home's pool file from before the pool moved into the store (`pool/nodes.json`), brought into the
store once."""

from __future__ import annotations

import json
from pathlib import Path

from lazarus.infra import pool_rows as rows
from lazarus.infra.store import Store, Transaction
from lazarus.schema.pool import PoolRecord


def import_record(tx: Transaction, record: PoolRecord) -> int:
    """Write an old pool file's record (schema/pool.py PoolRecord) into an empty pool; returns the
    nodes imported (0, writing nothing, where the pool has nodes already)."""
    if tx.one("SELECT count(*) FROM pool_nodes")[0]:  # type: ignore[index]
        return 0
    numbered = [(n, _number(n.name, i)) for i, n in enumerate(record.nodes)]
    tx.many(
        f"INSERT INTO pool_nodes (seq, {rows.COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        [
            (seq, n.name, n.role, n.owner, int(n.healthy), rows.iso(n.died_at), rows.iso(n.since), n.note, n.domain)
            for n, seq in numbered
        ],
    )
    next_seq = max((seq for _, seq in numbered), default=-1) + 1
    tx.run("UPDATE pool_state SET nodes = ?, next_seq = ? WHERE id = 1", (len(numbered), next_seq))
    rows.write_breaker(tx, record.breaker)
    tx.many(
        "INSERT INTO pool_quarantines (node, at) VALUES (?, ?)",
        [(node, rows.iso(at)) for node, at in record.breaker.quarantined.items()],
    )
    rows.lodge(tx, record.wants)
    return len(numbered)


def _number(name: str, index: int) -> int:
    """The order of an imported node: its number where it is named node-N (as the pool names them)."""
    from lazarus.schema.pool import node_number

    number = node_number(name)
    return number if number >= 0 else 1_000_000_000 + index


def read_pool_file(text: str) -> PoolRecord:
    """An old pool file's record (`pool/nodes.json`, before the pool moved into the store)."""
    data = json.loads(text)
    data.pop("generation", None)
    return PoolRecord.model_validate(data)


def import_old_pool(store: Store, home: str | Path) -> int:
    """Bring a home's pool file from before the store (`pool/nodes.json`) into an empty pool, once:
    the file is kept beside as `nodes.json.imported`, and a line says so. Returns the nodes imported."""
    import contextlib
    import logging

    from lazarus.schema.pool import old_pool_file

    path = old_pool_file(Path(home))
    try:
        record = read_pool_file(path.read_text())
    except FileNotFoundError:
        return 0
    with store.write() as tx:
        imported = import_record(tx, record)
    with contextlib.suppress(FileNotFoundError):  # another process of the home moved it first
        path.rename(path.with_name("nodes.json.imported"))
        if imported:
            logging.getLogger(__name__).warning(
                "imported the pool's %d node(s) from %s into the store %s; the file is kept as nodes.json.imported",
                imported,
                path,
                store.url,
            )
        else:
            logging.getLogger(__name__).warning(
                "%s not imported: the store %s has a pool already; the file is kept as nodes.json.imported",
                path,
                store.url,
            )
    return imported
