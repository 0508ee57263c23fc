"""Python stacks of running ranks (trainer/agent/stack_dump.py, trainer/agent/stacks.py, infra/stacks.py): every
rank Lazarus starts, cold or forked from a warm standby, dumps its threads on SIGUSR1 with no change
to the user's script; a rank that has no such handler is never sent the signal (it would end it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.schema.files import process_start_time, process_state, read_json
from lazarus.schema.stacks import NO_DUMP, no_dump_reason, where_it_waited
from lazarus.trainer.agent.stack_dump import registered_process, with_dump_hook
from lazarus.trainer.agent.stacks import signal_for_stacks
from tests.support.backends import launch_two_ranks
from tests.support.waiting import wait_until

# A plain script (no Lazarus import) that waits forever in a function of a known name, as a rank
# waits in a collective for a peer that will never come.
BLOCKER = """
import json, os, sys, threading

def wait_for_the_peer_that_never_comes():
    threading.Event().wait()

print(json.dumps({"pythonpath": os.environ.get("PYTHONPATH"), "stacks": os.environ.get("LAZARUS_STACKS_FILE"),
                  "site": getattr(sys.modules.get("sitecustomize"), "MARK", None)}), flush=True)
wait_for_the_peer_that_never_comes()
"""


@pytest.fixture
def processes():
    """Processes a test starts, each killed at the end, however the test ended."""
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        process.kill()
        process.wait()


def start(processes: list, command: list[str], env: dict, out: Path) -> subprocess.Popen:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    processes.append(process)
    return process


def test_a_cold_python_process_registers_and_dumps_where_it_waits(tmp_path, processes):
    """The launcher's environment alone (no change to the script): the dump is registered, the
    user's PYTHONPATH is what the script sees, and a sitecustomize it shadowed still runs."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("MARK = 'their sitecustomize ran'\n")
    (tmp_path / "blocker.py").write_text(BLOCKER)
    stacks = tmp_path / "stacks" / "0.txt"
    env = with_dump_hook({**os.environ, "PYTHONPATH": str(theirs)}, str(stacks))
    process = start(processes, [sys.executable, str(tmp_path / "blocker.py")], env, tmp_path / "out.log")
    seen = wait_until(lambda: (tmp_path / "out.log").read_text().strip(), "the script's first line")
    assert seen == (
        f'{{"pythonpath": "{theirs}", "stacks": null, "site": "their sitecustomize ran"}}'
    )  # env as the user set it
    assert registered_process(stacks)[0] == process.pid
    assert signal_for_stacks(stacks)
    dump = wait_until(lambda: "wait_for_the_peer_that_never_comes" in stacks.read_text() and stacks.read_text(), "dump")
    assert "blocker.py" in dump and process.poll() is None  # dumped, and still running


@pytest.mark.parametrize(
    "command",
    [
        ["sleep", "600"],  # not Python: SIGUSR1 would end it
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGUSR1, signal.SIG_DFL); time.sleep(600)"],
    ],
    ids=["not-python", "reset-the-signal"],
)
def test_a_process_without_the_handler_is_never_signalled(tmp_path, processes, command):
    stacks = tmp_path / "stacks" / "0.txt"
    process = start(processes, command, with_dump_hook(dict(os.environ), str(stacks)), tmp_path / "out.log")
    time.sleep(0.5)  # Python: registered by now, and the script reset the signal
    if command[0] == "sleep":
        assert not stacks.exists()
        # Even a file that names it (a stale one, a pid reused) does not get it signalled.
        stacks.parent.mkdir(parents=True, exist_ok=True)
        stacks.write_text(
            f"# lazarus stacks of pid {process.pid}, start time {process_start_time(process.pid)} (...)\n"
        )
    assert registered_process(stacks)[0] == process.pid
    assert not signal_for_stacks(stacks)
    time.sleep(0.2)
    assert process.poll() is None


def launch(cluster: LocalCluster, command: list[str], warm: bool) -> None:
    launch_two_ranks(cluster, command, warm)


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_the_backend_captures_each_ranks_stack(cluster, tmp_path, warm):
    """Ranks started cold (a new interpreter) and forked from a warm standby alike."""
    script = tmp_path / "project" / "blocker.py"
    script.parent.mkdir()
    script.write_text(BLOCKER)
    launch(cluster, ["python", str(script)], warm)
    run = cluster.run_dir("r1")
    wait_until(lambda: all(run.log_file(0, r).exists() and run.log_file(0, r).read_text() for r in (0, 1)), "ranks")
    stacks = cluster.capture_stacks("r1", 0)
    assert sorted(stacks) == [0, 1]
    for rank, dump in stacks.items():
        assert "wait_for_the_peer_that_never_comes" in dump and "blocker.py" in dump, dump
        assert registered_process(run.stacks_file(0, rank))[0] == read_json(run.pid_file(0, rank))["pid"]
        assert ("trainer/agent/standby/" in dump) is warm  # forked: it runs the script in place, below the standby
    again = cluster.capture_stacks("r1", 0, ranks=[1], wait_seconds=5)
    assert list(again) == [1] and again[1].count("most recent call first") == 1  # the new dump alone
    assert all(r.alive for r in cluster.observe("r1", 0).ranks)
    # Cold or forked in place, the script saw the environment the user gave it.
    assert '"pythonpath": null, "stacks": null' in run.log_file(0, 0).read_text()


def test_ranks_that_are_not_python_are_left_alone(cluster):
    launch(cluster, ["sleep", "600"], warm=False)
    run = cluster.run_dir("r1")
    wait_until(lambda: all(run.pid_file(0, r).exists() for r in (0, 1)), "both ranks")
    began = time.monotonic()
    assert cluster.capture_stacks("r1", 0) == {} and time.monotonic() - began < 1  # nothing to wait for
    assert cluster.capture_stacks("r1", 0, ranks=[0, 1]) == {}
    time.sleep(0.3)
    assert all(r.alive for r in cluster.observe("r1", 0).ranks)


def test_a_stopped_rank_is_named_as_such_instead_of_waited_for_and_dumps_whole_once_continued(cluster, tmp_path):
    script = tmp_path / "project" / "blocker.py"
    script.parent.mkdir()
    script.write_text(BLOCKER)
    launch(cluster, ["python", str(script)], warm=False)
    run = cluster.run_dir("r1")
    wait_until(lambda: all(run.log_file(0, r).exists() and run.log_file(0, r).read_text() for r in (0, 1)), "ranks")
    stopped = read_json(run.pid_file(0, 1))["pid"]
    os.kill(stopped, signal.SIGSTOP)
    try:
        wait_until(lambda: process_state(stopped) == "T", "rank 1 to stop")
        # A wait long enough that the capture ends only because the launcher said rank 1 cannot dump.
        stacks = cluster.capture_stacks("r1", 0, wait_seconds=30)
        assert sorted(stacks) == [0, 1] and "wait_for_the_peer_that_never_comes" in stacks[0]
        assert no_dump_reason(stacks[1]) == (
            f"its process (pid {stopped}) is T: stopped (SIGSTOP or SIGTSTP); it cannot dump its stacks now"
        )
        assert where_it_waited(stacks[1]) == no_dump_reason(stacks[1])
    finally:
        os.kill(stopped, signal.SIGCONT)
    # Continued, it dumps again, whole, after the note (its file is appended to, never overwritten).
    again = cluster.capture_stacks("r1", 0, ranks=[1], wait_seconds=30)
    assert "wait_for_the_peer_that_never_comes" in again[1] and no_dump_reason(again[1]) is None
    assert run.stacks_file(0, 1).read_text().count(NO_DUMP) == 1
