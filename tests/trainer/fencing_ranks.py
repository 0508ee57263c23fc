"""Rank processes for the fencing test (spawned by torch.multiprocessing): incarnation 0, whose
node the controller gives up on while its processes live on, and incarnation 1, which replaces it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lazarus.schema import Layout
from lazarus.schema.files import write_json_atomic
from lazarus.schema.rundir import COMMIT_MARKER, RunDir, checkpoint_manifest
from lazarus.trainer.gpt.step import Trainer
from lazarus.trainer.sdk import checkpoint
from tests.trainer.reshard_ranks import SETTINGS, flat_state

FIRST, LAST = 3, 6  # the checkpoint both incarnations share, and the one each writes after it
LAYOUT = Layout(dp=2)


def _start(rank: int, port: int) -> Trainer:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    return Trainer(SETTINGS, LAYOUT, rank)


def _train(trainer: Trainer, steps: range, offset: int = 0) -> None:
    for step in steps:
        trainer.step((step + offset) * SETTINGS.global_batch)


def _same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def fenced_rank(rank: int, port: int, folder: str) -> None:
    """Incarnation 0: checkpoints step 3, then (cut off: the controller ends it meanwhile) trains
    on other data to step 6 once told, writes its checkpoint of step 6 and commits it past the
    fence, as a commit whose check raced the end would. Then it loads what a resume would load."""
    out, run = Path(folder), RunDir(folder)
    trainer = _start(rank, port)
    _train(trainer, range(FIRST))
    saver = checkpoint.Checkpointer(run, incarnation=0, keep=3, asynchronous=False)
    saver.save(trainer.model, trainer.optimizer, FIRST, FIRST * SETTINGS.global_batch)
    (out / f"saved-{rank}").touch()
    deadline = time.monotonic() + 120
    while not (out / "go-late").exists():
        if time.monotonic() > deadline:
            raise SystemExit("fenced rank: never told to write late")
        time.sleep(0.05)
    _train(trainer, range(FIRST, LAST), offset=100)
    saver.save(trainer.model, trainer.optimizer, LAST, LAST * SETTINGS.global_batch)  # its commit is refused
    dist.barrier()
    late = run.checkpoint_folder(LAST, 0)
    if rank == 0:
        write_json_atomic(late / COMMIT_MARKER, {"step": LAST, "incarnation": 0, "files": checkpoint_manifest(late)})
    dist.barrier()
    fresh = Trainer(SETTINGS, LAYOUT, rank)
    progress = checkpoint.load(run, fresh.model, fresh.optimizer, LAST)
    loaded, expected = flat_state(fresh), torch.load(out / f"replacement-{rank}.pt")
    differ = sorted(key for key in expected if not _same(expected[key], loaded[key]))
    own = flat_state(trainer)
    report = {
        "keys": len(expected),
        "differ": differ,
        "progress": progress,
        "own_differs": any(not _same(own[key], expected[key]) for key in expected),
    }
    (out / f"fenced-{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    os._exit(0)


def replacement_rank(rank: int, port: int, folder: str) -> None:
    """Incarnation 1: restores step 3, trains to step 6 and checkpoints it; keeps its state."""
    out, run = Path(folder), RunDir(folder)
    trainer = _start(rank, port)
    checkpoint.load(run, trainer.model, trainer.optimizer, FIRST)
    _train(trainer, range(FIRST, LAST))
    saver = checkpoint.Checkpointer(run, incarnation=1, keep=3, asynchronous=False)
    saver.save(trainer.model, trainer.optimizer, LAST, LAST * SETTINGS.global_batch)
    torch.save(flat_state(trainer), out / f"replacement-{rank}.pt")
    dist.barrier()
    os._exit(0)
