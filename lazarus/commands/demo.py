"""`lazarus demo`: server, worker, a real run, a node killed mid-run, the recovery and its cost."""

from __future__ import annotations

import argparse

from lazarus.client.config import Settings
from lazarus.commands.common import UserError, load_run_spec


def register(commands: argparse._SubParsersAction) -> None:
    """Add `demo` to the top-level commands."""
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
    demo.add_argument(
        "--in-process",
        action="store_true",
        help="survivors keep their processes and the spare's ranks join them (recovery.in_process)",
    )
    fault = demo.add_mutually_exclusive_group()
    fault.add_argument(
        "--kill-at-step", type=int, metavar="N", help="kill a node once the run reaches step N (default: mid-run)"
    )
    fault.add_argument("--no-fault", action="store_true", help="kill nothing (the reference run)")
    demo.add_argument("--json", action="store_true", help="print the final status as JSON (progress goes to stderr)")
    demo.set_defaults(handler=run_the_demo)


async def _final_status(args: argparse.Namespace, settings: Settings):
    """Run the demo as asked; returns the run's final status."""
    from lazarus.commands.demo_run import DEFAULT_SPEC, DemoError, default_kill_step, run_demo

    spec = load_run_spec(args.spec or DEFAULT_SPEC)
    if args.spares is not None or args.in_process:
        from lazarus.schema.load import SpecError, parse_spec

        data = spec.model_dump(mode="json")
        if args.spares is not None:
            data["cluster"]["spare_nodes"] = args.spares
        data["recovery"]["in_process"] = data["recovery"]["in_process"] or args.in_process
        try:
            spec = parse_spec(data)
        except SpecError as error:
            raise UserError(f"--spares {args.spares}: {error}") from None
    kill_at = None if args.no_fault else (args.kill_at_step or default_kill_step(spec))
    try:
        return await run_demo(settings, spec, kill_at, args.json)
    except DemoError as error:
        raise UserError(str(error)) from None


async def run_the_demo(args: argparse.Namespace, settings: Settings) -> int:
    """Print the run's stage tables and where to read more, or with --json its final status; exit 0
    if the run completed."""
    from lazarus.commands.report import stage_tables
    from lazarus.console import stdout, stdout_reserved_for_json
    from lazarus.schema.records import RunState

    if args.json:
        with stdout_reserved_for_json() as emit:
            final = await _final_status(args, settings)
            emit(final.summary())
    else:
        final = await _final_status(args, settings)
        stdout.print()
        stdout.print(stage_tables(final))
        stdout.print()
        stdout.print(f"History in the web UI: {settings.workflow_url(final.run_id)}")
        stdout.print(f"Run directory: {final.run_dir}")
    return 0 if final.state == RunState.COMPLETED else 1
