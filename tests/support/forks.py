"""Processes forked from one server process that imported torch once per session (Python's
forkserver), for the tests that start many: the trainer tests' ranks (tests/support/ranks.py), the
fake kubelet's containers (tests/k8s/kubelet.py), and the local backend's node launchers and
standbys started in the test's own process (the `forked_nodes` fixture).

A spawned interpreter imports torch again: about 1.2 s of CPU, 2.3 s with what a warm standby
imports. On a real cluster each node does that on its own cores, in parallel; here every run's
nodes share two cores. The forkserver never runs a torch op or starts a thread, so a fork starts as
a fresh process would after its imports, as the warm standbys fork (trainer/agent/standby/).
What stays exec'd, as in production: every node of a worker run as its own process (the chaos
matrix, `lazarus launch`, the demo), a command that is not `python -m`, and an environment that
differs from the forkserver's in more than the contract's LAZARUS_ variables (an import may read it).
"""

from __future__ import annotations

import atexit
import ctypes
import multiprocessing
import os
import runpy
import sys
import time
import traceback
from multiprocessing import reduction
from pathlib import Path

from lazarus.infra import processes
from lazarus.schema.contract import ENV_STANDBY_LOCK_FDS

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

SESSION_WAIT_SECONDS = 10.0
"""How long a start waits for its fork to lead a session of its own (seconds)."""

_environ_at_start: dict[str, str] = {}
"""The environment the forkserver started with (and imported torch in)."""


def context():
    """The forkserver context, its preload set (it takes effect when the server first starts)."""
    if not _environ_at_start:
        _environ_at_start.update(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    forks = multiprocessing.get_context("forkserver")
    forks.set_forkserver_preload(PRELOAD)
    return forks


class Inherited:
    """A descriptor the fork holds, as Popen's pass_fds gives it (sent to the forkserver)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _received, (reduction.DupFd(self.fd),)


def _received(duplicate) -> int:
    fd = duplicate.detach()
    os.set_inheritable(fd, True)
    return fd


class ForkedProcess:
    """`python -m module args` forked from the forkserver: in a session of its own, with exactly
    `env`, its output appended to `log`, holding `pass_fds`, named `name` where given; Popen's
    `pid`, `poll`, `returncode` and `wait`."""

    def __init__(self, command: list[str], env: dict, log: Path, name: str | None = None, pass_fds=()):
        assert command[1:2] == ["-m"] and len(command) > 2, command
        fds = [(fd, Inherited(fd)) for fd in pass_fds]
        self._process = context().Process(
            target=run_module, args=(command[2:], env, os.getcwd(), str(log), name, fds), daemon=False
        )
        self._process.start()
        self.pid = self._process.pid
        # The caller records the pid as the group a kill ends: the fork must lead it first.
        deadline = time.monotonic() + SESSION_WAIT_SECONDS
        while time.monotonic() < deadline:
            try:
                if os.getpgid(self.pid) == self.pid:
                    break
            except ProcessLookupError:
                break
            time.sleep(0.001)

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self) -> int | None:
        self._process.join()
        return self._process.exitcode


def run_module(argv: list[str], env: dict, cwd: str, log: str, name: str | None, fds: list) -> None:
    """The body of a forked `python -m argv[0] argv[1:]` (ForkedProcess); exits as the
    interpreter would, with the module's exit code."""
    os.setsid()
    if name is not None:  # what its forks inherit, where the environment in /proc is the forkserver's
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    numbers = dict(fds)  # the parent's descriptor -> this process's
    if ENV_STANDBY_LOCK_FDS in env:
        env = {
            **env,
            ENV_STANDBY_LOCK_FDS: ",".join(str(numbers[int(n)]) for n in env[ENV_STANDBY_LOCK_FDS].split(",")),
        }
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


def imports_alike(env: dict) -> bool:
    """Whether `env` differs from the forkserver's only where no import reads it: the contract's
    LAZARUS_ variables and pytest's own."""
    context()
    keys = set(env) | set(_environ_at_start)
    return all(
        env.get(key) == _environ_at_start.get(key)
        for key in keys
        if not key.startswith("LAZARUS_") and key != "PYTEST_CURRENT_TEST"
    )


def start_in_session(command: list[str], env: dict, log: Path, pass_fds: tuple[int, ...] = ()):
    """infra/processes.start_in_session, forking `python -m` commands whose imports the forkserver
    made alike; anything else is exec'd as in production."""
    if command[0] != sys.executable or command[1:2] != ["-m"] or not imports_alike(env):
        return REAL_START(command, env, log, pass_fds)
    log.parent.mkdir(parents=True, exist_ok=True)
    return ForkedProcess(command, env, log, pass_fds=pass_fds)


REAL_START = processes.start_in_session
