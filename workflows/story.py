"""What a person reads of a run in the Temporal web UI: a one-line summary of every activity, and
the workflow's current details. Pure functions of the workflow's own data (no command, no event),
so they may change without a patch."""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from lazarus.schema.nodelist import compress
    from lazarus.schema.records import Assignment, RunStatus
    from lazarus.schema.stages import (
        ArchiveInput,
        DetectInput,
        DrainInput,
        LaunchInput,
        ReplaceInput,
        ResumeInput,
        ReturnNodeInput,
        StopInput,
        TakeOverInput,
    )


def nodes(names: list[str]) -> str:
    """Node names as an operator reads them: a few by name, many as ranges (node-[0-2047])."""
    return ", ".join(names) if len(names) <= 4 else compress(names)


def on(assignment: Assignment) -> str:
    """Where an incarnation runs: `incarnation 3 on node-0, node-1, node-4`."""
    return f"incarnation {assignment.incarnation} on {nodes(assignment.nodes)}"


def activity_summary(stage: str, request) -> str:
    """The activity's one line in the UI's timeline and event history, e.g. `drain node-2,
    incarnation 3 (incident 1: node_down)`."""
    match request:
        case LaunchInput():
            cluster, layout = request.spec.cluster, request.spec.layout
            return (
                f"launch incarnation 0: {layout.describe()} on {cluster.active_nodes} nodes "
                f"(+{cluster.spare_nodes} spare)"
            )
        case DetectInput():
            return f"watch incarnation {request.incarnation}"
        case DrainInput():
            incident = request.reason.split(": ", 2)
            why = f" ({incident[0]}: {incident[1]})" if len(incident) == 3 else ""
            rest = ": the rest of its graces" if request.waited is not None else ""
            return f"drain {nodes(request.nodes)}, incarnation {request.incarnation}{why}{rest}"
        case ReplaceInput():
            decision = request.decision
            if decision.action == "replace" and decision.replacements:
                swaps = ", ".join(f"{old} with {new}" for old, new in decision.replacements.items())
                return f"replace {swaps}" if len(decision.replacements) <= 4 else f"replace {swaps[:120]}..."
            return f"{decision.action} to {decision.layout.describe()} on {nodes(decision.nodes)}"
        case ResumeInput():
            return f"resume {on(request.assignment)}"  # where its state came from is in its result
        case StopInput():
            return f"checkpoint and stop incarnation {request.incarnation}"
        case ReturnNodeInput():
            return f"return {request.node} to the pool"
        case TakeOverInput():
            whom = f"from execution {request.previous}" if request.previous else "from whoever holds it"
            return f"take the run over {whom} ({request.kind}) and read what the cluster holds"
        case ArchiveInput():
            numbers = [incident.number for incident in request.incidents]
            return f"archive incidents {min(numbers)}-{max(numbers)}" if numbers else "archive incidents"
    return {
        "reschedule": "read the inventory: replace, reshard or wait",
        "release": "give the run's nodes back to the pool",
    }.get(stage, stage)


def current_details(status: RunStatus) -> str:
    """The run at a glance (markdown, the UI's current details): state, step, incarnation, and the
    newest incident with its MTTR."""
    lines = [f"**{status.state.value}** at step {status.progress}"]
    if status.step_at is not None and status.step is not None:
        lines[0] += f" (reported {status.step_at:%Y-%m-%d %H:%M:%S} UTC)"
    if status.assignment is not None:
        lines.append(f"{on(status.assignment)}, {status.layout.describe()}")
    if status.incidents:
        last = status.incidents[-1]
        fault = last.fault
        line = f"incident {last.number}: {fault.kind} on {nodes(fault.nodes)}, {last.outcome}"
        if last.mttr_seconds is not None:
            line += f", MTTR {last.mttr_seconds:.1f} s"
        if last.lost_steps is not None:
            line += f", {last.lost_steps} step(s) lost"
        lines.append(line)
    if status.reason:
        lines.append(status.reason)
    return "\n\n".join(lines)
