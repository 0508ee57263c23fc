"""A drain's waits under a cap (activities/draining.py): cut with a grace running, it stops nothing
and says what it waited; the call that goes on waits only the rest of each grace."""

from __future__ import annotations

import time
from pathlib import Path

from lazarus.activities.draining import end_incarnation
from lazarus.schema.stages import DrainInput, DrainWaits


class HeldSurvivors:
    """The calls drain makes, over survivors that end `end_after` seconds after the first wait
    began (None: never) and a checkpoint in flight that never commits; each wait sleeps until its
    grant or the survivors' end and records the grant."""

    keeps_survivors = False

    def __init__(self, folder: Path, end_after: float | None):
        self.folder, self.end_after = folder, end_after
        self.began: float | None = None
        self.grants: list[tuple[str, float]] = []
        self.stopped = 0

    def run_dir(self, run_id: str):
        return self

    def fall_back_file(self, incarnation: int) -> Path:
        return self.folder / f"fall-back-{incarnation}"

    def _alive_for(self, grant: float) -> float:
        """Seconds the wait takes: its grant, or until the survivors end."""
        if self.began is None:
            self.began = time.monotonic()
        if self.end_after is None:
            return grant
        return max(0.0, min(grant, self.began + self.end_after - time.monotonic()))

    def await_survivors(self, run_id: str, incarnation: int, grace: float) -> dict[int, int]:
        self.grants.append(("survivors", grace))
        time.sleep(self._alive_for(grace))
        return {0: 20, 1: 20} if self.end_after is not None else {}

    def await_checkpoint_in_flight(self, run_id: str, incarnation: int, grace: float):
        self.grants.append(("checkpoint", grace))
        time.sleep(self._alive_for(grace))
        return 30, False

    def stop_incarnation(self, run_id: str, incarnation: int) -> list[int]:
        self.stopped += 1
        return [0, 1, 2, 3]

    def remove_partial_checkpoints(self, run_id: str) -> list[int]:
        return [30]

    def remove_stale_survivors(self, run_id: str, incarnation: int) -> list[int]:
        return []


def request(cap: float | None, waited: DrainWaits | None = None, **graces) -> DrainInput:
    return DrainInput(
        run_id="r",
        incarnation=0,
        nodes=["node-2"],
        reason="incident 1: node_down: test",
        wait_cap_seconds=cap,
        waited=waited,
        **graces,
    )


def test_a_drain_cut_at_its_cap_stops_nothing_and_the_next_call_waits_only_the_rest(tmp_path):
    cluster = HeldSurvivors(tmp_path, end_after=None)  # a survivor that never ends (stopped)
    graces = {"survivor_grace_seconds": 0.4, "save_grace_seconds": 0.2}
    first = end_incarnation(cluster, request(0.1, **graces))
    assert first.unfinished is not None and first.unfinished.survivors >= 0.1
    assert (first.stopped_ranks, first.survivors, cluster.stopped) == ([], {}, 0)
    assert (tmp_path / "fall-back-0").exists()  # the survivors were told to save and end all the same
    rest = end_incarnation(cluster, request(None, first.unfinished, **graces))
    assert rest.unfinished is None and cluster.stopped == 1
    assert (rest.stopped_ranks, rest.in_flight_checkpoint, rest.removed_partial_checkpoints) == ([0, 1, 2, 3], 30, [30])
    (_, cut), (_, survivors_left), (_, checkpoint) = cluster.grants
    assert cut == 0.1
    assert survivors_left == 0.4 - first.unfinished.survivors  # what the cut call waited counts
    assert checkpoint == 0.2  # a grace that had not begun is whole


def test_a_cut_inside_the_second_grace_keeps_what_the_first_took(tmp_path):
    cluster = HeldSurvivors(tmp_path, end_after=None)
    graces = {"survivor_grace_seconds": 0.05, "save_grace_seconds": 0.5}
    first = end_incarnation(cluster, request(0.15, **graces))
    assert first.unfinished is not None
    assert [kind for kind, _ in cluster.grants] == ["survivors", "checkpoint"]
    assert first.unfinished.survivors >= 0.05 and first.unfinished.checkpoint > 0
    end_incarnation(cluster, request(None, first.unfinished, **graces))
    survivors_again, checkpoint_left = cluster.grants[2:]
    assert survivors_again == ("survivors", 0.0)  # run out: only what the survivors saved is read
    assert checkpoint_left == ("checkpoint", 0.5 - first.unfinished.checkpoint)


def test_survivors_that_end_inside_the_cap_finish_the_drain_in_one_call(tmp_path):
    cluster = HeldSurvivors(tmp_path, end_after=0.05)
    drained = end_incarnation(cluster, request(0.5, survivor_grace_seconds=2.0, save_grace_seconds=1.0))
    assert drained.unfinished is None and cluster.stopped == 1
    assert drained.survivors == {0: 20, 1: 20}
    (kind, survivors), (then, checkpoint) = cluster.grants
    assert (kind, survivors, then) == ("survivors", 0.5, "checkpoint")
    assert 0 < checkpoint < 0.5  # the cap, less what the survivors took
