"""The Kubernetes side of the tests: clients of the emulator (tests/k8s/emulator.py) and the
administrator's moves (nodes added, Ready conditions set), as a cluster's control plane would."""

from __future__ import annotations

from kubernetes import client as k8s


def api_client(url: str, user_agent: str) -> k8s.ApiClient:
    """A client of the emulator at `url`; the emulator records the calls of the backend's user agent."""
    configuration = k8s.Configuration()
    configuration.host = url
    api = k8s.ApiClient(configuration)
    api.user_agent = user_agent
    return api


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
    reason = "NodeStatusUnknown" if status == "Unknown" else "KubeletReady"
    condition = {"type": "Ready", "status": status, "reason": reason}
    if when:
        condition["lastTransitionTime"] = when
    admin.patch_node(name, {"status": {"conditions": [condition]}})
