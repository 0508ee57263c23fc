"""Small filesystem primitives both sides of the contract rely on: atomic JSON, liveness locks,
process identity. No models here; schema/contract.py types what is written with them."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import struct
import time
from pathlib import Path


def write_json_atomic(path: Path, data: dict | str) -> None:
    """Write JSON (a dict, or a document already serialized) so a reader sees the old or the new
    content, never a torn file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as handle:
        handle.write(data if isinstance(data, str) else json.dumps(data))
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    """The JSON in a file, or None when it does not exist (yet)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def read_text(path: Path) -> str | None:
    """A file's text, or None when it does not exist (yet)."""
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


_WHOLE_FILE = "hhqqi4x"  # struct flock on Linux x86-64 and arm64: type, whence, start, len, pid
_EXCLUSIVE = struct.pack(_WHOLE_FILE, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)


def take_lock(path: Path) -> int | None:
    """An open descriptor holding the exclusive lock on `path`, or None if a live process holds it.

    Liveness locks: the launcher takes a rank's (or the backend a launcher's) lock and hands
    the descriptor to the child it starts, so the lock lives exactly as long as that process.
    They are open file description locks (F_OFD_SETLK): like flock, one belongs to the open
    file and passes with the descriptor through fork and exec; unlike flock, it can be tested
    without being taken (lock_is_held). A test by taking a shared flock made a take that
    came at the same instant fail, and a launcher then took its node for one already running.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _EXCLUSIVE)
    except (BlockingIOError, PermissionError):  # EAGAIN or EACCES: another open file holds it
        os.close(fd)
        return None
    return fd


def lock_is_held(path: Path) -> bool:
    """True while a process holds the lock on `path` (tested, never taken: F_OFD_GETLK)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _EXCLUSIVE)
    finally:
        os.close(fd)
    return struct.unpack(_WHOLE_FILE, answer)[0] != fcntl.F_UNLCK


def process_state(pid: int) -> str | None:
    """The state letter of /proc/PID/stat (R, S, D, T, Z...); None when the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def process_start_time(pid: int) -> int | None:
    """Kernel start time of a process (clock ticks since boot), None if it is gone.

    Recorded with a pid so that a later kill can tell the process from another that got
    the same pid.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may contain spaces; fields after it are fixed.
    return int(stat.rsplit(")", 1)[1].split()[19])


def write_once(path: Path, text: str) -> bool:
    """Create `path` holding `text` unless it exists; True if this call wrote it.

    A hard link of a complete temporary file is atomic and fails if the name exists, also on
    a shared filesystem where locks may not be: of two writers exactly one wins, and a reader
    never sees a torn file.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}")
    temporary.write_text(text)
    try:
        os.link(temporary, path)
        return True
    except FileExistsError:
        return False
    finally:
        temporary.unlink()
