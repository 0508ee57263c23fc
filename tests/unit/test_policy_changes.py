"""set_policy's arithmetic: changes merged into the recovery policy, refused with one line naming the field."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lazarus.schema.policy import RecoveryPolicy
from lazarus.schema.policy_changes import changed_policy, describe_changes

POLICY = RecoveryPolicy()


def test_nested_changes_keep_the_fields_they_do_not_name():
    changed = changed_policy(POLICY, {"hang_after_seconds": 90, "stages": {"drain": {"max_attempts": 9}}}, 4)
    assert changed.hang_after_seconds == 90 and changed.stages.drain.max_attempts == 9
    assert changed.stages.drain.timeout_seconds == POLICY.stages.drain.timeout_seconds
    assert changed.stages.resume == POLICY.stages.resume
    assert POLICY.hang_after_seconds is None  # the policy changed from is left as it was (derived)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hang_after_seconds": -5}, "recovery.hang_after_seconds: Input should be greater than 0"),
        ({"stages": {"drain": {"max_attempts": -1}}}, "recovery.stages.drain.max_attempts: Input should be greater"),
        ({"hang_after": 5}, "recovery.hang_after: Extra inputs are not permitted"),
        ({"stages": 5}, "recovery.stages: Input should be"),
        ({"hang_after_seconds": 0.05}, "recovery.hang_after_seconds: 0.05 must exceed recovery.heartbeat_interval"),
        ({"min_dp": 5}, "recovery.min_dp: 5 exceeds layout.dp 4"),
        ({"workflow_task_timeout_seconds": 3}, "recovery.workflow_task_timeout_seconds: fixed when the run's"),
    ],
)
def test_a_bad_change_is_refused_with_one_line_naming_the_field(changes, message):
    with pytest.raises(ValueError) as refusal:
        changed_policy(POLICY, changes, layout_dp=4)
    assert str(refusal.value).startswith(message) and "\n" not in str(refusal.value)


def test_changes_are_described_as_dotted_assignments():
    described = describe_changes(
        {"hang_after_seconds": 60, "stages": {"drain": {"max_attempts": 9, "retry_backoff": 3}}}
    )
    assert described == "hang_after_seconds=60, stages.drain.max_attempts=9, stages.drain.retry_backoff=3"


@given(
    hang=st.floats(min_value=1, max_value=1e4),
    attempts=st.integers(min_value=0, max_value=100),
    stage=st.sampled_from(["launch", "detect", "drain", "reschedule", "replace_or_reshard", "resume", "stop"]),
)
def test_a_valid_change_is_exactly_that_change(hang, attempts, stage):
    changes = {"hang_after_seconds": hang, "stages": {stage: {"max_attempts": attempts}}}
    changed = changed_policy(POLICY, changes, layout_dp=4)
    stages = POLICY.stages.model_copy(
        update={stage: getattr(POLICY.stages, stage).model_copy(update={"max_attempts": attempts})}
    )
    assert changed == POLICY.model_copy(update={"hang_after_seconds": hang, "stages": stages})
    assert describe_changes(changes).count("=") == 2
