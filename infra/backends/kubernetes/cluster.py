"""The Kubernetes backend: nodes of a labelled pool are the unit of failure, each node's launcher
(trainer/agent/launcher.py) runs in the node's warm standby pod (infra/backends/kubernetes/pods.py) or,
cold, in a rank pod per node and incarnation, and quarantine is cordon + taint.

It implements infra/backend.py's ClusterBackend, as the local backend does. What lives where:
- the API server: which nodes belong to the pool (`lazarus.dev/pool=<pool>`), which run holds
  a node (`lazarus.dev/run=<run id>`), which nodes are hot spares (`lazarus.dev/spare=true`),
  quarantine (spec.unschedulable, a `lazarus.dev/quarantined` NoSchedule taint, a label naming
  the run and an annotation with the reason), node health (the Ready condition), the pods and
  an Event per recovery stage on the run's ConfigMap; node and pod changes reach the runs
  through two watch streams per worker (infra/backends/kubernetes/watch.py);
- the shared volume (a ReadWriteMany claim the pods and the worker mount): the run directory
  (schema/rundir.py) with its assignments, launch records, heartbeats, exits and checkpoints.

Every name derives from (run, incarnation, node index), so a retried activity finds what an
earlier attempt did: a 409 on create and a 404 on delete are success. A spare is claimed by a
label patch that carries the node's resourceVersion, so two runs racing for one spare cannot
both win: the loser's patch gets 409 Conflict.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from lazarus.infra.backend import ClusterError, Observation
from lazarus.infra.backends.kubernetes.objects import (
    POOL_LABEL,
    QUARANTINE_LABEL,
    RUN_LABEL,
    labels_of,
    name_of,
    node_address,
    node_ready,
    node_states,
    rank_pod,
    run_label,
    run_object_name,
    sick_nodes,
    stage_event,
)
from lazarus.infra.backends.kubernetes.pods import NodePods
from lazarus.infra.backends.kubernetes.pool import (
    PoolWants,
    claim_free_nodes,
    claim_node,
    node_records,
    quarantine_patch,
    release_node,
    return_patch,
)
from lazarus.infra.backends.kubernetes.watch import RunWatches
from lazarus.infra.rate import CLIENT_BURST, CLIENT_QPS, fan_out, throttle
from lazarus.infra.runfiles import RunFiles
from lazarus.schema.contract import LaunchRecord, SurvivorSource
from lazarus.schema.policy import RecoveryPolicy
from lazarus.schema.pool import SpareWant
from lazarus.schema.records import Assignment, Inventory
from lazarus.schema.run import KubernetesSettings, RunSpec
from lazarus.schema.rundir import RunDir

PODS_GONE_SECONDS = 60.0
"""How long drain waits for the API server to have removed an incarnation's pods after deleting
them (seconds). Pods on live nodes go once their kubelet confirms, within the spec's
delete_grace_seconds; pods on dead or quarantined nodes are deleted with grace 0. The drain
activity heartbeats while it waits."""

PODS_POLL_SECONDS = 0.2
"""How often drain lists the pods it waits to see gone (seconds)."""


class KubernetesCluster(RunFiles):
    """Runs' nodes as pods on a Kubernetes cluster, with run directories under `home` (the shared volume)."""

    backend = "kubernetes"
    records_stages = True
    quarantines_in_cluster = True  # a quarantined node is cordoned and tainted

    @classmethod
    def open(cls, options):
        """The cluster of the in-cluster service account, else of ~/.kube/config; ClusterError,
        one line, where neither is there."""
        try:
            return cls(options.home, qps=options.kube_qps, burst=options.kube_burst, runs=options.runs)
        except Exception as error:  # noqa: BLE001 - no kubeconfig, no service account: say so, no traceback
            raise ClusterError(f"cannot reach a Kubernetes API ({error})") from None

    def __init__(
        self,
        home: str | Path,
        api: k8s.ApiClient | None = None,
        qps: float = CLIENT_QPS,
        burst: int = CLIENT_BURST,
        runs: str | Path | None = None,
    ):
        super().__init__(home, runs)
        if api is None:
            from kubernetes import config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api = k8s.ApiClient()
        throttle(api, qps, burst)  # every request of this client, the watches' too
        self.core = k8s.CoreV1Api(api)
        self.watches = RunWatches(self.core)
        self.node_pods = NodePods(self.core, self.watches)
        self.wants = PoolWants(self.core)

    def close(self) -> None:
        """Stop the watches (the worker calls this on shutdown)."""
        self.watches.close()

    def _settings(self, run_id: str) -> KubernetesSettings:
        return self.spec(run_id).cluster.kubernetes

    # --- nodes -------------------------------------------------------------------------

    def _pool(self, settings: KubernetesSettings) -> list[k8s.V1Node]:
        return self.core.list_node(label_selector=f"{POOL_LABEL}={settings.pool}").items

    def _pool_nodes(self, settings: KubernetesSettings) -> dict[str, k8s.V1Node]:
        """The pool's nodes by name: from the watch while it is synced, else from a list."""
        cached = self.watches.cached("nodes", settings.pool)
        return cached if cached is not None else {name_of(n): n for n in self._pool(settings)}

    def _read_node(self, name: str) -> k8s.V1Node:
        try:
            return self.core.read_node(name)
        except ApiException as error:
            if error.status == 404:
                raise ClusterError(f"no node {name!r} in the cluster") from None
            raise

    def _claim(self, node_name: str, run_id: str, spare_only: bool) -> bool:
        """Label the node as this run's if it is free (infra/kubernetes_pool.claim_node); True if
        it is (now or already) this run's. A claim made now leaves an Event on the node."""
        claimed = claim_node(self.core, node_name, run_label(run_id), spare_only)
        if claimed == "claimed":
            self._event(run_id, "Claimed", f"{node_name} joins run {run_id}", kind="Node", name=node_name, namespace="")
        return claimed != "refused"

    def _release(self, node_name: str, run_id: str) -> None:
        if release_node(self.core, node_name, run_label(run_id)):
            message = f"{node_name} leaves run {run_id}: a hot spare of the pool again"
            self._event(run_id, "Released", message, kind="Node", name=node_name, namespace="")

    # --- run state -----------------------------------------------------------------------

    def create(self, run_id: str, spec: RunSpec) -> RunDir:
        """Record the run (directory, spec, ConfigMap) and claim its active nodes from the pool, once."""
        run = self.write_spec(run_id, spec)
        settings = spec.cluster.kubernetes
        config_map = k8s.V1ConfigMap(
            metadata=k8s.V1ObjectMeta(
                name=run_object_name(run_id), labels={RUN_LABEL: run_label(run_id), POOL_LABEL: settings.pool}
            ),
            data={"spec.json": spec.model_dump_json()},
        )
        _ignoring_conflict(lambda: self.core.create_namespaced_config_map(settings.namespace, config_map))
        pool = self._pool(settings)
        mine = claim_free_nodes(
            pool, run_label(run_id), spec.cluster.active_nodes, lambda n: self._claim(n, run_id, spare_only=False)
        )
        if len(mine) < spec.cluster.active_nodes:
            fan_out([lambda n=n: self._release(name_of(n), run_id) for n in mine])
            raise ClusterError(
                f"pool {settings.pool!r} has {len(mine)} free ready node(s); the run needs "
                f"{spec.cluster.active_nodes} (label more nodes {POOL_LABEL}={settings.pool})"
            )
        return run

    def inventory(self, run_id: str) -> Inventory:
        """This run's nodes (active, quarantined by it) and the pool's free hot spares."""
        self._existing(run_id)
        settings = self._settings(run_id)
        records = node_records(self._pool(settings), run_label(run_id))
        return Inventory(nodes=records, wants=self.wants.others(settings.namespace, settings.pool, run_id))

    def vet_spare(self, run_id: str, node: str) -> str | None:
        """A free node a health agent marks sick (health.node_conditions) is quarantined; returns why."""
        settings, conditions = self._settings(run_id), self.spec(run_id).health.node_conditions
        why = sick_nodes(self._pool_nodes(settings), [node], conditions).get(node)
        if why is not None:
            self.quarantine(run_id, [node], f"sick before it was handed out: {why}")
        return why

    def want_spares(self, run_id: str, want: SpareWant) -> None:
        """Lodge the run's need of the pool's spares on its ConfigMap, where the pool's runs read it."""
        settings = self._settings(run_id)
        self.wants.lodge(settings.namespace, settings.pool, want)

    def drop_want(self, run_id: str) -> None:
        """The run's recovery is over: its want comes off its ConfigMap."""
        self.wants.drop(self._settings(run_id).namespace, run_id)

    def quarantine(self, run_id: str, nodes: list[str], reason: str, counted: bool = True) -> None:
        """Cordon, taint, label with the run and annotate why; an Event each (no breaker yet: `counted` unused)."""
        for name in nodes:
            self.core.patch_node(name, quarantine_patch(self._read_node(name), run_label(run_id), reason))
            self._event(run_id, "Quarantined", f"{name}: {reason}", kind="Node", name=name, namespace="")

    def return_node(self, run_id: str, node: str) -> Inventory:
        """A repaired node goes back to the pool as a hot spare: uncordoned, untainted, unlabelled."""
        self.core.patch_node(node, return_patch(self._read_node(node)))
        message = f"{node} is back in the pool as a hot spare"
        self._event(run_id, "Returned", message, kind="Node", name=node, namespace="")
        return self.inventory(run_id)

    def rendezvous_port(self, run_id: str) -> int:
        """The spec's port on rank 0's node: the pods use the host network."""
        return self._settings(run_id).master_port

    def commit_assignment(
        self, run_id: str, assignment: Assignment, claims: Sequence[str] = (), releases: Sequence[str] = ()
    ) -> Assignment:
        """Claim the spares, record the assignment exactly once (rank 0's node address filled in),
        and release leftover nodes to the spare pool."""
        recorded = self.assignment(run_id, assignment.incarnation)
        if recorded is None:
            taken = [node for node in claims if not self._claim(node, run_id, spare_only=True)]
            if taken:
                raise ClusterError(f"node {', '.join(taken)} is no longer a free spare")
            self.wants.place(self._settings(run_id).namespace, run_id, got=len(claims))
            address = node_address(self.core.read_node(assignment.nodes[0])) or assignment.nodes[0]
            recorded = self.record_assignment(run_id, assignment.model_copy(update={"master_addr": address}))
        # Completes an attempt that crashed between its writes: claims what is not labelled the
        # run's yet (a claim of a node held already only confirms it).
        pool = self._pool_nodes(self._settings(run_id))
        missing = [n for n in recorded.nodes if n not in pool or labels_of(pool[n]).get(RUN_LABEL) != run_label(run_id)]
        held = fan_out([lambda n=n: self._claim(n, run_id, spare_only=False) for n in missing])
        lost = [n for n, took in zip(missing, held, strict=True) if not took]
        if lost:
            raise ClusterError(f"node {lost[0]} of incarnation {recorded.incarnation} is held by another run")
        fan_out([lambda n=n: self._release(n, run_id) for n in sorted(set(releases) - set(recorded.nodes))])
        return recorded

    # --- rank pods -----------------------------------------------------------------------

    def start_ranks(
        self,
        run_id: str,
        incarnation: int,
        resume_step: int,
        skipped: dict[int, str] | None = None,
        policy: RecoveryPolicy | None = None,
        survivors: SurvivorSource | None = None,
    ) -> LaunchRecord:
        """Start each node's launcher of the incarnation unless its rank pod exists: ordered from the
        node's standby pod, else (no standby, or one that did not answer) in a rank pod of its own;
        returns the launch record in force. Pods tolerate a not-ready node as `policy` says."""
        run, assignment = self._incarnation(run_id, incarnation)
        record = self.record_launch(run_id, incarnation, resume_step, skipped, survivors)
        spec = self.spec(run_id)
        namespace = spec.cluster.kubernetes.namespace
        existing = self.node_pods.rank_pods(run_id, namespace, incarnation)
        cold = [i for i in range(len(assignment.nodes)) if i not in existing]
        if spec.cluster.warm_standby and cold:
            self.ensure_standbys(run_id, policy)
            cold = self.node_pods.launch(run, namespace, assignment, cold, record.resume_step)
        pods = [rank_pod(run_id, spec, assignment, i, record.resume_step, policy or spec.recovery) for i in cold]
        fan_out(
            [
                lambda pod=pod: _ignoring_conflict(lambda: self.core.create_namespaced_pod(namespace, pod))
                for pod in pods
            ]
        )
        return record

    def observe(self, run_id: str, incarnation: int) -> Observation:
        """Pods, node Ready conditions and the ranks' heartbeat and exit files of an incarnation."""
        run, assignment = self._incarnation(run_id, incarnation)
        nodes = self._pool_nodes(self._settings(run_id))
        dead, addresses = node_states(nodes, assignment.nodes)
        observation = self._observation(run, incarnation, dead, addresses)
        observation.sick_nodes = sick_nodes(nodes, assignment.nodes, self.spec(run_id).health.node_conditions)
        running, launched = self.node_pods.launchers(run, self._settings(run_id).namespace, assignment)
        observation.launchers_alive = sum(running)
        # A pod runs a node's ranks together: the backend sees the pod, its launcher each rank's process.
        per_node = assignment.layout.ranks_per_node
        observation.nodes = self._nodes(run, assignment, running, launched=lambda rank: rank // per_node in launched)
        return observation

    async def wait_for_exit(self, run_id: str, incarnation: int, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the watch to report one of the run's nodes not ready or
        gone, or one of its pods ended or deleted; True if it did (at once if one came since the
        last wait returned, while the caller was looking)."""
        settings = self._settings(run_id)
        self.watches.start(settings.pool, settings.namespace)
        return await self.watches.wait(run_id, timeout)

    def stop_incarnation(self, run_id: str, incarnation: int) -> list[int]:
        """End the incarnation's launchers and ranks and wait until none is left; returns the ranks
        that were running.

        Survivors' standbys kill their launchers in place, and the pods stay warm for the next
        incarnation; rank pods are deleted, with the spec's grace. A node that is not ready or
        that this run quarantined loses its pods at once (grace 0): its kubelet is dead or
        suspect and would never confirm, and the node is cordoned and out of the run either way.
        A standby that does not answer has its pod deleted, as a rank pod would be.
        """
        run, assignment = self._incarnation(run_id, incarnation)
        run.end(incarnation)
        settings = self._settings(run_id)
        observation = self.observe(run_id, incarnation)
        lost = set(observation.dead_nodes) | self._lost(run_id)
        doomed = self.node_pods.stop(run, settings, assignment, lost)
        pods = self.node_pods.rank_pods(run_id, settings.namespace, incarnation)
        for grace, lost_node in ((0, True), (settings.delete_grace_seconds, False)):
            names = [name_of(pod) for i, pod in pods.items() if (assignment.nodes[i] in lost) == lost_node]
            self.node_pods.delete(names, settings.namespace, grace)
        deadline = time.monotonic() + PODS_GONE_SECONDS
        while self.node_pods.rank_pods(run_id, settings.namespace, incarnation) or doomed & set(
            self.node_pods.pods(run_id, settings.namespace, watched=False)
        ):
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"pods of incarnation {incarnation} of run {run_id!r} still exist "
                    f"{PODS_GONE_SECONDS:.0f} s after deletion"
                )
            time.sleep(PODS_POLL_SECONDS)
        return sorted(r.rank for r in observation.ranks if r.alive)

    def stop_nodes(self, run_id: str, incarnation: int, nodes: list[str]) -> list[int]:
        """Delete the incarnation's rank pods and the standby pods on `nodes` at once (grace 0: a hung
        node would never confirm) and wait until they are gone; returns the ranks that ran there."""
        run, assignment = self._incarnation(run_id, incarnation)
        namespace = self._settings(run_id).namespace
        indices = {i for i, node in enumerate(assignment.nodes) if node in nodes}
        running = sorted(r.rank for r in self.observe(run_id, incarnation).ranks if r.alive and r.node in nodes)
        standbys = self.node_pods.pods(run_id, namespace, watched=False)
        ranks = self.node_pods.rank_pods(run_id, namespace, incarnation)
        doomed = [name_of(standbys[n]) for n in nodes if n in standbys] + [
            name_of(ranks[i]) for i in indices & set(ranks)
        ]
        self.node_pods.delete(doomed, namespace, 0)
        deadline = time.monotonic() + PODS_GONE_SECONDS
        while set(doomed) & {name_of(p) for p in self._pods_of(run_id, namespace, incarnation)}:
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"pods {', '.join(doomed)} of run {run_id!r} still exist {PODS_GONE_SECONDS:.0f} s after deletion"
                )
            time.sleep(PODS_POLL_SECONDS)
        return running

    def _pods_of(self, run_id: str, namespace: str, incarnation: int) -> list:
        """The run's standby pods and the incarnation's rank pods, listed (the API server's word)."""
        standbys = self.node_pods.pods(run_id, namespace, watched=False)
        return [*standbys.values(), *self.node_pods.rank_pods(run_id, namespace, incarnation).values()]

    def _lost(self, run_id: str) -> set[str]:
        """The pool's nodes that this run quarantined or that are not ready. A fresh list, not the
        watch: the quarantine drain wrote a moment ago must be seen."""
        label = run_label(run_id)
        return {
            name_of(n)
            for n in self._pool(self._settings(run_id))
            if labels_of(n).get(QUARANTINE_LABEL) == label or not node_ready(n)[0]
        }

    def _survivors_run(self, run_id: str, incarnation: int):
        """A check whether a launcher of the incarnation runs on a node that is not lost: a lost
        node's pod may still look running (the API server may not know it died yet), and waiting
        for it would only cost the whole grace."""
        run, assignment = self._incarnation(run_id, incarnation)
        lost = self._lost(run_id)

        def alive() -> bool:
            running, _ = self.node_pods.launchers(run, self._settings(run_id).namespace, assignment)
            return any(up and node not in lost for up, node in zip(running, assignment.nodes, strict=True))

        return alive

    def await_checkpoint_in_flight(self, run_id: str, incarnation: int, grace: float) -> tuple[int | None, bool]:
        """Give a checkpoint being written `grace` seconds to commit while a launcher of the
        incarnation runs on a node that is not lost."""
        return self.wait_for_commit(run_id, grace, self._survivors_run(run_id, incarnation))

    def await_survivors(self, run_id: str, incarnation: int, grace: float) -> dict[int, int]:
        """Give the surviving ranks `grace` seconds to save their state while a launcher of the
        incarnation runs on a node that is not lost; then the warm standbys read what their
        nodes' next ranks will load."""
        saved = self.wait_for_survivors(run_id, incarnation, grace, self._survivors_run(run_id, incarnation))
        run, assignment = self._incarnation(run_id, incarnation)
        if saved and self.spec(run_id).cluster.warm_standby:
            self.node_pods.prefetch(run, self._settings(run_id).namespace, assignment, self.inventory(run_id))
        return saved

    def release_nodes(self, run_id: str) -> list[str]:
        """The run ended: unlabel its nodes, which go back to the pool as hot spares; returns them."""
        self._existing(run_id)
        mine = [
            name_of(n) for n in self._pool(self._settings(run_id)) if labels_of(n).get(RUN_LABEL) == run_label(run_id)
        ]
        fan_out([lambda name=name: self._release(name, run_id) for name in mine])
        self.drop_want(run_id)
        return mine

    def ensure_standbys(self, run_id: str, policy: RecoveryPolicy | None = None) -> None:
        """A standby pod on each healthy node of the run and each free spare of its pool, if the spec asks for them."""
        spec = self.spec(run_id)
        if not spec.cluster.warm_standby:
            return
        nodes, inventory = self._pool_nodes(spec.cluster.kubernetes), self.inventory(run_id)
        healthy = {
            n.name: node_address(nodes[n.name]) or n.name
            for n in inventory.nodes
            if n.healthy and n.role != "quarantined" and n.name in nodes
        }
        held = {n.name for n in inventory.nodes if n.role == "active"}
        self.node_pods.ensure(self.run_dir(run_id), spec, healthy, held, policy or spec.recovery)

    def release_standbys(self, run_id: str) -> None:
        """The run ended: delete its standby pods (they would only wait for their idle exit)."""
        self.node_pods.release(run_id, self._settings(run_id))

    # --- audit ------------------------------------------------------------------------------

    def _event(self, run_id: str, reason: str, message: str, kind: str, name: str, namespace: str) -> None:
        settings = self._settings(run_id)
        self.core.create_namespaced_event(
            settings.namespace, stage_event(settings.namespace, reason, message, kind, name, namespace)
        )

    def record_stage(self, run_id: str, stage: str, message: str) -> None:
        """An Event on the run's ConfigMap for a recovery stage (`kubectl describe configmap` shows them)."""
        reason = "".join(part.capitalize() for part in stage.split("_"))
        settings = self._settings(run_id)
        self._event(run_id, reason, message, "ConfigMap", run_object_name(run_id), settings.namespace)


def _ignoring_conflict(create) -> None:
    """Create an object; one that exists already (409) was created by an earlier attempt."""
    try:
        create()
    except ApiException as error:
        if error.status != 409:
            raise
