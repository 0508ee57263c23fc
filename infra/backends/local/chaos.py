"""What the local backend alone does to its nodes on purpose: the chaos bed's kills of a node or a
whole fault domain, and the clean-up that makes the pool whole again after a run. Each takes the
LocalCluster (or a backend built on it) as `cluster`."""

from __future__ import annotations

from datetime import UTC, datetime

from lazarus.infra.backend import ClusterError
from lazarus.infra.processes import kill_and_wait, node_groups


def kill_node(cluster, run_id: str, node: str) -> list[int]:
    """Chaos: mark a node dead, SIGKILL every process on it, and wait until they are gone.

    Returns the process groups killed (one per incarnation the node ran in). The node is
    marked dead first, with the time just before the kill, so a detector sees a dead node
    rather than only its ranks' exits.
    """
    run = cluster._existing(run_id)
    cluster.update_nodes(
        run_id, {node: {"healthy": False, "died_at": datetime.now(UTC), "note": "killed (chaos kill-node)"}}
    )
    # The standbys first, so that none can fork another launcher on the dead node; its ranks are
    # signalled before anyone waits for the standbys to be gone, as they would all die at once.
    cluster._kill_standbys_on([node], wait=False)
    killed = kill_and_wait([g for k in run.incarnations() for g in node_groups(run, k, node)])
    cluster._kill_standbys_on([node])
    cluster._reap()
    return [group_id for _, _, group_id in killed if group_id is not None]


def kill_domain(cluster, domain: str) -> dict[str, str | None]:
    """Chaos: every node of a fault domain dies at once, as with a rack's switch: marked dead in one
    write, then every process of every run on them SIGKILLed. Returns node -> the run that held it."""
    held = nodes_of_domain(cluster, domain)
    now = datetime.now(UTC)
    note = f"killed with {domain} (chaos kill-domain)"
    cluster.pool.set_health({node: {"healthy": False, "died_at": now, "note": note} for node in held})
    cluster._kill_standbys_on(list(held), wait=False)
    groups = [g for run in cluster._runs() for k in run.incarnations() for n in held for g in node_groups(run, k, n)]
    kill_and_wait(groups)
    cluster._kill_standbys_on(list(held))
    cluster._reap()
    return held


def nodes_of_domain(cluster, domain: str) -> dict[str, str | None]:
    """The pool's nodes in `domain` and who holds each; ClusterError names the domains there are."""
    record = cluster.pool.read()
    held = {n.name: n.owner for n in record.nodes if n.domain == domain}
    if not held:
        known = ", ".join(sorted({n.domain for n in record.nodes if n.domain})) or "none (`lazarus pool domain`)"
        raise ClusterError(f"the pool of {cluster.store.url} has no node in fault domain {domain!r}; domains: {known}")
    return held


def repair_after(cluster, run_id: str) -> list[str]:
    """Chaos clean-up of an ended run: its active nodes go back to the pool, and what it
    quarantined and every dead free node are returned healthy, so the pool is whole for the
    next run; returns the nodes repaired."""
    cluster.release_nodes(run_id)
    broken = [
        n.name
        for n in cluster.pool.read().nodes
        if (n.role == "quarantined" and n.owner == run_id) or (n.role == "free" and not n.healthy)
    ]
    for node in broken:
        cluster.pool.return_node(node)
    return broken
