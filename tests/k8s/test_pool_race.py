"""The race of tests/e2e/test_pool.py on the Kubernetes emulator: two runs of one labelled pool,
one spare between them, both losing a node at once; the fake kubelet runs the real trainer."""

from __future__ import annotations

import math
import re

import pytest

from lazarus.chaos.judge import duplicate_starts
from lazarus.chaos.pool_race import Pool, race_for_one_spare
from lazarus.infra.backend import free_ports
from lazarus.infra.backends.kubernetes.objects import RUN_LABEL
from lazarus.schema import RunState, load_spec, parse_spec
from tests.k8s.kubelet import FakeKubelet
from tests.support.kubernetes import add_node
from tests.support.runs import SPECS, losses, unlogged

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

POOL_SPEC = SPECS / "pool.yaml"


@pytest.fixture
def race_pool(admin, tmp_path):
    """worker-0..3 and spare-0 of pool `race`, their pods run by a fake kubelet (namespace lz)."""
    for i in range(4):
        add_node(admin, f"worker-{i}", pool="race")
    add_node(admin, "spare-0", pool="race", spare=True)
    kubelet = FakeKubelet(admin, "lz", tmp_path / "kubelet").start()
    try:
        yield kubelet
    finally:
        kubelet.stop()


def on_kubernetes(home, master_port: int):
    """The pool spec on pool `race`; every emulated node is this host, so each run needs its own
    rendezvous port (on a cluster, rank 0's node tells runs apart)."""
    data = load_spec(POOL_SPEC).model_dump(mode="json")
    data["cluster"] |= {
        "backend": "kubernetes",
        "kubernetes": {
            "namespace": "lz",
            "pool": "race",
            "mount_path": str(home),
            "image": "trainer:test",
            "delete_grace_seconds": 1,
            "master_port": master_port,
        },
    }
    return parse_spec(data)


async def test_two_runs_of_a_kubernetes_pool_share_its_spare_by_priority_and_the_loser_regrows(
    dev_env, admin, clusters, race_pool, reference, tmp_path
):
    home = tmp_path / "volume"
    cluster = clusters(home)
    pool = Pool(
        cluster,
        {"a": "worker-1", "b": "worker-3"},
        lambda _run_id, node: race_pool.kill_node(node),
        lambda: len(cluster.wants.others("lz", "race", "")),
        race_pool.repair,
    )
    a_port, b_port = free_ports(2)
    spec_a, spec_b = on_kubernetes(home, a_port), on_kubernetes(home, b_port)
    race = await race_for_one_spare(dev_env.client, pool, spec_a, priority_a=5, spec_b=spec_b)
    ids, final_a, final_b = race.ids, race.status["a"], race.status["b"]

    assert race_pool.errors == []
    assert final_a.state == final_b.state == RunState.COMPLETED, (final_a.reason, final_b.reason)
    [incident_a], [incident_b] = final_a.incidents, final_b.incidents
    assert incident_a.decision.action == "replace" and incident_a.new_assignment.nodes == ["worker-0", "spare-0"]
    assert incident_a.decision.rivals == [ids["b"]]
    # a reads b's need still open (and says it goes ahead of b), or b decided first, reading a's need
    # (b's reason says so, below): which run reads the pool first is up to the worker.
    b_decided_first = f"run {ids['a']} needs 1 of the pool's spares first" in incident_b.decision.reason
    assert b_decided_first or f"ahead of run {ids['b']}" in incident_a.decision.reason
    assert incident_b.decision.action == "reshard" and incident_b.new_assignment.nodes == ["worker-2"]
    # a still needs the spare, or has taken it already, as b reads the pool: either way a comes first.
    assert re.search(
        f"run {ids['a']} (needs|took) 1 of the pool's spares first \\(priority 5 > 0\\)", incident_b.decision.reason
    )
    [regrowth] = final_b.regrowths
    assert (regrowth.to_dp, regrowth.nodes, regrowth.lost_steps) == (2, ["worker-1"], 0)
    expected = reference(POOL_SPEC)
    for key, final in (("a", final_a), ("b", final_b)):
        trained = losses(race.runs[key])
        assert set(expected) - set(trained) <= unlogged(final), f"run {key} has no loss for some steps"
        assert {s: v for s, v in trained.items() if not math.isclose(v, expected[s], rel_tol=1e-4)} == {}, key
        assert duplicate_starts(race.runs[key]) == 0
    # Both ended: every node they held is back in the pool, but b's dead worker-3 stays quarantined.
    labels = {n.metadata.name: n.metadata.labels for n in admin.list_node(label_selector="lazarus.dev/pool=race").items}
    assert [name for name, found in labels.items() if RUN_LABEL in found] == []
    assert labels["worker-3"]["lazarus.dev/quarantined"] == ids["b"]
