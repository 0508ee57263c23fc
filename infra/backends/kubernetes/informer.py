"""A watched cache of one kind of Kubernetes object: list once, then follow the watch stream.

The Kubernetes backend keeps one per node pool and one per namespace of rank pods, shared by
every run a worker drives, so that a node turning NotReady or a rank pod failing reaches the
runs it concerns within one event of the API server, and a hundred runs watching one pool cost
the API server one watch instead of a list per run per heartbeat.

The cache is trusted only while it is `synced`: after any error of the stream it is not,
until the next list has succeeded; callers then fall back to a list of their own. Nothing is
retried behind the caller's back (a watch with `timeout_seconds` has the client's own retry
turned off): a stream that ends or fails is listed again from scratch, a 410 Gone included.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar, cast

from kubernetes import client as k8s
from kubernetes import watch
from kubernetes.client.exceptions import ApiException

from lazarus.infra.backends.kubernetes.objects import meta, name_of

log = logging.getLogger(__name__)

WATCH_SECONDS = 240
"""How long the API server keeps one watch open before the informer renews it (seconds)."""

RETRY_SECONDS = 1.0
"""Pause before listing again after a failed list or a broken stream (seconds)."""


Obj = TypeVar("Obj", k8s.V1Node, k8s.V1Pod)


class Informer(Generic[Obj]):
    """Objects of one `list_*` call of the official client (with its selector), kept current by a thread.

    `on_event(kind, obj)` runs in the informer's thread for every ADDED, MODIFIED and DELETED
    event; it must be quick and must not block. A (re)list reports what changed since the cache
    it replaces, as the stream would have: new objects as ADDED, changed ones (another
    resourceVersion) as MODIFIED, vanished ones as DELETED. So a change that came while the
    stream was down, or in the moment between a stream's end and the next list, is not lost.
    """

    def __init__(self, list_objects: Callable, name: str, on_event: Callable[[str, Obj], None], **selector):
        self._list = list_objects
        self._selector = selector
        self._on_event = on_event
        self._objects: dict[str, Obj] = {}
        self._lock = threading.Lock()
        self._synced = threading.Event()
        self._stopped = threading.Event()
        self._watch: watch.Watch | None = None
        self._thread = threading.Thread(target=self._follow, name=f"informer-{name}", daemon=True)

    def start(self) -> Informer:
        self._thread.start()
        return self

    @property
    def synced(self) -> bool:
        """Whether the cache holds the API server's state (a list succeeded and its stream has not failed since)."""
        return self._synced.is_set()

    def wait_synced(self, timeout: float) -> bool:
        """Wait until the first list has filled the cache; False after `timeout` seconds."""
        return self._synced.wait(timeout)

    def objects(self) -> dict[str, Obj] | None:
        """A copy of the cache by name, or None while it is not synced."""
        with self._lock:
            return dict(self._objects) if self._synced.is_set() else None

    def stop(self) -> None:
        """End the stream (its socket is shut down, so a blocked read returns) and the thread."""
        self._stopped.set()
        current = self._watch
        if current is not None:
            current.stop()
        self._thread.join(10)

    def _follow(self) -> None:
        while not self._stopped.is_set():
            try:
                version = self._relist()
                while not self._stopped.is_set():
                    version = self._stream(version)
            except ApiException as error:
                self._synced.clear()
                if error.status == 410:  # the version followed is too old: list again at once
                    continue
                self._pause(error)
            except Exception as error:  # noqa: BLE001 - any failure: distrust the cache, list again
                self._synced.clear()
                self._pause(error)

    def _pause(self, error: Exception) -> None:
        if not self._stopped.is_set():
            log.warning("watch of %s failed (%s); listing again in %.0f s", self._thread.name, error, RETRY_SECONDS)
            self._stopped.wait(RETRY_SECONDS)

    def _relist(self) -> str | None:
        listed = self._list(**self._selector)
        current: dict[str, Obj] = {name_of(obj): obj for obj in listed.items}
        with self._lock:
            before, self._objects = self._objects, current
        self._synced.set()
        for name, obj in current.items():
            known = before.get(name)
            if known is None:
                self._on_event("ADDED", obj)
            elif meta(known).resource_version != meta(obj).resource_version:
                self._on_event("MODIFIED", obj)
        for name, obj in before.items():
            if name not in current:
                self._on_event("DELETED", obj)
        return listed.metadata.resource_version if listed.metadata else None

    def _stream(self, version: str | None) -> str | None:
        """Follow one watch until the server ends it; returns the last resourceVersion seen."""
        self._watch = watch.Watch()
        if self._stopped.is_set():  # stop() came before this watch existed
            return version
        arguments: dict[str, Any] = dict(
            self._selector, timeout_seconds=WATCH_SECONDS, _request_timeout=(10, WATCH_SECONDS + 30)
        )
        if version:
            arguments["resource_version"] = version
        try:
            # The client leaves stream() untyped: of a list call it yields events, not log lines.
            events = cast(Iterator[dict[str, Any]], self._watch.stream(self._list, **arguments))
            for event in events:
                if self._stopped.is_set():
                    break
                kind, obj = event["type"], event["object"]  # an ERROR event (410 Gone too) raises in stream()
                version = meta(obj).resource_version or version
                if kind == "BOOKMARK":
                    continue
                with self._lock:
                    known = self._objects.get(name_of(obj))
                    if kind == "DELETED":
                        self._objects.pop(name_of(obj), None)
                    else:
                        self._objects[name_of(obj)] = obj
                # A watch that starts by replaying what exists (one without a resourceVersion,
                # or the test emulator's) says ADDED for objects the list already gave: only a
                # change against the cache is reported, and as what it is.
                if kind == "ADDED" and known is not None:
                    if meta(known).resource_version == meta(obj).resource_version:
                        continue
                    kind = "MODIFIED"
                self._on_event(kind, obj)
        finally:
            self._watch = None
        return version
