"""The detached dev server of `lazarus server --detach` and of the demo, and the first client of it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lazarus.client.config import Settings
from lazarus.client.runs import connect, has_search_attributes
from lazarus.infra.backend import free_ports
from lazarus.infra.harness.temporal_server import foreign_dev_server, port_answers, start_detached, stop_detached
from lazarus.schema.files import process_state
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


async def test_a_detached_server_serves_a_client_at_once_and_stops(tmp_path):
    """The demo connects the moment its server answers (lazarus.client.runs.connect waits out a
    frontend that is not healthy yet), and `lazarus server --stop` ends the server it recorded."""
    port, ui_port = free_ports(2)
    pid = start_detached(tmp_path, port, ui_port)
    try:
        client = await connect(Settings(address=f"127.0.0.1:{port}", home=tmp_path))
        assert await has_search_attributes(client, "default")
    finally:
        assert stop_detached(tmp_path) == pid
    assert not Path(f"/proc/{pid}").exists() and not (tmp_path / "server.pid").exists()


def foreground_server(tmp_path) -> tuple[subprocess.Popen, int, int]:
    """`lazarus server` in the foreground on free ports, once its dev server answers: the CLI's
    process, the dev server's pid (as recorded for `--stop`) and its port."""
    port, ui_port = free_ports(2)
    cli = subprocess.Popen(
        [sys.executable, "-m", "lazarus.cli", "server", "--port", str(port), "--ui-port", str(ui_port)],
        env={**os.environ, "LAZARUS_HOME": str(tmp_path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until(lambda: port_answers("127.0.0.1", port) or cli.poll() is not None, timeout=30, what="the server")
        assert cli.poll() is None, cli.stdout.read().decode() if cli.stdout else ""
        pid = int((tmp_path / "server.pid").read_text().split()[0])
    except BaseException:
        cli.kill()
        raise
    return cli, pid, port


def ended(cli: subprocess.Popen, pid: int, port: int) -> None:
    """The CLI and its dev server are gone, the port free and the record removed (else both are killed)."""
    try:
        wait_until(lambda: not Path(f"/proc/{pid}").exists(), timeout=20, what=f"dev server {pid} to end")
        assert cli.wait(timeout=20) == 0
    finally:
        cli.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not port_answers("127.0.0.1", port)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_foreground_server_ends_with_its_command_on_a_supervisors_signal(tmp_path, signum):
    cli, pid, port = foreground_server(tmp_path)
    cli.send_signal(signum)
    ended(cli, pid, port)
    assert not (tmp_path / "server.pid").exists()


def test_a_foreground_server_is_stopped_by_lazarus_server_stop(tmp_path):
    cli, pid, port = foreground_server(tmp_path)
    stopped = subprocess.run(
        [sys.executable, "-m", "lazarus.cli", "server", "--stop"],
        env={**os.environ, "LAZARUS_HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert stopped.returncode == 0 and f"stopped the Temporal dev server (pid {pid})" in stopped.stdout
    ended(cli, pid, port)


def test_a_foreground_server_whose_command_is_killed_ends_too(tmp_path):
    cli, pid, port = foreground_server(tmp_path)
    cli.kill()  # SIGKILL: no handler runs; the kernel's parent-death signal ends the server
    cli.wait(timeout=10)
    try:
        wait_until(lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid), timeout=20, what="the orphan to end")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not port_answers("127.0.0.1", port)


def _zombie(pid: int) -> bool:
    return process_state(pid) in (None, "Z")


def test_a_worker_whose_server_is_gone_ends_on_sigterm(tmp_path):
    """Also when the server went while the worker still checked its namespace with it (under load,
    1 in 12 sittings here ended in a cancellation that hung the interpreter's exit)."""
    port, ui_port = free_ports(2)
    server = start_detached(tmp_path / "server", port, ui_port)
    env = {**os.environ, "LAZARUS_TEMPORAL_ADDRESS": f"127.0.0.1:{port}", "LAZARUS_HOME": str(tmp_path / "home")}
    out, err = tmp_path / "worker.out", tmp_path / "worker.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        worker = subprocess.Popen(
            [sys.executable, "-m", "lazarus.cli", "worker"], env=env, stdout=stdout, stderr=stderr
        )
    try:
        wait_until(lambda: out.read_text().startswith("worker pid "), "the worker to start", 30)
        assert stop_detached(tmp_path / "server") == server
        worker.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.wait(timeout=20)
        assert worker.returncode == 0, f"status {worker.returncode}: {err.read_text()[-2000:]}"
        assert "Traceback" not in err.read_text(), err.read_text()[-2000:]
    finally:
        worker.kill()
        worker.wait()
        stop_detached(tmp_path / "server")


def test_a_dev_server_of_another_home_is_named_with_its_state_and_how_to_stop_it(tmp_path):
    port, ui_port = free_ports(2)
    theirs, ours = tmp_path / "theirs", tmp_path / "ours"
    pid = start_detached(theirs, port, ui_port)
    try:
        assert foreign_dev_server(theirs, f"127.0.0.1:{port}") is None  # its own home's server
        assert foreign_dev_server(ours, f"127.0.0.1:{port}") == (
            f"the Temporal dev server on 127.0.0.1:{port} (pid {pid}, its state in {theirs / 'temporal.db'}) is not "
            f"this home's ({ours}): stop it (`kill {pid}`) or point LAZARUS_TEMPORAL_ADDRESS elsewhere"
        )
        assert foreign_dev_server(ours, f"localhost:{port}") == foreign_dev_server(ours, f"127.0.0.1:{port}")
        assert foreign_dev_server(ours, f"10.0.0.1:{port}") is None  # another machine's: not told
        (theirs / "temporal.db").unlink()  # its home deleted under it, as an orphan's often is
        assert ", which no longer exists) is not this home's" in foreign_dev_server(ours, f"127.0.0.1:{port}")
    finally:
        assert stop_detached(theirs) == pid
