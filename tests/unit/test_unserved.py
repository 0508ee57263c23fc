"""The controls' handling of a run no worker serves (lazarus/commands/unserved.py), where an end-to-end
test cannot time it: a worker that goes while its request is carried out, and aborts that cannot
stop the run's processes from this machine, refused without ending the workflow."""

from __future__ import annotations

import asyncio
from argparse import Namespace

import pytest

from lazarus.client.config import Settings
from lazarus.commands import unserved
from lazarus.commands.common import UserError


class FakeUpdate:
    """An accepted update whose answer comes when `answer` is set (never, if it is not)."""

    def __init__(self):
        self.answer = asyncio.get_running_loop().create_future()
        self.waits = 0

    async def result(self):
        self.waits += 1
        return await self.answer


class FakeHandle:
    def __init__(self, terminated: list[str]):
        self.terminated = terminated

    async def terminate(self, reason: str):
        self.terminated.append(reason)


class FakeClient:
    """A client that records the workflows it terminates."""

    def __init__(self):
        self.terminated: list[str] = []

    def get_workflow_handle(self, run_id: str):
        return FakeHandle(self.terminated)


@pytest.fixture
def worker(monkeypatch):
    """worker["why"]: what why_unserved says (None: a worker serves the run); checks are counted."""
    state = {"why": None, "checks": 0}

    async def why_unserved(client, run_id, task_queue):
        state["checks"] += 1
        return state["why"]

    monkeypatch.setattr(unserved, "why_unserved", why_unserved)
    monkeypatch.setattr(unserved, "WATCH_SECONDS", 0.01)
    return state


async def test_an_answer_is_awaited_while_a_worker_serves_the_run(worker):
    update = FakeUpdate()
    asyncio.get_running_loop().call_later(0.1, update.answer.set_result, "paused")
    assert await unserved.carried_out(update, FakeClient(), "r1", "q") == ("paused", "")
    assert worker["checks"] >= 1, "the worker was checked on while the answer was awaited"


async def test_a_worker_that_goes_before_answering_ends_the_wait(worker):
    update = FakeUpdate()
    worker["why"] = "no worker on task queue 'q' answered its status query"
    assert await unserved.carried_out(update, FakeClient(), "r1", "q") == (None, worker["why"])
    await asyncio.sleep(0)
    assert update.answer.cancelled(), "no wait on the update is left behind"


def abort_args() -> Namespace:
    return Namespace(run_id="r1", reason="", update="abort", run_command="abort")


async def test_an_abort_that_cannot_stop_kubernetes_ranks_is_refused_and_ends_nothing(tmp_path):
    client = FakeClient()
    with pytest.raises(UserError, match="only a worker stops its kubernetes ranks; start one with"):
        await unserved.abort_here(
            client, Settings(home=tmp_path), abort_args(), ("kubernetes", True), "gone", "start one with ..."
        )
    assert client.terminated == []


async def test_an_abort_of_a_local_run_kept_elsewhere_is_refused_and_ends_nothing(tmp_path):
    client = FakeClient()
    with pytest.raises(UserError, match=r"its run directory is not under LAZARUS_HOME"):
        await unserved.abort_here(client, Settings(home=tmp_path), abort_args(), ("local", True), "gone", "hint")
    assert client.terminated == []


async def test_an_abort_of_a_run_that_launched_nothing_terminates_its_workflow(tmp_path):
    client = FakeClient()
    line = await unserved.abort_here(
        client, Settings(home=tmp_path), abort_args(), ("kubernetes", False), "no poller", "hint"
    )
    assert line == "aborted run r1: no worker had taken it up (no poller), so its workflow was terminated"
    assert len(client.terminated) == 1 and "no worker serving the run" in client.terminated[0]


def test_the_hint_names_the_task_queue_and_the_backend():
    assert unserved.start_worker_hint("q1", "local") == "start one with `LAZARUS_TASK_QUEUE=q1 lazarus worker`"
    assert unserved.start_worker_hint("q1", "kubernetes").endswith("lazarus worker --backend kubernetes`")
    assert (
        unserved.start_worker_hint("q1", "slurm")
        == "start one with `LAZARUS_TASK_QUEUE=q1 lazarus worker --backend slurm`"
    )


def test_the_status_query_waits_as_long_as_lazarus_query_seconds_says(capsys):
    from lazarus.client.reading import QUERY_SECONDS, query_seconds

    assert query_seconds({}) == QUERY_SECONDS
    assert query_seconds({"LAZARUS_QUERY_SECONDS": "0.5"}) == 0.5
    assert capsys.readouterr().err == ""
    assert query_seconds({"LAZARUS_QUERY_SECONDS": "soon"}) == QUERY_SECONDS
    assert query_seconds({"LAZARUS_QUERY_SECONDS": "-1"}) == QUERY_SECONDS
    said = capsys.readouterr().err.splitlines()
    assert said[0] == "lazarus: LAZARUS_QUERY_SECONDS='soon' is not a positive number of seconds; waiting 3 s"
    assert len(said) == 2
