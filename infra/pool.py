"""The node pool every run of a fleet takes its nodes from (the local, simulated and Slurm backends),
a row per node in the store (infra/store: SQLite on one machine, PostgreSQL across machines).

Every change is one transaction that reads and writes only the rows it concerns, so its cost does not
grow with the pool: a claim locks the nodes it takes (two runs can never both take one spare) and
writes the incarnation's assignment with them, so a claim retried after a crash finds what it took.
Changes to the pool as a whole (adding nodes, the quarantine breaker's count) lock the pool's own
row first, then nodes. The breaker and the fault domains live in the store too (schema/pool.py).

Where the pool has a folder of markers (`unusable`), a node that dies or is quarantined gets one
before anyone ends its processes, and loses it when it is returned: the local backend's standbys
read them (trainer/agent/standby) rather than the database.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path

from lazarus.infra import pool_rows as rows
from lazarus.infra.backend import ClusterError, QuarantineRefused
from lazarus.infra.store import Store
from lazarus.schema.pool import PoolNode, PoolRecord, QuarantineBreaker, SpareWant
from lazarus.schema.records import Assignment, Inventory, NodeRecord

DEAD_NODES_SECONDS = 0.05
"""How old a thread's read of the dead nodes may be where the store cannot tell that it changed
(PostgreSQL): what it adds to the detection of a dead node at most (seconds)."""
DEAD_NODES_KEPT = 10_000
"""Answers of dead_among a thread keeps (one per run it looks at), before it starts again."""


class NodePool:
    """The nodes of a fleet: who holds which, and which are free hot spares."""

    def __init__(self, store: Store, unusable: Path | None = None):
        self.store = store
        self.unusable = unusable  # markers of nodes a standby must not start ranks on (None: none kept)
        self._dead = threading.local()  # each thread's last read of the dead nodes (dead_among)

    # --- changes, each one transaction -------------------------------------------------------

    def add(self, count: int, note: str = "added") -> list[str]:
        """Add `count` free healthy nodes; returns their names."""
        with self.store.write() as tx:
            return rows.add_nodes(tx, count, note, datetime.now(UTC))

    def provision(self, run_id: str, active: int, spares: int) -> list[str]:
        """Give a new run `active` nodes of its own and leave `spares` free nodes as the pool's hot
        spares: free nodes beyond those spares first, then nodes added (a local node costs nothing
        until it runs). A repeated call finds the nodes the run holds. Returns its active nodes."""
        now = datetime.now(UTC)
        with self.store.write() as tx:
            rows.pool_row(tx)  # provisions and adds take turns
            mine = [row[0] for row in tx.all(rows.HELD, (run_id,))]
            if not mine:
                free = rows.free_count(tx)
                take = max(0, min(active, free - spares))
                mine = [row[0] for row in tx.all(rows.FREE + " LIMIT ?" + tx.lock, (take,))]
                mine += rows.add_nodes(tx, active - len(mine), "added for a run", now)
                rows.set_fields(tx, mine, role="active", owner=run_id, since=rows.iso(now), note=f"{run_id}: launch")
            rows.add_nodes(tx, spares - rows.free_count(tx), "added as a hot spare", now)
            return mine

    def set_health(self, changes: dict[str, dict]) -> None:
        """Apply field changes (healthy, died_at, note) to named nodes; ClusterError names an unknown one."""
        with self.store.write() as tx:
            nodes = rows.known_nodes(tx, changes)
            changed = [PoolNode.model_validate({**nodes[n].model_dump(), **changes[n]}) for n in sorted(changes)]
            tx.many(
                "UPDATE pool_nodes SET healthy = ?, died_at = ?, note = ? WHERE name = ?",
                [(int(n.healthy), rows.iso(n.died_at), n.note, n.name) for n in changed],
            )
        self._mark(changed)

    def quarantine(self, run_id: str, names: list[str], reason: str, counted: bool = True) -> None:
        """Hold the nodes out of every run until they are returned (the run that holds them drains them).

        Unless not `counted` (an operator's own drain), the quarantine breaker counts them:
        QuarantineRefused, quarantining nothing, while it is open or when these would take the
        window past its cap (which trips it, for a person to reset)."""
        now = datetime.now(UTC)
        with self.store.write() as tx:
            state = rows.pool_row(tx) if counted else None
            nodes = rows.known_nodes(tx, dict.fromkeys(names))
            others = [n for n in names if nodes[n].owner not in (None, run_id)]
            if others:
                raise ClusterError(f"{', '.join(others)} belongs to another run ({nodes[others[0]].owner})")
            new = [n for n in names if nodes[n].role != "quarantined"]  # a retried drain counts once
            refusal = rows.breaker_refusal(tx, state, run_id, new, now) if state is not None and new else None
            if refusal is None:
                if state is not None and new:
                    rows.count_quarantines(tx, new, now, state)
                rows.set_fields(tx, names, role="quarantined", owner=run_id, since=rows.iso(now), note=reason)
        if refusal is not None:  # the breaker's trip is written: raised after the commit
            raise QuarantineRefused(refusal)
        self._mark_out(names)

    def reject_spare(self, name: str, reason: str) -> None:
        """A free node failed a run's health check before the run claimed it: out of the pool, held by
        no run (it was none's loss), until returned. The quarantine breaker counts it, as any: a check
        that fails everywhere must not empty the pool. QuarantineRefused when the breaker refuses."""
        now = datetime.now(UTC)
        with self.store.write() as tx:
            state = rows.pool_row(tx)
            node = rows.known_nodes(tx, {name: None})[name]
            if node.role != "free":
                raise ClusterError(f"{name} is no longer a free spare ({name} {rows.holding(node)})")
            refusal = rows.breaker_refusal(tx, state, "(a spare's health check)", [name], now)
            if refusal is None:
                rows.count_quarantines(tx, [name], now, state)
                rows.set_fields(tx, [name], role="quarantined", owner=None, since=rows.iso(now), note=reason)
        if refusal is not None:
            raise QuarantineRefused(refusal)
        self._mark_out([name])

    def set_breaker(self, max_fraction: float | None = None, window_seconds: float | None = None) -> QuarantineBreaker:
        """Change the breaker's cap or window (None: as it is); returns it."""
        with self.store.write() as tx:
            state = rows.pool_row(tx)
            changes = {"max_fraction": max_fraction, "window_seconds": window_seconds}
            fields = state.breaker.model_dump() | {k: v for k, v in changes.items() if v is not None}
            breaker = QuarantineBreaker.model_validate(fields)
            rows.write_breaker(tx, breaker)
            return breaker.model_copy(update={"quarantined": rows.breaker_window(tx)})

    def reset_breaker(self) -> QuarantineBreaker:
        """A person closes the breaker: the window starts empty. Returns it."""
        with self.store.write() as tx:
            state = rows.pool_row(tx)
            breaker = state.breaker.model_copy(update={"tripped_at": None, "tripped_reason": "", "quarantined": {}})
            rows.write_breaker(tx, breaker)
            tx.run("DELETE FROM pool_quarantines")
            return breaker

    def return_node(self, name: str) -> PoolNode:
        """A repaired node rejoins the pool as a free healthy spare; returns it as recorded."""
        now = datetime.now(UTC)
        with self.store.write() as tx:
            node = rows.known_nodes(tx, {name: None})[name]
            if node.role == "active":
                raise ClusterError(f"{name} is active in run {node.owner}; only a quarantined or dead node is returned")
            returned = node.model_copy(
                update={
                    "role": "free",
                    "owner": None,
                    "healthy": True,
                    "died_at": None,
                    "since": now,
                    "note": "returned",
                }
            )
            tx.run(
                "UPDATE pool_nodes SET role = 'free', owner = NULL, healthy = 1, died_at = NULL, since = ?, note = ? "
                "WHERE name = ?",
                (rows.iso(now), returned.note, name),
            )
        self._mark([returned])
        return returned

    def release(self, run_id: str) -> list[str]:
        """The run ended: its active nodes go back to the pool as free spares (what it quarantined
        stays quarantined) and its want goes; returns the nodes."""
        now = datetime.now(UTC)
        with self.store.write() as tx:
            mine = [row[0] for row in tx.all(rows.HELD + tx.lock, (run_id,))]
            rows.set_fields(tx, mine, role="free", owner=None, since=rows.iso(now), note=f"released by {run_id}")
            tx.run("DELETE FROM pool_wants WHERE run_id = ?", (run_id,))
            return mine

    def want(self, want: SpareWant) -> None:
        """Lodge a run's need of spares, in place of its earlier one."""
        with self.store.write() as tx:
            rows.lodge(tx, [want])

    def drop_want(self, run_id: str) -> None:
        """The run's recovery is over: its want goes."""
        with self.store.write() as tx:
            tx.run("DELETE FROM pool_wants WHERE run_id = ?", (run_id,))

    def set_domain(self, names: list[str], domain: str | None) -> list[str]:
        """Place the named nodes in fault domain `domain` (None: in none); returns them."""
        with self.store.write() as tx:
            rows.known_nodes(tx, dict.fromkeys(names))
            tx.many("UPDATE pool_nodes SET domain = ? WHERE name = ?", [(domain, name) for name in names])
            return names

    def claim(self, run_id: str, assignment: Assignment, releases: Sequence[str] = ()) -> Assignment:
        """Make the assignment's nodes the run's active nodes and free those of `releases` it held
        (but not the assignment's), recording the assignment with the claim: exactly once. The
        incarnation's assignment claimed before (an earlier attempt) is returned, its claim
        completed. ClusterError, changing nothing, when one of the nodes is neither free and
        healthy nor already the run's (a retry of a claim that succeeded succeeds)."""
        with self.store.write() as tx:
            row = tx.one(
                "SELECT assignment FROM run_claims WHERE run_id = ? AND incarnation = ?",
                (run_id, assignment.incarnation),
            )
            recorded = Assignment.model_validate_json(row[0]) if row else assignment
            rows.claim_and_release(tx, run_id, recorded.nodes, releases, f"incarnation {recorded.incarnation}")
            if row is None:
                tx.run(
                    "INSERT INTO run_claims (run_id, incarnation, assignment) VALUES (?, ?, ?)",
                    (run_id, recorded.incarnation, recorded.model_dump_json()),
                )
            return recorded

    def claimed(self, run_id: str, incarnation: int) -> Assignment | None:
        """The assignment recorded with the run's claim for the incarnation; None when none was made."""
        with self.store.read() as tx:
            row = tx.one(
                "SELECT assignment FROM run_claims WHERE run_id = ? AND incarnation = ?", (run_id, incarnation)
            )
        return None if row is None else Assignment.model_validate_json(row[0])

    # --- what one run sees -------------------------------------------------------------------

    def inventory(self, run_id: str, allowance: int | None = None) -> Inventory:
        """The run's view: its active nodes, what it quarantined, and the free nodes as spares: all
        of them, or, given the run's `allowance` (the most nodes it may hold), only healthy ones it
        could take: past the spares the other runs' needs that come first take (counted in the
        store: a burst across a fleet lodges a need per run), and at most `allowance` of them. The other
        runs' needs are then the first few that come before its own and after it."""
        with self.store.read() as tx:
            mine = tx.all(f"SELECT seq, {rows.COLUMNS} FROM pool_nodes WHERE owner = ? ORDER BY seq", (run_id,))
            died = [datetime.fromisoformat(row[5]) for row in mine if not row[4] and row[5]]
            shared = rows.shared_fault(tx, run_id, max(died)) if died else None
            if allowance is None:
                free = tx.all(f"SELECT seq, {rows.COLUMNS} FROM pool_nodes WHERE role = 'free' ORDER BY seq")
                wants = sorted((w for w in rows.all_wants(tx) if w.run_id != run_id), key=SpareWant.sort_key)
                counts = {}
            else:
                wants, counts = rows.needs_around(tx, run_id)
                free = tx.all(
                    f"SELECT seq, {rows.COLUMNS} FROM pool_nodes WHERE role = 'free' AND healthy = 1 "
                    "ORDER BY seq LIMIT ? OFFSET ?",
                    (allowance, counts["spares_before"]),
                )
        views = []
        for row in sorted([*free, *mine]):
            node = rows.node_of(row[1:])
            role, note = (
                ("spare", node.note or "hot spare of the pool") if node.role == "free" else (node.role, node.note)
            )
            views.append(NodeRecord(name=node.name, role=role, healthy=node.healthy, died_at=node.died_at, note=note))
        return Inventory.model_validate({"nodes": views, "wants": wants, "shared": shared, **counts})

    def unhealthy(self, names: Sequence[str] | None = None) -> dict[str, datetime | None]:
        """The pool's dead nodes (of `names`, where given: a look asks of its run's nodes alone, however
        many of a fleet's died) and when each died."""
        with self.store.read() as tx:
            if names is None:
                dead = tx.all("SELECT name, died_at FROM pool_nodes WHERE healthy = 0")
            elif not (wanted := sorted(set(names))):
                return {}
            else:
                dead = tx.all(
                    f"SELECT name, died_at FROM pool_nodes WHERE name IN {rows.in_list(wanted)} AND healthy = 0", wanted
                )
        return {name: rows.time_of(died) for name, died in dead}

    def died_since(self, since: datetime) -> dict[str, datetime]:
        """The nodes the pool holds dead that died at or after `since`, and when (the dead nodes'
        index: a burst's newest deaths, however many died before)."""
        with self.store.read() as tx:
            dead = tx.all("SELECT name, died_at FROM pool_nodes WHERE healthy = 0 AND died_at >= ?", (rows.iso(since),))
        return {name: died for name, at in dead if (died := rows.time_of(at)) is not None}

    def dead_among(self, names: Sequence[str]) -> dict[str, datetime | None]:
        """Of `names`, the nodes the pool holds dead and when each died: what every look of every run
        asks. Where the store tells that nothing changed since this thread last asked of these names
        (SQLite, in microseconds), the answer is the one it had; where it cannot tell (PostgreSQL),
        one read of every dead node serves every look for DEAD_NODES_SECONDS. A fleet's looks then
        cost no query each."""
        version, local = self.store.version(), self._dead
        if version is None:
            now, read = time.monotonic(), getattr(local, "every", None)
            if read is None or now - read[0] > DEAD_NODES_SECONDS:
                local.every = read = (now, self.unhealthy())
            return {name: read[1][name] for name in names if name in read[1]}
        asked = getattr(local, "asked", None)
        if asked is None:
            local.asked = asked = {}
        key = tuple(names)
        known = asked.get(key)
        if known is None or known[0] != version:
            if len(asked) > DEAD_NODES_KEPT:
                asked.clear()
            asked[key] = known = (version, self.unhealthy(names))
        return known[1]

    def node(self, name: str) -> PoolNode | None:
        """One node as recorded; None when the pool has no such node."""
        with self.store.read() as tx:
            row = tx.one(f"SELECT {rows.COLUMNS} FROM pool_nodes WHERE name = ?", (name,))
        return None if row is None else rows.node_of(row)

    def nodes(self, names: Iterable[str]) -> dict[str, PoolNode]:
        """The named nodes as recorded (a name the pool lacks is left out)."""
        wanted = sorted(set(names))
        if not wanted:
            return {}
        with self.store.read() as tx:
            found = tx.all(f"SELECT {rows.COLUMNS} FROM pool_nodes WHERE name IN {rows.in_list(wanted)}", wanted)
        return {row[0]: rows.node_of(row) for row in found}

    def held(self, run_id: str) -> list[str]:
        """The run's active nodes, in the order they were added."""
        with self.store.read() as tx:
            return [row[0] for row in tx.all(rows.HELD, (run_id,))]

    def free_spares(self) -> list[str]:
        """The healthy free nodes, in the order they were added."""
        with self.store.read() as tx:
            return [row[0] for row in tx.all(rows.FREE)]

    def read(self) -> PoolRecord:
        """The whole pool: every node, want and the breaker (for listings and checks; a run's stages
        ask for what they need instead)."""
        with self.store.read() as tx:
            nodes = [rows.node_of(row) for row in tx.all(f"SELECT {rows.COLUMNS} FROM pool_nodes ORDER BY seq")]
            wants = sorted(rows.all_wants(tx), key=SpareWant.sort_key)
            breaker = rows.pool_row(tx, lock=False).breaker.model_copy(update={"quarantined": rows.breaker_window(tx)})
        return PoolRecord(nodes=nodes, wants=wants, breaker=breaker)

    # --- the standbys' markers -------------------------------------------------------------

    def _mark(self, nodes: Iterable[PoolNode]) -> None:
        """Give each node that may not run ranks (dead, quarantined) its marker; take it from the others."""
        for node in nodes:
            if not node.healthy or node.role == "quarantined":
                self._mark_out([node.name])
            elif self.unusable is not None:
                (self.unusable / node.name).unlink(missing_ok=True)

    def _mark_out(self, names: Iterable[str]) -> None:
        if self.unusable is None:
            return
        self.unusable.mkdir(parents=True, exist_ok=True)
        for name in names:
            (self.unusable / name).touch()


def open_pool(store: Store, home: str | Path) -> NodePool:
    """The pool of a store, with the markers of a home's standbys (`<home>/pool/unusable`)."""
    return NodePool(store, Path(home) / "pool" / "unusable")
