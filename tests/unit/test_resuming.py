"""Where a script that restores its own snapshot restarted, from its ranks' first heartbeats."""

from __future__ import annotations

from lazarus.activities.resuming import first_step_done_at, script_restore_point, shows_restored_count
from lazarus.schema.contract import Heartbeat


def beat(rank: int, first: int | None, first_at: float | None = None, advanced_at: float | None = None) -> Heartbeat:
    return Heartbeat(
        rank=rank,
        step=first,
        phase="training",
        time=100.0,
        first_step=first,
        first_step_at=first_at,
        advanced_at=advanced_at,
        by="launcher",
    )


def test_a_script_that_prints_a_step_once_done_restarted_from_the_step_before_its_first():
    began = [beat(0, 1, 10.0), beat(1, 1, 10.1)]  # "step 1 loss ..." is the first line of the run
    assert not shows_restored_count(began)
    after = [beat(0, 11, 50.0, 51.0), beat(1, 11, 50.2, 51.1)]
    assert script_restore_point(after, shows_restored=False) == 10
    assert first_step_done_at(after, shows_restored=False) == 50.2


def test_a_progress_bar_shows_its_restored_count_first_and_its_first_step_is_its_first_advance():
    began = [beat(0, 0, 10.0), beat(1, 0, 10.1)]  # "0/40 [" before the first step
    assert shows_restored_count(began)
    after = [beat(0, 10, 50.0, 50.5), beat(1, 10, 50.1, 50.6)]  # "10/40 [" at once, "11/40 [" a step later
    assert script_restore_point(after, shows_restored=True) == 10
    assert first_step_done_at(after, shows_restored=True) == 50.6


def test_nothing_reported_is_unknown():
    assert not shows_restored_count([]) and script_restore_point([], shows_restored=True) is None
    assert first_step_done_at([beat(0, 10, 50.0)], shows_restored=True) is None  # not advanced yet
    assert script_restore_point([beat(0, 0, 1.0)], shows_restored=False) == 0  # never below 0
