"""The owner record of a run directory: who may act on a run, and how it changes hands."""

from __future__ import annotations

import asyncio
import threading

import pytest
from temporalio.testing import ActivityEnvironment

from lazarus.activities.ownership import acting_for_owner
from lazarus.activities.running import in_thread
from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.infra.ownership import NotOwner, StillActing, hold, read_owner, share_acting, take_over
from lazarus.schema.ownership import HANDOVERS_KEPT, Owner
from lazarus.schema.rundir import RunDir
from lazarus.schema.stages import RunRequest


def execution(name: str, lineage: str = "first", continued_from: str | None = None, workflow_id: str = "run-a"):
    return Owner(workflow_id=workflow_id, execution=name, lineage=lineage, continued_from=continued_from)


@pytest.fixture
def run(tmp_path) -> RunDir:
    return RunDir(tmp_path / "runs" / "run-a")


def test_the_first_execution_to_act_owns_the_run_and_its_continuations_inherit_it(run):
    first = execution("first")
    assert read_owner(run) is None
    assert hold(run, first).owner == first
    assert hold(run, first).owner == first  # acting again changes nothing
    second = execution("second", continued_from="first")
    assert hold(run, second).owner == second
    third = execution("third", continued_from="second")
    assert hold(run, third).owner == third and read_owner(run).handovers == []
    with pytest.raises(NotOwner, match="the workflow was reset"):
        hold(run, second)  # a run that continued as new never acts again


def test_a_reset_execution_is_refused_until_it_takes_the_run_over(run):
    hold(run, execution("first"))
    reset = execution("reset-1")  # same lineage, not a continuation of the owner
    with pytest.raises(NotOwner) as refused:
        hold(run, reset)
    assert "execution first of this workflow drives run 'run-a', not reset-1: the workflow was reset" in str(
        refused.value
    )
    assert refused.value.record.owner.execution == "first"
    record, replaced = take_over(run, reset, previous="first", kind="reset")
    assert replaced.execution == "first" and record.owner == reset
    [handover] = record.handovers
    assert (handover.kind, handover.from_execution, handover.to_execution) == ("reset", "first", "reset-1")
    assert hold(run, reset).owner == reset
    with pytest.raises(NotOwner):
        hold(run, execution("first"))  # the execution reset away changes nothing any more
    assert take_over(run, reset, previous="first", kind="reset") == (record, None)  # a retry of the same take-over


def test_a_later_workflow_under_the_same_id_must_adopt_and_another_workflow_never_acts(run):
    hold(run, execution("first"))
    later = execution("later", lineage="later")
    with pytest.raises(NotOwner, match="adopt it: lazarus run adopt run-a"):
        hold(run, later)
    stranger = execution("x", lineage="x", workflow_id="wf-b")
    with pytest.raises(NotOwner, match="run 'wf-b' is driven by workflow 'run-a'"):
        hold(run, stranger)
    record, _ = take_over(run, later, previous="first", kind="adopt")
    assert record.owner == later and record.handovers[-1].kind == "adopt"


def test_two_executions_taking_the_run_from_the_same_owner_cannot_both_win(run):
    hold(run, execution("first"))
    won, lost = [], []
    candidates = [execution(f"reset-{n}") for n in range(8)]
    barrier = threading.Barrier(len(candidates))

    def race(candidate):
        barrier.wait()
        try:
            won.append(take_over(run, candidate, previous="first", kind="reset")[0].owner)
        except NotOwner as error:
            lost.append(str(error))

    threads = [threading.Thread(target=race, args=(c,)) for c in candidates]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(won) == 1 and len(lost) == len(candidates) - 1
    assert read_owner(run).owner == won[0] and len(read_owner(run).handovers) == 1
    assert all(f"passed to execution {won[0].execution} since execution first was refused" in m for m in lost)


def test_the_record_keeps_only_the_newest_handovers(run):
    previous = "first"
    hold(run, execution(previous))
    for n in range(HANDOVERS_KEPT + 5):
        take_over(run, execution(f"reset-{n}"), previous=previous, kind="reset")
        previous = f"reset-{n}"
    handovers = read_owner(run).handovers
    assert len(handovers) == HANDOVERS_KEPT and handovers[-1].to_execution == previous


def test_a_take_over_waits_until_the_old_owner_s_stage_has_ended(run):
    """A reset lands while a stage of the old execution acts: the take-over records nothing until
    it ends, and no stage starts acting while the take-over holds the run."""
    hold(run, execution("first"))
    acting = share_acting(run)  # the old execution's resume, still starting ranks
    taken = threading.Event()
    thread = threading.Thread(
        target=lambda: (take_over(run, execution("reset-1"), "first", "reset", wait_seconds=30), taken.set())
    )
    thread.start()
    assert not taken.wait(0.5) and read_owner(run).owner.execution == "first"
    acting.close()  # the stage ended
    assert taken.wait(10)
    thread.join()
    assert read_owner(run).owner.execution == "reset-1"
    late = share_acting(run)  # a stage the old execution starts now gets the lock, then its refusal
    assert late is not None
    with pytest.raises(NotOwner):
        hold(run, execution("first"))
    late.close()


def test_a_take_over_says_so_when_the_old_owner_s_stage_never_ends(run):
    hold(run, execution("first"))
    acting = share_acting(run)
    try:
        with pytest.raises(StillActing, match="still acts on it after 0.2 s"):
            take_over(run, execution("reset-1"), "first", "reset", wait_seconds=0.2)
    finally:
        acting.close()
    assert read_owner(run).owner.execution == "first" and read_owner(run).handovers == []


async def test_a_cancelled_stage_holds_off_a_take_over_until_its_thread_ends(tmp_path):
    """A reset cancels the old execution's resume, whose backend call runs on in its thread: the
    run counts as acted on until that call ends, so the take-over reads the cluster only after."""
    cluster = LocalCluster(tmp_path)
    run = cluster.run_dir("run-a")
    hold(run, execution("first"))
    request = RunRequest(run_id="run-a", owner=execution("first"))
    started, release = threading.Event(), threading.Event()

    def starting_ranks():
        started.set()
        release.wait(30)

    async def resume():
        async with acting_for_owner(cluster, request):
            await in_thread(starting_ranks)

    stage = ActivityEnvironment()
    running = asyncio.ensure_future(stage.run(resume))
    await asyncio.to_thread(started.wait, 10)
    stage.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    try:
        with pytest.raises(StillActing):
            await asyncio.to_thread(take_over, run, execution("reset-1"), "first", "reset", 0.3)
    finally:
        release.set()
    record, _ = await asyncio.to_thread(take_over, run, execution("reset-1"), "first", "reset", 10)
    assert record.owner.execution == "reset-1"
