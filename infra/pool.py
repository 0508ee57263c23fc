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

import json
import threading
import time
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

from lazarus.infra.backend import ClusterError, QuarantineRefused
from lazarus.infra.store import Store, Transaction
from lazarus.schema.pool import TOGETHER_SECONDS, PoolNode, PoolRecord, QuarantineBreaker, SharedFault, SpareWant
from lazarus.schema.records import Assignment, Inventory, NodeRecord

COLUMNS = "name, role, owner, healthy, died_at, since, note, domain"
"""A node's columns, in the order _node reads them."""

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
            return _add(tx, count, note, datetime.now(UTC))

    def provision(self, run_id: str, active: int, spares: int) -> list[str]:
        """Give a new run `active` nodes of its own and leave `spares` free nodes as the pool's hot
        spares: free nodes beyond those spares first, then nodes added (a local node costs nothing
        until it runs). A repeated call finds the nodes the run holds. Returns its active nodes."""
        now = datetime.now(UTC)
        with self.store.write() as tx:
            _pool_row(tx)  # provisions and adds take turns
            mine = [row[0] for row in tx.all(_HELD, (run_id,))]
            if not mine:
                free = _free_count(tx)
                take = max(0, min(active, free - spares))
                mine = [row[0] for row in tx.all(_FREE + " LIMIT ?" + tx.lock, (take,))]
                mine += _add(tx, active - len(mine), "added for a run", now)
                _set(tx, mine, role="active", owner=run_id, since=_iso(now), note=f"{run_id}: launch")
            _add(tx, spares - _free_count(tx), "added as a hot spare", now)
            return mine

    def set_health(self, changes: dict[str, dict]) -> None:
        """Apply field changes (healthy, died_at, note) to named nodes; ClusterError names an unknown one."""
        with self.store.write() as tx:
            nodes = _known(tx, changes)
            changed = [PoolNode.model_validate({**nodes[n].model_dump(), **changes[n]}) for n in sorted(changes)]
            tx.many(
                "UPDATE pool_nodes SET healthy = ?, died_at = ?, note = ? WHERE name = ?",
                [(int(n.healthy), _iso(n.died_at), n.note, n.name) for n in changed],
            )
        self._mark(changed)

    def quarantine(self, run_id: str, names: list[str], reason: str, counted: bool = True) -> None:
        """Hold the nodes out of every run until they are returned (the run that holds them drains them).

        Unless not `counted` (an operator's own drain), the quarantine breaker counts them:
        QuarantineRefused, quarantining nothing, while it is open or when these would take the
        window past its cap (which trips it, for a person to reset)."""
        now = datetime.now(UTC)
        with self.store.write() as tx:
            state = _pool_row(tx) if counted else None
            nodes = _known(tx, dict.fromkeys(names))
            others = [n for n in names if nodes[n].owner not in (None, run_id)]
            if others:
                raise ClusterError(f"{', '.join(others)} belongs to another run ({nodes[others[0]].owner})")
            new = [n for n in names if nodes[n].role != "quarantined"]  # a retried drain counts once
            refusal = _breaker_refusal(tx, state, run_id, new, now) if state is not None and new else None
            if refusal is None:
                if state is not None and new:
                    _count_quarantines(tx, new, now, state)
                _set(tx, names, role="quarantined", owner=run_id, since=_iso(now), note=reason)
        if refusal is not None:  # the breaker's trip is written: raised after the commit
            raise QuarantineRefused(refusal)
        self._mark_out(names)

    def reject_spare(self, name: str, reason: str) -> None:
        """A free node failed a run's health check before the run claimed it: out of the pool, held by
        no run (it was none's loss), until returned. The quarantine breaker counts it, as any: a check
        that fails everywhere must not empty the pool. QuarantineRefused when the breaker refuses."""
        now = datetime.now(UTC)
        with self.store.write() as tx:
            state = _pool_row(tx)
            node = _known(tx, {name: None})[name]
            if node.role != "free":
                raise ClusterError(f"{name} is no longer a free spare ({name} {_held(node)})")
            refusal = _breaker_refusal(tx, state, "(a spare's health check)", [name], now)
            if refusal is None:
                _count_quarantines(tx, [name], now, state)
                _set(tx, [name], role="quarantined", owner=None, since=_iso(now), note=reason)
        if refusal is not None:
            raise QuarantineRefused(refusal)
        self._mark_out([name])

    def set_breaker(self, max_fraction: float | None = None, window_seconds: float | None = None) -> QuarantineBreaker:
        """Change the breaker's cap or window (None: as it is); returns it."""
        with self.store.write() as tx:
            state = _pool_row(tx)
            changes = {"max_fraction": max_fraction, "window_seconds": window_seconds}
            fields = state.breaker.model_dump() | {k: v for k, v in changes.items() if v is not None}
            breaker = QuarantineBreaker.model_validate(fields)
            _write_breaker(tx, breaker)
            return breaker.model_copy(update={"quarantined": _window(tx)})

    def reset_breaker(self) -> QuarantineBreaker:
        """A person closes the breaker: the window starts empty. Returns it."""
        with self.store.write() as tx:
            state = _pool_row(tx)
            breaker = state.breaker.model_copy(update={"tripped_at": None, "tripped_reason": "", "quarantined": {}})
            _write_breaker(tx, breaker)
            tx.run("DELETE FROM pool_quarantines")
            return breaker

    def return_node(self, name: str) -> PoolNode:
        """A repaired node rejoins the pool as a free healthy spare; returns it as recorded."""
        now = datetime.now(UTC)
        with self.store.write() as tx:
            node = _known(tx, {name: None})[name]
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
                (_iso(now), returned.note, name),
            )
        self._mark([returned])
        return returned

    def release(self, run_id: str) -> list[str]:
        """The run ended: its active nodes go back to the pool as free spares (what it quarantined
        stays quarantined) and its want goes; returns the nodes."""
        now = datetime.now(UTC)
        with self.store.write() as tx:
            mine = [row[0] for row in tx.all(_HELD + tx.lock, (run_id,))]
            _set(tx, mine, role="free", owner=None, since=_iso(now), note=f"released by {run_id}")
            tx.run("DELETE FROM pool_wants WHERE run_id = ?", (run_id,))
            return mine

    def want(self, want: SpareWant) -> None:
        """Lodge a run's need of spares, in place of its earlier one."""
        with self.store.write() as tx:
            _lodge(tx, [want])

    def drop_want(self, run_id: str) -> None:
        """The run's recovery is over: its want goes."""
        with self.store.write() as tx:
            tx.run("DELETE FROM pool_wants WHERE run_id = ?", (run_id,))

    def set_domain(self, names: list[str], domain: str | None) -> list[str]:
        """Place the named nodes in fault domain `domain` (None: in none); returns them."""
        with self.store.write() as tx:
            _known(tx, dict.fromkeys(names))
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
            _claim_and_release(tx, run_id, recorded.nodes, releases, f"incarnation {recorded.incarnation}")
            if row is None:
                tx.run(
                    "INSERT INTO run_claims (run_id, incarnation, assignment) VALUES (?, ?, ?)",
                    (run_id, recorded.incarnation, recorded.model_dump_json()),
                )
            return recorded

    def forget_claims(self, run_id: str) -> None:
        """The run's directory is gone for good: its claims' records go too."""
        with self.store.write() as tx:
            tx.run("DELETE FROM run_claims WHERE run_id = ?", (run_id,))

    # --- what one run sees -------------------------------------------------------------------

    def inventory(self, run_id: str, allowance: int | None = None) -> Inventory:
        """The run's view: its active nodes, what it quarantined, and the free nodes as spares: all
        of them, or, given the run's `allowance` (the most nodes it may hold), only healthy ones it
        could take: past the spares the other runs' needs that come first take (counted in the
        store: a burst across a fleet lodges a need per run), and at most `allowance` of them. The other
        runs' needs are then the first few that come before its own and after it."""
        with self.store.read() as tx:
            mine = tx.all(f"SELECT seq, {COLUMNS} FROM pool_nodes WHERE owner = ? ORDER BY seq", (run_id,))
            died = [datetime.fromisoformat(row[5]) for row in mine if not row[4] and row[5]]
            shared = _shared_fault(tx, run_id, max(died)) if died else None
            if allowance is None:
                free = tx.all(f"SELECT seq, {COLUMNS} FROM pool_nodes WHERE role = 'free' ORDER BY seq")
                wants = sorted((w for w in _wants(tx) if w.run_id != run_id), key=SpareWant.sort_key)
                counts = {}
            else:
                wants, counts = _needs_around(tx, run_id)
                free = tx.all(
                    f"SELECT seq, {COLUMNS} FROM pool_nodes WHERE role = 'free' AND healthy = 1 "
                    "ORDER BY seq LIMIT ? OFFSET ?",
                    (allowance, counts["spares_before"]),
                )
        views = []
        for row in sorted([*free, *mine]):
            node = _node(row[1:])
            role, note = (
                ("spare", node.note or "hot spare of the pool") if node.role == "free" else (node.role, node.note)
            )
            views.append(NodeRecord(name=node.name, role=role, healthy=node.healthy, died_at=node.died_at, note=note))
        return Inventory(nodes=views, wants=wants, shared=shared, **counts)

    def unhealthy(self, names: Sequence[str] | None = None) -> dict[str, datetime | None]:
        """The pool's dead nodes (of `names`, where given: a look asks of its run's nodes alone, however
        many of a fleet's died) and when each died."""
        with self.store.read() as tx:
            if names is None:
                rows = tx.all("SELECT name, died_at FROM pool_nodes WHERE healthy = 0")
            elif not (wanted := sorted(set(names))):
                return {}
            else:
                rows = tx.all(
                    f"SELECT name, died_at FROM pool_nodes WHERE name IN {_in(wanted)} AND healthy = 0", wanted
                )
        return {name: _time(died) for name, died in rows}

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
            row = tx.one(f"SELECT {COLUMNS} FROM pool_nodes WHERE name = ?", (name,))
        return None if row is None else _node(row)

    def nodes(self, names: Iterable[str]) -> dict[str, PoolNode]:
        """The named nodes as recorded (a name the pool lacks is left out)."""
        wanted = sorted(set(names))
        if not wanted:
            return {}
        with self.store.read() as tx:
            rows = tx.all(f"SELECT {COLUMNS} FROM pool_nodes WHERE name IN {_in(wanted)}", wanted)
        return {row[0]: _node(row) for row in rows}

    def held(self, run_id: str) -> list[str]:
        """The run's active nodes, in the order they were added."""
        with self.store.read() as tx:
            return [row[0] for row in tx.all(_HELD, (run_id,))]

    def free_spares(self) -> list[str]:
        """The healthy free nodes, in the order they were added."""
        with self.store.read() as tx:
            return [row[0] for row in tx.all(_FREE)]

    def read(self) -> PoolRecord:
        """The whole pool: every node, want and the breaker (for listings and checks; a run's stages
        ask for what they need instead)."""
        with self.store.read() as tx:
            nodes = [_node(row) for row in tx.all(f"SELECT {COLUMNS} FROM pool_nodes ORDER BY seq")]
            wants = sorted(_wants(tx), key=SpareWant.sort_key)
            breaker = _pool_row(tx, lock=False).breaker.model_copy(update={"quarantined": _window(tx)})
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


# --- SQL and rows -----------------------------------------------------------------------------

_HELD = "SELECT name FROM pool_nodes WHERE owner = ? AND role = 'active' ORDER BY seq"
_FREE = "SELECT name FROM pool_nodes WHERE role = 'free' AND healthy = 1 ORDER BY seq"


class _PoolRow:
    """The pool's own row: its size and the breaker (without its window)."""

    def __init__(self, nodes: int, breaker: QuarantineBreaker):
        self.nodes, self.breaker = nodes, breaker


def _pool_row(tx: Transaction, lock: bool = True) -> _PoolRow:
    nodes, breaker = tx.one("SELECT nodes, breaker FROM pool_state WHERE id = 1" + (tx.lock if lock else "")) or (
        0,
        "{}",
    )
    return _PoolRow(nodes, QuarantineBreaker.model_validate_json(breaker))


def _write_breaker(tx: Transaction, breaker: QuarantineBreaker) -> None:
    tx.run("UPDATE pool_state SET breaker = ? WHERE id = 1", (breaker.model_dump_json(exclude={"quarantined"}),))


def _window(tx: Transaction) -> dict[str, datetime]:
    rows = tx.all("SELECT node, at FROM pool_quarantines ORDER BY at, node")
    return {node: datetime.fromisoformat(at) for node, at in rows}


def _iso(moment: datetime | None) -> str | None:
    """A time as the store keeps it: ISO-8601 in UTC, always to the microsecond, so that comparing the
    texts (SQL's <, >=) compares the times."""
    return None if moment is None else moment.astimezone(UTC).isoformat(timespec="microseconds")


def _time(text: str | None) -> datetime | None:
    return None if text is None else datetime.fromisoformat(text)


def _node(row: Sequence) -> PoolNode:
    name, role, owner, healthy, died_at, since, note, domain = row
    return PoolNode.model_construct(
        name=name,
        role=role,
        owner=owner,
        healthy=bool(healthy),
        died_at=_time(died_at),
        since=_time(since),
        note=note,
        domain=domain,
    )


def _wants(tx: Transaction) -> list[SpareWant]:
    return [SpareWant.model_validate_json(row[0]) for row in tx.all("SELECT want FROM pool_wants")]


def _lodge(tx: Transaction, wants: Iterable[SpareWant]) -> None:
    """Lodge each want in place of its run's earlier one."""
    tx.many(
        "INSERT INTO pool_wants (run_id, want, needed, placed, priority, lost_ranks, fault_at) "
        "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (run_id) DO UPDATE SET want = excluded.want, "
        "needed = excluded.needed, placed = excluded.placed, priority = excluded.priority, "
        "lost_ranks = excluded.lost_ranks, fault_at = excluded.fault_at",
        [
            (w.run_id, w.model_dump_json(), w.needed, int(w.placed), w.priority, w.lost_ranks, _iso(w.fault_at))
            for w in wants
        ],
    )


WANTS_SHOWN = 8
"""Of the other runs' needs, how many before the run's own and how many after it its view lists: those a
decision's reason names (the rest are counted, not listed)."""

# The needs that come before a run's own (SpareWant.sort_key): higher priority, then more ranks lost,
# then the earlier fault, then the run id.
_BEFORE = (
    "(priority > ? OR (priority = ? AND (lost_ranks > ? OR (lost_ranks = ? AND "
    "(fault_at < ? OR (fault_at = ? AND run_id < ?))))))"
)
_ORDER = "ORDER BY priority DESC, lost_ranks DESC, fault_at, run_id"


def _needs_around(tx: Transaction, run_id: str) -> tuple[list[SpareWant], dict[str, int]]:
    """The other runs' needs a run's view lists (the first few before its own need, then after it), and
    what the rest add up to: the spares the needs before its own take, and every recovery's."""
    row = tx.one("SELECT priority, lost_ranks, fault_at FROM pool_wants WHERE run_id = ?", (run_id,))
    everyone = tx.one("SELECT coalesce(sum(needed), 0) FROM pool_wants WHERE placed = 0 AND run_id <> ?", (run_id,))
    by_recoveries = int(everyone[0]) if everyone else 0
    listed = f"SELECT want FROM pool_wants WHERE run_id <> ? AND {{}} {_ORDER} LIMIT {WANTS_SHOWN}"
    if row is None:  # no need of its own lodged (a regrow, a swap): every recovery comes first
        ahead = tx.all(listed.format("1 = 1"), (run_id,))
        behind, first = [], by_recoveries
    else:
        priority, lost, fault_at = row
        key = (priority, priority, lost, lost, fault_at, fault_at, run_id)
        ahead = tx.all(listed.format(_BEFORE), (run_id, *key))
        behind = tx.all(listed.format(f"placed = 0 AND NOT {_BEFORE}"), (run_id, *key))
        before = tx.one(
            f"SELECT coalesce(sum(needed), 0) FROM pool_wants WHERE placed = 0 AND run_id <> ? AND {_BEFORE}",
            (run_id, *key),
        )
        first = int(before[0]) if before else 0
    wants = [SpareWant.model_validate_json(text) for (text,) in [*ahead, *behind]]
    return wants, {"needed_first": first, "needed_by_recoveries": by_recoveries, "spares_before": first}


def _in(names: Sequence[str]) -> str:
    return f"({', '.join('?' * len(names))})"


def _known(tx: Transaction, names: dict) -> dict[str, PoolNode]:
    """The named nodes, locked for this transaction, in name order; ClusterError names unknown ones."""
    wanted = sorted(names)
    if not wanted:
        return {}
    rows = tx.all(f"SELECT {COLUMNS} FROM pool_nodes WHERE name IN {_in(wanted)} ORDER BY name{tx.lock}", wanted)
    nodes = {row[0]: _node(row) for row in rows}
    unknown = [n for n in wanted if n not in nodes]
    if unknown:
        count = _pool_row(tx, lock=False).nodes
        first = [row[0] for row in tx.all("SELECT name FROM pool_nodes ORDER BY seq LIMIT 8")]
        listed = _listed(first, total=count)
        raise ClusterError(f"the pool has no node {', '.join(unknown)}; nodes: {listed}")
    return nodes


def _set(tx: Transaction, names: Sequence[str], **fields) -> None:
    if not names:
        return
    assignments = ", ".join(f"{column} = ?" for column in fields)
    tx.run(f"UPDATE pool_nodes SET {assignments} WHERE name IN {_in(names)}", [*fields.values(), *names])


def _free_count(tx: Transaction) -> int:
    return tx.one("SELECT count(*) FROM pool_nodes WHERE role = 'free' AND healthy = 1")[0]  # type: ignore[index]


def _add(tx: Transaction, count: int, note: str, now: datetime) -> list[str]:
    if count <= 0:
        return []
    row = tx.one("SELECT next_seq FROM pool_state WHERE id = 1" + tx.lock)
    first = row[0] if row else 0
    names = [f"node-{first + i}" for i in range(count)]
    tx.many(
        "INSERT INTO pool_nodes (name, seq, role, owner, healthy, died_at, since, note, domain) "
        "VALUES (?, ?, 'free', NULL, 1, NULL, ?, ?, NULL)",
        [(name, first + i, _iso(now), note) for i, name in enumerate(names)],
    )
    tx.run("UPDATE pool_state SET nodes = nodes + ?, next_seq = next_seq + ? WHERE id = 1", (count, count))
    return names


def _claim_and_release(tx: Transaction, run_id: str, nodes: list[str], releases: Sequence[str], why: str) -> None:
    """Make `nodes` the run's active nodes and free `releases` it held (but not `nodes`); ClusterError,
    changing nothing, when one of `nodes` is neither free and healthy nor already the run's."""
    known = _known(tx, dict.fromkeys([*nodes, *releases]))
    taken = [n for n in nodes if not _claimable(known[n], run_id)]
    if taken:
        free = [row[0] for row in tx.all(_FREE + " LIMIT 9")]
        held = "; ".join(f"{n} {_held(known[n])}" for n in taken)
        raise ClusterError(f"node {', '.join(taken)} is no longer a free spare ({held}; free: {_listed(free)})")
    now = _iso(datetime.now(UTC))
    claimed = [name for name in nodes if known[name].owner != run_id or known[name].role != "active"]
    _set(tx, claimed, role="active", owner=run_id, since=now, note=f"{run_id}: {why}")
    row = tx.one("SELECT want FROM pool_wants WHERE run_id = ?" + tx.lock, (run_id,))
    if row is not None and not (want := SpareWant.model_validate_json(row[0])).placed:
        placed = want.model_copy(update={"placed": True, "got": len(claimed)})
        tx.run(
            "UPDATE pool_wants SET want = ?, placed = 1 WHERE run_id = ?",
            (placed.model_dump_json(), run_id),
        )
    leftover = [n for n in releases if n not in nodes and known[n].owner == run_id and known[n].role == "active"]
    _set(tx, leftover, role="free", owner=None, since=now, note=f"released by {run_id} at {why}")


def _breaker_refusal(tx: Transaction, state: _PoolRow, run_id: str, new: list[str], now: datetime) -> str | None:
    """Why the breaker refuses to quarantine `new` for `run_id` (tripping it when they would take the
    window past its cap); None when it lets them through."""
    breaker, pool_nodes = state.breaker, state.nodes
    reset = "a person resets it with `lazarus pool breaker --reset`"
    if breaker.tripped_at is None:
        held, cap = _in_window(tx, breaker, now), breaker.cap(pool_nodes)
        if held + len(new) <= cap:
            return None
        why = (
            f"{held + len(new)} nodes quarantined within {breaker.window_seconds:g} s would pass its cap of {cap} "
            f"({breaker.max_fraction:.0%} of the pool's {pool_nodes}); run {run_id} asked for {_listed(new)}"
        )
        breaker = breaker.model_copy(update={"tripped_at": now, "tripped_reason": why})
        _write_breaker(tx, breaker)
    return (
        f"the pool's quarantine breaker is open ({breaker.tripped_reason}): nothing more is quarantined until {reset}"
    )


def _in_window(tx: Transaction, breaker: QuarantineBreaker, now: datetime) -> int:
    """How many nodes the breaker's window holds at `now`: quarantined by faults within it, and still out
    (counted in the store: in a rack's burst the window holds hundreds)."""
    since = _iso(now - timedelta(seconds=breaker.window_seconds))
    row = tx.one(
        "SELECT count(*) FROM pool_quarantines q JOIN pool_nodes n ON n.name = q.node "
        "WHERE q.at >= ? AND n.role = 'quarantined'",
        (since,),
    )
    return row[0] if row else 0


def _count_quarantines(tx: Transaction, nodes: list[str], now: datetime, state: _PoolRow) -> None:
    """Count `nodes` in the breaker's window, and drop what left it (by time; a node returned since is
    not counted, whatever its row says)."""
    tx.run("DELETE FROM pool_quarantines WHERE at < ?", (_iso(now - timedelta(seconds=state.breaker.window_seconds)),))
    tx.many(
        "INSERT INTO pool_quarantines (node, at) VALUES (?, ?) ON CONFLICT (node) DO UPDATE SET at = excluded.at",
        [(node, _iso(now)) for node in nodes],
    )


def _shared_fault(tx: Transaction, run_id: str, latest: datetime) -> SharedFault | None:
    """The nodes of the pool that died within TOGETHER_SECONDS of the run's latest dead node (`latest`),
    when they are more than the run's own; None otherwise. Reads only the dead nodes of that span, and
    only what the report needs of each (a burst's span holds hundreds)."""
    span = timedelta(seconds=TOGETHER_SECONDS)
    rows = tx.all(
        "SELECT name, owner, role, domain FROM pool_nodes WHERE healthy = 0 AND died_at >= ? AND died_at <= ? "
        "ORDER BY seq",
        (_iso(latest - span), _iso(latest + span)),
    )
    others = [row for row in rows if row[1] != run_id]
    if not others:
        return None
    my_domains = {domain for _, owner, _, domain in rows if owner == run_id and domain}
    return SharedFault(
        nodes=[name for name, *_ in rows],
        domains=sorted({domain for *_, domain in rows if domain}),
        runs=sorted({owner for _, owner, _, _ in others if owner}),
        undrained=sorted(
            {owner for _, owner, role, domain in others if owner and role == "active" and domain in my_domains}
        ),
    )


def _listed(names: list[str], shown: int = 8, total: int | None = None) -> str:
    """Names for a message: the first few and how many more (a pool may have thousands free)."""
    total = len(names) if total is None else total
    more = f" and {total - shown} more" if total > shown else ""
    return (", ".join(names[:shown]) + more) or "none"


def _claimable(node: PoolNode, run_id: str) -> bool:
    return (node.role == "free" and node.healthy) or (node.role == "active" and node.owner == run_id)


def _held(node: PoolNode) -> str:
    if node.role == "free":
        return "is dead"
    if node.role == "active":
        return f"is active in run {node.owner}"
    return f"is quarantined by {node.owner}" if node.owner else f"is quarantined ({node.note})"


def import_record(tx: Transaction, record: PoolRecord) -> int:
    """Write an old pool file's record (schema/pool.py PoolRecord) into an empty pool; returns the
    nodes imported (0, writing nothing, where the pool has nodes already)."""
    if tx.one("SELECT count(*) FROM pool_nodes")[0]:  # type: ignore[index]
        return 0
    numbered = [(n, _number(n.name, i)) for i, n in enumerate(record.nodes)]
    tx.many(
        f"INSERT INTO pool_nodes (seq, {COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        [
            (seq, n.name, n.role, n.owner, int(n.healthy), _iso(n.died_at), _iso(n.since), n.note, n.domain)
            for n, seq in numbered
        ],
    )
    next_seq = max((seq for _, seq in numbered), default=-1) + 1
    tx.run("UPDATE pool_state SET nodes = ?, next_seq = ? WHERE id = 1", (len(numbered), next_seq))
    _write_breaker(tx, record.breaker)
    tx.many(
        "INSERT INTO pool_quarantines (node, at) VALUES (?, ?)",
        [(node, _iso(at)) for node, at in record.breaker.quarantined.items()],
    )
    _lodge(tx, record.wants)
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
