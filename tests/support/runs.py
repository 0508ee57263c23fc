"""Specs the tests run, what the trainer computed (losses, steps), and runs trained without a fault."""

from __future__ import annotations

from pathlib import Path

from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.schema import Assignment, RunSpec, load_spec
from lazarus.schema.contract import read_metrics
from lazarus.schema.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]
SPECS = REPO / "tests" / "specs"
SMALL_SPEC = SPECS / "small.yaml"
USER_DDP_SPEC = SPECS / "user-ddp.yaml"


def with_absolute_command(spec: RunSpec) -> RunSpec:
    """The spec with a script path in trainer.command made absolute (relative to the repository)."""
    command = [
        part if not part.endswith(".py") or Path(part).is_absolute() else str(REPO / part)
        for part in spec.trainer.command
    ]
    return spec.model_copy(update={"trainer": spec.trainer.model_copy(update={"command": command})})


def losses(run: RunDir, incarnation: int | None = None) -> dict[int, float]:
    """step -> loss from metrics.jsonl, of one incarnation (default: every line, later ones win)."""
    return {m.step: m.loss for m in read_metrics(run) if incarnation is None or m.incarnation == incarnation}


def trained_step(run: RunDir) -> int:
    """Newest step in metrics.jsonl (0 before the first)."""
    lines = read_metrics(run)
    return lines[-1].step if lines else 0


def kill_rank_processes(home: Path) -> None:
    """SIGKILL every launcher and rank still alive under `home` (a failed test must not leak them)."""
    cluster = LocalCluster(home)
    for run in (home / "runs").glob("*") if (home / "runs").is_dir() else []:
        cluster.stop_run(run.name)


def train_without_fault(home: Path, spec_path: Path) -> dict[int, float]:
    """Train a spec once without any fault and without Temporal; returns step -> loss."""
    from lazarus.chaos.judge import train_without_fault as train

    return train(home, with_absolute_command(load_spec(spec_path)))


def no_whole_survivor_state(run: RunDir, incarnation: int) -> bool:
    """Whether the survivors of `incarnation` saved, but no one step has a survivor at every
    (pp, dp_shard, tp) place, so that resume rightly takes the checkpoint. Two ways seen here
    with one surviving replica: the survivors straddle two steps (gloo's ring all-reduce ends at
    different times on different ranks, so a rank can complete the step its replica's other
    ranks fail in), or a survivor waits in a pipeline's receive past the survivors' grace and is
    killed unsaved."""
    from lazarus.infra.survivors import place_of
    from lazarus.schema.contract import read_survivors

    layout = Assignment.model_validate_json(run.assignment_file(incarnation).read_text()).layout
    saved = read_survivors(run, incarnation, layout.world_size)
    places = {place_of(layout, rank) for rank in range(layout.world_size)}
    steps = {m.step for m in saved.values()}
    whole = [s for s in steps if places <= {m.place() for m in saved.values() if m.step == s}]
    return bool(saved) and not whole  # nothing saved at all would be the mechanism broken


def survivors_ahead(run: RunDir, incarnation: int, resumed_from: int) -> bool:
    """Whether a survivor of `incarnation` completed a step past `resumed_from`: gloo's ring
    all-reduce ends at different times on different ranks, so a rank can complete the step its
    peers fail in; resume takes the step they all completed (infra/runfiles.survivor_holders),
    and the step the faster rank reported counts as lost."""
    from lazarus.schema.contract import read_survivors

    layout = Assignment.model_validate_json(run.assignment_file(incarnation).read_text()).layout
    return any(m.step > resumed_from for m in read_survivors(run, incarnation, layout.world_size).values())


def assert_restored_from_survivors(run: RunDir, incident) -> None:
    """The incident restored what the survivors saved and lost no step, unless they straddled two
    steps: then it lost the one step a faster survivor completed (survivors_ahead); with no whole
    state at any one step (no_whole_survivor_state) it fell back to a checkpoint, as it must."""
    if isinstance(incident, dict):  # as `--json` prints it
        old, restored, lost, resumed = (
            incident["old_assignment"]["incarnation"],
            incident["restored_from"],
            incident["lost_steps"],
            incident["resumed_from_step"],
        )
    else:
        old, restored = incident.old_assignment.incarnation, incident.restored_from
        lost, resumed = incident.lost_steps, incident.resumed_from_step
    if restored == "checkpoint" and no_whole_survivor_state(run, old):
        return
    assert restored == "survivors", f"restored from {restored}"
    if lost == 1 and survivors_ahead(run, old, resumed):
        return
    assert lost == 0, f"{lost} step(s) lost, restored from the survivors"


def unlogged(status) -> set[int]:
    """Steps a run trained whose loss no rank 0 logged: the step its survivors completed and were
    restored at, when rank 0 died after that step's all-reduce but before it logged the step."""
    return {
        incident.resumed_from_step
        for incident in status.incidents
        if incident.restored_from == "survivors" and incident.resumed_from_step is not None
    }
