"""Histories recorded from real runs replay against today's TrainingRun (determinism)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from temporalio import workflow
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer
from temporalio.workflow import NondeterminismError

from lazarus.schema import RunStart, RunStatus
from lazarus.workflows.training_run import TrainingRun

HISTORIES = sorted((Path(__file__).resolve().parents[1] / "histories").glob("*.json"))


def test_histories_are_committed():
    assert {path.stem for path in HISTORIES} >= {
        "hot_spare",
        "reshard",
        "no_capacity",
        "clean",
        "override",
        "escalation",
        "story",
        "rack",
    }


@pytest.mark.parametrize("path", HISTORIES, ids=lambda p: p.stem)
async def test_history_replays(path):
    text = path.read_text()
    events = json.loads(text)["events"]
    activity_types = [
        e["activityTaskScheduledEventAttributes"]["activityType"]["name"]
        for e in events
        if "activityTaskScheduledEventAttributes" in e
    ]
    assert {"launch", "detect"} <= set(activity_types)
    replayer = Replayer(workflows=[TrainingRun], data_converter=pydantic_data_converter)
    result = await replayer.replay_workflow(WorkflowHistory.from_json(path.stem, text), raise_on_replay_failure=True)
    assert result.replay_failure is None


@workflow.defn(name="TrainingRun", sandboxed=False)
class ChangedTrainingRun(TrainingRun):
    """TrainingRun with a deliberate, ungated change: a timer before every drain."""

    @workflow.init
    def __init__(self, start: RunStart) -> None:
        super().__init__(start)

    @workflow.run
    async def run(self, start: RunStart) -> RunStatus:
        return await super().run(start)

    async def _drain(self, incident, fault):
        await workflow.sleep(1)
        await super()._drain(incident, fault)


async def test_an_ungated_change_fails_the_replay():
    path = next(p for p in HISTORIES if p.stem == "hot_spare")
    replayer = Replayer(workflows=[ChangedTrainingRun], data_converter=pydantic_data_converter)
    with pytest.raises(NondeterminismError):
        await replayer.replay_workflow(WorkflowHistory.from_json("hot_spare", path.read_text()))
