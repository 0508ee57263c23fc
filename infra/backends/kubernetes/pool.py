"""What the runs of a Kubernetes pool share: its nodes, claimed by a label patch guarded by the
node's resourceVersion, and the runs' needs of its spares (schema/pool.py SpareWant), each on its
own run's ConfigMap as an annotation, the ConfigMap labelled with the pool so that every run of
the pool finds the others' with one list.

Each run writes only its own ConfigMap, so no want races another run's; what keeps a spare from
being claimed twice is the claim's guarded patch.
"""

from __future__ import annotations

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from lazarus.infra.backends.kubernetes.objects import (
    POOL_LABEL,
    QUARANTINE_LABEL,
    QUARANTINE_TAINT,
    REASON_ANNOTATION,
    RUN_LABEL,
    SPARE_LABEL,
    annotations_of,
    labels_of,
    meta,
    name_of,
    node_free,
    node_ready,
    other_taints,
    run_object_name,
)
from lazarus.infra.rate import fan_out
from lazarus.schema.pool import SpareWant
from lazarus.schema.records import NodeRecord

WANT_ANNOTATION = "lazarus.dev/spare-want"
"""The run's SpareWant as JSON, on its ConfigMap, from its drain to the end of its resume."""


def claim_node(core: k8s.CoreV1Api, node_name: str, label: str, spare_only: bool) -> str:
    """Label the node with the run's `label` if it is free (a hot spare, if `spare_only`): "claimed"
    now, "held" already, or "refused".

    The patch carries the resourceVersion the node was read at: if anything changed the node
    since (another run's claim), the API server refuses it with 409 and this one loses.
    """
    node = core.read_node(node_name)
    labels = labels_of(node)
    if labels.get(RUN_LABEL) == label:
        return "held"
    if not node_free(node) or (spare_only and labels.get(SPARE_LABEL) != "true"):
        return "refused"
    claim = {"labels": {RUN_LABEL: label, SPARE_LABEL: None}, "resourceVersion": meta(node).resource_version}
    try:
        core.patch_node(node_name, {"metadata": claim})
    except ApiException as error:
        if error.status != 409:
            raise
        return "held" if labels_of(core.read_node(node_name)).get(RUN_LABEL) == label else "refused"
    return "claimed"


def node_records(pool: list[k8s.V1Node], label: str) -> list[NodeRecord]:
    """The inventory of the run labelled `label` from its pool's nodes: its active ones, those it
    quarantined, and the pool's free hot spares."""
    records = []
    for node in pool:
        labels = labels_of(node)
        ready, since = node_ready(node)
        if labels.get(RUN_LABEL) == label:
            role, note = "active", ""
        elif labels.get(QUARANTINE_LABEL) == label:
            role, note = "quarantined", annotations_of(node).get(REASON_ANNOTATION, "")
        elif labels.get(SPARE_LABEL) == "true" and node_free(node):
            role, note = "spare", "hot spare of the pool"
        else:
            continue
        records.append(NodeRecord(name=name_of(node), role=role, healthy=ready, died_at=since, note=note))
    return records


def quarantine_patch(node: k8s.V1Node, label: str, reason: str) -> dict:
    """The patch that quarantines a node for the run labelled `label`: cordoned, tainted (its other
    taints kept), labelled with the run instead of held by it, annotated with why."""
    taint = {"key": QUARANTINE_TAINT, "value": label, "effect": "NoSchedule"}
    return {
        "spec": {"unschedulable": True, "taints": [*other_taints(node), taint]},
        "metadata": {
            "labels": {QUARANTINE_LABEL: label, RUN_LABEL: None},
            "annotations": {REASON_ANNOTATION: reason[:1000]},
        },
    }


def return_patch(node: k8s.V1Node) -> dict:
    """The patch that returns a repaired node to the pool as a hot spare: uncordoned, untainted
    (its other taints kept), no longer labelled or annotated as quarantined."""
    return {
        "spec": {"unschedulable": False, "taints": other_taints(node) or None},
        "metadata": {"labels": {QUARANTINE_LABEL: None, SPARE_LABEL: "true"}, "annotations": {REASON_ANNOTATION: None}},
    }


def release_node(core: k8s.CoreV1Api, node_name: str, label: str) -> bool:
    """Give a node the run labelled `label` holds back to the pool as a hot spare; False if it held none."""
    node = core.read_node(node_name)
    if labels_of(node).get(RUN_LABEL) != label:
        return False
    core.patch_node(node_name, {"metadata": {"labels": {RUN_LABEL: None, SPARE_LABEL: "true"}}})
    return True


class PoolWants:
    """The spare wants of the runs of one namespace."""

    def __init__(self, core: k8s.CoreV1Api):
        self.core = core

    def lodge(self, namespace: str, pool: str, want: SpareWant) -> None:
        """Put the run's want on its ConfigMap (in place of an earlier one, unless that is the same
        fault's and placed: the stages ran again after their claim, and the need is met)."""
        config_map = self.core.read_namespaced_config_map(run_object_name(want.run_id), namespace)
        if (text := annotations_of(config_map).get(WANT_ANNOTATION)) is not None:
            lodged = SpareWant.model_validate_json(text)
            if lodged.placed and (lodged.incarnation, lodged.fault_at) == (want.incarnation, want.fault_at):
                return
        self._put(namespace, pool, want)

    def _put(self, namespace: str, pool: str, want: SpareWant) -> None:
        patch = {"metadata": {"labels": {POOL_LABEL: pool}, "annotations": {WANT_ANNOTATION: want.model_dump_json()}}}
        self.core.patch_namespaced_config_map(run_object_name(want.run_id), namespace, patch)

    def drop(self, namespace: str, run_id: str) -> None:
        """Take the run's want off its ConfigMap (gone already is fine)."""
        try:
            patch = {"metadata": {"annotations": {WANT_ANNOTATION: None}}}
            self.core.patch_namespaced_config_map(run_object_name(run_id), namespace, patch)
        except ApiException as error:
            if error.status != 404:
                raise

    def place(self, namespace: str, run_id: str, got: int) -> None:
        """Mark the run's want placed with the spares it claimed: it no longer competes."""
        config_map = self.core.read_namespaced_config_map(run_object_name(run_id), namespace)
        text = annotations_of(config_map).get(WANT_ANNOTATION)
        if text is None:
            return
        want = SpareWant.model_validate_json(text)
        if not want.placed:
            self._put(
                namespace,
                labels_of(config_map).get(POOL_LABEL, ""),
                want.model_copy(update={"placed": True, "got": got}),
            )

    def others(self, namespace: str, pool: str, run_id: str) -> list[SpareWant]:
        """The wants of the pool's other runs."""
        listed = self.core.list_namespaced_config_map(namespace, label_selector=f"{POOL_LABEL}={pool}").items
        wants = []
        for config_map in listed:
            text = annotations_of(config_map).get(WANT_ANNOTATION)
            if text is not None:
                want = SpareWant.model_validate_json(text)
                if want.run_id != run_id:
                    wants.append(want)
        return sorted(wants, key=lambda w: w.run_id)


def claim_free_nodes(pool: list[k8s.V1Node], label: str, count: int, claim) -> list[k8s.V1Node]:
    """The nodes of `pool` held by the run labelled `label`, with free ones claimed (`claim(name)`:
    True if taken) until it holds `count`; fewer if the pool has not that many free."""
    mine = [n for n in pool if labels_of(n).get(RUN_LABEL) == label]
    # Spares last: a run takes ordinary free nodes first and leaves the hot spares for recoveries.
    candidates = sorted(
        (n for n in pool if node_free(n)),
        key=lambda n: (labels_of(n).get(SPARE_LABEL) == "true", name_of(n)),
    )
    while candidates and len(mine) < count:
        # As many claims at once as nodes are missing; another run's claim can refuse some.
        batch, candidates = candidates[: count - len(mine)], candidates[count - len(mine) :]
        claimed = fan_out([lambda n=n: claim(name_of(n)) for n in batch])
        mine += [n for n, took in zip(batch, claimed, strict=True) if took]
    return mine
