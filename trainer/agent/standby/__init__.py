"""A node's warm standby: an interpreter with torch and the trainer already imported, waiting
for orders to start the node's ranks of an incarnation.

One per node of a run (active nodes and hot spares alike), each in its own session. The local
backend starts the standbys it needs at once as `python -m lazarus.trainer.agent.standby` with
LAZARUS_RUN_DIR, LAZARUS_STANDBY_NODES and their locks' descriptors set: one interpreter
imports and builds the model, then forks one standby per node (trainer/agent/standby/fork.py), since its nodes
share one machine; with LAZARUS_NODE instead, the process is that node's standby itself. A cold
start pays a new interpreter and `import torch` (two to three seconds on a loaded 2-core
node) on every recovery; here that is paid once, before any fault. An order is one JSON line
written to the node's FIFO ({"incarnation", "node_index", "resume_step"}); the standby forks
a launcher for it (its own session, so the backend kills an incarnation by killing its group
without touching the standby), and the launcher forks the ranks, each of which runs the
trainer's `python -m module` or `python script.py` in place. For the built-in trainer the
standby also builds the model before any order and, on a prefetch order from drain
({"prefetch": {"incarnation", "ranks"}}), reads the survivors' states its ranks will load
(trainer/gpt/prepared.py). Nothing here starts a thread (it is checked), so forking is safe: a
child starts exactly as a fresh process would after its imports.

The standby exits when its run has had no live launcher for `IDLE_EXIT_SECONDS` (the run
ended, failed or is paused: the next launch starts a new standby), or when its run directory
is gone.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import runpy
import select
import signal
import sys
import threading
import time
import traceback

from lazarus.schema.contract import launcher_env
from lazarus.schema.files import lock_is_held, process_start_time, take_lock, write_json_atomic
from lazarus.schema.run import BUILT_IN_TRAINER, RunSpec
from lazarus.schema.rundir import RunDir
from lazarus.trainer.agent import stack_dump
from lazarus.trainer.agent.teardown import keep_destroyed_groups

IDLE_EXIT_SECONDS = 30.0
"""How long a standby waits with no live launcher in its run before it exits (seconds)."""

# What the built-in trainer imports before its first step; torch.distributed.checkpoint also
# brings in the compiler stack that the optimizer would otherwise import at its first step.
_BUILT_IN_IMPORTS = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.pipelining",
    "lazarus.trainer.gpt.train",
    "lazarus.trainer.gpt.step",
    "lazarus.trainer.gpt.model",
    "lazarus.trainer.sdk.checkpoint",
    "lazarus.trainer.gpt.data",
]
# A user's script: what a typical DDP/FSDP script reaches before its first step (DDP's
# constructor alone imports the compiler stack: more than a second here).
_ANY_PYTHON_IMPORTS = [
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch.distributed.checkpoint",
    "torch._dynamo",
    "lazarus.session",
]

_fork_safe = True
"""False once this process has more than one thread: a fork would copy locks other threads hold
(an OpenMP pool, say), so ranks are exec'd instead (cold, but correct)."""


def warm_entry(command: list[str]) -> tuple[str, str, list[str]] | None:
    """How a forked rank runs `command` in place: ("module"|"path", target, argv), or None if it
    must be exec'd (not `python -m module ...` or `python script.py ...`)."""
    if len(command) < 2 or command[0] not in ("python", "python3", sys.executable):
        return None
    if command[1] == "-m" and len(command) >= 3:
        return "module", command[2], command[2:]
    if not command[1].startswith("-"):
        return "path", command[1], command[1:]
    return None


def warm_up(command: list[str]) -> list[str]:
    """Import what the trainer will need; returns the modules that failed to import."""
    if warm_entry(command) is None:
        return []  # it will be exec'd: nothing imported here would help it
    failed = []
    for name in _BUILT_IN_IMPORTS if command == BUILT_IN_TRAINER else _ANY_PYTHON_IMPORTS:
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - a user's environment without torch still runs its ranks, cold
            failed.append(name)
    return failed


class ForkedRank:
    """A rank forked from this process; `wait()` returns what Popen.returncode would."""

    def __init__(self, pid: int):
        self.pid = pid

    def wait(self) -> int:
        _, status = os.waitpid(self.pid, 0)
        return os.waitstatus_to_exitcode(status)


def _exit_code(error: SystemExit) -> int:
    if error.code is None:
        return 0
    if isinstance(error.code, int):
        return error.code
    print(error.code, file=sys.stderr)
    return 1


def _run_in_place(command: list[str], env: dict) -> int:
    """In a forked child: become the rank (environment, argv, sys.path) and run its entry point."""
    os.environ.clear()
    os.environ.update(env)
    entry = warm_entry(command)
    if entry is None or not _fork_safe:
        os.execvpe(command[0], command, env)  # a new interpreter registers at startup (rank_hook)
    stack_dump.register_from_environment(stack_dump.HOOK_DIR)
    kind, target, argv = entry
    keep_destroyed_groups()
    sys.argv = list(argv)
    # A new interpreter would have put the rank's PYTHONPATH on sys.path; this one started earlier.
    for folder in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):
        if folder and folder not in sys.path:
            sys.path.insert(1, folder)
    try:
        if kind == "module":
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
        code = 0
    except SystemExit as error:
        code = _exit_code(error)
    except BaseException:  # noqa: BLE001 - nothing may unwind from a forked rank into the standby's loop
        traceback.print_exc()
        code = 1
    # What interpreter shutdown would do (as multiprocessing's forked children do): wait for
    # non-daemon threads (an async checkpoint's writer), run atexit hooks, flush.
    try:
        threading._shutdown()  # pyright: ignore[reportAttributeAccessIssue] - private: typeshed leaves it out
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - as above: the exit code says it failed
        traceback.print_exc()
        code = code or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stream must not change the exit code
            pass
    return code


def fork_starter(private_fds: list[int]):
    """A `start_rank` for lazarus.trainer.agent.launcher.launch_node that forks this warm process.

    `private_fds` are descriptors of the launcher that a rank must not inherit (its node
    lock: a rank holding it would keep the node's launcher looking alive).
    """

    def start_rank(command: list[str], env: dict, log, lock_fd: int, cwd) -> ForkedRank:
        pid = os.fork()
        if pid:
            return ForkedRank(pid)
        code = 1
        try:
            for fd in private_fds:
                os.close(fd)
            os.chdir(cwd)
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
            os.set_inheritable(lock_fd, True)  # kept across an exec, as Popen's pass_fds would
            code = _run_in_place(command, env)
        finally:
            os._exit(code)

    return start_rank


def launch_order(run: RunDir, node: str, order: dict, private_fds: list[int], checks_pool: bool = True) -> int:
    """Fork a launcher (own session) that starts this node's ranks of the ordered incarnation;
    returns its pid. `checks_pool`: refuse where the local backend's pool marks the node dead or
    quarantined (a Kubernetes standby has no such mark: its pod is deleted with its node)."""
    # Everything the standby holds (torch's modules, the prepared model, prefetched states)
    # moves to the permanent generation: a collection in a rank would otherwise touch every
    # inherited object and copy its page (copy-on-write) on the rank's critical path.
    gc.freeze()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        code = _forked_launcher(run, node, order, private_fds, checks_pool)
    except BaseException:  # noqa: BLE001 - a forked launcher ends here, whatever happened
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _forked_launcher(run: RunDir, node: str, order: dict, private_fds: list[int], checks_pool: bool) -> int:
    """launch_order's child: the launcher in a session of its own, its output to the node's log;
    returns its exit code."""
    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the launcher waits for its ranks itself
    for fd in private_fds:
        os.close(fd)
    incarnation, index = int(order["incarnation"]), int(order["node_index"])
    log_path = run.incarnation(incarnation) / "nodes" / f"{index}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    from lazarus.trainer.agent.launcher import launch_node

    node_lock = take_lock(run.node_lock_file(incarnation, index))
    if node_lock is None:
        return 0  # this node's launcher runs already (a repeated order)
    # The backend marks an incarnation ended, or the node dead, before it kills their
    # processes; this launcher took its lock first, so either it sees the mark here or the
    # backend sees the lock and kills it.
    unusable = checks_pool and run.unusable_marker(node).exists()
    if run.ended_file(incarnation).exists() or unusable:
        print(f"lazarus standby: incarnation {incarnation} ended or {node} is dead; not starting it", flush=True)
        return 0
    order_env = launcher_env(str(run.root), incarnation, node, index, int(order["resume_step"]))
    return launch_node(run, incarnation, index, {**os.environ, **order_env}, start_rank=fork_starter([node_lock]))


def _follow(run: RunDir, node: str, order: dict, private_fds: list[int], prepares: bool) -> None:
    """Carry out one order: read the survivors' states the node's ranks will load (a prefetch,
    sent by drain), or start a launcher for an incarnation."""
    if "prefetch" in order:
        if prepares:
            from lazarus.trainer.gpt import prepared

            wanted = order["prefetch"]
            began = time.monotonic()
            read = prepared.prefetch(run, int(wanted["incarnation"]), [int(r) for r in wanted["ranks"]])
            print(
                f"lazarus standby {node}: read the states of survivors {read} of incarnation "
                f"{wanted['incarnation']} in {time.monotonic() - began:.3f} s",
                flush=True,
            )
        return
    launch_order(run, node, order, private_fds)
    if prepares:
        from lazarus.trainer.gpt import prepared

        prepared.forget_states()  # the launcher's ranks have them; the next fault brings new ones


def launcher_alive(run: RunDir) -> bool:
    """Whether a launcher of the run's newest incarnation lives (its node lock is held)."""
    incarnations = run.incarnations()
    if not incarnations:
        return False
    newest = run.incarnation(incarnations[-1]) / "nodes"
    return any(lock_is_held(lock) for lock in newest.glob("*.lock")) if newest.is_dir() else False


class Warmth:
    """What warming up gave: the imports that failed, whether the built-in trainer's model is
    prepared, the threads left running, and how long it took (seconds)."""

    def __init__(self, run: RunDir):
        spec = RunSpec.model_validate_json(run.spec_file.read_text())
        began = time.time()
        self.failed = warm_up(spec.trainer.command)
        self.built_in = spec.trainer.command == BUILT_IN_TRAINER and not self.failed
        if self.built_in and len(os.listdir("/proc/self/task")) == 1:
            from lazarus.trainer.gpt import prepared

            prepared.prepare_model(spec.trainer, spec.layout.dp * spec.layout.dp_shard)
        global _fork_safe
        self.threads = len(os.listdir("/proc/self/task"))
        _fork_safe = self.threads == 1
        self.seconds = time.time() - began


def say_warm(node: str, warmth: Warmth) -> dict:
    """Log how warming up went; returns it as the `ready` file records it."""
    print(
        f"lazarus standby {node}: "
        + (
            f"warm after {warmth.seconds:.2f} s"
            if _fork_safe
            else f"{warmth.threads} threads after the imports (OMP_NUM_THREADS > 1?): ranks will be exec'd, cold"
        )
        + (f" (could not import {', '.join(warmth.failed)})" if warmth.failed else ""),
        flush=True,
    )
    return {
        "import_seconds": warmth.seconds,
        "failed_imports": warmth.failed,
        "threads": warmth.threads,
        "warm": _fork_safe,
    }


def record_pid(home) -> None:
    """Record this process as the standby in `home` (its pid file, which a kill reads)."""
    write_json_atomic(
        home / "pid", {"pid": os.getpid(), "pgid": os.getpgid(0), "start_time": process_start_time(os.getpid())}
    )


def serve(run: RunDir, node: str, lock: int | None = None, orders: int | None = None, warmth=None) -> int:
    """Warm up (unless `warmth` says it was, before a fork), then start a launcher for each order
    until the run goes idle; returns the exit code. `lock` and `orders`: the node's standby lock
    and FIFO, when already open."""
    home = run.standby(node)
    if lock is None:
        lock = take_lock(home / "lock")
        if lock is None:
            return 0  # this node has a live standby
    record_pid(home)
    # O_RDWR: the open neither blocks for a writer nor sees end-of-file when one leaves, and an
    # order written while the imports below run waits in the pipe.
    if orders is None:
        orders = os.open(home / "orders", os.O_RDWR)
    warmth = warmth or Warmth(run)
    write_json_atomic(home / "ready", say_warm(node, warmth))
    built_in = warmth.built_in
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # launchers are reaped by the kernel
    pending = b""
    idle_since = time.monotonic()
    while run.spec_file.exists():
        readable, _, _ = select.select([orders], [], [], 1.0)
        if readable:
            pending += os.read(orders, 65536)
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.strip():
                    _follow(run, node, json.loads(line), [orders, lock], built_in and _fork_safe)
            idle_since = time.monotonic()
        elif launcher_alive(run):
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since > IDLE_EXIT_SECONDS:
            print(f"lazarus standby {node}: no launcher alive for {IDLE_EXIT_SECONDS:g} s; exiting", flush=True)
            break
    return 0
