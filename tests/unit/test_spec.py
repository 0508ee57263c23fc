"""A bad spec is refused with one line that names the field and says how to fix it."""

from __future__ import annotations

import pytest

from lazarus.schema import Layout, RunSpec, SpecError, load_spec, parse_spec


def refuse(data: dict) -> str:
    with pytest.raises(SpecError) as error:
        parse_spec({"name": "ok", **data})
    message = str(error.value)
    assert "\n" not in message
    return message


def test_the_defaults_make_a_valid_spec():
    spec = parse_spec({"name": "ok"})
    assert spec.layout.world_size == spec.cluster.active_nodes * spec.layout.ranks_per_node


def test_layout_must_match_the_active_nodes():
    message = refuse({"layout": {"dp": 8}})
    assert (
        message.startswith("layout: dp*pp*dp_shard*tp = 8")
        and "cluster.active_nodes" in message
        and "layout.dp: 4" in message
    )


def test_negative_interval_is_refused():
    assert (
        refuse({"recovery": {"heartbeat_interval_seconds": -1}})
        == "recovery.heartbeat_interval_seconds: must be greater than 0 (got -1)"
    )


def test_negative_stage_timeout_names_the_stage():
    message = refuse({"recovery": {"stages": {"drain": {"timeout_seconds": -3, "heartbeat_timeout_seconds": 1}}}})
    assert message.startswith("recovery.stages.drain.timeout_seconds: must be greater than 0")


def test_a_stage_whose_longest_retry_wait_is_below_its_first_is_refused():
    drain = {
        "timeout_seconds": 60,
        "heartbeat_timeout_seconds": 5,
        "initial_retry_seconds": 20,
        "max_retry_seconds": 10,
    }
    message = refuse({"recovery": {"stages": {"drain": drain}}})
    assert message.startswith("recovery.stages.drain: max_retry_seconds (10) is less than initial_retry_seconds (20)")


def test_unknown_backend_is_refused(tmp_path):
    # The spec holds any well-formed name; the commands ask the registry which names are backends.
    from lazarus.commands.common import UserError, load_run_spec

    assert refuse({"cluster": {"backend": "LSF!"}}) == (
        "cluster.backend: 'LSF!' is not allowed; use lowercase letters, digits and dashes"
    )
    (tmp_path / "run.yaml").write_text("name: r\ncluster: {backend: lsf}\n")
    with pytest.raises(UserError) as refused:
        load_run_spec(tmp_path / "run.yaml")
    assert str(refused.value) == "cluster.backend: 'lsf' is not a backend; the backends are local, kubernetes, slurm"


def test_unknown_field_is_refused():
    assert refuse({"trainer": {"stpes": 10}}).startswith("trainer.stpes: unknown field")


def test_missing_name_is_refused():
    with pytest.raises(SpecError, match="^name: required field is missing$"):
        parse_spec({})


def test_bad_name_is_refused():
    assert refuse({"name": "My Run"}).startswith("name: 'My Run' is not allowed; use lowercase letters")


def test_min_dp_above_dp_is_refused():
    assert refuse({"recovery": {"min_dp": 5}}).startswith("recovery.min_dp: 5 exceeds layout.dp 4")


def test_heads_must_divide_width():
    assert refuse({"trainer": {"d_model": 64, "n_heads": 5}}).startswith("trainer.n_heads: 5 does not divide")


def test_global_batch_below_dp_is_refused():
    assert refuse({"trainer": {"global_batch": 2}}).startswith(
        "trainer.global_batch: 2 is smaller than layout.dp x layout.dp_shard = 4"
    )
    sharded = {"layout": {"dp": 2, "dp_shard": 2, "ranks_per_node": 1}, "trainer": {"global_batch": 3}}
    assert refuse(sharded).startswith("trainer.global_batch: 3 is smaller than layout.dp x layout.dp_shard = 4")


def test_hang_threshold_must_exceed_the_interval():
    assert refuse({"recovery": {"heartbeat_interval_seconds": 2, "hang_after_seconds": 1}}).startswith(
        "recovery.hang_after_seconds: 1.0 must exceed"
    )


def test_detect_timeout_must_exceed_the_progress_interval():
    message = refuse({"recovery": {"progress_every_seconds": 9000}})
    assert message.startswith(
        "recovery.stages.detect.timeout_seconds: 7200.0 must exceed recovery.progress_every_seconds"
    )


def test_node_must_not_hold_parts_of_two_replicas():
    message = refuse({"layout": {"dp": 2, "pp": 3, "ranks_per_node": 2}, "cluster": {"active_nodes": 3}})
    assert message.startswith("layout.ranks_per_node: 2 neither divides nor is a multiple")


def test_yaml_errors_name_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\ntrainer: [unclosed\n")
    with pytest.raises(SpecError, match=r"not valid YAML at line \d"):
        load_spec(path)


def test_top_level_must_be_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- name: x\n")
    with pytest.raises(SpecError, match="expected a mapping"):
        load_spec(path)


def test_missing_file_is_one_line(tmp_path):
    with pytest.raises(SpecError, match="cannot read the spec"):
        load_spec(tmp_path / "absent.yaml")


def test_examples_are_valid():
    from pathlib import Path

    for path in sorted(Path(__file__).resolve().parents[2].joinpath("examples").glob("*.yaml")):
        assert isinstance(load_spec(path), RunSpec)


def test_a_progress_pattern_must_compile_and_name_the_step():
    assert "is not a regular expression" in refuse({"trainer": {"progress_pattern": "step (\\d+"}})
    assert "has no group for the step" in refuse({"trainer": {"progress_pattern": "step \\d+"}})
    trainer = parse_spec({"name": "ok", "trainer": {"progress_pattern": "Epoch (?P<step>\\d+) \\|"}}).trainer
    assert trainer.step_in("[rank 1] Epoch 12 | 4 batches") == 12 and trainer.step_in("loading") is None
    assert parse_spec({"name": "ok", "trainer": {"progress_pattern": "it (\\d+)/"}}).trainer.step_in("it 7/9") == 7


def test_a_planned_fault_names_a_step_or_a_time():
    assert "either step or after_seconds" in refuse({"faults": [{"node": "node-1"}]})
    assert "either step or after_seconds" in refuse({"faults": [{"node": "node-1", "step": 3, "after_seconds": 2}]})
    timed_checkpoint = {"node": "node-1", "after_seconds": 2, "point": "checkpoint"}
    assert "checkpoint needs a step" in refuse({"faults": [timed_checkpoint]})
    [fault] = parse_spec({"name": "ok", "faults": [{"node": "node-1", "after_seconds": 2.5}]}).faults
    assert fault.planned == "after:2.5"


def test_a_planned_fault_s_effect_fits_its_point_and_trainer():
    raising = {"node": "node-1", "step": 3, "effect": "raise"}
    assert parse_spec({"name": "ok", "faults": [raising]}).faults[0].planned == "step:3:raise"
    full = {"node": "node-1", "step": 10, "point": "checkpoint", "effect": "disk_full"}
    assert parse_spec({"name": "ok", "faults": [full]}).faults[0].planned == "checkpoint:10:disk_full"
    assert "set point: checkpoint" in refuse({"faults": [{**full, "point": "step"}]})
    assert "needs a step" in refuse({"faults": [{"node": "node-1", "after_seconds": 2, "effect": "raise"}]})
    script = {"command": ["python", "train.py"], "progress_pattern": r"step (?P<step>\d+)"}
    assert "carry out planned faults themselves" in refuse({"trainer": script, "faults": [raising]})
    assert "needs the built-in trainer" in refuse({"trainer": {"command": ["python", "train.py"]}, "faults": [full]})


def test_relative_paths_are_taken_from_the_folder_the_run_starts_in(tmp_path):
    from lazarus.commands.local_paths import anchor_paths

    (tmp_path / "train.py").write_text("")
    (tmp_path / "mypkg").mkdir()
    script = parse_spec({"name": "ok", "trainer": {"command": ["python", "train.py", "--out", "x"], "workdir": "w"}})
    anchored = anchor_paths(script, tmp_path, True).trainer
    assert anchored.command == ["python", str(tmp_path / "train.py"), "--out", "x"]
    assert anchored.workdir == str(tmp_path / "w")
    module_spec = parse_spec({"name": "ok", "trainer": {"command": ["python", "-m", "mypkg.train"]}})
    module = anchor_paths(module_spec, tmp_path, True)
    assert module.trainer.env["PYTHONPATH"] == str(tmp_path) and module.trainer.command[2] == "mypkg.train"
    built_in = parse_spec({"name": "ok"})
    assert anchor_paths(built_in, tmp_path, True) == built_in
    # Slurm's nodes share the paths of the folder the run starts in; a pod's are the image's.
    from lazarus.infra.registry import backend_class

    on = {
        b: parse_spec({"name": "ok", "trainer": {"command": ["python", "train.py"]}, "cluster": {"backend": b}})
        for b in ("slurm", "kubernetes")
    }
    slurm, kubernetes = (anchor_paths(on[b], tmp_path, backend_class(b).shares_paths) for b in on)
    assert slurm.trainer.command == ["python", str(tmp_path / "train.py")]
    assert kubernetes.trainer.command == ["python", "train.py"]


def test_a_tensor_parallel_group_never_spans_nodes():
    message = refuse({"layout": {"dp": 2, "tp": 2, "ranks_per_node": 1}, "trainer": {"command": ["python", "x.py"]}})
    assert message.startswith("layout.tp: 2 does not divide layout.ranks_per_node 1") and "multiple of 2" in message


def test_the_built_in_trainer_splits_whole_heads_over_tp():
    message = refuse({"layout": {"dp": 1, "tp": 8, "ranks_per_node": 8}, "cluster": {"active_nodes": 1}})
    assert message == (
        "layout.tp: 8 does not divide trainer.n_heads 4, and each tensor-parallel rank computes whole attention "
        "heads; set tp to a divisor of 4"
    )
    four_d = {"dp": 1, "pp": 2, "dp_shard": 2, "tp": 2, "ranks_per_node": 4}
    assert parse_spec({"name": "ok", "layout": four_d, "cluster": {"active_nodes": 2}}).layout.world_size == 8


def test_a_rank_s_coordinates_follow_the_rank_order():
    layout = Layout(dp=2, pp=2, dp_shard=2, tp=2, ranks_per_node=2)
    assert layout.world_size == 16 and layout.replica_ranks == 8 and layout.shape == (2, 2, 2, 2)
    assert layout.coordinates(0) == {"dp": 0, "pp": 0, "dp_shard": 0, "tp": 0}
    assert layout.coordinates(1) == {"dp": 0, "pp": 0, "dp_shard": 0, "tp": 1}  # tp fastest: inside a node
    assert layout.coordinates(6) == {"dp": 0, "pp": 1, "dp_shard": 1, "tp": 0}
    assert layout.coordinates(13) == {"dp": 1, "pp": 1, "dp_shard": 0, "tp": 1}
    assert all(layout.replica_of_rank(r) == layout.coordinates(r)["dp"] for r in range(16))
    assert layout.describe() == "dp=2 pp=2 dp_shard=2 tp=2" and Layout(dp=4).describe() == "dp=4"
    user = parse_spec(
        {
            "name": "ok",
            "trainer": {"command": ["python", "x.py"]},
            "layout": {"dp": 2, "dp_shard": 2, "tp": 2, "ranks_per_node": 2},
        }
    )
    assert user.layout.world_size == 8 == user.cluster.active_nodes * 2
