"""The Kubernetes objects Lazarus writes and reads: the names and labels it uses, the rank pod of a
node, an Event, and what a Node object says about its health and place in the pool.

Pure functions of the official client's models; infra/backends/kubernetes/cluster.py makes the API calls.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from datetime import UTC, datetime

from kubernetes import client as k8s

from lazarus.schema.contract import (
    ENV_NODE,
    ENV_RUN_DIR,
    ENV_STANDBY_ADDRESS,
    launcher_env,
)
from lazarus.schema.policy import RecoveryPolicy
from lazarus.schema.records import Assignment
from lazarus.schema.run import RunSpec

POOL_LABEL = "lazarus.dev/pool"
RUN_LABEL = "lazarus.dev/run"
SPARE_LABEL = "lazarus.dev/spare"
QUARANTINE_LABEL = "lazarus.dev/quarantined"
QUARANTINE_TAINT = "lazarus.dev/quarantined"
REASON_ANNOTATION = "lazarus.dev/quarantine-reason"
INCARNATION_LABEL = "lazarus.dev/incarnation"
NODE_INDEX_LABEL = "lazarus.dev/node-index"
ROLE_LABEL = "lazarus.dev/role"
"""`standby` on a node's warm standby pod; rank pods have none."""

WARNING_REASONS = ("FaultDetected", "Quarantined")
"""Event reasons shown as warnings (`kubectl get events --field-selector type=Warning`)."""


def utc(value) -> datetime:
    """A timestamp of the API (a datetime or an RFC 3339 string) as an aware UTC datetime; now if absent."""
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    if isinstance(value, str) and value:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    return datetime.now(UTC)


Object = k8s.V1Node | k8s.V1Pod | k8s.V1ConfigMap
"""The kinds of object Lazarus reads back from the API server."""


def meta(obj: Object) -> k8s.V1ObjectMeta:
    """An object's metadata: every object the API server returns has it (the client's models make it
    optional, for an object a client sends)."""
    assert obj.metadata is not None, f"a {type(obj).__name__} from the API server without metadata"
    return obj.metadata


def name_of(obj: Object) -> str:
    """An object's name (every stored object has one)."""
    name = meta(obj).name
    assert name is not None, f"a {type(obj).__name__} from the API server without a name"
    return name


def labels_of(obj: Object) -> dict[str, str]:
    """An object's labels ({} where it has none)."""
    return meta(obj).labels or {}


def annotations_of(obj: Object) -> dict[str, str]:
    """An object's annotations ({} where it has none)."""
    return meta(obj).annotations or {}


def pod_node(pod: k8s.V1Pod) -> str:
    """The node a pod of Lazarus's runs on: each is pinned to its node (spec.nodeName)."""
    node = pod.spec.node_name if pod.spec else None
    assert node is not None, f"pod {name_of(pod)} is not pinned to a node"
    return node


NAME_LIMIT = 63
"""The longest object name and label value Lazarus writes (a DNS-1123 label; characters)."""

_NOT_IN_NAMES = re.compile(r"[^a-z0-9-]+")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?)?")


def _shortened(text: str, original: str) -> str:
    """`text` cut to leave room for a hash of `original`, with that hash: distinct originals stay distinct."""
    digest = hashlib.sha256(original.encode()).hexdigest()[:8]
    return f"{text[: NAME_LIMIT - 9].strip('-._')}-{digest}".lstrip("-")


def object_name(*parts: str | int) -> str:
    """A DNS-1123 label from its parts (lowercase letters, digits and '-', at most 63, alnum at both
    ends). Parts that are one already give the plain join; anything else (a run id with capitals,
    '_' or '.', or a long one) is mapped and given a hash of the original, so two run ids never
    share a name."""
    original = "-".join(str(p) for p in parts)
    name = _NOT_IN_NAMES.sub("-", original.lower()).strip("-")
    if name == original and len(name) <= NAME_LIMIT:
        return name
    return _shortened(name, original)


def run_label(run_id: str) -> str:
    """The value of RUN_LABEL and QUARANTINE_LABEL for a run: its id where that is a valid label
    value (at most 63 characters, alnum at both ends), else a shortened one with a hash of the id."""
    if len(run_id) <= NAME_LIMIT and _LABEL_VALUE.fullmatch(run_id):
        return run_id
    return _shortened(re.sub(r"[^A-Za-z0-9_.-]+", "-", run_id), run_id)


def pod_name(run_id: str, incarnation: int, index: int) -> str:
    """The rank pod of node `index` in an incarnation."""
    return object_name("lz", run_id, incarnation, index)


def standby_pod_name(run_id: str, node: str) -> str:
    """The warm standby pod of a node of the run."""
    return object_name("lzs", run_id, node)


def run_object_name(run_id: str) -> str:
    """The run's ConfigMap: its spec, and the object its Events are about."""
    return object_name("lazarus-run", run_id)


def node_address(node: k8s.V1Node) -> str | None:
    """The node's InternalIP (else its Hostname): rank pods use the host network, so this is the
    address their peers dial, and the one gloo names when a connection to it breaks."""
    addresses = {a.type: a.address for a in (node.status.addresses if node.status and node.status.addresses else [])}
    return addresses.get("InternalIP", addresses.get("Hostname"))


def node_ready(node: k8s.V1Node) -> tuple[bool, datetime | None]:
    """Ready condition: (True, None) when Ready, else (False, when it stopped being Ready)."""
    for condition in node.status.conditions if node.status and node.status.conditions else []:
        if condition.type == "Ready":
            if condition.status == "True":
                return True, None
            return False, utc(condition.last_transition_time)
    return False, None


def node_sick(node: k8s.V1Node, conditions: list[str]) -> str | None:
    """Why a health agent says the node is sick: the first of `conditions` (types besides Ready, as
    a node-problem-detector sets them) whose status is True, with its reason and message; None
    when none is."""
    for condition in node.status.conditions if node.status and node.status.conditions else []:
        if condition.type in conditions and condition.status == "True":
            said = ": ".join(part for part in (condition.reason, condition.message) if part)
            return f"node condition {condition.type} is True" + (f" ({said})" if said else "")
    return None


def node_states(nodes: dict[str, k8s.V1Node], names: list[str]) -> tuple[dict[str, datetime], dict[str, str]]:
    """Of the nodes `names`: those not Ready (or gone), with when they stopped being Ready (else
    now), and the addresses their ranks' peers dial."""
    dead, addresses = {}, {}
    for name in names:
        ready, since = node_ready(nodes[name]) if name in nodes else (False, None)
        if not ready:
            dead[name] = since or datetime.now(UTC)
        if name in nodes and (address := node_address(nodes[name])):
            addresses[name] = address
    return dead, addresses


def sick_nodes(nodes: dict[str, k8s.V1Node], names: list[str], conditions: list[str]) -> dict[str, str]:
    """Of the nodes `names`, those a health agent marks sick by one of `conditions`: name -> why."""
    found = {name: node_sick(nodes[name], conditions) for name in names if conditions and name in nodes}
    return {name: why for name, why in found.items() if why}


def node_free(node: k8s.V1Node) -> bool:
    """Ready, schedulable, and neither held nor quarantined by a run."""
    labels = labels_of(node)
    return (
        RUN_LABEL not in labels
        and QUARANTINE_LABEL not in labels
        and not (node.spec and node.spec.unschedulable)
        and node_ready(node)[0]
    )


def other_taints(node: k8s.V1Node) -> list[dict]:
    """The node's taints but Lazarus's quarantine, as a patch carries them (the list is replaced whole)."""
    return [
        {k: v for k, v in taint.to_dict().items() if v is not None and k != "time_added"}
        for taint in (node.spec.taints if node.spec and node.spec.taints else [])
        if taint.key != QUARANTINE_TAINT
    ]


def pod_running(pod: k8s.V1Pod | None) -> bool:
    """A pod not being deleted whose phase says its container may still run."""
    return (
        pod is not None
        and not meta(pod).deletion_timestamp
        and (pod.status is None or pod.status.phase in (None, "Pending", "Running"))
    )


def rank_pod(
    run_id: str, spec: RunSpec, assignment: Assignment, index: int, resume_step: int, policy: RecoveryPolicy
) -> k8s.V1Pod:
    """The pod of node `index`: its launcher with the contract's environment, pinned to the node,
    tolerating a not-ready node for `policy.not_ready_toleration_seconds` (the policy in force)."""
    run_dir = _mounted_run_dir(spec, run_id)
    env = launcher_env(run_dir, assignment.incarnation, assignment.nodes[index], index, resume_step)
    labels = {INCARNATION_LABEL: str(assignment.incarnation), NODE_INDEX_LABEL: str(index)}
    name = pod_name(run_id, assignment.incarnation, index)
    return _node_pod(run_id, spec, name, assignment.nodes[index], "launcher", env, labels, policy)


def standby_pod(run_id: str, spec: RunSpec, node: str, address: str, policy: RecoveryPolicy) -> k8s.V1Pod:
    """The warm standby pod of a node of the run (trainer/agent/standby/port.py): it holds what a rank pod
    would (the node's GPUs, the volume), and its ranks run in it. It listens for orders on a port
    of `address`, the node's address, on the host network."""
    # The trainer's environment as its ranks will see it, since the standby imports what they
    # use; one OpenMP thread, as the launcher gives ranks: a pool started by the imports would
    # make forking unsafe (the ranks would then be exec'd, cold).
    env = {"OMP_NUM_THREADS": "1", **spec.trainer.env, ENV_NODE: node, ENV_STANDBY_ADDRESS: address}
    labels = {ROLE_LABEL: "standby"}
    return _node_pod(run_id, spec, standby_pod_name(run_id, node), node, "standby", env, labels, policy)


def _mounted_run_dir(spec: RunSpec, run_id: str) -> str:
    """The run directory as a pod sees it, on the runs volume mounted at the spec's mount path."""
    return f"{spec.cluster.kubernetes.mount_path.rstrip('/')}/runs/{run_id}"


def _node_pod(
    run_id: str, spec: RunSpec, name: str, node: str, role: str, env: dict, labels: dict, policy: RecoveryPolicy
) -> k8s.V1Pod:
    settings = spec.cluster.kubernetes
    resources = {"cpu": settings.cpu, "memory": settings.memory}
    if settings.gpus:
        resources["nvidia.com/gpu"] = str(settings.gpus)
    env = {ENV_RUN_DIR: _mounted_run_dir(spec, run_id), **env}
    tolerations = [
        k8s.V1Toleration(
            key=key, operator="Exists", effect="NoExecute", toleration_seconds=policy.not_ready_toleration_seconds
        )
        for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
    ]
    container = k8s.V1Container(
        name=role,
        image=settings.image,
        command=["python", "-m", f"lazarus.trainer.agent.{role}"],
        env=[k8s.V1EnvVar(name=k, value=v) for k, v in env.items()],
        resources=k8s.V1ResourceRequirements(requests=resources, limits=resources),
        volume_mounts=[k8s.V1VolumeMount(name="runs", mount_path=settings.mount_path)],
    )
    return k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(
            name=name, namespace=settings.namespace, labels={RUN_LABEL: run_label(run_id), **labels}
        ),
        spec=k8s.V1PodSpec(
            node_name=node,
            restart_policy="Never",
            host_network=True,
            dns_policy="ClusterFirstWithHostNet",
            automount_service_account_token=False,
            termination_grace_period_seconds=settings.delete_grace_seconds,
            tolerations=tolerations,
            containers=[container],
            volumes=[
                k8s.V1Volume(
                    name="runs",
                    persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(claim_name=settings.volume_claim),
                )
            ],
        ),
    )


def stage_event(namespace: str, reason: str, message: str, kind: str, name: str, object_namespace: str):
    """An Event about `kind`/`name` from component `lazarus` (a warning for faults and quarantines)."""
    now = datetime.now(UTC)
    return k8s.CoreV1Event(
        metadata=k8s.V1ObjectMeta(name=f"{name}.{uuid.uuid4().hex[:12]}", namespace=namespace),
        involved_object=k8s.V1ObjectReference(kind=kind, name=name, namespace=object_namespace, api_version="v1"),
        reason=reason,
        message=message[:1024],
        type="Warning" if reason in WARNING_REASONS else "Normal",
        first_timestamp=now,
        last_timestamp=now,
        count=1,
        source=k8s.V1EventSource(component="lazarus"),
    )
