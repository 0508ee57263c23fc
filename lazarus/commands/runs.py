"""`lazarus run start|adopt|status|list|watch|logs|report`: start or adopt a run, and read what it did."""

from __future__ import annotations

import argparse
import asyncio
from datetime import datetime

from lazarus.client.config import Settings
from lazarus.commands.common import (
    RUN_HELP,
    UserError,
    connect_client,
    load_run_spec,
    local_cluster,
    node_name,
    positive_int,
    registered_backend,
    run_id,
)

TERMINAL_STATES = ("COMPLETED", "FAILED", "ABORTED")


def register(run_commands: argparse._SubParsersAction) -> None:
    """Add start, status, list, watch, logs and report to `lazarus run`."""
    start = run_commands.add_parser("start", help="start a run from a YAML spec")
    start.add_argument("spec", help="path of the run spec (YAML), e.g. examples/demo.yaml")
    start.add_argument("--run-id", type=run_id, help="run id, also the workflow id (default: <name>-<date>-<time>)")
    start.set_defaults(handler=start_run)
    adopt = run_commands.add_parser(
        "adopt",
        help="drive a run whose workflow was terminated (its ranks train on) from a new workflow",
        description=(
            "A run's ranks keep training when its workflow is terminated, cancelled or times out: nothing watches "
            "them or recovers them. adopt starts a new workflow under the run's id that carries the ended "
            "workflow's status, takes the run over (recorded as an intervention and in the run directory's "
            "owner record) and takes it up as the cluster holds it."
        ),
    )
    adopt.add_argument("run_id", metavar="RUN", type=run_id, help=RUN_HELP)
    adopt.set_defaults(handler=adopt_run)
    status = run_commands.add_parser("status", help="state, step, assignment and incidents of a run")
    status.add_argument("run_id", metavar="RUN", type=run_id, help=RUN_HELP)
    status.add_argument("--json", action="store_true", help="print the full status as JSON")
    status.set_defaults(handler=show_status)
    listing = run_commands.add_parser("list", help="runs known to Temporal, newest first, with state and incidents")
    listing.add_argument(
        "--state", type=run_state, help="only runs in this state, e.g. TRAINING (needs the search attributes)"
    )
    listing.add_argument("--limit", type=positive_int, default=50, help="at most this many (default 50)")
    listing.set_defaults(handler=list_runs)
    watch = run_commands.add_parser(
        "watch", help="follow a run live: progress bar, state, incidents (Ctrl-C stops watching)"
    )
    watch.add_argument("run_id", metavar="RUN", type=run_id, help=RUN_HELP)
    watch.set_defaults(handler=watch_run)
    logs = run_commands.add_parser("logs", help="the ranks' stdout and stderr (local backend: read from LAZARUS_HOME)")
    logs.add_argument("run_id", metavar="RUN", type=run_id, help=RUN_HELP)
    logs.add_argument(
        "--node", type=node_name, help="only this node's ranks (default incarnation: the newest it ran in)"
    )
    logs.add_argument("--incarnation", type=int, help="this incarnation (default: the newest)")
    logs.add_argument("--follow", action="store_true", help="keep printing until those ranks end (Ctrl-C stops)")
    logs.set_defaults(handler=show_logs)
    report = run_commands.add_parser(
        "report", help="what elasticity cost this run: stage table, ETTR, lost steps, timeline"
    )
    report.add_argument("run_id", metavar="RUN", type=run_id, help=RUN_HELP)
    report.add_argument("--plot", metavar="FILE", help="write the timeline as a PNG")
    report.add_argument("--json", action="store_true", help="print the summary as JSON")
    report.set_defaults(handler=show_report)


def run_state(value: str) -> str:
    """argparse type of --state: a RunState's name (any case); it goes into a visibility query, so
    nothing else may."""
    from lazarus.schema.names import shown
    from lazarus.schema.records import RunState

    if value.upper() not in RunState.__members__:
        raise argparse.ArgumentTypeError(f"{shown(value)} is not a run state: {', '.join(RunState.__members__)}")
    return value.upper()


async def start_run(args: argparse.Namespace, settings: Settings) -> int:
    """Start a TrainingRun workflow from a spec; says how to follow it."""
    from temporalio.service import RPCError

    from lazarus.activities.preflight import missing_command, unkept_survivors
    from lazarus.client.runs import start_run
    from lazarus.schema.rundir import RunDir

    spec = load_run_spec(args.spec)
    run_id = args.run_id or f"{spec.name}-{datetime.now():%Y%m%d-%H%M%S}"
    work_dir = RunDir(settings.runs_folder / run_id).work_dir
    backend = registered_backend(spec.cluster.backend)
    missing = missing_command(spec.trainer, work_dir, backend.shares_host) or unkept_survivors(
        spec, backend.keeps_survivors
    )
    if missing:
        raise UserError(missing)
    client = await connect_client(settings)
    try:
        await start_run(client, settings, spec, run_id)
    except RPCError as error:
        raise UserError(f"cannot start run {run_id}: {error.message}") from None
    print(f"started run {run_id}\n  status: lazarus run status {run_id}\n  web UI: {settings.workflow_url(run_id)}")
    return 0


async def adopt_run(args: argparse.Namespace, settings: Settings) -> int:
    """Start a workflow that takes over a run whose workflow ended without ending it."""
    from temporalio.service import RPCError

    from lazarus.client.runs import NotAdoptable, adopt_run

    client = await connect_client(settings)
    try:
        _, carried = await adopt_run(client, settings, args.run_id)
    except NotAdoptable as error:
        raise UserError(str(error)) from None
    except RPCError as error:
        raise UserError(f"cannot adopt run {args.run_id}: {error.message}") from None
    print(
        f"adopted run {args.run_id} (it was {carried.state.value} at step {carried.progress}); the new workflow "
        f"takes it up where the cluster holds it\n  status: lazarus run status {args.run_id}\n"
        f"  web UI: {settings.workflow_url(args.run_id)}"
    )
    return 0


async def fetch_status(client, run_id: str, runs=None):
    """The run's status and where it was read (lazarus/client/reading.py): from its worker, else its
    result or its history; no such run, or a history this version cannot replay, in one line."""
    from temporalio.client import WorkflowQueryFailedError
    from temporalio.service import RPCError

    from lazarus.client.reading import read_status

    try:
        return await read_status(client, run_id, runs)
    except RPCError as error:
        raise UserError(f"no status for run {run_id}: {error.message}") from None
    except WorkflowQueryFailedError as error:
        raise UserError(f"run {run_id} did not answer its status query: {error}") from None
    except RuntimeError as error:
        raise UserError(str(error)) from None


def where_read(reading) -> str:
    """One line: where the status was read, and what the reader should know."""
    return f"read from {reading.source}" + (f"; {reading.note}" if reading.note else "")


def status_view(status, read_from: str = ""):
    """A run's state, step, layout and nodes as a two-column grid, then its incidents' stage tables."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from lazarus.commands.report import stage_tables

    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold")
    facts.add_column()
    layout, assignment = status.layout, status.assignment
    facts.add_row("run", status.run_id)
    facts.add_row("state", status.state.value)
    facts.add_row("step", status.progress)
    facts.add_row("layout", f"{layout.describe()} ({layout.ranks_per_node} rank(s) per node)")
    if assignment:
        facts.add_row("incarnation", f"{assignment.incarnation} on {', '.join(assignment.nodes)}")
    if status.reason:
        facts.add_row("reason", status.reason)
    for warning in status.warnings:
        facts.add_row("warning", Text(warning, style="yellow"))
    if read_from:
        facts.add_row("source", Text(read_from, style="dim"))
    return Group(facts, Text(""), stage_tables(status))


async def show_status(args: argparse.Namespace, settings: Settings) -> int:
    """Print a run's status: a grid and its stage tables, or with --json the full status."""
    from lazarus.console import stdout, stdout_reserved_for_json

    if args.json:
        with stdout_reserved_for_json() as emit:
            reading = await fetch_status(await connect_client(settings), args.run_id, settings.runs_folder)
            emit(reading.summary())
        return 0
    reading = await fetch_status(await connect_client(settings), args.run_id, settings.runs_folder)
    stdout.print(status_view(reading.status, where_read(reading)))
    return 0


async def show_report(args: argparse.Namespace, settings: Settings) -> int:
    """Print what elasticity cost a run (with --json its numbers); with --plot, draw its timeline."""
    from lazarus.commands.report import plot_timeline, run_report, summarize, with_archived
    from lazarus.console import stdout, stdout_reserved_for_json

    async def bill():
        reading = await fetch_status(await connect_client(settings), args.run_id, settings.runs_folder)
        status = with_archived(reading.status)
        try:
            summary = summarize(status)
        except ValueError as error:
            raise UserError(str(error)) from None
        if args.plot:
            plot_timeline(status, summary, args.plot)
        return status, summary, reading

    if args.json:
        with stdout_reserved_for_json() as emit:
            _, summary, reading = await bill()
            emit({**summary, "read_from": reading.source, "worker_serving": reading.served})
        return 0
    status, summary, reading = await bill()
    stdout.print(run_report(status, summary))
    if args.plot:
        stdout.print(f"\nTimeline: {args.plot}")
    stdout.print(f"\nStatus {where_read(reading)}", style="dim")
    return 0


async def list_runs(args: argparse.Namespace, settings: Settings) -> int:
    """A table of the runs Temporal knows, newest first: id, workflow status, state, incidents, start."""
    from temporalio.client import WorkflowExecutionStatus

    from lazarus.client.reading import ask_worker
    from lazarus.console import stdout, table

    client = await connect_client(settings)
    query = "WorkflowType='TrainingRun'" + (f" AND LazarusState='{args.state}'" if args.state else "")
    runs = table("run", "workflow", "state", "incidents", "worker", "started", right=("incidents",))
    served: dict[str, bool] = {}  # task queue -> a worker polls it
    try:
        async for execution in client.list_workflows(query, limit=args.limit):
            attributes = execution.search_attributes
            worker = "-"
            if execution.status == WorkflowExecutionStatus.RUNNING:
                if execution.task_queue not in served:  # asked of one running run of each task queue
                    answer, _ = await ask_worker(client, execution.id, execution.task_queue)
                    served[execution.task_queue] = answer is not None
                worker = "serving" if served[execution.task_queue] else "none"
            runs.add_row(
                execution.id,
                execution.status.name.lower() if execution.status else "-",
                str((attributes.get("LazarusState") or ["-"])[0]),
                str((attributes.get("LazarusIncidents") or ["-"])[0]),
                worker,
                f"{execution.start_time:%Y-%m-%d %H:%M:%S}",
            )
    except Exception as error:  # noqa: BLE001 - a bad query is the user's: say it in one line
        raise UserError(f"cannot list runs: {str(error).splitlines()[0]}") from None
    stdout.print(runs if runs.row_count else "(no runs)")
    idle = sorted(queue for queue, up in served.items() if not up)
    if idle:
        stdout.print(
            f"No worker is serving task queue {', '.join(map(repr, idle))}: the runs on it are not watched "
            "(start one with `lazarus worker`; `lazarus run status` still reads them)."
        )
    return 0


async def watch_run(args: argparse.Namespace, settings: Settings) -> int:
    """Follow a run until it ends; exit 0 if it completed, 1 if it failed or was aborted."""
    from lazarus.console import stdout

    client = await connect_client(settings)

    async def current():
        return (await fetch_status(client, args.run_id, settings.runs_folder)).status

    return await follow(current, stdout)


async def follow(current, console, poll_seconds: float = 0.5) -> int:
    """Poll `current()` (a run's status) until the run ends: a live progress bar, a line for each
    state it enters and each incident, and at the end the state it ended in; returns 0 if it
    completed, else 1."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("{task.fields[state]:<22}"),
        BarColumn(bar_width=30),
        MofNCompleteColumn(),
        TextColumn("incarnation {task.fields[incarnation]}"),
        TimeElapsedColumn(),
    )
    last_state, incidents, task = None, 0, None
    with Progress(*columns, console=console) as progress:
        while True:
            status = await current()
            state = status.state.value
            incarnation = status.assignment.incarnation if status.assignment else "-"
            if task is None:
                total = status.total_steps if status.steps_from == "trainer" else None
                task = progress.add_task("run", total=total, state=state, incarnation=incarnation)
            if state != last_state and state not in TERMINAL_STATES:
                progress.console.print(f"{state} at step {status.progress}")
            for incident in (i for i in status.incidents if i.number > incidents):
                fault = incident.fault
                progress.console.print(
                    f"incident {incident.number}: {fault.kind} on {', '.join(fault.nodes)} at step "
                    + (str(fault.step) if fault.step is not None else "unknown")
                )
            incidents, last_state = status.incident_count, state
            progress.update(task, completed=status.step or 0, state=state, incarnation=incarnation)
            if state in TERMINAL_STATES:
                break
            await asyncio.sleep(poll_seconds)
    console.print(f"{state} at step {status.progress}" + (f": {status.reason}" if status.reason else ""))
    return 0 if state == "COMPLETED" else 1


async def show_logs(args: argparse.Namespace, settings: Settings) -> int:
    """Print the ranks' logs from the run directory, each line prefixed with its node and rank."""
    from lazarus.commands.logs import LogsError, select, show
    from lazarus.infra.backend import ClusterError

    try:
        run = local_cluster(settings).run_dir(args.run_id)
        selected = select(run, args.node, args.incarnation)
    except (ClusterError, LogsError) as error:
        raise UserError(f"logs of {args.run_id}: {error}") from None
    await asyncio.to_thread(show, run, selected, args.follow)
    return 0
