"""`lazarus launch`: torchrun's command line, Lazarus's recovery.

`torchrun --nnodes 4 --nproc-per-node 8 train.py --lr 3e-4` becomes `lazarus launch --nnodes 4
--nproc-per-node 8 train.py --lr 3e-4`: the run is built from torchrun's own flags, a local
Temporal server and a worker are started or reused as the demo does, rank 0's output is streamed
as torchrun would show it, each incident is said on stderr as it happens, and the exit status is
the script's.

The ranks run on this machine (`--backend local`, the default) or as job steps of one allocation of
the Slurm cluster SLURM_CONF names (`--backend slurm`); on Kubernetes a run needs a worker of its own
(`lazarus worker --backend kubernetes`) and `lazarus run start`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import re
import shutil
import uuid
from datetime import datetime
from pathlib import Path

from lazarus.commands.common import OneLineParser, UserError, connect_client, open_cluster
from lazarus.commands.launch_follow import Interruption

# The torchrun flags that mean nothing under Lazarus, each with the reason said once for its group.
IGNORED_FLAGS = {
    "Lazarus assigns the ranks and runs the rendezvous: rank 0's store, on a new port per incarnation": (
        "rdzv-backend",
        "rdzv-endpoint",
        "rdzv-conf",
        "master-addr",
        "master-port",
        "node-rank",
        "local-addr",
    ),
    "exits are seen as they happen": ("monitor-interval",),
    "ranks start as processes or as forks of warm standbys": ("start-method",),
    "every rank's output is kept in the run directory, `lazarus run logs RUN` shows it; rank 0's is shown here": (
        "log-dir",
        "redirects",
        "tee",
        "local-ranks-filter",
        "logs-specs",
        "duplicate-stdout-filters",
        "duplicate-stderr-filters",
    ),
    "the workflow history is the event log": ("event-log-handler",),
    "Ctrl-C, SIGTERM and SIGHUP end the run and stop its processes": ("signals-to-handle", "shutdown-timeout"),
    "not supported: the ranks run as torchrun's defaults run them": ("numa-binding", "virtual-local-rank", "role"),
}
SHORT_FLAGS = {"redirects": "-r", "tee": "-t"}


def refused_backend(name: str) -> str:
    """Why `lazarus launch` does not drive `name`: its nodes do not see this folder's paths."""
    from lazarus.infra.registry import backend_class, spec_names

    launchable = "|".join(n for n in spec_names() if backend_class(n).shares_paths)
    return (
        f"lazarus launch drives the backends whose nodes share this folder's paths (--backend {launchable}); "
        f"on {name} start a worker (`lazarus worker --backend {name}`) and the run with `lazarus run start`"
    )


class LaunchParser(OneLineParser):
    """The one-line parser, which says how to give a missing SCRIPT."""

    def error(self, message: str):
        if "required: SCRIPT" in message:
            message = "no SCRIPT given: lazarus launch [torchrun's flags] SCRIPT [the script's arguments]"
        super().error(message)


def _flag(group, name: str, **options) -> None:
    """A torchrun flag in both of torchrun's spellings (`--nproc-per-node`, `--nproc_per_node`)."""
    spellings = [f"--{name}"] + ([f"--{name.replace('-', '_')}"] if "-" in name else [])
    if name in SHORT_FLAGS:
        spellings.insert(0, SHORT_FLAGS[name])
    group.add_argument(*spellings, dest=name.replace("-", "_"), **options)


def build_parser() -> LaunchParser:
    """torchrun's flags (dash and underscore spellings), Lazarus's own, the script and its arguments."""
    assert __doc__ is not None, "the module's docstring is the help's description (python -OO drops it)"
    parser = LaunchParser(
        prog="lazarus launch",
        usage="lazarus launch [torchrun's flags] [--backend local|slurm] [--spares N ...] SCRIPT [script arguments]",
        allow_abbrev=False,
        description=__doc__.split("\n\n")[1].replace("\n", " "),
        epilog="torchrun flags accepted and ignored, with why: "
        + "; ".join(
            f"{', '.join(SHORT_FLAGS.get(f, f'--{f}') for f in flags)} ({why})" for why, flags in IGNORED_FLAGS.items()
        ),
    )
    torchrun = parser.add_argument_group("torchrun's flags, with their torchrun meaning")
    _flag(
        torchrun,
        "nnodes",
        metavar="N|MIN:MAX",
        help="nodes that train (default 1); with MIN:MAX the run may shrink to MIN nodes when no spare is left, "
        "with N it never shrinks (without a spare it waits for one)",
    )
    _flag(torchrun, "nproc-per-node", metavar="N", help="ranks per node (default 1)")
    _flag(
        torchrun,
        "max-restarts",
        type=int,
        metavar="N",
        help="recoveries before the run fails (TORCHELASTIC_MAX_RESTARTS; default 20)",
    )
    _flag(torchrun, "rdzv-id", metavar="ID", help="the run's id (TORCHELASTIC_RUN_ID; default: script name and time)")
    _flag(torchrun, "standalone", action="store_true", help="accepted: Lazarus always runs the rendezvous itself")
    torchrun.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module: `python -m SCRIPT`")
    _flag(torchrun, "no-python", action="store_true", help="run SCRIPT itself, not through python")
    _flag(torchrun, "run-path", action="store_true", help="run SCRIPT as a path (what happens anyway)")
    for flags in IGNORED_FLAGS.values():
        for name in flags:
            _flag(torchrun, name, help=argparse.SUPPRESS)
    torchrun.add_argument("--local-rank", "--local_rank", dest="local_rank", help=argparse.SUPPRESS)
    _own_flags(parser.add_argument_group("Lazarus's flags"))
    parser.add_argument(
        "script", metavar="SCRIPT", help="the training script (a module with -m, a program with --no-python)"
    )
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def _own_flags(own) -> None:
    """Lazarus's flags beside torchrun's: the backend, spares, a spec to start from, and how to read a script."""
    own.add_argument(
        "--backend",
        metavar="NAME",
        help="where the nodes are, a backend whose nodes share this folder's paths: `local` runs each "
        "node's ranks as processes of this machine; `slurm` holds the nodes in one allocation of the Slurm "
        "cluster SLURM_CONF names (cluster.slurm's partition, account and time limit) and runs each node's "
        "ranks as a job step on it, with LAZARUS_HOME and the working directory on a path every node "
        "shares; Ctrl-C or the run's end gives the allocation back (default: a --spec's cluster.backend, "
        "else local). Kubernetes is refused: start a worker (`lazarus worker --backend kubernetes`) and the "
        "run with `lazarus run start`",
    )
    own.add_argument("--spares", type=int, metavar="N", help="hot spare nodes (default 1)")
    own.add_argument("--spec", metavar="FILE", help="start from this run spec (policy, faults, ...); flags override it")
    own.add_argument("--name", help="run name (default: from the script's name)")
    own.add_argument(
        "--workdir",
        metavar="DIR",
        help="the ranks' working directory (default: the folder lazarus launch is typed in, as under torchrun; "
        "a --spec's trainer.workdir is kept)",
    )
    own.add_argument(
        "--progress-pattern",
        metavar="REGEX",
        help="for a script without lazarus.session: where a line it prints names a step, e.g. 'step (?P<step>\\d+)'",
    )
    own.add_argument(
        "--output-is-heartbeat", action="store_true", help="a rank that prints nothing for hang_after_seconds is hung"
    )
    own.add_argument("--steps", type=int, metavar="N", help="trainer.steps, for a script that uses lazarus.session")


def ignored_flags(args: argparse.Namespace) -> str | None:
    """One line naming the torchrun flags given that mean nothing here, and why; None if none."""
    parts = []
    for why, flags in IGNORED_FLAGS.items():
        given = ["--" + f for f in flags if getattr(args, f.replace("-", "_")) is not None]
        if given:
            parts.append(f"{', '.join(given)} ({why})")
    if args.local_rank is not None:
        parts.append("--local-rank (each rank reads LOCAL_RANK from its environment)")
    return "ignoring " + "; ".join(parts) if parts else None


def _count(flag: str, text: str, what: str) -> int:
    # isdigit alone takes '²' and other digits int() refuses.
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise UserError(f"--{flag}: {text!r} is not a number of {what} (a whole number, 1 or more)")
    return int(text)


def _node_range(text: str) -> tuple[int, int]:
    """--nnodes N or MIN:MAX."""
    low, _, high = text.partition(":")
    low_n = _count("nnodes", low, "nodes")
    high_n = _count("nnodes", high, "nodes") if high else low_n
    if low_n > high_n:
        raise UserError(f"--nnodes: {text!r}: MIN is more than MAX")
    return low_n, high_n


def run_name(script: str) -> str:
    """A run name from a script's name: `train_gpt.py` -> `train-gpt`."""
    stem = Path(script).stem if not script.endswith("/") else script.rstrip("/")
    name = re.sub(r"[^a-z0-9-]+", "-", stem.lower().split(".")[-1]).strip("-")[:40].strip("-")
    return name or "run"


def _command(args: argparse.Namespace) -> list[str]:
    """trainer.command from SCRIPT, -m or --no-python and the script's arguments; a missing script is one line."""
    if args.module and args.no_python:
        raise UserError("-m and --no-python exclude each other (see `lazarus launch --help`)")
    if args.module:
        return ["python", "-m", args.script, *args.script_args]
    if args.no_python:
        if not (shutil.which(args.script) or (Path(args.script).is_file() and os.access(args.script, os.X_OK))):
            raise UserError(f"no program {args.script!r}: not on PATH, not an executable file")
        return [args.script, *args.script_args]
    if not Path(args.script).is_file():
        raise UserError(f"no such script: {args.script}")
    return ["python", args.script, *args.script_args]


def build_spec(args: argparse.Namespace, folder: Path):
    """The run spec the flags describe (on --spec's, if given), its paths taken from `folder`."""
    from lazarus.commands.common import load_run_spec, registered_backend
    from lazarus.commands.local_paths import anchor_paths
    from lazarus.infra.registry import DEFAULT_BACKEND
    from lazarus.schema.load import SpecError, parse_spec

    command = _command(args)
    base = load_run_spec(args.spec) if args.spec else None
    data = base.model_dump(mode="json", exclude_unset=True) if base else {}
    nodes = args.nnodes or (str(base.cluster.active_nodes) if base else "1")
    low, high = _node_range(nodes)
    per_node = _count(
        "nproc-per-node", args.nproc_per_node or str(base.layout.ranks_per_node if base else 1), "ranks per node"
    )
    data["name"] = args.name or data.get("name") or run_name(args.script)
    trainer = data.setdefault("trainer", {})
    trainer["command"] = command
    for key in ("workdir", "progress_pattern", "steps"):
        if getattr(args, key) is not None:
            trainer[key] = getattr(args, key)
    if not trainer.get("workdir"):
        # As under torchrun, the ranks run where the command was typed: `--train_file data/train.txt`
        # reads this folder's data and `--output_dir out` writes here, not inside LAZARUS_HOME.
        trainer["workdir"] = str(folder.resolve())
    if args.output_is_heartbeat:
        trainer["output_is_heartbeat"] = True
    if base is None or args.nnodes or args.nproc_per_node:
        data["layout"] = {"dp": high * per_node, "pp": 1, "tp": 1, "ranks_per_node": per_node}
    cluster = data.setdefault("cluster", {})
    cluster["backend"] = args.backend or (base.cluster.backend if base else DEFAULT_BACKEND)
    backend = registered_backend(cluster["backend"], "--backend" if args.backend else "cluster.backend")
    if not backend.shares_paths:
        raise UserError(refused_backend(cluster["backend"]))
    cluster["active_nodes"] = high
    if args.spares is not None:
        cluster["spare_nodes"] = args.spares
    recovery = data.setdefault("recovery", {})
    if args.nnodes or base is None:
        # MIN:MAX may shrink to MIN nodes; a fixed N never reshards (min_dp is then the whole layout's
        # dp): without a spare the run waits for capacity, then fails, as the policy says.
        recovery["min_dp"] = low * per_node
    if args.max_restarts is not None:
        recovery["max_incidents"] = args.max_restarts
    try:
        spec = parse_spec(data)
    except SpecError as error:
        raise UserError(str(error)) from None
    return anchor_paths(spec, folder, backend.shares_paths)


def run_id_for(args: argparse.Namespace, name: str) -> str:
    """--rdzv-id (torchrun's job id) as the run id, else the name, the time and a few random letters."""
    if args.rdzv_id in (None, "none"):
        return f"{name}-{datetime.now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:4]}"
    from lazarus.schema.names import check_run_id

    try:
        return check_run_id(args.rdzv_id)
    except ValueError as error:
        raise UserError(f"--rdzv-id: {error}") from None


async def launch(args: argparse.Namespace, settings) -> int:
    """Build the run, start or reuse the server, serve it with a worker of this process, follow
    it to its end; returns the exit status (128 + N when signal N ended it)."""
    from lazarus import console

    def say(message: str) -> None:
        console.stderr.print(f"lazarus: {message}", highlight=False, markup=False)

    spec = build_spec(args, Path.cwd())
    run_id = run_id_for(args, spec.name)
    # On Slurm, slurmctld must answer before anything is said or started.
    cluster = await asyncio.to_thread(cluster_for, spec, settings)
    note = ignored_flags(args)
    if note:
        say(note)
    settings = dataclasses.replace(settings, task_queue=f"{settings.task_queue}-launch-{uuid.uuid4().hex[:8]}")
    _say_start(spec, run_id, settings, cluster, say)
    interruption = Interruption(say)
    with interruption.installed():
        try:
            return await _serve(spec, run_id, settings, cluster, say)
        except asyncio.CancelledError:
            if interruption.received is None:
                raise
            task = asyncio.current_task()
            assert task is not None, "a coroutine runs in a task"
            task.uncancel()
            code = 128 + interruption.received.value
            say(f"ended by {interruption.received.name} (exit status {code})")
            return code


def _say_start(spec, run_id: str, settings, backend, say) -> None:
    """The first lines: the nodes (and on Slurm, whose), where the ranks run, where the run is seen."""
    cluster, dp, min_dp = spec.cluster, spec.layout.dp, spec.recovery.min_dp
    shrink = f"it may shrink to dp={min_dp}" if min_dp < dp else "it never shrinks: without a spare it waits for one"
    say(
        f"run {run_id}: {cluster.active_nodes} node(s) x {spec.layout.ranks_per_node} rank(s) + "
        f"{cluster.spare_nodes} hot spare(s){backend.placement(cluster)}; {shrink}"
    )
    say(f"working directory: {spec.trainer.workdir}")
    say(f"web UI: {settings.workflow_url(run_id)}")


def cluster_for(spec, settings):
    """The backend the spec names, its cluster reached (on Slurm, once slurmctld answers; else
    UserError, one line)."""
    return open_cluster(spec.cluster.backend, settings)


async def _serve(spec, run_id: str, settings, cluster, say):
    """Start or reuse the server, serve the run with a worker of this process and follow it; on
    cancellation (a signal), end the run and every process of it (on Slurm, its allocation too)
    before the cancellation goes on."""
    from lazarus.commands.demo_run import DemoError, ensure_server
    from lazarus.commands.launch_follow import say_end, stop_processes, terminate
    from lazarus.infra.backend import ClusterError
    from lazarus.worker import build_worker

    try:
        await ensure_server(settings, say)
    except DemoError as error:
        raise UserError(str(error)) from None
    client = await connect_client(settings)
    started = False
    try:
        async with build_worker(client, settings.task_queue, cluster):
            started = True
            try:
                final = await _follow(client, settings, spec, run_id, cluster, say)
            except asyncio.CancelledError:
                await terminate(client, run_id, say)
                raise
    except asyncio.CancelledError:
        if started:
            # Once the worker is gone, so that none of its activities can start a process after this.
            try:
                await asyncio.to_thread(stop_processes, cluster, run_id)
            except ClusterError as error:  # a process outlived SIGKILL: said, and the signal's status stands
                say(f"not every process of run {run_id} could be stopped: {error}")
        raise
    finally:
        cluster.close()
    return say_end(final, say)


async def _follow(client, settings, spec, run_id: str, cluster, say):
    """Start the run and show it (rank 0's output, incidents, waits) until it ends; its final status."""
    from temporalio.client import WorkflowFailureError

    from lazarus.client.runs import run_status, start_run
    from lazarus.commands.launch_follow import Follower, WaitingNotice
    from lazarus.schema.states import TERMINAL_STATES

    follower, clock = Follower(cluster.run_dir(run_id), say), asyncio.get_running_loop()
    notice = WaitingNotice(node_limit=spec.cluster.active_nodes + spec.cluster.spare_nodes)
    handle = await start_run(client, settings, spec, run_id)
    result = asyncio.ensure_future(handle.result())
    try:
        while not result.done():
            status = await run_status(client, run_id)
            follower.output(status.assignment.incarnation if status.assignment else 0)
            follower.incidents(status)
            waiting = notice.line(status, clock.time())
            if waiting:
                say(waiting)
            if status.state in TERMINAL_STATES:
                break
            await asyncio.wait([result], timeout=0.1)
        final = await result
    except WorkflowFailureError:
        final = await run_status(client, run_id)
    finally:
        # Interrupted: the wait for the result goes too, else its failure (the run terminated) is
        # logged at exit as an exception nobody retrieved.
        if not result.cancel() and not result.cancelled():
            result.exception()
    follower.output(final.assignment.incarnation if final.assignment else 0)
    follower.incidents(final)
    return final
