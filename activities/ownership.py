"""One run, one owner, on the activities' side: every activity acts only for the execution that
owns the run (schema/ownership.py), and `take_over` hands the run over and reads what the cluster
holds of it, so the new owner takes up the run where it stands instead of redoing its past."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import AsyncIterator

from temporalio.exceptions import ApplicationError

from lazarus.activities.running import THREADS_OF_STAGE, in_thread
from lazarus.infra.backend import ClusterBackend, ClusterError
from lazarus.infra.ownership import ACTING_POLL_SECONDS, NotOwner, start_acting
from lazarus.schema.contract import read_launch
from lazarus.schema.ownership import NOT_OWNER
from lazarus.schema.stages import RunRequest, TakeOverInput, TakeOverResult


def refused(error: NotOwner) -> ApplicationError:
    """The refusal the workflow sees: for good (retrying cannot make the caller the owner), with
    the owner record in its details."""
    return ApplicationError(str(error), error.record.model_dump(mode="json"), type=NOT_OWNER, non_retryable=True)


@contextlib.asynccontextmanager
async def acting_for_owner(cluster: ClusterBackend, request: RunRequest) -> AsyncIterator[None]:
    """Let the request's execution act on its run for the body's duration, or raise the NOT_OWNER
    refusal. Until the body ends no take-over can begin (infra/ownership.py: share_acting). A
    request that names no owner (an execution from before runs had owners) is let through."""
    if request.owner is None:
        yield
        return
    try:
        cluster.run_dir(request.run_id)
    except ClusterError as error:  # a run id that names no directory
        raise ApplicationError(str(error), type="UnknownRun", non_retryable=True) from None
    threads: list[threading.Event] = []
    token = THREADS_OF_STAGE.set(threads)
    acting = None
    try:
        try:
            while (acting := await in_thread(start_acting, cluster.owners, request.run_id, request.owner)) is None:
                await asyncio.sleep(ACTING_POLL_SECONDS)  # a take-over is being recorded
        except NotOwner as error:
            raise refused(error) from None
        yield
    finally:
        THREADS_OF_STAGE.reset(token)
        if acting is not None:
            _close_when_ended(acting, threads)


def _close_when_ended(acting, threads: list[threading.Event]) -> None:
    """End the stage's hold on the run once its threads have ended: a stage cancelled (its
    workflow reset or terminated) leaves a backend call running on in its thread."""
    running = [ended for ended in threads if not ended.is_set()]
    if not running:
        acting.close()
        return

    def close_after():
        for ended in running:
            ended.wait()
        acting.close()

    threading.Thread(target=close_after, name="acting-until-threads-end", daemon=True).start()


async def check_owner(cluster: ClusterBackend, request: RunRequest) -> None:
    """Return when the request's execution may act on its run (for a stage that only reads: the
    check, without holding off a take-over); else raise the NOT_OWNER refusal."""
    async with acting_for_owner(cluster, request):
        pass


def checked(method):
    """Run the activity only for the run's owner; for a stage that watches and does not act (detect),
    which would otherwise hold off a take-over for as long as it watches."""

    @functools.wraps(method)
    async def run(self, request):
        await check_owner(self.cluster, request)
        return await method(self, request)

    return run


def owned(method):
    """Run the activity only for the run's owner, and hold off any take-over while it acts."""

    @functools.wraps(method)
    async def run(self, request):
        async with acting_for_owner(self.cluster, request):
            return await method(self, request)

    return run


def take_over_run(cluster: ClusterBackend, request: TakeOverInput, wait_seconds: float) -> TakeOverResult:
    """Make the request's execution the run's owner, once no stage of the execution it replaces
    acts on the run (waiting up to `wait_seconds`), and read what the cluster holds: the newest
    incarnation (whether its ranks were started, whether the backend ended it, the newest step
    they reported), the quarantined nodes and the newest complete checkpoint."""
    run = cluster.run_dir(request.run_id)
    owner = request.owner
    assert owner is not None, "the take_over activity refuses a request without one"
    previous = request.previous
    if previous is None:  # an adoption takes the run from whoever holds it
        record = cluster.owners.read(request.run_id)
        previous = record.owner.execution if record is not None else owner.execution
    _, replaced = cluster.owners.take_over(request.run_id, owner, previous, request.kind, wait_seconds)
    result = TakeOverResult(previous_owner=replaced, run_dir=str(run.root))
    if not run.spec_file.exists():
        return result  # never launched: the new owner launches it
    incarnations = run.incarnations()
    inventory = cluster.inventory(request.run_id)
    result.quarantined = [node.name for node in inventory.nodes if node.role == "quarantined"]
    result.checkpoint_step = run.newest_checkpoint()[0]
    if not incarnations:
        return result
    newest = incarnations[-1]
    result.assignment = cluster.assignment(request.run_id, newest)
    result.launched = read_launch(run, newest) is not None
    if not result.launched and len(incarnations) > 1:
        _stop_the_one_before(cluster, request.run_id, incarnations[-2])
    result.ended = run.ended_file(newest).exists()
    result.stopped = run.stop_file(newest).exists()
    if result.launched and not result.ended:
        result.step = cluster.observe(request.run_id, newest).newest_step()
    return result


def _stop_the_one_before(cluster: ClusterBackend, run_id: str, incarnation: int) -> None:
    """The newest incarnation is claimed but not started; the one before it may still run: a regrow
    claims its nodes before it stops the ranks (workflows/regrow.py), and a recovery that keeps its
    survivors ends them only when they rejoin. The new owner starts the newest from what was saved,
    so the one before is stopped first: two incarnations never train at once."""
    run = cluster.run_dir(run_id)
    if read_launch(run, incarnation) is not None and not run.ended_file(incarnation).exists():
        cluster.stop_incarnation(run_id, incarnation)
