"""`lazarus run report`: what elasticity cost one run, in minutes and in steps, with a timeline."""

from __future__ import annotations

from datetime import UTC, datetime

from lazarus.schema.records import STAGES, Incident, RunStatus

STAGE_COLORS = {
    "detect": "#d62728",
    "drain": "#ff7f0e",
    "reschedule": "#bcbd22",
    "replace_or_reshard": "#9467bd",
    "resume": "#1f77b4",
}


def _seconds(a: datetime, b: datetime) -> float:
    return (b - a).total_seconds()


def downtime(incident: Incident, until: datetime) -> tuple[datetime, datetime]:
    """From the fault to the first new step (or to its last stage's end, or `until`, if it never trained)."""
    start = incident.fault.occurred_at
    if incident.first_step_at is not None:
        return start, incident.first_step_at
    ends = [stage.ended_at for stage in incident.stages.values() if stage.ended_at is not None]
    return start, max(ends) if ends else until


def paused_intervals(status: RunStatus, until: datetime) -> list[tuple[datetime, datetime]]:
    """When operators held the run: a pause from its request to its resume's first step, a
    reshard from its request to the restart."""
    intervals, since = [], None
    for intervention in status.interventions:
        if intervention.kind == "pause" and intervention.done_at is not None:
            since = intervention.requested_at
        elif intervention.kind == "resume" and since is not None:
            intervals.append((since, intervention.done_at or until))
            since = None
        elif intervention.kind == "reshard" and intervention.done_at is not None:
            intervals.append((intervention.requested_at, intervention.done_at))
    if since is not None:
        intervals.append((since, until))
    return intervals


def summarize(status: RunStatus, now: datetime | None = None) -> dict:
    """The run's bill: wall time, time lost to each cause, lost steps, ETTR.

    ETTR = productive training time / wall time. Unproductive: every recovery from fault to the
    first new step, the time spent on steps that were lost and trained again (lost steps times
    the run's mean step time), and paused time. The launch (before the first step) counts as
    training.
    """
    now = now or datetime.now(UTC)
    if status.started_at is None:
        raise ValueError(f"run {status.run_id} has not been launched yet")
    end = status.ended_at or now
    wall = _seconds(status.started_at, end)
    recoveries = [_seconds(*downtime(incident, end)) for incident in status.incidents]
    paused = sum(_seconds(a, b) for a, b in paused_intervals(status, end))
    lost_steps = sum(incident.lost_steps or 0 for incident in status.incidents)
    training = max(wall - sum(recoveries) - paused, 0.0)
    steps_trained = status.step + lost_steps
    step_seconds = training / steps_trained if steps_trained else 0.0
    recomputing = lost_steps * step_seconds
    productive = max(training - recomputing, 0.0)
    stages = {
        name: sum(i.stages[name].seconds or 0 for i in status.incidents if name in i.stages) for name in STAGE_COLORS
    }
    return {
        "run_id": status.run_id,
        "state": status.state.value,
        "step": status.step,
        "total_steps": status.total_steps,
        "wall_seconds": wall,
        "productive_seconds": productive,
        "ettr": productive / wall if wall > 0 else None,
        "incidents": len(status.incidents),
        "lost_steps": lost_steps,
        "mean_step_seconds": step_seconds,
        "lost_seconds": {"recovery": sum(recoveries), "recomputed_steps": recomputing, "operator_holds": paused},
        "stage_seconds": stages,
        "mttr_seconds": [incident.mttr_seconds for incident in status.incidents],
    }


def stage_table(status: RunStatus) -> str:
    """The incidents of a run as a table: each stage's seconds, MTTR, steps lost, decision."""
    lines = []
    for incident in status.incidents:
        fault = incident.fault
        lines.append(
            f"Incident {incident.number}: {fault.kind} on {', '.join(fault.nodes)} at step {fault.step} "
            f"({fault.reason})"
        )
        lines.append(f"  {'stage':<20}{'seconds':>9}")
        for name in STAGES:
            stage = incident.stages.get(name)
            seconds = "-" if stage is None or stage.seconds is None else f"{stage.seconds:.2f}"
            lines.append(f"  {name:<20}{seconds:>9}")
        mttr = incident.mttr_seconds
        lines.append(f"  {'MTTR':<20}{'-' if mttr is None else f'{mttr:.2f}':>9}   (fault -> first new training step)")
        if incident.decision:
            lines.append(f"  decision: {incident.decision.reason}")
        if incident.new_assignment and incident.new_assignment.layout != incident.old_assignment.layout:
            old, new = incident.old_assignment.layout, incident.new_assignment.layout
            below = " (below the spec's dp)" if incident.decision and incident.decision.below_target_dp else ""
            lines.append(f"  layout: dp={old.dp} pp={old.pp} -> dp={new.dp} pp={new.pp}{below}")
        if incident.discarded_checkpoints or incident.skipped_checkpoints:
            skipped = ", ".join(f"step-{s} ({why})" for s, why in incident.skipped_checkpoints.items())
            discarded = ", ".join(f"step-{s}" for s in incident.discarded_checkpoints)
            lines.append(
                "  checkpoints: "
                + "; ".join(
                    filter(
                        None, [discarded and f"discarded half-written {discarded}", skipped and f"skipped {skipped}"]
                    )
                )
            )
        if incident.resumed_from_step is None:
            lines.append(f"  outcome: {incident.outcome}")
        else:
            lines.append(
                f"  resumed from step {incident.resumed_from_step}, lost {incident.lost_steps} step(s); "
                f"outcome: {incident.outcome}"
            )
    if not lines:
        lines.append("No incidents: the run trained without a fault.")
    return "\n".join(lines)


def report_text(status: RunStatus, summary: dict) -> str:
    """The bill as text."""
    lost = summary["lost_seconds"]
    lines = [
        f"Run {summary['run_id']}: {summary['state']}, step {summary['step']}/{summary['total_steps']}, "
        f"wall {summary['wall_seconds']:.1f} s",
        f"ETTR {summary['ettr']:.1%}: productive {summary['productive_seconds']:.1f} s; lost to recoveries "
        f"{lost['recovery']:.1f} s, to {summary['lost_steps']} recomputed step(s) {lost['recomputed_steps']:.1f} s "
        f"(mean step {summary['mean_step_seconds']:.3f} s), held by operators {lost['operator_holds']:.1f} s",
        "",
        stage_table(status),
    ]
    if status.interventions:
        lines += ["", "Operator interventions:"]
        for intervention in status.interventions:
            lines.append(
                f"  {intervention.requested_at:%H:%M:%S} {intervention.kind} {intervention.detail}".rstrip()
                + f": {intervention.outcome or 'pending'}"
            )
    return "\n".join(lines)


def plot_timeline(status: RunStatus, summary: dict, path: str, now: datetime | None = None) -> None:
    """A timeline: training, each recovery's stages, pauses; and the run's step over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    end = status.ended_at or now or datetime.now(UTC)
    origin = status.started_at
    at = lambda moment: _seconds(origin, moment)  # noqa: E731
    figure, axis = plt.subplots(figsize=(12, 2.8))
    axis.broken_barh([(0, at(end))], (0, 1), color="#2ca02c", alpha=0.6)
    for incident in status.incidents:
        fault_at, back_at = downtime(incident, end)
        axis.broken_barh([(at(fault_at), _seconds(fault_at, back_at))], (1.2, 0.8), color="#7f7f7f", alpha=0.5)
        for name, stage in incident.stages.items():
            if stage.ended_at is not None:
                axis.broken_barh([(at(stage.started_at), max(stage.seconds, 0.01))], (0, 1), color=STAGE_COLORS[name])
        axis.annotate(
            f"#{incident.number} {incident.fault.kind}\n{', '.join(incident.fault.nodes)}",
            (at(fault_at), 2.05),
            fontsize=8,
            ha="left",
            va="bottom",
        )
    for start, stop in paused_intervals(status, end):
        axis.broken_barh([(at(start), _seconds(start, stop))], (0, 1), color="#c7c7c7", hatch="//")
    axis.set_ylim(0, 2.8)
    axis.set_yticks([0.5, 1.6], ["run", "fault to\nfirst step"])
    axis.set_xlabel("seconds since launch")
    axis.set_title(
        f"{status.run_id}: ETTR {summary['ettr']:.1%}, {summary['incidents']} incident(s), "
        f"{summary['lost_steps']} lost step(s)"
    )
    legend = [Patch(color="#2ca02c", alpha=0.6, label="training")]
    legend += [Patch(color=color, label=name) for name, color in STAGE_COLORS.items()]
    legend += [Patch(facecolor="#c7c7c7", hatch="//", label="operator hold")]
    axis.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=7, fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
