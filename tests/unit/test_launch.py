"""`lazarus launch` without a server: the spec its flags build (where the ranks run, whether the run
may shrink), and the words it says while the run waits, repeated every minute of an injected clock."""

from __future__ import annotations

import asyncio
import os
import signal
from datetime import UTC, datetime

import pytest

from lazarus.commands.common import UserError
from lazarus.commands.launch import _say_start, build_parser, build_spec
from lazarus.commands.launch_follow import Interruption, WaitingNotice, stop_processes, waiting_words
from lazarus.infra.backend import ClusterError
from lazarus.infra.backends.slurm.cluster import SlurmCluster
from lazarus.schema import RecoveryPolicy, RunState
from lazarus.schema.records import Decision, FaultReport, Incident, RunStatus

LAYOUT = {"dp": 2, "ranks_per_node": 1}


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A user's folder with a script, the current directory while the test runs."""
    (tmp_path / "train.py").write_text("print('never run')\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def spec_of(*argv: str, folder):
    return build_spec(build_parser().parse_args(list(argv)), folder)


def test_the_ranks_run_in_the_folder_launch_was_typed_in(project):
    spec = spec_of("--nnodes", "2", "train.py", "--train_file", "data/train.txt", folder=project)
    assert spec.trainer.workdir == str(project)
    assert spec.trainer.command == ["python", str(project / "train.py"), "--train_file", "data/train.txt"]


def test_workdir_flag_and_a_specs_workdir_are_kept(project):
    assert spec_of("--workdir", "elsewhere", "train.py", folder=project).trainer.workdir == str(project / "elsewhere")
    (project / "run.yaml").write_text(
        "name: s\ntrainer:\n  workdir: /srv/jobs/s\nlayout: {dp: 2, ranks_per_node: 1}\ncluster: {active_nodes: 2}\n"
    )
    assert spec_of("--spec", "run.yaml", "train.py", folder=project).trainer.workdir == "/srv/jobs/s"
    assert spec_of("--spec", "run.yaml", "--workdir", "/tmp/w", "train.py", folder=project).trainer.workdir == "/tmp/w"


@pytest.mark.parametrize(
    ("nnodes", "per_node", "dp", "min_dp"),
    [("4", "1", 4, 4), ("4", "2", 8, 8), ("2:4", "1", 4, 2), ("2:4", "2", 8, 4), (None, "3", 3, 3)],
)
def test_a_fixed_nnodes_never_shrinks_and_min_max_may(project, nnodes, per_node, dp, min_dp):
    flags = ["--nnodes", nnodes] if nnodes else []
    spec = spec_of(*flags, "--nproc-per-node", per_node, "train.py", folder=project)
    assert (spec.layout.dp, spec.recovery.min_dp) == (dp, min_dp)


SLURM_SPEC = (
    "name: s\nlayout: {dp: 2, ranks_per_node: 1}\ncluster: {backend: slurm, active_nodes: 2, slurm: {partition: gpu}}\n"
)


def test_the_backend_is_the_flags_else_the_specs_else_local(project):
    assert spec_of("train.py", folder=project).cluster.backend == "local"
    on_slurm = spec_of("--backend", "slurm", "--nnodes", "2", "train.py", folder=project)
    assert on_slurm.cluster.backend == "slurm"
    # Slurm's nodes share the paths: the script is named as launch found it, as on the local backend.
    assert on_slurm.trainer.command == ["python", str(project / "train.py")]
    (project / "run.yaml").write_text(SLURM_SPEC)
    from_spec = spec_of("--spec", "run.yaml", "train.py", folder=project)
    assert (from_spec.cluster.backend, from_spec.cluster.slurm.partition) == ("slurm", "gpu")
    assert spec_of("--spec", "run.yaml", "--backend", "local", "train.py", folder=project).cluster.backend == "local"


def test_kubernetes_is_refused_with_what_to_do_instead(project):
    (project / "k8s.yaml").write_text("name: k\ncluster: {backend: kubernetes}\n")
    for flags in (["--backend", "kubernetes"], ["--spec", "k8s.yaml"]):
        with pytest.raises(UserError) as refused:
            spec_of(*flags, "train.py", folder=project)
        said = str(refused.value)
        assert (
            "lazarus launch drives the backends whose nodes share this folder's paths (--backend local|slurm)" in said
        )
        assert "`lazarus worker --backend kubernetes`" in said and "`lazarus run start`" in said


def test_help_explains_the_backend_flag():
    shown = " ".join(build_parser().format_help().split())
    assert "--backend NAME where the nodes are, a backend whose nodes share this folder's paths" in shown
    assert "one allocation of the Slurm cluster SLURM_CONF names" in shown
    assert "Ctrl-C or the run's end gives the allocation back" in shown
    assert "(default: a --spec's cluster.backend, else local)" in shown


def test_the_first_line_names_the_slurm_cluster_and_its_partition(project):
    from lazarus.infra.registry import backend_class

    class Settings:
        def workflow_url(self, run_id):
            return f"http://ui/{run_id}"

    (project / "run.yaml").write_text(SLURM_SPEC)
    said: list[str] = []
    on_slurm = spec_of("--spec", "run.yaml", "train.py", folder=project)
    _say_start(on_slurm, "r1", Settings(), backend_class("slurm"), said.append)
    assert said[0] == (
        "run r1: 2 node(s) x 1 rank(s) + 1 hot spare(s) on the Slurm cluster SLURM_CONF names (partition gpu); "
        "it may shrink to dp=1"
    )
    said.clear()
    _say_start(
        spec_of("--nnodes", "2", "train.py", folder=project), "r1", Settings(), backend_class("local"), said.append
    )
    assert (
        said[0] == "run r1: 2 node(s) x 1 rank(s) + 1 hot spare(s); it never shrinks: without a spare it waits for one"
    )


class RecordedSlurm(SlurmCluster):
    """The Slurm backend with Slurm's commands recorded and answered here: five idle nodes, job 42."""

    def __init__(self, home):
        super().__init__(home, environ={})
        self.commands: list[tuple[str, ...]] = []

    def _slurm(self, *command: str) -> str:
        self.commands.append(command)
        if command[0] == "sinfo":
            return "".join(f"node-{i} idle\n" for i in range(5))
        return "salloc: Granted job allocation 42\n" if command[0] == "salloc" else ""


def test_a_signal_on_slurm_gives_the_allocation_back(project):
    cluster = RecordedSlurm(project / "home")
    (project / "run.yaml").write_text(SLURM_SPEC)
    cluster.create("r1", spec_of("--spec", "run.yaml", "train.py", folder=project))
    assert cluster.job_id("r1") == "42"
    stop_processes(cluster, "r1")
    assert ("scancel", "42") in cluster.commands
    assert [n.name for n in cluster.pool.read().nodes if n.owner == "r1"] == []  # the active nodes are free again


def test_the_nodes_go_back_even_when_a_process_outlives_the_stop(project):
    cluster = RecordedSlurm(project / "home")
    (project / "run.yaml").write_text(SLURM_SPEC)
    cluster.create("r1", spec_of("--spec", "run.yaml", "train.py", folder=project))

    def stuck(run_id):
        raise ClusterError("the launcher of node-0 (incarnation 0) is still alive 10 s after SIGKILL")

    cluster.stop_run = stuck
    with pytest.raises(ClusterError):
        stop_processes(cluster, "r1")
    assert ("scancel", "42") in cluster.commands


def status(state: RunState, **more) -> RunStatus:
    return RunStatus(run_id="r1", state=state, total_steps=10, layout=LAYOUT, **more)


def waiting_for_capacity() -> RunStatus:
    now = datetime.now(UTC)
    fault = FaultReport(kind="node_down", nodes=["node-1"], incarnation=0, occurred_at=now, detected_at=now, step=3)
    old = {"incarnation": 0, "nodes": ["node-0", "node-1"], "layout": LAYOUT, "master_port": 1234}
    decision = Decision(action="wait", layout=LAYOUT, reason="no free healthy spare; dp=1 is below recovery.min_dp=2")
    incident = Incident(number=1, fault=fault, old_assignment=old, decision=decision)
    return status(
        RunState.WAITING_FOR_CAPACITY,
        assignment=old,
        incidents=[incident],
        quarantined_nodes=["node-1"],
        policy=RecoveryPolicy(min_dp=2),
    )


def test_each_wait_names_the_commands_that_move_it_on():
    capacity = waiting_words(waiting_for_capacity())
    assert capacity.startswith(
        "run r1 is waiting for capacity (no free healthy spare; dp=1 is below recovery.min_dp=2)"
    )
    assert "`lazarus pool return NODE` once a node it quarantined (node-1) is repaired, or " in capacity
    assert "`lazarus pool add 1` gives it a node" in capacity and "`lazarus run abort r1` ends it" in capacity
    assert "fails by itself after 300 s (recovery.capacity_wait_seconds)" in capacity
    # A run that holds all the nodes its spec allows (active and quarantined) can take no new one.
    full = waiting_words(waiting_for_capacity(), node_limit=2)
    assert (
        ": `lazarus pool return NODE` once a node it quarantined (node-1) is repaired (it holds the 2 node(s)" in full
    )
    assert "pool add" not in full
    assert "pool add 1" in waiting_words(waiting_for_capacity(), node_limit=3)

    decision = Decision(action="wait", layout=LAYOUT, reason="dp=1 is below recovery.min_dp=2")
    approval = waiting_words(status(RunState.WAITING_FOR_APPROVAL, awaiting_approval=decision))
    assert approval.startswith("run r1 is waiting for an operator's approval (dp=1 is below recovery.min_dp=2)")
    assert "`lazarus run approve r1 reshard-below-minimum`" in approval
    assert "`lazarus run approve r1 wait-longer`" in approval and "`lazarus run abort r1`" in approval

    paused = waiting_words(status(RunState.PAUSED), waited_seconds=180)
    assert (
        paused == "run r1 is paused, 3 min so far: `lazarus run resume r1` continues it; `lazarus run abort r1` ends it"
    )

    for state in (RunState.TRAINING, RunState.RESCHEDULING, RunState.COMPLETED):
        assert waiting_words(status(state)) is None


def test_a_wait_is_said_at_once_and_every_minute_while_it_lasts():
    notice = WaitingNotice()
    said = {}
    states = {0: RunState.TRAINING, 10: RunState.WAITING_FOR_CAPACITY, 200: RunState.WAITING_FOR_APPROVAL}
    states |= {250: RunState.TRAINING, 260: RunState.PAUSED, 300: RunState.TRAINING}
    state = RunState.TRAINING
    for now in range(0, 330, 1):  # a look every second of a clock the test drives
        state = states.get(now, state)
        run = waiting_for_capacity() if state == RunState.WAITING_FOR_CAPACITY else status(state)
        line = notice.line(run, float(now))
        if line:
            said[now] = line
    assert sorted(said) == [10, 70, 130, 190, 200, 260]
    assert said[10].startswith("run r1 is waiting for capacity (")
    assert said[70].startswith("run r1 is waiting for capacity, 1 min so far (no free")
    assert said[190].startswith("run r1 is waiting for capacity, 3 min so far")
    assert said[200].startswith("run r1 is waiting for an operator's approval")  # a new wait: at once
    assert said[260].startswith("run r1 is paused:")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_cancels_the_launch_once_and_a_second_is_only_said(sig):
    said: list[str] = []

    async def launch() -> signal.Signals | None:
        interruption = Interruption(said.append)
        with interruption.installed():
            try:
                os.kill(os.getpid(), sig)
                await asyncio.Event().wait()  # only the cancellation ends this
            except asyncio.CancelledError:
                os.kill(os.getpid(), sig)  # while the run is being ended
                deadline = asyncio.get_running_loop().time() + 10
                while not said and asyncio.get_running_loop().time() < deadline:
                    await asyncio.sleep(0.01)
        return interruption.received

    assert asyncio.run(launch()) == sig
    assert said == [f"{sig.name}: still stopping the run's processes"]


def test_a_program_failure_names_the_node_its_rank_ran_on_though_no_node_is_blamed(capsys):
    from lazarus.commands.launch_follow import say_end

    now = datetime(2026, 1, 1, tzinfo=UTC)
    failure = FaultReport(
        kind="rank_error",
        nodes=[],  # the program's failure: no node is blamed
        incarnation=1,
        occurred_at=now,
        detected_at=now,
        step=None,
        rank=1,
        node="node-1",
        exit_code=1,
        error="AttributeError: 'Config' object has no attribute 'timeout'",
        log_tail="Traceback (most recent call last):\nAttributeError: 'Config' object has no attribute 'timeout'\n",
    )
    final = RunStatus(
        run_id="r",
        run_dir="/r",
        state=RunState.FAILED,
        total_steps=10,
        layout=LAYOUT,
        failure=failure,
        reason="crash loop: ...",
    )
    said: list[str] = []
    assert say_end(final, said.append) == 1
    assert said[-1] == "last lines of rank 1's log (node-1):"
    unknown = final.model_copy(update={"failure": failure.model_copy(update={"node": None})})
    say_end(unknown, said.append)
    assert said[-1] == "last lines of rank 1's log:"  # never an empty name
    assert "AttributeError" in capsys.readouterr().err
