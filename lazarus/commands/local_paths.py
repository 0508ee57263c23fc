"""Paths in a spec, as a user means them: relative to the folder they start the run from.

The ranks run in trainer.workdir. A spec without one runs them in the run's own folder, not where
`lazarus run start` was typed, so that two runs never share a snapshot file by accident;
`lazarus launch` sets it to the folder it was typed in, as torchrun runs its workers there. What
the user named relative to the folder they typed the command in (the script, a module of the
project, a workdir) is made absolute here, before the spec is submitted: the spec in the
workflow's history then says exactly what ran.
"""

from __future__ import annotations

import os
from pathlib import Path

from lazarus.schema.run import RunSpec


def _absolute(path: str, folder: Path) -> str:
    """`path` from `folder`, when it names something there; else as given."""
    candidate = folder / path
    return str(candidate.resolve()) if not Path(path).is_absolute() and candidate.exists() else path


def anchor_paths(spec: RunSpec, folder: Path, shares_paths: bool) -> RunSpec:
    """The spec with the trainer's relative paths taken from `folder`, where the backend's nodes
    share this machine's paths (`shares_paths`: local, Slurm; on Kubernetes they are paths inside
    the image): a relative workdir; the script of `python script.py` or a program named by a
    relative path; for `python -m package`, the folder holding the package goes on the ranks'
    PYTHONPATH."""
    trainer = spec.trainer
    if not shares_paths or trainer.built_in:
        return spec
    command, env = list(trainer.command), dict(trainer.env)
    if "/" in command[0]:
        command[0] = _absolute(command[0], folder)
    elif command[0] in ("python", "python3") and len(command) > 1:
        if command[1] == "-m" and len(command) > 2:
            top = command[2].split(".")[0]
            if (folder / top).is_dir() or (folder / f"{top}.py").is_file():
                env["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder.resolve()), env.get("PYTHONPATH")) if p)
        elif not command[1].startswith("-"):
            command[1] = _absolute(command[1], folder)
    workdir = trainer.workdir
    if workdir and not Path(workdir).is_absolute():
        workdir = str((folder / workdir).resolve())
    changed = trainer.model_copy(update={"command": command, "env": env, "workdir": workdir})
    return spec.model_copy(update={"trainer": changed})
