"""Many API calls at once within a client rate: the claims of a run's nodes, its rank pods' creation
and deletion. A run of 2,048 nodes makes thousands of such calls per launch and drain; one after
another they take minutes, all at once they would flood the API server. client-go bounds a
client by a token bucket (QPS, burst); so does this, every request of the backend's client, and a
few threads keep the calls in flight.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

CLIENT_QPS, CLIENT_BURST = 100.0, 200
"""The backend's client rate: requests a second, and at most this many at once (client-go's QPS and
burst; `lazarus worker --kube-qps/--kube-burst`). Launching or draining a run of thousands of
nodes makes a few requests per node."""

CALLS_IN_FLIGHT = 8
"""Threads that make the calls of one fan-out: the kubernetes client's connection pool keeps
about this many connections (5 per core), and more threads would open and drop connections."""


class TokenBucket:
    """At most `burst` calls at once, then `qps` a second, as client-go's flowcontrol allows."""

    def __init__(self, qps: float, burst: int, clock=time.monotonic, sleep=time.sleep):
        self.qps, self.burst = qps, burst
        self._clock, self._sleep = clock, sleep
        self._tokens = float(burst)
        self._at = clock()
        self._guard = threading.Lock()

    def take(self) -> None:
        """Take a token, waiting until it is due: each caller reserves the next one, so callers
        waiting together leave one 1/qps after another."""
        with self._guard:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.qps)
            self._at = now
            self._tokens -= 1
            wait = -self._tokens / self.qps
        if wait > 0:
            self._sleep(wait)


def throttle(api, qps: float, burst: int) -> TokenBucket:
    """Make every request of the kubernetes ApiClient `api` take a token of a new bucket first
    (its one funnel, the REST client's request: a watch takes one per connection); returns the bucket."""
    bucket = TokenBucket(qps, burst)
    request = api.rest_client.request

    def paced(*args, **kwargs):
        bucket.take()
        return request(*args, **kwargs)

    api.rest_client.request = paced
    return bucket


def fan_out(calls: list[Callable[[], T]]) -> list[T]:
    """Make every call, CALLS_IN_FLIGHT at a time; their results in order. The first call that
    raises is raised, once the others are done."""
    if len(calls) <= 1:
        return [call() for call in calls]
    with ThreadPoolExecutor(max_workers=min(CALLS_IN_FLIGHT, len(calls)), thread_name_prefix="k8s-call") as pool:
        futures = [pool.submit(call) for call in calls]
    return [future.result() for future in futures]
