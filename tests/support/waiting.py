"""Waiting for a condition in tests: poll it, and fail with what was awaited when it does not come."""

from __future__ import annotations

import time


def wait_until(condition, what: str, timeout: float = 60.0, every: float = 0.02):
    """Return `condition()`'s first truthy value; fail the test after `timeout` seconds, naming `what`."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(every)
    return value
