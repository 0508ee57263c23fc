"""Raw updates, signals and starts of every wrong shape, sent with the plain Temporal client (not
the CLI, which checks first): each update is refused in one line naming the problem, each bad
signal is dropped, a bad start fails the run cleanly; no workflow task ever fails, and the run
still answers its status query and takes a well-formed update afterwards.

Hypothesis drives plain (sync) tests, one update per example, against one run on a dev server of
the module's own, served by an event loop in a thread of its own.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import uuid
import warnings
from contextlib import AsyncExitStack
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from temporalio.client import WorkflowFailureError, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError

from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.infra.harness.temporal_server import local_environment
from lazarus.schema import RunState, RunStatus, controls
from lazarus.schema.controls import LEGACY_DEFAULTS, FaultSignal
from lazarus.worker import build_worker
from lazarus.workflows.training_run import TrainingRun
from tests.workflow.fakes import ACTIVE, FakeStages, fake_worker, make_spec

pytestmark = pytest.mark.timeout(200)

VALID = {
    "pause": {"reason": "r"},
    "resume": {"reason": "r"},
    "abort": {"reason": "r"},
    "drain_node": {"node": "node-1", "reason": ""},
    "return_node": {"node": "node-1"},
    "reshard": {"dp": 2},
    "approve": {"action": "wait_longer", "wait_seconds": 5.0},
    "set_policy": {"changes": {"hang_after_seconds": 60}},
}
"""Each update's fields, well formed; the strategies break one thing in them."""

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=5,
)
NOT_A_MAPPING = st.lists(JSON, max_size=3) | st.text(max_size=10) | st.integers() | st.none() | st.binary(max_size=8)
# Values no field's type coerces: pydantic turns "5" into an int and 5 into a float, never these.
NO_SCALAR = st.none() | st.lists(JSON, max_size=2) | st.dictionaries(st.text(max_size=4), JSON, max_size=2)
NOT_A_NODE = st.sampled_from(["", ".", "..", "a/b", "../x", "a b", "a\nb", "n" * 300])


def broken_field(update: str, field: str) -> st.SearchStrategy:
    """Values `field` of `update` refuses."""
    if field == "changes":
        return st.none() | st.lists(JSON, max_size=2) | st.text(max_size=8) | st.integers()
    if field == "node":
        return NO_SCALAR | st.integers() | NOT_A_NODE
    if field == "action":
        return NO_SCALAR | st.text(max_size=8).filter(lambda a: a not in ("wait_longer", "reshard_below_minimum"))
    if field in ("dp", "wait_seconds"):
        return NO_SCALAR | st.sampled_from([2.5, "two", "", "nan"])
    return NO_SCALAR | st.integers() | st.floats() | st.booleans()


@st.composite
def bad_updates(draw) -> tuple[str, Any]:
    """An update's name and a payload it must refuse: a field of the wrong type, an unknown field, or no mapping."""
    update = draw(st.sampled_from(sorted(VALID)))
    fields = dict(VALID[update])
    how = draw(st.sampled_from(["field", "unknown", "mapping"]))
    if how == "mapping":
        return update, draw(NOT_A_MAPPING)
    if how == "unknown":
        known = set(fields) | set(LEGACY_DEFAULTS)  # a legacy field at its default is dropped, as in old histories
        fields[draw(st.text(min_size=1, max_size=10).filter(lambda key: key not in known))] = draw(JSON)
        return update, fields
    field = draw(st.sampled_from(sorted(fields)))
    fields[field] = draw(broken_field(update, field))
    return update, fields


BAD_SIGNALS = (
    NOT_A_MAPPING
    | st.fixed_dictionaries({"nodes": NO_SCALAR | st.text(max_size=5) | st.just([])})
    # Not times: pydantic reads a number, or a string of digits, as seconds since the epoch.
    | st.fixed_dictionaries({"nodes": st.just(["node-1"]), "occurred_at": st.sampled_from(["", "noon", "2026-13-01"])})
    | st.fixed_dictionaries({"nodes": st.just(["node-1"]), "reason": NO_SCALAR | st.integers()})
    | st.fixed_dictionaries({"nodes": st.just(["node-1"]), "bogus": JSON})
    # Well formed, but naming no node of the run: recorded, then ignored.
    | st.fixed_dictionaries({"nodes": st.lists(st.text(max_size=6).filter(lambda n: n not in ACTIVE), min_size=1)})
)


class LoopThread:
    """An event loop in a thread of its own: the module's server, worker and client live there,
    and each (sync) hypothesis example hands it a coroutine to run."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine, timeout: float = 60):
        """Run `coroutine` on the loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        """Stop the loop and its thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


class Served:
    """A dev server with a TrainingRun over the fakes, watching (its detect blocks until cancelled)."""

    def __init__(self, loop: LoopThread):
        self.loop = loop
        self.stack = AsyncExitStack()

    async def start(self) -> None:
        self.env = await local_environment()
        self.stack.push_async_callback(self.env.shutdown)
        self.handle = await self.start_run(FakeStages(watch=["block"]))
        await until_state(self.handle, RunState.TRAINING)

    async def start_run(self, stages: FakeStages) -> WorkflowHandle:
        """A TrainingRun on a worker (and task queue) of its own; terminated at the module's end."""
        queue = f"fuzz-{uuid.uuid4()}"
        await self.stack.enter_async_context(fake_worker(self.env, stages, queue))
        handle = await self.env.client.start_workflow(
            TrainingRun.run, {"spec": make_spec().model_dump(mode="json")}, id=queue, task_queue=queue
        )
        self.stack.push_async_callback(terminate, handle)
        return handle


async def terminate(handle: WorkflowHandle) -> None:
    """End the run unless it already ended."""
    if (await handle.describe()).status.name == "RUNNING":
        await handle.terminate("test over")


async def until_state(handle: WorkflowHandle, state: RunState) -> RunStatus:
    """Query until the run is in `state` (the workflow moves on its own)."""
    for _ in range(2000):
        status = await handle.query(TrainingRun.status)
        if status.state == state:
            return status
        await asyncio.sleep(0.01)
    raise AssertionError(f"run never reached {state}; it is {status.state}")


async def task_failures(handle: WorkflowHandle) -> list[str]:
    """The messages of the workflow task failures in the run's history."""
    history = await handle.fetch_history()
    return [
        e.workflow_task_failed_event_attributes.failure.message
        for e in history.events
        if e.HasField("workflow_task_failed_event_attributes")
    ]


async def refusal(handle: WorkflowHandle, update: str, payload: Any) -> str:
    """What the workflow said refusing `payload` for `update` (AssertionError if it took it)."""
    try:
        await handle.execute_update(update, payload)
    except WorkflowUpdateFailedError as failed:
        assert isinstance(failed.cause, ApplicationError), failed.cause
        return failed.cause.message
    raise AssertionError(f"{update} accepted {payload!r}")


@pytest.fixture(scope="module")
def served():
    """The module's server and run, stopped at its end."""
    loop = LoopThread()
    served = Served(loop)
    try:
        loop.run(served.start())
        yield served
    finally:
        loop.run(served.stack.aclose())
        loop.close()


FOUND_VALUE = {"": None, "000\x1f": -8.796518564250401e-277, "\x86": 1.8461232608450708e16, "æ": None}


def assert_one_line(message: str) -> None:
    """A refusal's message is one short line."""
    assert message and "\n" not in message and len(message) < 400, message


@settings(max_examples=100)
@given(bad_updates())
@example(("pause", {"reason": 5, "bogus": 1}))
@example(("pause", ["reason"]))
@example(("pause", None))
@example(("abort", b"\x00"))
@example(("resume", {"reason": "x" * 200_000, "bogus": 1}))
@example(("drain_node", {"node": "../../x"}))
@example(("reshard", {"dp": "two"}))
@example(("approve", {"action": "wait_longer", "wait_seconds": "forever"}))
@example(("set_policy", {"changes": [("hang_after_seconds", 60)]}))
# Found by hypothesis: escaped keys made the refusal's repr of the input 401 characters long.
@example(("abort", [{"\x04\U000addce\U0010f8fd": None, "\U0009831eB": None, "\U0009ee96:Ü¬z": FOUND_VALUE}] * 2))
def test_an_update_of_the_wrong_shape_is_refused_in_one_line(served, case):
    update, payload = case
    message = served.loop.run(refusal(served.handle, update, payload))
    assert_one_line(message)
    assert served.loop.run(task_failures(served.handle)) == []


@pytest.mark.parametrize(
    ("update", "payload", "said"),
    [
        ("pause", {"reason": 5}, "PauseRequest: reason: must be a valid string (got 5)"),
        ("pause", None, "pause takes a PauseRequest (a mapping of its fields), not NoneType"),
        ("drain_node", {"node": "a/b"}, "DrainNodeRequest: node: 'a/b' is not a node name"),
        ("drain_node", {"node": "node-9"}, "node-9 is not a node of the run's current assignment"),
        ("return_node", {"node": "node-1"}, "node-1 is not quarantined by this run"),
        ("reshard", {"dp": 99}, "reshard needs dp between 1 and the spec's layout.dp 4"),
        ("approve", {"action": "wait_longer"}, "nothing is waiting for approval"),
        ("set_policy", {"changes": {}}, "set_policy needs changes"),
        ("set_policy", {"changes": {"stages": 5}}, "recovery.stages: Input should be"),
        ("set_policy", {"changes": {"approval_wait_seconds": 1e308}}, "recovery.approval_wait_seconds: Input should"),
        (
            "set_policy",
            {"changes": {"stages": {"drain": {"timeout_seconds": 1e12}}}},
            "recovery.stages.drain.timeout_seconds: Input",
        ),
        (
            "set_policy",
            {"changes": {"stages": {"detect": {"max_attempts": 2**31}}}},
            "recovery.stages.detect.max_attempts: Input",
        ),
        ("no_such_update", {}, "Update handler for 'no_such_update' expected but not found"),
    ],
)
def test_each_refusal_names_the_problem(served, update, payload, said):
    message = served.loop.run(refusal(served.handle, update, payload))
    assert_one_line(message)
    assert message.startswith(said), message


@settings(max_examples=60)
@given(st.sampled_from(["report_fault", "no_such_signal"]), BAD_SIGNALS)
@example("report_fault", None)
@example("report_fault", b"garbage")
@example("report_fault", {"nodes": "node-1"})
@example("report_fault", {"nodes": ["node-1"], "occurred_at": "yesterday"})
def test_a_bad_signal_is_dropped_and_the_run_goes_on(served, name, payload):
    async def signal_then_ask() -> tuple[RunStatus, RunStatus]:
        before = await served.handle.query(TrainingRun.status)
        await served.handle.signal(name, payload)
        return before, await served.handle.query(TrainingRun.status)  # answered after the signal's task

    before, after = served.loop.run(signal_then_ask())
    assert after.state == RunState.TRAINING and len(after.incidents) == len(before.incidents) == 0
    assert served.loop.run(task_failures(served.handle)) == []


def test_after_all_that_the_run_answers_and_takes_a_good_update(served):
    async def good_update():
        return await served.handle.execute_update(
            TrainingRun.set_policy, controls.SetPolicyRequest(changes={"hang_after_seconds": 45})
        )

    answer = served.loop.run(good_update())
    assert answer.message == "policy updated" and answer.state == "TRAINING"
    status = served.loop.run(served.handle.query(TrainingRun.status))
    assert status.policy.hang_after_seconds == 45 and [i.kind for i in status.interventions] == ["set_policy"]
    assert served.loop.run(task_failures(served.handle)) == []


def test_a_fault_report_without_a_time_zone_is_taken_as_utc(served):
    """A naive occurred_at once failed the workflow task at the drain (aware minus naive)."""

    async def report_and_recover() -> RunStatus:
        handle = await served.start_run(FakeStages(watch=["block", "block"]))
        await until_state(handle, RunState.TRAINING)
        signal = {"nodes": ["node-2", "node-99"], "reason": "x" * 5000, "occurred_at": "2026-01-01T00:00:00"}
        await handle.signal(TrainingRun.report_fault, signal)
        for _ in range(2000):
            status = await handle.query(TrainingRun.status)
            if status.incidents and status.incidents[0].outcome == "recovered":
                break
            await asyncio.sleep(0.01)
        assert await task_failures(handle) == []
        return status

    status = served.loop.run(report_and_recover())
    [incident] = status.incidents
    assert incident.fault.nodes == ["node-2"] and incident.fault.occurred_at.tzinfo is not None
    assert incident.fault.reason.endswith("... (4000 more characters)") and incident.outcome == "recovered"
    assert len(FaultSignal(nodes=["n"], reason="y" * 5000).reason) < 1100


@pytest.mark.parametrize(
    ("start", "said"),
    [
        ({"run_id": "../../x", "spec": {"name": "x"}}, "RunStart: run_id: '../../x' is not a run id"),
        ({"run_id": "ok", "spec": {"name": "x", "layout": {"dp": 3}}}, "RunStart: spec: layout: dp*pp*dp_shard*tp = 3"),
        ({"run_id": "ok"}, "RunStart: spec: required field is missing"),
        ([1, 2], "RunStart: input: must be a valid dictionary"),
        (None, "TrainingRun takes a RunStart, not NoneType"),
        # A run's id is its workflow id: another id would let two workflows drive one run.
        (
            {"run_id": "other-run", "spec": {"name": "x"}},
            "the input's run_id 'other-run' is not the workflow id 'start-",
        ),
    ],
)
def test_a_bad_start_fails_the_run_cleanly_and_writes_nothing(served, tmp_path, start, said):
    home = tmp_path / "home"

    async def start_and_wait():
        queue = f"start-{uuid.uuid4()}"
        async with build_worker(served.env.client, queue, LocalCluster(home)):
            handle = await served.env.client.start_workflow("TrainingRun", start, id=queue, task_queue=queue)
            with pytest.raises(WorkflowFailureError) as failed:
                await asyncio.wait_for(handle.result(), 30)
            return failed.value.cause, await task_failures(handle)

    cause, failures = served.loop.run(start_and_wait())
    with warnings.catch_warnings():
        # The SDK made the run's coroutine before __init__ refused the input; collect it here, not
        # in whichever test happens to run the collector next.
        warnings.filterwarnings("ignore", "coroutine .* was never awaited", RuntimeWarning)
        gc.collect()
    assert isinstance(cause, ApplicationError) and cause.type == "InvalidInput" and cause.non_retryable
    assert cause.message.startswith(said) and "\n" not in cause.message
    assert failures == []
    assert not home.exists() and list(tmp_path.iterdir()) == []
