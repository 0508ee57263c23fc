"""`lazarus run report`: what elasticity cost one run, in minutes and in steps, with a timeline."""

from __future__ import annotations

from datetime import UTC, datetime

from rich.console import Group
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from lazarus.console import table
from lazarus.schema.incident_archive import read_archived
from lazarus.schema.records import STAGES, Incident, RunStatus
from lazarus.schema.rundir import RunDir
from lazarus.schema.stacks import where_it_waited
from lazarus.schema.tally import IncidentTally, downtime

STAGE_COLORS = {
    "detect": "#d62728",
    "drain": "#ff7f0e",
    "reschedule": "#bcbd22",
    "replace_or_reshard": "#9467bd",
    "resume": "#1f77b4",
}


def _seconds(a: datetime, b: datetime) -> float:
    return (b - a).total_seconds()


def with_archived(status: RunStatus) -> RunStatus:
    """The status with every incident in full: those archived in the run directory read back
    before its own (schema/tally.py); as it is when they cannot be read (its tally stands for them)."""
    count = status.earlier_incidents.count
    if not count or status.run_dir is None:
        return status
    archived = read_archived(RunDir(status.run_dir), count)
    if archived is None:
        return status
    return status.model_copy(update={"incidents": archived + status.incidents, "earlier_incidents": IncidentTally()})


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
    the run's mean step time), paused time, and what a straggler cost before its swap. The launch
    (before the first step) counts as training. Where a recovery's lost work is unknown (a script
    that reports no steps), it cannot be taken out: the ETTR is then an upper bound, and
    `ettr_upper_bound` says so.
    """
    now = now or datetime.now(UTC)
    if status.started_at is None:
        raise ValueError(f"run {status.run_id} has not been launched yet")
    end = status.ended_at or now
    wall = _seconds(status.started_at, end)
    tally = status.earlier_incidents  # incidents archived and not read back: their sums
    recoveries = [tally.recovery_seconds] + [_seconds(*downtime(incident, end)) for incident in status.incidents]
    paused = sum(_seconds(a, b) for a, b in paused_intervals(status, end))
    regrowing = sum(r.seconds or 0.0 for r in status.regrowths)
    # A script that reports no steps leaves lost steps and the step time unknown: they are left
    # out of the bill (None), never guessed.
    lost = [tally.lost_steps] + [incident.lost_steps for incident in status.incidents]
    lost_steps = None if None in lost else sum(steps for steps in lost if steps is not None)
    training = max(wall - sum(recoveries) - paused - regrowing, 0.0)
    steps_trained = None if status.step is None or lost_steps is None else status.step + lost_steps
    step_seconds = training / steps_trained if steps_trained else None
    recomputing = lost_steps * step_seconds if lost_steps and step_seconds else 0.0
    # A straggler's extra work on every step before its swap: the run trained, at its pace.
    slowed = sum(incident.fault.cost_seconds or 0.0 for incident in status.incidents)
    productive = max(training - recomputing - slowed, 0.0)
    stages = {
        name: tally.stage_seconds.get(name, 0.0)
        + sum(i.stages[name].seconds or 0 for i in status.incidents if name in i.stages)
        for name in STAGE_COLORS
    }
    return {
        "run_id": status.run_id,
        "state": status.state.value,
        "step": status.step,
        "total_steps": status.total_steps,
        "progress": status.progress,
        "wall_seconds": wall,
        "productive_seconds": productive,
        "ettr": productive / wall if wall > 0 else None,
        "ettr_upper_bound": lost_steps is None and status.incident_count > 0,
        "incidents": status.incident_count,
        "incidents_only_tallied": tally.count,
        "lost_steps": lost_steps,
        "mean_step_seconds": step_seconds,
        "lost_seconds": {
            "recovery": sum(recoveries),
            "recomputed_steps": recomputing,
            "operator_holds": paused,
            "regrow": regrowing,
            "slow_nodes": slowed,
        },
        "regrowths": len(status.regrowths),
        "stage_seconds": stages,
        "mttr_seconds": [incident.mttr_seconds for incident in status.incidents],
    }


def _or_unknown(value) -> str:
    return "unknown" if value is None else str(value)


def _seconds_cell(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f}"


def _incident_notes(incident: Incident) -> list[str]:
    """What an incident's stage table leaves out: the decision, a layout change, checkpoints, outcome."""
    notes = []
    if incident.shared:
        notes.append(f"failed together: {incident.shared.describe()}")
    if incident.decision:
        notes.append(f"decision: {incident.decision.reason}")
    if incident.new_assignment and incident.new_assignment.layout != incident.old_assignment.layout:
        old, new = incident.old_assignment.layout, incident.new_assignment.layout
        below = " (below the spec's dp)" if incident.decision and incident.decision.below_target_dp else ""
        notes.append(f"layout: {old.describe()} -> {new.describe()}{below}")
    discarded = ", ".join(f"step-{s}" for s in incident.discarded_checkpoints)
    skipped = ", ".join(f"step-{s} ({why})" for s, why in incident.skipped_checkpoints.items())
    kept = [discarded and f"discarded half-written {discarded}", skipped and f"skipped {skipped}"]
    if any(kept):
        notes.append("checkpoints: " + "; ".join(filter(None, kept)))
    if incident.fault.stack:
        notes.append(f"rank {incident.fault.rank} waited in: {where_it_waited(incident.fault.stack)}")
    if incident.resumed_from_step is None and incident.outcome == "recovered":
        # Whether the script restored anything of its own was not seen: say why.
        why = "the script reports no steps" if incident.fault.step is None else "no step was read after the restart"
        notes.append(f"restart point unknown ({why}), lost work unknown; outcome: recovered")
    elif incident.resumed_from_step is None:
        notes.append(f"outcome: {incident.outcome}")
    else:
        source = f" ({incident.restored_from})" if incident.restored_from else ""
        notes.append(
            f"resumed from step {incident.resumed_from_step}{source}, lost {_or_unknown(incident.lost_steps)} "
            f"step(s); outcome: {incident.outcome}"
        )
    if incident.stalls:
        notes.append(_stalls_note(incident))
    return notes


def _stalls_note(incident: Incident) -> str:
    """The longest stall of the ranks on the nodes that outlived the fault and of those on the nodes
    that replaced the lost ones (of any rank, after a reshard renumbered them)."""
    words = "stalls (fault to each rank's next step): "
    old, new = incident.old_assignment, incident.new_assignment
    if new is None or new.layout != old.layout:
        return f"{words}up to {max(incident.stalls.values()):.2f} s"
    lost = set(incident.fault.nodes)
    on_lost = {rank: old.nodes[old.layout.node_of_rank(rank)] in lost for rank in incident.stalls}
    kept = [s for rank, s in incident.stalls.items() if not on_lost[rank]]
    fresh = [s for rank, s in incident.stalls.items() if on_lost[rank]]
    parts = [f"survivors up to {max(kept):.2f} s" if kept else "", f"new ranks {max(fresh):.2f} s" if fresh else ""]
    return words + ", ".join(filter(None, parts))


def incident_view(incident: Incident) -> Group:
    """One incident: a heading, each stage's seconds and the MTTR in a table, then the notes."""
    fault = incident.fault
    because = f" ({fault.reason})" if fault.reason else ""
    heading = Text(
        f"Incident {incident.number}: {fault.kind}{' on ' + ', '.join(fault.nodes) if fault.nodes else ''} "
        f"at step {_or_unknown(fault.step)}"
        f"{because}",
        style="bold",
    )
    stages = table("stage", "seconds", "", right=("seconds",))
    # A planned swap checkpoints and stops the ranks at a step boundary before it drains.
    for name in (STAGES[0], "stop", *STAGES[1:]) if "stop" in incident.stages else STAGES:
        stage = incident.stages.get(name)
        stages.add_row(name, _seconds_cell(None if stage is None else stage.seconds), "")
    stages.add_section()
    stages.add_row("MTTR", _seconds_cell(incident.mttr_seconds), "fault -> first new training step")
    notes = [Text(f"  {note}") for note in _incident_notes(incident)]
    return Group(heading, Padding(stages, (0, 0, 0, 2), expand=False), *notes)


def stage_tables(status: RunStatus) -> Group:
    """Every incident of a run, oldest first, each with its stage table (`run status`, the demo)."""
    if not status.incident_count:
        return Group(Text("No incidents: the run trained without a fault."))
    views: list[Group | Text] = []
    if status.earlier_incidents.count:
        tally = status.earlier_incidents
        views += [
            Text(
                f"Incidents 1-{tally.count} are archived in the run directory's incidents/ (not readable here): "
                f"{', '.join(f'{n} {outcome}' for outcome, n in sorted(tally.outcomes.items()))}; "
                f"{tally.recovery_seconds:.1f} s of recovery"
            ),
            Text(""),
        ]
    for incident in status.incidents:
        views += [incident_view(incident), Text("")]
    return Group(*views[:-1])


def _cost_table(summary: dict) -> Table:
    """Where the wall time went, in seconds and as a share of it."""
    wall, lost = summary["wall_seconds"], summary["lost_seconds"]
    costs = table("time", "seconds", "of wall", right=("seconds", "of wall"))
    for label, seconds in (
        ("productive training", summary["productive_seconds"]),
        ("recoveries (fault -> first new step)", lost["recovery"]),
        (f"recomputed steps ({_or_unknown(summary['lost_steps'])})", lost["recomputed_steps"]),
        ("held by operators", lost["operator_holds"]),
        ("slow nodes, before their swap", lost["slow_nodes"]),
    ):
        costs.add_row(label, f"{seconds:.1f}", f"{seconds / wall:.1%}" if wall > 0 else "-")
    costs.add_section()
    costs.add_row("wall", f"{wall:.1f}", "100.0%" if wall > 0 else "-")
    return costs


def _interventions_table(status: RunStatus) -> Table:
    interventions = table("requested", "intervention", "detail", "outcome")
    for intervention in status.interventions:
        interventions.add_row(
            f"{intervention.requested_at:%H:%M:%S}",
            intervention.kind,
            intervention.detail,
            intervention.outcome or "pending",
        )
    return interventions


def run_report(status: RunStatus, summary: dict) -> Group:
    """The bill (`run report`): ETTR, where the wall time went, each incident's stages, operators' interventions."""
    ettr = "-" if summary["ettr"] is None else f"{summary['ettr']:.1%}"
    if summary["ettr"] is not None and summary["ettr_upper_bound"]:
        why = "the script reports no steps" if status.steps_from is None else "a restart's point was not seen"
        ettr = f"at most {ettr} (the work lost at recoveries is unknown: {why})"
    parts: list = [
        Text(
            f"Run {summary['run_id']}: {summary['state']}, step {summary['progress']}, ETTR {ettr}, mean step "
            + ("unknown" if summary["mean_step_seconds"] is None else f"{summary['mean_step_seconds']:.3f} s"),
            style="bold",
        ),
        _cost_table(summary),
        Text(""),
        stage_tables(status),
    ]
    if status.reason:  # why a failed or aborted run ended
        parts.insert(1, Text(f"{status.state.value}: {status.reason}"))
    if status.interventions:
        parts += [Text(""), Text("Operator interventions", style="bold"), _interventions_table(status)]
    return Group(*parts)


def plot_timeline(status: RunStatus, summary: dict, path: str, now: datetime | None = None) -> None:
    """A timeline: training, each recovery's stages, pauses; and the run's step over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    end = status.ended_at or now or datetime.now(UTC)
    origin = status.started_at
    assert origin is not None, "the summary refused a run never launched"

    def at(moment: datetime) -> float:
        return _seconds(origin, moment)

    figure, axis = plt.subplots(figsize=(12, 2.8))
    axis.broken_barh([(0, at(end))], (0, 1), color="#2ca02c", alpha=0.6)
    for incident in status.incidents:
        fault_at, back_at = downtime(incident, end)
        axis.broken_barh([(at(fault_at), _seconds(fault_at, back_at))], (1.2, 0.8), color="#7f7f7f", alpha=0.5)
        for name, stage in incident.stages.items():
            seconds = stage.seconds  # None until the stage ended
            if seconds is not None:
                axis.broken_barh([(at(stage.started_at), max(seconds, 0.01))], (0, 1), color=STAGE_COLORS[name])
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
        f"{_or_unknown(summary['lost_steps'])} lost step(s)"
    )
    legend = [Patch(color="#2ca02c", alpha=0.6, label="training")]
    legend += [Patch(color=color, label=name) for name, color in STAGE_COLORS.items()]
    legend += [Patch(facecolor="#c7c7c7", hatch="//", label="operator hold")]
    axis.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=7, fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
