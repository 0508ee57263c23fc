"""The hang time, worked out in one place (schema/policy.py hang_seconds): the same numbers its
callers (activities/pace.py, activities/health.py, activities/hangs.py, longest_hang_seconds) had."""

from __future__ import annotations

import pytest

from lazarus.activities.pace import MIN_GAPS, Pace
from lazarus.schema.policy import RecoveryPolicy, hang_seconds

DERIVED = RecoveryPolicy(
    startup_grace_seconds=60,
    hang_floor_seconds=1.0,
    hang_step_multiple=5.0,
    quiet_hang_seconds=10.0,
    busy_hang_seconds=300.0,
)
EXPLICIT = DERIVED.model_copy(update={"hang_after_seconds": 30.0})


@pytest.mark.parametrize(
    ("stretch", "of", "expected"),
    [
        (None, "step", 60.0),  # no step times yet: the startup grace
        (0.4, "step", 2.0),  # 5 x the step times' p99
        (0.12, "step", 1.0),  # 5 x 0.12 s is under hang_floor_seconds
        (None, "idle", 60.0),  # no rank seen busy yet: the startup grace
        (3.1, "idle", 15.5),  # 5 x the longest idle stretch
        (1.0, "idle", 10.0),  # 5 x 1 s is under quiet_hang_seconds
        (None, "longest", 300.0),  # busy_hang_seconds
        (1000.0, "longest", 300.0),  # whatever the stretch
    ],
)
def test_a_derived_hang_time(stretch, of, expected):
    assert hang_seconds(DERIVED, stretch, of) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("stretch", [None, 0.01, 0.4, 1000.0])
@pytest.mark.parametrize("of", ["step", "idle", "longest"])
def test_the_policys_own_hang_time_is_the_hang_time_whatever_else(stretch, of):
    assert hang_seconds(EXPLICIT, stretch, of) == 30.0


def test_the_callers_ask_the_one_function():
    assert DERIVED.longest_hang_seconds == 300.0 and EXPLICIT.longest_hang_seconds == 30.0
    pace = Pace(DERIVED)
    assert pace.hang_after() == pace.quiet_after() == 60.0  # no steps, nobody busy yet
    pace.gaps.extend([0.4] * MIN_GAPS)
    assert pace.hang_after() == pytest.approx(2.0)
    assert Pace(EXPLICIT).hang_after() == Pace(EXPLICIT).quiet_after() == 30.0
