"""The SQL of the pool's transactions (infra/pool.py): a node's row and its times, the nodes a change
locks and sets, nodes added, a claim, the runs' needs around a run's own, the quarantine breaker's
window, the nodes that died within a fault's second. Each works inside its caller's transaction and
touches only the rows it concerns; none commits."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta

from lazarus.infra.backend import ClusterError
from lazarus.infra.store import Transaction
from lazarus.schema.pool import TOGETHER_SECONDS, PoolNode, QuarantineBreaker, SharedFault, SpareWant

COLUMNS = "name, role, owner, healthy, died_at, since, note, domain"
"""A node's columns, in the order node_of reads them."""

HELD = "SELECT name FROM pool_nodes WHERE owner = ? AND role = 'active' ORDER BY seq"
FREE = "SELECT name FROM pool_nodes WHERE role = 'free' AND healthy = 1 ORDER BY seq"


class PoolRow:
    """The pool's own row: its size and the breaker (without its window)."""

    def __init__(self, nodes: int, breaker: QuarantineBreaker):
        self.nodes, self.breaker = nodes, breaker


def pool_row(tx: Transaction, lock: bool = True) -> PoolRow:
    nodes, breaker = tx.one("SELECT nodes, breaker FROM pool_state WHERE id = 1" + (tx.lock if lock else "")) or (
        0,
        "{}",
    )
    return PoolRow(nodes, QuarantineBreaker.model_validate_json(breaker))


def write_breaker(tx: Transaction, breaker: QuarantineBreaker) -> None:
    tx.run("UPDATE pool_state SET breaker = ? WHERE id = 1", (breaker.model_dump_json(exclude={"quarantined"}),))


def breaker_window(tx: Transaction) -> dict[str, datetime]:
    rows = tx.all("SELECT node, at FROM pool_quarantines ORDER BY at, node")
    return {node: datetime.fromisoformat(at) for node, at in rows}


def iso(moment: datetime | None) -> str | None:
    """A time as the store keeps it: ISO-8601 in UTC, always to the microsecond, so that comparing the
    texts (SQL's <, >=) compares the times."""
    return None if moment is None else moment.astimezone(UTC).isoformat(timespec="microseconds")


def time_of(text: str | None) -> datetime | None:
    return None if text is None else datetime.fromisoformat(text)


def node_of(row: Sequence) -> PoolNode:
    name, role, owner, healthy, died_at, since, note, domain = row
    return PoolNode.model_construct(
        name=name,
        role=role,
        owner=owner,
        healthy=bool(healthy),
        died_at=time_of(died_at),
        since=time_of(since),
        note=note,
        domain=domain,
    )


def all_wants(tx: Transaction) -> list[SpareWant]:
    return [SpareWant.model_validate_json(row[0]) for row in tx.all("SELECT want FROM pool_wants")]


def lodge(tx: Transaction, wants: Iterable[SpareWant]) -> None:
    """Lodge each want in place of its run's earlier one, unless that one is the same fault's and
    placed: the stages ran again after their claim (a workflow task timed out in them), and their
    need, lodged again unplaced, would make every run behind it count a spare it already holds."""
    tx.many(
        "INSERT INTO pool_wants (run_id, want, needed, placed, priority, lost_ranks, fault_at) "
        "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (run_id) DO UPDATE SET want = excluded.want, "
        "needed = excluded.needed, placed = excluded.placed, priority = excluded.priority, "
        "lost_ranks = excluded.lost_ranks, fault_at = excluded.fault_at "
        "WHERE pool_wants.placed = 0 OR pool_wants.fault_at <> excluded.fault_at",
        [
            (w.run_id, w.model_dump_json(), w.needed, int(w.placed), w.priority, w.lost_ranks, iso(w.fault_at))
            for w in wants
        ],
    )


WANTS_SHOWN = 8
"""Of the other runs' needs, how many before the run's own and how many after it its view lists: those a
decision's reason names (the rest are counted, not listed)."""

# The needs that come before a run's own (SpareWant.sort_key): higher priority, then more ranks lost,
# then the earlier fault, then the run id.
BEFORE = (
    "(priority > ? OR (priority = ? AND (lost_ranks > ? OR (lost_ranks = ? AND "
    "(fault_at < ? OR (fault_at = ? AND run_id < ?))))))"
)
ORDER = "ORDER BY priority DESC, lost_ranks DESC, fault_at, run_id"


def needs_around(tx: Transaction, run_id: str) -> tuple[list[SpareWant], dict[str, int]]:
    """The other runs' needs a run's view lists (the first few before its own need, then after it), and
    what the rest add up to: the spares the needs before its own take, and every recovery's."""
    row = tx.one("SELECT priority, lost_ranks, fault_at FROM pool_wants WHERE run_id = ?", (run_id,))
    everyone = tx.one("SELECT coalesce(sum(needed), 0) FROM pool_wants WHERE placed = 0 AND run_id <> ?", (run_id,))
    by_recoveries = int(everyone[0]) if everyone else 0
    listed = f"SELECT want FROM pool_wants WHERE run_id <> ? AND {{}} {ORDER} LIMIT {WANTS_SHOWN}"
    if row is None:  # no need of its own lodged (a regrow, a swap): every recovery comes first
        ahead = tx.all(listed.format("1 = 1"), (run_id,))
        behind, first = [], by_recoveries
    else:
        priority, lost, fault_at = row
        key = (priority, priority, lost, lost, fault_at, fault_at, run_id)
        ahead = tx.all(listed.format(BEFORE), (run_id, *key))
        behind = tx.all(listed.format(f"placed = 0 AND NOT {BEFORE}"), (run_id, *key))
        before = tx.one(
            f"SELECT coalesce(sum(needed), 0) FROM pool_wants WHERE placed = 0 AND run_id <> ? AND {BEFORE}",
            (run_id, *key),
        )
        first = int(before[0]) if before else 0
    wants = [SpareWant.model_validate_json(text) for (text,) in [*ahead, *behind]]
    return wants, {"needed_first": first, "needed_by_recoveries": by_recoveries, "spares_before": first}


def in_list(names: Sequence[str]) -> str:
    return f"({', '.join('?' * len(names))})"


def known_nodes(tx: Transaction, names: dict) -> dict[str, PoolNode]:
    """The named nodes, locked for this transaction, in name order; ClusterError names unknown ones."""
    wanted = sorted(names)
    if not wanted:
        return {}
    rows = tx.all(f"SELECT {COLUMNS} FROM pool_nodes WHERE name IN {in_list(wanted)} ORDER BY name{tx.lock}", wanted)
    nodes = {row[0]: node_of(row) for row in rows}
    unknown = [n for n in wanted if n not in nodes]
    if unknown:
        count = pool_row(tx, lock=False).nodes
        first = [row[0] for row in tx.all("SELECT name FROM pool_nodes ORDER BY seq LIMIT 8")]
        listed = names_listed(first, total=count)
        raise ClusterError(f"the pool has no node {', '.join(unknown)}; nodes: {listed}")
    return nodes


def set_fields(tx: Transaction, names: Sequence[str], **fields) -> None:
    if not names:
        return
    assignments = ", ".join(f"{column} = ?" for column in fields)
    tx.run(f"UPDATE pool_nodes SET {assignments} WHERE name IN {in_list(names)}", [*fields.values(), *names])


def free_count(tx: Transaction) -> int:
    return tx.one("SELECT count(*) FROM pool_nodes WHERE role = 'free' AND healthy = 1")[0]  # type: ignore[index]


def add_nodes(tx: Transaction, count: int, note: str, now: datetime) -> list[str]:
    if count <= 0:
        return []
    row = tx.one("SELECT next_seq FROM pool_state WHERE id = 1" + tx.lock)
    first = row[0] if row else 0
    names = [f"node-{first + i}" for i in range(count)]
    tx.many(
        "INSERT INTO pool_nodes (name, seq, role, owner, healthy, died_at, since, note, domain) "
        "VALUES (?, ?, 'free', NULL, 1, NULL, ?, ?, NULL)",
        [(name, first + i, iso(now), note) for i, name in enumerate(names)],
    )
    tx.run("UPDATE pool_state SET nodes = nodes + ?, next_seq = next_seq + ? WHERE id = 1", (count, count))
    return names


def claim_and_release(tx: Transaction, run_id: str, nodes: list[str], releases: Sequence[str], why: str) -> None:
    """Make `nodes` the run's active nodes and free `releases` it held (but not `nodes`); ClusterError,
    changing nothing, when one of `nodes` is neither free and healthy nor already the run's."""
    known = known_nodes(tx, dict.fromkeys([*nodes, *releases]))
    taken = [n for n in nodes if not claimable(known[n], run_id)]
    if taken:
        free = [row[0] for row in tx.all(FREE + " LIMIT 9")]
        held = "; ".join(f"{n} {holding(known[n])}" for n in taken)
        raise ClusterError(f"node {', '.join(taken)} is no longer a free spare ({held}; free: {names_listed(free)})")
    now = iso(datetime.now(UTC))
    claimed = [name for name in nodes if known[name].owner != run_id or known[name].role != "active"]
    set_fields(tx, claimed, role="active", owner=run_id, since=now, note=f"{run_id}: {why}")
    row = tx.one("SELECT want FROM pool_wants WHERE run_id = ?" + tx.lock, (run_id,))
    if row is not None and not (want := SpareWant.model_validate_json(row[0])).placed:
        placed = want.model_copy(update={"placed": True, "got": len(claimed)})
        tx.run(
            "UPDATE pool_wants SET want = ?, placed = 1 WHERE run_id = ?",
            (placed.model_dump_json(), run_id),
        )
    leftover = [n for n in releases if n not in nodes and known[n].owner == run_id and known[n].role == "active"]
    set_fields(tx, leftover, role="free", owner=None, since=now, note=f"released by {run_id} at {why}")


def breaker_refusal(tx: Transaction, state: PoolRow, run_id: str, new: list[str], now: datetime) -> str | None:
    """Why the breaker refuses to quarantine `new` for `run_id` (tripping it when they would take the
    window past its cap); None when it lets them through."""
    breaker, pool_nodes = state.breaker, state.nodes
    reset = "a person resets it with `lazarus pool breaker --reset`"
    if breaker.tripped_at is None:
        held, cap = in_window(tx, breaker, now), breaker.cap(pool_nodes)
        if held + len(new) <= cap:
            return None
        why = (
            f"{held + len(new)} nodes quarantined within {breaker.window_seconds:g} s would pass its cap of {cap} "
            f"({breaker.max_fraction:.0%} of the pool's {pool_nodes}); run {run_id} asked for {names_listed(new)}"
        )
        breaker = breaker.model_copy(update={"tripped_at": now, "tripped_reason": why})
        write_breaker(tx, breaker)
    return (
        f"the pool's quarantine breaker is open ({breaker.tripped_reason}): nothing more is quarantined until {reset}"
    )


def in_window(tx: Transaction, breaker: QuarantineBreaker, now: datetime) -> int:
    """How many nodes the breaker's window holds at `now`: quarantined by faults within it, and still out
    (counted in the store: in a rack's burst the window holds hundreds)."""
    since = iso(now - timedelta(seconds=breaker.window_seconds))
    row = tx.one(
        "SELECT count(*) FROM pool_quarantines q JOIN pool_nodes n ON n.name = q.node "
        "WHERE q.at >= ? AND n.role = 'quarantined'",
        (since,),
    )
    return row[0] if row else 0


def count_quarantines(tx: Transaction, nodes: list[str], now: datetime, state: PoolRow) -> None:
    """Count `nodes` in the breaker's window, and drop what left it (by time; a node returned since is
    not counted, whatever its row says)."""
    tx.run("DELETE FROM pool_quarantines WHERE at < ?", (iso(now - timedelta(seconds=state.breaker.window_seconds)),))
    tx.many(
        "INSERT INTO pool_quarantines (node, at) VALUES (?, ?) ON CONFLICT (node) DO UPDATE SET at = excluded.at",
        [(node, iso(now)) for node in nodes],
    )


def shared_fault(tx: Transaction, run_id: str, latest: datetime) -> SharedFault | None:
    """The nodes of the pool that died within TOGETHER_SECONDS of the run's latest dead node (`latest`),
    when they are more than the run's own; None otherwise. Reads only the dead nodes of that span, and
    only what the report needs of each (a burst's span holds hundreds)."""
    span = timedelta(seconds=TOGETHER_SECONDS)
    rows = tx.all(
        "SELECT name, owner, role, domain FROM pool_nodes WHERE healthy = 0 AND died_at >= ? AND died_at <= ? "
        "ORDER BY seq",
        (iso(latest - span), iso(latest + span)),
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


def names_listed(names: list[str], shown: int = 8, total: int | None = None) -> str:
    """Names for a message: the first few and how many more (a pool may have thousands free)."""
    total = len(names) if total is None else total
    more = f" and {total - shown} more" if total > shown else ""
    return (", ".join(names[:shown]) + more) or "none"


def claimable(node: PoolNode, run_id: str) -> bool:
    return (node.role == "free" and node.healthy) or (node.role == "active" and node.owner == run_id)


def holding(node: PoolNode) -> str:
    if node.role == "free":
        return "is dead"
    if node.role == "active":
        return f"is active in run {node.owner}"
    return f"is quarantined by {node.owner}" if node.owner else f"is quarantined ({node.note})"
