"""A node dies mid-step: the surviving ranks save the state of the last step they completed, and
a new incarnation that loads it at the same mesh coordinates trains on bit for bit."""

from __future__ import annotations

import json

import pytest

from lazarus.infra.backend import free_port
from lazarus.schema import Layout
from lazarus.schema.contract import read_survivor
from lazarus.schema.rundir import RunDir
from lazarus.trainer.gpt import survivor_state as survivors
from tests.support.ranks import start_ranks
from tests.trainer.survivor_ranks import COMPLETED, SETTINGS, run_rank

pytestmark = pytest.mark.timeout(180)

WORLD = 4


def spawn(layout: dict, mode: str, folder, sources: dict | None = None) -> None:
    start_ranks(run_rank, (WORLD, free_port(), layout, mode, str(folder), sources or {}), WORLD)


def read(folder, name: str) -> dict:
    return json.loads((folder / name).read_text())


def test_survivors_save_the_last_completed_step_and_a_new_incarnation_trains_on_bit_for_bit(tmp_path):
    # HSDP: the saved shares are DTensor shards; the end-to-end tests cover dp and pipelines.
    layout = {"dp": 2, "dp_shard": 2}
    spawn(layout, "reference", tmp_path)
    spawn(layout, "fault", tmp_path)
    run, place = RunDir(tmp_path), Layout(**layout, ranks_per_node=1).coordinates
    for rank in range(WORLD - 1):
        assert read(tmp_path, f"fault-{rank}.json")["saved"] is True
        record = read_survivor(run, 0, rank)
        assert record.step == COMPLETED and record.coordinates == place(rank)
    assert read_survivor(run, 0, WORLD - 1) is None  # the dead rank saved nothing

    # The lost rank's share comes from the other replica's rank at the same (pp, dp_shard, tp).
    def source(rank: int) -> int:
        wanted = {k: v for k, v in place(rank).items() if k != "dp"}
        return next(r for r in range(WORLD - 1) if {k: v for k, v in place(r).items() if k != "dp"} == wanted)

    spawn(layout, "resume", tmp_path, {str(rank): source(rank) for rank in range(WORLD)})
    expected = read(tmp_path, "reference-0.json")["losses"]
    resumed = read(tmp_path, "resume-0.json")
    assert resumed["first"] == COMPLETED
    assert sorted(map(int, resumed["losses"])) == list(range(COMPLETED + 1, SETTINGS.steps + 1))
    assert {s: loss for s, loss in resumed["losses"].items() if loss != expected[s]} == {}


def test_a_survivor_of_an_ended_incarnation_saves_nothing_that_counts(tmp_path):
    run = RunDir(tmp_path)
    run.ended_file(0).parent.mkdir(parents=True)
    run.ended_file(0).write_text("")
    assert survivors.save(run, 0, 0, trainer=None, step=3, samples=36) is False
    assert read_survivor(run, 0, 0) is None and not run.survivor_state(0, 0).exists()
