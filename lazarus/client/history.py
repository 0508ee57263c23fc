"""Reading a run's Temporal histories for what they cost: events per incident and payload bytes
(bench/controller_scale.py, bench/large_run.py, the long-run workflow test)."""

from __future__ import annotations

import json

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client


async def chain_histories(client: Client, workflow_id: str, first_run_id: str | None = None) -> list[list]:
    """The history events of every workflow run of a chain of continues-as-new, oldest first."""
    histories, run_id = [], first_run_id
    while True:
        history = client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history_events()
        events = [event async for event in history]
        histories.append(events)
        moved = [e for e in events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW]
        if not moved:
            return histories
        run_id = moved[0].workflow_execution_continued_as_new_event_attributes.new_execution_run_id


def _activity_names(events) -> dict[int, str]:
    return {
        e.event_id: e.activity_task_scheduled_event_attributes.activity_type.name
        for e in events
        if e.HasField("activity_task_scheduled_event_attributes")
    }


def incident_spans(events) -> list[int]:
    """Events of each incident in one history: from the completion of the detect that reported its
    fault through its resume's completion, inclusive (a detect that ends with no resume after it
    reported progress or completion, and is not counted)."""
    names = _activity_names(events)
    spans, opened = [], None
    for index, event in enumerate(events):
        if not event.HasField("activity_task_completed_event_attributes"):
            continue
        name = names[event.activity_task_completed_event_attributes.scheduled_event_id]
        if name == "detect":
            opened = index
        elif name == "resume" and opened is not None:
            spans.append(index - opened + 1)
            opened = None
    return spans


def largest_payloads(events) -> dict[str, int]:
    """The largest payload (bytes) of each kind in one history: `<activity> input`, `<activity>
    result`, `workflow input` (a continue-as-new's carried status), `workflow result`."""
    names = _activity_names(events)
    largest: dict[str, int] = {}

    def saw(label: str, payloads) -> None:
        for payload in payloads.payloads:
            largest[label] = max(largest.get(label, 0), payload.ByteSize())

    for event in events:
        if event.HasField("workflow_execution_started_event_attributes"):
            saw("workflow input", event.workflow_execution_started_event_attributes.input)
        elif event.HasField("workflow_execution_continued_as_new_event_attributes"):
            saw("workflow input", event.workflow_execution_continued_as_new_event_attributes.input)
        elif event.HasField("workflow_execution_completed_event_attributes"):
            saw("workflow result", event.workflow_execution_completed_event_attributes.result)
        elif event.HasField("activity_task_scheduled_event_attributes"):
            attributes = event.activity_task_scheduled_event_attributes
            saw(f"{attributes.activity_type.name} input", attributes.input)
        elif event.HasField("activity_task_completed_event_attributes"):
            attributes = event.activity_task_completed_event_attributes
            saw(f"{names[attributes.scheduled_event_id]} result", attributes.result)
    return largest


def local_activity_type(event) -> str | None:
    """The activity type of a local activity's marker (workflows/stage_calls.py: drain, reschedule,
    replace_or_reshard run as local activities); None for any other event."""
    if not event.HasField("marker_recorded_event_attributes"):
        return None
    data = event.marker_recorded_event_attributes.details.get("data")
    if data is None or not data.payloads:
        return None
    return json.loads(data.payloads[0].data).get("activity_type")
