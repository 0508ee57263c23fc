"""Incidents a run's status no longer holds in full: their tally, carried in the status through
continue-as-new, and their records, kept in the run directory (`incidents/<number>.json`).

A run of thousands of nodes with a fault every few hours has hundreds of incidents, each with two
assignments; carried in full they would outgrow Temporal's payload limit. The status keeps the
newest (at most INCIDENTS_KEPT, and INCIDENT_BYTES_KEPT of JSON); the workflow archives the rest
(the `archive_incidents` activity) and adds them to the tally, which is all a report needs of
them when it cannot read the run directory.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING

from pydantic import Field

from lazarus.schema.base import Record

if TYPE_CHECKING:
    from lazarus.schema.records import Incident

INCIDENTS_KEPT = 20
"""Most incidents a status holds in full; past it the workflow archives the older half."""
INCIDENT_BYTES_KEPT = 96 * 1024
"""Most JSON the incidents a status holds may take (bytes); past it the older half is archived."""


class IncidentTally(Record):
    """What the archived incidents add up to: counts and seconds, for the report and the UI."""

    count: int = Field(default=0, ge=0, description="Incidents archived (numbers 1 .. count).")
    outcomes: dict[str, int] = Field(default_factory=dict, description="Archived incidents per outcome.")
    kinds: dict[str, int] = Field(default_factory=dict, description="Archived incidents per fault kind.")
    lost_steps: int | None = Field(
        default=0, ge=0, description="Steps trained again; None when one incident's is unknown."
    )
    recovery_seconds: float = Field(
        default=0.0, ge=0, description="Sum of each archived incident's downtime: fault to first new step (seconds)."
    )
    stage_seconds: dict[str, float] = Field(default_factory=dict, description="Seconds in each stage, summed.")
    mttr_seconds_max: float | None = Field(default=None, description="The longest MTTR among them (seconds).")

    def add(self, incident: Incident, downtime_seconds: float) -> None:
        """Count one closed incident, whose fault-to-first-step downtime was `downtime_seconds`."""
        self.count += 1
        self.outcomes[incident.outcome] = self.outcomes.get(incident.outcome, 0) + 1
        self.kinds[incident.fault.kind] = self.kinds.get(incident.fault.kind, 0) + 1
        if self.lost_steps is not None:
            self.lost_steps = None if incident.lost_steps is None else self.lost_steps + incident.lost_steps
        self.recovery_seconds += max(0.0, downtime_seconds)
        for name, stage in incident.stages.items():
            self.stage_seconds[name] = self.stage_seconds.get(name, 0.0) + (stage.seconds or 0.0)
        mttr = incident.mttr_seconds
        if mttr is not None and (self.mttr_seconds_max is None or mttr > self.mttr_seconds_max):
            self.mttr_seconds_max = mttr


def downtime(incident: Incident, until: datetime) -> tuple[datetime, datetime]:
    """From the fault to the first new step (or to its last stage's end, or `until`, if it never trained)."""
    start = incident.fault.occurred_at
    if incident.first_step_at is not None:
        return start, incident.first_step_at
    ends = [stage.ended_at for stage in incident.stages.values() if stage.ended_at is not None]
    return start, max(ends) if ends else until


def downtime_seconds(incident: Incident, until: datetime) -> float:
    """downtime() in seconds."""
    start, end = downtime(incident, until)
    return (end - start).total_seconds()


def to_archive(incidents: list[Incident]) -> int:
    """How many of the oldest `incidents` (a status's, oldest first) to archive now: none while they
    are within INCIDENTS_KEPT and INCIDENT_BYTES_KEPT, else the older ones down to half of each,
    keeping the newest and any recovery still under way."""
    sizes = [len(incident.model_dump_json()) for incident in incidents]
    if len(incidents) <= INCIDENTS_KEPT and sum(sizes) <= INCIDENT_BYTES_KEPT:
        return 0
    kept, kept_bytes = 0, 0
    for size in reversed(sizes):
        if kept >= 1 and (kept >= INCIDENTS_KEPT // 2 or kept_bytes + size > INCIDENT_BYTES_KEPT // 2):
            break
        kept, kept_bytes = kept + 1, kept_bytes + size
    closed = 0
    for incident in incidents[: len(incidents) - kept]:
        if incident.outcome == "recovering":
            break
        closed += 1
    return closed
