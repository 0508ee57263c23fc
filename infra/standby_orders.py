"""Orders to a node's warm standby over a port (trainer/agent/standby/port.py), for backends whose nodes
are other machines than the controller's (Kubernetes, Slurm): a FIFO on the shared filesystem
does not cross machines. The standby writes `standby/<node>/ready` ({"address", "port"}) once it
listens; every order carries the run's secret (`standby/token`, written here) and the node's name.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
import time
from collections.abc import Callable

from lazarus.schema.files import read_json, write_once
from lazarus.schema.rundir import RunDir

CONNECT_SECONDS = 2.0
"""How long one connection to a standby's port may take to open (seconds)."""

READY_POLL_SECONDS = 0.01
"""How often an order looks whether the standby has written its port yet (seconds)."""


def write_standby_secret(run: RunDir) -> None:
    """The run's standby secret, once. It guards the port, which anyone on the node's network
    reaches; the shared filesystem, which holds the checkpoints too, is trusted."""
    write_once(run.standby_token_file, secrets.token_hex(16))


def order_standby(run: RunDir, node: str, order: dict, timeout: float, running: Callable[[], bool]) -> dict | None:
    """Send one order to the node's standby and return its answer; None once `running()` says the
    standby is gone, or if it did not answer within `timeout` seconds (it may still be starting:
    until it listens, the order waits for its port)."""
    deadline = time.monotonic() + timeout
    secret = run.standby_token_file.read_text().strip()
    while time.monotonic() < deadline:
        if not running():
            return None
        ready = read_json(run.standby(node) / "ready") or {}
        if ready.get("port"):
            with contextlib.suppress(OSError, ValueError):
                return send_order(ready, secret, node, order, deadline - time.monotonic())
        time.sleep(READY_POLL_SECONDS)
    return None


def send_order(ready: dict, secret: str, node: str, order: dict, timeout: float) -> dict:
    """One order to the standby that wrote `ready`, and its answer, over a fresh connection;
    OSError or ValueError when there is none (or the standby refused it)."""
    deadline = time.monotonic() + timeout
    line = json.dumps({"token": secret, "node": node, **order}).encode() + b"\n"
    with socket.create_connection((ready["address"], int(ready["port"])), timeout=CONNECT_SECONDS) as connection:
        connection.sendall(line)
        connection.settimeout(max(0.1, deadline - time.monotonic()))
        data = b""
        while not data.endswith(b"\n"):
            chunk = connection.recv(4096)
            if not chunk:
                break
            data += chunk
    answer = json.loads(data)
    if "error" in answer:
        raise ValueError(answer["error"])
    return answer
