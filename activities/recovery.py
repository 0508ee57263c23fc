"""The recovery stages as Temporal activities over a cluster backend.

Every activity is idempotent: it reads what an earlier attempt left in the run directory
(assignments, launch records, rank locks) and finishes the job instead of repeating it, so
a worker killed at any point and retried elsewhere neither duplicates ranks nor claims a
spare twice.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

from temporalio import activity
from temporalio.exceptions import ApplicationError

from lazarus.activities.draining import end_incarnation, hold_out
from lazarus.activities.failpoints import Failpoints
from lazarus.activities.gathering import gathered
from lazarus.activities.metrics import Metrics
from lazarus.activities.ownership import acting_for_owner, checked, owned, refused, take_over_run
from lazarus.activities.preflight import missing_command, unkept_survivors
from lazarus.activities.resuming import (
    first_step_done_at,
    restore_and_start,
    script_restore_point,
    shows_restored_count,
    up_when,
)
from lazarus.activities.running import in_thread, observe_start_lag, timed
from lazarus.activities.watching import last_warnings, progress_of, watch, watch_until_reported
from lazarus.infra import registry
from lazarus.infra.backend import ClusterBackend, ClusterError, QuarantineRefused
from lazarus.infra.ownership import NotOwner, StillActing
from lazarus.schema.incident_archive import write_archived
from lazarus.schema.nodelist import natural_key
from lazarus.schema.records import Assignment, DetectResult, FaultReport, Inventory
from lazarus.schema.stages import (
    ArchiveInput,
    DetectInput,
    DrainInput,
    DrainResult,
    LaunchInput,
    LaunchResult,
    ReleaseInput,
    ReplaceInput,
    RescheduleInput,
    ResumeInput,
    ResumeResult,
    ReturnNodeInput,
    StopInput,
    StopResult,
    TakeOverInput,
    TakeOverResult,
)


def _permanent(error: Exception, kind: str) -> ApplicationError:
    return ApplicationError(str(error), type=kind, non_retryable=True)


def _touch(path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()


class RecoveryActivities:
    """launch, detect, drain, reschedule, replace_or_reshard and resume, over one backend."""

    def __init__(self, cluster: ClusterBackend, failpoints: Failpoints | None = None, metrics: Metrics | None = None):
        self.cluster = cluster
        self.failpoints = failpoints or Failpoints()
        self.metrics = metrics or Metrics()

    def every(self) -> list:
        """Every activity of the class, bound to this object: what a worker registers (a stage
        added here cannot be left out of a worker)."""
        return [
            getattr(self, name)
            for name, member in vars(type(self)).items()
            if hasattr(member, "__temporal_activity_definition")
        ]

    @activity.defn(name="launch")
    @timed("launch")
    async def launch(self, request: LaunchInput) -> LaunchResult:
        """Create the run's directory and inventory, assign the active nodes, start incarnation 0."""
        refused = registry.refuses(self.cluster, request.spec.cluster.backend)
        if refused:
            raise ApplicationError(refused, type="WrongBackend", non_retryable=True)
        work_dir = self.cluster.run_dir(request.run_id).work_dir
        missing = missing_command(request.spec.trainer, work_dir, self.cluster.shares_host)
        if missing:
            raise ApplicationError(missing, type="CommandNotFound", non_retryable=True)
        unkept = unkept_survivors(request.spec, self.cluster.keeps_survivors)
        if unkept:
            raise ApplicationError(unkept, type="PolicyNotSupported", non_retryable=True)
        async with acting_for_owner(self.cluster, request):  # after the checks: a refused launch leaves no owner
            return await self._launch(request)

    async def _launch(self, request: LaunchInput) -> LaunchResult:
        try:
            run = await in_thread(self.cluster.create, request.run_id, request.spec)
        except ClusterError as error:
            raise _permanent(error, "RunDirectoryConflict") from None
        inventory = await in_thread(self.cluster.inventory, request.run_id)
        active = sorted((n.name for n in inventory.nodes if n.role == "active"), key=natural_key)
        assignment = await in_thread(
            self.cluster.commit_assignment,
            request.run_id,
            Assignment(
                incarnation=0,
                nodes=active,
                layout=request.spec.layout,
                master_port=await in_thread(self.cluster.rendezvous_port, request.run_id),
            ),
        )
        await in_thread(self.cluster.start_ranks, request.run_id, 0, 0, None, request.spec.recovery)
        return LaunchResult(run_dir=str(run.root), assignment=assignment)

    async def _note(self, run_id: str, stage: str, message: str) -> None:
        """Record the stage where the cluster's tools show it (an Event on Kubernetes); never fails the stage."""
        if not self.cluster.records_stages:
            return
        try:
            await in_thread(self.cluster.record_stage, run_id, stage, message)
        except Exception as error:  # noqa: BLE001 - the audit trail of record is the workflow history
            activity.logger.warning("could not record %s for run %s: %s", stage, run_id, error)

    @activity.defn(name="detect")
    @checked
    async def detect(self, request: DetectInput) -> DetectResult:
        """Watch an incarnation; return a fault, completion, a new warning, spares for a regrow, or
        progress after progress_every_seconds (activities/watching.py)."""
        observe_start_lag(self.metrics, "detect", time.time())
        verdict, now, capacity, swap = await watch_until_reported(self.cluster, request)
        fault = verdict.fault
        if swap is not None:
            fault = swap.fault(request.incarnation, verdict.step, now)
        if verdict.stopped:
            # Nobody asked (the workflow stops detect before it asks): treat it as a failure.
            assignment = await in_thread(self.cluster.assignment, request.run_id, request.incarnation)
            at = datetime.fromtimestamp(now, UTC)
            fault = FaultReport(
                kind="rank_exit",
                nodes=assignment.nodes,
                incarnation=request.incarnation,
                occurred_at=at,
                detected_at=at,
                step=verdict.step,
                reason=f"every rank exited at step {verdict.step}, before the last step",
            )
        if fault is not None:
            await self._note(
                request.run_id, "fault_detected", f"{fault.kind} on {', '.join(fault.nodes)}: {fault.reason}"
            )
            await self.failpoints.reach("detect.after_fault")
        progress = progress_of(verdict, now)
        if fault is not None:
            warned = await in_thread(last_warnings, self.cluster, request.run_id, request.incarnation)
            progress.warnings = [*progress.warnings, *(w for w in warned if w not in progress.warnings)]
        return DetectResult(fault=fault, completed=verdict.completed, progress=progress, capacity=capacity)

    @activity.defn(name="drain")
    @timed("drain")
    @owned
    async def drain(self, request: DrainInput) -> DrainResult:
        """Quarantine the blamed nodes, stop every rank of the incarnation, drop half-written checkpoints."""
        # Drain runs once per incident (its first call's first attempt): the place to count the
        # incident's detection time.
        if activity.info().attempt == 1 and request.waited is None:
            self.metrics.stage_seconds.labels("detect").observe(request.detect_seconds)
        try:
            held_back = await in_thread(hold_out, self.cluster, request)
        except ClusterError as error:
            raise _permanent(error, "UnknownNode") from None
        await self.failpoints.reach("drain.after_quarantine")
        drained = await in_thread(end_incarnation, self.cluster, request, held_back)
        if drained.unfinished is not None:
            return drained
        await self._note(
            request.run_id,
            "drained",
            f"quarantined {', '.join(drained.quarantined) or f'nothing: {held_back}'}; "
            f"stopped incarnation {request.incarnation} (ranks {drained.stopped_ranks or 'none'} were alive)",
        )
        return drained

    @activity.defn(name="reschedule")
    @timed("reschedule")
    @owned
    async def reschedule(self, request: RescheduleInput) -> Inventory:
        """The run's inventory: which spares are free, which nodes are quarantined, and the next
        incarnation's claim where an earlier attempt of the stages made it. An execution from
        before the workflow gathered on its own timer asks it to wait here for the runs that failed
        with its own (activities/gathering.py)."""
        inventory = await gathered(self.cluster, request)
        if request.incarnation is not None:
            inventory.claimed = await in_thread(
                self.cluster.claimed_assignment, request.run_id, request.incarnation + 1
            )
        await self.failpoints.reach("reschedule.after_inventory")
        said = f"free spares: {', '.join(inventory.free_spares()) or 'none'}"
        if inventory.claimed is not None:
            said += (
                f"; incarnation {inventory.claimed.incarnation} claimed already: {', '.join(inventory.claimed.nodes)}"
            )
        await self._note(request.run_id, "rescheduled", said)
        return inventory

    @activity.defn(name="replace_or_reshard")
    @timed("replace_or_reshard")
    @owned
    async def replace_or_reshard(self, request: ReplaceInput) -> Assignment:
        """Claim the decided spares and release leftover nodes (exactly once); record the next assignment."""
        old, decision = request.old_assignment, request.decision
        proposed = Assignment(
            incarnation=old.incarnation + 1,
            nodes=decision.nodes,
            layout=decision.layout,
            master_addr=old.master_addr,
            master_port=await in_thread(self.cluster.rendezvous_port, request.run_id),
        )
        claims = [node for node in decision.nodes if node not in old.nodes]
        for node in claims:
            try:
                failed = await in_thread(self.cluster.vet_spare, request.run_id, node)
            except QuarantineRefused as refused:  # it failed, and the open breaker keeps it in the pool
                raise _permanent(refused, "QuarantineRefused") from None
            if failed is not None:  # out of the pool now: the run decides again, without it
                error = ClusterError(f"spare {node} failed the health check before it was handed out: {failed}")
                raise _permanent(error, "SpareUnavailable")
        try:
            recorded = await in_thread(
                self.cluster.commit_assignment, request.run_id, proposed, claims, decision.released_nodes
            )
        except ClusterError as error:
            raise _permanent(error, "SpareUnavailable") from None
        await self.failpoints.reach("replace_or_reshard.after_claim")
        if recorded.nodes == proposed.nodes and recorded.layout == proposed.layout and activity.info().attempt == 1:
            self.metrics.incidents.labels(request.fault_kind, decision.action).inc()
        await self._note(
            request.run_id,
            "replaced" if decision.action == "replace" else "resharded",
            f"incarnation {recorded.incarnation} on {', '.join(recorded.nodes)} (dp {recorded.layout.dp})",
        )
        return recorded

    @activity.defn(name="resume")
    @timed("resume")
    @owned
    async def resume(self, request: ResumeInput) -> ResumeResult:
        """Start the incarnation from what the fault's survivors saved, else from the newest complete
        checkpoint; return once it is up: past its first new step where the ranks report steps,
        else once every rank runs."""
        run_id, incarnation = request.run_id, request.assignment.incarnation
        launch, newest, skipped = await in_thread(restore_and_start, self.cluster, request)
        if launch is None:
            return ResumeResult(
                resumed_from_step=newest, skipped_checkpoints=skipped, completed=True, restored_from="checkpoint"
            )
        # The record in force: a retried resume restores what its first attempt chose.
        resumed_from, skipped = launch.resume_step, launch.skipped
        restored_from = (
            "in_process"
            if launch.rejoin
            else "survivors"
            if launch.survivors
            else "checkpoint"
            if resumed_from
            else "scratch"
        )
        await self.failpoints.reach("resume.after_launch")

        # A progress bar shows the restored count before it trains (activities/resuming.py).
        shows_restored = request.steps_from == "output" and shows_restored_count(
            await in_thread(self._heartbeats, run_id, 0)
        )
        up = up_when(request, resumed_from, shows_restored, self._heartbeats)
        await self._note(
            run_id, "resuming", f"incarnation {incarnation} restores step {resumed_from} from {restored_from}"
        )
        verdict, _ = await watch(self.cluster, run_id, incarnation, request.policy, request.total_steps, until=up)
        beats = await in_thread(self._recovered, run_id, incarnation)
        if verdict.fault:
            return ResumeResult(resumed_from_step=resumed_from, skipped_checkpoints=skipped, fault=verdict.fault)
        if activity.info().attempt == 1:
            self._count_restore(restored_from, request.fault_step, resumed_from)
        if request.steps_from != "trainer" and not resumed_from:
            # No checkpoint of Lazarus's was restored: the script restored its own snapshot.
            resumed_from, restored_from = script_restore_point(beats, shows_restored), None
        # Every reporting rank records when it finished its first step; the step is done when the
        # last of them has, whatever the poll interval was.
        done_at = first_step_done_at(beats, shows_restored)
        return ResumeResult(
            resumed_from_step=resumed_from,
            skipped_checkpoints=skipped,
            restored_from=restored_from,
            completed=verdict.completed,
            first_step_at=datetime.fromtimestamp(done_at, UTC) if done_at else None,
            rank_first_steps={beat.rank: beat.first_step_at for beat in beats if beat.first_step_at},
            step=verdict.step,
        )

    def _count_restore(self, restored_from: str | None, fault_step: int | None, resumed_from: int | None) -> None:
        """Count where a resumed incarnation's state came from, and the steps its fault lost."""
        if restored_from is None:
            return
        self.metrics.restores.labels(restored_from).inc()
        if fault_step is not None and resumed_from is not None:
            self.metrics.lost_steps.inc(max(0, fault_step - resumed_from))

    def _recovered(self, run_id: str, incarnation: int) -> list:
        """The recovery is over, whatever became of it: the run's want of spares goes. Returns the
        newest heartbeats of the incarnation's ranks."""
        self.cluster.drop_want(run_id)
        return self._heartbeats(run_id, incarnation)

    def _heartbeats(self, run_id: str, incarnation: int) -> list:
        """The newest heartbeat of every rank of the incarnation that has written one."""
        return [r.heartbeat for r in self.cluster.observe(run_id, incarnation).ranks if r.heartbeat]

    @activity.defn(name="stop")
    @timed("stop")
    @owned
    async def stop(self, request: StopInput) -> StopResult:
        """Ask the incarnation to checkpoint and exit; past the timeout, or on a fault, kill it."""
        run_id, incarnation = request.run_id, request.incarnation
        run = self.cluster.run_dir(run_id)
        await in_thread(_touch, run.stop_file(incarnation))
        deadline = time.time() + request.timeout_seconds
        verdict, _ = await watch(
            self.cluster, run_id, incarnation, request.policy, request.total_steps, until=lambda _, now: now >= deadline
        )
        clean = verdict.stopped or verdict.completed
        if not clean:
            await in_thread(self.cluster.stop_incarnation, run_id, incarnation)
            await in_thread(self.cluster.remove_partial_checkpoints, run_id)
        newest, _ = await in_thread(run.newest_checkpoint)
        reason = (
            ""
            if clean
            else (
                verdict.fault.reason
                if verdict.fault
                else f"the ranks did not stop within {request.timeout_seconds:g} s; killed"
            )
        )
        return StopResult(
            step=verdict.step, checkpoint_step=newest, clean=clean, completed=verdict.completed, reason=reason
        )

    @activity.defn(name="release")
    @timed("release")
    @owned
    async def release(self, request: ReleaseInput) -> list[str]:
        """The run ended: stop its standbys and give its active nodes back to the pool; returns them."""
        try:
            await in_thread(self.cluster.release_standbys, request.run_id)
            return await in_thread(self.cluster.release_nodes, request.run_id)
        except ClusterError as error:
            raise _permanent(error, "UnknownRun") from None

    @activity.defn(name="return_node")
    @timed("return_node")
    @owned
    async def return_node(self, request: ReturnNodeInput) -> Inventory:
        """A repaired node rejoins the run's spare pool."""
        try:
            return await in_thread(self.cluster.return_node, request.run_id, request.node)
        except ClusterError as error:
            raise _permanent(error, "UnknownNode") from None

    @activity.defn(name="archive_incidents")
    @timed("archive")
    @owned
    async def archive_incidents(self, request: ArchiveInput) -> int:
        """Write closed incidents' records to the run directory; returns how many."""
        await in_thread(write_archived, self.cluster.run_dir(request.run_id), request.incidents)
        return len(request.incidents)

    @activity.defn(name="take_over")
    @timed("take_over")
    async def take_over(self, request: TakeOverInput) -> TakeOverResult:
        """Make the calling execution the run's owner (after a reset, or an adoption) and read what
        the cluster holds of the run (activities/ownership.py)."""
        if request.owner is None:
            raise ApplicationError(
                "take_over needs the calling execution (owner)", type="InvalidInput", non_retryable=True
            )
        # Wait for the old owner's stages for most of this attempt's time, keeping some to read the cluster.
        timeout = activity.info().start_to_close_timeout
        wait_seconds = 0.8 * timeout.total_seconds() if timeout else 600.0
        try:
            return await in_thread(take_over_run, self.cluster, request, wait_seconds)
        except NotOwner as error:
            raise refused(error) from None
        except StillActing as error:  # retried: the pending activity says what it waits for
            raise ApplicationError(str(error), type="StillActing") from None
        except ClusterError as error:
            raise _permanent(error, "UnknownRun") from None
