"""The `lazarus` command: server, worker, runs, the pool, chaos, the planner and the demo.

The parser is assembled from the command modules under lazarus/commands/; each subcommand
names its handler (`handler(args, settings) -> exit code`, a coroutine function or a plain one).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import logging
import os
import sys
import traceback

from lazarus.client.config import HELP as ENV_HELP
from lazarus.client.config import Settings
from lazarus.commands import chaos, controls, demo, pool, runs, server, simulate, worker
from lazarus.commands.common import OneLineParser, UserError, server_error


def build_parser() -> OneLineParser:
    """The argument parser of every command, with the environment variables in its epilog."""
    parser = OneLineParser(
        prog="lazarus",
        description="Training runs that survive a dead node: each run is a durable Temporal workflow "
        "whose activities detect, drain, reschedule, replace and resume.",
        epilog=ENV_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    server.register(commands)
    worker.register(commands)
    run = commands.add_parser("run", help="start, list, watch, steer and report runs")
    run_commands = run.add_subparsers(dest="run_command", required=True, metavar="ACTION")
    runs.register(run_commands)
    controls.register(run_commands)
    pool.register(commands)
    chaos.register(commands)
    simulate.register(commands)
    demo.register(commands)
    # Parsed by lazarus.commands.launch's own parser (torchrun's flags before the script, its arguments after):
    # listed here for `lazarus --help`, never reached through this parser.
    commands.add_parser(
        "launch",
        add_help=False,
        help="torchrun's command line with Lazarus's recovery: `lazarus launch --nnodes 4 train.py ...`",
    )
    return parser


def _run(args: argparse.Namespace, settings: Settings) -> int:
    outcome = args.handler(args, settings)
    return asyncio.run(outcome) if inspect.iscoroutine(outcome) else outcome


def _parse(argv: list[str]) -> argparse.Namespace:
    if argv[:1] == ["launch"]:
        from lazarus.commands.launch import build_parser as launch_parser
        from lazarus.commands.launch import launch

        args = launch_parser().parse_args(argv[1:])
        args.handler = launch
        return args
    return build_parser().parse_args(argv)


def one_line(message: str) -> str:
    """`message` as one printable line: a newline or other control character a user typed shows escaped."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in message)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `lazarus` console script."""
    argv = sys.argv[1:] if argv is None else argv
    prog = "lazarus launch" if argv[:1] == ["launch"] else "lazarus"
    try:
        args = _parse(argv)
    except UserError as error:
        print(f"{prog}: error: {one_line(str(error))}", file=sys.stderr)
        sys.exit(2)
    # Logs (the Temporal core's included, see lazarus.client.runs.CORE_LOGGER) go to stderr: stdout is for results.
    logging.basicConfig(
        stream=sys.stderr, level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    code = 1
    settings = Settings.from_environ()
    try:
        code = _run(args, settings)
    except UserError as error:
        print(f"{prog}: error: {one_line(str(error))}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    except SystemExit as error:  # sys.exit in a command: its status (a text is said), the same explicit end
        code = error.code if isinstance(error.code, int) else int(error.code is not None)
        if isinstance(error.code, str):
            print(error.code, file=sys.stderr)
    except Exception as error:  # noqa: BLE001 - whatever it was, the process ends below, explicitly
        code = _failed(prog, error, settings)
    except BaseException as error:  # noqa: BLE001 - a cancellation that escaped: not past os._exit below
        traceback.print_exception(error)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # End explicitly, after an error too: Temporal's native client can crash at interpreter exit
    # (sdk-python#300), or hang there while its threads (a worker's) wind down.
    os._exit(code)


def _failed(prog: str, error: Exception, settings: Settings) -> int:
    """Say an error no command handled: what the Temporal server answered in one line; anything else
    is a bug, shown with its traceback. Returns the exit status (1)."""
    line = server_error(error, settings.address)
    if line is None:
        traceback.print_exception(error)
    else:
        from lazarus.infra.harness.temporal_server import foreign_dev_server

        # A server another home left on this address may have lost its state: an orphan keeps answering.
        hint = foreign_dev_server(settings.home, settings.address)
        print(f"{prog}: error: {one_line(line)}{f'; {hint}' if hint else ''}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    main()
