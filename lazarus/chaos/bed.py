"""The test bed of the chaos matrix: a Temporal dev server and workers as processes of their own (so
that either can be SIGKILLed and started again), the local backend, and a watch on the run's
checkpoints (so that a checkpoint committed before a fault and lost after it is seen)."""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from lazarus.activities.failpoints import ENV_FAILPOINT_DIR, ENV_FAILPOINTS
from lazarus.client.config import ENV_ADDRESS, ENV_HOME, ENV_TASK_QUEUE, Settings
from lazarus.infra.backend import free_ports
from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.infra.backends.slurm.cluster import SlurmCluster
from lazarus.infra.harness.slurm_daemons import SlurmDaemons
from lazarus.infra.harness.temporal_server import PORT_ATTEMPTS, dev_server_command, port_answers
from lazarus.schema.files import read_json
from lazarus.schema.rundir import COMMIT_MARKER, RunDir

POLL_SECONDS = 0.02
"""How often the bed looks at files it waits for (seconds)."""


class ChaosError(RuntimeError):
    """The bed could not do what a scenario asked (a server that does not start, a wait that ran out)."""


async def wait_for(condition, what: str, timeout: float = 120.0):
    """Poll `condition()` (a function, or a coroutine function such as a query of the run) until
    it returns something true, and return that; ChaosError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not (value := await condition() if inspect.iscoroutinefunction(condition) else condition()):
        if time.monotonic() > deadline:
            raise ChaosError(f"gave up after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(POLL_SECONDS)
    return value


class ServerProcess:
    """The Temporal dev server on fixed loopback ports and one SQLite file, so that it comes back,
    after a SIGKILL, as the same server with the same workflows."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.port, self.http_port, self.metrics_port, self.ui_port = free_ports(4)
        self.process: subprocess.Popen | None = None
        self.started = False

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, wait: float = 30.0) -> None:
        """Start it (again, on the same ports and database) and return once its frontend answers;
        its first start tries fresh ports when one was taken between their choice and the bind."""
        for attempt in range(PORT_ATTEMPTS):
            try:
                return self._start(wait)
            except ChaosError:
                if self.started or attempt == PORT_ATTEMPTS - 1:
                    raise
                self.port, self.http_port, self.metrics_port, self.ui_port = free_ports(4)

    def _start(self, wait: float) -> None:
        command = dev_server_command(self.folder / "temporal.db", self.port, self.ui_port)
        command += ["--http-port", str(self.http_port), "--metrics-port", str(self.metrics_port)]
        with open(self.folder / "server.log", "ab") as log:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + wait
        while not port_answers("127.0.0.1", self.port) or not self.running:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise ChaosError(f"the Temporal dev server did not start; see {self.folder / 'server.log'}")
            time.sleep(0.05)
        self.started = True

    @property
    def running(self) -> bool:
        """Whether the server process lives (an answer on its port may come from another process
        for a moment: ports are chosen free, not reserved)."""
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL it, as a crashed host would end it, and reap it."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)


@dataclass
class WorkerProcess:
    """One `lazarus worker` process (its output in `log`, in the working directory `cwd`), perhaps
    with failpoints armed in its `env`; so that it can be SIGKILLed as a crashed controller is."""

    env: dict
    log: Path
    cwd: Path | None = None
    args: tuple[str, ...] = ()  # `lazarus worker`'s flags (`--backend slurm`)
    entry: str = "lazarus.cli"  # the module run as `python -m ENTRY worker`: the CLI, or a test's wrapper of it
    process: subprocess.Popen = field(init=False)

    def __post_init__(self) -> None:
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", self.entry, "worker", *self.args],
                env=self.env,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def kill(self) -> None:
        """SIGKILL it (unless it ended) and reap it."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)


class CheckpointWatch:
    """Every checkpoint of a run whose commit marker was ever seen, with the marker's commit time:
    what a fault must not lose, even after a later purge has removed it from disk."""

    def __init__(self, run: RunDir):
        self.run = run
        self.committed: dict[int, tuple[float, int]] = {}  # step -> (commit time, committing incarnation)
        self.gone: dict[int, float] = {}  # step -> when its committed folder was first seen gone (a purge)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="checkpoint-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            self.look()

    def look(self) -> None:
        """Record the commit markers there now."""
        if not self.run.checkpoints.is_dir():
            return
        present = set(self.run.checkpoint_steps(complete_only=True))
        now = time.time()
        for step in set(self.committed) - present - set(self.gone):
            self.gone[step] = now
        for step in present:
            if step not in self.committed:
                try:
                    marker = read_json(self.run.checkpoint(step) / COMMIT_MARKER)
                except FileNotFoundError:  # purged between the listing and the read
                    continue
                if marker is not None:
                    self.committed[step] = (float(marker["time"]), int(marker["incarnation"]))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.look()


class ChaosBed:
    """A server, the run's home, and the workers of one scenario; `close()` ends everything started."""

    def __init__(self, folder: Path, slurm: SlurmDaemons | None = None, worker_entry: str = "lazarus.cli"):
        self.folder = folder
        self.worker_entry = worker_entry  # what its workers run (WorkerProcess.entry)
        self.home = folder / "home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.server = ServerProcess(folder)
        # On a Slurm cluster (`slurm`), the workers serve the Slurm backend and a node dies whole.
        self.slurm = slurm
        self.cluster = SlurmCluster(self.home, environ=slurm.env) if slurm else LocalCluster(self.home)
        self.workers: list[WorkerProcess] = []
        self.markers = folder / "failpoints"
        self.task_queue = "chaos"

    @property
    def settings(self) -> Settings:
        return Settings(address=self.server.address, home=self.home, task_queue=self.task_queue)

    def start_worker(self, *failpoints: str) -> WorkerProcess:
        """A new worker process on the bed's task queue, with `failpoints` armed."""
        env = {
            **os.environ,
            ENV_ADDRESS: self.server.address,
            ENV_HOME: str(self.home),
            ENV_TASK_QUEUE: self.task_queue,
        }
        if failpoints:
            env |= {ENV_FAILPOINTS: ",".join(failpoints), ENV_FAILPOINT_DIR: str(self.markers)}
        args = ("--backend", "slurm") if self.slurm else ()
        if self.slurm:
            env |= self.slurm.env
        log = self.folder / f"worker-{len(self.workers) + 1}.log"
        self.workers.append(WorkerProcess(env, log, args=args, entry=self.worker_entry))
        return self.workers[-1]

    def kill_node(self, run_id: str, node: str) -> None:
        """SIGKILL every process of the node (on Slurm, its slurmd too) and return once they are gone."""
        if self.slurm:
            self.slurm.kill_node(node)
        else:
            self.cluster.kill_node(run_id, node)

    async def serving(self, worker: WorkerProcess, timeout: float = 60.0) -> None:
        """Wait until `worker` has connected and is about to poll (its first line says so)."""

        def up():
            if worker.process.poll() is not None:
                raise ChaosError(f"the worker ended (code {worker.process.returncode}); see {worker.log}")
            return worker.log.exists() and f"worker pid {worker.process.pid} " in worker.log.read_text(errors="replace")

        await wait_for(up, "a new worker to start", timeout)

    async def take_over(self, dead: WorkerProcess, *failpoints: str) -> WorkerProcess:
        """Start a worker (with `failpoints`), and once it serves, SIGKILL `dead`: a controller
        replica that crashes while another stands by, as a deployment of two or more runs them."""
        successor = self.start_worker(*failpoints)
        await self.serving(successor)
        dead.kill()
        return successor

    async def reached(self, failpoint: str, worker: WorkerProcess, timeout: float = 120.0) -> None:
        """Wait until `worker` stands at `failpoint`; ChaosError if it ended or never got there."""
        marker = self.markers / failpoint

        def there():
            if worker.process.poll() is not None:
                raise ChaosError(f"the worker ended (code {worker.process.returncode}) before {failpoint}")
            return marker.exists() and marker.read_text() == str(worker.process.pid)

        await wait_for(there, f"the worker to reach {failpoint}", timeout)

    def close(self) -> None:
        """SIGKILL every worker, the server and every rank process the bed's runs left."""
        for worker in self.workers:
            worker.kill()
        for run in (self.home / "runs").glob("*") if (self.home / "runs").is_dir() else []:
            self.cluster.stop_run(run.name)
        self.server.kill()
