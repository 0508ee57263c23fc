"""What every backend keeps in the run directory (schema/contract.py), whoever runs the ranks:
the spec, each incarnation's assignment and launch record, logs and checkpoints."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from lazarus.schema.contract import COMMIT_MARKER, RunDir, read_json, write_json_atomic
from lazarus.schema.records import Assignment
from lazarus.schema.run import RunSpec


class ClusterError(RuntimeError):
    """The backend cannot do what was asked (unknown run or node, a stuck process)."""


class RunFiles:
    """Run directories under `home/runs/<run_id>`."""

    backend = "files"

    records_stages = False
    """Whether record_stage writes anywhere (so callers can skip the call)."""

    def __init__(self, home: str | Path):
        self.home = Path(home).resolve()
        self._specs: dict[str, RunSpec] = {}  # a run's spec never changes once written (write_spec)

    def run_dir(self, run_id: str) -> RunDir:
        """The run's directory (it may not exist yet)."""
        return RunDir(self.home / "runs" / run_id)

    def _existing(self, run_id: str) -> RunDir:
        run = self.run_dir(run_id)
        if not run.spec_file.exists():
            raise ClusterError(f"no run {run_id!r} under {self.home / 'runs'}")
        return run

    def spec(self, run_id: str) -> RunSpec:
        """The run's spec as recorded at launch (read once per run)."""
        if run_id not in self._specs:
            self._specs[run_id] = RunSpec.model_validate_json(self._existing(run_id).spec_file.read_text())
        return self._specs[run_id]

    def write_spec(self, run_id: str, spec: RunSpec) -> RunDir:
        """Create the run directory with its spec; a second call finds it and checks the spec is the same."""
        run = self.run_dir(run_id)
        run.root.mkdir(parents=True, exist_ok=True)
        if run.spec_file.exists():
            if RunSpec.model_validate_json(run.spec_file.read_text()) != spec:
                raise ClusterError(f"run directory {run.root} belongs to another run with a different spec")
            return run
        write_json_atomic(run.spec_file, spec.model_dump(mode="json"))
        return run

    def assignment(self, run_id: str, incarnation: int) -> Assignment | None:
        """The recorded assignment of an incarnation, if any."""
        data = read_json(self.run_dir(run_id).assignment_file(incarnation))
        return None if data is None else Assignment.model_validate(data)

    def record_assignment(self, run_id: str, assignment: Assignment) -> Assignment:
        """Write the incarnation's assignment unless one exists; returns the one recorded first.

        A hard link of a complete temporary file is atomic and fails if the name exists, also
        on a shared filesystem where locks may not be: two writers cannot both win.
        """
        path = self.run_dir(run_id).assignment_file(assignment.incarnation)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}")
        temporary.write_text(assignment.model_dump_json())
        try:
            os.link(temporary, path)
        except FileExistsError:
            pass
        finally:
            temporary.unlink()
        return Assignment.model_validate_json(path.read_text())

    def record_launch(self, run_id: str, incarnation: int, resume_step: int, skipped: dict[int, str] | None) -> dict:
        """The incarnation's launch record ({resume_step, skipped, launched_at}), written by the first launch.

        A retried launch restores the same checkpoint as the ranks the first attempt may have
        started, and reports the same skipped checkpoints.
        """
        launch_file = self._existing(run_id).incarnation(incarnation) / "launch.json"
        record = read_json(launch_file)
        if record is None:
            record = {
                "resume_step": resume_step,
                "skipped": {str(k): v for k, v in (skipped or {}).items()},
                "launched_at": time.time(),
            }
            write_json_atomic(launch_file, record)
        return record

    def log_tail(self, run_id: str, incarnation: int, rank: int, lines: int = 20) -> str:
        """The last lines of a rank's log ('' if it has none)."""
        path = self.run_dir(run_id).log_file(incarnation, rank)
        try:
            with open(path, "rb") as handle:
                handle.seek(max(0, path.stat().st_size - 16384))
                text = handle.read().decode(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_for_commit(self, run_id: str, grace: float, alive) -> tuple[int | None, bool]:
        """If a checkpoint was being written when the fault hit, give it `grace` seconds to commit
        while `alive()` (some rank of the incarnation still runs).

        Returns its step (None if there was none) and whether it committed. A save whose
        writer died usually cannot finish (its ranks meet in a collective at the end), but
        one whose every shard was written commits within milliseconds, and keeping it saves
        up to a whole checkpoint interval of training.
        """
        run = self._existing(run_id)
        complete = run.checkpoint_steps()
        newer = [s for s in run.checkpoint_steps(complete_only=False) if not complete or s > complete[-1]]
        if not newer:
            return None, False
        step = newer[-1]
        deadline = time.monotonic() + grace
        while not (run.checkpoint(step) / COMMIT_MARKER).is_file():
            if not alive() or time.monotonic() > deadline:
                return step, False
            time.sleep(0.02)
        return step, True

    def remove_partial_checkpoints(self, run_id: str) -> list[int]:
        """Delete checkpoint folders that never got their commit marker; returns their steps.

        Called only once no rank of the run is alive, so nothing can still be writing them.
        """
        run = self._existing(run_id)
        complete = set(run.checkpoint_steps())
        partial = [s for s in run.checkpoint_steps(complete_only=False) if s not in complete]
        for step in partial:
            shutil.rmtree(run.checkpoint(step), ignore_errors=True)
        return partial

    def close(self) -> None:
        """Release what the backend holds for its lifetime (the Kubernetes backend's watches); nothing here."""

    def record_stage(self, run_id: str, stage: str, message: str) -> None:
        """Note a recovery stage where the cluster's own tools show it (Kubernetes: an Event); here nothing."""
