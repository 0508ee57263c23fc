"""An upgrade with runs in flight (bench/upgrade.py, small): the worker of the commit before HEAD,
from a worktree of it, launches ten runs on simulated nodes; this checkout's worker starts in the
middle of a burst of faults, both serve, the earlier stops, and a second burst is recovered by the
new code alone on histories the earlier began."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]


def test_runs_go_on_through_an_upgrade_from_the_commit_before():
    parent = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "HEAD~1"], capture_output=True)
    if parent.returncode != 0:
        pytest.skip("not a git checkout with the commit before HEAD (a shallow clone): nothing to upgrade from")
    done = subprocess.run(
        [sys.executable, "bench/upgrade.py", "--from", "HEAD~1", "--runs", "10", "--spread-seconds", "2"]
        + ["--overlap-seconds", "2", "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode in (0, 1), done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["failed"] == 0 and result["workflow_task_failures"] == 0, result
    assert result["exactly_once"] and result["needless_reshards"] == 0, result["problems"]
    # Both served: the earlier launched and recovered the first burst, the later the second.
    assert result["workflow_tasks_completed"]["earlier"] >= 10, result
    assert result["workflow_tasks_completed"]["later"] >= 10, result
    assert done.returncode == 0
