"""The demo says every state a recovery passed, read from the workflow's record of the incident's
stages, though its poll of the status saw only some of them."""

from __future__ import annotations

import asyncio

from lazarus.commands import demo_run as demo
from lazarus.schema import RunState, load_spec
from tests.unit.test_cli_output import recovered_run


def test_the_states_an_incident_passed_come_from_its_stages_in_order():
    status = recovered_run()
    assert demo.passed_states(status) == [
        (1, RunState.DRAINING),
        (1, RunState.RESCHEDULING),
        (1, RunState.REPLACING),
        (1, RunState.RESUMING),
    ]
    status.incidents[0].decision.action = "reshard"
    assert demo.passed_states(status)[2] == (1, RunState.RESHARDING)


async def test_the_demo_says_states_its_poll_never_saw(monkeypatch, tmp_path):
    # The poll sees TRAINING, then RESUMING (draining to replacing took milliseconds), then the end.
    training = recovered_run().model_copy(update={"state": RunState.TRAINING, "incidents": []})
    resuming = recovered_run().model_copy(update={"state": RunState.RESUMING})
    done = recovered_run()
    polls = [training, resuming, done]
    result: asyncio.Future = asyncio.get_running_loop().create_future()

    async def run_status(client, run_id):
        status = polls.pop(0)
        if not polls:
            result.set_result(status)
        return status

    monkeypatch.setattr(demo, "run_status", run_status)
    monkeypatch.setattr(demo, "last_metric", lambda run: None)
    said: list[str] = []
    spec = load_spec(demo.DEFAULT_SPEC)
    final = await demo._follow(None, None, spec, None, "r", result, None, said.append, None)
    assert final is done
    assert said == ["TRAINING", "DRAINING", "RESCHEDULING", "REPLACING", "RESUMING", "COMPLETED"]
