"""Rank processes for the survivor-state test (spawned by torch.multiprocessing)."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from lazarus.schema import Layout, TrainerSettings
from lazarus.schema.rundir import RunDir
from lazarus.trainer.gpt import survivor_state as survivors
from lazarus.trainer.gpt.step import Trainer

SETTINGS = TrainerSettings(steps=8, global_batch=12, seq_len=16, d_model=32, n_layers=2, n_heads=2, microbatches=2)
COMPLETED = 5
"""Steps every rank completes before the last rank's node dies, inside step COMPLETED + 1."""
BATCH = SETTINGS.global_batch


def run_rank(rank: int, world: int, port: int, layout: dict, mode: str, folder: str, sources: dict) -> None:
    """mode: "reference" trains every step; "fault" dies on the last rank in step COMPLETED + 1,
    the others saving their state; "resume" loads rank sources[rank]'s saved state and trains on."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    out, run = Path(folder), RunDir(folder)
    trainer = Trainer(SETTINGS, Layout(**layout), rank)
    losses, first = {}, 0
    if mode == "resume":
        first = survivors.load(run, 0, int(sources[str(rank)]), trainer)["step"]
    for step in range(first, SETTINGS.steps):
        if mode == "fault" and step == COMPLETED:
            if rank == world - 1:
                os._exit(0)  # the node dies: its sockets close under the peers' next collective
            try:
                trainer.step(step * BATCH)
            except Exception as error:  # noqa: BLE001 - what train() catches
                saved = survivors.save(run, 0, rank, trainer, step, step * BATCH)
                (out / f"fault-{rank}.json").write_text(json.dumps({"saved": saved, "error": type(error).__name__}))
            os._exit(0)
        losses[step + 1], _ = trainer.step(step * BATCH)
    (out / f"{mode}-{rank}.json").write_text(json.dumps({"first": first, "losses": losses}))
    dist.barrier()
    os._exit(0)
