"""The built-in trainer's share of a survivor's state: what it saves when a collective breaks
(parameters and optimizer state as local tensors, the RNG, its data position) and how a rank of the
next incarnation restores it, through the script SDK's files (trainer/sdk/survivors.py) and the
standby's prefetch (prepared.py)."""

from __future__ import annotations

import contextlib
import io

import torch

from lazarus.schema.contract import Rejoin
from lazarus.schema.rundir import RunDir
from lazarus.trainer.gpt.prepared import survivor_state
from lazarus.trainer.sdk.survivors import write_state


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's own values of a parameter or optimizer state (a DTensor's local shard)."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as a value of the same kind as `param`: a DTensor on its mesh if `param` is one."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor) or local.dim() == 0:
        return local

    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


@contextlib.contextmanager
def saved_on_failure(run: RunDir, session, trainer, step: int, samples: int):
    """Save the trainer's state after `step` steps as a survivor's if the block raises (a broken
    collective outside the step: a checkpoint's), then let the error go on."""
    try:
        yield
    except Exception:
        save(run, session.incarnation, session.rank, trainer, step, samples)
        raise


def snapshot(trainer, step: int, samples: int) -> dict:
    """The built-in trainer's state after `step` steps (data position `samples`): parameters and
    optimizer state as local tensors, and the RNG; copies, so that it outlives the trainer."""
    params = trainer.params
    return {
        "step": step,
        "samples": samples,
        "rng": torch.get_rng_state(),
        # Copies: a local shard can be a view, and torch.save would write all of its storage.
        "params": [_local(p).detach().clone() for p in params],
        "optimizer": [{k: _local(v).clone() for k, v in trainer.optimizer.state.get(p, {}).items()} for p in params],
    }


def save(run: RunDir, incarnation: int, rank: int, trainer, step: int, samples: int, state: dict | None = None) -> bool:
    """Save the built-in trainer's state after `step` steps (its `snapshot`, or `state` taken
    earlier) as survivor `rank`'s of `incarnation` (write_state)."""
    if run.ended_file(incarnation).exists():
        return False  # before copying anything: the controller has given up on these ranks
    state = state if state is not None else snapshot(trainer, step, samples)
    return write_state(run, incarnation, rank, trainer.layout.coordinates(rank), step, state)


def apply(trainer, state: dict) -> None:
    """Put a `snapshot` of the same mesh coordinates' share into a fresh trainer."""
    with torch.no_grad():
        for param, saved, optimizer_state in zip(trainer.params, state["params"], state["optimizer"], strict=True):
            _local(param).copy_(saved)
            if optimizer_state:
                trainer.optimizer.state[param] = {k: _like(param, v) for k, v in optimizer_state.items()}
    torch.set_rng_state(state["rng"])


def load(run: RunDir, incarnation: int, rank: int, trainer) -> dict:
    """Restore a fresh trainer from survivor `rank` of `incarnation`, which must hold the same
    mesh coordinates' share; returns {"step", "samples", "prefetched"} (whether the node's
    standby had read the state already). Refuses a file its manifest does not match."""
    state, prefetched = survivor_state(run, incarnation, rank)
    apply(trainer, state)
    return {"step": state["step"], "samples": state["samples"], "prefetched": prefetched}


def share(trainer, rank: int, rejoin: Rejoin, held: dict | None) -> tuple[int, int]:
    """Every rank of an incarnation the survivors rejoined, in its new process group: the source
    replica's rank at this rank's (pp, dp_shard, tp) place sends the state it holds over the dp
    group, and a rank new to the run puts it into its fresh trainer. `held` is a survivor's own
    state (None for a new rank); returns the step and data position every rank goes on from."""
    import torch.distributed as dist

    layout = trainer.layout
    source = rejoin.source_replica * layout.replica_ranks + rank % layout.replica_ranks
    group = trainer.dp_group  # None under pure data parallelism: the default group is the dp group
    payload = torch.empty(0, dtype=torch.uint8)
    if rank == source:
        assert held is not None, "the source replica's ranks are survivors"
        buffer = io.BytesIO()
        torch.save(held, buffer)
        payload = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    dist.broadcast(size, src=source, group=group)
    if rank != source:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(payload, src=source, group=group)
    state = held if held is not None else torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
    if held is None:
        apply(trainer, state)
    return state["step"], state["samples"]
