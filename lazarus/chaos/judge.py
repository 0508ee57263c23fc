"""What a chaos scenario left behind, judged from what the trainer computed and the run's own files:
one row of the matrix."""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lazarus.infra.backend import free_port
from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.schema.contract import read_metrics
from lazarus.schema.records import Assignment, RunState, RunStatus
from lazarus.schema.run import RunSpec
from lazarus.schema.rundir import RunDir

RESHARD_TOLERANCE = 1e-4
"""Relative loss difference allowed after a reshard (the same math, another summation order)."""

RANK_START = "lazarus trainer: rank"
"""The line a rank of the built-in trainer prints once, when it starts."""


@dataclass
class Row:
    """One scenario of the matrix: what it did to the run, and what the run made of it."""

    scenario: str
    recovered: bool = False
    state: str = ""
    incidents: int = 0
    new_incarnations: int = 0
    duplicate_starts: int = 0
    spares_claimed: int = 0
    double_claims: int = 0
    checkpoints_lost: int = 0
    losses_equal: bool = False
    max_loss_difference: float | None = None
    mttr_seconds: list[float] = field(default_factory=list)
    lost_steps: list[int] = field(default_factory=list)
    restored_from: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    injected: list[str] = field(default_factory=list)  # the nodes the scenario broke (killed, stopped, held, ...)
    blamed: list[str] | None = None  # the nodes the first incident blamed (None: no incident)

    @property
    def passed(self) -> bool:
        """Recovered with nothing duplicated, nothing claimed twice, no checkpoint lost, losses equal."""
        return (
            self.recovered
            and self.duplicate_starts == 0
            and self.double_claims == 0
            and self.checkpoints_lost == 0
            and self.losses_equal
            and not any(note.startswith("FAIL") for note in self.notes)
        )

    def as_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def final_losses(run: RunDir) -> dict[int, float]:
    """step -> loss, the later incarnation's where a step was trained twice."""
    return {m.step: m.loss for m in read_metrics(run)}


def duplicate_starts(run: RunDir) -> int:
    """Ranks of any incarnation whose process was started more than once."""
    count = 0
    for k in run.incarnations():
        if not run.assignment_file(k).exists():
            continue
        world = Assignment.model_validate_json(run.assignment_file(k).read_text()).layout.world_size
        for rank in range(world):
            log = run.log_file(k, rank)
            text = log.read_text(errors="replace") if log.exists() else ""
            count += sum(line.startswith(RANK_START) for line in text.splitlines()) > 1
    return count


def claims(spec: RunSpec, status: RunStatus) -> tuple[int, int]:
    """(spares claimed, claims of a node already claimed or held twice in one assignment)."""
    spares = {
        f"node-{i}" for i in range(spec.cluster.active_nodes, spec.cluster.active_nodes + spec.cluster.spare_nodes)
    }
    claimed: list[str] = []
    doubled = 0
    for incident in status.incidents:
        if incident.new_assignment is None:
            continue
        nodes = incident.new_assignment.nodes
        doubled += len(nodes) - len(set(nodes))
        claimed += [n for n in nodes if n in spares and n not in incident.old_assignment.nodes]
    return len(set(claimed)), doubled + len(claimed) - len(set(claimed))


def checkpoints_lost(
    status: RunStatus, committed: dict[int, tuple[float, int]], gone: dict[int, float], corrupted: set[int]
) -> list[int]:
    """Checkpoints on disk at a fault (committed before it, not yet purged) that its recovery did
    not resume from or past (those the scenario corrupted on purpose aside)."""
    lost = set()
    for incident in status.incidents:
        if incident.resumed_from_step is None:
            continue
        fault_at = incident.fault.occurred_at.timestamp()
        lost |= {
            step
            for step, (at, _) in committed.items()
            if at <= fault_at < gone.get(step, float("inf"))
            and step > incident.resumed_from_step
            and step not in corrupted
        }
    return sorted(lost)


def late_commits(status: RunStatus, committed: dict[int, tuple[float, int]]) -> list[int]:
    """Checkpoints committed by an incarnation after drain had ended it: the fence failed."""
    late = set()
    for incident in status.incidents:
        drain = incident.stages.get("drain")
        if drain is None or drain.ended_at is None:
            continue
        old, drained_at = incident.old_assignment.incarnation, drain.ended_at.timestamp()
        late |= {step for step, (at, k) in committed.items() if k == old and at > drained_at}
    return sorted(late)


def compare_losses(row: Row, run: RunDir, status: RunStatus, reference: dict[int, float]) -> None:
    """Every step trained once in the end, with the loss of the run without a fault: bit for bit
    unless some recovery resharded (then within RESHARD_TOLERANCE)."""
    got = final_losses(run)
    resharded = any(i.decision and i.decision.action == "reshard" for i in status.incidents)
    if sorted(got) != sorted(reference):
        missing = sorted(set(reference) - set(got))
        row.notes.append(f"FAIL steps trained: {len(got)} of {len(reference)} (missing {missing[:5]}...)")
        return
    differences = [abs(got[s] - reference[s]) / max(abs(reference[s]), 1e-12) for s in reference]
    row.max_loss_difference = max(differences)
    row.losses_equal = row.max_loss_difference <= RESHARD_TOLERANCE if resharded else row.max_loss_difference == 0


def judge(
    name: str,
    spec: RunSpec,
    run: RunDir,
    status: RunStatus,
    reference: dict[int, float],
    committed: dict[int, tuple[float, int]],
    gone: dict[int, float],
    corrupted: Collection[int] = frozenset(),
) -> Row:
    """The matrix row of a scenario whose run ended with `status`."""
    row = Row(scenario=name, state=status.state.value, incidents=len(status.incidents))
    # An incident cut short by the next fault (outcome "interrupted") is recovered by the next one.
    outcomes = [i.outcome for i in status.incidents]
    row.recovered = status.state == RunState.COMPLETED and "failed" not in outcomes and outcomes[-1:] == ["recovered"]
    row.new_incarnations = max(run.incarnations(), default=0)
    row.duplicate_starts = duplicate_starts(run)
    row.spares_claimed, row.double_claims = claims(spec, status)
    lost = checkpoints_lost(status, committed, gone, set(corrupted))
    row.checkpoints_lost = len(lost)
    if lost:
        row.notes.append(f"checkpoints lost: {lost}")
    for incident in status.incidents:
        decided, claimed = incident.decision, incident.new_assignment
        if decided and claimed and (decided.nodes, decided.layout) != (claimed.nodes, claimed.layout):
            # The stages ran again after the claim and decided afresh: the pool no longer showed the
            # spare they had claimed as free (a workflow task timed out inside them).
            row.notes.append(
                f"FAIL incident {incident.number} decided {decided.action} on {', '.join(decided.nodes)}, "
                f"but incarnation {claimed.incarnation} was claimed on {', '.join(claimed.nodes)}"
            )
    late = late_commits(status, committed)
    if late:
        row.notes.append(f"FAIL checkpoints {late} committed by an incarnation after drain had ended it")
    row.mttr_seconds = [round(i.mttr_seconds, 2) for i in status.incidents if i.mttr_seconds is not None]
    row.lost_steps = [i.lost_steps for i in status.incidents if i.lost_steps is not None]
    row.restored_from = [i.restored_from for i in status.incidents if i.restored_from]
    if not row.recovered:
        row.notes.append(f"FAIL ended {status.state.value}: {status.reason}")
    compare_losses(row, run, status, reference)
    newest, skipped = run.newest_checkpoint()
    if row.recovered and newest != spec.trainer.steps:
        row.notes.append(f"FAIL newest intact checkpoint is step {newest}, not the last step ({skipped})")
    return row


def train_without_fault(home: Path, spec: RunSpec, timeout: float = 300.0) -> dict[int, float]:
    """Train `spec` once without a fault and without Temporal; step -> loss."""
    cluster = LocalCluster(home)
    try:
        cluster.create("reference", spec)
        nodes = [f"node-{i}" for i in range(spec.cluster.active_nodes)]
        assignment = Assignment(incarnation=0, nodes=nodes, layout=spec.layout, master_port=free_port())
        cluster.commit_assignment("reference", assignment)
        cluster.start_ranks("reference", 0, resume_step=0)
        deadline = time.monotonic() + timeout
        while True:
            observation = cluster.observe("reference", 0)
            failed = [r.exit for r in observation.ranks if r.exit and r.exit.code]
            if failed:
                raise RuntimeError(f"the reference run failed: {failed}")
            if all(r.exit is not None and not r.alive for r in observation.ranks) and not observation.launchers_alive:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the reference run did not finish within {timeout:.0f} s")
            time.sleep(0.1)
    finally:
        cluster.stop_run("reference")
    result = final_losses(cluster.run_dir("reference"))
    if sorted(result) != list(range(1, spec.trainer.steps + 1)):
        raise RuntimeError(f"the reference run trained steps {sorted(result)[:3]}..., not 1..{spec.trainer.steps}")
    return result
