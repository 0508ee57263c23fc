"""Entry point of a node's warm standby: `python -m lazarus.trainer.agent.standby`. It serves the nodes a
backend names (forks, on the local backend), or one node's port (Kubernetes and Slurm), or one node."""

from __future__ import annotations

import os
import sys

from lazarus.schema.contract import (
    ENV_NODE,
    ENV_RUN_DIR,
    ENV_STANDBY_ADDRESS,
    ENV_STANDBY_LOCK_FDS,
    ENV_STANDBY_NODES,
)
from lazarus.schema.files import take_lock
from lazarus.schema.rundir import RunDir
from lazarus.trainer.agent.standby import record_pid, serve


def main() -> None:
    """Entry point: `python -m lazarus.trainer.agent.standby`."""
    if ENV_STANDBY_NODES in os.environ and ENV_RUN_DIR in os.environ:
        from lazarus.trainer.agent.standby.fork import serve_nodes

        nodes = os.environ.pop(ENV_STANDBY_NODES).split(",")
        locks = [int(fd) for fd in os.environ.pop(ENV_STANDBY_LOCK_FDS).split(",")]
        sys.exit(serve_nodes(RunDir(os.environ[ENV_RUN_DIR]), nodes, locks))
    missing = [name for name in (ENV_RUN_DIR, ENV_NODE) if name not in os.environ]
    if missing:
        raise SystemExit(f"lazarus standby: missing environment variables {', '.join(missing)} (trainer/CONTRACT.md)")
    run, node = RunDir(os.environ[ENV_RUN_DIR]), os.environ[ENV_NODE]
    if ENV_STANDBY_ADDRESS in os.environ:
        from lazarus.trainer.agent.standby.port import serve_port

        lock = take_lock(run.standby(node) / "lock")
        if lock is None:
            sys.exit(0)  # this node has a live standby
        record_pid(run.standby(node))  # where the backend shares this host, it ends the standby by its group
        sys.exit(serve_port(run, node, os.environ[ENV_STANDBY_ADDRESS], lock))
    sys.exit(serve(run, node))


main()
