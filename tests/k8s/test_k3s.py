"""The backend against a real API server: k3s in a container (testcontainers), where a Docker
engine answers. Skipped with the reason otherwise; the emulator tests cover the rest."""

from __future__ import annotations

import asyncio

import pytest
from kubernetes import client as k8s
from kubernetes import config

from lazarus.infra.backends.kubernetes.cluster import KubernetesCluster
from lazarus.infra.backends.kubernetes.objects import QUARANTINE_TAINT, RUN_LABEL
from tests.k8s.test_backend import k8s_spec
from tests.support.waiting import wait_until


def docker_engine() -> str | None:
    """Why no Docker engine can be used here, or None when one answers."""
    try:
        import docker

        docker.from_env(timeout=5).ping()
    except Exception as error:  # noqa: BLE001 - any failure means the same: no engine to start k3s in
        return f"no Docker engine answers ({type(error).__name__}: {str(error)[:160]})"
    return None


@pytest.fixture(scope="module")
def k3s_api():
    reason = docker_engine()
    if reason:
        pytest.skip(f"k3s test needs a Docker engine: {reason}")
    from testcontainers.k3s import K3SContainer

    with K3SContainer() as cluster:
        yield config.new_client_from_config_dict(__import__("yaml").safe_load(cluster.config_yaml()))


def test_claim_quarantine_pods_and_return_on_k3s(k3s_api, tmp_path):
    core = k8s.CoreV1Api(k3s_api)
    [node] = core.list_node().items
    core.patch_node(node.metadata.name, {"metadata": {"labels": {"lazarus.dev/pool": "test"}}})
    core.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name="lz")))
    cluster = KubernetesCluster(tmp_path, k3s_api)
    try:
        spec = k8s_spec(tmp_path, active=1, spares=0)
        cluster.create("k3s", spec)
        assert core.read_node(node.metadata.name).metadata.labels[RUN_LABEL] == "k3s"
        from lazarus.schema import Assignment

        cluster.commit_assignment(
            "k3s", Assignment(incarnation=0, nodes=[node.metadata.name], layout=spec.layout, master_port=1)
        )
        cluster.start_ranks("k3s", 0, resume_step=0)
        assert len(core.list_namespaced_pod("lz", label_selector=f"{RUN_LABEL}=k3s").items) == 1
        # The watches: started by a first wait, then the pod's deletion wakes the run.
        asyncio.run(cluster.wait_for_exit("k3s", 0, 0.1))
        wait_until(lambda: cluster.watches.cached("pods", "lz") is not None, "the pod watch to sync")
        cluster.stop_incarnation("k3s", 0)
        assert asyncio.run(cluster.wait_for_exit("k3s", 0, 30)) is True
        cluster.quarantine("k3s", [node.metadata.name], "test")
        assert QUARANTINE_TAINT in [t.key for t in core.read_node(node.metadata.name).spec.taints]
        cluster.return_node("k3s", node.metadata.name)
        assert not core.read_node(node.metadata.name).spec.unschedulable
    finally:
        cluster.close()
