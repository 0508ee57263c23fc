"""Checkpoints as torch.distributed.checkpoint folders that count only once committed.

A save is collective. With `asynchronous`, dcp.async_save stages a copy of the state and
writes it from a background thread over a process group of its own (on the training
group it aborts the process), so training goes on while the files are written. Rank 0
commits a checkpoint once its save has completed, which for the coordinator means every
rank's files and the metadata are on disk: it writes the manifest (size and SHA-256 of every
file) as the `COMMITTED` marker, atomically, last. A folder without it is never loaded.

A save that fails on the disk (a full volume: any rank's write raised OSError, and dcp hands
every rank the failure) costs that checkpoint, not the run: the folder is removed, the ranks
say so (their log and their heartbeat, which the controller shows as the run's warning), and
training goes on with the newest complete checkpoint where it was; the next one is tried as due.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from lazarus.schema.rundir import RunDir
from lazarus.trainer.sdk.faults import planned_disk_full
from lazarus.trainer.sdk.session import commit_or_say_why

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


class DiskFull(FileSystemWriter):
    """A writer that fails as a full volume does, for a planned `disk_full` fault: part of a file
    written, then ENOSPC."""

    def write_data(self, plan, planner):
        with open(Path(self.path) / f"__{dist.get_rank()}_partial.distcp", "wb") as partial:
            partial.write(b"\0" * 4096)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))


def disk_error(error: BaseException) -> OSError | None:
    """The OSError behind a failed save when the disk is what failed (on any rank), else None: a
    broken collective (a peer died) is the recovery's business, not this checkpoint's."""
    if isinstance(error, OSError):
        return error
    if isinstance(error, CheckpointException):
        causes = [failure[0] if isinstance(failure, tuple) else failure for failure in error.failures.values()]
        on_disk = [cause for cause in causes if isinstance(cause, OSError)]
        if causes and len(on_disk) == len(causes):
            return on_disk[0]
    return None


class Checkpointer:
    """Saves `step-N.incarnation-K` checkpoints (at most one in flight), commits them, keeps the newest k.

    `warn(message)` tells the controller about a checkpoint lost to the disk (see the module)."""

    def __init__(
        self, run: RunDir, incarnation: int, keep: int, asynchronous: bool, warn: Callable[[str], None] | None = None
    ):
        self.run = run
        self.incarnation = incarnation
        self.keep = keep
        self.warn = warn or (lambda message: None)
        self.rank = dist.get_rank()
        self.group: dist.ProcessGroup | None = None
        if asynchronous:
            group = dist.new_group(backend="gloo")
            assert isinstance(group, dist.ProcessGroup), "every rank is a member of the group"
            self.group = group
        self._in_flight: tuple[int, Future, threading.Thread | None] | None = None
        self._commit_error: BaseException | None = None
        self._abandoned = False  # see abandon()

    def save(self, model, optimizer, step: int, samples: int) -> None:
        """Checkpoint the state after `step` steps; returns once the state is staged (async) or written."""
        self.wait()
        path = self.run.checkpoint_folder(step, self.incarnation)
        state = _state(model, optimizer, step, samples)
        writer = DiskFull(path) if planned_disk_full(step) else None
        if self.group is None:
            try:
                state_dict_saver.save(state, checkpoint_id=path, storage_writer=writer)
            except (OSError, CheckpointException) as error:
                self._failed(step, error)
                return
            self._commit(step)
            return
        future = state_dict_saver.async_save(state, checkpoint_id=path, storage_writer=writer, process_group=self.group)
        # A response of two futures comes only from a stager that stages in the background; the default stages first.
        assert isinstance(future, Future), "the default stager's save is one future"
        committer = None
        if self.rank == 0:
            # Hashing the files and writing the marker happen off the training thread too.
            committer = threading.Thread(target=self._commit_when_written, args=(step, future), daemon=True)
            committer.start()
        self._in_flight = (step, future, committer)

    def poll(self) -> None:
        """Finish the in-flight save if it is written, so that a failed one is told at once."""
        if self._in_flight is not None and self._in_flight[1].done():
            self.wait()

    def wait(self) -> None:
        """Block until the in-flight save (if any) is written and committed (or lost to the disk)."""
        if self._in_flight is None:
            return
        step, future, committer = self._in_flight
        self._in_flight = None
        if committer is not None:
            committer.join()
        try:
            future.result()
        except (OSError, CheckpointException) as error:
            self._failed(step, error)
            return
        if self._commit_error is not None:
            error, self._commit_error = self._commit_error, None
            self._failed(step, error)

    def abandon(self, timeout: float) -> bool:
        """Give up the save in flight without committing it (its process group is abandoned, so it
        can only have been written already or fail), and wait up to `timeout` seconds for its
        threads to end; False when they still run, and may still write into its folder."""
        self._abandoned = True
        if self._in_flight is None:
            return True
        _, future, committer = self._in_flight
        self._in_flight = None
        try:
            future.exception(timeout=timeout)
        except TimeoutError:
            return False
        if committer is not None:
            committer.join(timeout)
            return not committer.is_alive()
        return True

    def _commit_when_written(self, step: int, future: Future) -> None:
        try:
            future.result()
        except BaseException:  # noqa: BLE001 - wait() reads the same failure from the future
            return
        if self._abandoned:
            return
        try:
            self._commit(step)
        except OSError as error:  # hashing or the marker's write hit the full disk
            self._commit_error = error

    def _failed(self, step: int, error: BaseException) -> None:
        """A save of `step` failed: on the disk, warn and go on without it; else raise it again."""
        cause = disk_error(error)
        if cause is None:
            raise error
        if self.rank == 0:
            shutil.rmtree(self.run.checkpoint_folder(step, self.incarnation), ignore_errors=True)
        newest = (self.run.checkpoint_steps() or [0])[-1]
        message = (
            f"checkpoint of step {step} not written ({cause.strerror or cause}); training goes on, the newest "
            f"complete checkpoint is step {newest}"
        )
        print(f"lazarus trainer: {message}", file=sys.stderr, flush=True)
        self.warn(message)

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
                for folder in self.run.checkpoint_folders(step):
                    shutil.rmtree(folder, ignore_errors=True)


def load(run: RunDir, model, optimizer, step: int) -> dict:
    """Restore model, optimizer and RNG from checkpoint `step`, whatever dp wrote it; returns its progress."""
    state = _state(model, optimizer, 0, 0)
    state_dict_loader.load(state, checkpoint_id=run.checkpoint(step))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=OPTIONS)
    torch.set_rng_state(state["rng"])
    progress = state["progress"]
    if progress["step"] != step:
        raise RuntimeError(f"checkpoint {run.checkpoint(step)} holds step {progress['step']}, expected {step}")
    return progress
