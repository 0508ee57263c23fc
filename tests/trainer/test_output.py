"""A launcher reading its ranks' output: heartbeats from a progress pattern or any line, a rank's
own heartbeats left alone, and planned faults carried out for a script that knows nothing of them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lazarus.schema.contract import Heartbeat, read_heartbeat, write_heartbeat
from lazarus.schema.run import FaultInjection, TrainerSettings
from lazarus.schema.rundir import RunDir
from lazarus.trainer.output import OutputWatch
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

PRINTS_STEPS = """import time
for step in range(1, 1000):
    print(f"step {step} loss 0.5", flush=True)
    time.sleep(0.05)
"""


@pytest.fixture
def rank_process(tmp_path):
    """Start `python -c CODE` as rank 0 with its output in its log; killed at the end."""
    started = []

    def start(code: str) -> tuple[subprocess.Popen, Path]:
        log = tmp_path / "0.log"
        with open(log, "ab") as output:
            process = subprocess.Popen([sys.executable, "-c", code], stdout=output, stderr=subprocess.STDOUT)
        started.append(process)
        return process, log

    yield start
    for process in started:
        process.kill()
        process.wait(timeout=10)


def watching(tmp_path, process, log, fault=None, **trainer) -> tuple[OutputWatch, RunDir]:
    run = RunDir(tmp_path / "run")
    watch = OutputWatch(run, 0, TrainerSettings(command=["python", "x.py"], **trainer), fault)
    watch.add(0, process.pid, log, 0)
    watch.start()
    return watch, run


def test_steps_in_the_output_become_heartbeats(tmp_path, rank_process):
    process, log = rank_process(PRINTS_STEPS)
    watch, run = watching(tmp_path, process, log, progress_pattern=r"^step (?P<step>\d+) ")
    try:
        beat = wait_until(
            lambda: (b := read_heartbeat(run, 0, 0)) and b.step is not None and b.step >= 5 and b, "step 5", timeout=30
        )
    finally:
        watch.stop()
    assert beat.by == "launcher" and beat.phase == "training" and beat.first_step == 1 and beat.first_step_at


def test_with_output_as_heartbeat_any_line_is_one_and_the_rank_starts_as_starting(tmp_path, rank_process):
    process, log = rank_process("import time\ntime.sleep(0.5)\nprint('loading data', flush=True)\ntime.sleep(30)\n")
    watch, run = watching(tmp_path, process, log, output_is_heartbeat=True)
    try:
        assert read_heartbeat(run, 0, 0).phase == "starting"
        beat = wait_until(
            lambda: (b := read_heartbeat(run, 0, 0)) and b.phase == "training" and b, "a line read", timeout=30
        )
    finally:
        watch.stop()
    assert beat.step is None and beat.by == "launcher"


def test_a_rank_that_writes_its_own_heartbeats_is_left_alone(tmp_path, rank_process):
    process, log = rank_process(PRINTS_STEPS)
    run = RunDir(tmp_path / "run")
    write_heartbeat(run, 0, Heartbeat(rank=0, step=3, phase="training", time=1.0))
    watch, run = watching(tmp_path, process, log, progress_pattern=r"^step (?P<step>\d+) ")
    try:
        wait_until(lambda: "step 5 " in log.read_text(), "the rank's fifth step", timeout=30)
        watch.finish(0)
    finally:
        watch.stop()
    assert read_heartbeat(run, 0, 0) == Heartbeat(rank=0, step=3, phase="training", time=1.0)


def test_a_planned_fault_after_some_seconds_kills_the_rank(tmp_path, rank_process):
    process, log = rank_process("import time\ntime.sleep(60)\n")
    watch, _ = watching(tmp_path, process, log, FaultInjection(node="node-0", after_seconds=0.3))
    try:
        assert process.wait(timeout=30) == -9
    finally:
        watch.stop()


def test_a_planned_fault_at_a_step_kills_the_rank_once_its_output_shows_the_step_before(tmp_path, rank_process):
    process, log = rank_process(PRINTS_STEPS)
    fault = FaultInjection(node="node-0", step=6)
    watch, _ = watching(tmp_path, process, log, fault, progress_pattern=r"^step (?P<step>\d+) ")
    try:
        assert process.wait(timeout=30) == -9
    finally:
        watch.stop()
    printed = [int(line.split()[1]) for line in log.read_text().splitlines()]
    assert 5 <= printed[-1] <= 7  # killed within a poll of printing step 5
