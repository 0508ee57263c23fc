"""A user's FSDP2 + tensor-parallel script that takes its layout from Lazarus: the device mesh
comes from lazarus.session (dp x pp x dp_shard x tp, built from the assignment), the state is
saved and restored with torch.distributed.checkpoint, and each data-parallel rank trains on its
share of a global batch keyed by step, so any dp sees the same samples.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lazarus.session import TrainingSession

GLOBAL_BATCH = 32


def batch(step: int, share: int, shares: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's share of the step's global batch."""
    generator = torch.Generator().manual_seed(step)
    inputs = torch.randn(GLOBAL_BATCH, 16, generator=generator)
    targets = torch.sin(inputs).sum(dim=1, keepdim=True)
    return inputs.chunk(shares)[share], targets.chunk(shares)[share]


def main() -> None:
    torch.set_num_threads(1)
    session = TrainingSession.from_environ()
    session.wait_for_store()
    dist.init_process_group("gloo")
    mesh = session.device_mesh()
    place, layout = session.coordinates, session.layout
    assert tuple(mesh.get_coordinate()) == tuple(place[name] for name in ("dp", "pp", "dp_shard", "tp"))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp", "dp_shard"])  # HSDP: replicate over dp, shard over dp_shard
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    step = 0
    if session.resume_checkpoint:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state, "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=str(session.resume_checkpoint))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        step = int(state["step"])

    shares = layout.dp * layout.dp_shard
    share = place["dp"] * layout.dp_shard + place["dp_shard"]
    if session.rank == 0:
        print(f"mesh {layout.describe()}: training steps {step + 1}..{session.total_steps}", flush=True)
    while step < session.total_steps:
        step += 1
        inputs, targets = batch(step, share, shares)
        loss = F.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # every tp rank holds its replica's loss: the mean over all ranks is the batch's
        session.step_done(step, mean.item() / session.world_size)
        if session.checkpoint_due(step):
            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optimizer_state, "step": torch.tensor(step)}
            dcp.save(state, checkpoint_id=str(session.checkpoint_dir(step)))
            dist.barrier()
            session.commit_checkpoint(step)
    session.finish(step)
    sys.stdout.flush()
    os._exit(0)  # ends without gloo's teardown, which can abort a rank at exit on this CPU build (README)


if __name__ == "__main__":
    main()
