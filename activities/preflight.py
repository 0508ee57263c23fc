"""What a launch checks before it starts any rank: that the trainer's command can start where the
ranks run, so that a mistake in the spec fails the run with a sentence, not with every rank."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from lazarus.schema.run import RunSpec, TrainerSettings


def python_script(command: list[str]) -> str | None:
    """The script of a `python script.py ...` command (None for `python -m`, or any other program)."""
    if command[0] in ("python", "python3") and len(command) > 1 and not command[1].startswith("-"):
        return command[1]
    return None


def missing_command(trainer: TrainerSettings, work_dir: Path, shares_host: bool) -> str | None:
    """Why the ranks could not start trainer.command in their working directory, or None. Where
    the ranks run on this machine (`shares_host`, the local backend) `python` is the worker's
    interpreter and paths are this machine's; elsewhere only the node can tell, so only a relative
    workdir is refused."""
    if trainer.workdir and not Path(trainer.workdir).is_absolute():
        return (
            f"trainer.workdir: {trainer.workdir!r} is relative; give an absolute path "
            "(`lazarus run start` and `lazarus launch` make it absolute from the folder they run in)"
        )
    if not shares_host:
        return None
    folder = Path(trainer.workdir) if trainer.workdir else work_dir
    program = trainer.command[0]
    if program != "python":
        found = folder / program if "/" in program else shutil.which(program)
        if not found or not Path(found).is_file() or not os.access(found, os.X_OK):
            why = "not on PATH, not a file that can run"
            return f"trainer.command: {program!r} is not an executable on this node ({why})"
    script = python_script(trainer.command)
    if script and not (folder / script).is_file():
        where = "" if Path(script).is_absolute() else f" in the ranks' working directory {folder}"
        return (
            f"trainer.command: no script {script!r}{where}; give its absolute path "
            "(`lazarus run start` and `lazarus launch` do that from the folder they run in)"
        )
    return None


def unkept_survivors(spec: RunSpec, keeps_survivors: bool) -> str | None:
    """Why the spec's recovery.in_process cannot hold on the backend (it restarts every rank at a
    recovery, `keeps_survivors` false), or None. Survivors that wait at their boundary there would
    only delay the restart, and hide the lost peer their exits would have named."""
    if spec.recovery.in_process and not keeps_survivors:
        return (
            f"recovery.in_process: the {spec.cluster.backend} backend restarts every rank at a recovery "
            "(survivors keep their processes on the local backend); set it to false"
        )
    return None
