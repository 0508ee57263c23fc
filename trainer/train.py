"""The built-in training program: one rank of a dp x pp GPT run (contract: trainer/CONTRACT.md).

Run as `python -m trainer` with torchrun's environment plus LAZARUS_RUN_DIR,
LAZARUS_INCARNATION, LAZARUS_NODE and LAZARUS_RESUME_STEP.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

from spec.contract import (
    ENV_FAIL_AT,
    ENV_INCARNATION,
    ENV_NODE,
    ENV_RESUME_STEP,
    ENV_RUN_DIR,
    RunDir,
    write_json_atomic,
)
from spec.layout import Layout
from spec.records import Assignment
from spec.run import RunSpec, TrainerSettings


@dataclass(frozen=True)
class RankEnv:
    """This process's place in the run, read from its environment."""

    rank: int
    world_size: int
    run_dir: RunDir
    incarnation: int
    node: str
    resume_step: int
    fail_at: tuple[str, int] | None

    @classmethod
    def from_environ(cls, environ=os.environ) -> RankEnv:
        missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", ENV_RUN_DIR, ENV_INCARNATION)
                   if name not in environ]
        if missing:
            raise SystemExit(f"trainer: missing environment variables {', '.join(missing)} (see trainer/CONTRACT.md)")
        fail_at = None
        if environ.get(ENV_FAIL_AT):
            point, _, step = environ[ENV_FAIL_AT].partition(":")
            fail_at = (point, int(step))
        return cls(
            rank=int(environ["RANK"]),
            world_size=int(environ["WORLD_SIZE"]),
            run_dir=RunDir(environ[ENV_RUN_DIR]),
            incarnation=int(environ[ENV_INCARNATION]),
            node=environ.get(ENV_NODE, "local"),
            resume_step=int(environ.get(ENV_RESUME_STEP, "0")),
            fail_at=fail_at,
        )

    def maybe_fail(self, point: str, step: int) -> None:
        """Injected fault: die as a dead node's process does (SIGKILL) at the planned point."""
        if self.fail_at == (point, step):
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


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


def check_layout(layout: Layout, settings: TrainerSettings, world_size: int) -> None:
    """Refuse a layout this trainer cannot run, saying what to change."""
    if layout.tp != 1:
        raise SystemExit(f"trainer: layout.tp = {layout.tp} is not supported on CPU; set layout.tp: 1")
    if layout.world_size != world_size:
        raise SystemExit(f"trainer: WORLD_SIZE {world_size} does not match the assignment's "
                         f"dp*pp*tp = {layout.world_size}")
    if layout.pp > settings.n_layers:
        raise SystemExit(f"trainer: layout.pp = {layout.pp} exceeds trainer.n_layers = {settings.n_layers}; "
                         f"every pipeline stage needs at least one block")


class Trainer:
    """One rank's pipeline stage of the model, its optimizer, and the training step.

    Math that survives resharding: replica r of dp trains on its share of each global batch
    (shares differ by at most one sample), the loss is the sum of per-sample losses divided
    by the global batch, and gradients are summed over the data-parallel group. The
    optimizer therefore sees the gradient of the global batch's mean loss whatever dp is.
    """

    def __init__(self, settings: TrainerSettings, layout: Layout, rank: int):
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from trainer.data import share
        from trainer.model import build_stage

        self.torch, self.dist = torch, dist
        self.settings, self.layout = settings, layout
        if layout.pp == 1:
            # Pure data parallelism: the default group is the dp group. A mesh would create
            # a group per rank and dimension, each a rendezvous that delays every resume.
            self.replica, self.stage = rank, 0
            self.dp_group = self.pp_group = None
        else:
            mesh = init_device_mesh("cpu", (layout.dp, layout.pp), mesh_dim_names=("dp", "pp"))
            self.replica = mesh.get_local_rank("dp")
            self.stage = mesh.get_local_rank("pp")
            self.dp_group = mesh.get_group("dp")
            self.pp_group = mesh.get_group("pp")
        self.first_stage = self.stage == 0
        self.last_stage = self.stage == layout.pp - 1
        self.offsets = share(settings.global_batch, layout.dp, self.replica)

        torch.manual_seed(settings.seed)
        self.model = build_stage(settings.vocab_size, settings.seq_len, settings.d_model, settings.n_layers,
                                 settings.n_heads, self.stage, layout.pp)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=settings.learning_rate)
        self.params = list(self.model.parameters())
        self.schedule = None
        if layout.pp > 1:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B

            # Equal microbatches: a stage sizes its receive buffers from the first one. So the
            # count is the largest divisor of this replica's share not above the setting.
            wanted = settings.microbatches or 2 * layout.pp
            share_size = len(self.offsets)
            microbatches = max(n for n in range(1, min(wanted, share_size) + 1) if share_size % n == 0)
            stage = PipelineStage(self.model, self.stage, layout.pp, torch.device("cpu"), group=self.pp_group)
            # Gradients stay sums over microbatches; the loss already divides by the global batch.
            self.schedule = Schedule1F1B(stage, microbatches, loss_fn=self.loss, scale_grads=False)

    def loss(self, logits, targets):
        """Sum of per-sample mean token losses, divided by the global batch."""
        per_token = self.torch.nn.functional.cross_entropy(
            logits.reshape(-1, self.settings.vocab_size), targets.reshape(-1), reduction="none")
        return per_token.view(targets.shape[0], -1).mean(dim=1).sum() / self.settings.global_batch

    def step(self, first_sample: int, stop_requested: bool = False) -> tuple[float, bool]:
        """Train one optimizer step on samples first_sample .. first_sample+global_batch-1.

        Returns the global batch's mean loss (on every rank of the last stage, and on rank 0)
        and whether any rank asked to stop after this step; the request rides on the step's
        own collectives, so every rank learns it at the same step.
        """
        from trainer.data import batch

        torch, dist = self.torch, self.dist
        inputs, targets = batch(self.settings.seed, first_sample, self.offsets,
                                self.settings.seq_len, self.settings.vocab_size)
        self.optimizer.zero_grad(set_to_none=False)
        if self.schedule is None:
            local_loss = self.loss(self.model(inputs), targets)
            local_loss.backward()
        else:
            losses: list = []
            if self.first_stage:
                self.schedule.step(inputs)
            elif self.last_stage:
                self.schedule.step(target=targets, losses=losses)
            else:
                self.schedule.step()
            local_loss = torch.stack(losses).sum() if self.last_stage else torch.zeros(())

        # One hand-written all-reduce over a buffer of fixed layout instead of DDP: DDP
        # rebuilds its buckets in each new process, which changes the summation order of
        # the first step after a restart and so breaks bit-identical resumption.
        flag = torch.tensor([1.0 if stop_requested else 0.0])
        flat = torch.cat([p.grad.reshape(-1) for p in self.params] + [flag, local_loss.detach().reshape(1)])
        dist.all_reduce(flat, group=self.dp_group)
        offset = 0
        for p in self.params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.optimizer.step()
        tail = flat[-2:]
        if self.layout.pp > 1:
            # Only the last stage computed the loss; the others contribute zero. The stop flag
            # reached the first stage of every replica through the dp group, and the rest here.
            tail = tail.clone()
            dist.all_reduce(tail, group=self.pp_group)
        stop, loss = tail.tolist()
        return loss, stop > 0


def train(env: RankEnv, heartbeat: Heartbeat) -> int:
    """Train from the resume step to the last step; returns the last step trained."""
    import torch
    import torch.distributed as dist

    from trainer import checkpoint

    spec = RunSpec.model_validate_json(env.run_dir.spec_file.read_text())
    assignment = Assignment.model_validate_json(env.run_dir.assignment_file(env.incarnation).read_text())
    layout, settings = assignment.layout, spec.trainer
    check_layout(layout, settings, env.world_size)

    # One thread per rank: several ranks share few cores, and oversubscription costs ~10x.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=spec.recovery.hang_after_seconds + 30))
    trainer = Trainer(settings, layout, env.rank)
    checkpointer = checkpoint.Checkpointer(env.run_dir, env.incarnation, settings.keep_checkpoints,
                                           asynchronous=settings.async_checkpoint)

    step, samples = 0, 0  # samples: the data position, global index of the next sample
    if env.resume_step:
        progress = checkpoint.load(env.run_dir, trainer.model, trainer.optimizer, env.resume_step)
        step, samples = progress["step"], progress["samples"]
    heartbeat.beat(step, "restored")

    metrics = open(env.run_dir.metrics_file, "a") if env.rank == 0 else None
    consumed = None
    if trainer.first_stage:
        # The data-loading rank of each replica records which samples it trained on.
        consumed_path = env.run_dir.samples_file(env.incarnation, env.rank)
        consumed_path.parent.mkdir(parents=True, exist_ok=True)
        consumed = open(consumed_path, "a")

    stop_file = env.run_dir.stop_file(env.incarnation)
    stopped = False
    while step < settings.steps:
        env.maybe_fail("step", step + 1)
        # Rank 0 reads the controller's stop request; the step's collectives tell the others.
        loss, stopped = trainer.step(samples, stop_requested=env.rank == 0 and stop_file.exists())
        if consumed:
            first = samples + trainer.offsets.start
            consumed.write(json.dumps({"step": step + 1, "replica": trainer.replica,
                                       "start": first, "stop": first + len(trainer.offsets)}) + "\n")
            consumed.flush()
        step += 1
        samples += settings.global_batch

        heartbeat.beat(step, "training")
        if metrics:
            metrics.write(json.dumps({"step": step, "loss": loss, "incarnation": env.incarnation, "dp": layout.dp}) + "\n")
            metrics.flush()
        if step % settings.checkpoint_every == 0 or step == settings.steps or stopped:
            checkpointer.save(trainer.model, trainer.optimizer, step, samples)
            env.maybe_fail("checkpoint", step)
        if stopped:
            break

    checkpointer.wait()
    dist.barrier()
    heartbeat.beat(step, "stopped" if stopped else "done")
    return step


def main() -> None:
    """Entry point of one rank; always ends the process explicitly with an exit record."""
    env = RankEnv.from_environ()
    print(f"lazarus trainer: rank {env.rank}/{env.world_size} pid {os.getpid()} on {env.node}, "
          f"incarnation {env.incarnation}, resume step {env.resume_step}", flush=True)
    heartbeat = Heartbeat(env)
    step = env.resume_step
    heartbeat.beat(step, "starting")
    code, error_line = 0, ""
    try:
        step = train(env, heartbeat)
    except BaseException as error:  # noqa: BLE001 - every ending must leave an exit record
        traceback.print_exc()
        if isinstance(error, SystemExit):
            code = error.code if isinstance(error.code, int) and error.code else 1
            error_line = str(error.code)
        else:
            code, error_line = 1, f"{type(error).__name__}: {error}"
    write_json_atomic(env.run_dir.exit_file(env.incarnation, env.rank), {
        "rank": env.rank, "code": code, "step": step, "time": time.time(),
        "error": error_line.strip().splitlines()[-1] if error_line.strip() else "",
    })
    sys.stdout.flush()
    sys.stderr.flush()
    # torch with gloo sometimes aborts in its exit-time destructors; end explicitly instead.
    os._exit(code)
