"""A plain torchrun DDP training script, as a user writes one, made recoverable with lazarus.session.

Under torchrun alone it would read RANK/WORLD_SIZE/MASTER_* and train; under Lazarus the same
environment is set by the node launcher, and the session tells it where to resume from.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lazarus.session import TrainingSession


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's data for a step: the same for the same (step, rank), whatever happened before."""
    generator = torch.Generator().manual_seed(10_000 * step + rank)
    inputs = torch.randn(256, 64, generator=generator)
    return inputs, torch.sin(inputs).sum(dim=1, keepdim=True)


def wrap(model: nn.Module) -> DDP:
    """The model under DDP over the default process group.

    DDP rebuilds its gradient buckets after the first step of every process, so the first step
    after a restart would sum gradients in another order than the uninterrupted run did. With
    find_unused_parameters it never rebuilds: resumed runs stay bit-identical."""
    return DDP(model, find_unused_parameters=True)


def main() -> None:
    torch.set_num_threads(1)
    session = TrainingSession.from_environ()
    session.wait_for_store()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    step = 0
    if session.resume_step:
        # The survivors' state of the step the fault interrupted (trainer.survivor_state: true),
        # else the checkpoint of resume_step. Before DDP: where the survivors kept their processes
        # (recovery.in_process), this receives it from them, the new group's first collective.
        state = session.load_survivor_state() or torch.load(session.resume_checkpoint / "state.pt")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
    ddp = wrap(model)

    print(f"rank {rank} of {world}: training steps {step + 1}..{session.total_steps}", flush=True)
    while step < session.total_steps:
        inputs, targets = batch(step + 1, rank)
        try:
            loss = F.mse_loss(ddp(inputs), targets)
            optimizer.zero_grad()
            loss.backward()  # DDP's all-reduce: where a dead peer shows
            optimizer.step()
            step += 1
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
        except Exception:
            # The process group broke; what this rank holds is the state after `step` steps.
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
            if session.keep_process(step, state) is not None:
                # recovery.in_process: this process goes on in the next incarnation, whose new
                # ranks received the same state; DDP again, over its process group.
                ddp = wrap(model)
                continue
            session.save_survivor_state(step, state)
            raise
        session.step_done(step, mean_loss.item() / world)
        if session.checkpoint_due(step):
            if rank == 0:
                torch.save(
                    {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                    session.checkpoint_dir(step) / "state.pt",
                )
            dist.barrier()
            session.commit_checkpoint(step)
    session.finish(step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
