"""End-to-end fixtures: a reference run without a fault, workers as processes, cleanup of ranks."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lazarus.infra.local import LocalCluster
from lazarus.schema import Assignment, RunSpec, load_spec
from lazarus.schema.contract import RunDir

SPECS = Path(__file__).resolve().parents[1] / "specs"
SMALL_SPEC = SPECS / "small.yaml"
SMALL_PP_SPEC = SPECS / "small-pp.yaml"


REPO = Path(__file__).resolve().parents[2]
USER_DDP_SPEC = SPECS / "user-ddp.yaml"


def with_absolute_command(spec: RunSpec) -> RunSpec:
    """The spec with a script path in trainer.command made absolute (relative to the repository)."""
    command = [
        part if not part.endswith(".py") or Path(part).is_absolute() else str(REPO / part)
        for part in spec.trainer.command
    ]
    return spec.model_copy(update={"trainer": spec.trainer.model_copy(update={"command": command})})


def wait_for(condition, timeout: float, what: str, every: float = 0.02):
    """Poll `condition` until it returns something truthy; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def losses(run: RunDir, incarnation: int | None = None) -> dict[int, float]:
    """step -> loss from metrics.jsonl, of one incarnation (default: every line, later ones win)."""
    rows = [json.loads(line) for line in run.metrics_file.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if incarnation is None or r["incarnation"] == incarnation}


def trained_step(run: RunDir) -> int:
    """Newest step in metrics.jsonl (0 before the first)."""
    try:
        lines = run.metrics_file.read_text().splitlines()
    except FileNotFoundError:
        return 0
    return json.loads(lines[-1])["step"] if lines else 0


def kill_rank_processes(home: Path) -> None:
    """SIGKILL every launcher and rank still alive under `home` (a failed test must not leak them)."""
    cluster = LocalCluster(home)
    for run in (home / "runs").glob("*") if (home / "runs").is_dir() else []:
        cluster.stop_run(run.name)


@pytest.fixture
def home(tmp_path):
    """LAZARUS_HOME of one test; its rank processes are killed at teardown, pass or fail."""
    home = tmp_path / "lazarus-home"
    home.mkdir()
    yield home
    kill_rank_processes(home)


def _train_without_fault(home: Path, spec_path: Path) -> dict[int, float]:
    """Train a spec once without any fault and without Temporal; returns step -> loss."""
    spec = with_absolute_command(load_spec(spec_path))
    cluster = LocalCluster(home)
    try:
        cluster.create("reference", spec)
        cluster.commit_assignment(
            "reference",
            Assignment(
                incarnation=0,
                nodes=[f"node-{i}" for i in range(spec.cluster.active_nodes)],
                layout=spec.layout,
                master_port=_port(),
            ),
        )
        cluster.start_ranks("reference", 0, resume_step=0)

        def finished():
            ranks = cluster.observe("reference", 0).ranks
            assert not any(r.exit and r.exit["code"] for r in ranks), [r.exit for r in ranks]
            return all(r.exit is not None and not r.alive for r in ranks)

        wait_for(
            lambda: finished() and not cluster.observe("reference", 0).launchers_alive,
            180,
            f"the reference run of {spec_path.name} to finish",
            every=0.1,
        )
    finally:
        kill_rank_processes(home)
    result = losses(cluster.run_dir("reference"))
    assert sorted(result) == list(range(1, spec.trainer.steps + 1))
    return result


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """reference(spec_path) -> losses of that spec trained without a fault (once per session)."""
    cache: dict[Path, dict[int, float]] = {}

    def losses_of(spec_path: Path) -> dict[int, float]:
        if spec_path not in cache:
            cache[spec_path] = _train_without_fault(tmp_path_factory.mktemp("reference"), spec_path)
        return cache[spec_path]

    return losses_of


@pytest.fixture(scope="session")
def reference_losses(reference) -> dict[int, float]:
    """Losses of the small spec trained once without any fault and without Temporal."""
    return reference(SMALL_SPEC)


def _port() -> int:
    from lazarus.infra.local import free_port

    return free_port()


class WorkerProcess:
    """`lazarus worker` as a child process, so a test can SIGKILL it like a crashed controller."""

    def __init__(self, env: dict, log: Path):
        self.log = open(log, "ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "lazarus.cli", "worker"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)
        self.log.close()


@pytest.fixture
def workers():
    """Start workers with `workers(env, log)`; any still running at teardown is killed."""
    started: list[WorkerProcess] = []

    def start(env: dict, log: Path) -> WorkerProcess:
        worker = WorkerProcess(env, log)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.kill()
