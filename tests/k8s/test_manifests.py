"""infra/backends/kubernetes/manifests/: every manifest is a valid object of the official client's models, and the RBAC
rules grant exactly what the backend uses (no more, no less)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml
from kubernetes import client as k8s

from lazarus.infra.backend import ClusterBackend, ClusterError
from lazarus.schema import load_spec
from lazarus.schema.contract import Rejoin
from lazarus.schema.records import FaultReport
from lazarus.workflows.policy import spare_want
from tests.support.backends import Harness, every_rank_training
from tests.support.waiting import wait_until

MANIFESTS = Path(__file__).resolve().parents[2] / "infra" / "backends" / "kubernetes" / "manifests"
RUN_SPECS = {"run.yaml"}  # Lazarus run specs kept beside the manifests


def documents() -> list[tuple[str, dict]]:
    found = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        if path.name not in RUN_SPECS:
            found += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return found


def _without_nones(value):
    if isinstance(value, dict):
        return {k: _without_nones(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nones(v) for v in value]
    return value


@pytest.mark.parametrize(("name", "document"), documents(), ids=lambda x: x if isinstance(x, str) else x["kind"])
def test_every_manifest_parses_into_the_clients_models(name, document):
    api = k8s.ApiClient()
    model = getattr(k8s, f"V1{document['kind']}")
    parsed = api._ApiClient__deserialize(document, model.__name__)
    # Serialized back, it is the same document: a misspelt or misplaced field would be dropped.
    assert _without_nones(api.sanitize_for_serialization(parsed)) == document, f"{name}: fields the model does not know"


def test_the_example_run_spec_is_a_valid_kubernetes_run():
    spec = load_spec(MANIFESTS / "run.yaml")
    assert spec.cluster.backend == "kubernetes"
    volume = next(doc for _, doc in documents() if doc["kind"] == "PersistentVolumeClaim")
    assert spec.cluster.kubernetes.volume_claim == volume["metadata"]["name"]
    assert "ReadWriteMany" in volume["spec"]["accessModes"]


def granted() -> set[tuple[str, str, str]]:
    """(verb, API group, resource) the worker's Role and ClusterRole allow."""
    rules = [rule for _, doc in documents() if doc["kind"] in ("Role", "ClusterRole") for rule in doc["rules"]]
    return {
        (verb, group, resource)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


class Recorder:
    """The backend with a record of which of its methods were called."""

    def __init__(self, cluster):
        self.cluster, self.called = cluster, set()

    def __getattr__(self, name):
        self.called.add(name)
        return getattr(self.cluster, name)


def drive_every_method(harness: Harness) -> set[str]:
    """Call every method of the backend's Protocol, in the order a run's life calls them (its
    watches included); returns the names called."""
    recorder = Recorder(harness.cluster)
    harness.cluster = recorder
    cluster = recorder
    old = harness.launch("r1")  # create, inventory, rendezvous_port, commit_assignment, start_ranks
    every_rank_training(harness, "r1")  # observe
    woke = asyncio.run(cluster.wait_for_exit("r1", 0, 0.5))  # starts the node and pod watches
    # Nothing ended, but for standby pods that failed (none listens on these nodes' addresses):
    # the spare's stays Failed until the next launch replaces it.
    assert woke is bool(harness.cluster_section.get("warm_standby"))
    watches = harness.cluster.cluster.watches
    wait_until(
        lambda: watches.cached("nodes", "test") is not None and watches.cached("pods", "lz") is not None,
        "the watches to list (they watch next)",
    )
    assert set(cluster.capture_stacks("r1", 0)) == {0, 1}  # through the run directory: no API call
    cluster.await_survivors("r1", 0, 0.0)
    cluster.await_checkpoint_in_flight("r1", 0, 0.0)
    lost, spare = harness.active[1], harness.spares[0]
    fault = FaultReport(
        kind="node_down",
        nodes=[lost],
        incarnation=0,
        occurred_at=datetime.now(UTC),
        detected_at=datetime.now(UTC),
        step=3,
    )
    cluster.want_spares("r1", spare_want("r1", old, fault, priority=0))
    cluster.quarantine("r1", [lost], "node_down: test")
    assert cluster.stop_nodes("r1", 0, [lost]) == [1]  # a hang's node first, as drain does
    assert cluster.stop_incarnation("r1", 0) == [0]
    cluster.remove_partial_checkpoints("r1")
    cluster.remove_stale_survivors("r1", 0)
    assert cluster.assignment("r1", 0) == old and cluster.run_dir("r1").root.is_dir()
    new = old.model_copy(update={"incarnation": 1, "nodes": [harness.active[0], spare]})
    assert cluster.vet_spare("r1", spare) is None  # no health agent marks it sick
    assert cluster.claimed_assignment("r1", 1) is None
    recorded = cluster.commit_assignment("r1", new, claims=[spare])
    assert cluster.claimed_assignment("r1", 1) == recorded  # what stages that ran again decide on
    with pytest.raises(ClusterError, match="restarts every rank"):  # survivors keep no process here
        cluster.rejoin_ranks("r1", 1, 3, Rejoin(incarnation=0, ranks=[0], source_replica=0))
    cluster.log_tail("r1", 0, 0)
    cluster.drop_want("r1")
    cluster.return_node("r1", lost)
    cluster.record_stage("r1", "replaced", "incarnation 1")
    cluster.release_standbys("r1")
    assert sorted(cluster.release_nodes("r1")) == sorted(new.nodes)
    cluster.close()
    return recorder.called


def test_rbac_grants_exactly_what_the_backend_uses(kubernetes_backend, emulator):
    """The backend driven through every method of its Protocol on an emulator of this test's own:
    what it asked the API server for is what the manifests' rbac.yaml grants, no more, no less. With
    warm standby pods, whose listening fails on these nodes' addresses (not this machine's): the
    standby pods are created, ordered, found failed and replaced by rank pods, and drained."""
    kubernetes_backend.cluster_section["warm_standby"] = True
    called = drive_every_method(kubernetes_backend)
    protocol = {name for name, value in vars(ClusterBackend).items() if callable(value) and not name.startswith("_")}
    assert protocol <= called, f"the scenario leaves out {sorted(protocol - called)}"
    used = emulator.emulator.used
    assert sorted(used - granted()) == [], (
        "the backend used these without a grant in infra/backends/kubernetes/manifests/rbac.yaml"
    )
    assert sorted(granted() - used) == [], (
        "infra/backends/kubernetes/manifests/rbac.yaml grants these but the backend never used them"
    )
