"""`lazarus worker`: the TrainingRun workflow and the recovery activities, until Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import os

from lazarus.client import config
from lazarus.client.config import Settings
from lazarus.commands.common import UserError, connect_client, open_cluster
from lazarus.infra import registry


def register(commands: argparse._SubParsersAction) -> None:
    """Add `worker` to the top-level commands."""
    worker = commands.add_parser("worker", help="run the Lazarus worker (workflow and activities) until Ctrl-C")
    worker.add_argument(
        "--backend",
        choices=registry.names(),
        default=os.environ.get(config.ENV_BACKEND, registry.DEFAULT_BACKEND),
        help=f"cluster the activities drive: {registry.summaries()} (default: LAZARUS_BACKEND, else "
        f"{registry.DEFAULT_BACKEND})",
    )
    worker.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ.get(config.ENV_METRICS_PORT, "0")) or None,
        help="serve Prometheus metrics on ADDRESS:PORT/metrics (default: LAZARUS_METRICS_PORT, else off)",
    )
    worker.add_argument(
        "--metrics-address",
        default=os.environ.get(config.ENV_METRICS_ADDRESS, "127.0.0.1"),
        help="address the metrics server binds: 0.0.0.0 in a pod, so that Prometheus can scrape it "
        "(default: LAZARUS_METRICS_ADDRESS, else 127.0.0.1)",
    )
    worker.add_argument(
        "--kube-qps",
        type=float,
        default=os.environ.get(config.ENV_KUBE_QPS, "100"),
        help="Kubernetes API requests a second the backend makes at most (default: LAZARUS_KUBE_QPS, else 100)",
    )
    worker.add_argument(
        "--kube-burst",
        type=int,
        default=os.environ.get(config.ENV_KUBE_BURST, "200"),
        help="Kubernetes API requests the backend makes at once before --kube-qps paces it "
        "(default: LAZARUS_KUBE_BURST, else 200)",
    )
    worker.add_argument(
        "--sandbox",
        action="store_true",
        help="run workflow code in Temporal's sandbox, which refuses non-deterministic calls: for "
        "developing the workflow (it costs a burst of faults about a fifth of the worker's CPU)",
    )
    worker.set_defaults(handler=work)


def _cluster(args: argparse.Namespace, settings: Settings):
    if not args.kube_qps > 0 or args.kube_burst < 1:
        raise UserError("--kube-qps must be positive and --kube-burst at least 1")
    return open_cluster(args.backend, settings, kube_qps=args.kube_qps, kube_burst=args.kube_burst)


async def work(args: argparse.Namespace, settings: Settings) -> int:
    """Serve the task queue until SIGINT or SIGTERM, with Prometheus metrics when asked."""
    from lazarus.activities.failpoints import Failpoints
    from lazarus.activities.metrics import Metrics
    from lazarus.worker import build_worker, count_runs_by_state, serve, serve_metrics, time_the_loop
    from lazarus.workflows.watch import watch_queue

    client = await connect_client(settings)
    metrics = Metrics()
    cluster = _cluster(args, settings)
    worker = build_worker(
        client, settings.task_queue, cluster, Failpoints.from_environ(), metrics, sandboxed=args.sandbox
    )
    helpers = []
    if args.metrics_port:
        try:
            serve_metrics(args.metrics_port, metrics, args.metrics_address)
        except OSError as error:
            raise UserError(
                f"--metrics-port {args.metrics_port} on {args.metrics_address}: {error.strerror or error}"
            ) from None
        helpers = [
            asyncio.ensure_future(count_runs_by_state(client, metrics)),
            asyncio.ensure_future(time_the_loop(metrics)),
        ]
    metrics_url = f", metrics on http://{args.metrics_address}:{args.metrics_port}/metrics" if args.metrics_port else ""
    print(
        f"worker pid {os.getpid()} ({args.backend} backend) on task queue {settings.task_queue!r} "
        f"(its runs' watches on {watch_queue(settings.task_queue)!r}) "
        f"at {settings.address}, runs under {settings.runs_folder.resolve()}{metrics_url}",
        flush=True,
    )
    try:
        await serve(worker, *helpers)
    finally:
        cluster.close()
    return 0
