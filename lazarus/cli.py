"""The `lazarus` command: server, worker, runs, chaos and the demo."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
from datetime import datetime

from lazarus.config import HELP as ENV_HELP
from lazarus.config import Settings


class UserError(Exception):
    """A mistake of the user's: printed as one line, exit code 2."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lazarus",
        description="Training runs that survive a dead node: each run is a durable Temporal workflow "
        "whose activities detect, drain, reschedule, replace and resume.",
        epilog=ENV_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    server = commands.add_parser(
        "server", help="run the Temporal dev server (127.0.0.1, web UI, SQLite under LAZARUS_HOME)"
    )
    server.add_argument(
        "--port", type=int, default=None, help="gRPC port (default: the port of LAZARUS_TEMPORAL_ADDRESS, 7233)"
    )
    server.add_argument("--ui-port", type=int, default=None, help="web UI port (default: gRPC port + 1000)")
    mode = server.add_mutually_exclusive_group()
    mode.add_argument("--detach", action="store_true", help="start it in the background and return")
    mode.add_argument("--stop", action="store_true", help="stop a server started with --detach (or by the demo)")

    worker = commands.add_parser("worker", help="run the Lazarus worker (workflow and activities) until Ctrl-C")
    worker.add_argument(
        "--backend",
        choices=["local", "kubernetes"],
        default=os.environ.get("LAZARUS_BACKEND", "local"),
        help="cluster the activities drive: local rank processes, or pods through the Kubernetes API "
        "(in-cluster service account, else ~/.kube/config) (default: LAZARUS_BACKEND, else local)",
    )
    worker.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ.get("LAZARUS_METRICS_PORT", "0")) or None,
        help="serve Prometheus metrics on ADDRESS:PORT/metrics (default: LAZARUS_METRICS_PORT, else off)",
    )
    worker.add_argument(
        "--metrics-address",
        default=os.environ.get("LAZARUS_METRICS_ADDRESS", "127.0.0.1"),
        help="address the metrics server binds: 0.0.0.0 in a pod, so that Prometheus can scrape it "
        "(default: LAZARUS_METRICS_ADDRESS, else 127.0.0.1)",
    )

    run = commands.add_parser("run", help="start, list, watch, steer and report runs")
    run_commands = run.add_subparsers(dest="run_command", required=True, metavar="ACTION")
    start = run_commands.add_parser("start", help="start a run from a YAML spec")
    start.add_argument("spec", help="path of the run spec (YAML), e.g. examples/demo.yaml")
    start.add_argument("--run-id", help="run id, also the workflow id (default: <name>-<date>-<time>)")
    status = run_commands.add_parser("status", help="state, step, assignment and incidents of a run")
    status.add_argument("run_id", metavar="RUN")
    status.add_argument("--json", action="store_true", help="print the full status as JSON")
    listing = run_commands.add_parser("list", help="runs known to Temporal, newest first, with state and incidents")
    listing.add_argument("--state", help="only runs in this state, e.g. TRAINING (needs the search attributes)")
    listing.add_argument("--limit", type=int, default=50, help="at most this many (default 50)")
    watch = run_commands.add_parser(
        "watch", help="follow a run live: progress bar, state, incidents (Ctrl-C stops watching)"
    )
    watch.add_argument("run_id", metavar="RUN")
    logs = run_commands.add_parser("logs", help="the ranks' stdout and stderr (local backend: read from LAZARUS_HOME)")
    logs.add_argument("run_id", metavar="RUN")
    logs.add_argument("--node", help="only this node's ranks (default incarnation: the newest it ran in)")
    logs.add_argument("--incarnation", type=int, help="this incarnation (default: the newest)")
    logs.add_argument("--follow", action="store_true", help="keep printing until those ranks end (Ctrl-C stops)")
    report = run_commands.add_parser(
        "report", help="what elasticity cost this run: stage table, ETTR, lost steps, timeline"
    )
    report.add_argument("run_id", metavar="RUN")
    report.add_argument("--plot", metavar="FILE", help="write the timeline as a PNG")
    report.add_argument("--json", action="store_true", help="print the summary as JSON")
    for name, helptext in (
        ("pause", "checkpoint, stop the ranks, hold the nodes"),
        ("resume", "continue a paused run on the nodes it held"),
        ("abort", "stop the run cleanly; the newest checkpoint is kept"),
    ):
        command = run_commands.add_parser(name, help=helptext)
        command.add_argument("run_id", metavar="RUN")
        command.add_argument("--reason", default="", help="why (recorded in the run's history)")
    drain = run_commands.add_parser("drain-node", help="treat a node as faulty: the same recovery as a detected fault")
    drain.add_argument("run_id", metavar="RUN")
    drain.add_argument("node", metavar="NODE")
    drain.add_argument("--reason", default="", help="why (recorded on the incident)")
    back_node = run_commands.add_parser("return-node", help="a repaired node rejoins the run's spare pool")
    back_node.add_argument("run_id", metavar="RUN")
    back_node.add_argument("node", metavar="NODE")
    reshard = run_commands.add_parser("reshard", help="run at DP replicas: checkpoint, stop, re-plan, resume")
    reshard.add_argument("run_id", metavar="RUN")
    reshard.add_argument("dp", type=int, metavar="DP")
    approve = run_commands.add_parser("approve", help="answer an escalation (state WAITING_FOR_APPROVAL)")
    approve.add_argument("run_id", metavar="RUN")
    approve.add_argument("action", choices=["reshard-below-minimum", "wait-longer"])
    approve.add_argument(
        "--wait-seconds", type=float, default=600.0, help="with wait-longer: how much longer (default 600)"
    )
    policy = run_commands.add_parser(
        "set-policy", help="change recovery policy fields, e.g. hang_after_seconds=60 stages.drain.max_attempts=9"
    )
    policy.add_argument("run_id", metavar="RUN")
    policy.add_argument("changes", nargs="+", metavar="FIELD=VALUE")

    chaos = commands.add_parser("chaos", help="break things on purpose (local backend)")
    chaos_commands = chaos.add_subparsers(dest="chaos_command", required=True, metavar="ACTION")
    kill = chaos_commands.add_parser("kill-node", help="SIGKILL every process of a node and mark it dead")
    kill.add_argument("run_id", metavar="RUN")
    kill.add_argument("node", metavar="NODE", help="node name, e.g. node-2")
    back = chaos_commands.add_parser("return-node", help="return a repaired node to the pool as a healthy spare")
    back.add_argument("run_id", metavar="RUN")
    back.add_argument("node", metavar="NODE")

    simulate = commands.add_parser(
        "simulate",
        help="Monte Carlo planner: what elasticity costs a large cluster, per recovery policy",
        description="Simulate a long run on a large cluster under each recovery policy: ETTR, goodput, "
        "lost GPU-hours by cause, the best checkpoint interval and the spares needed.",
    )
    simulate.add_argument("scenario", nargs="?", metavar="SCENARIO.yaml", help="scenario file (see schema/scenario.py)")
    simulate.add_argument("--preset", help="a built-in scenario: llama3-405b, human-vs-automatic")
    simulate.add_argument(
        "--costs",
        metavar="FILE",
        help="stage costs measured on real runs: `lazarus run status --json` output (one status or a list)",
    )
    simulate.add_argument(
        "--repetitions", type=int, help="Monte Carlo repetitions per policy (default: the scenario's)"
    )
    simulate.add_argument("--json", action="store_true", help="print the results as one JSON object")
    simulate.add_argument(
        "--plot", metavar="FILE", help="write a PNG: ETTR against checkpoint interval, lost GPU-hours by cause"
    )

    demo = commands.add_parser(
        "demo", help="server, worker, a real run, a node killed mid-run, automatic recovery, its cost"
    )
    demo.add_argument(
        "--spec", help="run spec (default: examples/demo.yaml; examples/dp2-pp2.yaml for pipeline replicas)"
    )
    demo.add_argument(
        "--spares",
        type=int,
        metavar="N",
        help="hot spares, overriding the spec's cluster.spare_nodes (0: the run reshards to fewer replicas)",
    )
    fault = demo.add_mutually_exclusive_group()
    fault.add_argument(
        "--kill-at-step", type=int, metavar="N", help="kill a node once the run reaches step N (default: mid-run)"
    )
    fault.add_argument("--no-fault", action="store_true", help="kill nothing (the reference run)")
    demo.add_argument("--json", action="store_true", help="print the final status as JSON (progress goes to stderr)")
    return parser


def _load(path: str):
    from lazarus.schema.load import SpecError, load_spec

    try:
        return load_spec(path)
    except SpecError as error:
        raise UserError(str(error)) from None


async def _client(settings: Settings):
    from lazarus.client import connect

    try:
        return await connect(settings)
    except RuntimeError as error:
        cause = "connection refused" if "Connection refused" in str(error) else str(error).splitlines()[0][:160]
        raise UserError(
            f"cannot reach Temporal at {settings.address} ({cause}); "
            f"start one with `lazarus server` or set LAZARUS_TEMPORAL_ADDRESS"
        ) from None


def _server(args, settings: Settings) -> int:
    from lazarus.infra.temporal_server import (
        ServerError,
        dev_server_command,
        port_answers,
        split_address,
        start_detached,
        stop_detached,
    )

    if args.stop:
        pid = stop_detached(settings.home)
        print("no detached server recorded" if pid is None else f"stopped the Temporal dev server (pid {pid})")
        return 0
    port = args.port or split_address(settings.address)[1]
    ui_port = args.ui_port or port + 1000
    if port_answers("127.0.0.1", port):
        raise UserError(
            f"something already listens on 127.0.0.1:{port}; is a server running? (`lazarus server --stop`)"
        )
    settings.home.mkdir(parents=True, exist_ok=True)
    try:
        if args.detach:
            pid = start_detached(settings.home, port, ui_port)
            print(f"Temporal dev server pid {pid}: gRPC 127.0.0.1:{port}, web UI http://127.0.0.1:{ui_port}")
            return 0
        command = dev_server_command(settings.home / "temporal.db", port, ui_port)
    except ServerError as error:
        raise UserError(str(error)) from None
    print(
        f"Temporal dev server: gRPC 127.0.0.1:{port}, web UI http://127.0.0.1:{ui_port}, "
        f"state {settings.home / 'temporal.db'} (Ctrl-C stops)",
        flush=True,
    )
    server = subprocess.Popen(command)
    try:
        return server.wait()
    except KeyboardInterrupt:
        # Let the server close its SQLite file cleanly rather than killing it.
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
        return 0


async def _worker(args, settings: Settings) -> int:
    from lazarus.activities.failpoints import Failpoints
    from lazarus.activities.metrics import Metrics
    from lazarus.infra.local import LocalCluster
    from lazarus.worker import build_worker, count_runs_by_state, serve, serve_metrics

    client = await _client(settings)
    metrics = Metrics()
    if args.backend == "kubernetes":
        from lazarus.infra.kubernetes import KubernetesCluster

        try:
            cluster = KubernetesCluster(settings.home)
        except Exception as error:  # noqa: BLE001 - no kubeconfig, no service account: say so, no traceback
            raise UserError(f"--backend kubernetes: cannot reach a Kubernetes API ({error})") from None
    else:
        cluster = LocalCluster(settings.home)
    worker = build_worker(client, settings.task_queue, cluster, Failpoints.from_environ(), metrics)
    counter = None
    if args.metrics_port:
        try:
            serve_metrics(args.metrics_port, metrics, args.metrics_address)
        except OSError as error:
            raise UserError(
                f"--metrics-port {args.metrics_port} on {args.metrics_address}: {error.strerror or error}"
            ) from None
        counter = asyncio.ensure_future(count_runs_by_state(client, metrics))
    print(
        f"worker pid {os.getpid()} ({args.backend} backend) on task queue {settings.task_queue!r} at {settings.address}, "
        f"runs under {settings.home.resolve() / 'runs'}"
        + (f", metrics on http://{args.metrics_address}:{args.metrics_port}/metrics" if args.metrics_port else ""),
        flush=True,
    )
    try:
        await serve(worker, counter)
    finally:
        cluster.close()
    return 0


async def _run(args, settings: Settings) -> int:
    from temporalio.client import WorkflowQueryFailedError
    from temporalio.service import RPCError

    from lazarus.client import run_status, start_run

    if args.run_command == "start":
        from lazarus.activities.recovery import missing_command

        spec = _load(args.spec)
        if missing_command(spec.trainer.command):
            raise UserError(missing_command(spec.trainer.command))
        run_id = args.run_id or f"{spec.name}-{datetime.now():%Y%m%d-%H%M%S}"
        client = await _client(settings)
        try:
            await start_run(client, settings, spec, run_id)
        except RPCError as error:
            raise UserError(f"cannot start run {run_id}: {error.message}") from None
        print(f"started run {run_id}\n  status: lazarus run status {run_id}\n  web UI: {settings.workflow_url(run_id)}")
        return 0

    if args.run_command == "logs":
        from lazarus.infra.local import LocalCluster
        from lazarus.logs import LogsError, select, show

        run = LocalCluster(settings.home).run_dir(args.run_id)
        try:
            selected = select(run, args.node, args.incarnation)
        except LogsError as error:
            raise UserError(f"logs of {args.run_id}: {error}") from None
        await asyncio.to_thread(show, run, selected, args.follow)
        return 0
    client = await _client(settings)
    if args.run_command == "list":
        return await _list(client, args)
    if args.run_command in UPDATES:
        return await _update(client, args)

    async def current():
        try:
            return await run_status(client, args.run_id)
        except RPCError as error:
            raise UserError(f"no status for run {args.run_id}: {error.message}") from None
        except WorkflowQueryFailedError as error:
            raise UserError(
                f"run {args.run_id} did not answer: {error}; is a worker running (`lazarus worker`)?"
            ) from None

    if args.run_command == "watch":
        return await _watch(current)
    status = await current()
    if args.run_command == "report":
        from lazarus.report import plot_timeline, report_text, summarize

        try:
            summary = summarize(status)
        except ValueError as error:
            raise UserError(str(error)) from None
        if args.plot:
            plot_timeline(status, summary, args.plot)
        print(json.dumps(summary, indent=2) if args.json else report_text(status, summary))
        if args.plot and not args.json:
            print(f"\nTimeline: {args.plot}")
        return 0
    if args.json:
        print(json.dumps(status.summary(), indent=2))
        return 0
    from lazarus.report import stage_table

    assignment = status.assignment
    print(
        f"run {status.run_id}: {status.state.value}, step {status.step}/{status.total_steps}, "
        f"layout dp={status.layout.dp} pp={status.layout.pp} tp={status.layout.tp}"
    )
    if assignment:
        print(f"incarnation {assignment.incarnation} on {', '.join(assignment.nodes)}")
    if status.reason:
        print(f"reason: {status.reason}")
    print(stage_table(status))
    return 0


UPDATES = {
    "pause": "pause",
    "resume": "resume",
    "abort": "abort",
    "drain-node": "drain_node",
    "return-node": "return_node",
    "reshard": "reshard",
    "approve": "approve",
    "set-policy": "set_policy",
}


def _policy_changes(pairs: list[str]) -> dict:
    """FIELD=VALUE pairs (dotted fields nest, values are YAML scalars) as a nested dict."""
    import yaml

    changes: dict = {}
    for pair in pairs:
        field, sep, value = pair.partition("=")
        if not sep or not field:
            raise UserError(f"set-policy: {pair!r} is not FIELD=VALUE (e.g. hang_after_seconds=60)")
        *path, last = field.split(".")
        target = changes
        for part in path:
            target = target.setdefault(part, {})
        target[last] = yaml.safe_load(value)
    return changes


async def _update(client, args) -> int:
    from temporalio.client import WorkflowUpdateFailedError
    from temporalio.service import RPCError

    from lazarus.schema import controls
    from lazarus.workflows.training_run import TrainingRun

    command = args.run_command
    if command == "approve":
        request = controls.ApproveRequest(action=args.action.replace("-", "_"), wait_seconds=args.wait_seconds)
    elif command == "set-policy":
        request = controls.SetPolicyRequest(changes=_policy_changes(args.changes))
    elif command == "reshard":
        request = controls.ReshardRequest(dp=args.dp)
    elif command in ("drain-node", "return-node"):
        model = controls.DrainNodeRequest if command == "drain-node" else controls.ReturnNodeRequest
        request = model(node=args.node, **({"reason": args.reason} if command == "drain-node" else {}))
    else:
        model = {"pause": controls.PauseRequest, "resume": controls.ResumeRequest, "abort": controls.AbortRequest}
        request = model[command](reason=args.reason)
    update = getattr(TrainingRun, UPDATES[args.run_command])
    try:
        answer = await client.get_workflow_handle(args.run_id).execute_update(update, request)
    except WorkflowUpdateFailedError as error:
        cause = error.cause
        raise UserError(f"{args.run_command} refused: {getattr(cause, 'message', None) or cause}") from None
    except RPCError as error:
        raise UserError(f"{args.run_command}: run {args.run_id}: {error.message}") from None
    print(f"{answer.message} (state {answer.state})")
    return 0


async def _list(client, args) -> int:
    query = "WorkflowType='TrainingRun'" + (f" AND LazarusState='{args.state.upper()}'" if args.state else "")
    print(f"{'run':<36}{'workflow':<12}{'state':<22}{'incidents':>10}  started")
    count = 0
    try:
        async for execution in client.list_workflows(query, limit=args.limit):
            attributes = execution.search_attributes
            state = (attributes.get("LazarusState") or ["-"])[0]
            incidents = (attributes.get("LazarusIncidents") or ["-"])[0]
            print(
                f"{execution.id:<36}{execution.status.name.lower():<12}{state:<22}{incidents!s:>10}  "
                f"{execution.start_time:%Y-%m-%d %H:%M:%S}"
            )
            count += 1
    except Exception as error:  # noqa: BLE001 - a bad query is the user's: say it in one line
        raise UserError(f"cannot list runs: {str(error).splitlines()[0]}") from None
    if not count:
        print("(no runs)")
    return 0


async def _watch(current) -> int:
    terminal = {"COMPLETED", "FAILED", "ABORTED"}
    last_state, incidents = None, 0
    while True:
        status = await current()
        state = status.state.value
        if state != last_state and last_state is not None:
            print()
        if len(status.incidents) > incidents:
            incident = status.incidents[-1]
            print(
                f"\nincident {incident.number}: {incident.fault.kind} on {', '.join(incident.fault.nodes)} "
                f"at step {incident.fault.step}"
            )
            incidents = len(status.incidents)
        width = 30
        done = int(width * status.step / status.total_steps)
        print(
            f"\r[{'#' * done}{'.' * (width - done)}] {status.step}/{status.total_steps} {state:<22}"
            f"incarnation {status.assignment.incarnation if status.assignment else '-'}",
            end="",
            flush=True,
        )
        last_state = state
        if state in terminal:
            print(f"\n{state}" + (f": {status.reason}" if status.reason else ""))
            return 0 if state == "COMPLETED" else 1
        await asyncio.sleep(0.5)


def _chaos(args, settings: Settings) -> int:
    from lazarus.infra.local import ClusterError, LocalCluster

    cluster = LocalCluster(settings.home)
    try:
        if args.chaos_command == "kill-node":
            pids = cluster.kill_node(args.run_id, args.node)
            print(f"killed {args.node} of run {args.run_id} (pids: {', '.join(map(str, pids)) or 'none alive'})")
        else:
            cluster.return_node(args.run_id, args.node)
            print(f"{args.node} of run {args.run_id} is a healthy spare again")
    except ClusterError as error:
        raise UserError(str(error)) from None
    return 0


def _simulate(args) -> int:
    from lazarus.simulate import PlanError, load_scenario, measured_costs, plan, plot, report

    try:
        scenario = load_scenario(args.scenario, args.preset)
        if args.costs:
            scenario = scenario.model_copy(
                update={"costs": scenario.costs.model_copy(update=measured_costs(args.costs))}
            )
        if args.repetitions is not None and args.repetitions < 2:
            raise PlanError(f"--repetitions {args.repetitions}: use at least 2 (for a confidence band)")
    except PlanError as error:
        raise UserError(str(error)) from None
    result = plan(scenario, args.repetitions)
    if args.plot:
        plot(result, args.plot)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(report(result))
        if args.plot:
            print(f"\nPlot: {args.plot}")
    return 0


async def _demo(args, settings: Settings) -> int:
    from lazarus.demo import DEFAULT_SPEC, DemoError, default_kill_step, run_demo

    spec = _load(args.spec or DEFAULT_SPEC)
    if args.spares is not None:
        from lazarus.schema.load import SpecError, parse_spec

        data = spec.model_dump(mode="json")
        data["cluster"]["spare_nodes"] = args.spares
        try:
            spec = parse_spec(data)
        except SpecError as error:
            raise UserError(f"--spares {args.spares}: {error}") from None
    kill_at = None if args.no_fault else (args.kill_at_step or default_kill_step(spec))
    try:
        return await run_demo(settings, spec, kill_at, args.json)
    except DemoError as error:
        raise UserError(str(error)) from None


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `lazarus` console script."""
    args = _parser().parse_args(argv)
    settings = Settings.from_environ()
    code = 1
    try:
        if args.command == "server":
            code = _server(args, settings)
        elif args.command == "chaos":
            code = _chaos(args, settings)
        elif args.command == "simulate":
            code = _simulate(args)
        else:
            handler = {"worker": _worker, "run": _run, "demo": _demo}[args.command]
            code = asyncio.run(handler(args, settings))
    except UserError as error:
        print(f"lazarus: error: {error}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    sys.stdout.flush()
    sys.stderr.flush()
    # End explicitly: Temporal's native client can crash at interpreter exit
    # (sdk-python#300), which would turn a clean run into a failed exit status.
    os._exit(code)


if __name__ == "__main__":
    main()
