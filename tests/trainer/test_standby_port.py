"""A Kubernetes standby (trainer/agent/standby/port.py) as its pod runs it: orders over its port, refused
without the run's secret or for another node; a started launcher's ranks are forked warm, a
stop kills them and answers once they are gone, and the standby records how each launcher ended."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.infra.standby_orders import send_order
from lazarus.schema import Assignment, parse_spec
from lazarus.schema.contract import ENV_NODE, ENV_RUN_DIR, ENV_STANDBY_ADDRESS, read_exit
from lazarus.schema.files import read_json, write_once
from tests.support.waiting import wait_until

# A rank that records whether torch came with its fork, then trains for ever or exits at once.
RANK = """
import json, os, sys, time
rank = int(os.environ["RANK"])
report = os.path.join(os.environ["REPORT_DIR"], f"{rank}.json")
with open(report + ".part", "w") as out:  # renamed when whole: the test reads it while the rank runs
    json.dump({"torch": "torch" in sys.modules, "pid": os.getpid()}, out)
os.replace(report + ".part", report)
if sys.argv[1] == "forever":
    time.sleep(600)
"""
SECRET = "the-runs-secret"


@pytest.fixture
def standby(tmp_path):
    """Run `r1` (2 nodes of 1 rank, the RANK script) and the standby of node-0 on 127.0.0.1; yields
    (run, its ready record, the reports folder). The standby is killed at the end."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    reports = tmp_path / "reports"
    reports.mkdir()
    spec = parse_spec(
        {
            "name": "r",
            "cluster": {"active_nodes": 2, "spare_nodes": 0},
            "layout": {"dp": 2},
            "trainer": {"command": ["python", str(script), "forever"], "env": {"REPORT_DIR": str(reports)}},
        }
    )
    cluster = LocalCluster(tmp_path / "home")
    cluster.create("r1", spec)
    cluster.commit_assignment(
        "r1", Assignment(incarnation=0, nodes=["node-0", "node-1"], layout=spec.layout, master_port=29999)
    )
    run = cluster.run_dir("r1")
    write_once(run.standby_token_file, SECRET)
    run.standby("node-0").mkdir(parents=True)
    env = {**os.environ, ENV_RUN_DIR: str(run.root), ENV_NODE: "node-0", ENV_STANDBY_ADDRESS: "127.0.0.1"}
    env["OMP_NUM_THREADS"] = "1"
    with open(tmp_path / "standby.log", "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "lazarus.trainer.agent.standby"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        ready = wait_until(lambda: read_json(run.standby("node-0") / "ready"), "the standby to listen")
        yield run, ready, reports
    finally:
        process.kill()
        process.wait()
        for rank in (0, 1):  # a rank left by a failed test (a stop kills them otherwise)
            if record := read_json(run.pid_file(0, rank)):
                _kill(record["pid"])


def _kill(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False


def test_orders_without_the_secret_or_for_another_node_are_refused(standby):
    run, ready, _ = standby
    start = {"incarnation": 0, "node_index": 0, "resume_step": 0}
    with pytest.raises(ValueError, match="not the run's secret"):
        send_order(ready, "a-guess", "node-0", start, 60)
    with pytest.raises(ValueError, match="this is the standby of node-0"):
        send_order(ready, SECRET, "node-1", start, 60)
    assert not run.node_pid_file(0, 0).exists()


def test_a_started_launcher_runs_warm_ranks_until_a_stop_ends_them(standby):
    run, ready, reports = standby
    answer = send_order(ready, SECRET, "node-0", {"incarnation": 0, "node_index": 0, "resume_step": 0}, 60)
    assert answer == {"started": True} and run.node_pid_file(0, 0).exists()
    report = wait_until(lambda: read_json(reports / "0.json"), "rank 0 to report")
    assert report["torch"], "the rank was not forked from the warm standby"
    # A repeated order (a retried launch) finds the launcher running and starts nothing more.
    assert send_order(ready, SECRET, "node-0", {"incarnation": 0, "node_index": 0, "resume_step": 0}, 60) == {
        "started": True
    }
    answer = send_order(ready, SECRET, "node-0", {"stop": 0}, 60)
    assert answer["alive"] == [] and len(answer["stopped"]) == 1
    assert not _alive(report["pid"]), "the rank outlived the stop's answer"
    assert read_json(run.launcher_exit_file(0, 0))["code"] == -9
    assert read_exit(run, 0, 0) is None  # killed with its launcher: no record of its own


def test_a_launcher_that_ends_is_recorded_by_its_standby(standby, tmp_path):
    run, ready, reports = standby
    spec = run.spec_file.read_text().replace('"forever"', '"once"')
    run.spec_file.write_text(spec)
    assert send_order(ready, SECRET, "node-0", {"incarnation": 0, "node_index": 0, "resume_step": 0}, 60)["started"]
    ended = wait_until(lambda: read_json(run.launcher_exit_file(0, 0)), "the standby to record the launcher's end")
    assert ended["code"] == 0
    assert read_exit(run, 0, 0).code == 0
