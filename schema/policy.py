"""What a user writes about recovery: how faults are detected, how recovery behaves, and every
stage's timeouts and retries (the spec's `recovery` section)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from lazarus.schema.base import MAX_ATTEMPTS, MAX_SECONDS, Strict


class StagePolicy(Strict):
    """Timeout and retry policy of one activity (one recovery stage)."""

    timeout_seconds: float = Field(gt=0, le=MAX_SECONDS, description="Start-to-close timeout of one attempt (seconds).")
    heartbeat_timeout_seconds: float = Field(
        gt=0, le=MAX_SECONDS, description="An attempt that does not heartbeat for this long is presumed lost (seconds)."
    )
    max_attempts: int = Field(
        default=5, ge=0, le=MAX_ATTEMPTS, description="Attempts before the stage counts as failed; 0 means unlimited."
    )
    initial_retry_seconds: float = Field(
        default=0.5, gt=0, le=MAX_SECONDS, description="Wait before the first retry (seconds)."
    )
    retry_backoff: float = Field(
        default=2.0, ge=1, description="Factor by which each retry's wait grows (dimensionless)."
    )
    max_retry_seconds: float = Field(
        default=10.0, gt=0, le=MAX_SECONDS, description="Longest wait between retries (seconds)."
    )

    @model_validator(mode="after")
    def _retries_grow_to_their_longest(self) -> StagePolicy:
        # Temporal refuses a retry policy whose longest wait is shorter than its first.
        if self.max_retry_seconds < self.initial_retry_seconds:
            raise ValueError(
                f"max_retry_seconds ({self.max_retry_seconds:g}) is less than initial_retry_seconds "
                f"({self.initial_retry_seconds:g}): the longest wait between retries cannot be shorter than the first"
            )
        return self


def _stage(timeout: float, heartbeat: float, attempts: int = 5) -> StagePolicy:
    return StagePolicy(timeout_seconds=timeout, heartbeat_timeout_seconds=heartbeat, max_attempts=attempts)


class StagePolicies(Strict):
    """Per-activity timeouts and retries; `launch` starts incarnation 0, the rest are the recovery stages."""

    launch: StagePolicy = Field(
        default_factory=lambda: _stage(120, 10), description="Create the run's cluster state and start incarnation 0."
    )
    detect: StagePolicy = Field(
        default_factory=lambda: _stage(7200, 15, attempts=0),
        description=(
            "Watch the run; returns a fault, completion, a new warning, spares for a regrow, or a progress snapshot "
            "after progress_every_seconds (so its timeout must exceed that)."
        ),
    )
    drain: StagePolicy = Field(
        default_factory=lambda: _stage(60, 5),
        description="Quarantine faulty nodes and stop every rank of the incarnation.",
    )
    reschedule: StagePolicy = Field(
        default_factory=lambda: _stage(30, 5), description="Read the node inventory for the recovery decision."
    )
    replace_or_reshard: StagePolicy = Field(
        default_factory=lambda: _stage(30, 5), description="Claim spares and write the next incarnation's assignment."
    )
    resume: StagePolicy = Field(
        default_factory=lambda: _stage(300, 10),
        description="Start the next incarnation and wait for its first new step.",
    )
    stop: StagePolicy = Field(
        default_factory=lambda: _stage(180, 10),
        description=(
            "Checkpoint and stop the ranks (pause, abort, operator's reshard); past the timeout they are killed."
        ),
    )
    return_node: StagePolicy = Field(
        default_factory=lambda: _stage(30, 5), description="Return a repaired node to the spare pool."
    )
    release: StagePolicy = Field(
        default_factory=lambda: _stage(60, 5),
        description="When the run ends: stop its standbys and give its active nodes back to the pool.",
    )
    archive: StagePolicy = Field(
        default_factory=lambda: _stage(60, 5),
        description="Write older incidents' records to the run directory, so the status carries only their tally.",
    )
    take_over: StagePolicy = Field(
        default_factory=lambda: _stage(600, 5, attempts=0),
        description=(
            "Take the run over (after a reset, for an adoption) once the stages of the execution it replaces have "
            "ended (each attempt waits most of its timeout for them, then fails saying so and is retried), and "
            "read what the cluster holds of it."
        ),
    )


class StragglerPolicy(Strict):
    """What a node slower than its peers gets: each rank reports its own work per step (before it waits
    for its peers), and a node whose work takes `factor` times its peers' for `window_seconds` is a
    straggler."""

    action: Literal["swap", "report", "off"] = Field(
        default="swap",
        description=(
            "swap: a planned recovery puts a free spare in its place (checkpoint at a step boundary, no step "
            "lost), else it is reported; report: a warning on the run; off: not looked for."
        ),
    )
    factor: float = Field(
        default=1.2,
        gt=1,
        description="How many times its peers' median work per step makes a node slow (dimensionless).",
    )
    window_seconds: float = Field(
        default=60.0,
        gt=0,
        le=MAX_SECONDS,
        description="How long a node must stay that slow, judged on its median over this window (seconds).",
    )


class RecoveryPolicy(Strict):
    """How faults are detected and how recovery behaves; every stage's timeouts and retries."""

    heartbeat_interval_seconds: float = Field(
        default=0.1,
        gt=0,
        le=60,
        description="How often detect reads rank heartbeats and node health, and heartbeats to Temporal (seconds).",
    )
    hang_after_seconds: float | None = Field(
        default=None,
        gt=0,
        le=MAX_SECONDS,
        description=(
            "A rank whose last heartbeat is older than this counts as hung, whatever else is seen (seconds). None: "
            "derived from the run's own step times (hang_step_multiple, hang_floor_seconds, busy_hang_seconds)."
        ),
    )
    hang_step_multiple: float = Field(
        default=5.0,
        gt=1,
        description=(
            "Derived hang time: this multiple of the 99th percentile of the run's recent step times, at least "
            "hang_floor_seconds; a run whose step stalls that long is hung when a rank's process stopped or every "
            "rank sits idle (no CPU, no output) (dimensionless)."
        ),
    )
    hang_floor_seconds: float = Field(
        default=1.0, gt=0, le=MAX_SECONDS, description="The least derived hang time (seconds)."
    )
    quiet_hang_seconds: float = Field(
        default=10.0,
        gt=0,
        le=MAX_SECONDS,
        description=(
            "Derived hang time of a script that reports no steps: how long every rank may sit idle together (no CPU, "
            "no output) before the run counts as hung, or hang_step_multiple times the longest such stretch the run "
            "went on from, if longer; before any rank was seen busy, the startup grace (seconds)."
        ),
    )
    busy_hang_seconds: float = Field(
        default=300.0,
        gt=0,
        le=MAX_SECONDS,
        description=(
            "Derived hang time: a run whose step stalls while its ranks still run and use CPU counts as hung only "
            "after this long, since a checkpoint save or a recompile looks the same as a rank spinning (seconds)."
        ),
    )
    busy_probe_seconds: float = Field(
        default=15.0,
        gt=0,
        le=MAX_SECONDS,
        description=(
            "Derived hang time: a run whose step stalls this long while its ranks still use CPU has their Python "
            "stacks dumped every few seconds; one whose main thread then stays put for stack_still_seconds is hung, "
            "well before busy_hang_seconds (seconds)."
        ),
    )
    stack_still_seconds: float = Field(
        default=10.0,
        gt=0,
        le=MAX_SECONDS,
        description=(
            "How long a rank's main thread must stay in the same functions, dump after dump, while the step stalls "
            "past busy_probe_seconds, before the rank counts as hung (seconds): a rank in an endless loop, or "
            "busy-waiting, never leaves them; one that saves or computes moves through its calls."
        ),
    )
    startup_grace_seconds: float = Field(
        default=120.0,
        gt=0,
        le=MAX_SECONDS,
        description="Time a new incarnation may take to its first heartbeat before it counts as hung (seconds).",
    )
    progress_every_seconds: float = Field(
        default=3600.0,
        gt=0,
        le=MAX_SECONDS,
        description=(
            "Detect returns to the workflow with a progress snapshot at least this often, even when nothing "
            "happened (seconds): a safety interval. Between reports the step is in detect's heartbeat details."
        ),
    )
    min_dp: int = Field(default=1, ge=1, description="Smallest data-parallel degree the run may shrink to (replicas).")
    workflow_task_timeout_seconds: float = Field(
        default=10.0,
        ge=1,
        le=120,
        description=(
            "How long the Temporal server waits for a worker to finish one of the run's workflow tasks before it "
            "hands the task to another worker (seconds). A controller that dies inside a local stage (drain, "
            "reschedule, replace_or_reshard) holds the recovery this long. A worker so loaded that one task takes "
            "longer has the task retried and its local stages run again, to the decision their first run claimed "
            "(at 3 s, 1,000 runs hit within 10 s on one worker: 252 tasks retried, none failed; "
            "bench/controller_scale.py). Operator controls during a local stage wait up to 80 % of it. Also the "
            "time a worker has to replay a long history cold. Fixed when the run's workflow starts (set_policy "
            "refuses it)."
        ),
    )
    burst_gather_seconds: float = Field(
        default=2.0,
        ge=0,
        le=MAX_SECONDS,
        description=(
            "When a fault domain (a rack, a switch) takes nodes of several runs at once, a run's recovery waits "
            "for the others hit to drain before it decides, so that the pool's spares go by priority, not by who "
            "drained first; it stops waiting when none of them drained for this long (seconds)."
        ),
    )
    capacity_wait_seconds: float = Field(
        default=300.0,
        ge=0,
        le=MAX_SECONDS,
        description="How long to wait for a free spare before asking an operator (WAITING_FOR_APPROVAL) (seconds).",
    )
    capacity_poll_seconds: float = Field(
        default=5.0,
        gt=0,
        le=MAX_SECONDS,
        description="How often the inventory is read again while waiting for capacity (seconds).",
    )
    regrow: bool = Field(
        default=True,
        description=(
            "A run below its spec's layout.dp (or the dp of an operator's reshard) grows back once the pool has the "
            "nodes (a node returned, a spare freed, a run ended): at a step boundary it checkpoints, stops, claims "
            "them and resumes at the larger dp, the global batch and sample order kept. Set false to hold it small "
            "(`lazarus run set-policy RUN regrow=false`)."
        ),
    )
    approval_wait_seconds: float = Field(
        default=3600.0,
        ge=0,
        le=MAX_SECONDS,
        description=(
            "After the capacity wait, how long to wait for an operator's approve or abort before the run stops "
            "(seconds); the only time a human is asked."
        ),
    )
    stop_grace_seconds: float = Field(
        default=120.0,
        gt=0,
        le=MAX_SECONDS,
        description=(
            "How long ranks get to checkpoint and exit on a pause, abort or operator's reshard before they are killed "
            "(seconds)."
        ),
    )
    history_limit_events: int = Field(
        default=10000,
        ge=100,
        description=(
            "The workflow continues as new once its history has this many events, or when Temporal suggests it "
            "(events)."
        ),
    )
    max_incidents: int = Field(
        default=20,
        ge=0,
        description=(
            "Recoveries after which the run fails instead of recovering again (incidents); 0: the first fault fails "
            "it. The ranks see it as TORCHELASTIC_MAX_RESTARTS."
        ),
    )
    crash_loop: Literal["fail", "pause"] = Field(
        default="fail",
        description=(
            "What a crash loop does to the run: the program failed again after a restart in place, the same way "
            "(the same exception type and message, or the same exit code) or before a step was trained between "
            "the two. fail: the run ends FAILED with the rank's exception; pause: it is PAUSED with its nodes, for "
            "an operator to fix and `lazarus run resume`. Either way no node is quarantined for it."
        ),
    )
    exit_grace_seconds: float = Field(
        default=20.0,
        gt=0,
        le=MAX_SECONDS,
        description=(
            "Once a rank of the incarnation has exited with code 0, how long the others get to exit too (seconds); "
            "those still running then are ended and the run completes with a warning naming them (a rank stuck in "
            "its teardown)."
        ),
    )
    save_grace_seconds: float = Field(
        default=1.0,
        ge=0,
        le=MAX_SECONDS,
        description=(
            "Drain waits this long for a checkpoint being written at the fault to commit before discarding it "
            "(seconds)."
        ),
    )
    survivor_grace_seconds: float = Field(
        default=2.0,
        ge=0,
        le=MAX_SECONDS,
        description=(
            "Drain waits at most this long for the ranks that survived the fault to save the state of their last "
            "completed step and end (the built-in trainer does when its collectives break), so that the next "
            "incarnation starts from that step instead of the newest checkpoint; 0 turns it off (seconds)."
        ),
    )
    in_process: bool = Field(
        default=False,
        description=(
            "Survivors keep their processes when a node is lost and replaced by a spare: they abandon the broken "
            "process group and wait at their step boundary, the replacement's ranks join them in a new group and "
            "receive the state from a surviving replica in memory (the built-in trainer on the local backend). "
            "Any other fault, or a survivor that does not reach the boundary, takes the restart path."
        ),
    )
    boundary_grace_seconds: float = Field(
        default=2.0,
        gt=0,
        le=MAX_SECONDS,
        description=(
            "With in_process: how long drain waits for every surviving rank to reach its step boundary before it "
            "falls back to the restart path (seconds)."
        ),
    )
    rejoin_timeout_seconds: float = Field(
        default=120.0,
        gt=0,
        le=MAX_SECONDS,
        description="With in_process: how long a survivor waits at its step boundary for the next incarnation (s).",
    )
    not_ready_toleration_seconds: int = Field(
        default=10,
        ge=0,
        le=MAX_SECONDS,
        description=(
            "Kubernetes backend: how long a rank pod stays bound to a node that is not ready or unreachable "
            "before Kubernetes evicts it, its pods' tolerations (seconds; Kubernetes' default is 300)."
        ),
    )
    stragglers: StragglerPolicy = Field(
        default_factory=StragglerPolicy, description="Nodes slower than their peers: found, then swapped or reported."
    )
    stages: StagePolicies = Field(default_factory=StagePolicies, description="Per-stage timeouts and retry policies.")

    @property
    def longest_hang_seconds(self) -> float:
        """The longest a stalled run goes before it counts as hung (seconds): a collective may wait this long."""
        return hang_seconds(self, of="longest")

    @model_validator(mode="after")
    def _hang_longer_than_interval(self) -> RecoveryPolicy:
        if self.hang_after_seconds is not None and self.hang_after_seconds <= self.heartbeat_interval_seconds:
            raise ValueError(
                f"recovery.hang_after_seconds: {self.hang_after_seconds} must exceed "
                f"recovery.heartbeat_interval_seconds {self.heartbeat_interval_seconds}; raise it to several intervals"
            )
        if self.stages.detect.timeout_seconds <= self.progress_every_seconds:
            raise ValueError(
                f"recovery.stages.detect.timeout_seconds: {self.stages.detect.timeout_seconds} must exceed "
                f"recovery.progress_every_seconds {self.progress_every_seconds}, or every watch times out"
            )
        return self


HangOf = Literal["step", "idle", "longest"]
"""What a hang time bounds: how long a run's step may stall; how long every rank of a script that
reports no steps may sit idle together; the longest any stall goes, whatever the ranks do."""


def hang_seconds(policy: RecoveryPolicy, stretch: float | None = None, of: HangOf = "step") -> float:
    """How long a run may show no progress before it counts as hung (seconds): the one place this is
    worked out (activities/pace.py, activities/health.py and activities/hangs.py ask here, and the
    trainer's collective timeout through RecoveryPolicy.longest_hang_seconds).

    The policy's `hang_after_seconds` where set, whatever else. Else it is derived: "longest" is
    `busy_hang_seconds`; before the run showed how long it stays quiet while well (`stretch` None:
    too few step times, no rank seen busy yet), the startup grace; after, `hang_step_multiple` times
    `stretch` (of "step": the 99th percentile of its recent step times; of "idle": the longest
    stretch its ranks sat idle together and it went on from), at least `hang_floor_seconds` ("step")
    or `quiet_hang_seconds` ("idle")."""
    if policy.hang_after_seconds is not None:
        return policy.hang_after_seconds
    if of == "longest":
        # The last resort for a step that stalls while its ranks still run (a save and a spin look alike).
        return policy.busy_hang_seconds
    if stretch is None:
        # The first steps after a start or a restore are slow (allocation, warm-up, loading).
        return policy.startup_grace_seconds
    floor = policy.hang_floor_seconds if of == "step" else policy.quiet_hang_seconds
    return max(floor, policy.hang_step_multiple * stretch)
