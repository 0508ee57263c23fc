"""How `lazarus worker` serves its task queue's workers until a signal (lazarus/worker.py serve_until):
a worker still starting against a server that is gone is cancelled, not waited for; one that
fails first ends the others and its error is raised."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from lazarus.worker import QueueWorkers, serve_until


class StartingWorker:
    """A worker still checking its namespace with a server that stopped answering: its run() waits
    until cancelled (the SDK's retries run for many seconds)."""

    is_running = False

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = False
        self.shut_down = False

    async def run(self) -> None:
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise

    async def shutdown(self) -> None:
        self.shut_down = True  # waits for the namespace check in the SDK: never for a worker still starting


class ServingWorker:
    """A worker that polls until shut down."""

    def __init__(self) -> None:
        self.is_running = False
        self.started = asyncio.Event()
        self._shutdown = asyncio.Event()

    async def run(self) -> None:
        self.is_running = True
        self.started.set()
        await self._shutdown.wait()
        self.is_running = False

    async def shutdown(self) -> None:
        self._shutdown.set()


class FailingWorker:
    """A worker whose namespace check failed: its server never answered."""

    is_running = False

    async def run(self) -> None:
        raise RuntimeError("Failed validating namespace")

    async def shutdown(self) -> None:
        raise AssertionError("a worker that never started is not shut down")


def workers(*fakes: Any) -> QueueWorkers:
    return QueueWorkers(*cast(Any, fakes))


async def test_a_signal_while_a_worker_still_starts_cancels_it_and_shuts_the_other_down():
    starting, serving = StartingWorker(), ServingWorker()
    stop = asyncio.Event()
    served = asyncio.ensure_future(serve_until(stop, workers(serving, starting)))
    await asyncio.wait_for(asyncio.gather(starting.started.wait(), serving.started.wait()), 10)
    stop.set()
    await asyncio.wait_for(served, 10)
    assert starting.cancelled and not starting.shut_down
    assert not serving.is_running


async def test_a_worker_that_fails_first_ends_the_others_and_its_error_is_raised():
    serving = ServingWorker()
    with pytest.raises(RuntimeError, match="Failed validating namespace"):
        await asyncio.wait_for(serve_until(asyncio.Event(), workers(serving, FailingWorker())), 10)
    assert serving.started.is_set() and not serving.is_running
