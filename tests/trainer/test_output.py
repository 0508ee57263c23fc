"""A launcher reading its ranks' output: heartbeats from a progress pattern or any line (a tqdm bar
redrawn with carriage returns too), a rank's own heartbeats left alone, a bad line skipped, a
pattern that matches nothing warned of, and planned faults carried out for a script that knows
nothing of them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lazarus.schema.contract import Heartbeat, read_heartbeat, write_heartbeat
from lazarus.schema.run import FaultInjection, TrainerSettings
from lazarus.schema.rundir import RunDir
from lazarus.trainer.agent import output
from lazarus.trainer.agent.output import NO_MATCH_REFRESH_SECONDS, NO_MATCH_WARNING_SECONDS, OutputWatch
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


TQDM = r"(?P<step>\d+)/150\s\["


def bar(step: int) -> str:
    """One redraw of a tqdm bar, as tqdm writes it: a carriage return first, no line end."""
    return f"\r{step * 100 // 150:3d}%|#         | {step}/150 [00:0{step}<00:10, 9.9it/s]"


def reading(tmp_path, **trainer) -> tuple[OutputWatch, RunDir, Path]:
    """A watch of rank 0's log (written by the test), polled by the test, with no thread and no process."""
    run = RunDir(tmp_path / "run")
    log = tmp_path / "0.log"
    log.write_bytes(b"")
    watch = OutputWatch(run, 0, TrainerSettings(command=["python", "x.py"], **trainer), None)
    watch.add(0, 999_999_999, log, 0)
    return watch, run, log


def printing(log: Path, text: str) -> None:
    with open(log, "ab") as file:
        file.write(text.encode())


def test_a_tqdm_bar_redrawn_with_carriage_returns_gives_its_newest_step_from_step_0(tmp_path):
    watch, run, log = reading(tmp_path, progress_pattern=TQDM)
    printing(log, "loading\r\n" + bar(0) + bar(1))
    watch.poll()  # bar(1) is not ended yet: it may be half written
    beat = read_heartbeat(run, 0, 0)
    assert (beat.step, beat.first_step, beat.phase, beat.by) == (0, 0, "training", "launcher")
    watch.poll()  # it did not grow for a poll: the newest redraw, whole
    beat = read_heartbeat(run, 0, 0)
    assert (beat.step, beat.first_step) == (1, 0) and beat.advanced_at is not None
    printing(log, bar(2) + bar(3) + bar(4))
    watch.poll()
    assert read_heartbeat(run, 0, 0).step == 3
    printing(log, "\n")
    watch.poll()
    beat = read_heartbeat(run, 0, 0)
    assert (beat.step, beat.first_step) == (4, 0)


def test_an_unended_line_caught_half_written_never_takes_the_step_back(tmp_path):
    watch, run, log = reading(tmp_path, progress_pattern=r"step (?P<step>\d+)")
    printing(log, "step 14 loss 0.1\nstep 1")  # "step 15 ..." half written
    watch.poll()
    watch.poll()
    assert read_heartbeat(run, 0, 0).step == 14
    printing(log, "5 loss 0.1\n")
    watch.poll()
    assert read_heartbeat(run, 0, 0).step == 15


def test_the_watch_thread_reads_a_tqdm_bar_of_a_running_rank_from_step_0(tmp_path, rank_process):
    redraws = "".join(bar(step) for step in range(7))  # 6/150, not ended by a `\r`, is read once it stays
    process, log = rank_process(
        f"import sys, time\nsys.stderr.write({redraws!r})\nsys.stderr.flush()\ntime.sleep(60)\n"
    )
    watch, run = watching(tmp_path, process, log, progress_pattern=TQDM)
    try:
        beat = wait_until(lambda: (b := read_heartbeat(run, 0, 0)) and b.step == 6 and b, "step 6 read", timeout=30)
    finally:
        watch.stop()
    assert beat.first_step == 0 and beat.by == "launcher"


def test_the_last_step_in_a_line_wins():
    trainer = TrainerSettings(command=["python", "x.py"], progress_pattern=TQDM)
    assert trainer.step_in("".join(bar(step) for step in (0, 1, 2, 3))) == 3
    assert trainer.step_in(" 0/150 [") == 0 and trainer.step_in("loading") is None


def test_the_last_line_of_an_ended_rank_is_read(tmp_path):
    watch, run, log = reading(tmp_path, progress_pattern=TQDM)
    printing(log, bar(0) + bar(1) + bar(150))
    watch.finish(0)
    assert read_heartbeat(run, 0, 0).step == 150


def test_a_number_too_long_to_be_a_step_is_skipped(tmp_path):
    watch, run, log = reading(tmp_path, progress_pattern=r"step (?P<step>\d+)")
    # 5000 digits: int() refuses them (sys.get_int_max_str_digits).
    printing(log, "step 1\n" + f"step {'9' * 5000}\n" + "step 2\n")
    watch.poll()
    assert read_heartbeat(run, 0, 0).step == 2


def test_a_line_the_pattern_fails_on_is_said_once_and_skipped(tmp_path, capsys, monkeypatch):
    watch, run, log = reading(tmp_path, progress_pattern=r"step (?P<step>\d+)")
    real = TrainerSettings.step_in

    def fails_on_boom(self, line):
        if "boom" in line:
            raise ValueError("bad line")
        return real(self, line)

    monkeypatch.setattr(TrainerSettings, "step_in", fails_on_boom)
    printing(log, "step 1\n" + "boom\n" * 3 + "step 2\n")
    watch.poll()
    assert read_heartbeat(run, 0, 0).step == 2
    said = capsys.readouterr().err
    assert said.count("rank 0: cannot read a step from a line of its output (ValueError: bad line)") == 1


def test_an_error_writing_a_heartbeat_is_said_once_and_the_watch_goes_on(tmp_path, capsys, monkeypatch):
    watch, run, log = reading(tmp_path, progress_pattern=r"step (?P<step>\d+)")
    real = output.write_heartbeat

    def refuse_step_1(run, incarnation, beat):
        if beat.step == 1:
            raise ValueError("refused")
        real(run, incarnation, beat)

    monkeypatch.setattr(output, "write_heartbeat", refuse_step_1)
    for _ in range(3):
        printing(log, "step 1\n")
        watch.poll()
    printing(log, "step 2\n")
    watch.poll()
    assert read_heartbeat(run, 0, 0).step == 2
    said = capsys.readouterr().err
    assert said.count("rank 0: cannot write its heartbeat (ValueError: refused); watching on") == 1


def test_the_watch_thread_reads_on_past_a_bad_line(tmp_path, rank_process):
    code = f"print('step 1', flush=True)\nprint('step {'9' * 5000}', flush=True)\nprint('step 7', flush=True)\n"
    code += "import time\ntime.sleep(60)\n"
    process, log = rank_process(code)
    watch, run = watching(tmp_path, process, log, progress_pattern=r"step (?P<step>\d+)")
    try:
        wait_until(lambda: (b := read_heartbeat(run, 0, 0)) and b.step == 7, "step 7 read", timeout=30)
    finally:
        watch.stop()


def test_a_pattern_that_matches_nothing_for_long_is_a_warning_in_the_heartbeat(tmp_path):
    watch, run, log = reading(tmp_path, progress_pattern=TQDM)
    started = watch.ranks[0].started
    printing(log, "Epoch 1 | loss 0.5\n" * 7)
    watch.poll(now=started + NO_MATCH_WARNING_SECONDS - 1)
    assert read_heartbeat(run, 0, 0) is None  # not yet: a script's start-up may print anything
    watch.poll(now=started + NO_MATCH_WARNING_SECONDS + 1)
    beat = read_heartbeat(run, 0, 0)
    assert beat.step is None and beat.first_step is None and beat.phase == "starting"
    assert beat.warning == (
        f"trainer.progress_pattern {TQDM!r} matched none of rank 0's 7 lines in {NO_MATCH_WARNING_SECONDS + 1:.0f} s; "
        "check the pattern against the script's output"
    )
    # Kept fresh (no hang for a rank that reports no step) and worded the same while it lasts.
    printing(log, "Epoch 2 | loss 0.4\n")
    watch.poll(now=beat.time + NO_MATCH_REFRESH_SECONDS)
    again = read_heartbeat(run, 0, 0)
    assert again.time == beat.time + NO_MATCH_REFRESH_SECONDS and again.warning == beat.warning
    # A step read at last ends the warning.
    printing(log, bar(3) + "\n")
    watch.poll(now=again.time + 0.1)
    assert (read_heartbeat(run, 0, 0).step, read_heartbeat(run, 0, 0).warning) == (3, None)


def test_with_output_as_heartbeat_the_warning_keeps_the_newest_lines_time(tmp_path):
    watch, run, log = reading(tmp_path, progress_pattern=TQDM, output_is_heartbeat=True)
    started = watch.ranks[0].started
    printing(log, "Epoch 1 | loss 0.5\n")
    watch.poll(now=started + 5)
    watch.poll(now=started + NO_MATCH_WARNING_SECONDS + 1)
    beat = read_heartbeat(run, 0, 0)
    assert beat.time == started + 5 and "matched none of rank 0's 1 lines" in beat.warning
    watch.poll(now=started + NO_MATCH_WARNING_SECONDS + 60)
    assert read_heartbeat(run, 0, 0).time == started + 5  # a silent rank still goes stale


def test_a_rank_that_prints_nothing_gets_no_warning(tmp_path):
    watch, run, _ = reading(tmp_path, progress_pattern=TQDM)
    watch.poll(now=watch.ranks[0].started + NO_MATCH_WARNING_SECONDS + 1)
    assert read_heartbeat(run, 0, 0) is None
