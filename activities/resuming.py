"""How resume starts a new incarnation, and what its first heartbeats tell resume: when it is up, where a script that
restores its own snapshot restarted, and when its first step past that was done.

A script read through trainer.progress_pattern names the steps it has done. Most print a step
once it is done ("step 11 loss ..."): the first one read after a restart is the step after the
restored one. A progress bar shows the count done before it trains ("10/40" at once after a
restore, "0/40" when a run begins): the restored count is the first read, and the first step
past it is its first advance. Which kind a script is shows when the run begins: its first
reading there was 0.
"""

from __future__ import annotations

from lazarus.activities.running import in_thread
from lazarus.infra.backend import ClusterBackend
from lazarus.infra.survivors import fall_back, rejoin_of, survivor_source, waiting_survivors
from lazarus.schema.contract import Heartbeat, LaunchRecord, read_launch
from lazarus.schema.stages import ResumeInput


def restore_and_start(cluster: ClusterBackend, request: ResumeInput) -> tuple[LaunchRecord | None, int, dict[int, str]]:
    """Start the new incarnation from what the fault's survivors saved, else from the newest complete
    checkpoint: the launch record in force, the newest checkpoint's step and the newer ones passed
    over, each with why. When that checkpoint is of the last step the run is done: no launch (None),
    unless an earlier attempt launched this incarnation, which trained to the end meanwhile (survivors
    that kept their processes need no controller to go on): its record."""
    run = cluster.run_dir(request.run_id)
    newest, skipped = run.newest_checkpoint()
    if newest >= request.total_steps:
        cluster.release_standbys(request.run_id)
        return read_launch(run, request.assignment.incarnation), newest, skipped
    incarnation = request.assignment.incarnation
    if request.survivors_of is not None and cluster.keeps_survivors:
        launch = rejoin_or_release(cluster, request, request.survivors_of, skipped)
        if launch is not None:
            return launch, newest, skipped
    survivors = None
    if request.survivors_of is not None:
        found = survivor_source(run, request.survivors_of, request.assignment.layout, newest)
        # The last step's state belongs in a checkpoint: a run never ends on survivors' files.
        if found is not None and found[0] < request.total_steps:
            newest, survivors = found
    launch = cluster.start_ranks(request.run_id, incarnation, newest, skipped, request.policy, survivors)
    return launch, newest, skipped


def rejoin_or_release(
    cluster: ClusterBackend, request: ResumeInput, old: int, skipped: dict[int, str]
) -> LaunchRecord | None:
    """Where the survivors of incarnation `old` wait at their step boundary (RecoveryPolicy.in_process):
    start the new incarnation with them rejoining, when its assignment keeps their nodes and a whole
    replica of them can send the state (its launch record); else tell them to fall back, give them
    the grace to save their state and end, and stop what is left of `old` (None: start afresh)."""
    run, new = cluster.run_dir(request.run_id), request.assignment
    earlier = read_launch(run, new.incarnation)  # a retried resume takes the path the first attempt took
    old_assignment = cluster.assignment(request.run_id, old)
    if old_assignment is None:
        return None
    kept = waiting_survivors(run, old_assignment)
    rejoin = rejoin_of(old_assignment, new, kept) if earlier is None else earlier.rejoin
    if rejoin is not None:
        launch = cluster.rejoin_ranks(request.run_id, new.incarnation, kept_step(kept, earlier), rejoin, skipped)
        # The survivors serve the new incarnation now: ended, the old one's late checkpoint commits
        # (a save it had in flight) never count, as for a stopped incarnation.
        run.end(old)
        return launch
    if not run.ended_file(old).exists():  # drain kept them: they save and end now, as on the restart path
        fall_back(run, old)
        cluster.await_survivors(request.run_id, old, request.policy.survivor_grace_seconds)
        cluster.stop_incarnation(request.run_id, old)
        cluster.remove_partial_checkpoints(request.run_id)
    return None


def kept_step(kept: dict[int, int], earlier: LaunchRecord | None) -> int:
    """The step the kept survivors hold: what they wait at, or what a first attempt recorded."""
    return earlier.resume_step if earlier is not None else next(iter(kept.values()))


def shows_restored_count(first_heartbeats: list[Heartbeat]) -> bool:
    """Whether the ranks' output showed step 0 first when the run began (incarnation 0's heartbeats)."""
    firsts = [beat.first_step for beat in first_heartbeats if beat.first_step is not None]
    return bool(firsts) and min(firsts) == 0


def script_restore_point(heartbeats: list[Heartbeat], shows_restored: bool) -> int | None:
    """The step a script that restores its own snapshot restarted from; None when it reports no step."""
    firsts = [beat.first_step for beat in heartbeats if beat.first_step is not None]
    if not firsts:
        return None
    return max(0, min(firsts) - (0 if shows_restored else 1))


def first_step_done_at(heartbeats: list[Heartbeat], shows_restored: bool) -> float | None:
    """When the incarnation's first step past its restore was done: when the last rank to report it
    did (seconds since the epoch); None before."""
    done = [beat.advanced_at if shows_restored else beat.first_step_at for beat in heartbeats]
    return max((at for at in done if at), default=None)


def up_when(request: ResumeInput, resumed_from: int, shows_restored: bool, heartbeats):
    """When resume's new incarnation is up, as a watch's `until`: past the restored step where the
    trainer reports steps; at the first step a script's output names (its first advance, where it
    shows the restored count first); else once every rank runs. `heartbeats(run_id, incarnation)`
    reads the ranks' heartbeats."""
    world, incarnation = request.assignment.layout.world_size, request.assignment.incarnation

    async def up(verdict, _now) -> bool:
        if request.steps_from == "trainer":
            return verdict.step is not None and verdict.step > resumed_from
        if request.steps_from == "output" and verdict.step is not None and shows_restored:
            beats = await in_thread(heartbeats, request.run_id, incarnation)
            return len(beats) == world and all(beat.advanced_at for beat in beats)  # as verdict.step: every rank
        if request.steps_from == "output":
            return verdict.step is not None  # the script restored what it chose: any step it reports
        return verdict.up

    return up
