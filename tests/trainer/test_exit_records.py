"""How a launcher records a rank's end: the exception, from torch's @record file or the traceback
at the end of the rank's log (a script that does not use @record)."""

from __future__ import annotations

import json
import subprocess
import sys

from lazarus.schema.contract import read_exit
from lazarus.schema.rundir import RunDir
from lazarus.trainer.agent.launcher import record_exit

SCRIPT = """
import sys
print("epoch 1 | loss 0.5", flush=True)
try:
    open("out/checkpoint-40/trainer_state.json")
except FileNotFoundError as error:
    raise RuntimeError("could not resume from out/checkpoint-40") from error
"""


def test_the_exception_at_the_end_of_a_ranks_log_is_its_error(tmp_path):
    run = RunDir(tmp_path / "run")
    log = run.log_file(0, 3)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:  # a real traceback, chained, as Python prints it
        code = subprocess.run([sys.executable, "-c", SCRIPT], stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
    record_exit(run, 0, 3, code.returncode)
    ended = read_exit(run, 0, 3)
    assert ended.code == 1 and ended.error == "RuntimeError: could not resume from out/checkpoint-40"


def test_records_file_wins_and_a_clean_or_killed_end_has_no_error(tmp_path):
    run = RunDir(tmp_path / "run")
    traceback = "Traceback (most recent call last):\n  File 'x.py', line 1\nValueError: from the log\n"
    for rank in range(3):
        run.log_file(0, rank).parent.mkdir(parents=True, exist_ok=True)
        run.log_file(0, rank).write_text(traceback)
    error_file = run.error_file(0, 0)
    error_file.parent.mkdir(parents=True, exist_ok=True)
    error_file.write_text(json.dumps({"message": {"message": "ValueError: rank 3 saw a bad batch\n"}}))
    record_exit(run, 0, 0, 1)
    assert read_exit(run, 0, 0).error == "ValueError: rank 3 saw a bad batch"
    record_exit(run, 0, 1, -9)  # SIGKILL: whatever the log says, no exception ended it
    assert read_exit(run, 0, 1).error == "" and read_exit(run, 0, 1).signal == "SIGKILL"
    run.log_file(0, 2).write_text(traceback + "then it recovered and printed more\n")
    record_exit(run, 0, 2, 2)
    assert read_exit(run, 0, 2).error == "ValueError: from the log"
