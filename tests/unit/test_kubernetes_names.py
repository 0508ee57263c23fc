"""Names and label values Lazarus writes on Kubernetes: valid for the API server whatever the run
id (run ids allow capitals, '_', '.' and 100 characters; names and labels do not), and distinct
for distinct run ids."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from lazarus.infra.backends.kubernetes.objects import pod_name, run_label, run_object_name
from lazarus.schema.names import RUN_ID_PATTERN

DNS_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
LABEL_VALUE = re.compile(r"([A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?)?")

run_ids = st.from_regex(RUN_ID_PATTERN, fullmatch=True)


@settings(max_examples=300, deadline=None)
@given(run_ids)
def test_every_run_id_gives_valid_names_and_label_values(run_id):
    for name in (pod_name(run_id, 12, 3), run_object_name(run_id)):
        assert DNS_LABEL.fullmatch(name), name
    assert LABEL_VALUE.fullmatch(run_label(run_id)) and len(run_label(run_id)) <= 63


@settings(max_examples=300, deadline=None)
@given(run_ids, run_ids)
def test_distinct_run_ids_never_share_a_name_or_a_label(a, b):
    if a != b:
        assert pod_name(a, 0, 0) != pod_name(b, 0, 0) and run_object_name(a) != run_object_name(b)
        assert run_label(a) != run_label(b)


def test_plain_run_ids_are_their_own_names_and_labels():
    assert pod_name("r1", 0, 1) == "lz-r1-0-1" and run_object_name("kube-ab12") == "lazarus-run-kube-ab12"
    assert run_label("Big_Run.v2") == "Big_Run.v2"
    # The cases hypothesis might not draw: case alone, a trailing '_', a long id.
    assert pod_name("Run", 0, 0) != pod_name("run", 0, 0)
    assert run_label("run_") != "run_" and LABEL_VALUE.fullmatch(run_label("run_"))
    long_id = "a" * 100
    assert len(run_label(long_id)) <= 63 and run_label(long_id) != run_label("a" * 99)
