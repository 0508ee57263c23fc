"""The contract between controller and trainer: environment variables and run-directory files.

trainer/CONTRACT.md says what each variable and file means; this module names them.

Environment of every rank process (torchrun's names, plus Lazarus's own):

    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT   as torchrun sets them
    LAZARUS_RUN_DIR       the run directory below
    LAZARUS_INCARNATION   launch counter K: 0 at start, +1 per recovery
    LAZARUS_NODE          name of the node the rank runs on
    LAZARUS_RESUME_STEP   checkpoint step to restore (0: start from scratch); chosen by the controller
    LAZARUS_FAIL_AT       injected fault: `step:N` or `checkpoint:N` (the rank SIGKILLs itself there)
    LAZARUS_NODE_INDEX    (launcher only) the node's index in the assignment

Both sides build paths only through RunDir, so the file layout is written down once:

    <run_dir>/spec.json                         the RunSpec (JSON)
    <run_dir>/inventory.json                    the local backend's nodes
    <run_dir>/metrics.jsonl                     rank 0: one line per optimizer step
    <run_dir>/checkpoints/step-N/               torch.distributed.checkpoint folder
    <run_dir>/checkpoints/step-N/COMMITTED      written last; only then does step-N count
    <run_dir>/incarnations/K/assignment.json    nodes and rendezvous of incarnation K
    <run_dir>/incarnations/K/ranks/R.lock       held (flock) by rank R's process while it lives
    <run_dir>/incarnations/K/ranks/R.pid        pid and start time of rank R's process
    <run_dir>/incarnations/K/heartbeat/R.json   rank R's last completed step and its time
    <run_dir>/incarnations/K/exit/R.json        rank R's exit code, when it ended on its own
    <run_dir>/incarnations/K/logs/R.log         rank R's stdout and stderr
    <run_dir>/incarnations/K/samples/R.jsonl    data-loading rank R: sample ids trained per step
    <run_dir>/incarnations/K/stop               the controller asks the ranks to checkpoint and exit
    <run_dir>/incarnations/K/errors/R.json      torch's @record error file of rank R (TORCHELASTIC_ERROR_FILE)
    <run_dir>/incarnations/K/nodes/I.lock, .pid the launcher of node I (held while it lives)
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import time
from pathlib import Path

ENV_RUN_DIR = "LAZARUS_RUN_DIR"
ENV_INCARNATION = "LAZARUS_INCARNATION"
ENV_NODE = "LAZARUS_NODE"
ENV_RESUME_STEP = "LAZARUS_RESUME_STEP"
ENV_FAIL_AT = "LAZARUS_FAIL_AT"
ENV_NODE_INDEX = "LAZARUS_NODE_INDEX"
ENV_STANDBY_LOCK_FD = "LAZARUS_STANDBY_LOCK_FD"

COMMIT_MARKER = "COMMITTED"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class RunDir:
    """Paths of one run's directory."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    @property
    def spec_file(self) -> Path:
        return self.root / "spec.json"

    @property
    def inventory_file(self) -> Path:
        return self.root / "inventory.json"

    @property
    def metrics_file(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def incarnation(self, k: int) -> Path:
        """Folder of incarnation k."""
        return self.root / "incarnations" / str(k)

    def assignment_file(self, k: int) -> Path:
        return self.incarnation(k) / "assignment.json"

    def lock_file(self, k: int, rank: int) -> Path:
        return self.incarnation(k) / "ranks" / f"{rank}.lock"

    def pid_file(self, k: int, rank: int) -> Path:
        return self.incarnation(k) / "ranks" / f"{rank}.pid"

    def heartbeat_file(self, k: int, rank: int) -> Path:
        return self.incarnation(k) / "heartbeat" / f"{rank}.json"

    def exit_file(self, k: int, rank: int) -> Path:
        return self.incarnation(k) / "exit" / f"{rank}.json"

    def log_file(self, k: int, rank: int) -> Path:
        return self.incarnation(k) / "logs" / f"{rank}.log"

    def samples_file(self, k: int, rank: int) -> Path:
        return self.incarnation(k) / "samples" / f"{rank}.jsonl"

    def stop_file(self, k: int) -> Path:
        return self.incarnation(k) / "stop"

    def error_file(self, k: int, rank: int) -> Path:
        """Where torch's @record writes rank R's exception (TORCHELASTIC_ERROR_FILE)."""
        return self.incarnation(k) / "errors" / f"{rank}.json"

    def node_lock_file(self, k: int, node_index: int) -> Path:
        """Held (flock) by the launcher of node `node_index` while it lives."""
        return self.incarnation(k) / "nodes" / f"{node_index}.lock"

    def node_pid_file(self, k: int, node_index: int) -> Path:
        return self.incarnation(k) / "nodes" / f"{node_index}.pid"

    def ended_file(self, k: int) -> Path:
        """Written by the backend before it kills an incarnation: a launcher started later must not run."""
        return self.incarnation(k) / "ended"

    def standby(self, node: str) -> Path:
        """The warm standby of a node: `orders` (a FIFO), `lock` (held while it lives), `pid`, `ready`, `log`."""
        return self.root / "standby" / node

    def incarnations(self) -> list[int]:
        """Incarnations that have an assignment, in order."""
        base = self.root / "incarnations"
        if not base.is_dir():
            return []
        return sorted(int(p.name) for p in base.iterdir() if p.name.isdigit() and (p / "assignment.json").exists())

    def checkpoint(self, step: int) -> Path:
        """Folder of the checkpoint taken after `step` steps."""
        return self.checkpoints / f"step-{step}"

    def checkpoint_steps(self, complete_only: bool = True) -> list[int]:
        """Steps that have a checkpoint folder (only complete ones by default), ascending.

        A folder is complete when its commit marker exists: the marker is written after every
        rank has finished writing (for torch.distributed.checkpoint, after its metadata), so a
        folder without it may be half-written and is never loaded.
        """
        if not self.checkpoints.is_dir():
            return []
        steps = []
        for entry in self.checkpoints.iterdir():
            match = _STEP_DIR.match(entry.name)
            if not match:
                continue
            if complete_only and not (entry / COMMIT_MARKER).is_file():
                continue
            steps.append(int(match.group(1)))
        return sorted(steps)

    def checkpoint_problem(self, step: int) -> str | None:
        """Why checkpoint `step` must not be loaded, or None when its files match its manifest.

        The commit marker lists every file with its size and SHA-256; a missing, truncated
        or altered file makes the checkpoint corrupt.
        """
        folder = self.checkpoint(step)
        marker = read_json(folder / COMMIT_MARKER) if folder.is_dir() else None
        if marker is None:
            return "incomplete (no commit marker)"
        for name, expected in marker.get("files", {}).items():
            path = folder / name
            if not path.is_file():
                return f"corrupt: {name} is missing"
            if path.stat().st_size != expected["size"]:
                return f"corrupt: {name} has {path.stat().st_size} bytes, the manifest says {expected['size']}"
            if file_sha256(path) != expected["sha256"]:
                return f"corrupt: {name} does not match its SHA-256"
        return None

    def newest_checkpoint(self) -> tuple[int, dict[int, str]]:
        """Newest checkpoint that is complete and intact (0: none, start from scratch), and
        the newer ones that were skipped, each with the reason."""
        skipped = {}
        for step in reversed(self.checkpoint_steps(complete_only=False)):
            problem = self.checkpoint_problem(step)
            if problem is None:
                return step, skipped
            skipped[step] = problem
        return 0, skipped


def checkpoint_manifest(folder: Path) -> dict[str, dict]:
    """Size and SHA-256 of every file of a checkpoint folder (the commit marker's `files`)."""
    return {
        path.name: {"size": path.stat().st_size, "sha256": file_sha256(path)}
        for path in sorted(folder.iterdir())
        if path.is_file() and path.name != COMMIT_MARKER
    }


def commit_checkpoint(run: RunDir, step: int, incarnation: int) -> bool:
    """Write checkpoint `step`'s commit marker (its manifest), last; False, writing nothing, when
    the controller has ended `incarnation`.

    That is the fence for a rank the controller gave up on (a node cut off from the API server
    but not from the volume): its late commit must not make a stale checkpoint count, nor its
    purge of older ones touch what the next incarnation restores.
    """
    if run.ended_file(incarnation).exists():
        return False
    folder = run.checkpoint(step)
    write_json_atomic(
        folder / COMMIT_MARKER,
        {"step": step, "incarnation": incarnation, "time": time.time(), "files": checkpoint_manifest(folder)},
    )
    return True


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON so a reader sees the old or the new content, never a torn file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as handle:
        json.dump(data, handle)
    os.replace(tmp, path)


def take_lock(path: Path) -> int | None:
    """An open descriptor holding the exclusive flock on `path`, or None if a live process holds it.

    Liveness locks: the launcher takes a rank's (or the backend a launcher's) lock and hands
    the descriptor to the child it starts, so the lock lives exactly as long as that process.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def lock_is_held(path: Path) -> bool:
    """True while a process holds the flock on `path`."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


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


def read_json(path: Path) -> dict | None:
    """The JSON in a file, or None when it does not exist (yet)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
