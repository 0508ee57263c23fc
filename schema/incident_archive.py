"""Incidents a run's status no longer holds in full, kept in the run directory
(`incidents/<number>.json`): written by the `archive_incidents` activity, read by a report that
can reach the run directory (schema/tally.py keeps their tally)."""

from __future__ import annotations

from pydantic import ValidationError

from lazarus.schema.files import read_text, write_json_atomic
from lazarus.schema.records import Incident
from lazarus.schema.rundir import RunDir


def archive_file(run: RunDir, number: int):
    """Where an archived incident's record lives."""
    return run.root / "incidents" / f"{number:06d}.json"


def write_archived(run: RunDir, incidents: list[Incident]) -> None:
    """Keep each incident's full record in the run directory (a retry rewrites the same files)."""
    for incident in incidents:
        write_json_atomic(archive_file(run, incident.number), incident.model_dump_json())


def read_archived(run: RunDir, count: int) -> list[Incident] | None:
    """Incidents 1 .. count from the run directory, oldest first; None when any cannot be read
    (another machine's run directory, a record removed)."""
    incidents = []
    for number in range(1, count + 1):
        try:
            text = read_text(archive_file(run, number))
            if text is None:
                return None
            incidents.append(Incident.model_validate_json(text))
        except (OSError, ValidationError):
            return None
    return incidents
