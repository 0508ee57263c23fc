"""A Kubernetes API for tests: kmock's KubernetesEmulator, served on 127.0.0.1 in a thread of its own,
extended with what Lazarus's backend relies on and kmock 0.8 lacks.

Added: label and field selectors on list and watch; `metadata.resourceVersion` on every write,
checked as a precondition when a patch carries one (409 Conflict on a stale version, as the
real API server does); `uid` and `creationTimestamp` on create; graceful deletion of pods as
the API server does it (a pod bound to a node and not yet ended only gets a
deletionTimestamp, and goes when its kubelet confirms with a delete of grace 0; a delete of
grace 0, of an unbound pod or of an ended one removes it at once); watch expiry (410 Gone);
the pods/eviction subresource (the pod is deleted); a count of the backend's requests; and a
record of every (verb, resource) requested, in RBAC's terms, so a test can compare what the
backend used with what the manifests grant.
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import itertools
import re
import threading
import uuid

import kmock
from kmock import KubernetesEmulator
from kmock._internal import enums, k8s

BACKEND_USER_AGENT = "lazarus-backend"
"""User-Agent prefix of the backend's client in tests; requests with it are recorded in `used`."""

_VERBS = {
    enums.action.LIST: "list",
    enums.action.WATCH: "watch",
    enums.action.FETCH: "get",
    enums.action.CREATE: "create",
    enums.action.UPDATE: "patch",
    enums.action.DELETE: "delete",
}
_SET = re.compile(r"^\s*([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_selector(selector: str) -> list[str]:
    """Split on commas outside parentheses (`a in (x,y),b=c` -> two terms)."""
    terms, depth, current = [], 0, ""
    for char in selector:
        depth += char == "("
        depth -= char == ")"
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    return [t for t in [*terms, current] if t.strip()]


def label_selector_matches(selector: str, labels: dict) -> bool:
    """Kubernetes label selector semantics: =, ==, !=, in, notin, exists, !exists."""
    for term in _split_selector(selector):
        term = term.strip()
        found = _SET.match(term)
        if found:
            key, operator, values = found.group(1), found.group(2), {v.strip() for v in found.group(3).split(",")}
            if (labels.get(key) in values) != (operator == "in") or (operator == "in" and key not in labels):
                return False
        elif "!=" in term:
            key, value = (x.strip() for x in term.split("!=", 1))
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = (x.strip() for x in term.replace("==", "=").split("=", 1))
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


def _field(obj: dict, path: str):
    value = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def field_selector_matches(selector: str, obj: dict) -> bool:
    """Field selectors: `path=value`, `path==value`, `path!=value`, joined by commas."""
    for term in _split_selector(selector):
        if "!=" in term:
            path, value = (x.strip() for x in term.split("!=", 1))
            if str(_field(obj, path) or "") == value:
                return False
        else:
            path, value = (x.strip() for x in term.replace("==", "=").split("=", 1))
            if str(_field(obj, path) or "") != value:
                return False
    return True


def selected(request, obj: dict) -> bool:
    """Whether `obj` passes the request's labelSelector and fieldSelector."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    label_selector = request.params.get("labelSelector", "")
    field_selector = request.params.get("fieldSelector", "")
    return (not label_selector or label_selector_matches(label_selector, labels)) and (
        not field_selector or field_selector_matches(field_selector, obj)
    )


REQUESTS_KEPT = 128
"""Requests the emulator keeps in kmock's log (it trims the log to a quarter past this)."""


class ClusterEmulator(KubernetesEmulator):
    """kmock's emulator with selectors, resource versions, eviction and a record of the verbs used."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        # Declared up front: kmock answers 404 to a list of a resource it has no object of yet.
        for resource, kind, namespaced in (
            ("v1/nodes", "Node", False),
            ("v1/pods", "Pod", True),
            ("v1/events", "Event", True),
            ("v1/configmaps", "ConfigMap", True),
        ):
            self.resources[resource] = kmock.ResourceInfo(kind=kind, namespaced=namespaced)
        self.used: set[tuple[str, str, str]] = set()  # (verb, API group, resource[/subresource])
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()  # (verb, resource) of the backend
        self._versions = itertools.count(1)
        self._write_lock = asyncio.Lock()

    async def _handle(self, request):
        # kmock keeps every request and finds each new one among them to route it: a cost that
        # grows with the requests served, which a pool of thousands of nodes makes by the
        # thousand. No test reads that log; the newest requests stay, so any still in flight
        # (a dozen at most: the client's threads and the watches) is found.
        if len(self._requests) > REQUESTS_KEPT:
            del self._requests[: -REQUESTS_KEPT // 4]
        if request.resource is None:
            return await super()._handle(request)
        group = request.resource.group or ""
        plural = request.resource.plural
        # Only the backend's calls count (its client says so); a test's own setup does not.
        recording = request.headers.get("User-Agent", "").startswith(BACKEND_USER_AGENT)
        if request.subresource == "eviction" and request.method == enums.method.POST:
            if recording:
                self.used.add(("create", group, f"{plural}/eviction"))
            return await self._evict(request)
        verb = _VERBS.get(request.action)
        if verb and recording:
            self.used.add((verb, group, plural + (f"/{request.subresource}" if request.subresource else "")))
            self.calls[(verb, plural)] += 1
        if request.action == enums.action.DELETE and plural == "pods" and request.name is not None:
            graceful = await self._delete_gracefully(request)
            if graceful is not None:
                return graceful
        if request.action not in (enums.action.CREATE, enums.action.UPDATE):
            return await super()._handle(request)
        # Check and write under one lock: two patches racing with the same resourceVersion
        # must not both pass the check.
        async with self._write_lock:
            metadata = request.data.setdefault("metadata", {})
            if request.action == enums.action.UPDATE:
                key = (request.resource, request.namespace, request.name)
                stored = self._objects[key] if key in self._objects else None
                expected = metadata.get("resourceVersion")
                if stored is not None and not stored.deleted and expected is not None:
                    current = (stored.get("metadata") or {}).get("resourceVersion")
                    if str(expected) != str(current):
                        return await self._conflict(request, current, expected)
            else:
                metadata.setdefault("uid", str(uuid.uuid4()))
                metadata.setdefault(
                    "creationTimestamp", datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                )
            metadata["resourceVersion"] = str(next(self._versions))
            return await super()._handle(request)

    async def _conflict(self, request, current, expected):
        import aiohttp.web

        message = (
            f'Operation cannot be fulfilled on {request.resource.plural} "{request.name}": the object has '
            f"been modified; please apply your changes to the latest version and try again "
            f"(resourceVersion {expected}, now {current})"
        )
        return aiohttp.web.json_response(
            {
                "kind": "Status",
                "apiVersion": "v1",
                "status": "Failure",
                "reason": "Conflict",
                "code": 409,
                "message": message,
            },
            status=409,
        )

    async def _delete_gracefully(self, request):
        """Mark a running pod terminating instead of deleting it, unless the delete is forced;
        None when the delete should go through at once."""
        import aiohttp.web

        options = request.data if isinstance(request.data, dict) else {}
        grace = request.params.get("gracePeriodSeconds", options.get("gracePeriodSeconds"))
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            stored = self._objects[key] if key in self._objects else None
            if stored is None or stored.deleted or (grace is not None and int(grace) == 0):
                return None
            raw = stored.raw
            if not (raw.get("spec") or {}).get("nodeName") or (raw.get("status") or {}).get("phase") in (
                "Succeeded",
                "Failed",
            ):
                return None
            if not raw["metadata"].get("deletionTimestamp"):
                now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                stored.patch(
                    {
                        "metadata": {
                            "deletionTimestamp": now,
                            "resourceVersion": str(next(self._versions)),
                            "deletionGracePeriodSeconds": int(grace) if grace is not None else 30,
                        }
                    }
                )
                await self._buses[request.resource].put({"type": "MODIFIED", "object": stored.raw})
            return aiohttp.web.json_response(stored.raw)

    async def _evict(self, request):
        import aiohttp.web

        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            if key not in self._objects or self._objects[key].deleted:
                return aiohttp.web.json_response(
                    {
                        "kind": "Status",
                        "status": "Failure",
                        "reason": "NotFound",
                        "code": 404,
                        "message": f'pods "{request.name}" not found',
                    },
                    status=404,
                )
            self._objects[key].delete()
            raw = self._objects[key].last.raw
            await self._buses[request.resource].put({"type": "DELETED", "object": raw})
        return aiohttp.web.json_response(
            {"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201}, status=201
        )

    async def _serve_list(self, request):
        listed = await super()._serve_list(request)
        listed["items"] = [item for item in listed["items"] if selected(request, item)]
        return listed

    async def _serve_watch(self, request):
        async for event in super()._serve_watch(request):
            if (
                not isinstance(event, dict)
                or event.get("type") == "ERROR"
                or selected(request, event.get("object") or {})
            ):
                yield event

    async def expire_watches(self, plural: str) -> None:
        """Send every open watch of `plural` a 410 Gone, as an API server does when it no longer
        holds the resourceVersion a watch follows (the client must list again)."""
        for resource, bus in list(self._buses.items()):
            if resource.plural == plural:
                await bus.put(
                    {
                        "type": "ERROR",
                        "object": {
                            "kind": "Status",
                            "apiVersion": "v1",
                            "status": "Failure",
                            "reason": "Expired",
                            "code": 410,
                            "message": "too old resource version",
                        },
                    }
                )


class EmulatorThread:
    """The emulator served on 127.0.0.1 (a free port) by an event loop in a thread of its own, so
    that synchronous clients (the official `kubernetes` package) can call it from anywhere."""

    def __init__(self):
        self.emulator: ClusterEmulator | None = None
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="k8s-emulator", daemon=True)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        except BaseException as error:  # noqa: BLE001 - surfaced by start()
            self._error = error
            self._ready.set()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        async with ClusterEmulator() as emulator, kmock.Server(emulator) as server:
            self.emulator = emulator
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def start(self) -> EmulatorThread:
        self._thread.start()
        if not self._ready.wait(30) or self._error is not None:
            raise RuntimeError(f"the Kubernetes emulator did not start: {self._error!r}")
        return self

    def call(self, coroutine_function, *args):
        """Run `coroutine_function(*args)` on the emulator's loop (to change its objects) and wait."""
        return asyncio.run_coroutine_threadsafe(coroutine_function(*args), self._loop).result(30)

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


__all__ = ["ClusterEmulator", "EmulatorThread", "label_selector_matches", "field_selector_matches", "k8s"]
