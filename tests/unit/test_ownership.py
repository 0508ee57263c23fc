"""The owner records: who may act on a run, and how it changes hands; in the store that a fleet's
controllers share (both engines) and in the run directory (the Kubernetes backend's)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
import time

import pytest
from temporalio.testing import ActivityEnvironment

from lazarus.activities.ownership import acting_for_owner
from lazarus.activities.running import in_thread
from lazarus.infra import ownership_rows
from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.infra.ownership import FileOwnerRecords, NotOwner, OwnerRecords, StillActing
from lazarus.infra.ownership_rows import StoreOwnerRecords
from lazarus.infra.runfiles import RunFiles
from lazarus.infra.store import open_store
from lazarus.schema.ownership import HANDOVERS_KEPT, Owner
from lazarus.schema.stages import RunRequest
from tests.support.fixtures import schema_of_its_own

RUN = "run-a"
FORK = multiprocessing.get_context("fork")


def execution(name: str, lineage: str = "first", continued_from: str | None = None, workflow_id: str = "run-a"):
    return Owner(workflow_id=workflow_id, execution=name, lineage=lineage, continued_from=continued_from)


@pytest.fixture(params=["sqlite", "postgresql", "file"])
def owners(request, tmp_path) -> OwnerRecords:
    """The records in a store of the test's own on each engine in turn, then in the run directory."""
    if request.param == "file":
        return FileOwnerRecords(RunFiles(tmp_path))
    if request.param == "sqlite":
        return StoreOwnerRecords(open_store(f"sqlite:///{(tmp_path / 'lazarus.db').as_posix().lstrip('/')}"))
    _, url = schema_of_its_own(request.getfixturevalue("postgres_server"))
    return StoreOwnerRecords(open_store(url))


def test_the_first_execution_to_act_owns_the_run_and_its_continuations_inherit_it(owners):
    first = execution("first")
    assert owners.read(RUN) is None
    assert owners.hold(RUN, first).owner == first
    assert owners.hold(RUN, first).owner == first  # acting again changes nothing
    second = execution("second", continued_from="first")
    assert owners.hold(RUN, second).owner == second
    third = execution("third", continued_from="second")
    assert owners.hold(RUN, third).owner == third and owners.read(RUN).handovers == []
    with pytest.raises(NotOwner, match="the workflow was reset"):
        owners.hold(RUN, second)  # a run that continued as new never acts again


def test_a_reset_execution_is_refused_until_it_takes_the_run_over(owners):
    owners.hold(RUN, execution("first"))
    reset = execution("reset-1")  # same lineage, not a continuation of the owner
    with pytest.raises(NotOwner) as refused:
        owners.hold(RUN, reset)
    assert "execution first of this workflow drives run 'run-a', not reset-1: the workflow was reset" in str(
        refused.value
    )
    assert refused.value.record.owner.execution == "first"
    record, replaced = owners.take_over(RUN, reset, previous="first", kind="reset")
    assert replaced.execution == "first" and record.owner == reset
    [handover] = record.handovers
    assert (handover.kind, handover.from_execution, handover.to_execution) == ("reset", "first", "reset-1")
    assert owners.hold(RUN, reset).owner == reset
    with pytest.raises(NotOwner):
        owners.hold(RUN, execution("first"))  # the execution reset away changes nothing any more
    assert owners.take_over(RUN, reset, previous="first", kind="reset") == (
        record,
        None,
    )  # a retry of the same take-over


def test_a_later_workflow_under_the_same_id_must_adopt_and_another_workflow_never_acts(owners):
    owners.hold(RUN, execution("first"))
    later = execution("later", lineage="later")
    with pytest.raises(NotOwner, match="adopt it: lazarus run adopt run-a"):
        owners.hold(RUN, later)
    stranger = execution("x", lineage="x", workflow_id="wf-b")
    with pytest.raises(NotOwner, match="run 'wf-b' is driven by workflow 'run-a'"):
        owners.hold(RUN, stranger)
    record, _ = owners.take_over(RUN, later, previous="first", kind="adopt")
    assert record.owner == later and record.handovers[-1].kind == "adopt"


def test_two_executions_taking_the_run_from_the_same_owner_cannot_both_win(owners):
    owners.hold(RUN, execution("first"))
    won, lost = [], []
    candidates = [execution(f"reset-{n}") for n in range(8)]
    barrier = threading.Barrier(len(candidates))

    def race(candidate):
        barrier.wait()
        try:
            won.append(owners.take_over(RUN, candidate, previous="first", kind="reset")[0].owner)
        except NotOwner as error:
            lost.append(str(error))

    threads = [threading.Thread(target=race, args=(c,)) for c in candidates]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(won) == 1 and len(lost) == len(candidates) - 1
    assert owners.read(RUN).owner == won[0] and len(owners.read(RUN).handovers) == 1
    assert all(f"passed to execution {won[0].execution} since execution first was refused" in m for m in lost)


def test_the_record_keeps_only_the_newest_handovers(owners):
    previous = "first"
    owners.hold(RUN, execution(previous))
    for n in range(HANDOVERS_KEPT + 5):
        owners.take_over(RUN, execution(f"reset-{n}"), previous=previous, kind="reset")
        previous = f"reset-{n}"
    handovers = owners.read(RUN).handovers
    assert len(handovers) == HANDOVERS_KEPT and handovers[-1].to_execution == previous


def test_a_take_over_waits_until_the_old_owner_s_stage_has_ended(owners):
    """A reset lands while a stage of the old execution acts: the take-over records nothing until
    it ends, and no stage starts acting while the take-over holds the run."""
    owners.hold(RUN, execution("first"))
    acting = owners.share_acting(RUN)  # the old execution's resume, still starting ranks
    taken = threading.Event()
    thread = threading.Thread(
        target=lambda: (owners.take_over(RUN, execution("reset-1"), "first", "reset", wait_seconds=30), taken.set())
    )
    thread.start()
    assert not taken.wait(0.5) and owners.read(RUN).owner.execution == "first"
    acting.close()  # the stage ended
    assert taken.wait(10)
    thread.join()
    assert owners.read(RUN).owner.execution == "reset-1"
    late = owners.share_acting(RUN)  # a stage the old execution starts now gets the lock, then its refusal
    assert late is not None
    with pytest.raises(NotOwner):
        owners.hold(RUN, execution("first"))
    late.close()


def test_a_take_over_says_so_when_the_old_owner_s_stage_never_ends(owners):
    owners.hold(RUN, execution("first"))
    acting = owners.share_acting(RUN)
    try:
        with pytest.raises(StillActing, match="still acts on it after 0.2 s"):
            owners.take_over(RUN, execution("reset-1"), "first", "reset", wait_seconds=0.2)
    finally:
        acting.close()
    assert owners.read(RUN).owner.execution == "first" and owners.read(RUN).handovers == []


async def test_a_cancelled_stage_holds_off_a_take_over_until_its_thread_ends(tmp_path):
    """A reset cancels the old execution's resume, whose backend call runs on in its thread: the
    run counts as acted on until that call ends, so the take-over reads the cluster only after."""
    cluster = LocalCluster(tmp_path)
    owners = cluster.owners
    owners.hold(RUN, execution("first"))
    request = RunRequest(run_id=RUN, owner=execution("first"))
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
            await asyncio.to_thread(owners.take_over, RUN, execution("reset-1"), "first", "reset", 0.3)
    finally:
        release.set()
    record, _ = await asyncio.to_thread(owners.take_over, RUN, execution("reset-1"), "first", "reset", 10)
    assert record.owner.execution == "reset-1"


def _act_and_wait(url: str, acting, lease_seconds: float) -> None:
    """A controller's stage that acts on the run until its process is killed (a fork's target)."""
    ownership_rows.ACTING_LEASE_SECONDS, ownership_rows.RENEW_EVERY_SECONDS = lease_seconds, lease_seconds / 4
    owners = StoreOwnerRecords(open_store(url))
    held = owners.share_acting(RUN)
    owners.hold(RUN, execution("first"))
    acting.set()
    time.sleep(600)
    held.close()


@pytest.mark.parametrize("engine", ["sqlite", "postgresql"])
def test_a_stage_of_a_controller_killed_holds_off_a_take_over_only_until_its_lease_lapses(request, tmp_path, engine):
    """The stage's controller dies with it (SIGKILL): no lock outlives it, and the take-over waits
    for its lease only; while the process lives it renews the lease past its length."""
    if engine == "sqlite":
        url = f"sqlite:///{(tmp_path / 'lazarus.db').as_posix().lstrip('/')}"
    else:
        url = schema_of_its_own(request.getfixturevalue("postgres_server"))[1]
    owners = StoreOwnerRecords(open_store(url))
    acting = FORK.Event()
    stage = FORK.Process(target=_act_and_wait, args=(url, acting, 1.0))
    stage.start()
    try:
        assert acting.wait(30)
        # Three lease lengths: the living stage renewed its lease, and the take-over still waits.
        with pytest.raises(StillActing):
            owners.take_over(RUN, execution("reset-1"), "first", "reset", wait_seconds=3.0)
        assert owners.read(RUN).owner.execution == "first"
        os.kill(stage.pid, signal.SIGKILL)
        stage.join(10)
        record, replaced = owners.take_over(RUN, execution("reset-1"), "first", "reset", wait_seconds=30)
        assert record.owner.execution == "reset-1" and replaced.execution == "first"
        with pytest.raises(NotOwner):
            owners.hold(RUN, execution("first"))
        assert _leases(owners) == []  # the dead stage's lease went with the take-over
    finally:
        if stage.is_alive():
            stage.kill()
            stage.join(10)


def _leases(owners: StoreOwnerRecords) -> list[tuple]:
    with owners.store.read() as tx:
        return tx.all("SELECT run_id, stage FROM run_acting")


def test_a_lease_its_worker_left_goes_with_the_run_s_next_stage(tmp_path):
    owners = StoreOwnerRecords(open_store(f"sqlite:///{(tmp_path / 'lazarus.db').as_posix().lstrip('/')}"))
    with owners.store.write() as tx:  # a stage of a worker that died an hour ago
        tx.run("INSERT INTO run_acting (run_id, stage, until) VALUES (?, 'dead', '2026-01-01T00:00:00+00:00')", (RUN,))
    acting = owners.share_acting(RUN)
    assert acting is not None and [stage for _, stage in _leases(owners)] == [acting.stage]
    acting.close()


def test_a_take_over_that_gave_up_lets_the_run_s_stages_act_again(owners):
    """A take-over that waited past its time holds off no stage after it."""
    owners.hold(RUN, execution("first"))
    acting = owners.share_acting(RUN)
    with pytest.raises(StillActing):
        owners.take_over(RUN, execution("reset-1"), "first", "reset", wait_seconds=0.2)
    acting.close()
    again = owners.share_acting(RUN)
    assert again is not None
    again.close()
