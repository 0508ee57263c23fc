"""The Kubernetes backend: nodes of a labelled pool are the unit of failure, one pod per node and
incarnation runs the node's launcher (trainer/launcher.py), and quarantine is cordon + taint.

Behind the same interface as the local backend (infra/local.py), so the activities do not know
which one they drive. What lives where:
- the API server: which nodes belong to the pool (`lazarus.dev/pool=<pool>`), which run holds
  a node (`lazarus.dev/run=<run id>`), which nodes are hot spares (`lazarus.dev/spare=true`),
  quarantine (spec.unschedulable, a `lazarus.dev/quarantined` NoSchedule taint, a label naming
  the run and an annotation with the reason), node health (the Ready condition), the rank pods
  and an Event per recovery stage on the run's ConfigMap; node and pod changes reach the runs
  through two watch streams per worker (infra/informer.py), one of the pool, one of the namespace;
- the shared volume (a ReadWriteMany claim the pods and the worker mount): the run directory
  of schema/contract.py with its assignments, launch records, heartbeats, exits and checkpoints.

Every name derives from (run, incarnation, node index), so a retried activity finds what an
earlier attempt did: a 409 on create and a 404 on delete are success. A spare is claimed by a
label patch that carries the node's resourceVersion, so two runs racing for one spare cannot
both win: the loser's patch gets 409 Conflict.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from lazarus.infra.informer import Informer
from lazarus.infra.local import Observation, RankObservation
from lazarus.infra.runfiles import ClusterError, RunFiles
from lazarus.schema.contract import (
    ENV_INCARNATION,
    ENV_NODE,
    ENV_NODE_INDEX,
    ENV_RESUME_STEP,
    ENV_RUN_DIR,
    RunDir,
    read_json,
)
from lazarus.schema.policy import RecoveryPolicy
from lazarus.schema.records import Assignment, Inventory, NodeRecord
from lazarus.schema.run import KubernetesSettings, RunSpec

POOL_LABEL = "lazarus.dev/pool"
RUN_LABEL = "lazarus.dev/run"
SPARE_LABEL = "lazarus.dev/spare"
QUARANTINE_LABEL = "lazarus.dev/quarantined"
QUARANTINE_TAINT = "lazarus.dev/quarantined"
REASON_ANNOTATION = "lazarus.dev/quarantine-reason"
INCARNATION_LABEL = "lazarus.dev/incarnation"
NODE_INDEX_LABEL = "lazarus.dev/node-index"


def _utc(value) -> datetime:
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    if isinstance(value, str) and value:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    return datetime.now(UTC)


def object_name(*parts: str | int) -> str:
    """A DNS-1123 name from its parts, shortened with a hash past 63 characters."""
    name = "-".join(str(p) for p in parts).lower()
    if len(name) <= 63:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[:54].rstrip('-')}-{digest}"


def pod_name(run_id: str, incarnation: int, index: int) -> str:
    """The rank pod of node `index` in an incarnation."""
    return object_name("lz", run_id, incarnation, index)


def run_object_name(run_id: str) -> str:
    """The run's ConfigMap: its spec, and the object its Events are about."""
    return object_name("lazarus-run", run_id)


def _address(node: k8s.V1Node) -> str | None:
    """The node's InternalIP (else its Hostname): rank pods use the host network, so this is the
    address their peers dial, and the one gloo names when a connection to it breaks."""
    addresses = {a.type: a.address for a in (node.status.addresses if node.status and node.status.addresses else [])}
    return addresses.get("InternalIP", addresses.get("Hostname"))


def _ready(node: k8s.V1Node) -> tuple[bool, datetime | None]:
    """Ready condition: (True, None) when Ready, else (False, when it stopped being Ready)."""
    for condition in node.status.conditions if node.status and node.status.conditions else []:
        if condition.type == "Ready":
            if condition.status == "True":
                return True, None
            return False, _utc(condition.last_transition_time)
    return False, None


class KubernetesCluster(RunFiles):
    """Runs' nodes as pods on a Kubernetes cluster, with run directories under `home` (the shared volume)."""

    backend = "kubernetes"
    records_stages = True

    def __init__(self, home: str | Path, api: k8s.ApiClient | None = None):
        super().__init__(home)
        if api is None:
            from kubernetes import config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api = k8s.ApiClient()
        self.core = k8s.CoreV1Api(api)
        self._informers: dict[tuple[str, str], Informer] = {}
        self._lock = threading.Lock()
        self._changes: dict[str, int] = {}  # per run: node or pod events that call for a look
        self._seen: dict[str, int] = {}  # per run: the count its last wait_for_exit returned at
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}

    def close(self) -> None:
        """Stop the watches (the worker calls this on shutdown)."""
        with self._lock:
            informers, self._informers = list(self._informers.values()), {}
        for informer in informers:
            informer.stop()

    def _settings(self, run_id: str) -> KubernetesSettings:
        return self.spec(run_id).cluster.kubernetes

    # --- nodes -------------------------------------------------------------------------

    def _pool(self, settings: KubernetesSettings) -> list[k8s.V1Node]:
        return self.core.list_node(label_selector=f"{POOL_LABEL}={settings.pool}").items

    @staticmethod
    def _free(node: k8s.V1Node) -> bool:
        labels = node.metadata.labels or {}
        return (
            RUN_LABEL not in labels
            and QUARANTINE_LABEL not in labels
            and not (node.spec and node.spec.unschedulable)
            and _ready(node)[0]
        )

    def _claim(self, node_name: str, run_id: str, spare_only: bool) -> bool:
        """Label the node as this run's if it is free; True if it is (now or already) this run's.

        The patch carries the resourceVersion the node was read at: if anything changed the node
        since (another run's claim), the API server refuses it with 409 and this one loses.
        """
        node = self.core.read_node(node_name)
        labels = node.metadata.labels or {}
        if labels.get(RUN_LABEL) == run_id:
            return True
        if not self._free(node) or (spare_only and labels.get(SPARE_LABEL) != "true"):
            return False
        try:
            self.core.patch_node(
                node_name,
                {
                    "metadata": {
                        "labels": {RUN_LABEL: run_id, SPARE_LABEL: None},
                        "resourceVersion": node.metadata.resource_version,
                    }
                },
            )
        except ApiException as error:
            if error.status != 409:
                raise
            return (self.core.read_node(node_name).metadata.labels or {}).get(RUN_LABEL) == run_id
        return True

    def _release(self, node_name: str, run_id: str) -> None:
        node = self.core.read_node(node_name)
        if (node.metadata.labels or {}).get(RUN_LABEL) == run_id:
            self.core.patch_node(node_name, {"metadata": {"labels": {RUN_LABEL: None, SPARE_LABEL: "true"}}})

    # --- watches ---------------------------------------------------------------------------

    def _informer(self, kind: str, scope: str) -> Informer:
        """The watch of the pool's nodes (kind "nodes", scope the pool) or of the rank pods of a
        namespace (kind "pods", scope the namespace), started on first use and shared by every run."""
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
        if kind == "DELETED" or not _ready(node)[0]:
            self._changed((node.metadata.labels or {}).get(RUN_LABEL))

    def _pod_event(self, kind: str, pod: k8s.V1Pod) -> None:
        if kind == "DELETED" or not self._running(pod):
            self._changed((pod.metadata.labels or {}).get(RUN_LABEL))

    def _changed(self, run_id: str | None) -> None:
        """Count an event that calls for a look at the run, and wake its waiters (from an informer's thread)."""
        if run_id is None:
            return
        with self._lock:
            self._changes[run_id] = self._changes.get(run_id, 0) + 1
            waiters = list(self._waiters.get(run_id, ()))
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    def _watched(self, kind: str, scope: str) -> dict | None:
        """The cache of a running, synced watch (wait_for_exit starts them), else None: a look at a
        run then reads no list, where a hundred runs looking every second would otherwise cost
        the API server two hundred lists a second."""
        with self._lock:
            informer = self._informers.get((kind, scope))
        return informer.objects() if informer is not None else None

    def _pool_nodes(self, settings: KubernetesSettings) -> dict[str, k8s.V1Node]:
        """The pool's nodes by name: from the watch while it is synced, else from a list."""
        cached = self._watched("nodes", settings.pool)
        if cached is not None:
            return cached
        return {n.metadata.name: n for n in self._pool(settings)}

    # --- run state -----------------------------------------------------------------------

    def create(self, run_id: str, spec: RunSpec) -> RunDir:
        """Record the run (directory, spec, ConfigMap) and claim its active nodes from the pool, once."""
        run = self.write_spec(run_id, spec)
        settings = spec.cluster.kubernetes
        self._create_ignoring_conflict(
            lambda: self.core.create_namespaced_config_map(
                settings.namespace,
                k8s.V1ConfigMap(
                    metadata=k8s.V1ObjectMeta(name=run_object_name(run_id), labels={RUN_LABEL: run_id}),
                    data={"spec.json": spec.model_dump_json()},
                ),
            )
        )
        pool = self._pool(settings)
        mine = [n for n in pool if (n.metadata.labels or {}).get(RUN_LABEL) == run_id]
        # Spares last: a run takes ordinary free nodes first and leaves the hot spares for recoveries.
        candidates = sorted(
            (n for n in pool if self._free(n)),
            key=lambda n: ((n.metadata.labels or {}).get(SPARE_LABEL) == "true", n.metadata.name),
        )
        for node in candidates:
            if len(mine) >= spec.cluster.active_nodes:
                break
            if self._claim(node.metadata.name, run_id, spare_only=False):
                mine.append(node)
        if len(mine) < spec.cluster.active_nodes:
            for node in mine:
                self._release(node.metadata.name, run_id)
            raise ClusterError(
                f"pool {settings.pool!r} has {len(mine)} free ready node(s); the run needs "
                f"{spec.cluster.active_nodes} (label more nodes {POOL_LABEL}={settings.pool})"
            )
        return run

    def inventory(self, run_id: str) -> Inventory:
        """This run's nodes (active, quarantined by it) and the pool's free hot spares."""
        self._existing(run_id)
        records = []
        for node in self._pool(self._settings(run_id)):
            labels = node.metadata.labels or {}
            ready, since = _ready(node)
            annotations = node.metadata.annotations or {}
            if labels.get(RUN_LABEL) == run_id:
                role, note = "active", ""
            elif labels.get(QUARANTINE_LABEL) == run_id:
                role, note = "quarantined", annotations.get(REASON_ANNOTATION, "")
            elif labels.get(SPARE_LABEL) == "true" and self._free(node):
                role, note = "spare", "hot spare of the pool"
            else:
                continue
            records.append(NodeRecord(name=node.metadata.name, role=role, healthy=ready, died_at=since, note=note))
        return Inventory(nodes=records)

    def _read_node(self, name: str) -> k8s.V1Node:
        try:
            return self.core.read_node(name)
        except ApiException as error:
            if error.status == 404:
                raise ClusterError(f"no node {name!r} in the cluster") from None
            raise

    @staticmethod
    def _other_taints(node: k8s.V1Node) -> list[dict]:
        """The node's taints but Lazarus's quarantine, as a patch carries them (the list is replaced whole)."""
        return [
            {k: v for k, v in taint.to_dict().items() if v is not None and k != "time_added"}
            for taint in (node.spec.taints if node.spec and node.spec.taints else [])
            if taint.key != QUARANTINE_TAINT
        ]

    def quarantine(self, run_id: str, nodes: list[str], reason: str) -> None:
        """Cordon and taint the nodes, label them with the run and annotate why; an Event on each."""
        for name in nodes:
            taints = [
                *self._other_taints(self._read_node(name)),
                {"key": QUARANTINE_TAINT, "value": run_id, "effect": "NoSchedule"},
            ]
            self.core.patch_node(
                name,
                {
                    "spec": {"unschedulable": True, "taints": taints},
                    "metadata": {
                        "labels": {QUARANTINE_LABEL: run_id, RUN_LABEL: None},
                        "annotations": {REASON_ANNOTATION: reason[:1000]},
                    },
                },
            )
            self._event(run_id, "Quarantined", f"{name}: {reason}", kind="Node", name=name, namespace="")

    def return_node(self, run_id: str, node: str) -> Inventory:
        """A repaired node goes back to the pool as a hot spare: uncordoned, untainted, unlabelled."""
        taints = self._other_taints(self._read_node(node))
        self.core.patch_node(
            node,
            {
                "spec": {"unschedulable": False, "taints": taints or None},
                "metadata": {
                    "labels": {QUARANTINE_LABEL: None, SPARE_LABEL: "true"},
                    "annotations": {REASON_ANNOTATION: None},
                },
            },
        )
        self._event(
            run_id, "Returned", f"{node} is back in the pool as a hot spare", kind="Node", name=node, namespace=""
        )
        return self.inventory(run_id)

    def commit_assignment(
        self, run_id: str, assignment: Assignment, claims: list[str] = (), releases: list[str] = ()
    ) -> Assignment:
        """Claim the spares, record the assignment exactly once (rank 0's node address filled in),
        and release leftover nodes to the spare pool."""
        recorded = self.assignment(run_id, assignment.incarnation)
        if recorded is None:
            taken = [node for node in claims if not self._claim(node, run_id, spare_only=True)]
            if taken:
                raise ClusterError(f"node {', '.join(taken)} is no longer a free spare")
            settings = self._settings(run_id)
            first = self.core.read_node(assignment.nodes[0])
            proposal = assignment.model_copy(
                update={"master_addr": _address(first) or assignment.nodes[0], "master_port": settings.master_port}
            )
            recorded = self.record_assignment(run_id, proposal)
        for node in recorded.nodes:  # completes an attempt that crashed between its writes
            if not self._claim(node, run_id, spare_only=False):
                raise ClusterError(f"node {node} of incarnation {recorded.incarnation} is held by another run")
        for node in set(releases) - set(recorded.nodes):
            self._release(node, run_id)
        return recorded

    # --- rank pods -----------------------------------------------------------------------

    @staticmethod
    def _create_ignoring_conflict(create) -> None:
        try:
            create()
        except ApiException as error:
            if error.status != 409:  # already there: an earlier attempt created it
                raise

    def rank_pod(
        self,
        run_id: str,
        spec: RunSpec,
        assignment: Assignment,
        index: int,
        resume_step: int,
        policy: RecoveryPolicy | None = None,
    ) -> k8s.V1Pod:
        """The pod of node `index`: its launcher with the contract's environment, pinned to the node;
        its tolerations from `policy` (the one in force), else from the spec's."""
        settings = spec.cluster.kubernetes
        run_dir = f"{settings.mount_path.rstrip('/')}/runs/{run_id}"
        resources = {"cpu": settings.cpu, "memory": settings.memory}
        if settings.gpus:
            resources["nvidia.com/gpu"] = str(settings.gpus)
        env = {
            ENV_RUN_DIR: run_dir,
            ENV_INCARNATION: str(assignment.incarnation),
            ENV_NODE: assignment.nodes[index],
            ENV_NODE_INDEX: str(index),
            ENV_RESUME_STEP: str(resume_step),
        }
        tolerations = [
            k8s.V1Toleration(
                key=key,
                operator="Exists",
                effect="NoExecute",
                toleration_seconds=(policy or spec.recovery).not_ready_toleration_seconds,
            )
            for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
        ]
        return k8s.V1Pod(
            metadata=k8s.V1ObjectMeta(
                name=pod_name(run_id, assignment.incarnation, index),
                namespace=settings.namespace,
                labels={
                    RUN_LABEL: run_id,
                    INCARNATION_LABEL: str(assignment.incarnation),
                    NODE_INDEX_LABEL: str(index),
                },
            ),
            spec=k8s.V1PodSpec(
                node_name=assignment.nodes[index],
                restart_policy="Never",
                host_network=True,
                dns_policy="ClusterFirstWithHostNet",
                automount_service_account_token=False,
                termination_grace_period_seconds=settings.delete_grace_seconds,
                tolerations=tolerations,
                containers=[
                    k8s.V1Container(
                        name="launcher",
                        image=settings.image,
                        command=["python", "-m", "lazarus.trainer.launcher"],
                        env=[k8s.V1EnvVar(name=k, value=v) for k, v in env.items()],
                        resources=k8s.V1ResourceRequirements(requests=resources, limits=resources),
                        volume_mounts=[k8s.V1VolumeMount(name="runs", mount_path=settings.mount_path)],
                    )
                ],
                volumes=[
                    k8s.V1Volume(
                        name="runs",
                        persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(
                            claim_name=settings.volume_claim
                        ),
                    )
                ],
            ),
        )

    def start_ranks(
        self,
        run_id: str,
        incarnation: int,
        resume_step: int,
        skipped: dict[int, str] | None = None,
        policy: RecoveryPolicy | None = None,
    ) -> dict:
        """Create the incarnation's pods (one per node) unless they exist; returns the launch record in force."""
        assignment = self.assignment(run_id, incarnation)
        if assignment is None:
            raise ClusterError(f"incarnation {incarnation} of run {run_id!r} has no assignment")
        record = self.record_launch(run_id, incarnation, resume_step, skipped)
        spec = self.spec(run_id)
        for index in range(len(assignment.nodes)):
            pod = self.rank_pod(run_id, spec, assignment, index, record["resume_step"], policy)
            self._create_ignoring_conflict(
                lambda pod=pod: self.core.create_namespaced_pod(spec.cluster.kubernetes.namespace, pod)
            )
        return record

    def _pods(self, run_id: str, incarnation: int, watched: bool = False) -> dict[int, k8s.V1Pod]:
        """The incarnation's pods by node index: from the watch if `watched` and it is synced, else
        from a list (drain's deletions and its wait for them use a list: the API server's word)."""
        namespace = self._settings(run_id).namespace
        if watched:
            cached = self._watched("pods", namespace)
            if cached is not None:
                mine = {RUN_LABEL: run_id, INCARNATION_LABEL: str(incarnation)}
                return {
                    int(p.metadata.labels[NODE_INDEX_LABEL]): p
                    for p in cached.values()
                    if all(p.metadata.labels.get(k) == v for k, v in mine.items())
                }
        pods = self.core.list_namespaced_pod(
            namespace, label_selector=f"{RUN_LABEL}={run_id},{INCARNATION_LABEL}={incarnation}"
        ).items
        return {int(p.metadata.labels[NODE_INDEX_LABEL]): p for p in pods}

    @staticmethod
    def _running(pod: k8s.V1Pod | None) -> bool:
        return (
            pod is not None
            and not pod.metadata.deletion_timestamp
            and (pod.status is None or pod.status.phase in (None, "Pending", "Running"))
        )

    def observe(self, run_id: str, incarnation: int) -> Observation:
        """Pods, node Ready conditions and the ranks' heartbeat and exit files of an incarnation."""
        run = self._existing(run_id)
        assignment = self.assignment(run_id, incarnation)
        if assignment is None:
            raise ClusterError(f"incarnation {incarnation} of run {run_id!r} has no assignment")
        launch = read_json(run.incarnation(incarnation) / "launch.json") or {}
        nodes = self._pool_nodes(self._settings(run_id))
        dead, addresses = {}, {}
        for name in assignment.nodes:
            ready, since = _ready(nodes[name]) if name in nodes else (False, None)
            if not ready:
                dead[name] = since or datetime.now(UTC)
            if name in nodes and (address := _address(nodes[name])):
                addresses[name] = address
        pods = self._pods(run_id, incarnation, watched=True)
        observation = Observation(
            incarnation,
            launch.get("launched_at"),
            launch.get("resume_step", 0),
            dead_nodes=dead,
            node_addresses=addresses,
        )
        observation.launchers_alive = sum(self._running(p) for p in pods.values())
        layout = assignment.layout
        for rank in range(layout.world_size):
            index = layout.node_of_rank(rank)
            running = self._running(pods.get(index))
            exit_record = read_json(run.exit_file(incarnation, rank))
            observation.ranks.append(
                RankObservation(
                    rank=rank,
                    node=assignment.nodes[index],
                    launched=index in pods or exit_record is not None,
                    alive=running and exit_record is None,
                    heartbeat=read_json(run.heartbeat_file(incarnation, rank)),
                    exit=exit_record,
                    launcher_alive=running,
                )
            )
        return observation

    async def wait_for_exit(self, run_id: str, incarnation: int, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the watch to report one of the run's nodes not ready or
        gone, or one of its pods ended or deleted; True if it did (at once if one came since the
        last wait returned, while the caller was looking)."""
        settings = self._settings(run_id)
        self._informer("nodes", settings.pool)
        self._informer("pods", settings.namespace)
        loop, woken = asyncio.get_running_loop(), asyncio.Event()
        with self._lock:
            if self._changes.get(run_id, 0) > self._seen.get(run_id, 0):
                self._seen[run_id] = self._changes[run_id]
                return True
            self._waiters.setdefault(run_id, []).append((loop, woken))
        try:
            await asyncio.wait_for(woken.wait(), timeout)
            return True
        except TimeoutError:
            return False
        finally:
            with self._lock:
                self._waiters[run_id].remove((loop, woken))
                if not self._waiters[run_id]:
                    del self._waiters[run_id]
                self._seen[run_id] = self._changes.get(run_id, 0)

    def stop_incarnation(self, run_id: str, incarnation: int, timeout: float = 60.0) -> list[int]:
        """Delete the incarnation's pods and wait until the API server has none left; returns the
        ranks whose pods were running.

        Pods get the spec's grace, but none on a node that is not ready or that this run
        quarantined: their kubelet is dead or suspect and would never confirm, and the node is
        cordoned and out of the run either way.
        """
        run = self._existing(run_id)
        run.ended_file(incarnation).parent.mkdir(parents=True, exist_ok=True)
        run.ended_file(incarnation).touch()
        settings = self._settings(run_id)
        assignment = self.assignment(run_id, incarnation)
        observation = self.observe(run_id, incarnation)
        # A fresh list, not the watch: the quarantine drain wrote a moment ago must be seen.
        lost = set(observation.dead_nodes) | {
            n.metadata.name for n in self._pool(settings) if (n.metadata.labels or {}).get(QUARANTINE_LABEL) == run_id
        }
        for index, pod in self._pods(run_id, incarnation).items():
            grace = 0 if assignment.nodes[index] in lost else settings.delete_grace_seconds
            try:
                self.core.delete_namespaced_pod(pod.metadata.name, settings.namespace, grace_period_seconds=grace)
            except ApiException as error:
                if error.status != 404:  # gone already
                    raise
        deadline = time.monotonic() + timeout
        while self._pods(run_id, incarnation):
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"pods of incarnation {incarnation} of run {run_id!r} still exist {timeout:.0f} s after deletion"
                )
            time.sleep(0.2)
        return sorted(r.rank for r in observation.ranks if r.alive)

    def await_checkpoint_in_flight(self, run_id: str, incarnation: int, grace: float) -> tuple[int | None, bool]:
        """As the local backend's: give a checkpoint being written `grace` seconds to commit while pods run."""
        return self.wait_for_commit(
            run_id, grace, lambda: any(self._running(p) for p in self._pods(run_id, incarnation, watched=True).values())
        )

    # --- what the local backend does with processes, which pods do not need ----------------

    def ensure_standbys(self, run_id: str) -> None:
        """No warm standbys on Kubernetes (yet): each pod starts its interpreter."""

    def release_standbys(self, run_id: str) -> None:
        """No warm standbys on Kubernetes (yet)."""

    # --- audit ------------------------------------------------------------------------------

    def _event(
        self,
        run_id: str,
        reason: str,
        message: str,
        kind: str = "ConfigMap",
        name: str | None = None,
        namespace: str | None = None,
    ) -> None:
        settings = self._settings(run_id)
        name = name or run_object_name(run_id)
        now = datetime.now(UTC)
        event = k8s.CoreV1Event(
            metadata=k8s.V1ObjectMeta(name=f"{name}.{uuid.uuid4().hex[:12]}", namespace=settings.namespace),
            involved_object=k8s.V1ObjectReference(
                kind=kind, name=name, namespace=settings.namespace if namespace is None else namespace, api_version="v1"
            ),
            reason=reason,
            message=message[:1024],
            type="Warning" if reason in ("FaultDetected", "Quarantined") else "Normal",
            first_timestamp=now,
            last_timestamp=now,
            count=1,
            source=k8s.V1EventSource(component="lazarus"),
        )
        self.core.create_namespaced_event(settings.namespace, event)

    def record_stage(self, run_id: str, stage: str, message: str) -> None:
        """An Event on the run's ConfigMap for a recovery stage (`kubectl describe configmap` shows them)."""
        reason = "".join(part.capitalize() for part in stage.split("_"))
        self._event(run_id, reason, message)
