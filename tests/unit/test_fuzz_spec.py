"""The run spec, fed what a careless or hostile user writes: every document either parses into a
spec the controller can run (its timeouts fit Temporal, its commands can be executed, it crosses
the wire unchanged) or is refused with a SpecError of one short line naming the field."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from temporalio.api.common.v1 import RetryPolicy as RetryPolicyProto
from temporalio.exceptions import ApplicationError

from lazarus.schema import RunSpec, SpecError, StagePolicies, load_spec, parse_spec
from lazarus.workflows.stage_calls import stage_options

ROOT = Path(__file__).resolve().parents[2]
SPEC_FILES = [ROOT / "examples" / "demo.yaml", *sorted((ROOT / "tests" / "specs").glob("*.yaml"))]
RAW = [yaml.safe_load(path.read_text()) for path in SPEC_FILES]
# As written (what users mutate) and with every default spelled out (so deep fields, such as each
# stage's retry policy, are there to be mutated too).
BASES = RAW + [parse_spec(data).model_dump(mode="json") for data in RAW]
FIELD = re.compile(rf"({'|'.join(RunSpec.model_fields)}|spec)\b")

NUMBERS = st.sampled_from(
    [-1, 0, 1, 2**31, 2**63, -(2**63), 10**30, 1e308, -1e308, float("nan"), float("inf"), float("-inf"), 5e-324, -0.0]
)
ODD_TEXT = st.sampled_from(
    ["", " ", "../../etc/passwd", "/", "\\", "\x00", "a\nb", "é", "²", "١", "\u202e", "🙂", "node-01", "node-²"]
    + ["node-١", "node-1\n", "x" * 10_000, "null", "yes", "0x10", "1_000", "step (\\d+", "(?P<step>\\d+)"]
)
SCALARS = st.none() | st.booleans() | NUMBERS | st.integers() | st.floats() | ODD_TEXT | st.text(max_size=20)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8) | ODD_TEXT, inner, max_size=3),
    max_leaves=6,
)


def paths(data: Any, prefix: tuple = ()) -> list[tuple]:
    """Every place in a document: the document itself, each mapping's values, each list's items."""
    found = [prefix]
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else []
    for key, value in items:
        found += paths(value, (*prefix, key))
    return found


def mutated(base: Any, path: tuple, how: str, value: Any, key: str) -> Any:
    """A copy of `base` with the thing at `path` replaced by `value`, deleted, or given an unknown field `key`."""
    if not path:
        return value if how == "replace" else base
    copy = yaml.safe_load(yaml.safe_dump(base))
    parent = copy
    for part in path[:-1]:
        parent = parent[part]
    if how == "replace":
        parent[path[-1]] = value
    elif how == "delete":
        del parent[path[-1]]
    elif isinstance(parent[path[-1]], dict):
        parent[path[-1]][key] = value
    return copy


@st.composite
def documents(draw) -> Any:
    """A valid spec with one or two things wrong somewhere, at any depth."""
    data = draw(st.sampled_from(BASES))
    for _ in range(draw(st.integers(1, 2))):
        path = draw(st.sampled_from(paths(data)))
        how = draw(st.sampled_from(["replace", "replace", "delete", "unknown"]))
        data = mutated(data, path, how, draw(VALUES), draw(ODD_TEXT | st.text(min_size=1, max_size=8)))
    return data


def assert_runnable(spec: RunSpec) -> None:
    """What the controller does with a spec it accepted cannot fail on it."""
    assert RunSpec.model_validate_json(spec.model_dump_json()) == spec  # the history carries it as JSON
    for name in StagePolicies.model_fields:
        options = stage_options(getattr(spec.recovery.stages, name))
        options["retry_policy"].apply_to_proto(RetryPolicyProto())
    policy = spec.recovery
    for seconds in (policy.capacity_wait_seconds, policy.approval_wait_seconds, policy.capacity_poll_seconds):
        timedelta(seconds=seconds)
    trainer = spec.trainer
    texts = [*trainer.command, *trainer.env, *trainer.env.values(), trainer.workdir or ""]
    assert not any("\x00" in text for text in texts), "no program can be given a NUL"
    assert all(name and "=" not in name for name in trainer.env), "not an environment variable's name"
    nodes = {f"node-{i}" for i in range(spec.cluster.active_nodes + spec.cluster.spare_nodes)}
    assert {fault.node for fault in spec.faults} <= nodes, "a planned fault on no node never fires"


def assert_refused_well(error: SpecError) -> None:
    """One short line that starts with the field it is about."""
    message = str(error)
    assert "\n" not in message and len(message) < 400, message
    assert FIELD.match(message), f"names no field: {message}"


@settings(max_examples=150)
@given(documents())
@example({"name": "x", "recovery": {"stages": {"drain": {"timeout_seconds": 1e308, "heartbeat_timeout_seconds": 5}}}})
@example({"name": "x", "recovery": {"stages": {"drain": {"max_attempts": 2**31}}}})
@example({"name": "x", "recovery": {"capacity_wait_seconds": float("inf")}})
@example({"name": "x", "faults": [{"node": "node-²", "step": 3}]})
@example({"name": "x", "faults": [{"node": "node-١", "step": 3}]})
@example({"name": "x", "faults": [{"node": "node-01", "step": 3}]})
@example({"name": "x", "faults": [{"node": "a\nb"}]})
@example({"name": "x", "trainer": {"command": ["python", "a\x00b"]}})
@example({"name": "x", "trainer": {"command": ["python", "t.py"], "env": {"A=B": "1"}}})
@example({"name": "x", "trainer": {"command": ["python", "t.py"], "env": {"": "1"}}})
@example({"name": "x", "trainer": {"command": ["x" * 10_000 + " y"]}})
@example({"name": "x", "trainer": {"command": ["python", "t.py"], "env": {"RANK": "1"}, "x\ny": 1}})
def test_a_spec_parses_into_a_runnable_spec_or_is_refused_in_one_line(data):
    try:
        spec = parse_spec(data)
    except SpecError as error:
        assert_refused_well(error)
    else:
        assert_runnable(spec)


@settings(max_examples=50)
@given(VALUES)
def test_a_document_that_is_no_mapping_is_refused(data):
    if isinstance(data, dict):
        data = [data]
    with pytest.raises(SpecError, match=r"^spec: expected a mapping"):
        parse_spec(data)


@pytest.mark.parametrize("key", ["nmae", "a\nb", "x" * 10_000, "../../etc"])
def test_an_unknown_top_level_field_is_named_in_one_line(key):
    with pytest.raises(SpecError, match="unknown field") as refusal:
        parse_spec({"name": "x", key: 1})
    assert "\n" not in str(refusal.value) and len(str(refusal.value)) < 200


YAML_TEXTS = st.sampled_from(
    ["- a\n- b\n", "42", "", "null", "'x'", "!!binary aGk=", "a: [", "{a: 1", "---\na: 1\n---\nb: 2\n"]
    + ["name: x\n\tlayout: 1\n", "? [a, b]\n: 1\n", "a: &a [1]\nb: *a\n", "!!python/object:os.system\n"]
)


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory) -> Path:
    """One file the file-fed examples overwrite in turn."""
    return tmp_path_factory.mktemp("fuzz") / "spec.yaml"


@settings(max_examples=80, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=200) | YAML_TEXTS.map(str.encode) | st.text(max_size=100).map(str.encode))
@example(b"\xff\xfe\x00garbage")
@example(b"[" * 5000 + b"]" * 5000)
@example(b"name: x\n" + b"a:\n" * 3000)
@example(b"name: demo\ntrainer: {steps: 1e308}\n")
def test_a_file_of_anything_is_a_spec_or_a_spec_error(spec_file, content):
    spec_file.write_bytes(content)
    try:
        spec = load_spec(spec_file)
    except SpecError as error:
        assert "\n" not in str(error) and len(str(error)) < 400 + len(str(spec_file))
    else:
        assert_runnable(spec)


@pytest.mark.parametrize("path", ["/nonexistent/spec.yaml", "/", "a\x00b.yaml", "x" * 5000])
def test_a_path_that_cannot_be_read_is_a_spec_error(path):
    with pytest.raises(SpecError, match="cannot read the spec"):
        load_spec(path)


@settings(max_examples=100)
@given(st.text(max_size=20))
@example("step ²")
@example("step ١٢")
def test_a_rank_line_gives_a_step_or_none(line):
    trainer = parse_spec({"name": "x", "trainer": {"command": ["python", "t.py"], "progress_pattern": r"step (\S+)"}})
    step = trainer.trainer.step_in(line)
    assert step is None or (isinstance(step, int) and step >= 0)


def test_a_decoded_bad_spec_names_the_field_for_the_workflow_too():
    from lazarus.workflows.inputs import RunStartPayload

    with pytest.raises(ApplicationError) as refusal:
        RunStartPayload.model_validate({"run_id": "r", "spec": {"name": "x", "layout": {"dp": 3}}})
    assert (
        refusal.value.message.startswith("RunStart: spec: layout: dp*pp*dp_shard*tp = 3")
        and refusal.value.non_retryable
    )
