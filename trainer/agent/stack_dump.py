"""Inside a rank: dump every Python thread's stack to the rank's stacks file on SIGUSR1, so that the
controller can show where a hung rank waited (schema/rundir.py `stacks_file`, trainer/CONTRACT.md).

The handler is faulthandler's: it runs in C, at the signal, so it dumps a rank whose main thread
is blocked inside a collective (holding no GIL, never back in the interpreter's loop), which a
Python-level handler would never reach. SIGUSR1's default action ends a process, so a rank is
signalled only where it says it has the handler: the stacks file exists only once this module
registered it, and its first line names the process that did (pid and kernel start time).

Standard library only, and loaded by path too (trainer/agent/rank_hook/sitecustomize.py): a rank's
interpreter may not have Lazarus installed, and a rank must not pay for more imports at startup.
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal

ENV_STACKS_FILE = "LAZARUS_STACKS_FILE"
"""The rank's stacks file; set by the launcher, taken (removed from the environment) by the process
that registers, so that its own child processes do not register over it."""

ENV_PYTHONPATH = "PYTHONPATH"
"""Python's own: the launcher puts HOOK_DIR first on it, so that every rank registers its stack dump."""

HOOK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank_hook")
"""The folder the launcher puts first on a rank's PYTHONPATH: it holds only `sitecustomize.py`,
which registers the dump in a new interpreter (no change to the user's script)."""

HEADER = "# lazarus stacks of pid {pid}, start time {start} (clock ticks since boot); dumps follow on SIGUSR1\n"
_HEADER = re.compile(r"^# lazarus stacks of pid (\d+), start time (\d+) ")

_registered = None  # the open stacks file: faulthandler writes to its descriptor


def _start_time(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        # The command name (field 2) may contain spaces; fields after it are fixed.
        return int(stat.read().rsplit(")", 1)[1].split()[19])


def register(path: str) -> bool:
    """Dump all threads' stacks to `path` on SIGUSR1 (appending: one dump per signal); False where
    this process cannot (no /proc, an unwritable folder). The file appears whole, header and all,
    by rename: whoever sees it may signal the process it names."""
    global _registered
    if not hasattr(signal, "SIGUSR1"):
        return False
    pid = os.getpid()
    temporary = f"{path}.{pid}.partial"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        # Unbuffered: faulthandler writes to the descriptor, after the header. The file stays open
        # for the life of the process. Appending: each dump lands at the end, after any note the
        # launcher appended meanwhile (trainer/agent/stacks.py, a process that could not dump).
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND
        stacks = os.fdopen(os.open(temporary, flags, 0o666), "wb", buffering=0)
        stacks.write(HEADER.format(pid=pid, start=_start_time(pid)).encode())
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True, chain=False)
        os.replace(temporary, path)
    except (OSError, RuntimeError, ValueError):
        try:
            os.unlink(temporary)
        except OSError:
            pass
        return False
    _registered = stacks
    return True


def register_from_environment(hook_dir: str | None = None) -> bool:
    """Register the stacks file the launcher named in the environment, once per rank: the variable
    goes, and so does `hook_dir` from PYTHONPATH (the user's own PYTHONPATH is what children see)."""
    path = os.environ.pop(ENV_STACKS_FILE, None)
    pythonpath = os.environ.get(ENV_PYTHONPATH)
    if hook_dir is not None and pythonpath is not None:
        # The launcher put it first (with_dump_hook); what follows is the user's, as it was.
        if pythonpath == hook_dir:
            del os.environ[ENV_PYTHONPATH]
        elif pythonpath.startswith(hook_dir + os.pathsep):
            os.environ[ENV_PYTHONPATH] = pythonpath[len(hook_dir) + 1 :]
    return bool(path) and register(path)


def with_dump_hook(env: dict, stacks_file: str) -> dict:
    """`env` for a rank whose Python processes should register `stacks_file` at startup: the hook
    folder (HOOK_DIR) first on its PYTHONPATH, and the file named."""
    pythonpath = env.get(ENV_PYTHONPATH)
    hooked = HOOK_DIR if pythonpath is None else HOOK_DIR + os.pathsep + pythonpath
    return {**env, ENV_PYTHONPATH: hooked, ENV_STACKS_FILE: stacks_file}


def registered_process(path) -> tuple[int, int] | None:
    """(pid, kernel start time) of the process that registered the stacks file `path`, None when
    there is none (the rank is not Python, or has not started yet)."""
    try:
        with open(path, "rb") as stacks:
            first = stacks.readline(200).decode(errors="replace")
    except OSError:
        return None
    match = _HEADER.match(first)
    return (int(match.group(1)), int(match.group(2))) if match else None
