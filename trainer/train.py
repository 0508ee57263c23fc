"""The built-in training program: one rank of a data-parallel GPT run (see spec/contract.py).

Run as `python -m trainer` with torchrun's environment plus LAZARUS_RUN_DIR,
LAZARUS_INCARNATION, LAZARUS_NODE and LAZARUS_RESUME_STEP.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

from spec.contract import (
    ENV_INCARNATION,
    ENV_NODE,
    ENV_RESUME_STEP,
    ENV_RUN_DIR,
    RunDir,
    write_json_atomic,
)
from spec.records import Assignment
from spec.run import RunSpec


@dataclass(frozen=True)
class RankEnv:
    """This process's place in the run, read from its environment."""

    rank: int
    world_size: int
    run_dir: RunDir
    incarnation: int
    node: str
    resume_step: int

    @classmethod
    def from_environ(cls, environ=os.environ) -> RankEnv:
        missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", ENV_RUN_DIR, ENV_INCARNATION)
                   if name not in environ]
        if missing:
            raise SystemExit(f"trainer: missing environment variables {', '.join(missing)} (see spec/contract.py)")
        return cls(
            rank=int(environ["RANK"]),
            world_size=int(environ["WORLD_SIZE"]),
            run_dir=RunDir(environ[ENV_RUN_DIR]),
            incarnation=int(environ[ENV_INCARNATION]),
            node=environ.get(ENV_NODE, "local"),
            resume_step=int(environ.get(ENV_RESUME_STEP, "0")),
        )


class Heartbeat:
    """The rank's heartbeat file: the last completed step and when, read by detect."""

    def __init__(self, env: RankEnv):
        self.path = env.run_dir.heartbeat_file(env.incarnation, env.rank)
        self.rank = env.rank
        self.first_step_at: float | None = None

    def beat(self, step: int, phase: str) -> None:
        now = time.time()
        if phase == "training" and self.first_step_at is None:
            # The resume stage ends at the first step this process completes.
            self.first_step_at = now
        record = {"rank": self.rank, "step": step, "phase": phase, "time": now}
        if self.first_step_at is not None:
            record["first_step_at"] = self.first_step_at
        write_json_atomic(self.path, record)


def _exit_record(env: RankEnv, code: int, step: int, error: str = "") -> None:
    write_json_atomic(
        env.run_dir.exit_file(env.incarnation, env.rank),
        {"rank": env.rank, "code": code, "step": step, "time": time.time(), "error": error},
    )


def train(env: RankEnv, heartbeat: Heartbeat) -> int:
    """Train from the resume step to the last step; returns the last step trained."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from trainer import checkpoint
    from trainer.data import batch, share
    from trainer.model import GPT

    spec = RunSpec.model_validate_json(env.run_dir.spec_file.read_text())
    assignment = Assignment.model_validate_json(env.run_dir.assignment_file(env.incarnation).read_text())
    layout, settings = assignment.layout, spec.trainer
    if layout.pp != 1 or layout.tp != 1:
        raise SystemExit(f"trainer: layout pp={layout.pp} tp={layout.tp} is not supported yet; use pp: 1 and tp: 1")
    if layout.world_size != env.world_size:
        raise SystemExit(f"trainer: WORLD_SIZE {env.world_size} does not match the assignment's layout ({layout.world_size})")

    # One thread per rank: several ranks share few cores, and oversubscription costs ~10x.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=spec.recovery.hang_after_seconds + 30))

    torch.manual_seed(settings.seed)
    model = GPT(settings.vocab_size, settings.seq_len, settings.d_model, settings.n_layers, settings.n_heads)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate)
    params = list(model.parameters())

    step, samples = 0, 0  # samples: the data position, global index of the next sample
    if env.resume_step:
        progress = checkpoint.load(env.run_dir, model, optimizer, env.resume_step)
        step, samples = progress["step"], progress["samples"]
    heartbeat.beat(step, "restored")

    replica = layout.replica_of_rank(env.rank)
    offsets = share(settings.global_batch, layout.dp, replica)
    metrics = open(env.run_dir.metrics_file, "a") if env.rank == 0 else None

    while step < settings.steps:
        inputs, targets = batch(settings.seed, samples, offsets, settings.seq_len, settings.vocab_size)
        logits = model(inputs)
        per_token = F.cross_entropy(logits.reshape(-1, settings.vocab_size), targets.reshape(-1), reduction="none")
        local_loss_sum = per_token.view(len(offsets), -1).mean(dim=1).sum()
        optimizer.zero_grad(set_to_none=False)
        (local_loss_sum / settings.global_batch).backward()

        # One hand-written all-reduce over a buffer of fixed layout instead of DDP: DDP
        # rebuilds its buckets in each new process, which changes the summation order of
        # the first step after a restart and so breaks bit-identical resumption.
        flat = torch.cat([p.grad.reshape(-1) for p in params] + [local_loss_sum.detach().reshape(1)])
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        optimizer.step()
        step += 1
        samples += settings.global_batch
        loss = flat[-1].item() / settings.global_batch

        heartbeat.beat(step, "training")
        if metrics:
            metrics.write(json.dumps({"step": step, "loss": loss, "incarnation": env.incarnation, "dp": layout.dp}) + "\n")
            metrics.flush()
        if step % settings.checkpoint_every == 0 or step == settings.steps:
            checkpoint.save(env.run_dir, model, optimizer, step, samples, env.incarnation, settings.keep_checkpoints)

    dist.barrier()
    heartbeat.beat(step, "done")
    return step


def main() -> None:
    """Entry point of one rank; always ends the process explicitly with an exit record."""
    env = RankEnv.from_environ()
    print(f"lazarus trainer: rank {env.rank}/{env.world_size} pid {os.getpid()} on {env.node}, "
          f"incarnation {env.incarnation}, resume step {env.resume_step}", flush=True)
    heartbeat = Heartbeat(env)
    step = env.resume_step
    heartbeat.beat(step, "starting")
    try:
        step = train(env, heartbeat)
    except BaseException as error:  # noqa: BLE001 - every ending must leave an exit record
        traceback.print_exc()
        code = error.code if isinstance(error, SystemExit) and isinstance(error.code, int) else 1
        message = str(error) if isinstance(error, SystemExit) else f"{type(error).__name__}: {error}"
        _exit_record(env, code or 1, step, message.splitlines()[-1] if message else "")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 1)
    _exit_record(env, 0, step)
    sys.stdout.flush()
    sys.stderr.flush()
    # torch with gloo sometimes aborts in its exit-time destructors; end explicitly instead.
    os._exit(0)
