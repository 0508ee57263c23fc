"""The local backend: each node is a group of rank processes on this machine.

The nodes form one pool per home (infra/pool.py), shared by every run of that home: a run holds
its active nodes, quarantines what failed, and claims free nodes as spares (infra/pooled.py, whose
standby hooks this backend fills). Everything else a
restarted worker needs lives in the run directory: each incarnation's assignment and launch
record, and per process a liveness lock and a pid record (infra/processes.py). Nodes get warm
standbys (infra/standbys.py) when the spec asks for them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from lazarus.infra.backend import Observation
from lazarus.infra.backends.local import chaos
from lazarus.infra.pooled import PooledRunFiles
from lazarus.infra.processes import (
    any_exit,
    kill_and_wait,
    live_pids,
    node_groups,
    open_pidfds,
    start_locked,
)
from lazarus.infra.standbys import any_standby_alive, ensure_standbys, kill_standbys, order_launchers, order_prefetch
from lazarus.infra.survivors import await_followers, survivor_holders
from lazarus.schema.contract import (
    LaunchRecord,
    Rejoin,
    SurvivorSource,
    launcher_env,
)
from lazarus.schema.files import lock_is_held
from lazarus.schema.policy import RecoveryPolicy
from lazarus.schema.records import Assignment
from lazarus.schema.rundir import RunDir


class LocalCluster(PooledRunFiles):
    """Runs' nodes as rank processes on this machine, with state under `home/runs/<run_id>`."""

    backend = "local"
    quick_observe = True  # the run directory's files and the pool's record
    shares_host = True  # the ranks are this machine's processes
    keeps_survivors = True  # a survivor node's launcher follows its ranks (trainer/agent/follow.py)
    shares_paths = True

    def __init__(
        self, home: str | Path, python: str = sys.executable, store: str | None = None, runs: str | Path | None = None
    ):
        super().__init__(home, store, runs)
        self.python = python  # the interpreter that runs the node launchers and standbys
        # Processes this object started, reaped as they end so they do not linger as zombies;
        # after a restart the lock files tell liveness.
        self._children: list[subprocess.Popen] = []

    def _kill_standbys_on(self, nodes: list[str], wait: bool = True) -> None:
        """End every run's standby on these nodes (a spare of the pool may have one per run)."""
        for run in self._runs():
            kill_standbys(run, [n for n in nodes if run.standby(n).is_dir()], wait=wait)

    def _drop_standbys_off(self, run: RunDir) -> None:
        """Standbys the run keeps on nodes another run now holds would only idle."""
        kept = self.pool.nodes([d.name for d in run.standbys()])
        taken = [
            name for name, node in kept.items() if node.owner not in (None, run.root.name) and node.role == "active"
        ]
        kill_standbys(run, taken, wait=False)

    def _warm_returned(self) -> None:
        """Every live run of the pool may take the returned spare: each warms it now, not when it claims it."""
        for run in self._runs():
            if run.spec_file.exists() and any_standby_alive(run):
                self.ensure_standbys(run.root.name)

    # --- rank processes --------------------------------------------------------------

    def start_ranks(
        self,
        run_id: str,
        incarnation: int,
        resume_step: int,
        skipped: dict[int, str] | None = None,
        policy: RecoveryPolicy | None = None,
        survivors: SurvivorSource | None = None,
    ) -> LaunchRecord:
        """Start every rank of an incarnation that is not running (through the warm standbys when
        the spec has them); returns the launch record in force. Local processes need nothing of
        `policy`."""
        run, assignment = self._incarnation(run_id, incarnation)
        record = self.record_launch(run_id, incarnation, resume_step, skipped, survivors)
        self._start_nodes(run_id, run, assignment, record.resume_step, range(len(assignment.nodes)))
        return record

    def _start_nodes(self, run_id: str, run: RunDir, assignment: Assignment, resume_step: int, indexes) -> None:
        """Start the launchers of the assignment's nodes at `indexes`: through their warm standbys
        where the spec has them, else as new processes."""

        def start_cold(index: int) -> None:
            self._start_launcher(run, assignment.incarnation, index, assignment.nodes[index], resume_step)

        if self.spec(run_id).cluster.warm_standby:
            self.ensure_standbys(run_id)  # the spares too, so that they are warm before they are needed
            order_launchers(run, assignment, resume_step, start_cold, indexes=list(indexes))
        else:
            for index in indexes:
                start_cold(index)

    def rejoin_ranks(
        self, run_id: str, incarnation: int, resume_step: int, rejoin: Rejoin, skipped: dict[int, str] | None = None
    ) -> LaunchRecord:
        """Start an incarnation that the survivors of the one before rejoin: its launch record names
        them; once each survivor node's launcher has followed its ranks into it (or FOLLOW_WAIT_SECONDS
        passed), the other nodes start."""
        run, assignment = self._incarnation(run_id, incarnation)
        record = self.record_launch(run_id, incarnation, resume_step, skipped, rejoin=rejoin)
        fresh = await_followers(run, assignment, rejoin)
        self._start_nodes(run_id, run, assignment, record.resume_step, fresh)
        return record

    def _start_launcher(self, run: RunDir, incarnation: int, index: int, node: str, resume_step: int) -> None:
        """Start the launcher of one node unless one runs; it starts the node's ranks (trainer/agent/launcher.py)."""
        env = {**os.environ, **launcher_env(str(run.root), incarnation, node, index, resume_step)}
        child = start_locked(
            [self.python, "-m", "lazarus.trainer.agent.launcher"],
            env,
            run.node_lock_file(incarnation, index),
            run.node_pid_file(incarnation, index),
            run.incarnation(incarnation) / "nodes" / f"{index}.log",
            record={"node": node},
        )
        if child is not None:
            self._children.append(child)

    def ensure_standbys(self, run_id: str) -> None:
        """Give every healthy node of the run (active or spare) a warm standby, if the spec asks for them."""
        run, spec = self._existing(run_id), self.spec(run_id)
        if spec.cluster.warm_standby:
            nodes = [n.name for n in self.inventory(run_id).nodes if n.healthy and n.role != "quarantined"]
            child = ensure_standbys(run, spec, nodes, self.python)
            if child is not None:
                self._children.append(child)

    def release_standbys(self, run_id: str) -> None:
        """Stop the run's warm standbys (it has ended: they would only wait for their idle exit)."""
        kill_standbys(self.run_dir(run_id))
        self._reap()

    def _reap(self) -> None:
        """Collect the exit status of processes that ended, so none lingers as a zombie."""
        self._children = [child for child in self._children if child.poll() is None]

    def observe(self, run_id: str, incarnation: int) -> Observation:
        """Liveness, heartbeat and exit record of every rank of an incarnation, and dead nodes."""
        self._reap()
        run, assignment = self._incarnation(run_id, incarnation)
        observation = self._observation(run, incarnation, self.dead_nodes(assignment))
        launchers = [lock_is_held(run.node_lock_file(incarnation, i)) for i in range(len(assignment.nodes))]
        observation.launchers_alive = sum(launchers)
        observation.nodes = self._nodes(
            run,
            assignment,
            launchers,
            launched=lambda rank: run.pid_file(incarnation, rank).exists(),
            rank_alive=lambda rank: lock_is_held(run.lock_file(incarnation, rank)),
        )
        return observation

    async def wait_for_exit(self, run_id: str, incarnation: int, timeout: float) -> bool:
        """Return once a live rank or launcher of the incarnation exits (True), or after `timeout`
        seconds (False). Each process is watched through a pidfd, so a kill is seen at once
        rather than at the next poll."""
        run = self.run_dir(run_id)
        fds = open_pidfds(run, incarnation) if run.assignment_file(incarnation).exists() else []
        return await any_exit(fds, timeout)

    def await_checkpoint_in_flight(self, run_id: str, incarnation: int, grace: float) -> tuple[int | None, bool]:
        """If a checkpoint was being written when the fault hit, give it `grace` seconds to commit
        while a rank of the incarnation lives (RunFiles.wait_for_commit)."""
        run, assignment = self._incarnation(run_id, incarnation)
        locks = [run.lock_file(incarnation, r) for r in range(assignment.layout.world_size)]
        return self.wait_for_commit(run_id, grace, lambda: any(lock_is_held(lock) for lock in locks))

    def await_survivors(self, run_id: str, incarnation: int, grace: float) -> dict[int, int]:
        """Give the surviving ranks `grace` seconds to save their state and end (RunFiles.wait_for_survivors),
        then have the warm standbys read what their nodes' next ranks will load."""
        run, assignment = self._incarnation(run_id, incarnation)
        locks = [run.lock_file(incarnation, r) for r in range(assignment.layout.world_size)]
        saved = self.wait_for_survivors(run_id, incarnation, grace, lambda: any(lock_is_held(lock) for lock in locks))
        # The standbys read the states while the controller reschedules: off the critical path.
        # Which to read is a hint: the standby checks each file against its manifest, and a rank
        # whose survivor resume names otherwise reads its own.
        found = survivor_holders(run, incarnation, assignment.layout, verify=False) if saved else None
        if found is not None and self.spec(run_id).cluster.warm_standby:
            order_prefetch(run, assignment, self.pool.inventory(run_id), found[1], self._standby_sender(run))
        return saved

    def _standby_sender(self, run: RunDir) -> Callable[[str, dict], object] | None:
        """How an order reaches a node's standby, `send(node, order)`: None for the FIFO in its folder."""
        return None

    def stop_incarnation(self, run_id: str, incarnation: int) -> list[int]:
        """SIGKILL every process of an incarnation (launchers and ranks) and wait until none is alive;
        returns the ranks that were alive.

        The `ended` marker is written first: a launcher started after this (a standby answering
        late) must not run, and a late checkpoint commit of the incarnation does not count.
        """
        run, _ = self._incarnation(run_id, incarnation)
        run.end(incarnation)
        killed = kill_and_wait(node_groups(run, incarnation))
        self._reap()
        return sorted(rank for _, ranks, _ in killed for rank in ranks)

    def stop_nodes(self, run_id: str, incarnation: int, nodes: list[str]) -> list[int]:
        """SIGKILL the incarnation's launchers and ranks on `nodes` and wait until they are gone;
        returns the ranks that were alive."""
        run, _ = self._incarnation(run_id, incarnation)
        killed = kill_and_wait([group for node in nodes for group in node_groups(run, incarnation, node)])
        self._reap()
        return sorted(rank for _, ranks, _ in killed for rank in ranks)

    # --- what the local backend alone does: chaos and clean-up ---------------------------

    def stop_run(self, run_id: str) -> None:
        """SIGKILL every process of every incarnation of a run and wait until none is alive."""
        run = self.run_dir(run_id)
        for k in run.incarnations():
            run.end(k)
        kill_standbys(run)
        kill_and_wait([group for k in run.incarnations() for group in node_groups(run, k)])
        self._reap()

    def kill_node(self, run_id: str, node: str) -> list[int]:
        """Chaos: mark a node dead and SIGKILL every process on it (chaos.kill_node)."""
        return chaos.kill_node(self, run_id, node)

    def kill_domain(self, domain: str) -> dict[str, str | None]:
        """Chaos: every node of a fault domain dies at once (chaos.kill_domain)."""
        return chaos.kill_domain(self, domain)

    def repair_after(self, run_id: str) -> list[str]:
        """Chaos clean-up of an ended run: the pool whole again (chaos.repair_after)."""
        return chaos.repair_after(self, run_id)

    def live_pids(self, run_id: str) -> list[int]:
        """Pids of every live process of the run with a pid record (launchers and ranks, any incarnation)."""
        return live_pids(self.run_dir(run_id))
