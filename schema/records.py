"""What the system records: assignments, faults, incidents and the run's status."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import Field

from lazarus.schema.base import Record
from lazarus.schema.faults import FaultKind, FaultReport  # noqa: F401 - recorded here; imported from here
from lazarus.schema.layout import Layout
from lazarus.schema.names import RunId
from lazarus.schema.nodelist import NodeGroups, NodeList, RankList, natural_key
from lazarus.schema.policy import RecoveryPolicy
from lazarus.schema.pool import TOGETHER_SECONDS, SharedFault, SpareWant  # noqa: F401 - recorded here too
from lazarus.schema.run import RunSpec
from lazarus.schema.states import RunState
from lazarus.schema.tally import IncidentTally

STAGES = ("detect", "drain", "reschedule", "replace_or_reshard", "resume")
"""The recovery stages, in order; also the Temporal activity type names."""


class Assignment(Record):
    """Which node hosts which ranks in one incarnation (one launch of the rank processes)."""

    incarnation: int = Field(ge=0, description="Launch counter: 0 at start, +1 per recovery.")
    nodes: NodeList = Field(
        description="Node names in rank order: node i hosts ranks i*ranks_per_node .. (i+1)*ranks_per_node-1."
    )
    layout: Layout = Field(description="The parallel layout this incarnation runs.")
    master_addr: str = Field(default="127.0.0.1", description="Address of rank 0's rendezvous store.")
    master_port: int = Field(ge=1, le=65535, description="TCP port of rank 0's rendezvous store.")


class NodeRecord(Record):
    """One node of the inventory."""

    name: str = Field(description="Node name, unique within the run.")
    role: Literal["active", "spare", "quarantined"] = Field(
        description="active: in the current assignment; spare: free; quarantined: held out after a fault."
    )
    healthy: bool = Field(default=True, description="False once the backend saw the node die.")
    died_at: datetime | None = Field(default=None, description="When the node was seen to die (UTC).")
    note: str = Field(default="", description="Why the node has its role (for quarantine: the fault).")


class Inventory(Record):
    """The run's nodes as the backend sees them."""

    nodes: Annotated[list[NodeRecord], *NodeGroups] = Field(
        description="Every node of the run, active, spare or quarantined (in JSON, runs of alike nodes share a record)."
    )
    wants: list[SpareWant] = Field(
        default_factory=list,
        description=(
            "Other runs' needs of the pool's spares, from recoveries under way (placed ones included); where the "
            "counts below are given, only the first few that come before the run's own need and after it."
        ),
    )
    needed_first: int | None = Field(
        default=None,
        ge=0,
        description=(
            "Spares the other runs' unplaced needs that come before this run's own (lodged) need take first, "
            "summed; with none lodged, every recovery's (nodes). None: counted from `wants`, which lists them all."
        ),
    )
    needed_by_recoveries: int | None = Field(
        default=None,
        ge=0,
        description=(
            "Spares every other run's unplaced need takes first, summed: what comes before a regrow or a swap "
            "(nodes). None: counted from `wants`, which lists them all."
        ),
    )
    spares_before: int = Field(
        default=0,
        ge=0,
        description=(
            "Free spares of the pool before the first one listed in `nodes`: other runs' needs take them first, "
            "so a fleet's inventory lists only the spares the run could take (nodes)."
        ),
    )
    shared: SharedFault | None = Field(
        default=None,
        description="The nodes that failed together with the run's dead ones, where the pool tells (None: none did).",
    )
    claimed: Assignment | None = Field(
        default=None,
        description=(
            "The next incarnation's assignment, where an earlier execution of the same stages claimed its nodes "
            "already (they ran again after a workflow task timeout or a worker's death): the decision is that one."
        ),
    )

    def free_spares(self) -> list[str]:
        """Healthy spare nodes, in name order (node-2 before node-10)."""
        return sorted((n.name for n in self.nodes if n.role == "spare" and n.healthy), key=natural_key)

    def held(self) -> int:
        """Nodes the run holds: its active ones and those it quarantined."""
        return sum(n.role in ("active", "quarantined") for n in self.nodes)

    def spares_for(self, want: SpareWant | None, node_limit: int | None) -> tuple[list[str], list[SpareWant]]:
        """The free spares the run may claim now, and the other runs' needs that come before it.

        Each need that outranks `want` (for a regrow, None: every recovery's) and is not placed
        yet takes its spares first; the run then takes no more than keeps it within `node_limit`
        nodes held, when one is given."""
        ahead = [w for w in self.wants if want is None or w.outranks(want)]
        first = self.needed_by_recoveries if want is None else self.needed_first
        if first is None:
            first = sum(w.needed for w in ahead if not w.placed)
        spares = self.free_spares()[max(0, first - self.spares_before) :]
        if node_limit is not None:
            spares = spares[: max(0, node_limit - self.held())]
        return spares, ahead

    def node(self, name: str) -> NodeRecord:
        """The record of one node; KeyError names it when unknown."""
        for record in self.nodes:
            if record.name == name:
                return record
        raise KeyError(f"unknown node {name!r}")


StepSource = Literal["trainer", "output"]
RestoreSource = Literal["in_process", "survivors", "checkpoint", "scratch"]
"""Where a new incarnation's state came from: the fault's survivors in the processes they kept, their saved
state, a periodic checkpoint, nothing."""
"""Who reports the step: trainer (the built-in trainer or a lazarus.session script, which train to
trainer.steps), output (trainer.progress_pattern on the ranks' output; the script decides its end)."""


class RankProgress(Record):
    """A snapshot of training progress from the rank heartbeats."""

    step: int | None = Field(ge=0, description="Last step every rank had completed; None when no rank reports steps.")
    at: datetime = Field(description="When the snapshot was taken (UTC).")
    source: StepSource | None = Field(default="trainer", description="Who reported the step; None when nobody does.")
    warnings: list[str] = Field(
        default_factory=list, description="What the ranks' heartbeats ask the operator to know (a lost checkpoint)."
    )


class DetectResult(Record):
    """What one detect attempt returns: a fault, completion, or a progress snapshot."""

    fault: FaultReport | None = Field(default=None, description="Set when a fault was found.")
    completed: bool = Field(
        default=False, description="True when every rank finished the last step and exited cleanly."
    )
    progress: RankProgress = Field(description="Progress at the time of return.")
    capacity: bool = Field(
        default=False, description="The pool has the spares the watch was asked about (regrow_nodes)."
    )


class Decision(Record):
    """What reschedule decided for one incident."""

    action: Literal["replace", "reshard", "wait"] = Field(
        description=(
            "replace: hot spares take the lost nodes' places; reshard: fewer replicas, same global batch; wait: no "
            "capacity yet."
        )
    )
    nodes: NodeList = Field(
        default_factory=list, description="Nodes of the next incarnation in rank order (empty when waiting)."
    )
    replacements: dict[str, str] = Field(
        default_factory=dict, description="Lost node -> spare that takes its ranks (replace)."
    )
    layout: Layout = Field(description="Layout of the next incarnation.")
    lost_replicas: RankList = Field(
        default_factory=list, description="Data-parallel replicas that had a rank on a lost node."
    )
    released_nodes: NodeList = Field(
        default_factory=list, description="Healthy nodes of broken replicas returned to the spare pool (reshard)."
    )
    below_target_dp: bool = Field(
        default=False, description="The next incarnation runs with fewer replicas than the spec's layout.dp."
    )
    rivals: list[str] = Field(
        default_factory=list, description="Other runs whose recoveries needed the pool's spares at the time."
    )
    reason: str = Field(description="Why, in words an operator reads in the UI.")


class StageRecord(Record):
    """Start and end of one stage of an incident."""

    started_at: datetime = Field(description="Stage start (UTC).")
    ended_at: datetime | None = Field(default=None, description="Stage end (UTC); None while running.")

    @property
    def seconds(self) -> float | None:
        """Duration in seconds, once ended."""
        return None if self.ended_at is None else (self.ended_at - self.started_at).total_seconds()


class Incident(Record):
    """One fault and its recovery: what happened, what each stage cost, what was lost."""

    number: int = Field(ge=1, description="1 for the run's first incident, and so on.")
    fault: FaultReport = Field(description="The fault that started the recovery.")
    stages: dict[str, StageRecord] = Field(
        default_factory=dict, description="Stage name -> its timing; detect spans fault to report."
    )
    decision: Decision | None = Field(default=None, description="Reschedule's decision.")
    shared: SharedFault | None = Field(
        default=None, description="The nodes of other runs that failed together with this fault's (a rack, a switch)."
    )
    old_assignment: Assignment = Field(description="Assignment of the incarnation that failed.")
    new_assignment: Assignment | None = Field(default=None, description="Assignment of the incarnation that resumed.")
    checkpoint_in_flight: int | None = Field(
        default=None, description="Step of a checkpoint being written when the fault hit, if any."
    )
    discarded_checkpoints: list[int] = Field(
        default_factory=list, description="Half-written checkpoints drain deleted (never loaded)."
    )
    resumed_from_step: int | None = Field(
        default=None,
        description=(
            "Step the new incarnation restored (0: from scratch): the Lazarus checkpoint it was given, else the step "
            "before the first it reported; None when the script restores its own snapshot and reports no steps."
        ),
    )
    skipped_checkpoints: dict[int, str] = Field(
        default_factory=dict,
        description="Newer checkpoints that were not restored, with the reason (incomplete or corrupt).",
    )
    restored_from: RestoreSource | None = Field(
        default=None,
        description=(
            "Where the restored state came from: in_process (the ranks that outlived the fault kept their processes "
            "and sent it to the new ranks in memory), survivors (they saved their last step), checkpoint (the newest "
            "periodic one), scratch; None when the script restores its own."
        ),
    )
    lost_steps: int | None = Field(
        default=None,
        description="Steps trained after that checkpoint and lost to the fault (steps); None when unknown.",
    )
    stalls: dict[int, float] = Field(
        default_factory=dict,
        description=(
            "Each rank's stall: from the fault to the rank's first step past the restore (seconds); a survivor "
            "that kept its process stalls only while it waits and rejoins."
        ),
    )
    first_step_at: datetime | None = Field(
        default=None, description="When the new incarnation completed its first step (UTC)."
    )
    outcome: Literal["recovering", "recovered", "interrupted", "failed", "paused", "taken over"] = Field(
        default="recovering",
        description=(
            "recovered: trained past the checkpoint; interrupted: a new fault hit before that (see the next "
            "incident); failed: the run failed; paused: nothing was quarantined (the pool's quarantine breaker is "
            "open) and the run waits for a person; taken over: a reset or an adoption took the run over mid-recovery."
        ),
    )

    @property
    def mttr_seconds(self) -> float | None:
        """Fault to first new training step (seconds)."""
        if self.first_step_at is None:
            return None
        return (self.first_step_at - self.fault.occurred_at).total_seconds()

    def summary(self) -> dict:
        """JSON-ready view with each stage's seconds and the MTTR (the `run status --json` shape)."""
        data = self.model_dump(mode="json")
        for name, stage in self.stages.items():
            data["stages"][name]["seconds"] = stage.seconds
        data["mttr_seconds"] = self.mttr_seconds
        return data


class Regrowth(Record):
    """One regrow: the pool had the nodes again, and the run grew back to more replicas."""

    number: int = Field(ge=1, description="1 for the run's first regrow, and so on.")
    started_at: datetime = Field(description="When the run saw the capacity and set out to grow (UTC).")
    from_dp: int = Field(ge=1, description="Replicas before.")
    to_dp: int = Field(ge=1, description="Replicas after (from_dp while it is being decided).")
    nodes: NodeList = Field(default_factory=list, description="Nodes it claimed from the pool.")
    reason: str = Field(default="", description="The decision, in words.")
    stages: dict[str, StageRecord] = Field(
        default_factory=dict, description="reschedule, stop, replace_or_reshard, resume: when each ran."
    )
    stopped_at_step: int | None = Field(default=None, description="Step the ranks checkpointed and stopped at.")
    resumed_from_step: int | None = Field(default=None, description="Step the larger incarnation restored.")
    first_step_at: datetime | None = Field(
        default=None, description="When the larger incarnation finished its first step."
    )
    outcome: Literal["regrowing", "regrown", "capacity gone"] = Field(default="regrowing", description="How it ended.")

    @property
    def lost_steps(self) -> int | None:
        """Completed steps trained again (0 when the stop's checkpoint was restored)."""
        if self.stopped_at_step is None or self.resumed_from_step is None:
            return None
        return max(0, self.stopped_at_step - self.resumed_from_step)

    @property
    def seconds(self) -> float | None:
        """What it cost: from the decision to the first step at the larger dp (seconds)."""
        return None if self.first_step_at is None else (self.first_step_at - self.started_at).total_seconds()


OperatorUpdate = Literal["pause", "resume", "abort", "drain_node", "return_node", "reshard", "approve", "set_policy"]
InterventionKind = OperatorUpdate | Literal["reset", "adopt"]


class Intervention(Record):
    """An operator's request and what came of it (the history has the request too)."""

    kind: InterventionKind = Field(
        description="The update called; reset, adopt: a reset execution, or an adopting workflow, took the run over."
    )
    detail: str = Field(default="", description="Its arguments, in words.")
    requested_at: datetime = Field(description="When the update was accepted (UTC).")
    done_at: datetime | None = Field(default=None, description="When it took effect (UTC).")
    outcome: str = Field(default="", description="What happened.")


class RunStatus(Record):
    """The run as the workflow sees it; the `status` query and the workflow result."""

    run_id: str = Field(description="Run id; also the Temporal workflow id.")
    run_dir: str | None = Field(
        default=None, description="Directory holding the run's checkpoints, metrics and rank files."
    )
    state: RunState = Field(default=RunState.PENDING, description="State in the recovery state machine.")
    step: int | None = Field(
        default=0,
        ge=0,
        description="Last step every rank completed, as of the last progress report; None: the script reports none.",
    )
    step_at: datetime | None = Field(
        default=None, description="When the step was reported (UTC); None before the first."
    )
    steps_from: StepSource | None = Field(
        default="trainer",
        description="Who reports the step (trainer: it trains to total_steps); None when nobody does.",
    )
    total_steps: int = Field(ge=1, description="Steps the run trains for.")
    layout: Layout = Field(description="Layout the run currently trains with.")
    assignment: Assignment | None = Field(default=None, description="Current incarnation's nodes.")
    incidents: list[Incident] = Field(
        default_factory=list,
        description=(
            "The newest faults and their recoveries, oldest first (older ones are in earlier_incidents and the run "
            "directory's incidents/)."
        ),
    )
    earlier_incidents: IncidentTally = Field(
        default_factory=IncidentTally,
        description="What the incidents archived from `incidents` add up to (numbers 1 .. its count).",
    )
    reason: str = Field(default="", description="Why the run ended in FAILED or ABORTED.")
    failure: FaultReport | None = Field(
        default=None,
        description="The fault that failed the run, when one did (a program error, one recovery too many).",
    )
    started_at: datetime | None = Field(default=None, description="When the run was launched (UTC).")
    ended_at: datetime | None = Field(
        default=None, description="When the run reached COMPLETED, FAILED or ABORTED (UTC)."
    )
    interventions: list[Intervention] = Field(default_factory=list, description="Operators' requests, oldest first.")
    warnings: list[str] = Field(
        default_factory=list,
        description="What the ranks asked the operator to know though training went on (a checkpoint lost to a "
        "full disk), oldest first; the newest 20.",
    )
    quarantined_nodes: NodeList = Field(
        default_factory=list, description="Nodes this run quarantined and has not had returned."
    )
    awaiting_approval: Decision | None = Field(
        default=None, description="The decision waiting for an operator's approve (state WAITING_FOR_APPROVAL)."
    )
    policy: RecoveryPolicy | None = Field(
        default=None, description="The recovery policy in force (the spec's, as changed by set_policy)."
    )
    segments: int = Field(default=1, ge=1, description="Workflow runs so far: 1 + continue-as-new count.")
    wanted_dp: int | None = Field(
        default=None,
        ge=1,
        description="Replicas a regrow grows back to: the spec's layout.dp, or an operator's reshard's.",
    )
    regrowths: list[Regrowth] = Field(default_factory=list, description="Every regrow, oldest first.")

    @property
    def incident_count(self) -> int:
        """Incidents the run has had: those archived and those held here."""
        return self.earlier_incidents.count + len(self.incidents)

    @property
    def progress(self) -> str:
        """The step in words: `120/400` for a trainer, `120` for steps read from output, else unknown."""
        if self.step is None or self.steps_from is None:
            return "unknown (the script reports no steps)"
        return f"{self.step}/{self.total_steps}" if self.steps_from == "trainer" else str(self.step)

    def summary(self) -> dict:
        """JSON-ready view (`run status --json`): incidents carry stage seconds and MTTR."""
        data = self.model_dump(mode="json", exclude={"incidents"})
        data["incidents"] = [incident.summary() for incident in self.incidents]
        return data


class RunStart(Record):
    """Workflow input: the spec and the run's id, and the state carried over a continue-as-new."""

    run_id: RunId | None = Field(
        default=None,
        description="Run id: may be left out; when given it must be the workflow id, else the start is refused.",
    )
    spec: RunSpec = Field(description="The validated run spec.")
    carried: RunStatus | None = Field(
        default=None, description="Status of the previous workflow run when continued as new; None at launch."
    )
    search_attributes: bool = Field(
        default=False,
        description=(
            "The namespace has Lazarus's search attributes (LazarusState, LazarusIncidents); the workflow keeps them "
            "current."
        ),
    )
    adopt: bool = Field(
        default=False,
        description="Take over a run whose workflow ended; `carried` holds its last status (`lazarus run adopt`).",
    )
