"""The Kubernetes backend against the emulator: claims, quarantine, rank pods, observation, drain."""

from __future__ import annotations

import threading

import pytest

from lazarus.infra.backend import ClusterError
from lazarus.infra.backends.kubernetes.cluster import KubernetesCluster
from lazarus.infra.backends.kubernetes.objects import (
    QUARANTINE_LABEL,
    QUARANTINE_TAINT,
    RUN_LABEL,
    SPARE_LABEL,
    pod_name,
    rank_pod,
    run_label,
    run_object_name,
    standby_pod_name,
)
from lazarus.schema import Assignment, parse_spec
from lazarus.schema.contract import ENV_NODE, ENV_STANDBY_ADDRESS
from tests.support.kubernetes import add_node, set_ready


def k8s_spec(home, active: int = 2, spares: int = 1, pool: str = "test"):
    return parse_spec(
        {
            "name": "kube",
            "layout": {"dp": active},
            "trainer": {"steps": 30, "checkpoint_every": 10},
            "cluster": {
                "backend": "kubernetes",
                "active_nodes": active,
                "spare_nodes": spares,
                "warm_standby": False,  # the rank pods themselves (no kubelet runs standbys here)
                "kubernetes": {"namespace": "lz", "pool": pool, "mount_path": str(home), "image": "trainer:test"},
            },
        }
    )


@pytest.fixture
def pool(admin):
    for i in range(3):
        add_node(admin, f"worker-{i}", address=f"10.0.0.{i + 1}")
    add_node(admin, "spare-0", spare=True, address="10.0.1.1")
    add_node(admin, "elsewhere", pool="other")
    return admin


def launched(cluster: KubernetesCluster, run_id: str, spec) -> Assignment:
    cluster.create(run_id, spec)
    active = sorted(n.name for n in cluster.inventory(run_id).nodes if n.role == "active")
    assignment = cluster.commit_assignment(
        run_id,
        Assignment(incarnation=0, nodes=active, layout=spec.layout, master_port=cluster.rendezvous_port(run_id)),
    )
    cluster.start_ranks(run_id, 0, resume_step=0)
    return assignment


def test_a_run_claims_ordinary_nodes_first_and_sees_the_pools_spares(pool, backend_api, tmp_path):
    cluster = KubernetesCluster(tmp_path, backend_api)
    spec = k8s_spec(tmp_path)
    assignment = launched(cluster, "r1", spec)
    assert assignment.nodes == ["worker-0", "worker-1"]
    # Rank 0's node address and the spec's port: the pods use the host network.
    assert (assignment.master_addr, assignment.master_port) == ("10.0.0.1", 29500)
    roles = {n.name: n.role for n in cluster.inventory("r1").nodes}
    assert roles == {"worker-0": "active", "worker-1": "active", "spare-0": "spare"}  # worker-2 is free, not a spare
    assert (pool.read_node("worker-0").metadata.labels or {})[RUN_LABEL] == "r1"
    # A second create (a retried launch) claims nothing more.
    cluster.create("r1", spec)
    assert sorted(n.metadata.name for n in pool.list_node(label_selector=f"{RUN_LABEL}=r1").items) == [
        "worker-0",
        "worker-1",
    ]


def test_not_enough_free_nodes_is_a_clear_error_and_claims_nothing(pool, backend_api, tmp_path):
    cluster = KubernetesCluster(tmp_path, backend_api)
    with pytest.raises(ClusterError, match="pool 'test' has 4 free ready node"):
        cluster.create("big", k8s_spec(tmp_path, active=5))
    assert pool.list_node(label_selector=RUN_LABEL).items == []


def test_two_runs_racing_for_one_spare_exactly_one_wins(pool, backend_api, tmp_path):
    cluster = KubernetesCluster(tmp_path, backend_api)
    for run_id in ("a", "b"):
        cluster.write_spec(run_id, k8s_spec(tmp_path))  # a claim's Event names its run's namespace
    results = {}
    start = threading.Barrier(2)

    def claim(run_id: str) -> None:
        start.wait()
        results[run_id] = cluster._claim("spare-0", run_id, spare_only=True)

    threads = [threading.Thread(target=claim, args=(run_id,)) for run_id in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results.values()) == [False, True]
    winner = next(run_id for run_id, won in results.items() if won)
    labels = pool.read_node("spare-0").metadata.labels
    assert labels[RUN_LABEL] == winner and SPARE_LABEL not in labels


def test_a_stale_claim_loses_to_a_newer_write(pool, backend_api, tmp_path):
    # The claim's patch carries the version it read; a change in between (here the other run's
    # claim) makes the API server refuse it, even though the node looked free when read.
    node = pool.read_node("spare-0")
    pool.patch_node("spare-0", {"metadata": {"labels": {RUN_LABEL: "other"}}})
    from kubernetes.client.rest import ApiException

    with pytest.raises(ApiException) as refused:
        pool.patch_node(
            "spare-0", {"metadata": {"labels": {RUN_LABEL: "mine"}, "resourceVersion": node.metadata.resource_version}}
        )
    assert refused.value.status == 409
    assert KubernetesCluster(tmp_path, backend_api)._claim("spare-0", "mine", spare_only=True) is False


def test_quarantine_cordons_taints_labels_and_writes_events(pool, backend_api, emulator, tmp_path):
    cluster = KubernetesCluster(tmp_path, backend_api)
    launched(cluster, "r1", k8s_spec(tmp_path))
    cluster.quarantine("r1", ["worker-1"], "node_down: backend reports node worker-1 dead")
    node = pool.read_node("worker-1")
    assert node.spec.unschedulable is True
    assert [(t.key, t.value, t.effect) for t in node.spec.taints] == [(QUARANTINE_TAINT, "r1", "NoSchedule")]
    assert node.metadata.labels[QUARANTINE_LABEL] == "r1" and RUN_LABEL not in node.metadata.labels
    assert {n.name: n.role for n in cluster.inventory("r1").nodes}["worker-1"] == "quarantined"
    cluster.record_stage("r1", "drained", "stopped incarnation 0")
    events = pool.list_namespaced_event("lz").items
    assert {(e.involved_object.kind, e.involved_object.name, e.reason) for e in events} == {
        ("Node", "worker-0", "Claimed"),  # at launch
        ("Node", "worker-1", "Claimed"),
        ("Node", "worker-1", "Quarantined"),
        ("ConfigMap", run_object_name("r1"), "Drained"),
    }
    # Returned after repair: uncordoned, untainted, a hot spare of the pool.
    cluster.return_node("r1", "worker-1")
    node = pool.read_node("worker-1")
    assert not node.spec.unschedulable and not node.spec.taints
    assert node.metadata.labels[SPARE_LABEL] == "true" and QUARANTINE_LABEL not in node.metadata.labels


def test_rank_pods_are_created_once_pinned_and_tolerate_a_dead_node_briefly(pool, backend_api, tmp_path):
    cluster = KubernetesCluster(tmp_path, backend_api)
    launched(cluster, "r1", k8s_spec(tmp_path))
    cluster.start_ranks("r1", 0, resume_step=0)  # retried: 409 on create is success
    pods = pool.list_namespaced_pod("lz", label_selector=f"{RUN_LABEL}=r1").items
    assert sorted((p.metadata.name, p.spec.node_name) for p in pods) == [
        (pod_name("r1", 0, 0), "worker-0"),
        (pod_name("r1", 0, 1), "worker-1"),
    ]
    pod = next(p for p in pods if p.spec.node_name == "worker-1")
    assert {(t.key, t.toleration_seconds) for t in pod.spec.tolerations} == {
        ("node.kubernetes.io/not-ready", 10),
        ("node.kubernetes.io/unreachable", 10),
    }
    # The policy in force (an operator's set_policy) shapes the next incarnation's pods.
    spec = cluster.spec("r1")
    later = rank_pod(
        "r1",
        spec,
        cluster.assignment("r1", 0),
        1,
        0,
        spec.recovery.model_copy(update={"not_ready_toleration_seconds": 30}),
    )
    assert {t.toleration_seconds for t in later.spec.tolerations} == {30}
    env = {e.name: e.value for e in pod.spec.containers[0].env}
    assert env["LAZARUS_RUN_DIR"] == f"{tmp_path}/runs/r1" and env["LAZARUS_NODE_INDEX"] == "1"
    assert pod.spec.host_network and pod.spec.restart_policy == "Never"


def test_a_node_that_is_not_ready_is_dead_and_drain_deletes_every_pod(pool, backend_api, confirming_kubelet, tmp_path):
    cluster = KubernetesCluster(tmp_path, backend_api)
    launched(cluster, "r1", k8s_spec(tmp_path))
    set_ready(pool, "worker-1", "Unknown", when="2026-11-30T10:00:00Z")
    confirming_kubelet.dead.add("worker-1")  # its kubelet is gone: only a delete of grace 0 removes its pod
    observation = cluster.observe("r1", 0)
    assert list(observation.dead_nodes) == ["worker-1"]
    assert observation.dead_nodes["worker-1"].isoformat() == "2026-11-30T10:00:00+00:00"
    assert cluster.stop_incarnation("r1", 0) == [0, 1]
    assert pool.list_namespaced_pod("lz", label_selector=f"{RUN_LABEL}=r1").items == []
    assert cluster.stop_incarnation("r1", 0) == []  # again: nothing left, 404s are success
    assert cluster.run_dir("r1").ended_file(0).exists()


def test_stop_nodes_deletes_only_the_pods_of_a_hung_node_at_once(pool, backend_api, confirming_kubelet, tmp_path):
    cluster = KubernetesCluster(tmp_path, backend_api)
    launched(cluster, "r1", k8s_spec(tmp_path))
    confirming_kubelet.dead.add("worker-1")  # a hung node's kubelet never confirms: only grace 0 removes its pod
    assert cluster.stop_nodes("r1", 0, ["worker-1"]) == [1]
    left = pool.list_namespaced_pod("lz", label_selector=f"{RUN_LABEL}=r1").items
    assert [p.spec.node_name for p in left] == ["worker-0"]
    assert cluster.stop_nodes("r1", 0, ["worker-1"]) == []  # again: nothing left there
    assert cluster.stop_incarnation("r1", 0) == [0]


def test_replacing_claims_the_spare_exactly_once_and_releases_leftovers(pool, backend_api, tmp_path):
    cluster = KubernetesCluster(tmp_path, backend_api)
    old = launched(cluster, "r1", k8s_spec(tmp_path))
    cluster.quarantine("r1", ["worker-1"], "node_down")
    proposal = old.model_copy(update={"incarnation": 1, "nodes": ["worker-0", "spare-0"]})
    first = cluster.commit_assignment("r1", proposal, claims=["spare-0"])
    again = cluster.commit_assignment("r1", proposal.model_copy(update={"master_port": 7}), claims=["spare-0"])
    assert first == again and first.nodes == ["worker-0", "spare-0"]
    assert [n.metadata.name for n in pool.list_node(label_selector=f"{RUN_LABEL}=r1").items] == ["worker-0", "spare-0"]
    # Another run cannot take the spare now.
    other = KubernetesCluster(tmp_path, backend_api)
    other.create("r2", k8s_spec(tmp_path, active=1))
    with pytest.raises(ClusterError, match="spare-0 is no longer a free spare"):
        other.commit_assignment(
            "r2",
            Assignment(incarnation=1, nodes=["spare-0"], layout=k8s_spec(tmp_path, 1).layout, master_port=1),
            claims=["spare-0"],
        )
    # A reshard onto fewer nodes gives the leftover back to the pool as a hot spare.
    cluster.commit_assignment(
        "r1", first.model_copy(update={"incarnation": 2, "nodes": ["spare-0"]}), releases=["worker-0"]
    )
    assert pool.read_node("worker-0").metadata.labels[SPARE_LABEL] == "true"
    assert {n.name: n.role for n in cluster.inventory("r1").nodes}["worker-0"] == "spare"


def test_a_run_id_that_is_no_kubernetes_name_still_claims_runs_and_quarantines(
    pool, backend_api, confirming_kubelet, tmp_path
):
    """Run ids allow capitals, '_', '.' and 100 characters; names and label values do not: the
    backend writes the mapped forms (run_label, object_name) and finds its objects by them."""
    run_id = "Nightly_Run." + "x" * 60 + "_"
    cluster = KubernetesCluster(tmp_path, backend_api)
    launched(cluster, run_id, k8s_spec(tmp_path))
    label = run_label(run_id)
    assert label != run_id and len(label) <= 63
    claimed = pool.list_node(label_selector=f"{RUN_LABEL}={label}").items
    assert sorted(n.metadata.name for n in claimed) == ["worker-0", "worker-1"]
    pods = pool.list_namespaced_pod("lz", label_selector=f"{RUN_LABEL}={label}").items
    assert sorted(p.metadata.name for p in pods) == sorted(pod_name(run_id, 0, i) for i in (0, 1))
    assert all(len(p.metadata.name) <= 63 and p.metadata.name.islower() for p in pods)
    cluster.quarantine(run_id, ["worker-1"], "node_down")
    assert {n.name: n.role for n in cluster.inventory(run_id).nodes}["worker-1"] == "quarantined"
    assert [t.value for t in pool.read_node("worker-1").spec.taints] == [label]
    cluster.stop_incarnation(run_id, 0)
    assert pool.list_namespaced_pod("lz", label_selector=f"{RUN_LABEL}={label}").items == []


def warm(spec):
    """The spec with warm standby pods (the default)."""
    return spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"warm_standby": True})})


def standby_pods(admin) -> dict[str, list[str]]:
    """Standby pods of every run, as run label: sorted node names."""
    found: dict[str, list[str]] = {}
    for pod in admin.list_namespaced_pod("lz", label_selector="lazarus.dev/role=standby").items:
        found.setdefault(pod.metadata.labels[RUN_LABEL], []).append(pod.spec.node_name)
    return {run: sorted(nodes) for run, nodes in found.items()}


def test_standby_pods_keep_each_healthy_node_warm_and_a_claimed_spare_drops_other_runs(pool, backend_api, tmp_path):
    """Standby pods go on a run's active nodes and the pool's free spare, listening on the node's
    address; the run that takes the spare deletes the other run's standby pod there, and the
    other run's next launch no longer keeps one on it."""
    add_node(pool, "worker-3", address="10.0.0.4")
    first, second = KubernetesCluster(tmp_path, backend_api), KubernetesCluster(tmp_path, backend_api)
    first.create("r1", warm(k8s_spec(tmp_path, active=2)))
    second.create("r2", warm(k8s_spec(tmp_path, active=2)))
    first.ensure_standbys("r1")
    second.ensure_standbys("r2")
    assert standby_pods(pool) == {"r1": ["spare-0", "worker-0", "worker-1"], "r2": ["spare-0", "worker-2", "worker-3"]}
    pod = pool.read_namespaced_pod(standby_pod_name("r1", "worker-1"), "lz")
    env = {e.name: e.value for e in pod.spec.containers[0].env}
    assert pod.spec.host_network and pod.spec.containers[0].command == ["python", "-m", "lazarus.trainer.agent.standby"]
    assert env[ENV_NODE] == "worker-1" and env[ENV_STANDBY_ADDRESS] == "10.0.0.2" and env["OMP_NUM_THREADS"] == "1"

    layout = k8s_spec(tmp_path).layout
    first.commit_assignment(
        "r1", Assignment(incarnation=1, nodes=["worker-0", "spare-0"], layout=layout, master_port=1), claims=["spare-0"]
    )
    first.ensure_standbys("r1")
    second.ensure_standbys("r2")
    assert standby_pods(pool) == {"r1": ["spare-0", "worker-0", "worker-1"], "r2": ["worker-2", "worker-3"]}
