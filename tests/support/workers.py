"""The environment of a `lazarus` child process, the demo's --json, and `lazarus worker` as a child
process (lazarus.chaos.bed's), so a test can SIGKILL it like a crashed controller."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from lazarus.chaos.bed import WorkerProcess

__all__ = ["WorkerProcess", "demo_json", "lazarus_env"]


def lazarus_env(env, home: Path, queue: str) -> dict:
    """The environment of a `lazarus` process that uses the test's Temporal `env`, LAZARUS_HOME and task queue."""
    return {
        **os.environ,
        "LAZARUS_TEMPORAL_ADDRESS": env.client.service_client.config.target_host,
        "LAZARUS_HOME": str(home),
        "LAZARUS_TASK_QUEUE": queue,
    }


def demo_json(env: dict, *args: str, cwd: Path | None = None) -> dict:
    """Run `lazarus demo --json ARGS` to its end in `env`; its final status, the one document on stdout."""
    done = subprocess.run(
        [sys.executable, "-m", "lazarus.cli", "demo", "--json", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)
