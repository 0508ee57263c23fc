"""Recovery cost on the Kubernetes backend, against the API emulator with the fake kubelet.

    .venv/bin/python bench/kubernetes_recovery.py [--kills 3] [--json] [--markdown [PATH]]

Needs the test extra (kmock): `make test` installs it. Each kill is its own run of the demo
spec (4 active nodes and 1 hot spare of a pool of 5, one rank pod per node) on a private Temporal
dev server, one in-process worker with the Kubernetes backend, and a fresh emulator whose
fake kubelet runs every pod's launcher as a local process (tests/k8s/). Two scenarios:

  api-learns-first        the node's Ready turns Unknown and its pods Failed before its
                          processes die (a node problem detector, a short node-monitor grace)
  survivors-report-first  the processes die and the API server still shows the node Ready
                          (Kubernetes' default 40 s grace): blame comes from the survivors'
                          lost-peer errors and the dead node's silence, after a 2 s settle

Stage times are those the workflow records (as in bench/recovery.py). Each node runs a warm
standby pod (torch imported when the run starts) that forks the node's launcher on an order,
so a recovery restarts the survivors in place and orders the spare's standby; the emulator's
API calls are HTTP round trips on this machine. A second table says where drain, replace and
resume spend their seconds: each backend call the stages made after the fault, timed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ and tests/ are not installed packages

from kubernetes import client as k8s

from bench import perf_page
from bench.recovery import COLUMNS, row
from lazarus.client.config import Settings
from lazarus.commands.demo_run import DEFAULT_SPEC, default_kill_step, drive_run
from lazarus.infra.backend import free_port
from lazarus.infra.backends.kubernetes.cluster import KubernetesCluster
from lazarus.infra.harness.temporal_server import local_environment
from lazarus.schema import RunState, load_spec, parse_spec
from lazarus.worker import build_worker
from tests.k8s.emulator import BACKEND_USER_AGENT, EmulatorThread
from tests.k8s.kubelet import FakeKubelet
from tests.support.kubernetes import add_node, api_client

SCENARIOS = {"api-learns-first": True, "survivors-report-first": False}
PAGE_TITLE = "Recovery on Kubernetes (emulated)"
ABOUT = """The demo spec (4 active nodes and 1 hot spare of a pool of 5, one rank pod per node) on the
Kubernetes backend, against the API emulator with a fake kubelet that runs every pod's launcher as
a local process; each kill is its own run on a private Temporal dev server with one in-process
worker. Each node runs a warm standby pod that forks the node's launcher on an order, so a
recovery restarts the survivors in place and orders the spare's standby; the emulator's API calls
are HTTP round trips on this machine. Two scenarios: *api-learns-first*, where the node's Ready
turns Unknown and its pods Failed before its processes die, and *survivors-report-first*, where
the processes die while the API server still shows the node Ready (blame then comes from the
survivors' lost-peer errors and the dead node's silence, after a 2 s settle). Stage times are
those the workflow records, as on the local backend's page; the last table times each backend
call drain, replace_or_reshard and resume made after the fault."""

# The backend calls of drain (to stop_incarnation), replace_or_reshard (commit_assignment) and
# resume (start_ranks), in the order the stages make them.
CALLS = [
    "quarantine",
    "await_survivors",
    "await_checkpoint_in_flight",
    "stop_incarnation",
    "remove_partial_checkpoints",
    "commit_assignment",
    "start_ranks",
]


class CallClock:
    """The backend with the seconds of each call in CALLS recorded once `since` is set (the fault)."""

    def __init__(self, cluster):
        self.cluster, self.since, self.seconds = cluster, None, {}

    def __getattr__(self, name):
        method = getattr(self.cluster, name)
        if name not in CALLS:
            return method

        def timed(*args, **kwargs):
            began = time.monotonic()
            try:
                return method(*args, **kwargs)
            finally:
                if self.since is not None:
                    self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - began

        return timed


def kubernetes_spec(home: Path):
    """The demo spec on the kubernetes backend (pool `bench`, namespace lz, volume at `home`)."""
    data = load_spec(DEFAULT_SPEC).model_dump(mode="json")
    data["cluster"] = {
        **data["cluster"],
        "backend": "kubernetes",
        "kubernetes": {
            "namespace": "lz",
            "pool": "bench",
            "mount_path": str(home),
            "image": "trainer:bench",
            "delete_grace_seconds": 1,
            # Every emulated node is this host: a port of its own, free of other runs' rendezvous.
            "master_port": free_port(),
        },
    }
    return parse_spec(data)


async def one_kill(client, home: Path, run_id: str, api_learns: bool, say) -> dict:
    emulator = EmulatorThread().start()
    kubelet = cluster = None
    try:
        admin = k8s.CoreV1Api(api_client(emulator.url, "bench-admin"))
        for i in range(4):
            add_node(admin, f"worker-{i}", pool="bench")
        add_node(admin, "spare-0", pool="bench", spare=True)
        kubelet = FakeKubelet(admin, "lz", home / "kubelet" / run_id).start()
        cluster = CallClock(KubernetesCluster(home, api_client(emulator.url, BACKEND_USER_AGENT)))
        spec = kubernetes_spec(home)
        settings = Settings(address=client.service_client.config.target_host, home=home, task_queue=f"k8s-{run_id}")

        async def kill(_run_id: str, node: str) -> list[int]:
            pids = [
                p.pid
                for name, p in kubelet.processes.items()
                if admin.read_namespaced_pod(name, "lz").spec.node_name == node
            ]
            cluster.since = time.monotonic()
            await asyncio.to_thread(kubelet.kill_node, node, api_learns)
            return pids

        async with build_worker(client, settings.task_queue, cluster):
            final = await drive_run(client, settings, cluster, spec, run_id, default_kill_step(spec), say, kill)
        if kubelet.errors:
            raise SystemExit(f"bench: the fake kubelet failed: {kubelet.errors[0]!r}")
        if final.state != RunState.COMPLETED or len(final.incidents) != 1:
            raise SystemExit(
                f"bench: {run_id} ended {final.state.value} with {len(final.incidents)} incident(s): {final.reason}"
            )
        incident = final.incidents[0]
        calls = {name: cluster.seconds.get(name, 0.0) for name in CALLS}
        return {**row(incident), "blamed": ",".join(incident.fault.nodes), "kind": incident.fault.kind, "calls": calls}
    finally:
        if cluster is not None:
            cluster.close()
        if kubelet is not None:
            kubelet.stop()
        emulator.stop()


async def bench(kills: int, quiet: bool) -> dict[str, list[dict]]:
    env = await local_environment()
    started = time.monotonic()

    def say(message: str) -> None:
        if not quiet:
            print(f"[{time.monotonic() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    rows: dict[str, list[dict]] = {name: [] for name in SCENARIOS}
    try:
        with tempfile.TemporaryDirectory() as folder:
            for name, api_learns in SCENARIOS.items():
                for i in range(kills):
                    say(f"{name} {i + 1}/{kills}")
                    rows[name].append(await one_kill(env.client, Path(folder), f"k8s-{name[:3]}-{i}", api_learns, say))
    finally:
        await env.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=3, help="runs per scenario, one node killed in each (default 3)")
    parser.add_argument("--json", action="store_true", help="print per-run rows and medians as JSON")
    perf_page.add_option(parser, __file__)
    args = parser.parse_args()
    if args.kills < 1:
        parser.error("--kills must be at least 1")
    sitting = perf_page.begin()
    rows = asyncio.run(bench(args.kills, quiet=args.json))
    medians = {name: {c: statistics.median(r[c] for r in runs) for c in COLUMNS} for name, runs in rows.items()}
    if args.markdown:
        write_markdown(args.markdown, sitting, rows, medians)
    if args.json:
        print(json.dumps({"runs": rows, "median": medians}, indent=2))
        return
    widths = {c: max(len(c), 6) + 2 for c in COLUMNS}
    for name, runs in rows.items():
        print(f"\nKubernetes (emulated), {name}: {len(runs)} kill(s) of worker-2, hot spare (seconds)")
        print("run     " + "".join(f"{c:>{widths[c]}}" for c in COLUMNS) + "  blamed")
        for i, r in enumerate(runs, 1):
            print(f"{i:<8}" + "".join(f"{r[c]:>{widths[c]}.2f}" for c in COLUMNS) + f"  {r['blamed']} ({r['kind']})")
        print("median  " + "".join(f"{medians[name][c]:>{widths[c]}.2f}" for c in COLUMNS))
        print(f"backend calls after the fault, {name}, median seconds:")
        for call in CALLS:
            print(f"  {call:<28}{statistics.median(r['calls'][call] for r in runs):>6.2f}")


def write_markdown(path: Path, sitting, rows: dict[str, list[dict]], medians: dict) -> None:
    tables = []
    for name, runs in rows.items():
        body = [[i, *(f"{r[c]:.2f}" for c in COLUMNS), f"{r['blamed']} ({r['kind']})"] for i, r in enumerate(runs, 1)]
        body.append(["median", *(f"{medians[name][c]:.2f}" for c in COLUMNS), None])
        caption = f"Kubernetes (emulated), {name}: {len(runs)} kill(s) of worker-2, hot spare (seconds)"
        tables.append(perf_page.Table(["run", *COLUMNS, "blamed"], body, caption))
    calls = [
        [call, *(f"{statistics.median(r['calls'][call] for r in runs):.2f}" for runs in rows.values())]
        for call in CALLS
    ]
    tables.append(perf_page.Table(["backend call", *rows], calls, "Backend calls after the fault, median seconds"))
    perf_page.write_page(path, sitting, title=PAGE_TITLE, doc=__doc__, about=ABOUT, tables=tables)


if __name__ == "__main__":
    from lazarus.client.runs import exit_after

    exit_after(main)  # past the native client's crash at interpreter exit
