"""A run's incidents: one opened per fault (or the run fails, when no recovery can help), and the
oldest closed ones archived to the run directory so the status carried through continue-as-new
stays small (schema/tally.py). A mixin of TrainingRun."""

from __future__ import annotations

import re

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from lazarus.activities.recovery import RecoveryActivities
    from lazarus.schema.records import FaultReport, Incident, RunState, StageRecord
    from lazarus.schema.stages import ArchiveInput, ResumeResult
    from lazarus.schema.tally import downtime_seconds, to_archive
from lazarus.workflows.run_parts import RunParts
from lazarus.workflows.stage_calls import RunFailed, call_stage

# Deprecated patches: each id's workflow.deprecate_patch stands where its workflow.patched stood, so
# that histories with the id's marker replay (the patch policy: docs/concepts/run-as-workflow.md).
ARCHIVE_PATCH = "bounded-status"
"""Deprecated patch id: the status holds the newest incidents and a tally of the older ones, whose
records are archived in the run directory (before: every incident, in full)."""


CRASH_LOOP_PATCH = "program-errors-in-place"
"""Deprecated patch id: a rank's own failure (rank_error) restarts the run in place, no node blamed,
and the same failure again is a crash loop that ends the run (before: its node was quarantined)."""


def failure_signature(fault: FaultReport) -> str:
    """What makes two program failures the same: the exception's type and message (addresses
    masked), else the exit code or signal; which rank failed does not matter."""
    if fault.error:
        return re.sub(r"0x[0-9a-fA-F]+", "0x…", fault.error.strip())
    if fault.signal:
        return f"killed by {fault.signal}"
    return f"exit code {fault.exit_code}"


def crash_loop(incidents: list[Incident], fault: FaultReport) -> str | None:
    """Why `fault` makes a crash loop, or None. A loop: the program failed on its own (rank_error)
    right after a restart in place for its own failure, and either the same way (failure_signature)
    or before a step was trained between the two (the restart never trained)."""
    if fault.kind != "rank_error" or not incidents:
        return None
    last = incidents[-1]
    if last.fault.kind != "rank_error":
        return None
    if failure_signature(last.fault) == failure_signature(fault):
        return f"the same failure again after a restart in place (incident {last.number}): {fault.reason}"
    if last.outcome == "interrupted":
        return (
            f"failed again before training a step after a restart in place (incident {last.number}: "
            f"{failure_signature(last.fault)}): {fault.reason}"
        )
    return None


class Incidents(RunParts):
    """Opening, ending and archiving the run's incidents."""

    def _end_crash_loop(self, incident: Incident, looping: str) -> ResumeResult:
        """The program fails the same way on every restart: no recovery can help and no node is to
        blame. FAILED with the rank's exception, or PAUSED on its nodes for an operator to fix the
        program and resume (recovery.crash_loop)."""
        fault, status = incident.fault, self._status
        status.failure = fault
        tail = f"; last lines of rank {fault.rank}'s log:\n{fault.log_tail}" if fault.log_tail else ""
        if self._policy.crash_loop == "fail":
            raise RunFailed(f"crash loop: {looping}{tail}")
        incident.outcome = "failed"
        status.reason = f"crash loop, paused for an operator (recovery.crash_loop: pause): {looping}"
        self._enter(RunState.PAUSED)
        return ResumeResult(resumed_from_step=None)

    def _hold_for_a_person(self, incident: Incident, held_back: str) -> ResumeResult:
        """Drain stopped the ranks but quarantined nothing (the pool's quarantine breaker is open): no
        recovery follows. PAUSED on the run's nodes, with why and what a person does next."""
        nodes = ", ".join(incident.fault.nodes)
        incident.outcome = "paused"
        self._status.reason = (
            f"paused: {nodes} not quarantined: {held_back}; then `lazarus run resume {self._status.run_id}` "
            "restarts it on its nodes (a node that is really faulty fails it again, and is recovered from)"
        )
        self._enter(RunState.PAUSED)
        return ResumeResult(resumed_from_step=None)

    async def _archive_old_incidents(self) -> None:
        """Keep the carried status small: once it holds too many incidents, the oldest closed ones
        go to the run directory and into the tally (schema/tally.py). An archive that fails leaves
        them in the status, to be tried again after the next incident."""
        status = self._status
        count = to_archive(status.incidents)
        if not count:
            return
        workflow.deprecate_patch(ARCHIVE_PATCH)
        archived = status.incidents[:count]
        try:
            archiving = ArchiveInput(run_id=status.run_id, incidents=archived)
            await call_stage(self._policy, "archive", RecoveryActivities.archive_incidents, archiving)
        except RunFailed as failure:
            workflow.logger.warning("older incidents stay in the status: %s", failure)
            return
        for incident in archived:
            status.earlier_incidents.add(incident, downtime_seconds(incident, workflow.now()))
        status.incidents = status.incidents[count:]

    async def _stop_for_swap(self, incident: Incident, fault: FaultReport) -> None:
        """A planned swap (nothing died: a straggler): checkpoint and stop every rank at a step
        boundary first, so that the incarnation on the spare resumes from that step and none is lost."""
        stopped = await self._stop_ranks(f"{fault.kind}: swap {', '.join(fault.nodes)}", timing=incident)
        if stopped is not None and stopped.step is not None:
            fault.step = self._status.step = stopped.step

    def _open_incident(self, fault: FaultReport) -> Incident:
        """Record the fault as the run's next incident; RunFailed when no recovery can help."""
        status = self._status
        if fault.kind == "program_error" or status.incident_count >= self._policy.max_incidents:
            status.failure = fault
        if fault.kind == "program_error":
            # No node is to blame: replacing nodes would only fail the same way.
            tail = f"; last lines of rank {fault.rank}'s log:\n{fault.log_tail}" if fault.log_tail else ""
            raise RunFailed(f"the training program failed: {fault.reason}{tail}")
        if status.incident_count >= self._policy.max_incidents:
            raise RunFailed(f"fault after {status.incident_count} recoveries (recovery.max_incidents): {fault.reason}")
        assert status.assignment is not None, "the run loop launches before it recovers"
        incident = Incident(
            number=status.incident_count + 1,
            fault=fault,
            old_assignment=status.assignment,
            stages={"detect": StageRecord(started_at=fault.occurred_at, ended_at=fault.detected_at)},
        )
        status.incidents.append(incident)
        if fault.step is not None:
            status.step = fault.step
        return incident
