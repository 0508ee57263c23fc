"""What a capacity planner writes: a cluster, its failures, what recovery costs (`lazarus simulate`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from lazarus.schema.base import Strict

POLICIES = ("automatic", "survivors", "reshard-only", "wait-for-human")
"""automatic: hot spares, else reshard, restoring the newest checkpoint; survivors: the same,
restoring what the surviving replicas saved at a crash (Lazarus's policy for the built-in
trainer); reshard-only: never use spares; wait-for-human: every fault waits for a person to
restart the run on a spare."""


class Fixed(Strict):
    """A cost that is always the same."""

    dist: Literal["fixed"] = "fixed"
    seconds: float = Field(ge=0, description="The cost (seconds).")


class LogNormal(Strict):
    """A cost with a long right tail: log-normal with the given median."""

    dist: Literal["lognormal"]
    median: float = Field(gt=0, description="Median cost (seconds).")
    sigma: float = Field(default=0.5, ge=0, description="Standard deviation of the cost's logarithm (dimensionless).")


class Uniform(Strict):
    """A cost spread evenly between two bounds."""

    dist: Literal["uniform"]
    low: float = Field(ge=0, description="Smallest cost (seconds).")
    high: float = Field(ge=0, description="Largest cost (seconds).")


class Measured(Strict):
    """Costs measured on real runs; each recovery draws one of them at random."""

    dist: Literal["measured"]
    samples: list[float] = Field(min_length=1, description="Measured costs (seconds).")


Cost = Fixed | LogNormal | Uniform | Measured


def _cost(value) -> dict:
    """Accept a bare number as a fixed cost in seconds."""
    return {"dist": "fixed", "seconds": value} if isinstance(value, (int, float)) else value


class StageCosts(Strict):
    """What each recovery stage costs the whole job (all its GPUs wait)."""

    detect: Cost = Field(
        default_factory=lambda: Fixed(seconds=10), description="Fault to report, for crashes (seconds)."
    )
    drain: Cost = Field(
        default_factory=lambda: Fixed(seconds=20), description="Stop every rank, quarantine the node (seconds)."
    )
    reschedule: Cost = Field(
        default_factory=lambda: Fixed(seconds=1), description="Read the inventory and decide (seconds)."
    )
    replace_or_reshard: Cost = Field(
        default_factory=lambda: Fixed(seconds=5), description="Claim spares, write the assignment (seconds)."
    )
    resume: Cost = Field(
        default_factory=lambda: Fixed(seconds=120),
        description="Start every rank and load the checkpoint, to the first step (seconds).",
    )

    @model_validator(mode="before")
    @classmethod
    def _numbers_are_fixed_costs(cls, data):
        return {k: _cost(v) for k, v in data.items()} if isinstance(data, dict) else data


class FailureModel(Strict):
    """How often the job is interrupted and how faults show themselves."""

    interruptions_per_day: float = Field(
        gt=0,
        description=(
            "Unexpected interruptions of the whole job per day at full size (1/day); scales with the nodes in use."
        ),
    )
    hang_share: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description=(
            "Share of faults that are hangs, found only once the step stalls past the hang time; drain stops the hung "
            "node first, so its peers save as for a death (fraction)."
        ),
    )
    hang_detect_seconds: float = Field(
        default=300.0,
        ge=0,
        description=(
            "Time to notice a hang (seconds): Lazarus derives it from the run's step times, 5 x the p99 step at least "
            "1 s for a stopped process or every rank idle, about 25 s for a rank spinning (its stack stands still)."
        ),
    )
    straggler_share: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description=(
            "Share of faults that are stragglers: a node slowed by straggler_factor, which slows the whole job until "
            "it is swapped for a spare in a planned recovery, with no step lost (fraction)."
        ),
    )
    straggler_factor: float = Field(
        default=1.5, ge=1, description="How much slower a straggler is than its peers, and the job with it (x)."
    )
    straggler_detect_seconds: float = Field(
        default=60.0, ge=0, description="Time a straggler slows the job before it is found: the window (seconds)."
    )
    sick_share: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description=(
            "Share of faults that are sick nodes: a failing health check while the node still trains, swapped for a "
            "spare in a planned recovery, with no step lost (fraction)."
        ),
    )

    @model_validator(mode="after")
    def _shares_add_up(self) -> FailureModel:
        if self.hang_share + self.straggler_share + self.sick_share > 1:
            raise ValueError("failures: hang_share + straggler_share + sick_share must be at most 1")
        return self


class CheckpointModel(Strict):
    """How often the job checkpoints and what that costs."""

    interval_minutes: float = Field(default=30.0, gt=0, description="Training time between checkpoints (minutes).")
    save_stall_seconds: float = Field(
        default=10.0, ge=0, description="Time training stops for each save (seconds); small with asynchronous saves."
    )
    load_seconds: float = Field(
        default=60.0, ge=0, description="Time to load a checkpoint on resume, added to the resume stage (seconds)."
    )
    step_seconds: float = Field(
        default=10.0,
        gt=0,
        description=(
            "Time of one optimizer step (seconds): under the survivors policy a crash loses the step in flight "
            "(half of one on average), not the training since the last checkpoint."
        ),
    )
    survivor_save_seconds: float = Field(
        default=10.0,
        ge=0,
        description="Survivors policy: time the surviving ranks take to save their state at a fault, added to drain "
        "(seconds).",
    )


class Scenario(Strict):
    """A long training run on a large cluster, for the Monte Carlo planner."""

    name: str = Field(description="Scenario name, printed with the results.")
    gpus: int = Field(gt=0, description="GPUs the job trains on at full size (GPUs).")
    gpus_per_node: int = Field(default=8, gt=0, description="GPUs per node; a node is the unit of failure (GPUs).")
    tp: int = Field(default=1, ge=1, description="Tensor-parallel degree (GPUs per stage).")
    pp: int = Field(default=1, ge=1, description="Pipeline-parallel degree (stages per replica).")
    dp: int = Field(ge=1, description="Data-parallel degree: model replicas (replicas).")
    days: float = Field(default=54.0, gt=0, description="Wall-clock length of the run (days).")
    failures: FailureModel = Field(description="Interruption rate and kinds.")
    costs: StageCosts = Field(default_factory=StageCosts, description="Cost of each recovery stage.")
    checkpoint: CheckpointModel = Field(default_factory=CheckpointModel, description="Checkpoint interval and costs.")
    spare_nodes: int = Field(default=0, ge=0, description="Hot spare nodes held idle next to the job (nodes).")
    repair_hours: float = Field(
        default=24.0, gt=0, description="Time until a failed node is back in the spare pool (hours)."
    )
    human_restart: Cost = Field(
        default_factory=lambda: Fixed(seconds=1200),
        description="Fault to training again when a person restarts the run (seconds).",
    )
    min_dp: int = Field(default=1, ge=1, description="Smallest data-parallel degree the run may shrink to (replicas).")
    regrow: bool = Field(
        default=True,
        description="When repaired or released nodes can hold a whole replica again, restart at a larger dp.",
    )
    policies: list[Literal["automatic", "survivors", "reshard-only", "wait-for-human"]] = Field(
        default_factory=lambda: list(POLICIES), description="Policies to compare."
    )
    target_ettr: float = Field(default=0.9, gt=0, lt=1, description="ETTR the spare-count search aims for (fraction).")
    repetitions: int = Field(default=200, ge=1, description="Monte Carlo repetitions per policy.")
    seed: int = Field(default=0, ge=0, description="Random seed; the same seed gives the same numbers.")

    @model_validator(mode="before")
    @classmethod
    def _numbers_are_fixed_costs(cls, data):
        if isinstance(data, dict) and "human_restart" in data:
            data = {**data, "human_restart": _cost(data["human_restart"])}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Scenario:
        if self.tp * self.pp * self.dp != self.gpus:
            raise ValueError(f"dp*pp*tp = {self.dp * self.pp * self.tp} but gpus is {self.gpus}; make them equal")
        replica = self.tp * self.pp
        if replica % self.gpus_per_node:
            raise ValueError(
                f"gpus_per_node: {self.gpus_per_node} does not divide one replica's tp*pp = {replica} GPUs; "
                f"a node would hold parts of two replicas"
            )
        if self.min_dp > self.dp:
            raise ValueError(f"min_dp: {self.min_dp} exceeds dp {self.dp}")
        return self

    @property
    def nodes(self) -> int:
        """Nodes the job uses at full size."""
        return self.gpus // self.gpus_per_node

    @property
    def nodes_per_replica(self) -> int:
        """Nodes one model replica occupies."""
        return self.tp * self.pp // self.gpus_per_node
