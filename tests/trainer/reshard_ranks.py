"""Rank processes for the checkpoint reshard test (spawned by torch.multiprocessing)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lazarus.schema import Layout, TrainerSettings
from lazarus.schema.rundir import RunDir
from lazarus.trainer.gpt.step import Trainer
from lazarus.trainer.sdk import checkpoint

SETTINGS = TrainerSettings(steps=3, global_batch=12, seq_len=16, d_model=32, n_layers=2, n_heads=2, checkpoint_every=3)
STEPS = 3


def flat_state(trainer: Trainer) -> dict:
    """The stage's whole state with every DTensor (FSDP shard, tp slice) gathered: collective over
    the rank's dp_shard and tp groups, so every rank of a stage calls it."""
    model, optim = checkpoint.get_state_dict(trainer.model, trainer.optimizer, options=checkpoint.OPTIONS)

    def whole(value):
        return value.full_tensor() if isinstance(value, DTensor) else value

    return {**{f"model.{k}": whole(v) for k, v in model.items()}, **{f"optim.{k}": whole(v) for k, v in optim.items()}}


def run_rank(rank: int, world: int, port: int, layout: dict, mode: str, folder: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out, run = Path(folder), RunDir(folder)
    trainer = Trainer(SETTINGS, Layout(**layout), rank)
    if mode == "save":
        for step in range(STEPS):
            trainer.step(step * SETTINGS.global_batch)
        saver = checkpoint.Checkpointer(run, incarnation=0, keep=3, asynchronous=True)
        saver.save(trainer.model, trainer.optimizer, STEPS, STEPS * SETTINGS.global_batch)
        saver.wait()
        if trainer.replica == 0:
            state = flat_state(trainer)
            place = trainer.layout.coordinates(rank)
            if place["dp_shard"] == 0 and place["tp"] == 0:
                torch.save(state, out / f"stage-{trainer.stage}.pt")
    else:
        dist.barrier()
        progress = checkpoint.load(run, trainer.model, trainer.optimizer, STEPS)
        expected = torch.load(out / f"stage-{trainer.stage}.pt")
        actual = flat_state(trainer)

        def same(a, b) -> bool:
            return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b

        differ = sorted(key for key in expected if key not in actual or not same(expected[key], actual[key]))
        report = {
            "keys": len(expected),
            "missing_or_different": differ,
            "extra": sorted(set(actual) - set(expected)),
            "progress": progress,
        }
        (out / f"{mode}-rank-{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    os._exit(0)
