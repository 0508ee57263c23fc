"""Node health and pod ends from the watch stream: the informer's cache and the run's wake-ups."""

from __future__ import annotations

import asyncio
import functools
import threading
import time

import pytest
from kubernetes.client.rest import ApiException

from lazarus.infra.backends.kubernetes.informer import Informer
from lazarus.infra.backends.kubernetes.objects import RUN_LABEL, pod_name, pod_running
from tests.k8s.test_backend import k8s_spec, launched
from tests.support.kubernetes import add_node, set_ready
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pool(admin):
    for i in range(3):
        add_node(admin, f"worker-{i}")
    add_node(admin, "elsewhere", pool="other")
    return admin


def test_the_informer_follows_the_pools_nodes_and_distrusts_its_cache_when_the_stream_breaks(pool, emulator):
    events, lists, broken, changed = [], [], threading.Event(), threading.Event()

    @functools.wraps(pool.list_node)  # the client's watch reads the return type from the docstring
    def list_node(**arguments):
        if arguments.get("watch"):
            # The first watch starts only once worker-1 changed after the list: a watch that
            # replays what exists (the emulator's does) must report that change as MODIFIED.
            changed.wait(20)
        else:
            lists.append(time.monotonic())
            if broken.is_set():
                raise ApiException(status=503, reason="the API server is restarting")
        return pool.list_node(**arguments)

    informer = Informer(
        list_node,
        "test-pool",
        lambda kind, node: events.append((kind, node.metadata.name)),
        label_selector="lazarus.dev/pool=test",
    ).start()
    try:
        assert informer.wait_synced(20)
        assert sorted(informer.objects()) == ["worker-0", "worker-1", "worker-2"]  # not the other pool's node
        set_ready(pool, "worker-1", "Unknown")
        changed.set()
        wait_until(
            lambda: informer.objects()["worker-1"].status.conditions[0].status == "Unknown",
            "the watch to bring worker-1's Ready=Unknown",
        )
        assert ("MODIFIED", "worker-1") in events
        assert events.count(("ADDED", "worker-0")) == 1  # the replay of what did not change is no event
        pool.delete_node("worker-2")
        wait_until(lambda: "worker-2" not in informer.objects(), "the watch to bring worker-2's deletion")
        assert ("DELETED", "worker-2") in events

        # The stream expires (410 Gone) and the list that should follow fails: the cache is not
        # trusted until a list succeeds again.
        broken.set()
        emulator.call(emulator.emulator.expire_watches, "nodes")
        wait_until(lambda: len(lists) >= 2, "the informer to list again")
        assert not informer.synced and informer.objects() is None
        add_node(pool, "worker-3")  # while it was blind
        pool.delete_node("worker-1")
        broken.clear()
        wait_until(lambda: informer.synced, "a list to succeed again")
        assert sorted(informer.objects()) == ["worker-0", "worker-3"]
        # The list reports what it missed, as the stream would have: a run on worker-1 is woken.
        assert ("ADDED", "worker-3") in events and ("DELETED", "worker-1") in events
    finally:
        informer.stop()
    assert not informer._thread.is_alive()


def test_a_run_is_woken_by_its_nodes_and_pods_and_reads_node_health_from_the_watch(pool, emulator, clusters, tmp_path):
    cluster = clusters(tmp_path)
    launched(cluster, "r1", k8s_spec(tmp_path, spares=0))

    async def scenario():
        # The first wait starts the watches; nothing of the run has changed, so it times out.
        assert await cluster.wait_for_exit("r1", 0, 0.2) is False
        wait_until(
            lambda: (
                cluster.watches.cached("nodes", "test") is not None and cluster.watches.cached("pods", "lz") is not None
            ),
            "the watches to sync",
        )
        # Node health and pods come from the watches now: looking costs the API server no list.
        lists = (emulator.emulator.calls[("list", "nodes")], emulator.emulator.calls[("list", "pods")])
        observation = cluster.observe("r1", 0)
        assert observation.dead_nodes == {} and observation.launchers_alive == 2
        assert (emulator.emulator.calls[("list", "nodes")], emulator.emulator.calls[("list", "pods")]) == lists

        # A node of another run (here: of none) turning Unknown does not wake r1.
        await asyncio.to_thread(set_ready, pool, "worker-2", "Unknown")
        assert await cluster.wait_for_exit("r1", 0, 0.5) is False

        # One of r1's nodes turning Unknown wakes it, and the next look sees it dead.
        waiting = asyncio.ensure_future(cluster.wait_for_exit("r1", 0, 30))
        await asyncio.sleep(0)
        await asyncio.to_thread(set_ready, pool, "worker-1", "Unknown")
        assert await waiting is True
        assert list(cluster.observe("r1", 0).dead_nodes) == ["worker-1"]
        assert (emulator.emulator.calls[("list", "nodes")], emulator.emulator.calls[("list", "pods")]) == lists

        # An event that came while nobody waited wakes the next wait at once.
        set_ready(pool, "worker-1", "True")
        await asyncio.to_thread(pool.patch_namespaced_pod, pod_name("r1", 0, 0), "lz", {"status": {"phase": "Failed"}})
        wait_until(
            lambda: not pod_running(cluster.watches.cached("pods", "lz")[pod_name("r1", 0, 0)]),
            "the watch to bring the pod's failure",
        )
        assert await cluster.wait_for_exit("r1", 0, 30) is True

    asyncio.run(scenario())
    assert pool.list_node(label_selector=f"{RUN_LABEL}=r1").items  # the run still holds its nodes


def test_drain_deletes_pods_on_a_quarantined_node_without_waiting_for_its_dead_kubelet(
    pool, clusters, confirming_kubelet, tmp_path
):
    # The API server still shows the node Ready and its pod Running (it has not learnt of the
    # death): a graceful delete would leave the pod terminating until the timeout.
    cluster = clusters(tmp_path)
    launched(cluster, "r1", k8s_spec(tmp_path, spares=0))
    for index in (0, 1):
        pool.patch_namespaced_pod(pod_name("r1", 0, index), "lz", {"status": {"phase": "Running"}})
    confirming_kubelet.dead.add("worker-1")
    cluster.quarantine("r1", ["worker-1"], "node_down: went silent")
    assert cluster.stop_incarnation("r1", 0) == [0, 1]
    assert pool.list_namespaced_pod("lz", label_selector=f"{RUN_LABEL}=r1").items == []
