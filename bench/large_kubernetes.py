"""The Kubernetes backend with a pool of thousands of nodes, against the API emulator (bench/large_run.py).

The backend's own calls, through the real `kubernetes` client at a given rate (QPS, burst):
the watch following the pool, a run's claim of every node, its launch (a rank pod per node),
and its drain (every pod deleted, waited for until the API server has none). No kubelet runs
the pods: what is timed is the client and the API server, not containers starting.
"""

from __future__ import annotations

import time
from pathlib import Path

from kubernetes import client as k8s

from bench.large_run import large_spec
from lazarus.infra.kubernetes import KubernetesCluster
from lazarus.schema.records import Assignment
from tests.k8s.emulator import BACKEND_USER_AGENT, EmulatorThread
from tests.support.kubernetes import add_node, api_client


def _timed(what: str, figures: dict, emulator, say, call):
    """Run `call`; record its seconds and how many requests the backend made in them."""
    before, started = sum(emulator.calls.values()), time.monotonic()
    result = call()
    seconds, requests = time.monotonic() - started, sum(emulator.calls.values()) - before
    figures[what] = {"seconds": round(seconds, 2), "requests": requests, "per_second": round(requests / seconds, 1)}
    say(f"kubernetes: {what} took {seconds:.2f} s, {requests} requests ({requests / seconds:.1f}/s)")
    return result


def emulated_pool(home: Path, nodes: int, qps: float, burst: int, say) -> dict:
    """A run of `nodes` nodes (+2 hot spares) through the backend: the seconds of each step."""
    emulator = EmulatorThread().start()
    cluster = None
    figures: dict[str, dict] = {}
    try:
        admin = k8s.CoreV1Api(api_client(emulator.url, "bench-admin"))
        say(f"kubernetes: adding {nodes + 2} nodes to the emulator")
        for i in range(nodes):
            add_node(admin, f"node-{i}", pool="large")
        for i in range(2):
            add_node(admin, f"spare-{i}", pool="large", spare=True)
        cluster = KubernetesCluster(home, api_client(emulator.url, BACKEND_USER_AGENT), qps=qps, burst=burst)
        spec = large_spec(
            nodes,
            # No kubelet confirms a graceful delete: the drain deletes with grace 0, as for a dead node.
            {
                "backend": "kubernetes",
                "warm_standby": False,  # the cost of creating and deleting the rank pods themselves
                "kubernetes": {"namespace": "lz", "pool": "large", "mount_path": str(home), "delete_grace_seconds": 0},
            },
        )

        def follow() -> None:
            cluster.watches.start("large", "lz")
            while len(cluster.watches.cached("nodes", "large") or {}) < nodes + 2:
                time.sleep(0.05)

        _timed("watch synced (pool listed)", figures, emulator.emulator, say, follow)
        run_id = "large"
        _timed(f"claim {nodes} nodes", figures, emulator.emulator, say, lambda: cluster.create(run_id, spec))
        names = sorted(
            (n.name for n in cluster.inventory(run_id).nodes if n.role == "active"), key=lambda n: int(n.split("-")[1])
        )
        assignment = Assignment(incarnation=0, nodes=names, layout=spec.layout, master_port=29500)
        cluster.commit_assignment(run_id, assignment)
        _timed(f"launch {nodes} rank pods", figures, emulator.emulator, say, lambda: cluster.start_ranks(run_id, 0, 0))

        def pods_seen() -> None:
            while len(cluster.watches.cached("pods", "lz") or {}) < nodes:
                time.sleep(0.05)

        _timed("watch saw every pod", figures, emulator.emulator, say, pods_seen)
        drain = f"drain {nodes} rank pods (deleted, gone)"
        _timed(drain, figures, emulator.emulator, say, lambda: cluster.stop_incarnation(run_id, 0))
        return {"nodes": nodes, "qps": qps, "burst": burst, "steps": figures}
    finally:
        if cluster is not None:
            cluster.close()
        emulator.stop()
