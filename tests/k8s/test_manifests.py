"""infra/k8s/: every manifest is a valid object of the official client's models, and the RBAC
rules grant exactly what the backend uses (no more, no less)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from kubernetes import client as k8s

from lazarus.schema import load_spec
from tests.k8s.conftest import USED

MANIFESTS = Path(__file__).resolve().parents[2] / "infra" / "k8s"
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


def test_rbac_grants_exactly_what_the_backend_used():
    """Runs last (conftest): USED holds every call the backend made to an emulator in this session."""
    if not USED:
        pytest.skip("no test of the Kubernetes backend ran in this session, so there is nothing to compare")
    assert sorted(USED - granted()) == [], "the backend used these without a grant in infra/k8s/rbac.yaml"
    assert sorted(granted() - USED) == [], "infra/k8s/rbac.yaml grants these but the backend never used them"
