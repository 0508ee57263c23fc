"""The local backend: each node is a group of rank processes on this machine.

Everything a restarted worker needs lives in the run directory (spec/contract.py):
the inventory, each incarnation's assignment, and per rank a lock file and a pid file.
A rank process holds an exclusive flock on its lock file for its whole life (the launcher
hands it a locked descriptor), so "is rank R of incarnation K alive?" is answered by the
kernel, immune to pid reuse and zombies, and a launcher retried after a crash cannot start
a second copy of a rank.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from spec.contract import (
    COMMIT_MARKER,
    ENV_FAIL_AT,
    ENV_INCARNATION,
    ENV_NODE,
    ENV_RESUME_STEP,
    ENV_RUN_DIR,
    RunDir,
    read_json,
    write_json_atomic,
)
from spec.records import Assignment, Inventory, NodeRecord
from spec.run import RunSpec


class ClusterError(RuntimeError):
    """The backend cannot do what was asked (unknown run or node, a stuck process)."""


@dataclass
class RankObservation:
    """What the backend sees of one rank process."""

    rank: int
    node: str
    launched: bool
    alive: bool
    heartbeat: dict | None = None
    exit: dict | None = None
    returncode: int | None = None


@dataclass
class Observation:
    """One look at an incarnation: its ranks and the health of its nodes."""

    incarnation: int
    launched_at: float | None
    resume_step: int
    ranks: list[RankObservation] = field(default_factory=list)
    dead_nodes: dict[str, datetime] = field(default_factory=dict)


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


def _start_time(pid: int) -> int | None:
    """Kernel start time of a process (clock ticks since boot), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may contain spaces; fields after it are fixed.
    return int(stat.rsplit(")", 1)[1].split()[19])


def _lock_is_held(path: Path) -> bool:
    """True while a process holds the flock on `path`."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LocalCluster:
    """Runs' nodes as rank processes on this machine, with state under `home/runs/<run_id>`."""

    def __init__(self, home: str | Path, rank_command: list[str] | None = None):
        self.home = Path(home).resolve()
        # What each rank runs; the built-in trainer unless told otherwise (tests use a stand-in).
        self.rank_command = rank_command or [sys.executable, "-m", "trainer"]
        # Rank processes this object started, so their exit codes can be collected and
        # they do not linger as zombies; after a restart the lock files tell liveness.
        self._children: dict[tuple[str, int, int], subprocess.Popen] = {}

    # --- run state -----------------------------------------------------------------

    def run_dir(self, run_id: str) -> RunDir:
        """The run's directory (it may not exist yet)."""
        return RunDir(self.home / "runs" / run_id)

    def create(self, run_id: str, spec: RunSpec) -> RunDir:
        """Create the run's directory, spec and inventory; a second call finds them and checks the spec."""
        run = self.run_dir(run_id)
        run.root.mkdir(parents=True, exist_ok=True)
        with self._inventory_lock(run):
            if run.spec_file.exists():
                if RunSpec.model_validate_json(run.spec_file.read_text()) != spec:
                    raise ClusterError(f"run directory {run.root} belongs to another run with a different spec")
                return run
            names = [f"node-{i}" for i in range(spec.cluster.active_nodes + spec.cluster.spare_nodes)]
            inventory = Inventory(nodes=[
                NodeRecord(name=name, role="active" if i < spec.cluster.active_nodes else "spare")
                for i, name in enumerate(names)
            ])
            write_json_atomic(run.inventory_file, inventory.model_dump(mode="json"))
            # The spec is written last: its presence means the run directory is complete.
            write_json_atomic(run.spec_file, spec.model_dump(mode="json"))
        return run

    def _existing(self, run_id: str) -> RunDir:
        run = self.run_dir(run_id)
        if not run.spec_file.exists():
            raise ClusterError(f"no run {run_id!r} under {self.home / 'runs'}")
        return run

    @contextlib.contextmanager
    def _inventory_lock(self, run: RunDir):
        with open(run.root / "inventory.lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def inventory(self, run_id: str) -> Inventory:
        """The run's nodes as last recorded."""
        return self._read_inventory(self._existing(run_id))

    @staticmethod
    def _read_inventory(run: RunDir) -> Inventory:
        return Inventory.model_validate_json(run.inventory_file.read_text())

    @staticmethod
    def _write_inventory(run: RunDir, inventory: Inventory) -> None:
        write_json_atomic(run.inventory_file, inventory.model_dump(mode="json"))

    def update_nodes(self, run_id: str, changes: dict[str, dict]) -> Inventory:
        """Apply field changes to named nodes under the inventory lock; returns the new inventory."""
        run = self._existing(run_id)
        with self._inventory_lock(run):
            inventory = self._read_inventory(run)
            known = {n.name for n in inventory.nodes}
            unknown = sorted(set(changes) - known)
            if unknown:
                raise ClusterError(f"run {run_id!r} has no node {', '.join(unknown)}; nodes: {', '.join(sorted(known))}")
            inventory = Inventory(nodes=[n.model_copy(update=changes.get(n.name, {})) for n in inventory.nodes])
            self._write_inventory(run, inventory)
        return inventory

    def assignment(self, run_id: str, incarnation: int) -> Assignment | None:
        """The recorded assignment of an incarnation, if any."""
        data = read_json(self.run_dir(run_id).assignment_file(incarnation))
        return None if data is None else Assignment.model_validate(data)

    def commit_assignment(self, run_id: str, assignment: Assignment, claims: list[str] = (),
                          releases: list[str] = ()) -> Assignment:
        """Record an incarnation's assignment, claim the spares it uses and release nodes, exactly once.

        Under the inventory lock: if the incarnation already has an assignment (an earlier
        attempt wrote it), that one is returned; otherwise every claimed node must be a
        free healthy spare. Either way the nodes of the returned assignment are marked
        active and the released ones spare, which also completes an attempt that crashed
        between the two writes.
        """
        run = self._existing(run_id)
        with self._inventory_lock(run):
            recorded = self.assignment(run_id, assignment.incarnation)
            inventory = self._read_inventory(run)
            if recorded is None:
                free = inventory.free_spares()
                taken = [node for node in claims if node not in free]
                if taken:
                    raise ClusterError(f"node {', '.join(taken)} is no longer a free spare (free: {', '.join(free) or 'none'})")
                write_json_atomic(run.assignment_file(assignment.incarnation), assignment.model_dump(mode="json"))
                recorded = assignment
            active, released = set(recorded.nodes), set(releases) - set(recorded.nodes)

            def role(node: NodeRecord) -> NodeRecord:
                if node.name in active and node.role != "active":
                    return node.model_copy(update={"role": "active", "note": f"incarnation {recorded.incarnation}"})
                if node.name in released and node.role == "active":
                    return node.model_copy(update={"role": "spare", "note": f"released at incarnation {recorded.incarnation}"})
                return node

            self._write_inventory(run, Inventory(nodes=[role(n) for n in inventory.nodes]))
        return recorded

    # --- rank processes --------------------------------------------------------------

    def start_ranks(self, run_id: str, incarnation: int, resume_step: int, skipped: dict[int, str] | None = None) -> dict:
        """Start every rank of an incarnation that is not running; returns the launch record in force.

        The record ({resume_step, skipped, launched_at}) is written by the first launch, so
        a retried launch restores the same checkpoint as the ranks the first attempt may
        have started, and reports the same skipped checkpoints.
        """
        run = self._existing(run_id)
        assignment = self.assignment(run_id, incarnation)
        if assignment is None:
            raise ClusterError(f"incarnation {incarnation} of run {run_id!r} has no assignment")
        launch_file = run.incarnation(incarnation) / "launch.json"
        record = read_json(launch_file)
        if record is None:
            record = {"resume_step": resume_step, "skipped": {str(k): v for k, v in (skipped or {}).items()},
                      "launched_at": time.time()}
            write_json_atomic(launch_file, record)
        resume_step = record["resume_step"]

        layout = assignment.layout
        spec = RunSpec.model_validate_json(run.spec_file.read_text())
        planned = {f.node: f"{f.point}:{f.step}" for f in spec.faults if f.incarnation == incarnation}
        for rank in range(layout.world_size):
            node = assignment.nodes[layout.node_of_rank(rank)]
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(layout.world_size),
                "LOCAL_RANK": str(rank % layout.ranks_per_node),
                "LOCAL_WORLD_SIZE": str(layout.ranks_per_node),
                "GROUP_RANK": str(layout.node_of_rank(rank)),
                "MASTER_ADDR": assignment.master_addr,
                "MASTER_PORT": str(assignment.master_port),
                "OMP_NUM_THREADS": "1",
                ENV_RUN_DIR: str(run.root),
                ENV_INCARNATION: str(incarnation),
                ENV_NODE: node,
                ENV_RESUME_STEP: str(resume_step),
            }
            env.pop(ENV_FAIL_AT, None)
            if node in planned:
                env[ENV_FAIL_AT] = planned[node]
            self._spawn(run, run_id, incarnation, rank, node, env)
        return record

    def _spawn(self, run: RunDir, run_id: str, incarnation: int, rank: int, node: str, env: dict) -> None:
        lock_path = run.lock_file(incarnation, rank)
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # this rank is already running (an earlier attempt started it)
            if read_json(run.exit_file(incarnation, rank)) is not None:
                return  # it already ran and ended; restarting it would not rejoin its peers
            log_path = run.log_file(incarnation, rank)
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "ab") as log:
                child = subprocess.Popen(
                    self.rank_command,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    pass_fds=(fd,),
                    # Own session: ranks outlive a crashed worker, as they would on a real node.
                    start_new_session=True,
                )
            self._children[(run_id, incarnation, rank)] = child
            write_json_atomic(run.pid_file(incarnation, rank),
                              {"pid": child.pid, "start_time": _start_time(child.pid), "node": node})
        finally:
            # The child holds the lock through its inherited copy of the descriptor.
            os.close(fd)

    def observe(self, run_id: str, incarnation: int) -> Observation:
        """Liveness, heartbeat and exit record of every rank of an incarnation, and dead nodes."""
        run = self._existing(run_id)
        assignment = self.assignment(run_id, incarnation)
        if assignment is None:
            raise ClusterError(f"incarnation {incarnation} of run {run_id!r} has no assignment")
        launch = read_json(run.incarnation(incarnation) / "launch.json") or {}
        inventory = self.inventory(run_id)
        dead = {n.name: n.died_at or _utcnow() for n in inventory.nodes
                if not n.healthy and n.name in assignment.nodes}
        observation = Observation(incarnation, launch.get("launched_at"), launch.get("resume_step", 0), dead_nodes=dead)
        layout = assignment.layout
        for rank in range(layout.world_size):
            child = self._children.get((run_id, incarnation, rank))
            observation.ranks.append(RankObservation(
                rank=rank,
                node=assignment.nodes[layout.node_of_rank(rank)],
                launched=run.pid_file(incarnation, rank).exists(),
                alive=_lock_is_held(run.lock_file(incarnation, rank)),
                heartbeat=read_json(run.heartbeat_file(incarnation, rank)),
                exit=read_json(run.exit_file(incarnation, rank)),
                returncode=child.poll() if child else None,
            ))
        return observation

    def _rank_pids(self, run: RunDir, incarnation: int) -> list[tuple[int, dict]]:
        ranks_dir = run.incarnation(incarnation) / "ranks"
        if not ranks_dir.is_dir():
            return []
        found = []
        for pid_file in sorted(ranks_dir.glob("*.pid")):
            record = read_json(pid_file)
            if record is not None:
                found.append((int(pid_file.stem), record))
        return found

    def _kill(self, record: dict) -> None:
        # Only the process recorded at launch: a recycled pid has another start time.
        if record.get("start_time") is not None and _start_time(record["pid"]) == record["start_time"]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(record["pid"], signal.SIGKILL)

    def stop_incarnation(self, run_id: str, incarnation: int, timeout: float = 30.0) -> list[int]:
        """SIGKILL every rank of an incarnation and wait until none is alive; returns the ranks killed.

        After this returns no process of the incarnation exists, so none can still write
        a checkpoint or a heartbeat.
        """
        run = self._existing(run_id)
        killed = []
        for rank, record in self._rank_pids(run, incarnation):
            if _lock_is_held(run.lock_file(incarnation, rank)):
                self._kill(record)
                killed.append(rank)
        self._wait_gone(run_id, run, [(incarnation, rank) for rank, _ in self._rank_pids(run, incarnation)], timeout)
        return killed

    def _wait_gone(self, run_id: str, run: RunDir, ranks: list[tuple[int, int]], timeout: float) -> None:
        """Wait until the processes of (incarnation, rank) have ended: their locks are released."""
        deadline = time.monotonic() + timeout
        for incarnation, rank in ranks:
            while _lock_is_held(run.lock_file(incarnation, rank)):
                if time.monotonic() > deadline:
                    raise ClusterError(f"rank {rank} of incarnation {incarnation} is still alive {timeout:.0f} s after SIGKILL")
                time.sleep(0.005)
            child = self._children.pop((run_id, incarnation, rank), None)
            if child:
                child.wait()

    def kill_node(self, run_id: str, node: str) -> list[int]:
        """Chaos: mark a node dead, SIGKILL every process on it, and wait until they are gone.

        Returns the pids killed. The node is marked dead first, with the time just before
        the kill, so a detector sees a dead node rather than only its ranks' exits.
        """
        run = self._existing(run_id)
        self.update_nodes(run_id, {node: {"healthy": False, "died_at": _utcnow(), "note": "killed (chaos kill-node)"}})
        killed, ranks = [], []
        for incarnation in run.incarnations():
            for rank, record in self._rank_pids(run, incarnation):
                if record.get("node") == node and _lock_is_held(run.lock_file(incarnation, rank)):
                    self._kill(record)
                    killed.append(record["pid"])
                    ranks.append((incarnation, rank))
        self._wait_gone(run_id, run, ranks, timeout=30.0)
        return killed

    def return_node(self, run_id: str, node: str) -> Inventory:
        """A repaired node goes back to the pool as a healthy spare."""
        return self.update_nodes(run_id, {node: {"healthy": True, "died_at": None, "role": "spare", "note": "returned"}})

    def live_pids(self, run_id: str) -> list[int]:
        """Pids of every rank process of the run that is alive now (any incarnation)."""
        run = self.run_dir(run_id)
        return [record["pid"] for k in run.incarnations() for rank, record in self._rank_pids(run, k)
                if _lock_is_held(run.lock_file(k, rank))]

    def await_checkpoint_in_flight(self, run_id: str, incarnation: int, grace: float) -> tuple[int | None, bool]:
        """If a checkpoint was being written when the fault hit, give it `grace` seconds to commit.

        Returns its step (None if there was none) and whether it committed. A save whose
        writer died usually cannot finish (its ranks meet in a collective at the end), but
        one whose every shard was written commits within milliseconds, and keeping it saves
        up to a whole checkpoint interval of training.
        """
        run = self._existing(run_id)
        complete = run.checkpoint_steps()
        newer = [s for s in run.checkpoint_steps(complete_only=False) if not complete or s > complete[-1]]
        if not newer:
            return None, False
        step = newer[-1]
        deadline = time.monotonic() + grace
        ranks = range(self.assignment(run_id, incarnation).layout.world_size)
        while not (run.checkpoint(step) / COMMIT_MARKER).is_file():
            alive = any(_lock_is_held(run.lock_file(incarnation, rank)) for rank in ranks)
            if not alive or time.monotonic() > deadline:
                return step, False
            time.sleep(0.02)
        return step, True

    def remove_partial_checkpoints(self, run_id: str) -> list[int]:
        """Delete checkpoint folders that never got their commit marker; returns their steps.

        Called only once no rank of the run is alive, so nothing can still be writing them.
        """
        run = self._existing(run_id)
        complete = set(run.checkpoint_steps())
        partial = [s for s in run.checkpoint_steps(complete_only=False) if s not in complete]
        for step in partial:
            shutil.rmtree(run.checkpoint(step), ignore_errors=True)
        return partial
