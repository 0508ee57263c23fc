"""The local backend's node pool under LAZARUS_HOME, shared by every run of that home (and every
worker that serves them), as a Kubernetes pool is shared by its label.

Every change is an edit of the pool's record under its lock (infra/pool_file.py): a claim sees every
claim before it, two runs can never both take one spare. What changes a run's assignment and the
pool together (LocalCluster.commit_assignment) holds the lock across both. The quarantine breaker
and the fault domains live in the record too (schema/pool.py).
"""

from __future__ import annotations

from datetime import UTC, datetime

from lazarus.infra.backend import ClusterError, QuarantineRefused
from lazarus.infra.pool_file import PoolFile
from lazarus.schema.pool import (
    TOGETHER_SECONDS,
    PoolNode,
    PoolRecord,
    QuarantineBreaker,
    SharedFault,
    SpareWant,
    node_number,
)
from lazarus.schema.records import Inventory, NodeRecord


class LocalPool(PoolFile):
    """The nodes of one home: who holds which, and which are free hot spares."""

    # --- changes, each under the lock --------------------------------------------------------

    def add(self, count: int, note: str = "added") -> list[str]:
        """Add `count` free healthy nodes; returns their names."""
        return self.change(lambda record: [node.name for node in _add(record, count, note)])

    def provision(self, run_id: str, active: int, spares: int) -> list[str]:
        """Give a new run `active` nodes of its own and leave `spares` free nodes as the pool's hot
        spares: free nodes beyond those spares first, then nodes added (a local node costs nothing
        until it runs). A repeated call finds the nodes the run holds. Returns its active nodes."""

        def edit(record: PoolRecord) -> list[str]:
            mine = [node.name for node in record.held_by(run_id)]
            if not mine:
                now = datetime.now(UTC)
                free = record.free()
                wanted = [node.name for node in free[: max(0, min(active, len(free) - spares))]]
                wanted += [node.name for node in _add(record, active - len(wanted), "added for a run")]
                _hold(record, wanted, run_id, now, "launch")
                mine = wanted
            _add(record, spares - len(record.free()), "added as a hot spare")
            return mine

        return self.change(edit)

    def set_health(self, changes: dict[str, dict]) -> PoolRecord:
        """Apply field changes (healthy, died_at, note) to named nodes; ClusterError names an unknown one."""

        def edit(record: PoolRecord) -> PoolRecord:
            _known(record, changes)
            record.nodes[:] = [
                PoolNode.model_validate({**n.model_dump(), **changes[n.name]}) if n.name in changes else n
                for n in record.nodes
            ]
            return record

        return self.change(edit)

    def quarantine(self, run_id: str, names: list[str], reason: str, counted: bool = True) -> None:
        """Hold the nodes out of every run until they are returned (the run that holds them drains them).

        Unless not `counted` (an operator's own drain), the quarantine breaker counts them:
        QuarantineRefused, quarantining nothing, while it is open or when these would take the
        window past its cap (which trips it, for a person to reset)."""

        def edit(record: PoolRecord) -> str | None:
            nodes = _known(record, dict.fromkeys(names))
            others = [n for n in names if nodes[n].owner not in (None, run_id)]
            if others:
                raise ClusterError(f"{', '.join(others)} belongs to another run ({nodes[others[0]].owner})")
            now = datetime.now(UTC)
            new = [n for n in names if nodes[n].role != "quarantined"]  # a retried drain counts once
            if counted and new:
                refusal = _breaker_refusal(record, run_id, new, now)
                if refusal is not None:
                    return refusal
                record.breaker = record.breaker.counting(new, now, record.out())
            _replace(record, names, role="quarantined", owner=run_id, since=now, note=reason)
            return None

        refusal = self.change(edit)
        if refusal is not None:
            raise QuarantineRefused(refusal)

    def reject_spare(self, name: str, reason: str) -> None:
        """A free node failed a run's health check before the run claimed it: out of the pool, held by
        no run (it was none's loss), until returned. The quarantine breaker counts it, as any: a check
        that fails everywhere must not empty the pool. QuarantineRefused when the breaker refuses."""

        def edit(record: PoolRecord) -> str | None:
            node = _known(record, {name: None})[name]
            if node.role != "free":
                raise ClusterError(f"{name} is no longer a free spare ({name} {_held(node)})")
            now = datetime.now(UTC)
            refusal = _breaker_refusal(record, "(a spare's health check)", [name], now)
            if refusal is not None:
                return refusal
            record.breaker = record.breaker.counting([name], now, record.out())
            _replace(record, [name], role="quarantined", owner=None, since=now, note=reason)
            return None

        refusal = self.change(edit)
        if refusal is not None:
            raise QuarantineRefused(refusal)

    def set_breaker(self, max_fraction: float | None = None, window_seconds: float | None = None) -> QuarantineBreaker:
        """Change the breaker's cap or window (None: as it is); returns it."""

        def edit(record: PoolRecord) -> QuarantineBreaker:
            changes = {"max_fraction": max_fraction, "window_seconds": window_seconds}
            fields = record.breaker.model_dump() | {k: v for k, v in changes.items() if v is not None}
            record.breaker = QuarantineBreaker.model_validate(fields)
            return record.breaker

        return self.change(edit)

    def reset_breaker(self) -> QuarantineBreaker:
        """A person closes the breaker: the window starts empty. Returns it."""

        def edit(record: PoolRecord) -> QuarantineBreaker:
            record.breaker = record.breaker.model_copy(
                update={"tripped_at": None, "tripped_reason": "", "quarantined": {}}
            )
            return record.breaker

        return self.change(edit)

    def return_node(self, name: str) -> PoolNode:
        """A repaired node rejoins the pool as a free healthy spare; returns it as recorded."""

        def edit(record: PoolRecord) -> PoolNode:
            node = _known(record, {name: None})[name]
            if node.role == "active":
                raise ClusterError(f"{name} is active in run {node.owner}; only a quarantined or dead node is returned")
            fields = {"healthy": True, "died_at": None}
            return _free(record, [name], datetime.now(UTC), "returned", **fields)[0]

        return self.change(edit)

    def release(self, run_id: str) -> list[str]:
        """The run ended: its active nodes go back to the pool as free spares (what it quarantined
        stays quarantined) and its want goes; returns the nodes."""

        def edit(record: PoolRecord) -> list[str]:
            mine = [node.name for node in record.held_by(run_id)]
            _free(record, mine, datetime.now(UTC), f"released by {run_id}")
            record.wants[:] = [w for w in record.wants if w.run_id != run_id]
            return mine

        return self.change(edit)

    def want(self, want: SpareWant) -> None:
        """Lodge a run's need of spares, in place of its earlier one."""

        def edit(record: PoolRecord) -> None:
            record.wants[:] = [w for w in record.wants if w.run_id != want.run_id] + [want]

        self.change(edit)

    def drop_want(self, run_id: str) -> None:
        """The run's recovery is over: its want goes."""

        def edit(record: PoolRecord) -> None:
            record.wants[:] = [w for w in record.wants if w.run_id != run_id]

        self.change(edit)

    # --- what one run sees -------------------------------------------------------------------

    def inventory(self, run_id: str, record: PoolRecord | None = None, allowance: int | None = None) -> Inventory:
        """The run's view: its active nodes, what it quarantined, and the free nodes as spares: all
        of them, or, given the run's `allowance` (the most nodes it may hold), as many as it could
        ever take, past the other runs' needs that may come first (a fleet's pool has thousands)."""
        record = record or self.read()
        views, listed = [], None
        if allowance is not None:
            listed = sum(w.needed for w in record.wants if w.run_id != run_id and not w.placed) + allowance
        for node in record.nodes:
            if node.role == "free":
                if listed is not None and (listed := listed - 1) < 0:
                    continue
                role, note = "spare", node.note or "hot spare of the pool"
            elif node.owner == run_id:
                role, note = node.role, node.note
            else:
                continue
            views.append(NodeRecord(name=node.name, role=role, healthy=node.healthy, died_at=node.died_at, note=note))
        wants = [w for w in record.wants if w.run_id != run_id]
        return Inventory(nodes=views, wants=wants, shared=shared_fault(record, run_id))

    def set_domain(self, names: list[str], domain: str | None) -> list[str]:
        """Place the named nodes in fault domain `domain` (None: in none); returns them."""

        def edit(record: PoolRecord) -> list[str]:
            _known(record, dict.fromkeys(names))
            _replace(record, names, domain=domain)
            return names

        return self.change(edit)


def shared_fault(record: PoolRecord, run_id: str) -> SharedFault | None:
    """The nodes of the pool that died within TOGETHER_SECONDS of the run's latest dead node, when
    they are more than the run's own; None otherwise."""
    dead = [n for n in record.nodes if not n.healthy and n.died_at is not None]
    mine = [n for n in dead if n.owner == run_id]
    if not mine:
        return None
    latest = max(n.died_at for n in mine if n.died_at is not None)
    together = [
        n for n in dead if n.died_at is not None and abs((n.died_at - latest).total_seconds()) <= TOGETHER_SECONDS
    ]
    others = [n for n in together if n.owner != run_id]
    if not others:
        return None
    my_domains = {n.domain for n in together if n.owner == run_id and n.domain}
    return SharedFault(
        nodes=[n.name for n in together],
        domains=sorted({n.domain for n in together if n.domain}),
        runs=sorted({n.owner for n in others if n.owner}),
        undrained=sorted({n.owner for n in others if n.owner and n.role == "active" and n.domain in my_domains}),
    )


def claim_and_release(record: PoolRecord, run_id: str, nodes: list[str], releases: list[str], why: str) -> None:
    """In `record` (a working copy): make `nodes` the run's active nodes and free `releases` it held
    (but not `nodes`). ClusterError, changing nothing, when one of `nodes` is neither free and
    healthy nor already the run's (a retry of a claim that succeeded succeeds)."""
    known = _known(record, dict.fromkeys(nodes))
    taken = [n for n in nodes if not _claimable(known[n], run_id)]
    if taken:
        free = _listed([n.name for n in record.free()])
        held = "; ".join(f"{n} {_held(known[n])}" for n in taken)
        raise ClusterError(f"node {', '.join(taken)} is no longer a free spare ({held}; free: {free})")
    now = datetime.now(UTC)
    claimed = [name for name in nodes if known[name].owner != run_id or known[name].role != "active"]
    _hold(record, claimed, run_id, now, why)
    record.wants[:] = [
        w.model_copy(update={"placed": True, "got": len(claimed)}) if w.run_id == run_id and not w.placed else w
        for w in record.wants
    ]
    leftover = [n.name for n in record.held_by(run_id) if n.name in releases and n.name not in nodes]
    _free(record, leftover, now, f"released by {run_id} at {why}")


def _breaker_refusal(record: PoolRecord, run_id: str, new: list[str], now: datetime) -> str | None:
    """Why the breaker refuses to quarantine `new` for `run_id` (tripping it, in `record`, when they
    would take the window past its cap); None when it lets them through."""
    breaker, pool_nodes = record.breaker, len(record.nodes)
    reset = "a person resets it with `lazarus pool breaker --reset`"
    if breaker.tripped_at is None:
        held, cap = len(breaker.recent(now, record.out())), breaker.cap(pool_nodes)
        if held + len(new) <= cap:
            return None
        why = (
            f"{held + len(new)} nodes quarantined within {breaker.window_seconds:g} s would pass its cap of {cap} "
            f"({breaker.max_fraction:.0%} of the pool's {pool_nodes}); run {run_id} asked for {_listed(new)}"
        )
        record.breaker = breaker = breaker.model_copy(update={"tripped_at": now, "tripped_reason": why})
    return (
        f"the pool's quarantine breaker is open ({breaker.tripped_reason}): nothing more is quarantined until {reset}"
    )


def _listed(names: list[str], shown: int = 8) -> str:
    """Names for a message: the first few and how many more (a pool may have thousands free)."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return (", ".join(names[:shown]) + more) or "none"


def _claimable(node: PoolNode, run_id: str) -> bool:
    return (node.role == "free" and node.healthy) or (node.role == "active" and node.owner == run_id)


def _held(node: PoolNode) -> str:
    if node.role == "free":
        return "is dead"
    if node.role == "active":
        return f"is active in run {node.owner}"
    return f"is quarantined by {node.owner}" if node.owner else f"is quarantined ({node.note})"


def _known(record: PoolRecord, names: dict) -> dict[str, PoolNode]:
    nodes = {n.name: n for n in record.nodes}
    unknown = sorted(set(names) - set(nodes), key=node_number)
    if unknown:
        listed = ", ".join(n.name for n in record.nodes) or "none"
        raise ClusterError(f"the pool has no node {', '.join(unknown)}; nodes: {listed}")
    return nodes


def _add(record: PoolRecord, count: int, note: str) -> list[PoolNode]:
    first = max((node_number(n.name) for n in record.nodes), default=-1) + 1
    now = datetime.now(UTC)
    added = [PoolNode(name=f"node-{first + i}", role="free", since=now, note=note) for i in range(max(0, count))]
    record.nodes.extend(added)
    return added


def _replace(record: PoolRecord, names: list[str], **fields) -> list[PoolNode]:
    """Put a copy with `fields` in the place of each named node of the working record; returns the copies."""
    wanted = set(names)
    copies = []
    for index, node in enumerate(record.nodes):
        if node.name in wanted:
            record.nodes[index] = node.model_copy(update=fields)
            copies.append(record.nodes[index])
    return copies


def _hold(record: PoolRecord, names: list[str], run_id: str, now: datetime, why: str) -> None:
    _replace(record, names, role="active", owner=run_id, since=now, note=f"{run_id}: {why}")


def _free(record: PoolRecord, names: list[str], now: datetime, note: str, **fields) -> list[PoolNode]:
    return _replace(record, names, role="free", owner=None, since=now, note=note, **fields)
