"""The local backend's standbys started together: one interpreter warms up (the imports, the
built-in trainer's model) once and forks one standby per node (trainer/agent/standby/), since the
local backend's nodes share one machine and N interpreters importing torch would only cost N
times the CPU (4.2 s each here)."""

from __future__ import annotations

import gc
import os
import sys
import time
import traceback

from lazarus.schema.contract import ENV_NODE
from lazarus.schema.files import process_start_time, read_json, write_json_atomic
from lazarus.schema.rundir import RunDir
from lazarus.trainer.agent.standby import Warmth, serve

RECORD_WAIT_SECONDS = 10.0
"""How long the shared interpreter waits for the backend's pid records of its nodes before it forks (seconds)."""


def serve_nodes(run: RunDir, nodes: list[str], locks: list[int]) -> int:
    """The standbys of several nodes from one interpreter (the local backend's nodes share one
    machine): the imports and the model once, then a fork per node, in a session of its own
    with its lock and its FIFO, that serves as the node's standby; this process then exits.

    The backend recorded this process as each node's standby; a fork records itself before it
    leaves this process group, so a kill that read either record reaches it.
    """
    homes = [run.standby(node) for node in nodes]
    fifos = [os.open(home / "orders", os.O_RDWR) for home in homes]  # orders wait in the pipes meanwhile
    warmth = Warmth(run)
    deadline = time.monotonic() + RECORD_WAIT_SECONDS
    while time.monotonic() < deadline and not all(
        (read_json(home / "pid") or {}).get("pid") == os.getpid() for home in homes
    ):
        time.sleep(0.01)  # a fork's own record must come after the backend's
    gc.freeze()  # what every fork shares stays shared: see launch_order
    for node, home, lock, fifo in zip(nodes, homes, locks, fifos, strict=True):
        if os.fork():
            continue
        code = 1
        try:
            for fd in locks + fifos:
                if fd not in (lock, fifo):
                    os.close(fd)
            log = os.open(home / "log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.close(log)
            os.environ[ENV_NODE] = node
            # Recorded before it leaves this group, with the group it is about to lead: a kill
            # that read the backend's record ends this group and the fork in it; one that read
            # this record ends the fork by its pid (infra/processes.kill_group).
            me = os.getpid()
            write_json_atomic(home / "pid", {"pid": me, "pgid": me, "start_time": process_start_time(me)})
            os.setsid()
            code = serve(run, node, lock, fifo, warmth)
        except BaseException:  # noqa: BLE001 - a forked standby ends here, whatever happened
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return 0
