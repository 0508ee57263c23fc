"""An operator's change to a run's recovery policy (the set_policy update): the policy in force with
the change merged in and checked as the spec's loader checks it, and the change said in one line."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from lazarus.schema.policy import RecoveryPolicy


def _merged(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in changes.items():
        nested = isinstance(value, dict) and isinstance(base.get(key), dict)
        merged[key] = _merged(base[key], value) if nested else value
    return merged


def changed_policy(policy: RecoveryPolicy, changes: dict[str, Any], layout_dp: int) -> RecoveryPolicy:
    """`policy` with `changes` (nested as in the spec) merged in; fields not named keep their values.

    Raises ValueError with one line naming the first field that is wrong, as the spec's loader
    would (`recovery.<field>: why`); min_dp may not exceed `layout_dp`, the spec's layout.dp.
    """
    if "workflow_task_timeout_seconds" in changes:
        # The server holds it per workflow execution, from the start (or a continue-as-new) on.
        raise ValueError("recovery.workflow_task_timeout_seconds: fixed when the run's workflow starts")
    try:
        changed = RecoveryPolicy.model_validate(_merged(policy.model_dump(mode="json"), changes))
    except ValidationError as error:
        first = error.errors()[0]
        why = " ".join(first["msg"].removeprefix("Value error, ").split())
        # A check across fields (a model validator) has no field of its own, and names them itself.
        raise ValueError(f"recovery.{'.'.join(map(str, first['loc']))}: {why}" if first["loc"] else why) from None
    if changed.min_dp > layout_dp:
        raise ValueError(f"recovery.min_dp: {changed.min_dp} exceeds layout.dp {layout_dp}")
    return changed


def describe_changes(changes: dict[str, Any]) -> str:
    """Policy changes as dotted assignments: `hang_after_seconds=60, stages.drain.max_attempts=9`."""

    def dotted(changes: dict[str, Any], prefix: str) -> list[str]:
        return [
            item
            for key, value in changes.items()
            for item in (dotted(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}={value}"])
        ]

    return ", ".join(dotted(changes, ""))
