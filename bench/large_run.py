"""One run at the scale of Llama 3 (2,048 nodes of 8 GPUs): the controller's share of a recovery.

    .venv/bin/python bench/large_run.py [--nodes 64,256,1024,2048] [--faults 3]
                                        [--kubernetes-nodes 2048] [--qps 50 --burst 100]
                                        [--plot FILE.png] [--json] [--markdown [PATH]]

For each size, one run of NODES x 8 ranks (tp 8 in a node, pp 16, dp NODES/16) on a private
Temporal dev server, served by this process's worker with the real activities, on the simulated
backend (infra/backends/simulated/cluster.py: LocalCluster with every launcher replaced by the node report it
would keep, so a look reads and parses one file per node as on a real run). Once it trains,
--faults nodes die one after another, each after the last recovery. Printed per size:

  look              one detect look, observe + judge (median of 31, ms)
  report->decision  detect's fault report to reschedule's decision recorded (median, ms)
  decision->launch  the decision to every rank launched (the simulated launch is instant, so
                    this is replace_or_reshard and resume's start: the controller's share; ms)
  payload           the largest payload in the run's histories (bytes) and the activity it was
  events/incident   history events from the detect that reported the fault to resume's end

Then, unless --kubernetes-nodes 0, the Kubernetes backend against the API emulator (kmock,
the test extra): a pool of that many nodes followed by the watch, a run's claim of them, the
launch of one rank pod per node and the drain that deletes them, each through the client at
--qps/--burst (cluster.kubernetes.client_qps/client_burst). No kubelet runs the pods.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ and tests/ are not installed packages

from bench import perf_page
from lazarus.activities.running import look
from lazarus.client.config import Settings
from lazarus.client.history import chain_histories, incident_spans, largest_payloads
from lazarus.client.runs import run_status, start_run
from lazarus.infra.backends.simulated.cluster import SimulatedCluster
from lazarus.infra.harness.temporal_server import local_environment, quiet_runtime
from lazarus.schema import RunState, parse_spec
from lazarus.worker import build_worker

SIZES = (64, 256, 1024, 2048)
PAGE_TITLE = "One run of 2,048 nodes"
ABOUT = """For each size, one run of NODES x 8 ranks (tp 8 in a node, pp 16, dp NODES/16, two hot
spares, a heartbeat a second) on a private Temporal dev server, served by this process's worker
with the real activities, on the simulated backend (the local backend with each node's launcher
replaced by the report it would keep, so a look reads and parses one file per node as on a real
run); once it trains, nodes die one after another, each after the last recovery. *look*: one
detect look, observe + judge (median of 31). *report -> decision*: detect's fault report to
reschedule's decision recorded (median). *decision -> launch*: the decision to every rank launched
(the simulated launch is instant, so this is the controller's share). *largest payload*: the
largest payload in the run's histories and the activity it was. *events/incident*: history events
from the detect that reported the fault to resume's end. Then, unless left out, the Kubernetes
backend's calls for a pool of thousands of nodes against the API emulator (as on its own page)."""
RANKS_PER_NODE = 8
LOOKS = 31


def large_spec(nodes: int, backend: dict | None = None):
    """A Llama 3-like layout on `nodes` nodes of 8 ranks: tp 8 within a node, pp 16, dp the rest;
    two hot spares; a heartbeat a second, as such a run would have."""
    return parse_spec(
        {
            "name": f"large-{nodes}",
            "trainer": {
                "steps": 10_000_000,
                "checkpoint_every": 1000,
                "n_layers": 16,
                "n_heads": 8,
                "global_batch": 1024,
            },
            "layout": {"dp": max(1, nodes // 16), "pp": min(16, nodes), "tp": 8, "ranks_per_node": RANKS_PER_NODE},
            "cluster": {"active_nodes": nodes, "spare_nodes": 2, **(backend or {})},
            "recovery": {
                "heartbeat_interval_seconds": 1.0,
                "hang_after_seconds": 300,
                "startup_grace_seconds": 300,
                "progress_every_seconds": 60,
                "max_incidents": 100,
            },
        }
    )


def median_ms(values) -> float:
    return round(statistics.median(values) * 1000, 1)


def measure_looks(cluster: SimulatedCluster, run_id: str, incarnation: int, spec) -> list[float]:
    """LOOKS timed looks at a training incarnation, as detect takes them (activities/running.py look)."""
    seconds = []
    for _ in range(LOOKS):
        started = time.perf_counter()
        verdict, _ = look(cluster, run_id, incarnation, spec.recovery, time.time(), spec.trainer.steps)
        seconds.append(time.perf_counter() - started)
        if verdict.fault is not None:
            raise SystemExit(f"large_run: a look at the healthy run found a fault: {verdict.fault.reason}")
        time.sleep(0.1)
    return seconds


def first_steps(cluster: SimulatedCluster, run_id: str, incarnation: int, timeout: float = 300.0) -> None:
    """Wait until every rank of the incarnation reports a step (what the status learns only at
    the next progress report)."""
    deadline = time.monotonic() + timeout
    while not all(r.heartbeat and r.heartbeat.step for r in cluster.observe(run_id, incarnation).ranks):
        if time.monotonic() > deadline:
            raise SystemExit(f"large_run: run {run_id}: no step within {timeout:g} s")
        time.sleep(0.2)


async def wait_for(client, run_id: str, done, what: str, timeout: float = 900.0):
    """Poll the run's status until `done(status)`; SystemExit when it fails or the time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = await run_status(client, run_id)
        if status.state in (RunState.FAILED, RunState.ABORTED):
            raise SystemExit(f"large_run: run {run_id} ended {status.state.value}: {status.reason}")
        if done(status):
            return status
        await asyncio.sleep(0.5)
    raise SystemExit(f"large_run: run {run_id}: no {what} within {timeout:g} s")


async def one_size(env, home: Path, nodes: int, faults: int, say) -> dict:
    """One simulated run of `nodes` nodes: its looks, `faults` recoveries, its histories."""
    cluster = SimulatedCluster(home, steps_per_second=2.0, startup_seconds=1.0, report_seconds=1.0)
    rng = random.Random(nodes)
    spec, run_id = large_spec(nodes), f"large-{nodes}"
    settings = Settings(task_queue=f"large-{nodes}")
    try:
        async with build_worker(env.client, settings.task_queue, cluster):
            started = time.monotonic()
            await start_run(env.client, settings, spec, run_id)
            status = await wait_for(env.client, run_id, lambda s: s.state == RunState.TRAINING, "launch")
            await asyncio.to_thread(first_steps, cluster, run_id, status.assignment.incarnation)
            say(f"{nodes} nodes: training after {time.monotonic() - started:.1f} s; timing looks")
            looks = await asyncio.to_thread(measure_looks, cluster, run_id, status.assignment.incarnation, spec)
            killed = []
            for number in range(1, faults + 1):
                node = rng.choice(status.assignment.nodes)
                killed.append(node)
                await asyncio.to_thread(cluster.kill_node, run_id, node)
                status = await wait_for(
                    env.client,
                    run_id,
                    lambda s, n=number: s.incident_count >= n and s.incidents[-1].outcome == "recovered",
                    f"recovery {number}",
                )
                say(f"{nodes} nodes: incident {number} ({node}) recovered")
            histories = await chain_histories(env.client, run_id)
            logging.getLogger("temporalio").setLevel(logging.CRITICAL)
            await env.client.get_workflow_handle(run_id).terminate("benchmark done")
    finally:
        cluster.close()
    decisions, launches = [], []
    for incident in status.incidents:
        decided = incident.stages["reschedule"].ended_at
        decisions.append((decided - incident.fault.detected_at).total_seconds())
        launched = cluster.launches_done[(run_id, incident.new_assignment.incarnation)]
        launches.append(launched - decided.timestamp())
    payloads: dict[str, int] = {}
    for events in histories:
        for label, size in largest_payloads(events).items():
            payloads[label] = max(payloads.get(label, 0), size)
    largest = max(payloads, key=payloads.get)
    spans = [span for events in histories for span in incident_spans(events)]
    return {
        "nodes": nodes,
        "ranks": nodes * RANKS_PER_NODE,
        "look_ms": median_ms(looks),
        "report_to_decision_ms": median_ms(decisions),
        "decision_to_launch_ms": median_ms(launches),
        "largest_payload_bytes": payloads[largest],
        "largest_payload": largest,
        "events_per_incident": max(spans) if spans else None,
        "payloads": payloads,
        "killed": killed,
        "replacements": [incident.decision.replacements for incident in status.incidents],
        # The controller's share of each stage the planner costs (lazarus/planner/model.py StageCosts).
        "stage_seconds": {
            name: round(statistics.median(i.stages[name].seconds for i in status.incidents), 3)
            for name in ("drain", "reschedule", "replace_or_reshard")
        },
    }


async def bench(sizes, faults: int, kubernetes_nodes: int, qps: float, burst: int, say) -> dict:
    rows, kubernetes = [], None
    env = await local_environment(runtime=quiet_runtime())
    try:
        for nodes in sizes:
            with tempfile.TemporaryDirectory() as home:
                rows.append(await one_size(env, Path(home), nodes, faults, say))
    finally:
        await env.shutdown()
    if kubernetes_nodes:
        from bench.large_kubernetes import emulated_pool

        with tempfile.TemporaryDirectory() as home:
            kubernetes = await asyncio.to_thread(emulated_pool, Path(home), kubernetes_nodes, qps, burst, say)
    return {"simulated": rows, "kubernetes": kubernetes}


COLUMNS = ("look_ms", "report_to_decision_ms", "decision_to_launch_ms", "largest_payload_bytes", "events_per_incident")


def plot(rows: list[dict], path: str) -> None:
    """Each figure against the node count, on log-log axes, with a line of slope 1 for scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(COLUMNS), figsize=(4 * len(COLUMNS), 3.4))
    nodes = [r["nodes"] for r in rows]
    for axis, column in zip(axes, COLUMNS, strict=True):
        values = [r[column] for r in rows]
        axis.loglog(nodes, values, "o-", label="measured")
        axis.loglog(nodes, [values[0] * n / nodes[0] for n in nodes], ":", color="grey", label="linear from the first")
        axis.set_title(column.replace("_", " "), fontsize=9)
        axis.set_xlabel("nodes (x 8 ranks)")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default=",".join(map(str, SIZES)), help="run sizes, comma-separated (nodes)")
    parser.add_argument("--faults", type=int, default=3, help="nodes killed per run, one after another (default 3)")
    parser.add_argument("--kubernetes-nodes", type=int, default=2048, help="emulated pool size; 0 skips it")
    parser.add_argument("--qps", type=float, default=50.0, help="Kubernetes client requests per second (default 50)")
    parser.add_argument("--burst", type=int, default=100, help="Kubernetes client burst (default 100)")
    parser.add_argument("--plot", metavar="FILE", help="write each figure against the node count as a PNG")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    perf_page.add_option(parser, __file__)
    args = parser.parse_args()
    try:
        sizes = [int(n) for n in args.nodes.split(",")]
    except ValueError:
        parser.error(f"--nodes: {args.nodes!r} is not a comma-separated list of node counts")
    if any(n < 16 or n % 16 for n in sizes):
        parser.error("--nodes: each size must be a multiple of 16 (pp 16)")
    if args.faults < 1 or args.kubernetes_nodes < 0 or args.qps <= 0 or args.burst < 1:
        parser.error("--faults, --qps and --burst must be positive, --kubernetes-nodes at least 0")
    sitting = perf_page.begin()
    started = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    result = asyncio.run(bench(sizes, args.faults, args.kubernetes_nodes, args.qps, args.burst, say))
    if args.plot:
        plot(result["simulated"], args.plot)
    if args.markdown:
        write_markdown(args, sitting, result)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print("\nOne run on the simulated backend (real dev server, worker and activities)")
    print(
        f"{'nodes':>6} {'ranks':>6} {'look ms':>8} {'report->decision ms':>20} {'decision->launch ms':>20} "
        f"{'largest payload':>26} {'events/incident':>16}"
    )
    for r in result["simulated"]:
        payload = f"{r['largest_payload_bytes']:,} B ({r['largest_payload'].split()[0]})"
        print(
            f"{r['nodes']:>6} {r['ranks']:>6} {r['look_ms']:>8} {r['report_to_decision_ms']:>20} "
            f"{r['decision_to_launch_ms']:>20} {payload:>26} {r['events_per_incident']:>16}"
        )
    if result["kubernetes"]:
        k = result["kubernetes"]
        print(
            f"\nKubernetes backend against the emulator: {k['nodes']} nodes, "
            f"client at {k['qps']:g} QPS, burst {k['burst']}"
        )
        for name, step in k["steps"].items():
            print(f"  {name:<40} {step['seconds']:8.2f} s  {step['requests']:6} requests  {step['per_second']:7.1f}/s")


def write_markdown(args, sitting, result: dict) -> None:
    rows = [
        [
            r["nodes"],
            r["ranks"],
            r["look_ms"],
            r["report_to_decision_ms"],
            r["decision_to_launch_ms"],
            f"{r['largest_payload_bytes']:,} B ({r['largest_payload'].split()[0]})",
            r["events_per_incident"],
        ]
        for r in result["simulated"]
    ]
    headers = ["nodes", "ranks", "look ms", "report->decision ms", "decision->launch ms", "largest payload"]
    tables = [
        perf_page.Table(
            [*headers, "events/incident"],
            rows,
            f"One run on the simulated backend (real dev server, worker and activities), {args.faults} fault(s) each",
        )
    ]
    if result["kubernetes"]:
        from bench.large_kubernetes import pool_table

        tables.append(pool_table(result["kubernetes"]))
    perf_page.write_page(args.markdown, sitting, title=PAGE_TITLE, doc=__doc__, about=ABOUT, tables=tables)


if __name__ == "__main__":
    from lazarus.client.runs import exit_after

    exit_after(main)  # past the native client's crash at interpreter exit
