"""Inputs and results of the activities: one model in, one model out, per stage."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from lazarus.schema.base import Record
from lazarus.schema.nodelist import NodeList, RankList, RankSteps
from lazarus.schema.ownership import Owner
from lazarus.schema.policy import RecoveryPolicy
from lazarus.schema.pool import SpareWant
from lazarus.schema.records import Assignment, Decision, FaultReport, Incident, RestoreSource, StepSource
from lazarus.schema.run import RunSpec


class RunRequest(Record):
    """What every activity is asked about: a run, by the execution that owns it."""

    run_id: str = Field(description="Run id.")
    owner: Owner | None = Field(
        default=None,
        description=(
            "The workflow execution that asks; the activity acts only for the run's owner (schema/ownership.py). "
            "None from executions that began before runs had owners: no check."
        ),
    )


class LaunchInput(RunRequest):
    """Create the run's cluster state and start incarnation 0."""

    spec: RunSpec = Field(description="The run's spec.")


class LaunchResult(Record):
    """Where the run lives and who runs incarnation 0."""

    run_dir: str = Field(description="The run's directory.")
    assignment: Assignment = Field(description="Incarnation 0's nodes.")


class DetectInput(RunRequest):
    """Watch one incarnation."""

    incarnation: int = Field(ge=0, description="Incarnation to watch.")
    total_steps: int = Field(ge=1, description="Steps the run trains for; reaching them is completion.")
    policy: RecoveryPolicy = Field(description="Heartbeat interval, hang threshold, progress interval.")
    regrow_nodes: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Return as soon as the pool has this many spares the run may take for a regrow (none that another run's "
            "recovery needs, within node_limit), read every capacity_poll_seconds; None: do not look."
        ),
    )
    node_limit: int | None = Field(
        default=None, ge=1, description="Nodes the run may hold, active and quarantined (nodes)."
    )
    known_warnings: list[str] = Field(
        default_factory=list, description="Warnings the workflow has; a new one ends the watch, to be recorded."
    )


class DrainWaits(Record):
    """How long a drain has waited for the ranks, each grace's share (seconds)."""

    survivors: float = Field(default=0.0, ge=0, description="Waited for the survivors to save and end (seconds).")
    checkpoint: float = Field(default=0.0, ge=0, description="Waited for a checkpoint in flight to commit (seconds).")
    boundary: float = Field(
        default=0.0, ge=0, description="Waited for the survivors to reach their step boundary (seconds)."
    )


class DrainInput(RunRequest):
    """Stop an incarnation and quarantine the nodes blamed for its fault."""

    incarnation: int = Field(ge=0, description="Incarnation to stop.")
    nodes: NodeList = Field(description="Nodes to quarantine.")
    reason: str = Field(description="Why; recorded on the quarantined nodes.")
    save_grace_seconds: float = Field(
        default=1.0,
        ge=0,
        description="How long to let a checkpoint being written commit before the ranks are stopped (seconds).",
    )
    stop_first: NodeList = Field(
        default_factory=list,
        description=(
            "Nodes whose ranks are stopped before anything else (empty: none): a hung node, so that its peers, "
            "waiting on it in a collective, see it broken and save what they hold, as they do for a death."
        ),
    )
    survivor_grace_seconds: float = Field(
        default=0.0,
        ge=0,
        description=(
            "How long to let the surviving ranks save their state and end before they are stopped (seconds; 0: "
            "stop them at once, the trainer saves none)."
        ),
    )
    want: SpareWant | None = Field(
        default=None,
        description="The run's need of the pool's spares, lodged before anything else (None: lodge nothing).",
    )
    detect_seconds: float = Field(
        default=0.0, ge=0, description="The incident's fault-to-report time, for the detect metric (seconds)."
    )
    read_step: bool = Field(
        default=False,
        description=(
            "Look up the newest step a rank reported before stopping them: the fault came by signal or from an "
            "operator, and its step is only the workflow's last progress report."
        ),
    )
    breaker: bool = Field(
        default=True,
        description="The pool's quarantine breaker counts the nodes (false for an operator's own drain of a node).",
    )
    boundary_grace_seconds: float = Field(
        default=0.0,
        ge=0,
        description=(
            "RecoveryPolicy.in_process for a lost node: how long to wait for every surviving rank to reach its step "
            "boundary; then only the lost nodes' ranks are stopped, and the others wait for the next incarnation "
            "(seconds; 0: stop every rank, the restart path)."
        ),
    )
    wait_cap_seconds: float | None = Field(
        default=None,
        gt=0,
        description=(
            "The most this call waits for the ranks in all; a grace still running then ends the call with "
            "DrainResult.unfinished, and the drain goes on in a call of its own from there (seconds; None: every "
            "grace runs out here)."
        ),
    )
    waited: DrainWaits | None = Field(
        default=None,
        description="What an earlier, unfinished call of this drain waited: its graces go on from there (None: none).",
    )


class DrainResult(Record):
    """What drain did."""

    quarantined: NodeList = Field(description="Nodes now quarantined.")
    stopped_ranks: RankList = Field(description="Ranks that were still alive and were killed.")
    removed_partial_checkpoints: list[int] = Field(description="Steps of half-written checkpoints deleted.")
    in_flight_checkpoint: int | None = Field(
        default=None, description="Step of a checkpoint that was being written at the fault, if any."
    )
    in_flight_committed: bool = Field(
        default=False, description="That checkpoint committed within the grace time (else it was discarded)."
    )
    survivors: RankSteps = Field(
        default_factory=dict, description="Ranks that saved their state at the fault -> the step it holds."
    )
    step: int | None = Field(
        default=None, description="With read_step: the newest step a rank reported before the stop (None: unknown)."
    )
    held_back: str = Field(
        default="",
        description="Why nothing was quarantined (the pool's quarantine breaker is open): the run waits for a person.",
    )
    kept_survivors: RankSteps = Field(
        default_factory=dict,
        description=(
            "Ranks that kept their processes and wait at their step boundary for the next incarnation -> the step "
            "they hold (RecoveryPolicy.in_process); empty: every rank was stopped."
        ),
    )
    unfinished: DrainWaits | None = Field(
        default=None,
        description=(
            "Set when the call reached wait_cap_seconds with a grace running: how long each grace has run; the ranks "
            "were not stopped yet and every other field is empty. None: the drain is done."
        ),
    )


class RescheduleInput(RunRequest):
    """Read the inventory for a recovery decision."""

    incarnation: int | None = Field(
        default=None,
        ge=0,
        description=(
            "The incarnation the decision replaces: where its successor's nodes were claimed already, the inventory "
            "carries that claim (Inventory.claimed). None: not asked (an execution from before it was)."
        ),
    )

    gather_seconds: float = Field(
        default=0.0,
        ge=0,
        description=(
            "When the run's nodes failed with other runs' of their fault domain, wait for those runs to drain and "
            "lodge their needs of spares before reading the inventory it decides on, until none of them drained "
            "for this long (seconds)."
        ),
    )


class ReplaceInput(RunRequest):
    """Carry out a replace decision: claim spares and write the next assignment."""

    decision: Decision = Field(description="Reschedule's decision.")
    old_assignment: Assignment = Field(description="Assignment of the failed incarnation.")
    fault_kind: str = Field(
        default="operator", description="Kind of the fault being recovered from; operator for an operator's restart."
    )


class ResumeInput(RunRequest):
    """Start an incarnation from the newest complete checkpoint."""

    assignment: Assignment = Field(description="The incarnation to start.")
    total_steps: int = Field(ge=1, description="Steps the run trains for.")
    policy: RecoveryPolicy = Field(description="Heartbeat interval and hang thresholds while waiting.")
    steps_from: StepSource | None = Field(
        default="trainer",
        description=(
            "Who reports steps: trainer (wait for a step past the checkpoint), output (wait for a reported step), "
            "None (wait until every rank runs: the script reports nothing)."
        ),
    )
    fault_step: int | None = Field(
        default=None,
        description="The step the fault interrupted, as reported, for the lost-steps metric (None: unknown).",
    )
    survivors_of: int | None = Field(
        default=None,
        description=(
            "The failed incarnation, when its survivors saved their state: restore from them if they hold a step "
            "newer than the newest checkpoint for every (pp, dp_shard, tp) place."
        ),
    )


class ResumeResult(Record):
    """How the new incarnation started: its first step, or a fault on the way."""

    resumed_from_step: int | None = Field(
        ge=0,
        description=(
            "Step restored (0: from scratch): the checkpoint given, else the step before the first one the ranks "
            "reported; None when they report no steps and restore a snapshot of their own."
        ),
    )
    skipped_checkpoints: dict[int, str] = Field(
        default_factory=dict, description="Newer checkpoints not restored, with the reason (incomplete or corrupt)."
    )
    restored_from: RestoreSource | None = Field(
        default=None, description="Where the restored state came from; None when the script restores its own."
    )
    first_step_at: datetime | None = Field(
        default=None, description="When every rank had completed its first step past the restored one (UTC)."
    )
    rank_first_steps: dict[int, float] = Field(
        default_factory=dict,
        description="When each rank completed its first step past the restore (seconds since the epoch).",
    )
    fault: FaultReport | None = Field(
        default=None, description="A fault that hit the new incarnation before its first step."
    )
    completed: bool = Field(
        default=False, description="The restored checkpoint was the last step: nothing left to train."
    )
    step: int | None = Field(
        default=None, description="The step every reporting rank had completed when resume returned."
    )


class StopInput(RunRequest):
    """Checkpoint and stop an incarnation (operator's pause, abort or reshard)."""

    incarnation: int = Field(ge=0, description="Incarnation to stop.")
    total_steps: int = Field(ge=1, description="Steps the run trains for.")
    policy: RecoveryPolicy = Field(description="Heartbeat interval and hang thresholds while waiting.")
    timeout_seconds: float = Field(
        default=120.0,
        gt=0,
        description="How long the ranks get to checkpoint and exit before they are killed (seconds).",
    )


class StopResult(Record):
    """How the incarnation stopped."""

    step: int | None = Field(ge=0, description="Last step every rank completed; None when they report none.")
    checkpoint_step: int = Field(ge=0, description="Newest complete checkpoint after the stop (0: none).")
    clean: bool = Field(description="Every rank checkpointed and exited on its own (else they were killed).")
    completed: bool = Field(default=False, description="The ranks had reached the last step anyway.")
    reason: str = Field(default="", description="Why the stop was not clean.")


class ReleaseInput(RunRequest):
    """Give an ended run's nodes back to the pool."""


class ReturnNodeInput(RunRequest):
    """Return a repaired node to the spare pool."""

    node: str = Field(description="Node name.")


class ArchiveInput(RunRequest):
    """Keep closed incidents' full records in the run directory (schema/tally.py)."""

    incidents: list[Incident] = Field(description="The incidents, oldest first; each is written to incidents/.")


class TakeOverInput(RunRequest):
    """Take the run from the execution that owns it (after a reset, or to adopt it), and read what
    the cluster holds of it."""

    previous: str | None = Field(
        description=(
            "Temporal run id of the execution the caller takes the run from (the owner its refusal named); "
            "None to take whatever execution holds it (an operator's adoption)."
        )
    )
    kind: Literal["reset", "adopt"] = Field(description="Why: the workflow was reset, or an operator adopts the run.")


class TakeOverResult(Record):
    """What the cluster holds of the run, as the new owner found it."""

    previous_owner: Owner | None = Field(
        default=None, description="The execution the run was taken from; None if none held it."
    )
    run_dir: str = Field(description="The run's directory.")
    assignment: Assignment | None = Field(
        default=None, description="The newest incarnation's assignment; None when the run was never launched."
    )
    launched: bool = Field(
        default=False, description="The newest incarnation's ranks were started (it has a launch record)."
    )
    ended: bool = Field(default=False, description="The backend ended the newest incarnation (a drain or a stop).")
    stopped: bool = Field(
        default=False,
        description="The newest incarnation was asked to checkpoint and stop (a pause, reshard or regrow).",
    )
    quarantined: NodeList = Field(default_factory=list, description="Nodes the run holds out after faults.")
    checkpoint_step: int = Field(default=0, ge=0, description="Step of the newest complete checkpoint (0: none).")
    step: int | None = Field(
        default=None, ge=0, description="Newest step the newest incarnation's ranks reported, if any."
    )
