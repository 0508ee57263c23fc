"""A rack's gather inside the reschedule activity, for executions from before the workflow gathered
on its own timer (workflows/rescheduling.py: GATHER_PATCH); theirs asks for gather_seconds > 0."""

from __future__ import annotations

import asyncio
import time

from temporalio import activity

from lazarus.activities.running import in_thread
from lazarus.infra.backend import ClusterBackend
from lazarus.schema.records import Inventory
from lazarus.schema.stages import RescheduleInput

GATHER_POLL_SECONDS = 0.2
"""How often reschedule reads the inventory again while runs hit by the same fault domain drain (seconds)."""


async def gathered(cluster: ClusterBackend, request: RescheduleInput) -> Inventory:
    """The run's inventory once the runs hit with it in its fault domain have drained: read again
    until none of them drained for request.gather_seconds, at most half the activity's timeout."""
    inventory = await in_thread(cluster.inventory, request.run_id)
    started = time.monotonic()
    last_drain, undrained = started, _undrained(inventory)
    give_up = started + _gather_bound(request.gather_seconds)
    while undrained and time.monotonic() - last_drain < request.gather_seconds and time.monotonic() < give_up:
        await asyncio.sleep(GATHER_POLL_SECONDS)
        inventory = await in_thread(cluster.inventory, request.run_id)
        if (now_undrained := _undrained(inventory)) < undrained:
            last_drain = time.monotonic()
        undrained = now_undrained
    return inventory


def _undrained(inventory: Inventory) -> int:
    """How many other runs hit with this one have not drained yet."""
    return len(inventory.shared.undrained) if inventory.shared else 0


def _gather_bound(gather_seconds: float) -> float:
    """The longest a gather may last, however steadily the others drain: half the activity's own
    timeout, so that the wait never times the stage out (seconds)."""
    timeout = activity.info().start_to_close_timeout
    return max(gather_seconds, timeout.total_seconds() / 2) if timeout else gather_seconds
