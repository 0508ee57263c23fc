"""Failpoints: one inside each recovery stage, and a misspelt one refused rather than never hit."""

from __future__ import annotations

import pytest

from lazarus.activities.failpoints import ENV_FAILPOINT_DIR, ENV_FAILPOINTS, STAGE_FAILPOINTS, Failpoints
from lazarus.schema import STAGES


def test_every_stage_has_a_failpoint():
    assert list(STAGE_FAILPOINTS) == list(STAGES)


def test_an_unknown_failpoint_is_refused_naming_the_known_ones(tmp_path):
    with pytest.raises(SystemExit, match="no failpoint drain.after_quarantin .*known: detect.after_fault"):
        Failpoints.from_environ({ENV_FAILPOINTS: "drain.after_quarantin", ENV_FAILPOINT_DIR: str(tmp_path)})
    armed = Failpoints.from_environ({ENV_FAILPOINTS: " resume.after_launch ,", ENV_FAILPOINT_DIR: str(tmp_path)})
    assert armed.armed == {"resume.after_launch"}
