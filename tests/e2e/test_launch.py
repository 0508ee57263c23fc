"""`lazarus launch`: torchrun's command line, first word changed. A run completes and recovers from
a killed node, a failing script's exit status and log come back, and a user's mistake is one line."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.infra.backends.slurm.cluster import SlurmCluster
from tests.support.runs import REPO
from tests.support.waiting import wait_until
from tests.support.workers import lazarus_env

SCRIPT = REPO / "examples" / "torchrun_snapshot.py"
STEPS_SCRIPT = REPO / "tests" / "user_script" / "inplace_checkpoints.py"
LAUNCH = [sys.executable, "-m", "lazarus.cli", "launch"]
NOWHERE = "127.0.0.1:9"  # no Temporal server: a mistake must be refused before one is needed

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

NO_SLURMCTLD = (
    "ClusterName=nowhere\nSlurmctldHost=localhost\nSlurmctldPort=9\nMessageTimeout=1\n"
    "NodeName=node-0\nPartitionName=p Nodes=node-0\n"
)
"""A slurm.conf whose controller does not answer (nothing listens on port 9)."""


@pytest.fixture
def launched(tmp_path):
    """Start `lazarus launch ARGS` in tmp_path, its stdout and stderr in files; killed at the end if it still runs."""
    started = []

    def start(args: list[str], env: dict) -> tuple[subprocess.Popen, object, object]:
        out, err = tmp_path / "launch.out", tmp_path / "launch.err"
        with open(out, "wb") as stdout, open(err, "wb") as stderr:
            process = subprocess.Popen(LAUNCH + args, env=env, cwd=tmp_path, stdout=stdout, stderr=stderr)
        started.append(process)
        return process, out, err

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)


def test_launch_completes_a_run_and_recovers_a_killed_node(dev_env, home, launched, tmp_path):
    run_id = f"launch-{uuid.uuid4().hex[:6]}"
    env = lazarus_env(dev_env, home, f"launch-{uuid.uuid4().hex[:6]}")
    args = ["--nnodes", "4", "--nproc-per-node", "1", "--spares", "1", "--rdzv-backend", "c10d", "--rdzv-id", run_id]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.txt").write_text("a\nb\nc\n")
    script = [str(SCRIPT), "--epochs", "30", "--save-every", "5", "--train-file", "data/train.txt"]
    process, out, err = launched([*args, *script], env)
    wait_until(lambda: "epoch 12 loss" in out.read_text(), "epoch 12 on rank 0's output", timeout=120)
    killed = LocalCluster(home).kill_node(run_id, "node-2")
    assert killed
    assert process.wait(timeout=180) == 0, err.read_text()

    shown, said = out.read_text(), err.read_text()
    assert said.startswith("lazarus: ignoring --rdzv-backend (Lazarus assigns the ranks and runs the rendezvous")
    first = said.splitlines()[1:4]
    nodes = f"run {run_id}: 4 node(s) x 1 rank(s) + 1 hot spare(s); it never shrinks: without a spare it waits for one"
    assert first[0] == f"lazarus: {nodes}"
    assert first[1] == f"lazarus: working directory: {tmp_path}"
    assert first[2].startswith("lazarus: web UI: http://") and first[2].endswith(f"/workflows/{run_id}")
    assert "incident 1: node_down on node-2" in said
    assert "incident 1: recovered (replaced node-2 by spare node-4" in said
    assert f"run {run_id} COMPLETED" in said and "Traceback" not in said
    # Rank 0's output as the script printed it, across both incarnations: from scratch, then from its snapshot.
    assert shown.startswith("[rank 0] No snapshot at snapshot.pt: training from scratch")
    assert "[rank 0] Resuming training from snapshot at epoch" in shown
    assert shown.count("epoch 30 loss") == 1
    # The ranks ran where launch was typed, as torchrun's do, before the fault and after it: they read
    # the relative data/train.txt there, and the script's relative snapshot.pt is there.
    assert shown.count("[rank 0] read 3 lines of data/train.txt") == 2
    assert (tmp_path / "snapshot.pt").is_file()


def test_a_script_that_fails_on_every_rank_gives_its_exit_status_and_log(dev_env, home, launched, tmp_path):
    script = tmp_path / "bad_config.py"
    script.write_text("import os, sys\nprint(f\"rank {os.environ['RANK']}: no dataset at /data/x\")\nsys.exit(3)\n")
    env = lazarus_env(dev_env, home, f"launch-{uuid.uuid4().hex[:6]}")
    process, out, err = launched(["--nnodes", "2", str(script), "--lr", "3e-4"], env)
    assert process.wait(timeout=120) == 3
    said = err.read_text()
    # A first failure restarts in place (it may be transient); the same failure again is the crash loop.
    assert "incident 1: rank_error" in said and "the script reports no steps" in said
    assert "FAILED: crash loop: the same failure again after a restart in place (incident 1)" in said
    assert "exited with code 3" in said
    # The first rank to fail is blamed, and its log's tail shown.
    assert re.search(r"last lines of rank (\d)'s log \(node-\1\):\nrank \1: no dataset at /data/x\n$", said), said
    # Rank 0's output is launch's, from each start it printed in: the first start and the restart,
    # unless the other rank failed first and ended a start before rank 0 had printed.
    [run] = (home / "runs").iterdir()
    printed = [log for log in sorted(run.glob("incarnations/*/logs/0.log")) if log.read_text()]
    assert printed and out.read_text() == "rank 0: no dataset at /data/x\n" * len(printed)
    assert "Traceback" not in said


# The mark appears whole (a rename): a test that sees the file reads the pid.
RUNS_UNTIL_STOPPED = """import os, time
os.makedirs("out", exist_ok=True)
mark = f"out/rank{os.environ['RANK']}.txt"
with open(mark + ".tmp", "w") as partial:
    partial.write(str(os.getpid()))
os.replace(mark + ".tmp", mark)
print("up", flush=True)
while True:
    time.sleep(0.1)
"""


def recorded_processes(run) -> list[dict]:
    """The pid records of every launcher, rank and standby of the run (each with pid, and pgid or start time)."""
    files = [*run.root.glob("incarnations/*/ranks/*.pid"), *run.root.glob("incarnations/*/nodes/*.pid")]
    files += run.root.glob("standby/*/pid")
    return [json.loads(path.read_text()) for path in files]


def alive(pid: int, start_time: int | None = None) -> bool:
    """Whether `pid` is a live process (not a zombie), and the same one when its start time is known."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat[0] != "Z" and (start_time is None or int(stat[19]) == start_time)


def left_of(records: list[dict]) -> list[int]:
    """Live processes of the recorded ones, and any live member of their process groups."""
    groups = {record["pgid"] for record in records if record.get("pgid")}
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2]) in groups and alive(int(entry.name)):
                    members.append(int(entry.name))
    return sorted({r["pid"] for r in records if alive(r["pid"], r.get("start_time"))} | set(members))


def test_sigterm_ends_the_run_and_every_process_it_started(dev_env, home, launched, tmp_path):
    """SIGINT and SIGHUP take the same path (tests/unit/test_launch.py sends each to the handler)."""
    (tmp_path / "forever.py").write_text(RUNS_UNTIL_STOPPED)
    run_id = f"signal-{uuid.uuid4().hex[:6]}"
    run = LocalCluster(home).run_dir(run_id)
    env = lazarus_env(dev_env, home, f"launch-{uuid.uuid4().hex[:6]}")
    try:
        process, _, err = launched(["--nnodes", "2", "--spares", "1", "--rdzv-id", run_id, "forever.py"], env)
        # Both ranks run (in the folder launch was typed in) and every node, the spare too, has its standby.
        marks = [tmp_path / "out" / f"rank{rank}.txt" for rank in (0, 1)]
        wait_until(lambda: all(m.is_file() for m in marks), "both ranks to start", timeout=120)
        wait_until(lambda: len(list(run.root.glob("standby/*/pid"))) == 3, "a standby on each of 3 nodes", timeout=60)
        records = recorded_processes(run)
        assert {int(m.read_text()) for m in marks} <= {r["pid"] for r in records}
        assert left_of(records), "nothing of the run runs before the signal"

        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 128 + signal.SIGTERM.value, err.read_text()
        assert left_of(recorded_processes(run)) == []
        said = err.read_text()
        assert f"interrupted: terminating run {run_id} and stopping its processes" in said
        assert said.endswith("lazarus: ended by SIGTERM (exit status 143)\n"), said
        assert "Traceback" not in said, said
        # The run's history stops where it stood (TRAINING, or LAUNCHING where the signal came before the
        # launch stage's end was recorded): it reads as it ended, with that state, never as live.
        wide = {**env, "COLUMNS": "300"}  # the status table wraps its cells at the terminal's width
        for command in ("status", "report"):
            shown = subprocess.run(
                [*LAUNCH[:-1], "run", command, run_id], env=wide, capture_output=True, text=True, timeout=60
            )
            assert shown.returncode == 0, shown.stderr
            assert "ABORTED" in shown.stdout and "the workflow was terminated" in shown.stdout, shown.stdout
            assert re.search(r"while the run was (TRAINING|LAUNCHING)", shown.stdout), shown.stdout
            assert not re.search(r"^state +(TRAINING|LAUNCHING)", shown.stdout, re.MULTILINE), shown.stdout
    finally:
        LocalCluster(home).stop_run(run_id)


def test_a_fixed_nnodes_waits_for_its_node_says_so_and_recovers_on_it(dev_env, home, launched, tmp_path):
    """--nnodes 2 with no spare: losing a node never reshards to one; the run waits, says how to move
    it on, and recovers once `lazarus pool return` gives the node back."""
    (tmp_path / "forever.py").write_text(RUNS_UNTIL_STOPPED)
    run_id = f"wait-{uuid.uuid4().hex[:6]}"
    env = lazarus_env(dev_env, home, f"launch-{uuid.uuid4().hex[:6]}")
    try:
        process, _, err = launched(["--nnodes", "2", "--spares", "0", "--rdzv-id", run_id, "forever.py"], env)
        marks = [tmp_path / "out" / f"rank{rank}.txt" for rank in (0, 1)]
        wait_until(lambda: all(m.is_file() for m in marks), "both ranks to start", timeout=120)
        LocalCluster(home).kill_node(run_id, "node-1")
        waiting = f"lazarus: run {run_id} is waiting for capacity ("
        line = wait_until(
            lambda: next((x for x in err.read_text().splitlines() if x.startswith(waiting)), None),
            "the wait to be said",
            timeout=60,
        )
        # It holds the two nodes its spec allows (cluster.active_nodes + spare_nodes): only node-1 can help.
        assert "`lazarus pool return NODE` once a node it quarantined (node-1) is repaired (it holds the 2" in line
        assert f"`lazarus run abort {run_id}` ends it" in line and "pool add" not in line

        back = subprocess.run(
            [*LAUNCH[:-1], "pool", "return", "node-1"], env=env, capture_output=True, text=True, timeout=60
        )
        assert back.returncode == 0, back.stderr
        wait_until(lambda: "incident 1: recovered" in err.read_text(), "the recovery on node-1", timeout=60)
        assert "resharded" not in err.read_text()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 128 + signal.SIGTERM.value, err.read_text()
        # The activities the termination cancelled are not the user's warnings.
        assert "WARNING" not in err.read_text() and "Traceback" not in err.read_text()
    finally:
        LocalCluster(home).stop_run(run_id)


def queued_jobs(slurm_env: dict) -> list[str]:
    """The ids of the jobs squeue shows (pending, running or completing)."""
    shown = subprocess.run(
        ["squeue", "-h", "-o", "%i"], env=slurm_env, capture_output=True, text=True, timeout=30, check=True
    )
    return shown.stdout.split()


def on_slurm(folder: Path, warm: bool) -> list[str]:
    """launch's flags for the Slurm backend, with warm standbys or without (a spec in `folder` says which)."""
    (folder / "standbys.yaml").write_text(f"name: s\ncluster: {{warm_standby: {str(warm).lower()}}}\n")
    return ["--spec", "standbys.yaml", "--backend", "slurm"]


STANDBYS = pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm-standbys"])


@STANDBYS
def test_launch_on_slurm_runs_the_launchers_as_job_steps_and_gives_the_allocation_back(
    dev_env, slurm_daemons, home, launched, tmp_path, warm
):
    run_id = f"slurm-launch-{uuid.uuid4().hex[:6]}"
    env = {**lazarus_env(dev_env, home, f"launch-{uuid.uuid4().hex[:6]}"), "SLURM_CONF": str(slurm_daemons.conf)}
    cluster = SlurmCluster(home, environ=slurm_daemons.env)
    args = [*on_slurm(tmp_path, warm), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-id", run_id]
    args += ["--progress-pattern", r"^step (?P<step>\d+) loss"]
    script = [str(STEPS_SCRIPT), "--steps", "10", "--save-every", "5", "--step-seconds", "0.01"]
    try:
        process, out, err = launched([*args, *script], env)
        assert process.wait(timeout=180) == 0, err.read_text()
        queued = queued_jobs(slurm_daemons.env)  # at once: the run gave its nodes back before launch returned
        said = err.read_text()
        assert said.splitlines()[0] == (
            f"lazarus: run {run_id}: 2 node(s) x 1 rank(s) + 1 hot spare(s) on the Slurm cluster SLURM_CONF names; "
            "it never shrinks: without a spare it waits for one"
        )
        assert f"run {run_id} COMPLETED at step 10" in said and "Traceback" not in said, said
        assert out.read_text().count("step 10 loss") == 1
        # Each node's launcher ran as a step of the run's one allocation, on its node.
        job = cluster.job_id(run_id)
        assert job is not None
        run = cluster.run_dir(run_id)
        for index, node in enumerate(["node-0", "node-1"]):
            record = json.loads(run.node_pid_file(0, index).read_text())
            assert record["slurm_step"].startswith(f"{job}.") and record["node"] == node, record
        assert job not in queued, f"job {job} is still in squeue after launch returned"
    finally:
        cluster.stop_run(run_id)
        slurm_daemons.reset()


@STANDBYS
def test_a_signal_ends_a_launch_on_slurm_and_its_allocation(dev_env, slurm_daemons, home, launched, tmp_path, warm):
    (tmp_path / "forever.py").write_text(RUNS_UNTIL_STOPPED)
    run_id = f"slurm-signal-{uuid.uuid4().hex[:6]}"
    env = {**lazarus_env(dev_env, home, f"launch-{uuid.uuid4().hex[:6]}"), "SLURM_CONF": str(slurm_daemons.conf)}
    cluster = SlurmCluster(home, environ=slurm_daemons.env)
    run = cluster.run_dir(run_id)
    try:
        args = [*on_slurm(tmp_path, warm), "--nnodes", "2", "--spares", "0", "--rdzv-id", run_id, "forever.py"]
        process, _, err = launched(args, env)
        marks = [tmp_path / "out" / f"rank{rank}.txt" for rank in (0, 1)]
        wait_until(lambda: all(m.is_file() for m in marks), "both ranks to start", timeout=120)
        job = cluster.job_id(run_id)
        assert job in queued_jobs(slurm_daemons.env)

        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 128 + signal.SIGINT.value, err.read_text()
        # The workflow, terminated, gives nothing back: launch itself cancelled the allocation. A job
        # cancelled while its steps still run stays in squeue as COMPLETING until they end; uncancelled,
        # it would stay RUNNING for its whole time limit.
        wait_until(
            lambda: job not in queued_jobs(slurm_daemons.env), f"job {job} to leave squeue after launch", timeout=30
        )
        assert left_of(recorded_processes(run)) == []
        said = err.read_text()
        assert said.endswith("lazarus: ended by SIGINT (exit status 130)\n") and "Traceback" not in said, said
    finally:
        cluster.stop_run(run_id)
        slurm_daemons.reset()


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--nnodes", "2", "missing.py"], "no such script: missing.py"),
        (["--nnodes", "2", "--frobnicate", "3", "train.py"], "unrecognized arguments: --frobnicate"),
        (["--nnodes", "two", "train.py"], "--nnodes: 'two' is not a number of nodes"),
        (["--nnodes", "4:2", "train.py"], "--nnodes: '4:2': MIN is more than MAX"),
        (["--nproc-per-node", "auto", "train.py"], "--nproc-per-node: 'auto' is not a number of ranks per node"),
        (["--spares", "-1", "train.py"], "cluster.spare_nodes: must be greater than or equal to 0"),
        (["--progress-pattern", "step \\d+", "train.py"], "trainer.progress_pattern: 'step \\\\d+' has no group"),
        (["--rdzv-id", "a/b", "train.py"], "--rdzv-id: 'a/b' is not a run id"),
        ([], "no SCRIPT given"),
        (
            ["--backend", "kubernetes", "train.py"],
            "on kubernetes start a worker (`lazarus worker --backend kubernetes`)",
        ),
        (
            ["--backend", "pbs", "train.py"],
            "--backend: 'pbs' is not a backend; the backends are local, kubernetes, slurm",
        ),
    ],
)
def test_a_mistake_is_one_line_naming_it(tmp_path, args, said):
    launch_refused(tmp_path, args, said)


@pytest.mark.parametrize(
    ("conf", "said"),
    [
        (NO_SLURMCTLD, "--backend slurm: cannot reach a Slurm controller ("),
        (None, "--backend slurm: SLURM_CONF names "),
    ],
)
def test_slurm_without_a_controller_is_one_line(tmp_path, conf, said):
    """No slurmctld answers (SLURM_CONF names a controller nothing listens for, or no file): one line,
    before anything starts."""
    if conf is not None:
        (tmp_path / "slurm.conf").write_text(conf)
    launch_refused(tmp_path, ["--backend", "slurm", "--nnodes", "2", "train.py"], said, tmp_path / "slurm.conf")


def launch_refused(tmp_path, args: list[str], said: str, slurm_conf: Path | None = None) -> None:
    """`lazarus launch ARGS` (no Temporal server anywhere) ends with exit status 2 and one line containing `said`."""
    (tmp_path / "train.py").write_text("print('never run')\n")
    env = {"PATH": "/usr/bin:/bin", "LAZARUS_HOME": str(tmp_path / "home"), "LAZARUS_TEMPORAL_ADDRESS": NOWHERE}
    if slurm_conf is not None:
        env["SLURM_CONF"] = str(slurm_conf)
    done = subprocess.run(LAUNCH + args, cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2
    [line] = done.stderr.splitlines()
    assert line.startswith("lazarus launch: error: ") and said in line, line
    assert done.stdout == ""
    assert not (tmp_path / "home").exists()  # refused before anything started
