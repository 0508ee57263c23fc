"""Processes forked from one server process that imported torch once per session (Python's
forkserver), for the tests that start many: the trainer tests' ranks (tests/support/ranks.py) and
the fake kubelet's containers (tests/k8s/kubelet.py).

A spawned interpreter imports torch again: about 1.2 s of CPU, 2.7 s with what a warm standby
imports. On a real cluster each node does that on its own cores, in parallel; here five nodes'
standby pods share two cores and take 13 s of CPU between them. The forkserver never runs a torch
op or starts a thread, so a fork starts as a fresh process would after its imports (as the warm
standbys fork: trainer/agent/standby/).
"""

from __future__ import annotations

import atexit
import ctypes
import multiprocessing
import os
import runpy
import sys
import traceback

PRELOAD = [
    "tests.support.fork_threads",
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.pipelining",
    "lazarus.trainer.gpt.step",
    "lazarus.trainer.gpt.train",
    "lazarus.trainer.sdk.checkpoint",
    "lazarus.trainer.agent.standby",
    "lazarus.trainer.agent.launcher",
]
"""What the forkserver imports before its first fork: what a rank and a warm standby import."""

PR_SET_NAME = 15
"""prctl(2): set the calling thread's name, which /proc/<pid>/comm shows and a fork inherits."""


def context():
    """The forkserver context, its preload set (it takes effect when the server first starts)."""
    forks = multiprocessing.get_context("forkserver")
    forks.set_forkserver_preload(PRELOAD)
    return forks


def run_module(argv: list[str], env: dict[str, str], cwd: str, log: str, name: str) -> None:
    """The body of a forked `python -m argv[0] argv[1:]`: in a session of its own, with exactly
    `env`, in `cwd`, its output appended to `log`, its thread named `name` (what its forks
    inherit, where the environment they show in /proc is the forkserver's); exits with the
    module's exit code."""
    os.setsid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = ["-m", *argv[1:]]
    code = 1
    try:
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else 0 if exit.code is None else 1
        if not isinstance(exit.code, int | None):
            print(exit.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - printed and exit code 1, as the interpreter does
        traceback.print_exc()
    finally:
        # As an interpreter ends: its exit handlers (multiprocessing's child would skip them).
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
