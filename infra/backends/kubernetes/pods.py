"""The pods that run a run's node launchers on Kubernetes: cold rank pods (one per node and
incarnation) and warm standby pods, one per healthy node of a run (its active nodes
and the pool's free spares), started with the run, torch imported, taking orders on a port of
the node's host network (trainer/agent/standby/port.py). A launch orders each node's standby to fork
the node's launcher; a drain orders the surviving nodes' standbys to kill their launchers and
deletes only the pods of nodes that are lost, so a recovery recreates nothing that is still
there (as JobSet's in-place restart). A node whose standby does not answer gets a cold rank pod.

What the controller needs of a standby it reads on the shared volume: `standby/<node>/ready`
({"address", "port"}, written by the standby once it listens), and it writes `standby/token`,
the secret each order carries.
"""

from __future__ import annotations

import time

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from lazarus.infra.backend import ClusterError
from lazarus.infra.backends.kubernetes.objects import (
    INCARNATION_LABEL,
    NODE_INDEX_LABEL,
    ROLE_LABEL,
    RUN_LABEL,
    labels_of,
    name_of,
    pod_node,
    pod_running,
    run_label,
    standby_pod,
    standby_pod_name,
)
from lazarus.infra.backends.kubernetes.watch import RunWatches
from lazarus.infra.rate import fan_out
from lazarus.infra.standby_orders import CONNECT_SECONDS, order_standby, write_standby_secret
from lazarus.infra.standbys import order_prefetch
from lazarus.infra.survivors import survivor_holders
from lazarus.schema.policy import RecoveryPolicy
from lazarus.schema.records import Assignment, Inventory
from lazarus.schema.run import KubernetesSettings, RunSpec
from lazarus.schema.rundir import RunDir

STANDBY_ANSWER_SECONDS = 60.0
"""How long a launch waits for a node's standby to answer (its pod may still be starting and
importing torch, as a cold pod would) before the node gets a cold rank pod instead (seconds)."""

STOP_ANSWER_SECONDS = 20.0
"""How long a drain waits for a surviving node's standby to report its launchers gone before
it deletes the standby's pod instead (seconds)."""

GONE_SECONDS = 30.0
"""How long a replaced standby pod (ended, or of a node now elsewhere) may take to be gone (seconds)."""


class NodePods:
    """A run's rank pods, its standby pods and the orders sent to them (see the module docstring)."""

    def __init__(self, core: k8s.CoreV1Api, watches: RunWatches):
        self.core, self.watches = core, watches

    def pods(self, run_id: str, namespace: str, watched: bool = True) -> dict[str, k8s.V1Pod]:
        """The run's standby pods by node name: from the watch if `watched` and it is synced, else a list."""
        mine = {RUN_LABEL: run_label(run_id), ROLE_LABEL: "standby"}
        return {pod_node(p): p for p in self._listed(mine, namespace, watched)}

    def ensure(self, run: RunDir, spec: RunSpec, nodes: dict[str, str], held: set[str], policy: RecoveryPolicy) -> None:
        """Give each of `nodes` (name: address) a running standby pod, and delete the run's
        standby pods elsewhere (nodes released, quarantined or claimed by another run) and those
        that ended (a standby leaves when its run idles), so that they can be created anew.
        Other runs' standby pods on the nodes the run `held` go: they kept a free spare warm
        for their runs, and would hold the resources this run's pods need there."""
        run_id, namespace = run.root.name, spec.cluster.kubernetes.namespace
        write_standby_secret(run)
        existing = self.pods(run_id, namespace, watched=False)
        stale = [p for node, p in existing.items() if node not in nodes or not pod_running(p)]
        foreign = [
            p
            for p in self._listed({ROLE_LABEL: "standby"}, namespace, watched=False)
            if pod_node(p) in held and labels_of(p).get(RUN_LABEL) != run_label(run_id)
        ]
        self.delete([name_of(p) for p in stale + foreign], namespace, grace=0)
        wanted = [node for node in nodes if node not in existing or not pod_running(existing[node])]
        if not wanted:
            return
        self._wait_gone(run_id, namespace, {pod_node(p) for p in stale} & set(wanted))

        def create(node: str) -> None:
            home = run.standby(node)
            home.mkdir(parents=True, exist_ok=True)
            (home / "ready").unlink(missing_ok=True)  # an earlier standby's port: not this one's
            pod = standby_pod(run_id, spec, node, nodes[node], policy)
            try:
                self.core.create_namespaced_pod(namespace, pod)
            except ApiException as error:
                if error.status != 409:  # created by an earlier attempt
                    raise

        fan_out([lambda node=node: create(node) for node in wanted])

    def _wait_gone(self, run_id: str, namespace: str, nodes: set[str]) -> None:
        deadline = time.monotonic() + GONE_SECONDS
        while nodes & set(self.pods(run_id, namespace, watched=False)):
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"standby pods on {', '.join(sorted(nodes))} still exist {GONE_SECONDS:.0f} s after deletion"
                )
            time.sleep(0.05)

    def delete(self, names: list[str], namespace: str, grace: int) -> None:
        """Delete pods by name, with `grace` seconds (gone already is fine); does not wait."""

        def delete(name: str) -> None:
            try:
                self.core.delete_namespaced_pod(name, namespace, grace_period_seconds=grace)
            except ApiException as error:
                if error.status != 404:
                    raise

        fan_out([lambda name=name: delete(name) for name in names])

    def _running(self, run_id: str, namespace: str, node: str) -> bool:
        """Whether the node's standby pod runs: the watch's word, checked with the API server's
        where the watch says no (it may not have brought a pod created a moment ago, in place of
        one that ended under the same name)."""
        if pod_running(self.pods(run_id, namespace).get(node)):
            return True
        return pod_running(self.pods(run_id, namespace, watched=False).get(node))

    def rank_pods(self, run_id: str, namespace: str, incarnation: int, watched: bool = False) -> dict[int, k8s.V1Pod]:
        """The incarnation's rank pods by node index: from the watch if `watched` and it is synced,
        else from a list (drain's deletions and its wait for them use a list: the API server's word)."""
        mine = {RUN_LABEL: run_label(run_id), INCARNATION_LABEL: str(incarnation)}
        return {int(labels_of(p)[NODE_INDEX_LABEL]): p for p in self._listed(mine, namespace, watched)}

    def _listed(self, labels: dict[str, str], namespace: str, watched: bool) -> list[k8s.V1Pod]:
        cached = self.watches.cached("pods", namespace) if watched else None
        if cached is not None:
            return [p for p in cached.values() if all(labels_of(p).get(k) == v for k, v in labels.items())]
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        return self.core.list_namespaced_pod(namespace, label_selector=selector).items

    def launchers(self, run: RunDir, namespace: str, assignment: Assignment) -> tuple[list[bool], set[int]]:
        """Whether each node's launcher runs, and the nodes whose launcher started. A cold node's
        launcher is its rank pod; a warm one runs in the node's standby pod from the moment it
        records its pid until its standby records its end."""
        k, standbys = assignment.incarnation, self.pods(run.root.name, namespace)
        rank_pods = self.rank_pods(run.root.name, namespace, k, watched=True)
        running, launched = [], set(rank_pods)
        for index, node in enumerate(assignment.nodes):
            if index in rank_pods:
                running.append(pod_running(rank_pods[index]))
                continue
            started = run.node_pid_file(k, index).exists()
            if started:
                launched.add(index)
            ended = started and run.launcher_exit_file(k, index).exists()
            running.append(started and pod_running(standbys.get(node)) and not ended)
        return running, launched

    def launch(self, run: RunDir, namespace: str, assignment: Assignment, indexes: list[int], resume_step: int):
        """Order the standbys of the nodes at `indexes` to start their launchers of the
        assignment's incarnation; returns the indexes of those that did not answer, whose
        standby pods are deleted (a rank pod takes the node's resources instead)."""
        order = {"incarnation": assignment.incarnation, "resume_step": resume_step}

        def launch(index: int) -> dict | None:
            node = assignment.nodes[index]
            return self.order(run, namespace, node, {**order, "node_index": index}, STANDBY_ANSWER_SECONDS)

        answers = fan_out([lambda i=i: launch(i) for i in indexes])
        cold = [i for i, answer in zip(indexes, answers, strict=True) if answer is None]
        self.delete([standby_pod_name(run.root.name, assignment.nodes[i]) for i in cold], namespace, grace=0)
        return cold

    def stop(self, run: RunDir, settings: KubernetesSettings, assignment: Assignment, lost: set[str]) -> set[str]:
        """Drain's share: the standbys of surviving nodes that run a launcher of the incarnation kill
        their launchers (of it and any older one) in place; the standby pods of `lost` nodes are
        deleted at once (grace 0), and those of standbys that did not report their launchers gone
        with the spec's grace. Returns the nodes whose standby pods were deleted (drain waits for them)."""
        k, namespace = assignment.incarnation, settings.namespace
        standbys = self.pods(run.root.name, namespace, watched=False)
        warm = [
            node
            for i, node in enumerate(assignment.nodes)
            if node in standbys and node not in lost and run.node_pid_file(k, i).exists()
        ]
        answers = fan_out([lambda n=n: self.order(run, namespace, n, {"stop": k}, STOP_ANSWER_SECONDS) for n in warm])
        silent = {node for node, answer in zip(warm, answers, strict=True) if answer is None or answer.get("alive")}
        for grace, nodes in ((0, lost), (settings.delete_grace_seconds, silent - lost)):
            self.delete([name_of(standbys[n]) for n in nodes if n in standbys], namespace, grace)
        return (lost | silent) & set(standbys)

    def release(self, run_id: str, settings: KubernetesSettings) -> None:
        """Delete the run's standby pods, with the spec's grace; does not wait."""
        names = [name_of(p) for p in self.pods(run_id, settings.namespace, watched=False).values()]
        self.delete(names, settings.namespace, grace=settings.delete_grace_seconds)

    def prefetch(self, run: RunDir, namespace: str, assignment: Assignment, inventory: Inventory) -> None:
        """After the survivors saved their states: have the healthy nodes' standbys read those
        their next ranks will load (infra/standbys.order_prefetch), off the critical path."""
        found = survivor_holders(run, assignment.incarnation, assignment.layout, verify=False)
        if found is not None:

            def send(node: str, order: dict) -> None:
                self.order(run, namespace, node, order, CONNECT_SECONDS)

            order_prefetch(run, assignment, inventory, found[1], send)

    def order(self, run: RunDir, namespace: str, node: str, order: dict, timeout: float) -> dict | None:
        """Send one order to the node's standby and return its answer; None if the standby's pod is
        not running or it did not answer within `timeout` seconds."""
        return order_standby(run, node, order, timeout, lambda: self._running(run.root.name, namespace, node))
