"""The CLI answers a user's mistake with one line and exit code 2, never a traceback."""

from __future__ import annotations

import json
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


def test_chaos_refuses_a_node_that_is_not_the_runs(tmp_path):
    from lazarus.infra.backends.local.cluster import LocalCluster
    from lazarus.schema import parse_spec

    spec = {"name": "x", "trainer": {"command": ["python", "x.py"]}, "layout": {"dp": 2, "ranks_per_node": 1}}
    LocalCluster(tmp_path).create("mine", parse_spec({**spec, "cluster": {"active_nodes": 2, "spare_nodes": 1}}))
    LocalCluster(tmp_path).pool.quarantine("theirs", ["node-2"], "incident 1 of another run")
    nodes = {n.name: n.role for n in LocalCluster(tmp_path).inventory("mine").nodes}
    assert nodes == {"node-0": "active", "node-1": "active"}, nodes  # node-2 was the spare; now another run's

    for stranger in ("node-2", "node-9"):
        done = lazarus("chaos", "kill-node", "mine", stranger, env={"LAZARUS_HOME": str(tmp_path)})
        assert_one_line_error(
            done, f"{stranger} is not a node of run mine; its nodes: node-0 (active), node-1 (active)"
        )
        assert done.stdout == ""
    # Nothing was marked dead.
    assert all(n.healthy for n in LocalCluster(tmp_path).pool.read().nodes)


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


def test_the_pool_lists_adds_and_returns_nodes_and_refuses_unknown_ones(tmp_path):
    from lazarus.infra.backends.local.cluster import LocalCluster

    env = {"LAZARUS_HOME": str(tmp_path), "LAZARUS_TEMPORAL_ADDRESS": "127.0.0.1:1"}
    assert "has no node yet" in lazarus("pool", env=env).stdout
    added = lazarus("pool", "add", "2", env=env)
    assert added.returncode == 0 and added.stdout.startswith("added node-0, node-1")
    LocalCluster(tmp_path).pool.quarantine("gone-run", ["node-1"], "incident 1: node_down")
    listed = json.loads(lazarus("pool", "--json", env=env).stdout)
    assert [(n["name"], n["role"], n["owner"]) for n in listed["nodes"]] == [
        ("node-0", "free", None),
        ("node-1", "quarantined", "gone-run"),
    ]
    # The run that quarantined node-1 cannot be told (no server answers): the pool is changed directly.
    back = lazarus("pool", "return", "node-1", env=env)
    assert back.returncode == 0 and back.stdout == "node-1 is a free spare again\n", back.stderr
    assert LocalCluster(tmp_path).pool.read().node("node-1").role == "free"
    assert_one_line_error(
        lazarus("pool", "return", "node-7", env=env),
        f"the pool of sqlite:///{str(tmp_path).lstrip('/')}/lazarus.db has no node node-7",
    )
    assert_one_line_error(lazarus("pool", "add", "0", env=env), "argument COUNT: '0' is not a whole number")


def test_the_pool_lives_in_the_store_lazarus_store_names_and_a_bad_url_is_one_line(tmp_path):
    elsewhere = tmp_path / "shared" / "fleet.db"
    env = {"LAZARUS_HOME": str(tmp_path / "home"), "LAZARUS_STORE": f"sqlite:///{elsewhere}"}
    added = lazarus("pool", "add", "3", env=env)
    assert added.returncode == 0 and f"every run of sqlite:///{str(elsewhere).lstrip('/')}" in added.stdout
    assert elsewhere.exists() and not (tmp_path / "home" / "lazarus.db").exists()
    assert "3 node(s), 3 free hot spare(s)" in lazarus("pool", env=env).stdout
    bad = lazarus("pool", env={**env, "LAZARUS_STORE": "mysql://db/lazarus"})
    assert_one_line_error(bad, "LAZARUS_STORE='mysql://db/lazarus' names no store: use sqlite:///")
    down = lazarus("pool", env={**env, "LAZARUS_STORE": "postgresql://lazarus@127.0.0.1:1/lazarus"})
    assert_one_line_error(down, "the store postgresql://lazarus@127.0.0.1:1/lazarus does not answer")


def test_the_pool_places_nodes_in_domains_and_shows_and_resets_its_quarantine_breaker(tmp_path):
    import pytest

    from lazarus.infra.backend import QuarantineRefused
    from lazarus.infra.backends.local.cluster import LocalCluster

    env = {"LAZARUS_HOME": str(tmp_path), "LAZARUS_TEMPORAL_ADDRESS": "127.0.0.1:1"}
    lazarus("pool", "add", "4", env=env)
    placed = lazarus("pool", "domain", "rack-1", "node-0", "node-1", env=env)
    assert placed.returncode == 0 and placed.stdout == "node-0, node-1 in fault domain rack-1\n", placed.stderr
    assert [n.domain for n in LocalCluster(tmp_path).pool.read().nodes] == ["rack-1", "rack-1", None, None]
    capped = lazarus("pool", "breaker", "--max-fraction", "0.25", env=env)
    assert "closed: 0 of at most 1 node(s) quarantined in the last 300 s (25% of 4)" in capped.stdout
    assert_one_line_error(lazarus("pool", "breaker", "--max-fraction", "2", env=env), "--max-fraction: Input should be")
    # A second quarantine within the window trips it: `lazarus pool` says so, and how to reset it.
    pool = LocalCluster(tmp_path).pool
    pool.quarantine("a", ["node-0"], "incident 1")
    with pytest.raises(QuarantineRefused):
        pool.quarantine("b", ["node-2"], "incident 1")
    listed = lazarus("pool", env=env).stdout
    assert "quarantine breaker OPEN since" in listed and "reset it with `lazarus pool breaker --reset`" in listed
    assert "rack-1" in listed
    reset = lazarus("pool", "breaker", "--reset", env=env)
    assert reset.stdout.startswith("quarantine breaker closed: 0 of at most 1")
    assert_one_line_error(lazarus("pool", "domain", "rack-2", "node-9", env=env), "the pool has no node node-9")
    assert_one_line_error(
        lazarus("chaos", "kill-domain", "rack-9", env=env),
        f"the pool of sqlite:///{str(tmp_path).lstrip('/')}/lazarus.db has no node in fault domain 'rack-9'; "
        "domains: rack-1",
    )
