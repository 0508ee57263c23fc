"""What the Temporal server answers with an error (temporalio's RPCError) reaches the user as one
line that names the server and its answer, with a non-zero exit status and no traceback; and the
CLI ends its process itself after any error (lazarus.cli.main)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from temporalio.client import RPCTimeoutOrCancelledError
from temporalio.service import RPCError, RPCStatusCode

from lazarus import cli
from lazarus.commands import common, controls, runs

ROOT = Path(__file__).resolve().parents[2]
ADDRESS = "temporal.invalid:7233"
"""Never contacted (the tests replace the client's connect), and not this machine's: on a loopback
address the CLI would name a dev server of another home found there (tests/e2e/test_server.py), as
one another test started on a free port may be, and add that to the lines these tests compare."""


def test_an_rpc_error_is_one_line_naming_the_server_and_its_answer():
    error = RPCError("shard status unknown", RPCStatusCode.UNAVAILABLE, b"")
    assert common.server_error(error, ADDRESS) == f"Temporal at {ADDRESS} answered UNAVAILABLE: shard status unknown"


def test_a_message_over_several_lines_becomes_one():
    error = RPCError("namespace x\nis not\tfound ", RPCStatusCode.NOT_FOUND, b"")
    assert common.server_error(error, ADDRESS) == f"Temporal at {ADDRESS} answered NOT_FOUND: namespace x is not found"
    empty = RPCError("", RPCStatusCode.INTERNAL, b"")
    assert common.server_error(empty, ADDRESS) == f"Temporal at {ADDRESS} answered INTERNAL: no message"


def test_a_call_that_timed_out_names_the_server():
    line = common.server_error(RPCTimeoutOrCancelledError("Timeout expired"), ADDRESS)
    assert line == f"Temporal at {ADDRESS} did not answer in time (Timeout expired)"


def test_other_errors_are_not_the_servers():
    assert common.server_error(ValueError("a bug"), ADDRESS) is None


@pytest.fixture
def lazarus(monkeypatch, capsys, tmp_path):
    """lazarus(connect, *argv) -> (exit code, stdout, stderr) of the CLI run in this process, its
    Temporal client replaced by `connect` (an async function of the settings)."""
    ended_by_main = []

    def exit_now(code):
        ended_by_main.append(code)
        raise SystemExit(code)

    monkeypatch.setenv("LAZARUS_HOME", str(tmp_path))
    monkeypatch.setenv("LAZARUS_TEMPORAL_ADDRESS", ADDRESS)
    monkeypatch.setattr(os, "_exit", exit_now)
    monkeypatch.setattr(logging, "basicConfig", lambda **_: None)

    def run(connect, *argv: str) -> tuple[int, str, str]:
        for module in (runs, controls):
            monkeypatch.setattr(module, "connect_client", connect)
        with pytest.raises(SystemExit) as ended:
            cli.main(list(argv))
        out, err = capsys.readouterr()
        assert ended_by_main == [ended.value.code], "main ends the process itself (os._exit)"
        ended_by_main.clear()
        return ended.value.code, out, err

    return run


@pytest.mark.parametrize(
    "argv", [["run", "status", "r1"], ["run", "pause", "r1"], ["run", "start", "examples/demo.yaml"]]
)
def test_a_server_error_no_command_handled_is_one_line_and_exit_1(lazarus, monkeypatch, argv):
    async def broken_server(settings):
        raise RPCError("shard status unknown", RPCStatusCode.UNAVAILABLE, b"")

    monkeypatch.chdir(ROOT)
    code, out, err = lazarus(broken_server, *argv)
    assert (code, out) == (1, "")
    assert err == f"lazarus: error: Temporal at {ADDRESS} answered UNAVAILABLE: shard status unknown\n"


def test_a_bug_shows_its_traceback_and_the_process_still_ends(lazarus):
    async def buggy(settings):
        raise ZeroDivisionError("a bug of ours")

    code, out, err = lazarus(buggy, "run", "status", "r1")
    assert (code, out) == (1, "")
    assert "Traceback" in err and "ZeroDivisionError: a bug of ours" in err
