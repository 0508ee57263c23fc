"""One watcher per worker process of the deaths the pool records, for the watches of backends whose
nodes die without a process of the controller's host ending (the simulated nodes; a node an
operator or a health agent marks dead): a watch waiting between two looks wakes as soon as one of
its run's nodes dies, as a local run's wakes at a process's exit, however seldom it looks.

It asks the store at most every DEATHS_POLL_SECONDS, and only while a watch waits; with SQLite
only when the pool changed. One question serves every run the worker watches.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from datetime import UTC, datetime, timedelta

from lazarus.infra.pool import NodePool

DEATHS_POLL_SECONDS = 0.05
"""How often the pool's new deaths are read while a watch waits (seconds)."""

RECENT_SECONDS = 1.0
"""A death this recent when a watch starts to wait wakes it at once (seconds): the look before the
wait may have read the pool just before it. Older ones the look saw (or was bound to see)."""


class PoolDeaths:
    """Wakes the watches whose nodes die (`wait`)."""

    def __init__(self, pool: NodePool):
        self.pool = pool
        self._waiting: dict[asyncio.Future, frozenset[str]] = {}
        self._deaths: dict[str, float] = {}  # node -> when it died (seconds since the epoch), the recent ones
        self._read_from = datetime.now(UTC)
        self._version: object = None
        self._poller: asyncio.Task | None = None

    async def wait(self, nodes: Collection[str], timeout: float) -> bool:
        """True as soon as one of `nodes` dies (or died within RECENT_SECONDS), False after `timeout`."""
        recent = time.time() - RECENT_SECONDS
        if any(self._deaths.get(node, 0.0) >= recent for node in nodes):
            return True
        loop = asyncio.get_running_loop()
        woken = loop.create_future()
        self._waiting[woken] = frozenset(nodes)
        timer = loop.call_later(timeout, lambda: woken.done() or woken.set_result(False))
        if self._poller is None or self._poller.done():
            self._poller = asyncio.ensure_future(self._poll())
        try:
            return await woken
        finally:
            timer.cancel()
            self._waiting.pop(woken, None)

    async def _poll(self) -> None:
        while self._waiting:
            await asyncio.sleep(DEATHS_POLL_SECONDS)
            version = self.pool.store.version()
            if version is not None and version == self._version:
                continue
            self._version = version
            since = self._read_from
            self._read_from = datetime.now(UTC) - timedelta(seconds=RECENT_SECONDS)
            died = await asyncio.to_thread(self.pool.died_since, since)
            now = time.time()
            self._deaths = {n: at for n, at in self._deaths.items() if at >= now - 2 * RECENT_SECONDS}
            self._deaths.update({node: at.timestamp() for node, at in died.items()})
            for woken, nodes in list(self._waiting.items()):
                if not woken.done() and any(node in died for node in nodes):
                    woken.set_result(True)
