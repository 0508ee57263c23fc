"""`lazarus launch`: torchrun's command line, Lazarus's recovery.

`torchrun --nnodes 4 --nproc-per-node 8 train.py --lr 3e-4` becomes `lazarus launch --nnodes 4
--nproc-per-node 8 train.py --lr 3e-4`: the run is built from torchrun's own flags, a local
Temporal server and a worker are started or reused as the demo does, rank 0's output is streamed
as torchrun would show it, each incident is said on stderr as it happens, and the exit status is
the script's.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import re
import shutil
import signal
import sys
import uuid
from datetime import datetime
from pathlib import Path

from lazarus.commands.common import OneLineParser, UserError, connect_client

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
    "Ctrl-C ends the run and stops its ranks": ("signals-to-handle", "shutdown-timeout"),
    "not supported: the ranks run as torchrun's defaults run them": ("numa-binding", "virtual-local-rank", "role"),
}
SHORT_FLAGS = {"redirects": "-r", "tee": "-t"}


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
    parser = LaunchParser(
        prog="lazarus launch",
        usage="lazarus launch [torchrun's flags] [--spares N ...] SCRIPT [script arguments]",
        allow_abbrev=False,
        description=__doc__.split("\n\n")[1].replace("\n", " "),
        epilog="torchrun flags accepted and ignored, with why: "
        + "; ".join(
            f"{', '.join(SHORT_FLAGS.get(f, '--' + f) for f in flags)} ({why})" for why, flags in IGNORED_FLAGS.items()
        ),
    )
    torchrun = parser.add_argument_group("torchrun's flags, with their torchrun meaning")
    _flag(
        torchrun,
        "nnodes",
        metavar="N|MIN:MAX",
        help="nodes that train (default 1); with MIN:MAX the run may shrink to MIN nodes when no spare is left",
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

    own = parser.add_argument_group("Lazarus's flags")
    own.add_argument("--spares", type=int, metavar="N", help="hot spare nodes (default 1)")
    own.add_argument("--spec", metavar="FILE", help="start from this run spec (policy, faults, ...); flags override it")
    own.add_argument("--name", help="run name (default: from the script's name)")
    own.add_argument(
        "--workdir",
        metavar="DIR",
        help="the ranks' working directory (default: a folder of the run's own: two runs never share a snapshot)",
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
    parser.add_argument(
        "script", metavar="SCRIPT", help="the training script (a module with -m, a program with --no-python)"
    )
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


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
    from lazarus.commands.common import load_run_spec
    from lazarus.local_paths import anchor_paths
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
    if args.output_is_heartbeat:
        trainer["output_is_heartbeat"] = True
    if base is None or args.nnodes or args.nproc_per_node:
        data["layout"] = {"dp": high * per_node, "pp": 1, "tp": 1, "ranks_per_node": per_node}
    cluster = data.setdefault("cluster", {})
    cluster["active_nodes"] = high
    if args.spares is not None:
        cluster["spare_nodes"] = args.spares
    recovery = data.setdefault("recovery", {})
    if low != high:
        recovery["min_dp"] = low * per_node
    if args.max_restarts is not None:
        recovery["max_incidents"] = args.max_restarts
    try:
        spec = parse_spec(data)
    except SpecError as error:
        raise UserError(str(error)) from None
    if spec.cluster.backend != "local":
        raise UserError(
            "lazarus launch drives the local backend; on Kubernetes start a worker "
            "(`lazarus worker --backend kubernetes`) and the run with `lazarus run start`"
        )
    return anchor_paths(spec, folder)


def run_id_for(args: argparse.Namespace, name: str) -> str:
    """--rdzv-id (torchrun's job id) as the run id, else the name, the time and a few random letters."""
    if args.rdzv_id in (None, "none"):
        return f"{name}-{datetime.now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:4]}"
    from lazarus.schema.names import check_run_id

    try:
        return check_run_id(args.rdzv_id)
    except ValueError as error:
        raise UserError(f"--rdzv-id: {error}") from None


class Follower:
    """Shows a run as torchrun would show its job: rank 0's output on stdout, as it is written,
    across incarnations; and, on stderr, each incident when it opens and when it ends."""

    def __init__(self, run, say):
        self.run, self.say = run, say
        self.incarnation, self.offset = 0, 0
        self.told: dict[int, str] = {}  # incident number -> the outcome last said

    def output(self, incarnation: int) -> None:
        """Copy what rank 0 wrote since the last look; on a new incarnation, finish the old log first."""
        while True:
            self._copy()
            if incarnation <= self.incarnation:
                return
            self.incarnation, self.offset = self.incarnation + 1, 0

    def _copy(self) -> None:
        try:
            with open(self.run.log_file(self.incarnation, 0), "rb") as log:
                log.seek(self.offset)
                data = log.read()
        except FileNotFoundError:
            return
        # Whole lines only: a line being written is shown once it is complete.
        data = data[: data.rfind(b"\n") + 1]
        if data:
            self.offset += len(data)
            sys.stdout.buffer.write(data)
            sys.stdout.flush()

    def incidents(self, status) -> None:
        """Say each incident as it opens and when its outcome is known."""
        for incident in status.incidents:
            fault = incident.fault
            if incident.number not in self.told:
                self.say(f"incident {incident.number}: {fault.kind} on {', '.join(fault.nodes)}: {fault.reason}")
                self.told[incident.number] = "recovering"
            if incident.outcome != self.told[incident.number]:
                self.told[incident.number] = incident.outcome
                self.say(f"incident {incident.number}: {incident.outcome}{_recovery_words(incident)}")


def _recovery_words(incident) -> str:
    decision = incident.decision
    words = []
    if decision and decision.replacements:
        words.append(
            "replaced " + ", ".join(f"{lost} by spare {spare}" for lost, spare in decision.replacements.items())
        )
    elif decision and decision.action == "reshard" and incident.new_assignment:
        words.append(f"resharded to dp={incident.new_assignment.layout.dp}")
    if incident.mttr_seconds is not None:
        words.append(f"MTTR {incident.mttr_seconds:.2f} s")
    elif "resume" in incident.stages and incident.stages["resume"].ended_at:
        up = (incident.stages["resume"].ended_at - incident.fault.occurred_at).total_seconds()
        words.append(f"ranks up again {up:.2f} s after the fault (the script reports no steps)")
    return f" ({'; '.join(words)})" if words else ""


def exit_status(status) -> int:
    """The script's exit status, as torchrun would give it: 0 when the run completed; the failing
    rank's code when a rank's failure failed the run (128 + N for signal N); 1 otherwise."""
    from lazarus.schema.records import RunState

    if status.state == RunState.COMPLETED:
        return 0
    failure = status.failure
    if failure is not None and failure.exit_code:
        return failure.exit_code
    if failure is not None and failure.signal:
        return 128 + signal.Signals[failure.signal].value
    return 1


async def launch(args: argparse.Namespace, settings) -> int:
    """Build the run, start or reuse the server, serve it with a worker of this process, follow
    it to its end; returns the exit status."""
    from temporalio.client import WorkflowFailureError

    from lazarus import console
    from lazarus.client import run_status, start_run
    from lazarus.demo import DemoError, ensure_server
    from lazarus.infra.local import LocalCluster
    from lazarus.schema.states import TERMINAL_STATES
    from lazarus.worker import build_worker

    def say(message: str) -> None:
        console.stderr.print(f"lazarus: {message}", highlight=False, markup=False)

    spec = build_spec(args, Path.cwd())
    note = ignored_flags(args)
    if note:
        say(note)
    run_id = run_id_for(args, spec.name)
    try:
        await ensure_server(settings, say)
    except DemoError as error:
        raise UserError(str(error)) from None
    client = await connect_client(settings)
    cluster = LocalCluster(settings.home)
    settings = dataclasses.replace(settings, task_queue=f"{settings.task_queue}-launch-{uuid.uuid4().hex[:8]}")
    say(
        f"run {run_id}: {spec.cluster.active_nodes} node(s) x {spec.layout.ranks_per_node} rank(s) + "
        f"{spec.cluster.spare_nodes} hot spare(s); web UI {settings.workflow_url(run_id)}"
    )
    follower = Follower(cluster.run_dir(run_id), say)
    async with build_worker(client, settings.task_queue, cluster):
        handle = await start_run(client, settings, spec, run_id)
        result = asyncio.ensure_future(handle.result())
        try:
            while not result.done():
                status = await run_status(client, run_id)
                follower.output(status.assignment.incarnation if status.assignment else 0)
                follower.incidents(status)
                if status.state in TERMINAL_STATES:
                    break
                await asyncio.wait([result], timeout=0.1)
        except asyncio.CancelledError:
            await _end_interrupted(handle, cluster, run_id, say)
            raise
        try:
            final = await result
        except WorkflowFailureError:
            final = await run_status(client, run_id)
    follower.output(final.assignment.incarnation if final.assignment else 0)
    follower.incidents(final)
    return _say_end(final, say)


async def _end_interrupted(handle, cluster, run_id: str, say) -> None:
    """Ctrl-C: end the workflow and every process of the run, as torchrun ends its workers."""
    say(f"interrupted: terminating run {run_id} and stopping its ranks")
    try:
        await handle.terminate("lazarus launch was interrupted (Ctrl-C)")
    except Exception:  # noqa: BLE001 - the run may have ended meanwhile; the ranks are stopped anyway
        pass
    await asyncio.to_thread(cluster.stop_run, run_id)


def _say_end(final, say) -> int:
    code = exit_status(final)
    if code == 0:  # completed
        say(f"run {final.run_id} COMPLETED at step {final.progress} after {len(final.incidents)} incident(s)")
        return code
    failure = final.failure
    reason = final.reason.split("; last lines of")[0].splitlines()[0] if final.reason else ""
    say(f"run {final.run_id} {final.state.value}: {reason}")
    if failure is not None and failure.log_tail:
        say(f"last lines of rank {failure.rank}'s log ({failure.nodes[0] if failure.nodes else ''}):")
        sys.stderr.write(failure.log_tail.rstrip("\n") + "\n")
    return code
