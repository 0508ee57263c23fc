"""A checkpoint written by one layout loads exactly into a smaller data-parallel degree, and its
DTensor state (FSDP2 shards) into another dp_shard and a tensor-parallel split."""

from __future__ import annotations

import json

import pytest

from lazarus.infra.backend import free_port
from tests.support.ranks import start_ranks
from tests.trainer.reshard_ranks import SETTINGS, STEPS, run_rank

pytestmark = pytest.mark.timeout(180)


def spawn(world: int, layout: dict, mode: str, folder) -> None:
    start_ranks(run_rank, (world, free_port(), layout, mode, str(folder)), world)


def reports(folder, mode: str, world: int) -> list[dict]:
    return [json.loads((folder / f"{mode}-rank-{rank}.json").read_text()) for rank in range(world)]


def test_dp4_checkpoint_loads_exactly_into_dp3_and_dp2(tmp_path):
    spawn(4, {"dp": 4, "pp": 1}, "save", tmp_path)
    for world in (3, 2):
        spawn(world, {"dp": world, "pp": 1}, f"load-dp{world}", tmp_path)
        for report in reports(tmp_path, f"load-dp{world}", world):
            assert report["keys"] > 20
            assert report["missing_or_different"] == [] and report["extra"] == []
            assert report["progress"] == {"step": STEPS, "samples": STEPS * SETTINGS.global_batch}


def test_dp2_pp2_checkpoint_loads_exactly_into_dp1_pp2(tmp_path):
    spawn(4, {"dp": 2, "pp": 2}, "save", tmp_path)
    spawn(2, {"dp": 1, "pp": 2}, "load-dp1", tmp_path)
    for report in reports(tmp_path, "load-dp1", 2):
        assert report["keys"] > 10
        assert report["missing_or_different"] == [] and report["extra"] == []


def test_hsdp_checkpoint_loads_exactly_into_fewer_replicas_other_shards_and_tp(tmp_path):
    spawn(4, {"dp": 2, "dp_shard": 2}, "save", tmp_path)
    for name, layout in {
        "load-dp1-shard2": {"dp": 1, "dp_shard": 2},  # a reshard after a loss: one replica left
        "load-dp1-tp2": {"dp": 1, "tp": 2, "ranks_per_node": 2},  # no FSDP, heads split over 2 ranks
    }.items():
        spawn(2, layout, name, tmp_path)
        for report in reports(tmp_path, name, 2):
            assert report["keys"] > 20
            assert report["missing_or_different"] == [] and report["extra"] == []
            assert report["progress"] == {"step": STEPS, "samples": STEPS * SETTINGS.global_batch}
