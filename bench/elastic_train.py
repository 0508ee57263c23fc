"""The training script bench/vs_torchrun.py runs under both torchrun and Lazarus: same model,
data, global batch and checkpoint interval.

Rank 0 appends one JSON line per step to --step-log: {"step", "time", "world", "restart"},
where restart is TORCHELASTIC_RESTART_COUNT (torchrun's restart round; Lazarus's incarnation).
Under Lazarus it uses lazarus.session for checkpoints and heartbeats, unless --no-helper; under
torchrun (or with --no-helper) it keeps its own checkpoint in --checkpoint-dir (rank 0 writes it,
renames it into place when complete), as torchrun's elastic docs tell a script to.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

GLOBAL_BATCH = 256


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the step's global batch, keyed by step: any world size sees the same samples."""
    generator = torch.Generator().manual_seed(step)
    inputs = torch.randn(GLOBAL_BATCH, 64, generator=generator)
    share = torch.tensor_split(inputs, world)[rank]
    return share, torch.sin(share).sum(dim=1, keepdim=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100000)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--checkpoint-dir", type=Path)
    parser.add_argument("--step-log", type=Path, required=True)
    parser.add_argument("--no-helper", action="store_true", help="never import lazarus.session, even under Lazarus")
    args = parser.parse_args()

    torch.set_num_threads(1)
    session = None
    if "LAZARUS_RUN_DIR" in os.environ and not args.no_helper:
        from lazarus.session import TrainingSession

        session = TrainingSession.from_environ()
        session.wait_for_store()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1))
    ddp = DDP(model, find_unused_parameters=True)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)

    step = 0
    resume = session.resume_checkpoint / "state.pt" if session and session.resume_checkpoint else None
    if session is None and args.checkpoint_dir and (args.checkpoint_dir / "state.pt").exists():
        resume = args.checkpoint_dir / "state.pt"
    if resume:
        state = torch.load(resume)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log = open(args.step_log, "a") if rank == 0 else None
    total = session.total_steps if session else args.steps
    while step < total:
        step += 1
        inputs, targets = batch(step, rank, world)
        loss = F.mse_loss(ddp(inputs), targets) * len(inputs) / GLOBAL_BATCH * world
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if log:
            log.write(json.dumps({"step": step, "time": time.time(), "world": world, "restart": restart}) + "\n")
            log.flush()
        if session:
            session.step_done(step, loss.item())
        if step % args.checkpoint_every == 0:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
            if session:
                if rank == 0:
                    torch.save(state, session.checkpoint_dir(step) / "state.pt")
                dist.barrier()
                session.commit_checkpoint(step)
            elif rank == 0 and args.checkpoint_dir:
                args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
                torch.save(state, args.checkpoint_dir / "state.pt.tmp")
                os.replace(args.checkpoint_dir / "state.pt.tmp", args.checkpoint_dir / "state.pt")
    if session:
        session.finish(step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
