"""The built-in training program: one rank of a dp x pp x dp_shard x tp GPT run (contract: trainer/CONTRACT.md).

Run as `python -m lazarus.trainer` by the node launcher (trainer/agent/launcher.py), with torchrun's
environment plus LAZARUS_RUN_DIR, LAZARUS_INCARNATION, LAZARUS_NODE and LAZARUS_RESUME_STEP.
It uses lazarus.session for the contract, as a user's script would.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta

from lazarus.schema.contract import read_launch
from lazarus.schema.layout import MESH_DIMENSIONS, Layout
from lazarus.schema.run import RunSpec, TrainerSettings
from lazarus.trainer.sdk.faults import maybe_fail
from lazarus.trainer.sdk.session import TrainingSession


def check_layout(layout: Layout, settings: TrainerSettings, world_size: int) -> None:
    """Refuse a layout this trainer cannot run, saying what to change (the spec refuses it first)."""
    if layout.world_size != world_size:
        raise SystemExit(
            f"trainer: WORLD_SIZE {world_size} does not match the assignment's dp*pp*dp_shard*tp = {layout.world_size}"
        )
    if layout.pp > settings.n_layers:
        raise SystemExit(
            f"trainer: layout.pp = {layout.pp} exceeds trainer.n_layers = {settings.n_layers}; "
            f"every pipeline stage needs at least one block"
        )
    if settings.n_heads % layout.tp:
        raise SystemExit(f"trainer: layout.tp = {layout.tp} does not divide trainer.n_heads = {settings.n_heads}")


def build_mesh(layout: Layout, device_type: str):
    """The device mesh over the layout's dimensions above 1 (None for pure data parallelism).

    Every dimension costs a process group per slice, each a rendezvous that delays every
    resume, so a dimension of size 1 gets none; pure data parallelism uses the default group.
    """
    from torch.distributed.device_mesh import init_device_mesh

    used = [(name, size) for name, size in zip(MESH_DIMENSIONS, layout.shape, strict=True) if size > 1]
    if not used or [name for name, _ in used] == ["dp"]:
        return None
    names, sizes = zip(*used, strict=True)
    return init_device_mesh(device_type, sizes, mesh_dim_names=names)


class Trainer:
    """One rank's share of the model (a pipeline stage, its tp slice, its FSDP shard), its
    optimizer, and the training step.

    Math that survives resharding: each of the dp x dp_shard data-parallel ranks trains on its
    share of each global batch (shares differ by at most one sample), the loss is the sum of
    per-sample losses divided by the global batch, and gradients are summed: FSDP2 sums them over
    dp_shard (reduce-scatter), one all-reduce sums them over dp. The optimizer therefore sees the
    gradient of the global batch's mean loss whatever dp is. tp ranks compute the same samples.
    """

    def __init__(self, settings: TrainerSettings, layout: Layout, rank: int):
        import torch
        import torch.distributed as dist

        from lazarus.trainer.gpt import prepared
        from lazarus.trainer.gpt.data import share
        from lazarus.trainer.gpt.model import cut_to_stage

        self.torch, self.dist = torch, dist
        self.settings, self.layout = settings, layout
        # One GPU per rank where there are GPUs (NCCL), else the CPU (gloo).
        self.device = (
            torch.device(f"cuda:{rank % layout.ranks_per_node}") if torch.cuda.is_available() else torch.device("cpu")
        )
        place = layout.coordinates(rank)
        self.replica, self.stage = place["dp"], place["pp"]
        self.first_stage = self.stage == 0
        self.last_stage = self.stage == layout.pp - 1
        # Among a stage's tp ranks, which all hold the same loss, one reports it.
        self.reports_loss = self.last_stage and place["tp"] == 0
        self.writes_samples = self.first_stage and place["tp"] == 0
        self.offsets = share(
            settings.global_batch, layout.dp * layout.dp_shard, place["dp"] * layout.dp_shard + place["dp_shard"]
        )
        self.mesh = build_mesh(layout, self.device.type)
        self.dp_group = self.mesh["dp"].get_group() if self.mesh is not None and layout.dp > 1 else None

        # Built by this node's warm standby before the rank existed, where there is one.
        whole, rng = prepared.whole_model(settings)
        torch.set_rng_state(rng)
        self.model = cut_to_stage(whole, self.stage, layout.pp).to(self.device)
        self._parallelize()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=settings.learning_rate)
        self.params = list(self.model.parameters())
        self.schedule = self._pipeline_schedule() if layout.pp > 1 else None
        self.updating = False
        """True only inside the optimizer step: a failure there may leave the state half updated."""
        self.compute_seconds: float | None = None
        """This rank's own work on the newest step, before the gradients' all-reduce waits for its peers
        (seconds). On a GPU the kernels run asynchronously, so it is the host's share until the
        all-reduce; under pp or tp it holds the stage's and the shards' exchanges too."""

    def _parallelize(self) -> None:
        """Split each block over the tp ranks, then shard everything over the dp_shard ranks (FSDP2)."""
        mesh = self.mesh
        if self.layout.tp > 1:
            from torch.distributed.tensor.parallel import parallelize_module

            from lazarus.trainer.gpt.model import tensor_parallel_plan

            # Every rank built the whole model from the same seed, so each takes its slice of
            # each matrix from its own copy instead of a scatter from tp rank 0 per matrix (the
            # default; 0.1 to 0.2 s of a 16-rank start here).
            assert mesh is not None, "tp above 1 is a dimension of the mesh"
            for block in self.model.blocks.values():
                parallelize_module(block, mesh["tp"], tensor_parallel_plan(), src_data_rank=None)
        if self.layout.dp_shard > 1:
            from torch.distributed.fsdp import fully_shard

            assert mesh is not None, "dp_shard above 1 is a dimension of the mesh"
            # One FSDP unit for the stage: one all-gather forward, one reduce-scatter backward.
            sharded = fully_shard(self.model, mesh=mesh["dp_shard"])  # the model itself, now an FSDPModule
            # Sum, not mean, over the shard group: the loss already divides by the global batch.
            # A plain SUM: gloo has no PREMUL_SUM, which a custom factor would otherwise use.
            sharded.set_gradient_divide_factor(1.0)
            sharded.set_force_sum_reduction_for_comms(True)

    def _pipeline_schedule(self):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        # Equal microbatches: a stage sizes its receive buffers from the first one. So the
        # count is the largest divisor of this rank's share not above the setting.
        wanted = self.settings.microbatches or 2 * self.layout.pp
        share_size = len(self.offsets)
        microbatches = max(n for n in range(1, min(wanted, share_size) + 1) if share_size % n == 0)
        assert self.mesh is not None, "pp above 1 is a dimension of the mesh"
        stage = PipelineStage(self.model, self.stage, self.layout.pp, self.device, group=self.mesh["pp"].get_group())
        # Gradients stay sums over microbatches; the loss already divides by the global batch.
        return Schedule1F1B(stage, microbatches, loss_fn=self.loss, scale_grads=False)

    def loss(self, logits, targets):
        """Sum of per-sample mean token losses, divided by the global batch."""
        per_token = self.torch.nn.functional.cross_entropy(
            logits.reshape(-1, self.settings.vocab_size), targets.reshape(-1), reduction="none"
        )
        return per_token.view(targets.shape[0], -1).mean(dim=1).sum() / self.settings.global_batch

    def step(self, first_sample: int, stop_requested: bool = False) -> tuple[float, bool]:
        """Train one optimizer step on samples first_sample .. first_sample+global_batch-1.

        Returns the global batch's mean loss and whether any rank asked to stop after this
        step, on every rank; the request rides on the step's own collectives, so every rank
        learns it at the same step.
        """
        from lazarus.trainer.gpt.data import batch

        torch = self.torch
        started = time.perf_counter()
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
        self.compute_seconds = time.perf_counter() - started
        with torch.no_grad():
            stop, loss = self._sum_over_replicas(stop_requested, local_loss if self.reports_loss else None)
        self.updating = True
        self.optimizer.step()
        self.updating = False
        return loss, stop > 0

    def _sum_over_replicas(self, stop_requested: bool, local_loss) -> tuple[float, float]:
        """Sum the gradients over dp; returns the summed (stop flag, loss) of every rank.

        One hand-written all-reduce over a buffer of fixed layout instead of DDP: DDP rebuilds
        its buckets in each new process, which changes the summation order of the first step
        after a restart and so breaks bit-identical resumption. Under FSDP2 or tp a rank's
        gradients are its local shards (DTensor), summed with the same coordinates' in every
        replica. Pure data parallelism carries the flag and the loss in the same buffer; any
        other layout sums them over the world, where only rank 0 asks and one rank per
        data-parallel share reports a loss.
        """
        from torch.distributed.tensor import DTensor

        torch, dist = self.torch, self.dist
        grads = []
        for p in self.params:
            assert p.grad is not None, "the backward pass gave every parameter a gradient"
            grads.append(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
        tail = torch.tensor(
            [1.0 if stop_requested else 0.0, 0.0 if local_loss is None else local_loss.item()], device=self.device
        )
        pure_dp = self.mesh is None
        if pure_dp or self.dp_group is not None:
            flat = torch.cat([g.reshape(-1) for g in grads] + ([tail] if pure_dp else []))
            dist.all_reduce(flat, group=self.dp_group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            if pure_dp:
                tail = flat[-2:]
        if not pure_dp:
            dist.all_reduce(tail)
        stop, loss = tail.tolist()
        return stop, loss


def join(session: TrainingSession, spec: RunSpec) -> None:
    """Join the incarnation's process group: NCCL on GPUs, gloo on CPUs, one thread per rank."""
    import torch
    import torch.distributed as dist

    # One thread per rank: several ranks share few cores, and oversubscription costs ~10x.
    torch.set_num_threads(1)
    # NCCL on GPUs (the launcher sets TORCH_NCCL_ASYNC_ERROR_HANDLING, so a broken collective
    # fails instead of hanging), gloo on CPUs; either way a collective gives up after the
    # policy's longest hang time, by which time detect has already reported the hang.
    if torch.cuda.is_available():
        torch.cuda.set_device(session.rank % session.layout.ranks_per_node)
    session.wait_for_store()
    dist.init_process_group(
        "nccl" if torch.cuda.is_available() else "gloo",
        timeout=timedelta(seconds=spec.recovery.longest_hang_seconds + 30),
    )
    session.heartbeat(session.resume_step, "joined")


class SamplesLog:
    """What a data-parallel share trains on, a line per step as it starts (the data position's
    audit; a step trained again by a later incarnation has its lines there), written by the
    share's rank of the first stage and tp coordinate 0."""

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


def restore(session: TrainingSession, trainer: Trainer) -> tuple[int, int]:
    """Load the state the controller chose into `trainer`; returns its step and data position
    ((0, 0) from scratch): what the survivors that kept their processes send, where they rejoin
    this incarnation; what the fault's survivors saved, if the launch record names them; else the
    checkpoint of the resume step."""
    from lazarus.trainer.gpt import survivor_state as survivors
    from lazarus.trainer.sdk import checkpoint

    if not session.resume_step:
        return 0, 0
    run, launch = session.run, read_launch(session.run, session.incarnation)
    if launch is not None and launch.rejoin is not None:
        # The survivors kept their processes and state: the source replica's rank at this place sends it.
        step, samples = survivors.share(trainer, session.rank, launch.rejoin, None)
        if step != session.resume_step:
            raise RuntimeError(f"the survivors hold step {step}, expected {session.resume_step}")
        print(f"lazarus trainer: received step {step} from replica {launch.rejoin.source_replica}", flush=True)
        return step, samples
    if launch is not None and launch.survivors is not None:
        # The state of the step the fault interrupted, from a survivor at this rank's place.
        source = launch.survivors
        holder = source.ranks[session.rank]
        progress = survivors.load(run, source.incarnation, holder, trainer)
        if progress["step"] != session.resume_step:
            raise RuntimeError(f"survivor state holds step {progress['step']}, expected {session.resume_step}")
        read = "read by the node's standby before this rank started" if progress["prefetched"] else "read now"
        print(
            f"lazarus trainer: restored step {progress['step']} from survivor {holder} "
            f"of incarnation {source.incarnation} ({read})",
            flush=True,
        )
    else:
        progress = checkpoint.load(run, trainer.model, trainer.optimizer, session.resume_step)
    return progress["step"], progress["samples"]


class BrokenStep(Exception):
    """A step whose collective broke before the optimizer touched anything (a peer's node died):
    what the rank holds is exactly the state after `step` steps, at data position `samples`."""

    def __init__(self, step: int, samples: int):
        super().__init__(f"the collectives of step {step + 1} broke")
        self.step, self.samples = step, samples


def train(session: TrainingSession) -> tuple[int, bool]:
    """Train from the resume step to the last step; returns the last step trained and whether
    the controller stopped the run before it. With RecoveryPolicy.in_process, a step whose
    collectives break leaves this process waiting at its boundary for the next incarnation,
    which it joins (keep_process); else, or when the controller falls back, it saves the state
    for the next incarnation's ranks and ends."""
    from lazarus.trainer.gpt import survivor_state as survivors
    from lazarus.trainer.sdk.rejoin import remember_inherited_sockets

    run = session.run
    spec = RunSpec.model_validate_json(run.spec_file.read_text())
    check_layout(session.layout, spec.trainer, session.world_size)
    remember_inherited_sockets()
    join(session, spec)
    trainer = Trainer(spec.trainer, session.layout, session.rank)
    step, samples = restore(session, trainer)  # samples: the data position, index of the next sample
    while True:
        try:
            return train_steps(session, spec, trainer, step, samples)
        except BrokenStep as broken:
            kept = keep_process(session, spec, trainer, broken) if keeps_process(spec) else None
            if kept is None:
                survivors.save(run, session.incarnation, session.rank, trainer, broken.step, broken.samples)
                raise broken.__cause__ or broken from None
            trainer, step, samples = kept


def keeps_process(spec: RunSpec) -> bool:
    """Whether a survivor keeps its process at a broken step: the policy asks for it, and the
    group is gloo's, which can be abandoned (NCCL's would need aborting: not done yet)."""
    import torch.distributed as dist

    return spec.recovery.in_process and dist.get_backend() == "gloo"


def keep_process(session: TrainingSession, spec: RunSpec, trainer: Trainer, broken: BrokenStep):
    """A survivor at its step boundary: abandon the broken groups, wait for the next incarnation
    to take this rank in, move there, join its group, and share the state with the new ranks.
    Returns (the trainer to go on with, its step, its data position); None, with nothing moved,
    when the controller starts the next incarnation afresh (the caller saves the state and ends).
    A failure after the move saves the state as a survivor of the new incarnation and raises."""
    from lazarus.trainer.gpt import survivor_state as survivors
    from lazarus.trainer.sdk.rejoin import abandon_process_groups, wait_for_rejoin

    began = time.monotonic()
    held = survivors.snapshot(trainer, broken.step, broken.samples)  # local tensors: no collective
    abandon_process_groups()
    maybe_fail("boundary", broken.step)
    launch = wait_for_rejoin(session, broken.step, spec.recovery.rejoin_timeout_seconds)
    if launch is None or launch.rejoin is None:
        return None
    waited = time.monotonic() - began
    if launch.resume_step != broken.step:
        raise RuntimeError(f"the next incarnation resumes step {launch.resume_step}; this rank holds {broken.step}")
    session.move_to(session.incarnation + 1, launch.resume_step)
    try:
        join(session, spec)
        if trainer.mesh is not None:
            # The mesh's groups were the broken incarnation's: the same shares, laid out afresh.
            trainer = Trainer(spec.trainer, session.layout, session.rank)
            survivors.apply(trainer, held)
        step, samples = survivors.share(trainer, session.rank, launch.rejoin, held)
    except Exception:
        survivors.save(session.run, session.incarnation, session.rank, trainer, broken.step, broken.samples, held)
        raise
    print(
        f"lazarus trainer: kept this process at step {step}; waited {waited:.3f} s, joined incarnation "
        f"{session.incarnation} in {time.monotonic() - began - waited:.3f} s",
        flush=True,
    )
    return trainer, step, samples


def train_steps(session: TrainingSession, spec: RunSpec, trainer: Trainer, step: int, samples: int) -> tuple[int, bool]:
    """This incarnation's steps from `step` (data position `samples`) to the last; returns the last
    step trained and whether the controller stopped the run. BrokenStep: a step's collectives broke
    with the state intact."""
    import torch.distributed as dist

    from lazarus.trainer.gpt import survivor_state as survivors
    from lazarus.trainer.sdk import checkpoint

    run, settings = session.run, spec.trainer
    checkpointer = checkpoint.Checkpointer(
        run, session.incarnation, settings.keep_checkpoints, settings.async_checkpoint, warn=session.warn
    )
    session.heartbeat(step, "restored")
    consumed = SamplesLog(session, trainer) if trainer.writes_samples else None

    stopped = False
    while step < settings.steps:
        maybe_fail("step", step + 1)
        if consumed:
            # Before the step: a rank can die after its share reached the all-reduce that its
            # survivors complete, and the step it never logged is then restored from them.
            consumed.write(step + 1, samples)
        # Rank 0's stop request rides on the step's own collectives (no extra one per step).
        try:
            loss, stopped = trainer.step(samples, stop_requested=session.stop_requested(agree=lambda asked: asked))
        except Exception as error:
            # A broken collective (a peer's node died) fails the step before the optimizer
            # touched anything: what this rank holds is exactly the state after `step` steps.
            if not trainer.updating:
                raise BrokenStep(step, samples) from error
            raise
        step += 1
        samples += settings.global_batch

        session.step_done(step, loss, compute_seconds=trainer.compute_seconds)
        # A save's collectives break when a peer dies, an async one's found here a step or more
        # later: either way the state is still that after `step` steps, so it is a survivor's.
        with survivors.saved_on_failure(run, session, trainer, step, samples):
            checkpointer.poll()
            if session.checkpoint_due(step) or stopped:
                checkpointer.save(trainer.model, trainer.optimizer, step, samples)
        if session.checkpoint_due(step) or stopped:
            maybe_fail("checkpoint", step)
        if stopped:
            break

    with survivors.saved_on_failure(run, session, trainer, step, samples):
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
