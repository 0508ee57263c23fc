"""The TrainingRun workflow on a real Temporal dev server drives the Kubernetes backend against the
emulator, with the fake kubelet running the real launcher and trainer in the rank pods."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from lazarus.client.config import Settings
from lazarus.client.runs import start_run
from lazarus.infra.backend import free_port
from lazarus.infra.backends.kubernetes.cluster import KubernetesCluster
from lazarus.infra.backends.kubernetes.objects import QUARANTINE_TAINT, RUN_LABEL, run_object_name, standby_pod_name
from lazarus.schema import RunState, load_spec, parse_spec
from lazarus.schema.files import read_json
from lazarus.worker import build_worker
from tests.support import waiting
from tests.support.runs import SMALL_SPEC, assert_restored_from_survivors, losses, trained_step

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def kubernetes_spec(home, **recovery):
    """The small end-to-end spec (dp4, 40 steps) on the kubernetes backend, run directories under
    `home`, with these recovery settings changed."""
    data = load_spec(SMALL_SPEC).model_dump(mode="json")
    data["recovery"] |= recovery
    data["cluster"] = {
        "backend": "kubernetes",
        "active_nodes": 4,
        "spare_nodes": 1,
        "kubernetes": {
            "namespace": "lz",
            "pool": "test",
            "mount_path": str(home),
            "image": "trainer:test",
            "delete_grace_seconds": 1,
            # Every emulated node is this host: a port of its own, free of other runs' rendezvous.
            "master_port": free_port(),
        },
    }
    return parse_spec(data)


async def wait_until(condition, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        await asyncio.sleep(0.05)
    return value


def completed_incident(kubelet, status):
    """The one incident of a run that completed, with the kubelet having run cleanly."""
    assert kubelet.errors == []
    assert status.state == RunState.COMPLETED, status.reason
    [incident] = status.incidents
    return incident


@pytest.mark.parametrize("api_learns", [True, False], ids=["api-learns-first", "survivors-report-first"])
async def test_a_node_lost_on_kubernetes_is_replaced_by_the_spare(
    dev_env, admin, clusters, training_pool, reference_losses, tmp_path, api_learns
):
    # api_learns=False: the API server still shows the node Ready and its pod Running (as within
    # Kubernetes' 40 s node-monitor grace); the survivors' lost-peer errors must blame it.
    home = tmp_path / "volume"
    kubelet = training_pool
    cluster = clusters(home)
    spec = kubernetes_spec(home)
    run_id = f"kube-{uuid.uuid4().hex[:6]}"
    queue = f"k8s-{uuid.uuid4().hex[:8]}"
    async with build_worker(dev_env.client, queue, cluster):
        handle = await start_run(dev_env.client, Settings(task_queue=queue, home=home), spec, run_id)
        run = cluster.run_dir(run_id)
        await wait_until(lambda: trained_step(run) >= 15, "the run to train 15 steps")
        kubelet.kill_node("worker-2", api_learns=api_learns)
        status = await asyncio.wait_for(handle.result(), 240)
    incident = completed_incident(kubelet, status)
    assert incident.fault.kind == "node_down" and incident.fault.nodes == ["worker-2"], incident.fault.reason
    assert ("went silent" in incident.fault.reason) == (not api_learns)
    assert incident.decision.action == "replace" and incident.new_assignment.nodes == [
        "worker-0",
        "worker-1",
        "spare-0",
        "worker-3",
    ]

    # The lost node is cordoned, tainted and labelled with the run; the spare joined it, and is back
    # in the pool with the other nodes now that the run is over.
    lost = admin.read_node("worker-2")
    assert lost.spec.unschedulable and [t.key for t in lost.spec.taints] == [QUARANTINE_TAINT]
    assert claims_of(admin, run_id) == ["spare-0", "worker-0", "worker-1", "worker-2", "worker-3"]
    for name in ("spare-0", "worker-0", "worker-1", "worker-3"):
        labels = admin.read_node(name).metadata.labels
        assert RUN_LABEL not in labels and labels["lazarus.dev/spare"] == "true", (name, labels)
    assert_ran_in_place(kubelet, admin, cluster.run_dir(run_id), incident)
    # An Event for each recovery stage on the run's ConfigMap, and one on the quarantined node.
    events = admin.list_namespaced_event("lz").items
    on_run = {e.reason for e in events if e.involved_object.name == run_object_name(run_id)}
    assert {"FaultDetected", "Drained", "Rescheduled", "Replaced", "Resuming"} <= on_run
    assert any(e.reason == "Quarantined" and e.involved_object.name == "worker-2" for e in events)

    # The survivors' pods saved the interrupted step: no completed step is trained twice.
    assert_restored_from_survivors(cluster.run_dir(run_id), incident)
    # What the trainer computed: every step, and the resumed steps bit for bit as without a fault.
    trained = losses(cluster.run_dir(run_id))
    assert sorted(trained) == list(range(1, spec.trainer.steps + 1))
    assert trained == reference_losses


def kubeconfig(path, url: str) -> str:
    """A kubeconfig pointing at the emulator, for a worker running as its own process."""
    import yaml

    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "emulator",
                "clusters": [{"name": "emulator", "cluster": {"server": url}}],
                "users": [{"name": "test", "user": {"token": "test"}}],
                "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "test"}}],
            }
        )
    )
    return str(path)


async def test_worker_killed_during_drain_and_resume_leaves_one_pod_per_node_and_one_claim(
    dev_env, emulator, admin, training_pool, workers, reference_losses, tmp_path
):
    from lazarus.activities.failpoints import ENV_FAILPOINT_DIR, ENV_FAILPOINTS
    from tests.support.workers import lazarus_env

    home = tmp_path / "volume"
    kubelet = training_pool
    queue = f"k8s-crash-{uuid.uuid4().hex[:6]}"
    env = {
        **lazarus_env(dev_env, home, queue),
        "LAZARUS_BACKEND": "kubernetes",
        "KUBECONFIG": kubeconfig(tmp_path / "kubeconfig", emulator.url),
    }
    markers = tmp_path / "failpoints"

    def armed(name: str) -> dict:
        return {**env, ENV_FAILPOINTS: name, ENV_FAILPOINT_DIR: str(markers)}

    # A worker killed inside drain (a local stage) holds the recovery one workflow task timeout: 3 s here.
    spec = kubernetes_spec(home, workflow_task_timeout_seconds=3)
    run_id = f"kube-crash-{uuid.uuid4().hex[:6]}"
    run = KubernetesCluster(home, admin.api_client).run_dir(run_id)
    first = workers(armed("drain.after_quarantine"), tmp_path / "worker-1.log")
    handle = await start_run(dev_env.client, Settings(task_queue=queue), spec, run_id)
    await wait_until(lambda: trained_step(run) >= 15, "the run to train 15 steps")
    kubelet.kill_node("worker-2")
    await wait_until(lambda: (markers / "drain.after_quarantine").exists(), "the worker to reach drain", 60)
    assert admin.read_node("worker-2").spec.unschedulable  # the crash lands after the quarantine
    first.kill()
    second = workers(armed("resume.after_launch"), tmp_path / "worker-2.log")
    await wait_until(lambda: (markers / "resume.after_launch").exists(), "the second worker to reach resume", 90)
    second.kill()
    workers(env, tmp_path / "worker-3.log")
    status = await asyncio.wait_for(handle.result(), 240)
    incident = completed_incident(kubelet, status)
    assert incident.new_assignment.incarnation == 1 and run.incarnations() == [0, 1]
    # One claim: of the two spares exactly one joined the run (each node claimed once, as its Events say).
    claimed = claims_of(admin, run_id)
    assert set(claimed) == set(incident.old_assignment.nodes) | set(incident.new_assignment.nodes)
    assert len({"spare-0", "spare-1"} & set(claimed)) == 1
    # No duplicate pods or processes: incarnation 1 ran in the standby pods, each started once
    # (the retried launch ordered them again), and each rank started once.
    assert_ran_in_place(kubelet, admin, run, incident)
    for rank in range(spec.layout.world_size):
        starts = [
            line for line in run.log_file(1, rank).read_text().splitlines() if line.startswith("lazarus trainer: rank")
        ]
        assert len(starts) == 1, f"rank {rank} of incarnation 1 was started {len(starts)} times"
    assert losses(run) == reference_losses


def assert_ran_in_place(kubelet, admin, run, incident) -> None:
    """The incarnation after the fault ran in the nodes' warm standby pods: no rank pod was
    created, each standby pod of its nodes (the survivors' and the spare's) started once, and
    each of their launchers ended with code 0 as its standby recorded; the lost node's standby
    pod was deleted with it and not recreated."""
    run_id, k = run.root.name, incident.new_assignment.incarnation
    rank_pods = admin.list_namespaced_pod("lz", label_selector=f"{RUN_LABEL}={run_id},lazarus.dev/incarnation={k}")
    assert rank_pods.items == []
    for index, node in enumerate(incident.new_assignment.nodes):
        assert kubelet.started.count(standby_pod_name(run_id, node)) == 1, (node, kubelet.started)
        # The standby records its launcher's end when it reaps it, which may come after the run's end
        # was seen (its ranks' exit records): wait for the record, then read it.
        ended = waiting.wait_until(
            lambda index=index: read_json(run.launcher_exit_file(k, index)),
            f"{node}'s standby to record its launcher's end",
            10,
        )
        assert ended["code"] == 0, (node, ended)
    for node in incident.fault.nodes:
        assert kubelet.started.count(standby_pod_name(run_id, node)) == 1, (node, kubelet.started)


def claims_of(admin, run_id: str) -> list[str]:
    """Every node claim of the run, as its `Claimed` Events record them (one per claim), sorted."""
    events = admin.list_namespaced_event("lz").items
    return sorted(e.involved_object.name for e in events if e.reason == "Claimed" and e.message.endswith(f" {run_id}"))


async def test_a_node_condition_named_in_the_spec_swaps_the_node_at_a_step_boundary(
    dev_env, admin, clusters, training_pool, reference_losses, tmp_path
):
    # A GPU health agent marks worker-2 sick while it still trains: nothing has died, so the run
    # checkpoints and stops at a step boundary and the spare takes the node's place, no step lost.
    home = tmp_path / "volume"
    kubelet = training_pool
    cluster = clusters(home)
    spec = parse_spec(
        {**kubernetes_spec(home).model_dump(mode="json"), "health": {"node_conditions": ["GpuUnhealthy"]}}
    )
    run_id = f"kube-sick-{uuid.uuid4().hex[:6]}"
    queue = f"k8s-{uuid.uuid4().hex[:8]}"
    async with build_worker(dev_env.client, queue, cluster):
        handle = await start_run(dev_env.client, Settings(task_queue=queue, home=home), spec, run_id)
        run = cluster.run_dir(run_id)
        await wait_until(lambda: trained_step(run) >= 15, "the run to train 15 steps")
        sick = {"type": "GpuUnhealthy", "status": "True", "reason": "XidError", "message": "Xid 79 on GPU 3"}
        ready = {"type": "Ready", "status": "True", "reason": "KubeletReady"}
        admin.patch_node("worker-2", {"status": {"conditions": [ready, sick]}})
        status = await asyncio.wait_for(handle.result(), 240)
    incident = completed_incident(kubelet, status)
    fault = incident.fault
    assert fault.kind == "sick" and fault.nodes == ["worker-2"], fault.reason
    assert "node condition GpuUnhealthy is True (XidError: Xid 79 on GPU 3)" in fault.reason
    assert list(incident.stages)[:3] == ["detect", "stop", "drain"]
    assert incident.decision.action == "replace" and incident.new_assignment.nodes[2] == "spare-0"
    assert incident.resumed_from_step == fault.step and incident.lost_steps == 0
    assert admin.read_node("worker-2").spec.unschedulable
    trained = losses(cluster.run_dir(run_id))
    assert sorted(trained) == list(range(1, spec.trainer.steps + 1))
    assert trained == reference_losses
