"""The Kubernetes backend with a pool of thousands of nodes, against the API emulator (bench/large_run.py).

    .venv/bin/python bench/large_kubernetes.py [--nodes 2048] [--qps 50 --burst 100] [--json] [--markdown [PATH]]

The backend's own calls, through the real `kubernetes` client at a given rate (QPS, burst):
the watch following the pool, a run's claim of every node, its launch (a rank pod per node),
and its drain (every pod deleted, waited for until the API server has none). No kubelet runs
the pods: what is timed is the client and the API server, not containers starting. Needs the
test extra (kmock). bench/large_run.py runs the same after its simulated runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ and tests/ are not installed packages

from kubernetes import client as k8s

from bench import perf_page
from bench.large_run import large_spec
from lazarus.infra.backends.kubernetes.cluster import KubernetesCluster
from lazarus.schema.records import Assignment
from tests.k8s.emulator import BACKEND_USER_AGENT, EmulatorThread
from tests.support.kubernetes import add_node, api_client

PAGE_TITLE = "A Kubernetes pool of thousands of nodes (emulated)"
ABOUT = """The Kubernetes backend's own calls for one large run, through the real `kubernetes` client at
a given rate (QPS, burst), against the API emulator (kmock) in this process: the watch following
a pool of the run's nodes and two spares, the run's claim of every node, its launch (one rank pod
per node), the watch seeing every pod, and the drain (every pod deleted with grace 0, waited for
until the API server has none). No kubelet runs the pods: what is timed is the client and the API
server, not containers starting. The run's layout is bench/large_run.py's (8 ranks a node)."""


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


def pool_caption(k: dict) -> str:
    return (
        f"Kubernetes backend against the emulator: {k['nodes']} nodes, client at {k['qps']:g} QPS, burst {k['burst']}"
    )


def pool_table(k: dict) -> perf_page.Table:
    """emulated_pool's figures as the table the benches print."""
    rows = [
        [name, f"{step['seconds']:.2f}", step["requests"], f"{step['per_second']:.1f}"]
        for name, step in k["steps"].items()
    ]
    return perf_page.Table(["step", "seconds", "requests", "requests/s"], rows, pool_caption(k))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2048, help="the run's nodes (the pool has 2 spares more)")
    parser.add_argument("--qps", type=float, default=50.0, help="Kubernetes client requests per second (default 50)")
    parser.add_argument("--burst", type=int, default=100, help="Kubernetes client burst (default 100)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    perf_page.add_option(parser, __file__)
    args = parser.parse_args()
    if args.nodes < 16 or args.nodes % 16 or args.qps <= 0 or args.burst < 1:
        parser.error("--nodes must be a multiple of 16 (pp 16), --qps and --burst positive")
    sitting = perf_page.begin()
    started = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory() as home:
        k = emulated_pool(Path(home), args.nodes, args.qps, args.burst, say)
    if args.markdown:
        perf_page.write_page(args.markdown, sitting, title=PAGE_TITLE, doc=__doc__, about=ABOUT, tables=[pool_table(k)])
    if args.json:
        print(json.dumps(k, indent=2))
        return
    print(f"\n{pool_caption(k)}")
    for name, step in k["steps"].items():
        print(f"  {name:<40} {step['seconds']:8.2f} s  {step['requests']:6} requests  {step['per_second']:7.1f}/s")


if __name__ == "__main__":
    main()
