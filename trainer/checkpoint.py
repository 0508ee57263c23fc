"""Checkpoints as torch.distributed.checkpoint folders that count only once committed."""

from __future__ import annotations

import shutil
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from spec.contract import COMMIT_MARKER, RunDir, write_json_atomic


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, samples: int) -> dict:
    model_state, optim_state = get_state_dict(model, optimizer)
    return {
        "model": model_state,
        "optim": optim_state,
        "progress": {"step": step, "samples": samples},
        "rng": torch.get_rng_state(),
    }


def save(run: RunDir, model, optimizer, step: int, samples: int, incarnation: int, keep: int) -> None:
    """Save the training state after `step` steps; rank 0 commits it and purges old ones.

    Every rank takes part (the save is collective). The commit marker is written by rank 0
    only after dcp.save has returned there, which is after every rank's data and the
    metadata are on disk; a folder without the marker is never loaded.
    """
    path = run.checkpoint(step)
    dcp.save(_state(model, optimizer, step, samples), checkpoint_id=path)
    if dist.get_rank() == 0:
        write_json_atomic(path / COMMIT_MARKER, {"step": step, "incarnation": incarnation, "time": time.time()})
        _purge(run, keep)


def _purge(run: RunDir, keep: int) -> None:
    complete = run.checkpoint_steps()
    newest_kept = complete[-keep:]
    for step in run.checkpoint_steps(complete_only=False):
        # Incomplete folders older than the newest complete one are leftovers of a dead
        # incarnation; nothing will ever finish them.
        if step not in newest_kept and step <= complete[-1]:
            shutil.rmtree(run.checkpoint(step), ignore_errors=True)


def load(run: RunDir, model, optimizer, step: int) -> dict:
    """Restore model, optimizer and RNG from checkpoint `step`; returns its progress record."""
    state = _state(model, optimizer, 0, 0)
    dcp.load(state, checkpoint_id=run.checkpoint(step))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    torch.set_rng_state(state["rng"])
    progress = state["progress"]
    if progress["step"] != step:
        raise RuntimeError(f"checkpoint {run.checkpoint(step)} holds step {progress['step']}, expected {step}")
    return progress
