"""What wakes a run's detect on Kubernetes: one watch of a pool's nodes and one of a namespace's rank
pods (infra/backends/kubernetes/informer.py), shared by every run a worker drives.

A node of a run turning not ready or deleted, or a pod of a run ending or deleted, counts as a
change of that run and wakes its waiters at once; a change that came while the run was looking
(not waiting) wakes its next wait at once. Looks at a run read nodes and pods from the watches'
caches, so N runs cost the API server two watches instead of 2N lists per heartbeat interval.
"""

from __future__ import annotations

import asyncio
import threading

from kubernetes import client as k8s

from lazarus.infra.backends.kubernetes.informer import Informer
from lazarus.infra.backends.kubernetes.objects import (
    POOL_LABEL,
    RUN_LABEL,
    labels_of,
    node_ready,
    pod_running,
    run_label,
)


class RunWatches:
    """The node and pod watches of one worker, and the runs waiting on them."""

    def __init__(self, core: k8s.CoreV1Api):
        self.core = core
        self._informers: dict[tuple[str, str], Informer] = {}
        self._lock = threading.Lock()
        self._changes: dict[str, int] = {}  # per run: node or pod events that call for a look
        self._seen: dict[str, int] = {}  # per run: the count its last wait returned at
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}

    def start(self, pool: str, namespace: str) -> None:
        """Start the watches of `pool`'s nodes and of `namespace`'s rank pods, unless they run."""
        self._informer("nodes", pool)
        self._informer("pods", namespace)

    def _informer(self, kind: str, scope: str) -> Informer:
        with self._lock:
            informer = self._informers.get((kind, scope))
            if informer is None:
                if kind == "nodes":
                    informer = Informer(
                        self.core.list_node, f"nodes-{scope}", self._node_event, label_selector=f"{POOL_LABEL}={scope}"
                    )
                else:
                    informer = Informer(
                        self.core.list_namespaced_pod,
                        f"pods-{scope}",
                        self._pod_event,
                        namespace=scope,
                        label_selector=RUN_LABEL,
                    )
                self._informers[(kind, scope)] = informer.start()
            return informer

    def _node_event(self, kind: str, node: k8s.V1Node) -> None:
        if kind == "DELETED" or not node_ready(node)[0]:
            self._changed(labels_of(node).get(RUN_LABEL))

    def _pod_event(self, kind: str, pod: k8s.V1Pod) -> None:
        if kind == "DELETED" or not pod_running(pod):
            self._changed(labels_of(pod).get(RUN_LABEL))

    def _changed(self, label: str | None) -> None:
        """Count an event that calls for a look at the run whose RUN_LABEL value is `label`, and
        wake its waiters (from an informer's thread)."""
        if label is None:
            return
        with self._lock:
            self._changes[label] = self._changes.get(label, 0) + 1
            waiters = list(self._waiters.get(label, ()))
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    def cached(self, kind: str, scope: str) -> dict | None:
        """The objects of a running, synced watch ("nodes" of a pool, "pods" of a namespace) by
        name, else None: the caller then lists (a hundred runs looking every second would
        otherwise cost the API server two hundred lists a second)."""
        with self._lock:
            informer = self._informers.get((kind, scope))
        return informer.objects() if informer is not None else None

    async def wait(self, run_id: str, timeout: float) -> bool:
        """Wait up to `timeout` seconds for a change of the run; True if one came (at once if one
        came since the last wait returned)."""
        loop, woken, key = asyncio.get_running_loop(), asyncio.Event(), run_label(run_id)
        with self._lock:
            if self._changes.get(key, 0) > self._seen.get(key, 0):
                self._seen[key] = self._changes[key]
                return True
            self._waiters.setdefault(key, []).append((loop, woken))
        try:
            await asyncio.wait_for(woken.wait(), timeout)
            return True
        except TimeoutError:
            return False
        finally:
            with self._lock:
                self._waiters[key].remove((loop, woken))
                if not self._waiters[key]:
                    del self._waiters[key]
                self._seen[key] = self._changes.get(key, 0)

    def close(self) -> None:
        """Stop the watches (the worker calls this on shutdown, through the backend's close)."""
        with self._lock:
            informers, self._informers = list(self._informers.values()), {}
        for informer in informers:
            informer.stop()
