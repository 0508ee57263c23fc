"""Histories recorded from real runs replay against today's TrainingRun (determinism)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from workflows.training_run import TrainingRun

HISTORIES = sorted((Path(__file__).resolve().parents[1] / "histories").glob("*.json"))


def test_histories_are_committed():
    assert {path.stem for path in HISTORIES} >= {"hot_spare", "no_spare", "reshard", "no_capacity"}


@pytest.mark.parametrize("path", HISTORIES, ids=lambda p: p.stem)
async def test_history_replays(path):
    text = path.read_text()
    events = json.loads(text)["events"]
    activity_types = [e["activityTaskScheduledEventAttributes"]["activityType"]["name"]
                      for e in events if "activityTaskScheduledEventAttributes" in e]
    assert {"launch", "detect", "drain", "reschedule"} <= set(activity_types)
    replayer = Replayer(workflows=[TrainingRun], data_converter=pydantic_data_converter)
    result = await replayer.replay_workflow(WorkflowHistory.from_json(path.stem, text), raise_on_replay_failure=True)
    assert result.replay_failure is None
