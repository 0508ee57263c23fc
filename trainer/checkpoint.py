"""Checkpoints as torch.distributed.checkpoint folders that count only once committed.

A save is collective. With `asynchronous`, dcp.async_save stages a copy of the state and
writes it from a background thread over a process group of its own (on the training
group it aborts the process), so training goes on while the files are written. Rank 0
commits a checkpoint once its save has completed, which for the coordinator means every
rank's files and the metadata are on disk: it writes the manifest (size and SHA-256 of every
file) as the `COMMITTED` marker, atomically, last. A folder without it is never loaded.
"""

from __future__ import annotations

import shutil
import threading
from concurrent.futures import Future

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from lazarus.schema.rundir import RunDir
from lazarus.trainer.session import commit_or_say_why

# Optimizer state keyed by parameter name (`state.blocks.3.q.weight.exp_avg`, and the same
# for param_groups): each pipeline stage then has keys of its own. Unflattened, every stage
# has a `param_groups.0`, which the checkpoint's deduplication takes for one replicated value.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, samples: int) -> dict:
    model_state, optim_state = get_state_dict(model, optimizer, options=OPTIONS)
    return {
        "model": model_state,
        "optim": optim_state,
        "progress": {"step": step, "samples": samples},
        "rng": torch.get_rng_state(),
    }


class Checkpointer:
    """Saves `step-N` checkpoints (at most one in flight), commits them, keeps the newest k."""

    def __init__(self, run: RunDir, incarnation: int, keep: int, asynchronous: bool):
        self.run = run
        self.incarnation = incarnation
        self.keep = keep
        self.rank = dist.get_rank()
        self.group = dist.new_group(backend="gloo") if asynchronous else None
        self._in_flight: tuple[int, Future, threading.Thread | None] | None = None

    def save(self, model, optimizer, step: int, samples: int) -> None:
        """Checkpoint the state after `step` steps; returns once the state is staged (async) or written."""
        self.wait()
        path = self.run.checkpoint(step)
        state = _state(model, optimizer, step, samples)
        if self.group is None:
            dcp.save(state, checkpoint_id=path)
            self._commit(step)
            return
        future = dcp.async_save(state, checkpoint_id=path, process_group=self.group)
        committer = None
        if self.rank == 0:
            # Hashing the files and writing the marker happen off the training thread too.
            committer = threading.Thread(target=self._commit_when_written, args=(step, future), daemon=True)
            committer.start()
        self._in_flight = (step, future, committer)

    def wait(self) -> None:
        """Block until the in-flight save (if any) is written and committed."""
        if self._in_flight is None:
            return
        _, future, committer = self._in_flight
        self._in_flight = None
        future.result()
        if committer is not None:
            committer.join()

    def _commit_when_written(self, step: int, future: Future) -> None:
        future.result()
        self._commit(step)

    def _commit(self, step: int) -> None:
        # A refused commit purges nothing either: the checkpoints belong to the next incarnation.
        if self.rank == 0 and commit_or_say_why(self.run, step, self.incarnation):
            self._purge()

    def _purge(self) -> None:
        complete = self.run.checkpoint_steps()
        kept = complete[-self.keep :]
        for step in self.run.checkpoint_steps(complete_only=False):
            # Older incomplete folders are leftovers of a dead incarnation (the in-flight
            # save is always newer than the newest complete one).
            if step not in kept and step < complete[-1]:
                shutil.rmtree(self.run.checkpoint(step), ignore_errors=True)


def load(run: RunDir, model, optimizer, step: int) -> dict:
    """Restore model, optimizer and RNG from checkpoint `step`, whatever dp wrote it; returns its progress."""
    state = _state(model, optimizer, 0, 0)
    dcp.load(state, checkpoint_id=run.checkpoint(step))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=OPTIONS)
    torch.set_rng_state(state["rng"])
    progress = state["progress"]
    if progress["step"] != step:
        raise RuntimeError(f"checkpoint {run.checkpoint(step)} holds step {progress['step']}, expected {step}")
    return progress
