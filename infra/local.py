"""The local backend: each node is a group of rank processes on this machine.

Everything a restarted worker needs lives in the run directory (schema/contract.py):
the inventory, each incarnation's assignment, and per rank a lock file and a pid file.
A rank process holds an exclusive flock on its lock file for its whole life (the launcher
hands it a locked descriptor), so "is rank R of incarnation K alive?" is answered by the
kernel, immune to pid reuse and zombies, and a launcher retried after a crash cannot start
a second copy of a rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from lazarus.infra.runfiles import ClusterError, RunFiles
from lazarus.schema.contract import (
    ENV_INCARNATION,
    ENV_NODE,
    ENV_NODE_INDEX,
    ENV_RESUME_STEP,
    ENV_RUN_DIR,
    ENV_STANDBY_LOCK_FD,
    RunDir,
    lock_is_held,
    process_start_time,
    read_json,
    take_lock,
    write_json_atomic,
)
from lazarus.schema.policy import RecoveryPolicy
from lazarus.schema.records import Assignment, Inventory, NodeRecord
from lazarus.schema.run import RunSpec

__all__ = ["ClusterError", "LocalCluster", "Observation", "RankObservation", "free_port"]


@dataclass
class RankObservation:
    """What the backend sees of one rank process."""

    rank: int
    node: str
    launched: bool
    alive: bool
    heartbeat: dict | None = None
    exit: dict | None = None
    launcher_alive: bool = False


@dataclass
class Observation:
    """One look at an incarnation: its ranks and the health of its nodes."""

    incarnation: int
    launched_at: float | None
    resume_step: int
    ranks: list[RankObservation] = field(default_factory=list)
    dead_nodes: dict[str, datetime] = field(default_factory=dict)
    launchers_alive: int = 0
    node_addresses: dict[str, str] = field(
        default_factory=dict
    )  # node -> the address its ranks' peers dial, where known


@dataclass
class NodeGroup:
    """One node of an incarnation: its launcher (a process group with the node's ranks) and their locks."""

    incarnation: int
    index: int
    node: str
    lock: Path
    pid_file: Path
    rank_locks: list[tuple[int, Path]]


def _utcnow() -> datetime:
    return datetime.now(UTC)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LocalCluster(RunFiles):
    """Runs' nodes as rank processes on this machine, with state under `home/runs/<run_id>`."""

    backend = "local"

    def __init__(self, home: str | Path, python: str = sys.executable):
        super().__init__(home)
        self.python = python  # the interpreter that runs the node launchers
        # Launchers this object started, reaped as they end so they do not linger as zombies;
        # after a restart the lock files tell liveness.
        self._children: dict[tuple[str, int, int], subprocess.Popen] = {}

    # --- run state -----------------------------------------------------------------

    def create(self, run_id: str, spec: RunSpec) -> RunDir:
        """Create the run's directory, spec and inventory; a second call finds them and checks the spec."""
        run = self.run_dir(run_id)
        run.root.mkdir(parents=True, exist_ok=True)
        with self._inventory_lock(run):
            if run.spec_file.exists():
                return self.write_spec(run_id, spec)  # checks that it is the same spec
            names = [f"node-{i}" for i in range(spec.cluster.active_nodes + spec.cluster.spare_nodes)]
            inventory = Inventory(
                nodes=[
                    NodeRecord(name=name, role="active" if i < spec.cluster.active_nodes else "spare")
                    for i, name in enumerate(names)
                ]
            )
            write_json_atomic(run.inventory_file, inventory.model_dump(mode="json"))
            # The spec is written last: its presence means the run directory is complete.
            return self.write_spec(run_id, spec)

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
                raise ClusterError(
                    f"run {run_id!r} has no node {', '.join(unknown)}; nodes: {', '.join(sorted(known))}"
                )
            inventory = Inventory(nodes=[n.model_copy(update=changes.get(n.name, {})) for n in inventory.nodes])
            self._write_inventory(run, inventory)
        return inventory

    def commit_assignment(
        self, run_id: str, assignment: Assignment, claims: list[str] = (), releases: list[str] = ()
    ) -> Assignment:
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
                    raise ClusterError(
                        f"node {', '.join(taken)} is no longer a free spare (free: {', '.join(free) or 'none'})"
                    )
                write_json_atomic(run.assignment_file(assignment.incarnation), assignment.model_dump(mode="json"))
                recorded = assignment
            active, released = set(recorded.nodes), set(releases) - set(recorded.nodes)

            def role(node: NodeRecord) -> NodeRecord:
                if node.name in active and node.role != "active":
                    return node.model_copy(update={"role": "active", "note": f"incarnation {recorded.incarnation}"})
                if node.name in released and node.role == "active":
                    return node.model_copy(
                        update={"role": "spare", "note": f"released at incarnation {recorded.incarnation}"}
                    )
                return node

            self._write_inventory(run, Inventory(nodes=[role(n) for n in inventory.nodes]))
        return recorded

    # --- rank processes --------------------------------------------------------------

    def start_ranks(
        self,
        run_id: str,
        incarnation: int,
        resume_step: int,
        skipped: dict[int, str] | None = None,
        policy: RecoveryPolicy | None = None,
    ) -> dict:
        """Start every rank of an incarnation that is not running; returns the launch record in force.

        The record ({resume_step, skipped, launched_at}) is written by the first launch, so
        a retried launch restores the same checkpoint as the ranks the first attempt may
        have started, and reports the same skipped checkpoints. `policy` (the recovery policy
        in force) shapes Kubernetes pods; local processes need none of it.
        """
        run = self._existing(run_id)
        assignment = self.assignment(run_id, incarnation)
        if assignment is None:
            raise ClusterError(f"incarnation {incarnation} of run {run_id!r} has no assignment")
        record = self.record_launch(run_id, incarnation, resume_step, skipped)
        spec = self.spec(run_id)
        if spec.cluster.warm_standby:
            self._start_warm(run, run_id, spec, assignment, record["resume_step"])
            return record
        for index, node in enumerate(assignment.nodes):
            self._spawn_launcher(
                run,
                run_id,
                incarnation,
                index,
                node,
                self._launcher_env(run, incarnation, index, node, record["resume_step"]),
            )
        return record

    @staticmethod
    def _launcher_env(run: RunDir, incarnation: int, index: int, node: str, resume_step: int) -> dict:
        return {
            **os.environ,
            ENV_RUN_DIR: str(run.root),
            ENV_INCARNATION: str(incarnation),
            ENV_NODE: node,
            ENV_NODE_INDEX: str(index),
            ENV_RESUME_STEP: str(resume_step),
        }

    # --- warm standbys (trainer/standby.py) ------------------------------------------

    def _ensure_standby(self, run: RunDir, run_id: str, spec: RunSpec, node: str) -> subprocess.Popen | None:
        """Start the node's warm standby unless one lives; returns the process if this call started it."""
        home = run.standby(node)
        # Taken here and handed to the standby, as for launchers: from the moment this call
        # returns the lock says a standby lives, so no second one can be started meanwhile.
        fd = take_lock(home / "lock")
        if fd is None:
            return None
        try:
            with contextlib.suppress(FileExistsError):
                os.mkfifo(home / "orders")
            env = {
                **os.environ,
                **spec.trainer.env,
                ENV_RUN_DIR: str(run.root),
                ENV_NODE: node,
                ENV_STANDBY_LOCK_FD: str(fd),
            }
            env.setdefault("OMP_NUM_THREADS", "1")  # as the launcher sets it for ranks; read when torch is imported
            with open(home / "log", "ab") as log:
                child = subprocess.Popen(
                    [self.python, "-m", "lazarus.trainer.standby"],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    pass_fds=(fd,),
                )
            self._children[(run_id, "standby", node)] = child
            write_json_atomic(
                home / "pid", {"pid": child.pid, "pgid": child.pid, "start_time": process_start_time(child.pid)}
            )
        finally:
            os.close(fd)
        return child

    def ensure_standbys(self, run_id: str) -> None:
        """Give every healthy node of the run (active or spare) a warm standby, if the spec asks for them."""
        run = self._existing(run_id)
        spec = self.spec(run_id)
        if spec.cluster.warm_standby:
            for node in self.inventory(run_id).nodes:
                if node.healthy and node.role != "quarantined":
                    self._ensure_standby(run, run_id, spec, node.name)

    def _start_warm(
        self, run: RunDir, run_id: str, spec: RunSpec, assignment: Assignment, resume_step: int, timeout: float = 60.0
    ) -> None:
        """Order each node's standby to start its ranks; wait until each node's launcher exists.

        A node whose standby dies, or does not answer within `timeout` seconds (stuck in
        its imports), gets a cold launcher instead; should the standby answer later, its
        launcher finds the node lock taken or the ranks ended, and starts nothing.
        """
        incarnation = assignment.incarnation
        self.ensure_standbys(run_id)  # the spares too, so that they are warm before they are needed
        # O_RDWR keeps the FIFO's buffer alive until the standby opens it, even if it has not yet.
        writers = {}
        for index, node in enumerate(assignment.nodes):
            fd = os.open(run.standby(node) / "orders", os.O_RDWR | os.O_NONBLOCK)
            os.write(
                fd,
                json.dumps({"incarnation": incarnation, "node_index": index, "resume_step": resume_step}).encode()
                + b"\n",
            )
            writers[index] = fd
        deadline = time.monotonic() + timeout
        try:
            while writers:
                for index, fd in list(writers.items()):
                    node = assignment.nodes[index]
                    if (
                        lock_is_held(run.node_lock_file(incarnation, index))
                        or run.node_pid_file(incarnation, index).exists()
                    ):
                        del writers[index]  # its launcher runs (or already ran)
                        os.close(fd)
                        continue
                    # The standby holds its lock from the moment it is started (_ensure_standby).
                    if not lock_is_held(run.standby(node) / "lock") or time.monotonic() > deadline:
                        del writers[index]
                        os.close(fd)
                        self._spawn_launcher(
                            run,
                            run_id,
                            incarnation,
                            index,
                            node,
                            self._launcher_env(run, incarnation, index, node, resume_step),
                        )
                time.sleep(0.002)
        finally:
            for fd in writers.values():
                os.close(fd)

    def _kill_standbys(
        self, run: RunDir, nodes: list[str] | None = None, timeout: float = 30.0, wait: bool = True
    ) -> None:
        """SIGKILL the warm standbys of the given nodes (default: all) and, unless `wait` is false,
        wait until they are gone."""
        base = run.root / "standby"
        homes = [base / n for n in nodes] if nodes is not None else (sorted(base.iterdir()) if base.is_dir() else [])
        deadline = time.monotonic() + timeout
        for home in homes:
            record = read_json(home / "pid")
            while record is None and lock_is_held(home / "lock") and time.monotonic() < deadline:
                time.sleep(0.005)
                record = read_json(home / "pid")
            if record is not None and lock_is_held(home / "lock"):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(record["pgid"], signal.SIGKILL)
            while wait and lock_is_held(home / "lock"):
                if time.monotonic() > deadline:
                    raise ClusterError(f"standby of {home.name} is still alive {timeout:.0f} s after SIGKILL")
                time.sleep(0.005)

    def release_standbys(self, run_id: str) -> None:
        """Stop the run's warm standbys (it has ended: they would only wait for their idle exit)."""
        self._kill_standbys(self.run_dir(run_id))

    def _spawn_launcher(self, run: RunDir, run_id: str, incarnation: int, index: int, node: str, env: dict) -> None:
        """Start the launcher of one node unless one runs; it starts the node's ranks (trainer/launcher.py)."""
        fd = take_lock(run.node_lock_file(incarnation, index))
        if fd is None:
            return  # this node's launcher is running (an earlier attempt started it)
        try:
            log_path = run.incarnation(incarnation) / "nodes" / f"{index}.log"
            with open(log_path, "ab") as log:
                child = subprocess.Popen(
                    [self.python, "-m", "lazarus.trainer.launcher"],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    pass_fds=(fd,),
                    # Own session: a node outlives a crashed worker, as a real one would.
                    start_new_session=True,
                )
            self._children[(run_id, incarnation, index)] = child
            # The launcher records this too, first thing; whichever lands first is the same.
            write_json_atomic(
                run.node_pid_file(incarnation, index),
                {"pid": child.pid, "pgid": child.pid, "start_time": process_start_time(child.pid), "node": node},
            )
        finally:
            # The launcher holds the lock through its inherited copy of the descriptor.
            os.close(fd)

    def observe(self, run_id: str, incarnation: int) -> Observation:
        """Liveness, heartbeat and exit record of every rank of an incarnation, and dead nodes."""
        run = self._existing(run_id)
        assignment = self.assignment(run_id, incarnation)
        if assignment is None:
            raise ClusterError(f"incarnation {incarnation} of run {run_id!r} has no assignment")
        self._reap()
        launch = read_json(run.incarnation(incarnation) / "launch.json") or {}
        inventory = self.inventory(run_id)
        dead = {n.name: n.died_at or _utcnow() for n in inventory.nodes if not n.healthy and n.name in assignment.nodes}
        observation = Observation(incarnation, launch.get("launched_at"), launch.get("resume_step", 0), dead_nodes=dead)
        launcher_alive = [
            lock_is_held(run.node_lock_file(incarnation, index)) for index in range(len(assignment.nodes))
        ]
        observation.launchers_alive = sum(launcher_alive)
        layout = assignment.layout
        for rank in range(layout.world_size):
            exit_record = read_json(run.exit_file(incarnation, rank))
            observation.ranks.append(
                RankObservation(
                    rank=rank,
                    node=assignment.nodes[layout.node_of_rank(rank)],
                    # A rank the launcher could not even start has an exit record and no pid.
                    launched=exit_record is not None or run.pid_file(incarnation, rank).exists(),
                    alive=lock_is_held(run.lock_file(incarnation, rank)),
                    heartbeat=read_json(run.heartbeat_file(incarnation, rank)),
                    exit=exit_record,
                    launcher_alive=launcher_alive[layout.node_of_rank(rank)],
                )
            )
        return observation

    async def wait_for_exit(self, run_id: str, incarnation: int, timeout: float) -> bool:
        """Return once a live rank or launcher of the incarnation exits (True), or after `timeout`
        seconds (False). Each process is watched through a pidfd, so a kill is seen at once
        rather than at the next poll."""
        run = self.run_dir(run_id)
        assignment = self.assignment(run_id, incarnation)
        watched = []
        if assignment is not None:
            for group in self._node_groups(run, incarnation):
                processes = [(group.lock, group.pid_file)] + [
                    (lock, run.pid_file(incarnation, r)) for r, lock in group.rank_locks
                ]
                for lock, pid_file in processes:
                    record = read_json(pid_file)
                    if record is None or not lock_is_held(lock):
                        continue  # not started yet, or gone (the caller's next look sees that)
                    try:
                        fd = os.pidfd_open(record["pid"])
                    except OSError:
                        continue
                    if process_start_time(record["pid"]) != record.get("start_time"):
                        os.close(fd)  # the pid was reused
                        continue
                    watched.append(fd)
        if not watched:
            await asyncio.sleep(timeout)
            return False
        loop = asyncio.get_running_loop()
        exited = asyncio.Event()
        for fd in watched:
            loop.add_reader(fd, exited.set)
        try:
            await asyncio.wait_for(exited.wait(), timeout)
            return True
        except TimeoutError:
            return False
        finally:
            for fd in watched:
                loop.remove_reader(fd)
                os.close(fd)

    def _reap(self) -> None:
        """Collect the exit status of launchers that ended, so none lingers as a zombie."""
        for key, child in list(self._children.items()):
            if child.poll() is not None:
                del self._children[key]

    def _node_groups(self, run: RunDir, incarnation: int, node: str | None = None) -> list[NodeGroup]:
        """Every node (or one) of an incarnation: its launcher's lock and its ranks' locks."""
        assignment = Assignment.model_validate_json(run.assignment_file(incarnation).read_text())
        per_node = assignment.layout.ranks_per_node
        return [
            NodeGroup(
                incarnation,
                index,
                name,
                run.node_lock_file(incarnation, index),
                run.node_pid_file(incarnation, index),
                [(rank, run.lock_file(incarnation, rank)) for rank in range(index * per_node, (index + 1) * per_node)],
            )
            for index, name in enumerate(assignment.nodes)
            if node is None or name == node
        ]

    def _kill_and_wait(self, groups: list[NodeGroup], timeout: float) -> list[tuple[NodeGroup, list[int]]]:
        """SIGKILL every live node group (the launcher's process group: it and all its ranks),
        then wait until every lock is released; returns each group killed with its live ranks.

        Killing the process group rather than recorded pids leaves no gap: a rank holds its
        lock from the moment it is forked, before anyone could record its pid, and it is in
        its launcher's group from that moment too.
        """
        deadline = time.monotonic() + timeout
        killed = []
        for group in groups:
            ranks = [rank for rank, lock in group.rank_locks if lock_is_held(lock)]
            if not ranks and not lock_is_held(group.lock):
                continue
            # The launcher records its group before it starts any rank; wait if it has just started.
            record = read_json(group.pid_file)
            while record is None and lock_is_held(group.lock) and time.monotonic() < deadline:
                time.sleep(0.005)
                record = read_json(group.pid_file)
            if record is not None:
                # A live lock means the group still has members, so its id cannot have been reused.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(record["pgid"], signal.SIGKILL)
            killed.append((group, ranks))
        for group in groups:
            for what, lock in [("launcher", group.lock)] + [(f"rank {rank}", lock) for rank, lock in group.rank_locks]:
                while lock_is_held(lock):
                    if time.monotonic() > deadline:
                        raise ClusterError(
                            f"{what} of {group.node} (incarnation {group.incarnation}) is still alive "
                            f"{timeout:.0f} s after SIGKILL"
                        )
                    time.sleep(0.005)
        self._reap()
        return killed

    def stop_incarnation(self, run_id: str, incarnation: int, timeout: float = 30.0) -> list[int]:
        """SIGKILL every process of an incarnation (launchers and ranks) and wait until none is alive;
        returns the ranks that were alive.

        After this returns no process of the incarnation exists, so none can still write
        a checkpoint or a heartbeat.
        """
        run = self._existing(run_id)
        run.ended_file(incarnation).touch()
        killed = self._kill_and_wait(self._node_groups(run, incarnation), timeout)
        return sorted(rank for _, ranks in killed for rank in ranks)

    def stop_run(self, run_id: str, timeout: float = 30.0) -> None:
        """SIGKILL every process of every incarnation of a run and wait until none is alive."""
        run = self.run_dir(run_id)
        for k in run.incarnations():
            run.ended_file(k).touch()
        self._kill_standbys(run, timeout=timeout)
        groups = [group for k in run.incarnations() for group in self._node_groups(run, k)]
        self._kill_and_wait(groups, timeout)

    def kill_node(self, run_id: str, node: str) -> list[int]:
        """Chaos: mark a node dead, SIGKILL every process on it, and wait until they are gone.

        Returns the process groups killed (one per incarnation the node ran in). The node is
        marked dead first, with the time just before the kill, so a detector sees a dead node
        rather than only its ranks' exits.
        """
        run = self._existing(run_id)
        self.update_nodes(run_id, {node: {"healthy": False, "died_at": _utcnow(), "note": "killed (chaos kill-node)"}})
        # The standby first, so that it cannot fork another launcher on the dead node; its ranks are
        # signalled before anyone waits for the standby to be gone, as they would all die at once.
        self._kill_standbys(run, [node], wait=False)
        groups = [g for k in run.incarnations() for g in self._node_groups(run, k, node)]
        killed = [
            read_json(group.pid_file)["pgid"]
            for group, _ in self._kill_and_wait(groups, timeout=30.0)
            if read_json(group.pid_file)
        ]
        self._kill_standbys(run, [node])
        return killed

    def return_node(self, run_id: str, node: str) -> Inventory:
        """A repaired node goes back to the pool as a healthy spare."""
        inventory = self.update_nodes(
            run_id, {node: {"healthy": True, "died_at": None, "role": "spare", "note": "returned"}}
        )
        if any(lock_is_held(lock) for lock in (self.run_dir(run_id).root / "standby").glob("*/lock")):
            self.ensure_standbys(run_id)  # the run is live: warm the returned spare now, not at the next fault
        return inventory

    def live_pids(self, run_id: str) -> list[int]:
        """Pids of every live process of the run with a pid record (launchers and ranks, any incarnation)."""
        run = self.run_dir(run_id)
        pids = []
        for k in run.incarnations():
            for group in self._node_groups(run, k):
                for lock, pid_file in [(group.lock, group.pid_file)] + [
                    (lock, run.pid_file(k, r)) for r, lock in group.rank_locks
                ]:
                    record = read_json(pid_file)
                    if lock_is_held(lock) and record:
                        pids.append(record["pid"])
        return pids

    def await_checkpoint_in_flight(self, run_id: str, incarnation: int, grace: float) -> tuple[int | None, bool]:
        """If a checkpoint was being written when the fault hit, give it `grace` seconds to commit
        while a rank of the incarnation lives (RunFiles.wait_for_commit)."""
        ranks = range(self.assignment(run_id, incarnation).layout.world_size)
        run = self._existing(run_id)
        return self.wait_for_commit(
            run_id, grace, lambda: any(lock_is_held(run.lock_file(incarnation, r)) for r in ranks)
        )

    def quarantine(self, run_id: str, nodes: list[str], reason: str) -> None:
        """Hold the nodes out of the run and its spare pool (drain, after a fault)."""
        self.update_nodes(run_id, {node: {"role": "quarantined", "note": reason} for node in nodes})
