"""The built-in training program: one rank of a dp x pp GPT run (contract: trainer/CONTRACT.md).

Run as `python -m lazarus.trainer` by the node launcher (trainer/launcher.py), with torchrun's
environment plus LAZARUS_RUN_DIR, LAZARUS_INCARNATION, LAZARUS_NODE and LAZARUS_RESUME_STEP.
It uses lazarus.session for the contract, as a user's script would.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta

from lazarus.schema.layout import Layout
from lazarus.schema.run import RunSpec, TrainerSettings
from lazarus.trainer.session import TrainingSession, maybe_fail


def check_layout(layout: Layout, settings: TrainerSettings, world_size: int) -> None:
    """Refuse a layout this trainer cannot run, saying what to change."""
    if layout.tp != 1 or layout.dp_shard != 1:
        raise SystemExit(
            f"trainer: layout.tp = {layout.tp}, layout.dp_shard = {layout.dp_shard}: the built-in trainer runs "
            "tp 1 and dp_shard 1 only; set both to 1"
        )
    if layout.world_size != world_size:
        raise SystemExit(
            f"trainer: WORLD_SIZE {world_size} does not match the assignment's dp*pp*dp_shard*tp = {layout.world_size}"
        )
    if layout.pp > settings.n_layers:
        raise SystemExit(
            f"trainer: layout.pp = {layout.pp} exceeds trainer.n_layers = {settings.n_layers}; "
            f"every pipeline stage needs at least one block"
        )


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

        from lazarus.trainer.data import share
        from lazarus.trainer.model import build_stage

        self.torch, self.dist = torch, dist
        self.settings, self.layout = settings, layout
        # One GPU per rank where there are GPUs (NCCL), else the CPU (gloo).
        self.device = (
            torch.device(f"cuda:{rank % layout.ranks_per_node}") if torch.cuda.is_available() else torch.device("cpu")
        )
        if layout.pp == 1:
            # Pure data parallelism: the default group is the dp group. A mesh would create
            # a group per rank and dimension, each a rendezvous that delays every resume.
            self.replica, self.stage = rank, 0
            self.dp_group = self.pp_group = None
        else:
            mesh = init_device_mesh(self.device.type, (layout.dp, layout.pp), mesh_dim_names=("dp", "pp"))
            self.replica = mesh.get_local_rank("dp")
            self.stage = mesh.get_local_rank("pp")
            self.dp_group = mesh.get_group("dp")
            self.pp_group = mesh.get_group("pp")
        self.first_stage = self.stage == 0
        self.last_stage = self.stage == layout.pp - 1
        self.offsets = share(settings.global_batch, layout.dp, self.replica)

        torch.manual_seed(settings.seed)
        self.model = build_stage(
            settings.vocab_size,
            settings.seq_len,
            settings.d_model,
            settings.n_layers,
            settings.n_heads,
            self.stage,
            layout.pp,
        ).to(self.device)
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
            stage = PipelineStage(self.model, self.stage, layout.pp, self.device, group=self.pp_group)
            # Gradients stay sums over microbatches; the loss already divides by the global batch.
            self.schedule = Schedule1F1B(stage, microbatches, loss_fn=self.loss, scale_grads=False)

    def loss(self, logits, targets):
        """Sum of per-sample mean token losses, divided by the global batch."""
        per_token = self.torch.nn.functional.cross_entropy(
            logits.reshape(-1, self.settings.vocab_size), targets.reshape(-1), reduction="none"
        )
        return per_token.view(targets.shape[0], -1).mean(dim=1).sum() / self.settings.global_batch

    def step(self, first_sample: int, stop_requested: bool = False) -> tuple[float, bool]:
        """Train one optimizer step on samples first_sample .. first_sample+global_batch-1.

        Returns the global batch's mean loss (on every rank of the last stage, and on rank 0)
        and whether any rank asked to stop after this step; the request rides on the step's
        own collectives, so every rank learns it at the same step.
        """
        from lazarus.trainer.data import batch

        torch, dist = self.torch, self.dist
        inputs, targets = batch(
            self.settings.seed, first_sample, self.offsets, self.settings.seq_len, self.settings.vocab_size
        )
        inputs, targets = inputs.to(self.device), targets.to(self.device)
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
            local_loss = torch.stack(losses).sum() if self.last_stage else torch.zeros((), device=self.device)

        # One hand-written all-reduce over a buffer of fixed layout instead of DDP: DDP
        # rebuilds its buckets in each new process, which changes the summation order of
        # the first step after a restart and so breaks bit-identical resumption.
        flag = torch.tensor([1.0 if stop_requested else 0.0], device=self.device)
        flat = torch.cat([p.grad.reshape(-1) for p in self.params] + [flag, local_loss.detach().reshape(1)])
        dist.all_reduce(flat, group=self.dp_group)
        offset = 0
        for p in self.params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
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


def join(session: TrainingSession, spec: RunSpec) -> None:
    """Join the incarnation's process group: NCCL on GPUs, gloo on CPUs, one thread per rank."""
    import torch
    import torch.distributed as dist

    # One thread per rank: several ranks share few cores, and oversubscription costs ~10x.
    torch.set_num_threads(1)
    # NCCL on GPUs (the launcher sets TORCH_NCCL_ASYNC_ERROR_HANDLING, so a broken collective
    # fails instead of hanging), gloo on CPUs; either way a collective gives up after the
    # policy's hang threshold, by which time detect has already reported the hang.
    if torch.cuda.is_available():
        torch.cuda.set_device(session.rank % session.layout.ranks_per_node)
    session.wait_for_store()
    dist.init_process_group(
        "nccl" if torch.cuda.is_available() else "gloo",
        timeout=timedelta(seconds=spec.recovery.hang_after_seconds + 30),
    )
    session.heartbeat(session.resume_step, "joined")


class SamplesLog:
    """What the data-loading rank of a replica trained on, a line per step (the data position's audit)."""

    def __init__(self, session: TrainingSession, trainer: Trainer):
        path = session.run.samples_file(session.incarnation, session.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file, self.trainer = open(path, "a"), trainer

    def write(self, step: int, samples: int) -> None:
        """Step `step` trained on the replica's share of the global batch starting at sample `samples`."""
        first = samples + self.trainer.offsets.start
        line = {
            "step": step,
            "replica": self.trainer.replica,
            "start": first,
            "stop": first + len(self.trainer.offsets),
        }
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()


def train(session: TrainingSession) -> tuple[int, bool]:
    """Train from the resume step to the last step; returns the last step trained and whether
    the controller stopped the run before it."""
    import torch.distributed as dist

    from lazarus.trainer import checkpoint

    run = session.run
    spec = RunSpec.model_validate_json(run.spec_file.read_text())
    layout, settings = session.layout, spec.trainer
    check_layout(layout, settings, session.world_size)
    join(session, spec)
    trainer = Trainer(settings, layout, session.rank)
    checkpointer = checkpoint.Checkpointer(
        run, session.incarnation, settings.keep_checkpoints, asynchronous=settings.async_checkpoint
    )

    step, samples = 0, 0  # samples: the data position, global index of the next sample
    if session.resume_step:
        progress = checkpoint.load(run, trainer.model, trainer.optimizer, session.resume_step)
        step, samples = progress["step"], progress["samples"]
    session.heartbeat(step, "restored")
    consumed = SamplesLog(session, trainer) if trainer.first_stage else None

    stopped = False
    while step < settings.steps:
        maybe_fail("step", step + 1)
        # Rank 0's stop request rides on the step's own collectives (no extra one per step).
        loss, stopped = trainer.step(samples, stop_requested=session.stop_requested(agree=lambda asked: asked))
        if consumed:
            consumed.write(step + 1, samples)
        step += 1
        samples += settings.global_batch

        session.step_done(step, loss)
        if session.checkpoint_due(step) or stopped:
            checkpointer.save(trainer.model, trainer.optimizer, step, samples)
            maybe_fail("checkpoint", step)
        if stopped:
            break

    checkpointer.wait()
    dist.barrier()
    return step, stopped


def main() -> None:
    """Entry point of one rank; always ends the process explicitly with an exit record."""
    session = TrainingSession.from_environ()
    print(
        f"lazarus trainer: rank {session.rank}/{session.world_size} pid {os.getpid()} on {session.node}, "
        f"incarnation {session.incarnation}, resume step {session.resume_step}",
        flush=True,
    )
    try:
        step, stopped = train(session)
    except BaseException as error:  # noqa: BLE001 - every ending must leave an exit record
        traceback.print_exc()
        if isinstance(error, SystemExit):
            code = error.code if isinstance(error.code, int) and error.code else 1
            message = str(error.code)
        else:
            code, message = 1, f"{type(error).__name__}: {error}"
        session.fail(code, message)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    session.finish(step, stopped=stopped)
    sys.stdout.flush()
    sys.stderr.flush()
    # torch with gloo sometimes aborts in its exit-time destructors; end explicitly instead.
    os._exit(0)
