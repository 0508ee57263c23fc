"""The CLI answers a user's mistake with one line and exit code 2, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys


def lazarus(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lazarus.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def assert_one_line_error(done: subprocess.CompletedProcess, starts: str) -> None:
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"lazarus: error: {starts}"), done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_bad_spec(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nlayout:\n  dp: 3\n")
    assert_one_line_error(lazarus("run", "start", str(path)), "layout: dp*pp*dp_shard*tp = 3")


def test_chaos_on_an_unknown_run(tmp_path):
    done = lazarus("chaos", "kill-node", "no-such-run", "node-1", env={"LAZARUS_HOME": str(tmp_path)})
    assert_one_line_error(done, "no run 'no-such-run' under")


def test_no_temporal_server():
    done = lazarus("run", "status", "some-run", env={"LAZARUS_TEMPORAL_ADDRESS": "127.0.0.1:1"})
    assert_one_line_error(done, "cannot reach Temporal at 127.0.0.1:1 (connection refused)")


def test_demo_rejects_a_kill_step_past_the_end(tmp_path):
    done = lazarus(
        "demo",
        "--kill-at-step",
        "100000",
        env={"LAZARUS_HOME": str(tmp_path), "LAZARUS_TEMPORAL_ADDRESS": "127.0.0.1:1"},
    )
    assert_one_line_error(done, "--kill-at-step 100000 must be between 1 and 299")


def test_demo_rejects_negative_spares(tmp_path):
    done = lazarus(
        "demo", "--spares", "-1", env={"LAZARUS_HOME": str(tmp_path), "LAZARUS_TEMPORAL_ADDRESS": "127.0.0.1:1"}
    )
    assert_one_line_error(done, "--spares -1: cluster.spare_nodes: must be greater than or equal to 0")


def test_help_explains_the_commands():
    done = lazarus("--help")
    assert done.returncode == 0
    for word in ("server", "worker", "run", "chaos", "demo", "LAZARUS_TEMPORAL_ADDRESS", "LAZARUS_HOME"):
        assert word in done.stdout
