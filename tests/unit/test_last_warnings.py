"""At a fault, detect reads every rank's own newest heartbeat once (activities/watching.py
last_warnings): a warning a rank wrote after its node's last report, which a drained or lost node
never rewrites, still reaches the run's status."""

from __future__ import annotations

import time

from lazarus.activities.watching import last_warnings
from lazarus.schema.contract import Heartbeat, write_heartbeat
from lazarus.schema.layout import Layout
from lazarus.schema.records import Assignment
from lazarus.schema.rundir import RunDir


class RunFolder:
    """What last_warnings asks of a backend: the incarnation's assignment and the run directory."""

    def __init__(self, run: RunDir, assignment: Assignment | None):
        self.run, self._assignment = run, assignment

    def assignment(self, run_id: str, incarnation: int) -> Assignment | None:
        return self._assignment

    def run_dir(self, run_id: str) -> RunDir:
        return self.run


def test_every_ranks_last_warning_is_read_at_a_fault_once_each(tmp_path):
    run = RunDir(tmp_path / "r1")
    nodes = ["node-0", "node-1", "node-2", "node-3"]
    assignment = Assignment(incarnation=2, nodes=nodes, layout=Layout(dp=4), master_port=1)
    full = "checkpoint of step 20 not written: No space left on device"
    now = time.time()
    for rank, warning in [(0, None), (1, full), (2, full), (3, "loss is NaN at step 23")]:
        write_heartbeat(run, 2, Heartbeat(rank=rank, step=23, phase="training", time=now, warning=warning))
    run.heartbeat_file(2, 0).write_text("{torn")  # a torn file is passed over: the look judged the rest
    assert last_warnings(RunFolder(run, assignment), "r1", 2) == [full, "loss is NaN at step 23"]
    assert last_warnings(RunFolder(run, assignment), "r1", 3) == []  # nothing written for that incarnation
    assert last_warnings(RunFolder(run, None), "r1", 2) == []  # no assignment recorded
