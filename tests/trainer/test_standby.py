"""Warm standbys on the local backend: ranks forked from a warm interpreter, with the environment,
argv and exit status a cold start would give them, and killed with their node."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.infra.standbys import kill_standbys
from lazarus.schema import Assignment, parse_spec
from lazarus.schema.contract import read_exit
from lazarus.schema.files import lock_is_held, read_json
from lazarus.trainer.agent.standby import warm_entry
from tests.support.waiting import wait_until

# A rank that reports what it found and exits with a code of its choosing: it imports nothing,
# so `torch` in sys.modules shows that the standby's imports came with the fork.
REPORTER = """
import json, os, sys
rank = int(os.environ["RANK"])
with open(os.path.join(os.environ["REPORT_DIR"], f"{rank}.json"), "w") as out:
    json.dump({"argv": sys.argv, "path0": sys.path[0], "torch": "torch" in sys.modules, "pid": os.getpid(),
               "ppid": os.getppid(), "world": os.environ["WORLD_SIZE"], "name": __name__, "cwd": os.getcwd()}, out)
sys.exit(int(sys.argv[1]) + rank)
"""


def start(cluster: LocalCluster, tmp_path: Path, warm: bool = True, as_module: bool = False) -> Path:
    script = tmp_path / "project" / "reporter.py"
    script.parent.mkdir()
    script.write_text(REPORTER)
    reports = tmp_path / "reports"
    reports.mkdir()
    env = {"REPORT_DIR": str(reports)}
    command = ["python", str(script), "10"]
    if as_module:  # `python -m reporter` with the project on PYTHONPATH, as local_paths makes it
        command, env["PYTHONPATH"] = ["python", "-m", "reporter", "10"], str(script.parent)
    spec = parse_spec(
        {
            "name": "r",
            "cluster": {"active_nodes": 2, "spare_nodes": 1, "warm_standby": warm},
            "layout": {"dp": 2},
            "trainer": {"command": command, "env": env},
        }
    )
    cluster.create("r1", spec)
    cluster.commit_assignment(
        "r1", Assignment(incarnation=0, nodes=["node-0", "node-1"], layout=spec.layout, master_port=29999)
    )
    cluster.start_ranks("r1", 0, resume_step=0)
    return reports


def test_warm_entry_runs_python_modules_and_scripts_in_place():
    assert warm_entry(["python", "-m", "lazarus.trainer", "--x"]) == (
        "module",
        "lazarus.trainer",
        ["lazarus.trainer", "--x"],
    )
    assert warm_entry(["python", "train.py", "a"]) == ("path", "train.py", ["train.py", "a"])
    assert warm_entry([sys.executable, "train.py"]) == ("path", "train.py", ["train.py"])
    assert warm_entry(["python", "-c", "pass"]) is None  # exec'd: a flag we do not interpret
    assert warm_entry(["./train.sh"]) is None


def both_exits(run) -> list:
    """Wait until ranks 0 and 1 of incarnation 0 have exit records; returns them."""
    return wait_until(lambda: all(ended := [read_exit(run, 0, r) for r in (0, 1)]) and ended, "both ranks to exit")


def test_a_warm_rank_gets_a_cold_ranks_environment_and_exit_status(cluster, tmp_path):
    reports = start(cluster, tmp_path)
    run = cluster.run_dir("r1")
    exits = both_exits(run)
    assert [e.code for e in exits] == [10, 11]  # sys.exit(code) of each rank, recorded by its launcher
    for rank in (0, 1):
        report = json.loads((reports / f"{rank}.json").read_text())
        assert report["argv"] == [str(tmp_path / "project" / "reporter.py"), "10"]
        assert report["path0"] == str(tmp_path / "project")  # as `python script.py` sets it
        assert report["name"] == "__main__" and report["world"] == "2"
        assert report["cwd"] == str(run.work_dir)  # the run's own folder, not the worker's
        assert report["torch"] is True  # imported by the standby before the order came
        launcher = read_json(run.node_pid_file(0, rank))
        standby = read_json(run.standby(f"node-{rank}") / "pid")
        assert report["ppid"] == launcher["pid"] and launcher["pgid"] == launcher["pid"] != standby["pgid"]
    # The spare has its standby too, before anything asked for it.
    wait_until(lambda: lock_is_held(run.standby("node-2") / "lock"), "the spare's standby")


def test_a_cold_start_gives_the_same_result(cluster, tmp_path):
    reports = start(cluster, tmp_path, warm=False)
    run = cluster.run_dir("r1")
    exits = both_exits(run)
    assert [e.code for e in exits] == [10, 11]
    report = json.loads((reports / "0.json").read_text())
    assert report["torch"] is False and report["cwd"] == str(run.work_dir)
    assert not run.standby("node-0").exists()


@pytest.mark.parametrize("warm", [True, False])
def test_a_module_on_the_ranks_pythonpath_runs_warm_or_cold(cluster, tmp_path, warm):
    """The standby started before the rank's PYTHONPATH was known: a forked rank must find its module too."""
    reports = start(cluster, tmp_path, warm=warm, as_module=True)
    run = cluster.run_dir("r1")
    assert [e.code for e in both_exits(run)] == [10, 11]
    report = json.loads((reports / "1.json").read_text())
    assert report["argv"][1:] == ["10"] and report["name"] == "__main__" and report["torch"] is warm
    assert report["cwd"] == str(run.work_dir)


def test_kill_node_kills_its_standby_and_a_late_order_starts_nothing(cluster, tmp_path):
    start(cluster, tmp_path)
    run = cluster.run_dir("r1")
    wait_until(lambda: all(run.exit_file(0, r).exists() for r in (0, 1)), "both ranks to exit")
    spare = wait_until(
        lambda: (run.standby("node-2") / "ready").exists() and read_json(run.standby("node-2") / "pid"),
        "the spare's standby",
    )
    cluster.kill_node("r1", "node-0")
    assert not lock_is_held(run.standby("node-0") / "lock")
    assert lock_is_held(run.standby("node-2") / "lock") and read_json(run.standby("node-2") / "pid") == spare
    # An order for an incarnation the backend has ended (say, sent by a worker that crashed
    # right after) must not start ranks.
    cluster.stop_incarnation("r1", 0)
    with open(run.standby("node-1") / "orders", "w") as orders:
        orders.write(json.dumps({"incarnation": 0, "node_index": 1, "resume_step": 0}) + "\n")
    log = run.incarnation(0) / "nodes" / "1.log"
    wait_until(lambda: log.exists() and "not starting it" in log.read_text(), "the launcher to refuse the order")
    wait_until(lambda: not lock_is_held(run.node_lock_file(0, 1)), "the refusing launcher to exit")
    assert cluster.live_pids("r1") == [] and not any(r.alive for r in cluster.observe("r1", 0).ranks)


def session_of(pid: int) -> int:
    """The session id of a live process (field 6 of /proc/PID/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[3])


def test_standbys_started_together_share_one_import_and_die_alone(cluster, tmp_path):
    """The nodes' standbys are forks of one interpreter that imported torch once; each is the
    leader of its own session, so killing one node's leaves the others warm."""
    start(cluster, tmp_path)
    run = cluster.run_dir("r1")
    nodes = ["node-0", "node-1", "node-2"]
    wait_until(lambda: all((run.standby(n) / "ready").exists() for n in nodes), "every standby to be warm")
    records = {n: read_json(run.standby(n) / "pid") for n in nodes}
    pids = {record["pid"] for record in records.values()}
    assert len(pids) == 3 and all(
        record["pgid"] == record["pid"] == session_of(record["pid"]) for record in records.values()
    )
    imports = {json.loads((run.standby(n) / "ready").read_text())["import_seconds"] for n in nodes}
    assert len(imports) == 1  # one warm-up, shared
    cluster.kill_node("r1", "node-1")
    assert not lock_is_held(run.standby("node-1") / "lock")  # released only when its holder is gone
    assert all(lock_is_held(run.standby(n) / "lock") for n in ("node-0", "node-2"))
    assert {n: read_json(run.standby(n) / "pid") for n in ("node-0", "node-2")} == {
        n: records[n] for n in ("node-0", "node-2")
    }


def test_a_standby_killed_while_its_interpreter_imports_is_gone(cluster, tmp_path):
    """Killed while its interpreter imports (the interpreter is the node's recorded standby):
    nothing is left holding the node, and it never gets warm."""
    start(cluster, tmp_path)
    run = cluster.run_dir("r1")
    home = run.standby("node-2")
    wait_until(lambda: (home / "ready").exists(), "the spare's standby to be warm")
    kill_standbys(run, ["node-2"])
    (home / "ready").unlink()
    cluster.ensure_standbys("r1")  # a new interpreter for node-2 alone
    assert lock_is_held(home / "lock") and not (home / "ready").exists()
    cluster.kill_node("r1", "node-2")
    assert not lock_is_held(home / "lock") and not (home / "ready").exists()
