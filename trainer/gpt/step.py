"""One rank's share of the built-in GPT and its training step: the layout it can run, the device
mesh, the model cut to its pipeline stage and split over tp and dp_shard, the optimizer, and the
step whose math survives a reshard and a recovery bit for bit. The run loop is train.py's."""

from __future__ import annotations

import time

from lazarus.schema.layout import MESH_DIMENSIONS, Layout
from lazarus.schema.run import TrainerSettings


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
