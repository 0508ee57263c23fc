"""What a user writes: the run spec (trainer, layout, cluster, recovery policy)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from lazarus.schema.base import MAX_SECONDS, Strict
from lazarus.schema.cluster_settings import KubernetesSettings, SlurmSettings  # noqa: F401 - part of the spec
from lazarus.schema.health_checks import HealthChecks
from lazarus.schema.layout import Layout
from lazarus.schema.names import shown
from lazarus.schema.policy import RecoveryPolicy
from lazarus.schema.pool import NODE_NAME

CONTRACT_ENV = {
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_ERROR_FILE",
}
"""Variables the launcher sets for every rank (trainer/CONTRACT.md); trainer.env may not override them."""

BUILT_IN_TRAINER = ["python", "-m", "lazarus.trainer"]
"""The default trainer.command: the built-in GPT trainer (`python` is the worker's interpreter)."""


class TrainerSettings(Strict):
    """What each rank runs, where, how it reports progress; and the built-in GPT trainer's model,
    schedule and checkpointing.

    `command` may name any torchrun-ready script. One that uses lazarus.session reads `steps` and
    `checkpoint_every` from here; one that does not (a plain torchrun script keeping its own
    snapshot) is complete when every rank exits 0, and reports progress only through
    `progress_pattern`. The model fields are the built-in trainer's alone.
    """

    command: list[str] = Field(
        default_factory=lambda: list(BUILT_IN_TRAINER),
        min_length=1,
        description="Program each rank runs, as an argv list (no shell); `python` means the worker's interpreter.",
    )
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment variables for every rank.")
    workdir: str | None = Field(
        default=None,
        description=(
            "Folder the ranks run in: where the relative paths of a script (its own snapshot file, say) land. "
            "Default: `work/` in the run's directory, the same folder for every incarnation of the run and never "
            "another run's. Two runs given the same workdir share its files. On Kubernetes, a path inside the rank "
            "pods (the default is on the run volume)."
        ),
    )
    progress_pattern: str | None = Field(
        default=None,
        description=(
            "For a script that does not use lazarus.session: a regular expression matched against every line a "
            "rank prints, whose group `step` (else its first group) is the step that rank just completed, e.g. "
            "`^step (?P<step>\\d+)`. It then feeds the run's step, lost steps and hang detection."
        ),
    )
    survivor_state: bool = Field(
        default=False,
        description=(
            "The script saves its share of the last completed step with session.save_survivor_state when a "
            "collective breaks, and restores it with session.load_survivor_state (trainer/CONTRACT.md): drain "
            "then waits up to recovery.survivor_grace_seconds for the survivors, and a fault that leaves a whole "
            "replica loses no completed step. The built-in trainer always does."
        ),
    )
    output_is_heartbeat: bool = Field(
        default=False,
        description=(
            "Every line a rank prints counts as a heartbeat: a rank silent for recovery.hang_after_seconds "
            "(recovery.startup_grace_seconds before its first line) is judged hung. Off, a script that reports "
            "nothing is judged by its exit and its node's health alone."
        ),
    )

    vocab_size: int = Field(
        default=64, ge=8, le=65536, description="Vocabulary size of the synthetic token stream (tokens)."
    )
    seq_len: int = Field(default=32, ge=4, le=4096, description="Tokens per training sample.")
    d_model: int = Field(default=64, ge=8, le=8192, description="Width of the transformer (hidden units).")
    n_layers: int = Field(default=2, ge=1, le=128, description="Number of transformer blocks.")
    n_heads: int = Field(default=4, ge=1, le=128, description="Attention heads per block; must divide d_model.")
    steps: int = Field(default=60, ge=1, description="Optimizer steps the run trains for.")
    global_batch: int = Field(
        default=16, ge=1, description="Samples per optimizer step, summed over all data-parallel replicas."
    )
    learning_rate: float = Field(default=3e-3, gt=0, description="AdamW learning rate (dimensionless).")
    seed: int = Field(default=0, ge=0, description="Seed for model initialisation and the token stream.")
    checkpoint_every: int = Field(default=10, ge=1, description="Steps between checkpoints.")
    keep_checkpoints: int = Field(
        default=3, ge=1, description="Complete checkpoints kept on disk; older ones are purged."
    )
    async_checkpoint: bool = Field(
        default=True, description="Write checkpoints from a background thread so training does not wait for the disk."
    )
    microbatches: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Pipeline microbatches per replica and step, at most (default: 2 x pp); the trainer takes the "
            "largest count that divides the replica's share of the batch evenly."
        ),
    )

    @property
    def built_in(self) -> bool:
        """True when the ranks run the built-in trainer."""
        return self.command == BUILT_IN_TRAINER

    @property
    def saves_survivors(self) -> bool:
        """True when the ranks save their state on a broken collective (built-in, or survivor_state)."""
        return self.built_in or self.survivor_state

    @property
    def output_heartbeats(self) -> bool:
        """True when the node launchers turn the ranks' output into heartbeats (pattern or any line)."""
        return self.output_is_heartbeat or self.progress_pattern is not None

    def step_in(self, line: str) -> int | None:
        """The step `progress_pattern` finds in one line of output (0 is a step), or None. Of several
        matches (a progress bar redrawn within the line) the last that names a step wins: the newest."""
        if self.progress_pattern is None:
            return None
        pattern = re.compile(self.progress_pattern)  # re caches it: compiled once per process
        group = "step" if "step" in pattern.groupindex else 1
        step = None
        for found in pattern.finditer(line):
            text = found.group(group)
            # isdigit alone takes '²' and other digits int() refuses, from any line a rank prints;
            # past 18 digits (int64) it is no step counter, and int() refuses past 4300.
            if text is not None and text.isascii() and text.isdigit() and len(text) <= 18:
                step = int(text)
        return step

    @model_validator(mode="after")
    def _can_be_executed(self) -> TrainerSettings:
        # What the operating system refuses to exec would fail every launch attempt instead.
        texts = {"command": self.command, "env": [*self.env, *self.env.values()], "workdir": [self.workdir or ""]}
        for field, values in texts.items():
            if any("\x00" in value for value in values):
                raise ValueError(f"trainer.{field}: holds a NUL character, which no program can be given")
        bad_names = [name for name in self.env if not name or "=" in name]
        if bad_names:
            raise ValueError(f"trainer.env: {shown(bad_names[0])} is not a variable name (empty, or with '=')")
        return self

    @model_validator(mode="after")
    def _heads_divide_width(self) -> TrainerSettings:
        if len(self.command) == 1 and " " in self.command[0].strip():
            raise ValueError(
                f"trainer.command: {shown(self.command[0])} is one string; give an argv list, "
                f"e.g. {shown(self.command[0].split())}"
            )
        reserved = sorted(name for name in self.env if name in CONTRACT_ENV or name.startswith("LAZARUS_"))
        if reserved:
            raise ValueError(f"trainer.env: {shown(reserved)} set by the launcher for every rank; remove it")
        if self.progress_pattern is not None:
            try:
                groups = re.compile(self.progress_pattern).groups
            except re.error as error:
                raise ValueError(
                    f"trainer.progress_pattern: {shown(self.progress_pattern)} is not a regular expression: {error}"
                ) from None
            if not groups:
                raise ValueError(
                    f"trainer.progress_pattern: {shown(self.progress_pattern)} has no group for the step; "
                    f"write it as e.g. 'step (?P<step>\\d+)'"
                )
        if self.d_model % self.n_heads:
            raise ValueError(
                f"trainer.n_heads: {self.n_heads} does not divide trainer.d_model {self.d_model}; "
                f"pick n_heads from the divisors of d_model"
            )
        return self


class ClusterSpec(Strict):
    """Where the ranks run and how many nodes stand by."""

    backend: str = Field(
        default="local",
        pattern=r"^[a-z][a-z0-9-]*$",
        max_length=63,
        description=(
            "Cluster backend, by the name it is registered under (infra/registry.py; the commands and the "
            "worker refuse a name none is): `local` runs each node as rank processes on this machine; "
            "`kubernetes` runs a pod per node on the nodes labelled `lazarus.dev/pool`; `slurm` runs each "
            "node's ranks as a job step of one allocation of the Slurm cluster that SLURM_CONF names."
        ),
    )
    kubernetes: KubernetesSettings = Field(
        default_factory=KubernetesSettings, description="Settings of the kubernetes backend (ignored by the others)."
    )
    slurm: SlurmSettings = Field(
        default_factory=SlurmSettings, description="Settings of the slurm backend (ignored by the others)."
    )
    active_nodes: int = Field(default=4, ge=1, description="Nodes that train at launch (nodes).")
    spare_nodes: int = Field(
        default=1,
        ge=0,
        description=(
            "Hot spares the pool keeps free for this run (nodes). They are the pool's, shared by every run that "
            "uses it: the local backend adds nodes at launch until this many are free; on Kubernetes, label them "
            "`lazarus.dev/spare=true`."
        ),
    )
    priority: int = Field(
        default=0,
        ge=-1000,
        le=1000,
        description=(
            "When runs need the pool's last spares at once, the higher priority gets them first; on a tie, the run "
            "whose fault broke more ranks, then the one that failed first. The other reshards or waits, per its "
            "recovery policy."
        ),
    )
    warm_standby: bool = Field(
        default=True,
        description=(
            "Keep one warm standby process per node (interpreter started, torch and the trainer imported) "
            "that forks the node's ranks when an incarnation starts, so a resume pays neither process start "
            "nor import. Only `python -m module` and `python script.py` commands run warm; others start cold."
        ),
    )


class FaultInjection(Strict):
    """A fault planned in advance: every rank of `node` is SIGKILLed at a given step or time.

    The built-in trainer and lazarus.session scripts kill themselves exactly at the step; for any
    other script the node's launcher does it, when the output of that node's ranks shows the step
    before (trainer.progress_pattern; within a poll of 20 ms, so perhaps a step later) or
    `after_seconds` after the ranks started.
    """

    node: str = Field(description="Node whose ranks die, e.g. node-1 (a node of the pool: `lazarus pool` lists them).")
    step: int | None = Field(default=None, ge=1, description="Step at which they die (give this or after_seconds).")
    after_seconds: float | None = Field(
        default=None,
        gt=0,
        le=MAX_SECONDS,
        description="Or: seconds after the incarnation's ranks started, for a script that reports no steps (seconds).",
    )
    point: Literal["step", "checkpoint", "survivor_save", "boundary"] = Field(
        default="step",
        description=(
            "step: just before training `step`; checkpoint: just after starting the checkpoint of `step`, "
            "while it is being written (the built-in trainer and lazarus.session scripts); survivor_save: while "
            "saving the state of `step` as a survivor of another node's fault (a trainer that saves survivors); "
            "boundary: where a survivor holding the state of `step` would wait for the next incarnation "
            "(recovery.in_process; the built-in trainer)."
        ),
    )
    incarnation: int = Field(
        default=0, ge=0, description="Incarnation in which the fault happens (0: the first launch)."
    )
    effect: Literal["kill", "raise", "disk_full", "stuck", "spin"] = Field(
        default="kill",
        description=(
            "kill: every rank of the node dies by SIGKILL, as on a dead node; raise: each rank of the node raises "
            "a Python exception at that point (a bug in a rank whose peers and node are fine; the built-in "
            "trainer and lazarus.session scripts); disk_full: the node's ranks' writes of the checkpoint of `step` "
            "fail with ENOSPC, as on a full volume (point: checkpoint; the built-in trainer); stuck: each rank of "
            "the node waits at that point, forever, in a receive no peer answers, its peers behind it in the "
            "step's collective (point: step; the built-in trainer and lazarus.session scripts); spin: each rank of "
            "the node loops forever at that point, busy, never reaching the step's collective or the boundary "
            "(point: step or boundary; the same)."
        ),
    )

    @model_validator(mode="after")
    def _step_or_time(self) -> FaultInjection:
        if (self.step is None) == (self.after_seconds is None):
            raise ValueError(f"faults: give {shown(self.node)} either step or after_seconds, not both nor neither")
        if self.after_seconds is not None and self.point != "step":
            raise ValueError(f"faults.point: {self.point} needs a step, not after_seconds")
        if self.after_seconds is not None and self.effect != "kill":
            raise ValueError(f"faults.effect: {self.effect} needs a step, not after_seconds (the ranks raise it)")
        if self.effect == "disk_full" and self.point != "checkpoint":
            raise ValueError("faults.effect: disk_full fails a checkpoint's write; set point: checkpoint")
        if self.effect == "stuck" and self.point != "step":
            raise ValueError("faults.effect: stuck holds a rank before its step; set point: step")
        if self.effect == "spin" and self.point not in ("step", "boundary"):
            raise ValueError("faults.effect: spin holds a rank before its step or at its boundary; set point: step")
        return self

    @property
    def planned(self) -> str:
        """The fault as LAZARUS_FAIL_AT says it: `step:N`, `checkpoint:N` or `after:S`, then `:raise`,
        `:disk_full`, `:stuck` or `:spin` for those effects."""
        if self.after_seconds is not None:
            return f"after:{self.after_seconds:g}"
        return f"{self.point}:{self.step}" + ("" if self.effect == "kill" else f":{self.effect}")


class RunSpec(Strict):
    """One training run: what to train, on how many nodes, and how to recover."""

    name: str = Field(
        pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$",
        description="Run name: lowercase letters, digits and dashes; the default run id prefix.",
    )
    trainer: TrainerSettings = Field(
        default_factory=TrainerSettings,
        description="What each rank runs, where, how it reports progress; the built-in trainer's model and schedule.",
    )
    layout: Layout = Field(
        default_factory=Layout,
        description="Parallel layout: dp replicas of pp x dp_shard x tp ranks, ranks_per_node ranks on each node.",
    )
    cluster: ClusterSpec = Field(default_factory=ClusterSpec, description="Backend and node counts.")
    recovery: RecoveryPolicy = Field(default_factory=RecoveryPolicy, description="Detection and recovery policy.")
    health: HealthChecks = Field(
        default_factory=HealthChecks,
        description="Node health: a check each node runs, and Kubernetes node conditions; a sick node is swapped.",
    )
    faults: list[FaultInjection] = Field(
        default_factory=list, description="Faults to inject on purpose (tests, demos); empty in production."
    )

    @model_validator(mode="after")
    def _consistent(self) -> RunSpec:
        ranks = self.cluster.active_nodes * self.layout.ranks_per_node
        if self.layout.world_size != ranks:
            raise ValueError(
                f"layout: dp*pp*dp_shard*tp = {self.layout.world_size} but cluster.active_nodes x "
                f"layout.ranks_per_node = {self.cluster.active_nodes} x {self.layout.ranks_per_node} = {ranks} ranks; "
                f"make them equal (for example layout.dp: {ranks // self.layout.replica_ranks or 1})"
            )
        if self.recovery.min_dp > self.layout.dp:
            raise ValueError(
                f"recovery.min_dp: {self.recovery.min_dp} exceeds layout.dp {self.layout.dp}; "
                f"set it between 1 and {self.layout.dp}"
            )
        if self.trainer.built_in and self.trainer.n_heads % self.layout.tp:
            raise ValueError(
                f"layout.tp: {self.layout.tp} does not divide trainer.n_heads {self.trainer.n_heads}, and each "
                f"tensor-parallel rank computes whole attention heads; set tp to a divisor of {self.trainer.n_heads}"
            )
        if self.trainer.built_in and self.layout.pp > self.trainer.n_layers:
            raise ValueError(
                f"layout.pp: {self.layout.pp} pipeline stages but trainer.n_layers is {self.trainer.n_layers}; "
                f"every stage needs a block, so set pp to at most {self.trainer.n_layers}"
            )
        nodes = self.cluster.active_nodes + self.cluster.spare_nodes
        for fault in self.faults:
            # Spelled exactly as the pool names nodes: `node-01` or `node-١` would never fire. Which
            # nodes the pool has is known at launch, where the local backend checks it.
            if NODE_NAME.fullmatch(fault.node) is None:
                raise ValueError(
                    f"faults.node: {shown(fault.node)} is not a node name; the pool names its nodes "
                    f"node-0, node-1, ... (a run alone in its home gets node-0 .. node-{nodes - 1})"
                )
            if fault.point == "survivor_save" and not self.trainer.saves_survivors:
                raise ValueError(
                    "faults.point: survivor_save needs a trainer that saves survivors' state "
                    "(the built-in trainer, or trainer.survivor_state: true)"
                )
            if fault.effect in ("raise", "stuck") and self.trainer.progress_pattern is not None:
                raise ValueError(
                    f"faults.effect: {fault.effect} needs ranks that carry out planned faults themselves (the built-in "
                    "trainer or a lazarus.session script); with trainer.progress_pattern the launcher kills them"
                )
            if fault.effect == "disk_full" and not self.trainer.built_in:
                raise ValueError("faults.effect: disk_full needs the built-in trainer, which writes the checkpoints")
            if fault.step is not None and fault.step > self.trainer.steps and self.trainer.progress_pattern is None:
                raise ValueError(f"faults.step: {fault.step} is past trainer.steps {self.trainer.steps}")
        data_ranks = self.layout.dp * self.layout.dp_shard
        if self.trainer.global_batch < data_ranks:
            raise ValueError(
                f"trainer.global_batch: {self.trainer.global_batch} is smaller than layout.dp x layout.dp_shard = "
                f"{data_ranks}; every data-parallel rank needs at least one sample per step"
            )
        return self
