"""Which cluster backends exist: one place maps a backend's name to its class.

Everything else asks this module (which names there are, the class behind one, an open backend)
or asks the backend's class for a capability (`shares_host`, `shares_paths`, ...), never compares a
backend's name. A backend is registered by name with the dotted path of its class, so that naming
the backends imports none of them: the Kubernetes client costs half a second to import, and only a
Kubernetes worker needs it. A new backend is one class (ClusterBackend, infra/backend.py) with an
`open(options)` classmethod, and one `register` call.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from lazarus.infra.backend import ClusterBackend, ClusterError

DEFAULT_BACKEND = "local"
"""The backend of a spec that names none, and of a worker started without --backend."""


@dataclass(frozen=True)
class BackendOptions:
    """What opening a backend may need; each backend reads the fields it knows."""

    home: Path  # LAZARUS_HOME: where run directories live
    store: str | None = None  # LAZARUS_STORE: the store's URL (infra/store); None: SQLite in the home
    runs: Path | None = None  # LAZARUS_RUNS: the runs' directories, shared by a fleet's workers; None: home/runs
    kube_qps: float = 100.0  # Kubernetes API requests a second the backend makes at most
    kube_burst: int = 200  # Kubernetes API requests made at once before kube_qps paces them


@dataclass(frozen=True)
class Registration:
    """One backend as the registry knows it."""

    name: str  # what `--backend` and a spec's `cluster.backend` say
    target: str | type  # its class, or "module:Class" to import when it is first needed
    summary: str  # one line for --help: what a node is on this backend
    stands_in_for: str | None  # the spec backend it serves in place of its own name (None: its own)


_REGISTERED: dict[str, Registration] = {}


class UnknownBackend(ClusterError):
    """A name no backend is registered under."""


def register(name: str, target: str | type, summary: str, stands_in_for: str | None = None) -> None:
    """Make `name` a backend: `target` is its class or "module:Class". A name registered again
    replaces the earlier registration."""
    _REGISTERED[name] = Registration(name, target, summary, stands_in_for)


def unregister(name: str) -> None:
    """Forget the backend registered as `name` (a test's own backend, once the test is done)."""
    _REGISTERED.pop(name, None)


def names() -> list[str]:
    """Every backend a worker can drive, in the order they were registered."""
    return list(_REGISTERED)


def spec_names() -> list[str]:
    """The backends a spec's `cluster.backend` may name (stand-ins serve another's specs)."""
    return [r.name for r in _REGISTERED.values() if r.stands_in_for is None]


def summaries() -> str:
    """One clause per backend, for --help."""
    return "; ".join(f"{r.name}: {r.summary}" for r in _REGISTERED.values())


def backend_class(name: str) -> type:
    """The class registered as `name` (imported on first use); UnknownBackend for any other name."""
    registration = _REGISTERED.get(name)
    if registration is None:
        raise UnknownBackend(_unknown(name))
    if not isinstance(registration.target, str):
        return registration.target
    module, _, attribute = registration.target.partition(":")
    return getattr(importlib.import_module(module), attribute)


def open_backend(name: str, options: BackendOptions) -> ClusterBackend:
    """The backend `name`, opened (its cluster reached); ClusterError, one line, where it cannot be."""
    return backend_class(name).open(options)


def _unknown(name: str) -> str:
    return f"{name!r} is not a backend; the backends are {', '.join(spec_names())}"


def worker_flags(spec_backend: str) -> str:
    """The flags `lazarus worker` needs to serve runs whose spec names `spec_backend`."""
    return "" if spec_backend == DEFAULT_BACKEND else f" --backend {spec_backend}"


def refuses(cluster: ClusterBackend, spec_backend: str) -> str | None:
    """Why a worker driving `cluster` cannot serve a spec naming `spec_backend`, or None."""
    if spec_backend not in spec_names():
        return f"cluster.backend: {_unknown(spec_backend)}"
    if cluster.backend == spec_backend:
        return None
    return (
        f"cluster.backend is {spec_backend!r} but this worker drives the {cluster.backend!r} backend; "
        f"start a worker with `lazarus worker --backend {spec_backend}`"
    )


register(
    "local",
    "lazarus.infra.backends.local.cluster:LocalCluster",
    "each node a group of rank processes on this machine",
)
register(
    "kubernetes",
    "lazarus.infra.backends.kubernetes.cluster:KubernetesCluster",
    "a pod per node on the nodes labelled lazarus.dev/pool (in-cluster service account, else ~/.kube/config)",
)
register(
    "slurm",
    "lazarus.infra.backends.slurm.cluster:SlurmCluster",
    "each node's ranks a job step of one allocation of the Slurm cluster SLURM_CONF names "
    "(LAZARUS_HOME on a path every node shares)",
)
register(
    "simulated",
    "lazarus.infra.backends.simulated.cluster:SimulatedCluster",
    "nodes that only report, for exercising the controller with fleets this machine cannot run "
    "(specs keep cluster.backend local)",
    stands_in_for="local",
)
