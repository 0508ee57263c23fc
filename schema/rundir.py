"""The run directory: where each file of a run lives, and which checkpoints count.

Both sides build paths only through RunDir, so the layout is written down once; what each file
means is trainer/CONTRACT.md, and the records written in them are typed in schema/contract.py.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

from lazarus.schema.files import file_sha256, read_json, read_text, write_json_atomic
from lazarus.schema.names import check_node_name
from lazarus.schema.pool import unusable_marker

COMMIT_MARKER = "COMMITTED"
_STEP_DIR = re.compile(r"^step-(\d+)(?:\.incarnation-(\d+))?$")


class RunDir:
    """Paths of one run's directory."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    @property
    def spec_file(self) -> Path:
        """The run spec the run was started with (JSON), written once at its start."""
        return self.root / "spec.json"

    @property
    def owner_file(self) -> Path:
        """The execution that drives the run (schema/ownership.py), where the backend keeps no store
        (Kubernetes; the others keep it in the store); `owner.lock` beside it is held while it is
        read and changed."""
        return self.root / "owner.json"

    def unusable_marker(self, node: str) -> Path:
        """Present while `node` of the pool this run's nodes come from (its home's) is dead or quarantined."""
        return unusable_marker(self.root.parent.parent, node)

    @property
    def metrics_file(self) -> Path:
        """Rank 0's report of every optimizer step (schema/contract.py MetricsLine), one JSON line each."""
        return self.root / "metrics.jsonl"

    @property
    def work_dir(self) -> Path:
        """The ranks' working directory unless trainer.workdir names another: the run's own."""
        return self.root / "work"

    @property
    def checkpoints(self) -> Path:
        """The run's checkpoints: `step-N.incarnation-K/` folders, each counted once `COMMITTED` is in it."""
        return self.root / "checkpoints"

    def incarnation(self, k: int) -> Path:
        """Folder of incarnation k."""
        return self.root / "incarnations" / str(k)

    def assignment_file(self, k: int) -> Path:
        """Which node each rank of incarnation k runs on, and the layout (schema/records.py Assignment)."""
        return self.incarnation(k) / "assignment.json"

    def launch_file(self, k: int) -> Path:
        """The launch record of incarnation k (schema/contract.py LaunchRecord)."""
        return self.incarnation(k) / "launch.json"

    def lock_file(self, k: int, rank: int) -> Path:
        """Held by rank R's process for its whole life: a rank is alive exactly while it is locked."""
        return self.incarnation(k) / "ranks" / f"{rank}.lock"

    def pid_file(self, k: int, rank: int) -> Path:
        """Rank R's process id, written by its launcher."""
        return self.incarnation(k) / "ranks" / f"{rank}.pid"

    def heartbeat_file(self, k: int, rank: int) -> Path:
        """Rank R's newest progress (schema/contract.py Heartbeat), rewritten atomically."""
        return self.incarnation(k) / "heartbeat" / f"{rank}.json"

    def exit_file(self, k: int, rank: int) -> Path:
        """How rank R ended (schema/contract.py RankExit), written by its launcher."""
        return self.incarnation(k) / "exit" / f"{rank}.json"

    def log_file(self, k: int, rank: int) -> Path:
        """Rank R's standard output and error."""
        return self.incarnation(k) / "logs" / f"{rank}.log"

    def samples_file(self, k: int, rank: int) -> Path:
        """The global sample ids rank R trained on at each step (built-in trainer), one JSON line a step."""
        return self.incarnation(k) / "samples" / f"{rank}.jsonl"

    def stacks_file(self, k: int, rank: int) -> Path:
        """Rank R's Python stacks, one dump appended per SIGUSR1 (trainer/agent/stack_dump.py); it exists only
        once the rank's process registered the dump, and its first line names that process."""
        return self.incarnation(k) / "stacks" / f"{rank}.txt"

    def stacks_request_file(self, k: int) -> Path:
        """The controller's newest request for incarnation k's stacks (schema/stacks.py StackRequest):
        each node's launcher signals its ranks when it changes."""
        return self.incarnation(k) / "stacks" / "request.json"

    def stop_file(self, k: int) -> Path:
        """Asks incarnation k to stop at a step boundary (pause, abort, reshard): rank 0 checkpoints and
        every rank exits."""
        return self.incarnation(k) / "stop"

    def error_file(self, k: int, rank: int) -> Path:
        """Where torch's @record writes rank R's exception (TORCHELASTIC_ERROR_FILE)."""
        return self.incarnation(k) / "errors" / f"{rank}.json"

    def node_lock_file(self, k: int, node_index: int) -> Path:
        """Held (a liveness lock, schema/files.take_lock) by the launcher of node `node_index` while it lives."""
        return self.incarnation(k) / "nodes" / f"{node_index}.lock"

    def node_pid_file(self, k: int, node_index: int) -> Path:
        """The process id of node `node_index`'s launcher."""
        return self.incarnation(k) / "nodes" / f"{node_index}.pid"

    def launcher_exit_file(self, k: int, node_index: int) -> Path:
        """Written by a node's standby on Kubernetes when the launcher it forked ended: what a pod's
        phase says of a launcher that runs as its pod."""
        return self.incarnation(k) / "nodes" / f"{node_index}.exit"

    def node_report_file(self, k: int, node_index: int) -> Path:
        """The launcher's report of its node's ranks (schema/node_reports.py)."""
        return self.incarnation(k) / "nodes" / f"{node_index}.report.json"

    def survivors(self, k: int) -> Path:
        """The folder of incarnation k's survivors' states and manifests."""
        return self.incarnation(k) / "survivors"

    def survivor_state(self, k: int, rank: int) -> Path:
        """Rank R's state at its last completed step, saved when incarnation k's collectives broke
        (trainer/sdk/survivors.py); it counts only with its manifest, survivor_manifest(k, R)."""
        return self.survivors(k) / f"{rank}.pt"

    def survivor_manifest(self, k: int, rank: int) -> Path:
        """Step, mesh coordinates, size and SHA-256 of survivor_state(k, R), written last."""
        return self.survivors(k) / f"{rank}.json"

    def fall_back_file(self, k: int) -> Path:
        """Written by the controller when incarnation k's survivors, waiting at their step boundary,
        are to save their state and end as on the restart path (RecoveryPolicy.in_process)."""
        return self.incarnation(k) / "fall-back"

    def ended_file(self, k: int) -> Path:
        """Written by the backend before it kills an incarnation (a launcher started later must not
        run), or by resume once the incarnation's survivors rejoin the next one in their processes."""
        return self.incarnation(k) / "ended"

    def end(self, k: int) -> None:
        """Mark incarnation `k` ended, once, naming the checkpoints it had committed and the
        survivors that had saved by then: those alone of its checkpoints and survivors' states ever
        count (`committed`, `counted_survivors`). A retried drain leaves the first mark."""
        path = self.ended_file(k)
        if path.exists():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        steps = sorted(
            step
            for step, found in self._step_folders().items()
            for incarnation, folder in found
            if incarnation == k and (folder / COMMIT_MARKER).is_file()
        )
        saved = self.survivors(k)
        ranks = sorted(int(p.stem) for p in saved.glob("*.json") if p.stem.isdigit()) if saved.is_dir() else []
        temporary = path.with_name(f"ended.{os.getpid()}.{threading.get_ident()}")
        temporary.write_text(json.dumps({"committed_steps": steps, "survivor_ranks": ranks, "time": time.time()}))
        try:
            os.link(temporary, path)  # whole, and only if no other end came first
        except FileExistsError:
            pass
        finally:
            temporary.unlink()

    def counted_survivors(self, k: int) -> set[int] | None:
        """The survivors of incarnation k whose manifests may count: None while it is not ended
        (any), else those its end (`end`) found written, so that a save whose check raced the
        end does not count. None too for an empty mark, one from before ends named survivors."""
        ended = read_text(self.ended_file(k))
        ranks = json.loads(ended).get("survivor_ranks") if ended else None
        return set(ranks) if ranks is not None else None

    def standby(self, node: str) -> Path:
        """The warm standby of a node: `orders` (a FIFO), `lock` (held while it lives), `pid`, `ready`, `log`.
        ValueError for a name that is no node's: it would lead out of standby/."""
        return self.root / "standby" / check_node_name(node)

    @property
    def standby_token_file(self) -> Path:
        """The secret a Kubernetes standby wants with each order on its port (written by the backend, mode 0600)."""
        return self.root / "standby" / "token"

    def standbys(self) -> list[Path]:
        """The standby folders of every node the run has kept one on."""
        base = self.root / "standby"
        return sorted(p for p in base.iterdir() if p.is_dir()) if base.is_dir() else []

    def incarnations(self) -> list[int]:
        """Incarnations that have an assignment, in order."""
        base = self.root / "incarnations"
        if not base.is_dir():
            return []
        return sorted(int(p.name) for p in base.iterdir() if p.name.isdigit() and (p / "assignment.json").exists())

    def checkpoint_folder(self, step: int, incarnation: int) -> Path:
        """The folder incarnation `incarnation` writes its checkpoint of `step` into: its own, so
        that nothing a fenced incarnation writes late (a node cut off from the controller but not
        from the volume) can touch a checkpoint another incarnation wrote."""
        return self.checkpoints / f"step-{step}.incarnation-{incarnation}"

    def _step_folders(self) -> dict[int, list[tuple[int, Path]]]:
        """step -> its folders as (incarnation, folder), oldest incarnation first (-1: a folder
        named `step-N`, from before checkpoints had an incarnation's name)."""
        folders: dict[int, list[tuple[int, Path]]] = {}
        if not self.checkpoints.is_dir():
            return folders
        for entry in self.checkpoints.iterdir():
            match = _STEP_DIR.match(entry.name)
            if match:
                incarnation = int(match.group(2)) if match.group(2) is not None else -1
                folders.setdefault(int(match.group(1)), []).append((incarnation, entry))
        return {step: sorted(found) for step, found in folders.items()}

    def checkpoint_folders(self, step: int) -> list[Path]:
        """Every folder of the checkpoint of `step`, whichever incarnation wrote it."""
        return [folder for _, folder in self._step_folders().get(step, [])]

    def committed(self, folder: Path) -> bool:
        """Whether a checkpoint folder counts as committed: it has its commit marker, and the
        incarnation that wrote it had committed it when the controller ended that incarnation
        (`end`). A fenced incarnation's late commit (its check passed just before the end) never
        counts."""
        if not (folder / COMMIT_MARKER).is_file():
            return False
        match = _STEP_DIR.match(folder.name)
        if match is None or match.group(2) is None:
            return True
        ended = read_text(self.ended_file(int(match.group(2))))
        # An empty mark is one from before ends named their checkpoints.
        return not ended or int(match.group(1)) in json.loads(ended)["committed_steps"]

    def checkpoint(self, step: int) -> Path:
        """The folder of the checkpoint of `step`: the newest incarnation's committed one, else the
        newest incarnation's (incomplete) one, else where one from before incarnations were named
        would be."""
        found = self._step_folders().get(step, [])
        committed = [folder for _, folder in found if self.committed(folder)]
        if committed:
            return committed[-1]
        return found[-1][1] if found else self.checkpoints / f"step-{step}"

    def checkpoint_steps(self, complete_only: bool = True) -> list[int]:
        """Steps that have a checkpoint folder (only committed ones by default, `committed`), ascending.

        A folder is complete when its commit marker exists: the marker is written after every
        rank has finished writing (for torch.distributed.checkpoint, after its metadata), so a
        folder without it may be half-written and is never loaded.
        """
        return sorted(
            step
            for step, found in self._step_folders().items()
            if not complete_only or any(self.committed(folder) for _, folder in found)
        )

    def checkpoint_problem(self, step: int) -> str | None:
        """Why checkpoint `step` must not be loaded, or None when its files match its manifest.

        The commit marker lists every file with its size and SHA-256; a missing, truncated
        or altered file makes the checkpoint corrupt.
        """
        folder = self.checkpoint(step)
        marker = read_json(folder / COMMIT_MARKER) if folder.is_dir() else None
        if marker is None:
            return "incomplete (no commit marker)"
        if not self.committed(folder):
            return f"fenced: committed by incarnation {marker.get('incarnation')} after the controller ended it"
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
    folder = run.checkpoint_folder(step, incarnation)
    write_json_atomic(
        folder / COMMIT_MARKER,
        {"step": step, "incarnation": incarnation, "time": time.time(), "files": checkpoint_manifest(folder)},
    )
    return True
