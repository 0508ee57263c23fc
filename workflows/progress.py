"""How the run's step is kept: who reports it (the trainer, the output, or nobody) and what each
report changes, and what a recovery's resume tells its incident. Pure functions, so the workflow
says only when they apply."""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from lazarus.schema.records import Incident, RankProgress, RunStatus, StepSource
    from lazarus.schema.run import TrainerSettings
    from lazarus.schema.stages import ResumeResult


def expected_source(trainer: TrainerSettings) -> StepSource | None:
    """Who the spec says reports steps: the built-in trainer, the output through a progress pattern,
    else nobody yet (a lazarus.session script shows itself with its first heartbeat)."""
    return "trainer" if trainer.built_in else "output" if trainer.progress_pattern else None


MAX_WARNINGS = 20
"""Warnings a run's status keeps, the newest (its history holds every one)."""


def take_progress(status: RunStatus, progress: RankProgress) -> None:
    """A progress report: the step never goes back, and an unknown step leaves it as it was; a
    warning not seen before is kept."""
    for warning in progress.warnings:
        if warning not in status.warnings:
            status.warnings = [*status.warnings, warning][-MAX_WARNINGS:]
    if progress.source is not None:
        status.steps_from = progress.source
    step = progress.step
    if step is not None and (status.step is None or step >= status.step):
        status.step, status.step_at = step, progress.at


def take_resume(status: RunStatus, resumed: ResumeResult) -> None:
    """The step once a new incarnation is up."""
    if resumed.completed and status.steps_from == "trainer":
        status.step = status.total_steps
    elif resumed.step is not None:
        status.step = resumed.step
    elif resumed.resumed_from_step is not None and status.steps_from == "trainer":
        status.step = resumed.resumed_from_step + 1  # recorded before ResumeResult.step existed


def take_completion(status: RunStatus) -> None:
    """Training is done: a trainer reached its last step; a script that decides its own end stays where it said."""
    if status.steps_from == "trainer":
        status.step = status.total_steps


def take_recovery(incident: Incident, resumed: ResumeResult) -> None:
    """What the resume of an incident's recovery tells the incident: the restore point and where
    it came from, the steps lost, and the outcome (a fault before the first step interrupts it)."""
    incident.resumed_from_step = resumed.resumed_from_step
    incident.skipped_checkpoints = resumed.skipped_checkpoints
    incident.restored_from = resumed.restored_from
    if incident.fault.step is not None and resumed.resumed_from_step is not None:
        incident.lost_steps = max(0, incident.fault.step - resumed.resumed_from_step)
    if resumed.fault is not None:
        incident.outcome = "interrupted"
    else:
        incident.first_step_at = resumed.first_step_at
        incident.outcome = "recovered"
        fault_at = incident.fault.occurred_at.timestamp()
        incident.stalls = {rank: round(at - fault_at, 3) for rank, at in sorted(resumed.rank_first_steps.items())}
