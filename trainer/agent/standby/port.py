"""A node's warm standby on Kubernetes: orders arrive on a TCP port of the node's host network
instead of a FIFO, since the controller runs on another machine (a FIFO on the shared volume
does not cross machines, and a polled folder on NFS would wait for its attribute cache).

The standby runs as the node's standby pod (`python -m lazarus.trainer.agent.standby` with
LAZARUS_RUN_DIR, LAZARUS_NODE and LAZARUS_STANDBY_ADDRESS, the node's address, set). It binds a
free port there first and writes `{"address", "port"}` to `standby/<node>/ready` on the shared
volume, then warms up as the local standby does; an order that arrives meanwhile waits in the
socket's backlog. Each order is one connection: one JSON line in, carrying the run's secret
(`standby/token`, written by the backend) and the node's name, and one JSON line back:

  {"incarnation", "node_index", "resume_step"}  fork the node's launcher;
                                                 answer {"started": bool} once its pid is recorded
  {"stop": K}                                    SIGKILL the launchers (and their ranks) of
                                                 incarnations up to K; answer once they are gone
  {"prefetch": {"incarnation", "ranks"}}         answer at once, then read survivors' states

The standby is its launchers' kubelet: it reaps each one and records how it ended
(`incarnations/K/nodes/<i>.exit`), as a pod's phase does for a launcher that runs as its pod.
A standby pod is the container of its launchers and ranks: deleting it ends them all.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import select
import signal
import socket
import time

from lazarus.schema.files import read_json, write_json_atomic
from lazarus.schema.rundir import RunDir
from lazarus.trainer.agent.standby import IDLE_EXIT_SECONDS, Warmth, launch_order, launcher_alive, say_warm

ORDER_READ_SECONDS = 5.0
"""How long the standby waits for an order's line once its connection is accepted (seconds)."""

LAUNCHER_RECORD_SECONDS = 10.0
"""How long an order to start waits for the forked launcher to record its pid (seconds)."""

STOP_SECONDS = 10.0
"""How long a stop waits for the killed launchers' process groups to be empty (seconds)."""

LOOP_SECONDS = 0.05
"""How often the standby reaps its launchers while no order comes (seconds)."""


class Launchers:
    """The launchers this standby forked, by pid: reaped and recorded as they end, killed on a stop."""

    def __init__(self, run: RunDir):
        self.run = run
        self.running: dict[int, tuple[int, int]] = {}  # pid -> (incarnation, node index)

    def reap(self) -> None:
        """Collect every child that ended (ranks orphaned to this process too: in its pod it is
        the container's first process); record the end of each launcher that ran its node."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.running:
                incarnation, index = self.running.pop(pid)
                # A repeated order's fork finds the node's lock taken and exits: not the launcher.
                if (read_json(self.run.node_pid_file(incarnation, index)) or {}).get("pid") == pid:
                    record = {"code": os.waitstatus_to_exitcode(status), "time": time.time()}
                    write_json_atomic(self.run.launcher_exit_file(incarnation, index), record)

    def start(self, order: dict, node: str, private_fds: list[int]) -> dict:
        incarnation, index = int(order["incarnation"]), int(order["node_index"])
        pid = launch_order(self.run, node, order, private_fds, checks_pool=False)
        self.running[pid] = (incarnation, index)
        pid_file = self.run.node_pid_file(incarnation, index)
        deadline = time.monotonic() + LAUNCHER_RECORD_SECONDS
        while not pid_file.exists() and pid in self.running and time.monotonic() < deadline:
            time.sleep(0.002)
            self.reap()
        # A repeated order's fork finds the launcher running (another pid recorded) and ends at once.
        while pid in self.running and (read_json(pid_file) or {}).get("pid") != pid and time.monotonic() < deadline:
            time.sleep(0.002)
            self.reap()
        return {"started": pid_file.exists()}

    def stop(self, incarnation: int) -> dict:
        """SIGKILL the groups of the launchers of incarnations up to `incarnation` (a launcher leads
        its session; its ranks are in its group) and wait until each group is empty."""
        doomed = {pid: k for pid, (k, _) in self.running.items() if k <= incarnation}
        for pid in doomed:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        deadline = time.monotonic() + STOP_SECONDS
        left = set(doomed)
        while left and time.monotonic() < deadline:
            self.reap()
            left = {pid for pid in left if _group_lives(pid)}
            if left:
                time.sleep(0.005)
        return {"stopped": sorted(set(doomed) - left), "alive": sorted(left)}


def _group_lives(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


class OrderPort:
    """The listening socket and the run's secret; `take()` accepts one order."""

    def __init__(self, run: RunDir, node: str, address: str):
        self.node = node
        self.secret = run.standby_token_file.read_text().strip()
        self.server = socket.create_server((address, 0), backlog=64)
        self.address, self.port = address, self.server.getsockname()[1]

    def fileno(self) -> int:
        return self.server.fileno()

    def take(self) -> tuple[dict | None, socket.socket]:
        """Accept a connection and read its order (None: no valid order; answered already)."""
        connection, _ = self.server.accept()
        connection.settimeout(ORDER_READ_SECONDS)
        try:
            data = b""
            while not data.endswith(b"\n") and len(data) < 65536:
                chunk = connection.recv(4096)
                if not chunk:
                    break
                data += chunk
            order = json.loads(data)
        except (OSError, ValueError):
            answer(connection, {"error": "no order read"})
            return None, connection
        if not isinstance(order, dict) or not hmac.compare_digest(str(order.pop("token", "")), self.secret):
            answer(connection, {"error": "refused: not the run's secret"})
            return None, connection
        # A port reused by another node's standby (the emulated nodes share one host) must not
        # start this node's ranks there.
        if order.pop("node", None) != self.node:
            answer(connection, {"error": f"refused: this is the standby of {self.node}"})
            return None, connection
        return order, connection


def answer(connection: socket.socket, reply: dict) -> None:
    """Send one JSON line and close; a controller that gave up has closed its end: no matter."""
    with contextlib.suppress(OSError):
        connection.sendall(json.dumps(reply).encode() + b"\n")
    connection.close()


def serve_port(run: RunDir, node: str, address: str, lock: int) -> int:
    """Serve the node's orders on a port of `address` until the run goes idle (see the module docstring)."""
    home = run.standby(node)
    try:
        port = OrderPort(run, node, address)
    except OSError as error:
        print(f"lazarus standby {node}: cannot listen on {address} ({error}); the node starts cold", flush=True)
        return 1
    write_json_atomic(home / "ready", {"address": port.address, "port": port.port, "warm": None})
    warmth = Warmth(run)
    write_json_atomic(home / "ready", {"address": port.address, "port": port.port, **say_warm(node, warmth)})
    prepares = warmth.built_in and warmth.threads == 1
    launchers = Launchers(run)
    idle_since = time.monotonic()
    while run.spec_file.exists():
        readable, _, _ = select.select([port], [], [], LOOP_SECONDS)
        launchers.reap()
        if readable:
            order, connection = port.take()
            if order is not None:
                _follow_order(run, node, order, connection, launchers, [port.fileno(), lock], prepares)
            idle_since = time.monotonic()
        elif launchers.running or launcher_alive(run):
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since > IDLE_EXIT_SECONDS:
            print(f"lazarus standby {node}: no launcher alive for {IDLE_EXIT_SECONDS:g} s; exiting", flush=True)
            break
    return 0


def _follow_order(run: RunDir, node: str, order: dict, connection, launchers: Launchers, private, prepares) -> None:
    if "stop" in order:
        answer(connection, launchers.stop(int(order["stop"])))
    elif "prefetch" in order:
        answer(connection, {"accepted": True})  # the controller does not wait for the reads
        if prepares:
            from lazarus.trainer.gpt import prepared

            wanted = order["prefetch"]
            read = prepared.prefetch(run, int(wanted["incarnation"]), [int(r) for r in wanted["ranks"]])
            print(f"lazarus standby {node}: read the states of survivors {read}", flush=True)
    else:
        # The launcher closes the connection's descriptor in its fork (with the listening socket
        # and the lock): only this process answers, and a launcher never holds the controller's end.
        answer(connection, launchers.start(order, node, [*private, connection.fileno()]))
        if prepares:
            from lazarus.trainer.gpt import prepared

            prepared.forget_states()  # the launcher's ranks have them; the next fault brings new ones
