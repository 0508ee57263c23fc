"""Specs the tests run, what the trainer computed (losses, steps), and runs trained without a fault."""

from __future__ import annotations

from pathlib import Path

from lazarus.infra.backend import free_port
from lazarus.infra.local import LocalCluster
from lazarus.schema import Assignment, RunSpec, load_spec
from lazarus.schema.contract import read_metrics
from lazarus.schema.rundir import RunDir
from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
SPECS = REPO / "tests" / "specs"
SMALL_SPEC = SPECS / "small.yaml"
SMALL_PP_SPEC = SPECS / "small-pp.yaml"
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
    spec = with_absolute_command(load_spec(spec_path))
    cluster = LocalCluster(home)
    try:
        cluster.create("reference", spec)
        nodes = [f"node-{i}" for i in range(spec.cluster.active_nodes)]
        assignment = Assignment(incarnation=0, nodes=nodes, layout=spec.layout, master_port=free_port())
        cluster.commit_assignment("reference", assignment)
        cluster.start_ranks("reference", 0, resume_step=0)

        def finished():
            observation = cluster.observe("reference", 0)
            assert not any(r.exit and r.exit.code for r in observation.ranks), [r.exit for r in observation.ranks]
            return (
                all(r.exit is not None and not r.alive for r in observation.ranks) and not observation.launchers_alive
            )

        wait_until(finished, f"the reference run of {spec_path.name} to finish", timeout=180, every=0.1)
    finally:
        kill_rank_processes(home)
    result = losses(cluster.run_dir("reference"))
    assert sorted(result) == list(range(1, spec.trainer.steps + 1))
    return result


def survivors_straddle(run: RunDir, incarnation: int) -> bool:
    """Whether the survivors of `incarnation` saved different steps such that no one step has a
    survivor at every (pp, dp_shard, tp) place. gloo's ring all-reduce ends at different times
    on different ranks, so a rank can complete the step its replica's other ranks fail in; with
    one surviving replica that leaves no whole state, and resume rightly takes the checkpoint."""
    from lazarus.infra.runfiles import place_of
    from lazarus.schema.contract import read_survivors

    layout = Assignment.model_validate_json(run.assignment_file(incarnation).read_text()).layout
    saved = read_survivors(run, incarnation, layout.world_size)
    places = {place_of(layout, rank) for rank in range(layout.world_size)}
    steps = {m.step for m in saved.values()}
    whole = [s for s in steps if places <= {m.place() for m in saved.values() if m.step == s}]
    return len(steps) > 1 and not whole


def assert_restored_from_survivors(run: RunDir, incident) -> None:
    """The incident restored what the survivors saved and lost no step, unless they straddled two
    steps (survivors_straddle): then it fell back to a checkpoint, as it must."""
    if incident.restored_from == "checkpoint" and survivors_straddle(run, incident.old_assignment.incarnation):
        return
    assert incident.restored_from == "survivors" and incident.lost_steps == 0, (
        f"restored from {incident.restored_from}, {incident.lost_steps} step(s) lost"
    )
