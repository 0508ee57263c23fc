"""`lazarus server`: the Temporal dev server on 127.0.0.1, in the foreground or detached."""

from __future__ import annotations

import argparse
import signal
import subprocess

from lazarus.client.config import Settings
from lazarus.commands.common import UserError


def register(commands: argparse._SubParsersAction) -> None:
    """Add `server` to the top-level commands."""
    server = commands.add_parser(
        "server", help="run the Temporal dev server (127.0.0.1, web UI, SQLite under LAZARUS_HOME)"
    )
    server.add_argument(
        "--port", type=int, default=None, help="gRPC port (default: the port of LAZARUS_TEMPORAL_ADDRESS, 7233)"
    )
    server.add_argument("--ui-port", type=int, default=None, help="web UI port (default: gRPC port + 1000)")
    mode = server.add_mutually_exclusive_group()
    mode.add_argument("--detach", action="store_true", help="start it in the background and return")
    mode.add_argument(
        "--stop",
        action="store_true",
        help="stop the home's server: one started with --detach, by the demo, or in the foreground",
    )
    server.set_defaults(handler=serve)


def serve(args: argparse.Namespace, settings: Settings) -> int:
    """Stop the home's server, start one detached, or run one until Ctrl-C or SIGTERM."""
    from lazarus.infra.harness.temporal_server import (
        ServerError,
        dev_server_command,
        port_answers,
        split_address,
        start_detached,
        stop_detached,
    )

    if args.stop:
        pid = stop_detached(settings.home)
        print(
            f"no server recorded in {settings.home}" if pid is None else f"stopped the Temporal dev server (pid {pid})"
        )
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
        f"state {settings.home / 'temporal.db'} (Ctrl-C, SIGTERM or `lazarus server --stop` stops it)",
        flush=True,
    )
    return _run_until_stopped(command, settings.home, port, ui_port)


class _Stopped(Exception):
    """SIGTERM or SIGHUP reached the foreground `lazarus server`: stop as on Ctrl-C."""


def _stop_on_signal(signum, frame) -> None:
    raise _Stopped()


def _run_until_stopped(command: list[str], home, port: int, ui_port: int) -> int:
    """Run the dev server in the foreground until it exits, or until Ctrl-C, SIGTERM or SIGHUP
    (what a supervisor or a closed terminal sends), which end it too; recorded where `lazarus
    server --stop` looks, as a detached one is."""
    from lazarus.infra.harness.temporal_server import forget_server, record_server, stop_with_parent

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _stop_on_signal)
    # A server outliving its command would keep the port and answer the next home's clients.
    server = subprocess.Popen(command, preexec_fn=stop_with_parent)
    record_server(home, server.pid, port, ui_port)
    try:
        code = server.wait()
        # Stopped by `lazarus server --stop` (which forgot it): a request, not a failure.
        return code if forget_server(home, server.pid) else 0
    except (KeyboardInterrupt, _Stopped):
        # Let the server close its SQLite file cleanly rather than killing it.
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        forget_server(home, server.pid)
        return 0
