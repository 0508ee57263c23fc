"""Since when a rank has sat idle (trainer/agent/idle.py): no CPU in its process tree, no output in its log.
A process that sleeps keeps its idle_since; one that spins, prints, or has a child that spins moves it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lazarus.schema.files import process_start_time, write_json_atomic
from lazarus.schema.rundir import RunDir
from lazarus.trainer.agent.idle import IdleWatch, tree_cpu_ticks
from tests.support.backends import launch_two_ranks
from tests.support.waiting import wait_until

SLEEPS = "import time; print('ready', flush=True); time.sleep(600)"
SPINS = "print('ready', flush=True)\nwhile True: pass"
PRINTS = "import time\nwhile True:\n    print('tick', flush=True); time.sleep(0.05)"
# A parent that sleeps while its child (a data-loader worker, say) works.
CHILD_SPINS = (
    "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'while True: pass']);"
    " print('ready', flush=True); time.sleep(600)"
)


@pytest.fixture
def processes():
    """Processes a test starts, each killed (with its children) at the end, however the test ended."""
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        for child in children(process.pid):
            os.kill(child, signal.SIGKILL)
        process.kill()
        process.wait()


def children(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def start_rank(processes: list, run: RunDir, code: str, rank: int = 0) -> subprocess.Popen:
    """Start `code` as rank `rank` of incarnation 0, its output in the rank's log and its pid recorded
    as a launcher records it; returns once it printed its first line."""
    log = run.log_file(0, rank)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        process = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT)
    processes.append(process)
    write_json_atomic(run.pid_file(0, rank), {"pid": process.pid, "start_time": process_start_time(process.pid)})
    wait_until(lambda: log.stat().st_size > 0, "the process's first line")
    return process


def idle_times(watch: IdleWatch, rank: int = 0, samples: int = 8, every: float = 0.1) -> list[float | None]:
    """The rank's idle_since at `samples` samples, `every` seconds apart."""
    found = []
    for _ in range(samples):
        found.append(watch.idle_since(rank, time.time()))
        time.sleep(every)
    return found


def test_a_sleeping_process_keeps_the_time_it_was_first_seen(tmp_path, processes):
    run = RunDir(tmp_path)
    start_rank(processes, run, SLEEPS)
    time.sleep(0.3)  # its startup's CPU is behind it
    watch = IdleWatch(run, 0, sample_seconds=0.05)
    first = time.time()
    times = idle_times(watch)
    assert times[0] >= first and set(times) == {times[0]}, times


@pytest.mark.parametrize("code", [SPINS, PRINTS, CHILD_SPINS], ids=["spins", "prints", "child-spins"])
def test_a_process_that_works_or_prints_moves_it(tmp_path, processes, code):
    run = RunDir(tmp_path)
    start_rank(processes, run, code)
    watch = IdleWatch(run, 0, sample_seconds=0.05)
    times = idle_times(watch, samples=10, every=0.15)
    assert all(t is not None for t in times)
    assert times == sorted(times) and len(set(times)) >= 5, times  # later and later: never idle for long


def test_a_sample_is_taken_at_most_every_sample_seconds(tmp_path, processes):
    run = RunDir(tmp_path)
    start_rank(processes, run, SPINS)
    watch = IdleWatch(run, 0, sample_seconds=60)
    first = watch.idle_since(0, time.time())
    time.sleep(0.2)
    assert watch.idle_since(0, time.time()) == first  # spinning, but not looked at again yet


def test_unknown_before_the_process_starts_and_after_it_is_gone(tmp_path, processes):
    run = RunDir(tmp_path)
    watch = IdleWatch(run, 0, sample_seconds=0)
    assert watch.idle_since(0, time.time()) is None  # no pid recorded
    process = start_rank(processes, run, SLEEPS)
    start = process_start_time(process.pid)
    assert watch.idle_since(0, time.time()) is not None
    process.kill()
    process.wait()
    assert watch.idle_since(0, time.time()) is None
    assert tree_cpu_ticks(process.pid, start) is None


def test_another_process_with_the_recorded_pid_is_not_the_rank(tmp_path, processes):
    run = RunDir(tmp_path)
    process = start_rank(processes, run, SLEEPS)
    start = process_start_time(process.pid)
    assert tree_cpu_ticks(process.pid, start) is not None
    assert tree_cpu_ticks(process.pid, start + 1) is None  # a reused pid: another process


def test_the_local_backend_reports_idle_since_from_the_launchers(cluster):
    """Through the node reports: a rank that sleeps (a plain script waiting in a collective) has an
    idle_since that stays put, one that spins has one that keeps up with the clock."""
    command = ["python", "-c", "import os, time\nif os.environ['RANK'] == '1':\n    while True: pass\ntime.sleep(600)"]
    launch_two_ranks(cluster, command, warm=False, recovery={"heartbeat_interval_seconds": 0.1})
    wait_until(lambda: all(r.idle_since for r in cluster.observe("r1", 0).ranks), "both ranks' idle_since")
    # The sleeper's startup behind it: idle for a while already.
    wait_until(lambda: time.time() - cluster.observe("r1", 0).ranks[0].idle_since > 0.5, "rank 0 to sit idle")
    before = cluster.observe("r1", 0).ranks
    time.sleep(1.0)
    after = cluster.observe("r1", 0).ranks
    assert after[0].idle_since == before[0].idle_since < time.time() - 0.9  # asleep: put
    assert after[1].idle_since > before[1].idle_since > time.time() - 2.5  # spinning: keeps moving


def test_a_stopped_process_is_held_and_one_waiting_in_a_sleep_is_not(tmp_path, processes):
    """Every rank behind a hung one idles; the launcher tells the one that cannot run (SIGSTOP: state
    T) from those that wait (S), and a continued one is no longer held."""
    run = RunDir(tmp_path)
    watch = IdleWatch(run, 0, sample_seconds=0)
    waiting = start_rank(processes, run, SLEEPS, rank=0)
    stopped = start_rank(processes, run, SLEEPS, rank=1)
    os.kill(stopped.pid, signal.SIGSTOP)
    wait_until(lambda: Path(f"/proc/{stopped.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T", "stopped")
    first = time.time()
    for rank in (0, 1):
        watch.idle_since(rank, first)  # the first sample only starts the idle clock
    later = first + 1.0
    assert watch.idle_since(0, later) == first and watch.idle_since(1, later) == first
    assert watch.held(0) is None and watch.held(1) == "T"
    os.kill(stopped.pid, signal.SIGCONT)
    wait_until(lambda: Path(f"/proc/{stopped.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T", "continued")
    watch.idle_since(1, later + 1.0)
    assert watch.held(1) is None
    assert waiting.poll() is None
