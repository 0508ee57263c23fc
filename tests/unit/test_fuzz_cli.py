"""The CLI, typed at the way a careless or hostile user types: every mistake ends with exit code 2
and one line on stderr that names it, never a traceback, and nothing on stdout.

The commands run in this process (lazarus.cli.main); where a command gets as far as Temporal, the
client is a stub that says so in its own words, so that a test can tell a refusal from an
attempt; the last test asks a real (time-skipping) server about runs it does not have.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lazarus import cli
from lazarus.commands import common, controls, runs

ROOT = Path(__file__).resolve().parents[2]
NOT_CONNECTED = "stub: the command got as far as connecting to Temporal"

RUN_IDS = st.sampled_from(["ok-run", "../../x", "..", "", "-rf", ".x", "a/b", "a\nb", "x" * 101, "ü"]) | st.text(
    max_size=12
)
NODES = st.sampled_from(["node-1", "../x", "", "a/b", "a b", "\x00", "n" * 300]) | st.text(max_size=8)
NUMBERS = st.sampled_from(["0", "-1", "nan", "inf", "-inf", "1e400", "2**63", "9" * 30, "x", "", "²", " 1"]) | st.text(
    max_size=6
)
PAIRS = st.sampled_from(
    ["=", "a", "a=", "=1", ".a=1", "a..b=1", "x=[1", "a={", "a=!!binary AAAA", "a=2024-01-01", "a=.inf", "a.b.c"]
) | st.text(max_size=12)


@st.composite
def command_lines(draw) -> list[str]:
    """A command with its arguments, some of them wrong."""
    run, node, number = draw(RUN_IDS), draw(NODES), draw(NUMBERS)
    shape = draw(
        st.sampled_from(
            [
                ["run", "status", run],
                ["run", "watch", run],
                ["run", "report", run, "--json"],
                ["run", "logs", run, "--node", node, "--incarnation", number],
                ["run", "pause", run, "--reason", draw(st.text(max_size=8))],
                ["run", "resume", run],
                ["run", "abort", run],
                ["run", "drain-node", run, node],
                ["run", "return-node", run, node],
                ["run", "reshard", run, number],
                ["run", "approve", run, draw(st.sampled_from(["wait-longer", "wait_longer", "x"])), "--wait-seconds"]
                + [number],
                ["run", "set-policy", run, *draw(st.lists(PAIRS, max_size=3))],
                ["run", "list", "--state", draw(st.sampled_from(["TRAINING", "x' OR 1=1", "paused", ""])), "--limit"]
                + [number],
                ["run", "start", str(ROOT / "examples" / "demo.yaml"), "--run-id", run],
                ["chaos", "kill-node", run, node],
                ["chaos", "return-node", run, node],
            ]
        )
    )
    return shape + draw(st.sampled_from([[], [], ["--bogus"], ["extra\nline"]]))


@pytest.fixture
def lazarus(monkeypatch, capsys, tmp_path):
    """lazarus(*argv) -> (exit code, stdout, stderr) of the CLI run in this process."""

    async def not_connected(settings):
        raise common.UserError(NOT_CONNECTED)

    def exit_now(code):
        raise SystemExit(code)

    monkeypatch.setenv("LAZARUS_HOME", str(tmp_path))
    monkeypatch.setattr(os, "_exit", exit_now)  # main ends the process itself
    monkeypatch.setattr(logging, "basicConfig", lambda **_: None)
    for module in (runs, controls):
        monkeypatch.setattr(module, "connect_client", not_connected)

    def run(*argv: str) -> tuple[int, str, str]:
        with pytest.raises(SystemExit) as ended:
            cli.main(list(argv))
        out, err = capsys.readouterr()
        return ended.value.code, out, err

    return run


def assert_one_line_error(done: tuple[int, str, str], *names: str) -> str:
    """Exit code 2, nothing on stdout, one `lazarus: error:` line holding every name; returns it."""
    code, out, err = done
    assert code == 2 and out == "", done
    assert err.count("\n") == 1 and err.startswith(("lazarus: error: ", "lazarus launch: error: ")), err
    assert "Traceback" not in err
    for name in names:
        assert name in err, err
    return err


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(command_lines())
@example(["run", "status", "../../x"])
@example(["run", "start", "examples/demo.yaml", "--run-id", "../../x"])
@example(["run", "reshard", "ok", "0"])
@example(["run", "approve", "ok", "wait-longer", "--wait-seconds", "nan"])
@example(["run", "set-policy", "ok", "a=1", "a.b=2"])
@example(["run", "set-policy", "ok", "x=[1"])
@example(["run", "status", "ok", "extra\nline"])
def test_any_mistake_is_one_line_and_exit_code_2(lazarus, argv):
    assert_one_line_error(lazarus(*argv))


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (
            ["run", "start", "examples/demo.yaml", "--run-id", "../../x"],
            ["argument --run-id: '../../x' is not a run id"],
        ),
        (["run", "status", ".."], ["argument RUN: '..' is not a run id"]),
        (["run", "watch", "-"], ["argument RUN"]),
        (["run", "logs", "a\\b"], ["'a\\\\b' is not a run id"]),
        (["run", "report", "x" * 101], ["is not a run id"]),
        (["run", "logs", "ok", "--node", "../../etc"], ["argument --node: '../../etc' is not a node name"]),
        (["run", "pause", "a/b"], ["argument RUN"]),
        (["run", "drain-node", "ok", "a/b"], ["argument NODE: 'a/b' is not a node name"]),
        (["run", "return-node", "ok", ""], ["argument NODE: '' is not a node name"]),
        (["chaos", "kill-node", "../../x", "node-1"], ["argument RUN"]),
        (["chaos", "return-node", "ok", "../node-1"], ["argument NODE"]),
        (["run", "reshard", "ok", "two"], ["argument DP: invalid int value: 'two'", "lazarus run reshard --help"]),
        (["run", "reshard", "ok", "0"], ["reshard: dp: must be greater than or equal to 1 (got 0)"]),
        (["run", "approve", "ok", "wait-longer", "--wait-seconds", "-5"], ["approve: wait_seconds: must be greater"]),
        (["run", "approve", "ok", "wait-longer", "--wait-seconds", "inf"], ["approve: wait_seconds: must be a finite"]),
        (["run", "approve", "ok", "now"], ["argument action: invalid choice: 'now'"]),
        (["run", "set-policy", "ok", "hang_after_seconds"], ["set-policy: 'hang_after_seconds' is not FIELD=VALUE"]),
        (["run", "set-policy", "ok", "stages..max_attempts=3"], ["is not FIELD=VALUE"]),
        (["run", "set-policy", "ok", "a=[1"], ["set-policy: a: '[1' is not a value"]),
        (["run", "set-policy", "ok", "a=2024-01-01"], ["set-policy: a: '2024-01-01' is not a value"]),
        (["run", "set-policy", "ok", "a=1", "a.b=2"], ["set-policy: a.b is given twice"]),
        (["run", "list", "--state", "x' OR 1=1"], ['argument --state: "x\' OR 1=1" is not a run state']),
        (["run", "list", "--limit", "0"], ["argument --limit: '0' is not a whole number of 1 or more"]),
        (["run", "logs", "no-such-run"], ["no run directory at"]),
        (["chaos", "kill-node", "no-such-run", "node-1"], ["no run 'no-such-run' under"]),
        (["run", "status", "ok", "extra\nline"], ["unrecognized arguments: extra\\nline"]),
        (["run"], ["the following arguments are required: ACTION"]),
        (["lunch"], ["argument COMMAND: invalid choice: 'lunch'"]),
        (["launch", "--nnodes", "²", "examples/train_ddp.py"], ["--nnodes: '²' is not a number of nodes"]),
        (["launch", "--rdzv-id", "../x", "examples/train_ddp.py"], ["--rdzv-id: '../x' is not a run id"]),
        (["launch", "--max-restarts", "many", "x.py"], ["argument --max-restarts/--max_restarts: invalid int value"]),
    ],
)
def test_each_mistake_is_named(lazarus, monkeypatch, argv, names):
    monkeypatch.chdir(ROOT)
    err = assert_one_line_error(lazarus(*argv), *names)
    assert NOT_CONNECTED not in err, "refused only once it reached Temporal"


def test_a_well_formed_command_gets_as_far_as_temporal(lazarus):
    """The stub is reached: the refusals above are the CLI's own, not the stub's."""
    assert_one_line_error(lazarus("run", "drain-node", "ok", "node-1", "--reason", "ECC"), NOT_CONNECTED)
    assert_one_line_error(lazarus("run", "set-policy", "ok", "hang_after_seconds=60", "stages.drain.max_attempts=9"))


def test_unknown_runs_on_a_real_server(lazarus, monkeypatch, time_skipping_env):
    monkeypatch.setattr(runs, "connect_client", common.connect_client)
    monkeypatch.setattr(controls, "connect_client", common.connect_client)
    monkeypatch.setenv("LAZARUS_TEMPORAL_ADDRESS", time_skipping_env.client.service_client.config.target_host)
    assert_one_line_error(lazarus("run", "status", "no-such-run"), "no status for run no-such-run")
    assert_one_line_error(lazarus("run", "report", "no-such-run", "--json"), "no status for run no-such-run")
    assert_one_line_error(lazarus("run", "pause", "no-such-run"), "pause: run no-such-run")
    assert_one_line_error(lazarus("run", "drain-node", "no-such-run", "node-1"), "drain-node: run no-such-run")
