"""One run-id rule at every door: a run id is one plain directory name under LAZARUS_HOME/runs,
and a node name one under its run's standby/; nothing a user types can lead a run's files out."""

from __future__ import annotations

import argparse
from pathlib import PurePosixPath

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from lazarus.commands.common import UserError
from lazarus.commands.launch import run_id_for
from lazarus.infra.backend import ClusterError
from lazarus.infra.runfiles import RunFiles
from lazarus.schema import RunStart, parse_spec
from lazarus.schema.controls import DrainNodeRequest
from lazarus.schema.names import check_node_name, check_run_id
from lazarus.schema.rundir import RunDir

HOSTILE = ["", ".", "..", "../../x", "a/b", "a\\b", "/etc", "-rf", ".hidden", "a\x00b", "a\nb", "ü", "x" * 101]
"""Run ids that must be refused: empty, dot names, separators, NUL and control characters, a
leading dash (an option) or dot (hidden), non-ASCII, too long."""

GENERATED = ["demo-20261201-193000-ab12", "crash-1a2b3c", "bench-0", "hot_spare", "small-pp-20261130-104324-2c63"]
"""Run ids the demo, `run start`, the tests, the benchmarks and the committed histories make."""


@pytest.mark.parametrize("run_id", GENERATED + ["a" * 100, "A.b_c-9"])
def test_the_ids_lazarus_makes_are_run_ids(run_id):
    assert check_run_id(run_id) == run_id


@pytest.mark.parametrize("run_id", HOSTILE)
def test_hostile_ids_are_refused_in_one_line(run_id):
    with pytest.raises(ValueError, match="is not a run id") as refusal:
        check_run_id(run_id)
    assert "\n" not in str(refusal.value)


@settings(max_examples=150)
@given(st.text(max_size=120))
@example("..")
@example("a/../b")
def test_an_accepted_run_id_is_one_plain_path_component(text):
    try:
        check_run_id(text)
    except ValueError as refusal:
        assert "\n" not in str(refusal) and len(str(refusal)) < 300
        return
    assert PurePosixPath(text).name == text and text not in (".", "..") and text.isascii() and text.isprintable()
    assert not text.startswith(("-", ".")) and len(text.encode()) <= 100


@pytest.mark.parametrize("run_id", HOSTILE)
def test_run_files_refuse_a_hostile_id(tmp_path, run_id):
    with pytest.raises(ClusterError, match="is not a run id"):
        RunFiles(tmp_path / "home").run_dir(run_id)


def test_run_files_refuse_a_run_directory_that_is_a_link_out(tmp_path):
    runs = tmp_path / "home" / "runs"
    runs.mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (runs / "planted").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ClusterError, match="leads outside"):
        RunFiles(tmp_path / "home").run_dir("planted")
    assert RunFiles(tmp_path / "home").run_dir("fine").root == runs.resolve() / "fine"


@pytest.mark.parametrize("run_id", HOSTILE)
def test_the_workflow_input_refuses_a_hostile_id(run_id):
    with pytest.raises(ValidationError, match="is not a run id"):
        RunStart(run_id=run_id, spec=parse_spec({"name": "x"}))


def test_launch_refuses_a_hostile_rdzv_id():
    with pytest.raises(UserError, match=r"^--rdzv-id: '\.\./\.\./x' is not a run id"):
        run_id_for(argparse.Namespace(rdzv_id="../../x"), "train")
    assert check_run_id(run_id_for(argparse.Namespace(rdzv_id=None), "train-gpt")).startswith("train-gpt-")


@pytest.mark.parametrize("node", ["", ".", "..", "../x", "a/b", "a\\b", "a\nb", "a b", "n" * 254])
def test_a_node_name_cannot_lead_out_of_its_directory(tmp_path, node):
    with pytest.raises(ValueError, match="is not a node name"):
        RunDir(tmp_path).standby(node)
    with pytest.raises(ValidationError, match="is not a node name"):
        DrainNodeRequest(node=node)


@pytest.mark.parametrize("node", ["node-0", "node-12", "worker-3", "ip-10-0-0-1.ec2.internal"])
def test_the_node_names_backends_use_are_node_names(tmp_path, node):
    assert check_node_name(node) == node
    assert RunDir(tmp_path).standby(node) == tmp_path / "standby" / node
