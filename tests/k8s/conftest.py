"""Fixtures for the Kubernetes backend: the emulator in a thread, clients, and a pool of nodes."""

from __future__ import annotations

import pytest
from kubernetes import client as k8s

from tests.e2e.conftest import reference, reference_losses, workers  # noqa: F401 - shared with the local e2e tests
from tests.k8s.emulator import BACKEND_USER_AGENT, EmulatorThread
from tests.k8s.kubelet import FakeKubelet

USED: set[tuple[str, str, str]] = set()
"""Every (verb, API group, resource) the backend used against an emulator in this test session."""


@pytest.fixture
def emulator():
    """kmock's emulator, extended (tests/k8s/emulator.py), on a free port of 127.0.0.1."""
    served = EmulatorThread().start()
    try:
        yield served
    finally:
        USED.update(served.emulator.used)
        served.stop()


def api_client(url: str, user_agent: str) -> k8s.ApiClient:
    configuration = k8s.Configuration()
    configuration.host = url
    api = k8s.ApiClient(configuration)
    api.user_agent = user_agent
    return api


@pytest.fixture
def backend_api(emulator):
    """The client the backend uses (its calls are recorded for the RBAC check)."""
    return api_client(emulator.url, BACKEND_USER_AGENT)


@pytest.fixture
def clusters(backend_api):
    """Make KubernetesCluster(home) on the backend's client; each is closed (its watches stopped) at teardown."""
    from lazarus.infra.kubernetes import KubernetesCluster

    made = []

    def make(home):
        made.append(KubernetesCluster(home, backend_api))
        return made[-1]

    try:
        yield make
    finally:
        for cluster in made:
            cluster.close()


@pytest.fixture
def admin(emulator):
    """The test's own client: it plays the cluster's administrator and its kubelets."""
    return k8s.CoreV1Api(api_client(emulator.url, "test-admin"))


def add_node(
    admin: k8s.CoreV1Api, name: str, pool: str = "test", spare: bool = False, address: str = "127.0.0.1"
) -> None:
    """A Ready node of the pool (a hot spare if `spare`)."""
    labels = {"lazarus.dev/pool": pool, "kubernetes.io/hostname": name}
    if spare:
        labels["lazarus.dev/spare"] = "true"
    admin.create_node(
        k8s.V1Node(
            metadata=k8s.V1ObjectMeta(name=name, labels=labels),
            spec=k8s.V1NodeSpec(),
            status=k8s.V1NodeStatus(
                conditions=[k8s.V1NodeCondition(type="Ready", status="True", reason="KubeletReady")],
                addresses=[k8s.V1NodeAddress(type="InternalIP", address=address)],
            ),
        )
    )


def set_ready(admin: k8s.CoreV1Api, name: str, status: str, when: str | None = None) -> None:
    """Set a node's Ready condition ("True", "False" or "Unknown"), as the node controller would."""
    condition = {
        "type": "Ready",
        "status": status,
        "reason": "NodeStatusUnknown" if status == "Unknown" else "KubeletReady",
    }
    if when:
        condition["lastTransitionTime"] = when
    admin.patch_node(name, {"status": {"conditions": [condition]}})


def pytest_collection_modifyitems(config, items):
    """The RBAC comparison needs every other test's calls first: move it to the end."""
    last = [item for item in items if item.name == "test_rbac_grants_exactly_what_the_backend_used"]
    items[:] = [item for item in items if item not in last] + last


@pytest.fixture
def confirming_kubelet(admin, tmp_path):
    """The fake kubelet of namespace lz without containers: it confirms the graceful deletion of
    pods on nodes not in its `dead` set (add a node to make its kubelet gone)."""
    kubelet = FakeKubelet(admin, "lz", tmp_path / "kubelet", run_containers=False).start()
    try:
        yield kubelet
    finally:
        kubelet.stop()


@pytest.fixture
def training_pool(admin, tmp_path):
    """Nodes worker-0..3 and spares spare-0..1 of pool `test`, their pods run by a fake kubelet
    (namespace lz); yields the kubelet, stopped (its processes killed) at teardown."""
    for i in range(4):
        add_node(admin, f"worker-{i}")
    for i in range(2):
        add_node(admin, f"spare-{i}", spare=True)
    kubelet = FakeKubelet(admin, "lz", tmp_path / "kubelet").start()
    try:
        yield kubelet
    finally:
        kubelet.stop()
