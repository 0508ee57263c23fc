"""The local backend: each node is a group of rank processes on this machine.

The nodes form one pool per home (infra/pool.py), shared by every run of that home: a run holds
its active nodes, quarantines what failed, and claims free nodes as spares. Everything else a
restarted worker needs lives in the run directory: each incarnation's assignment and launch
record, and per process a liveness lock and a pid record (infra/processes.py). Nodes get warm
standbys (infra/standbys.py) when the spec asks for them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

from lazarus.infra.backend import ClusterError, Observation, free_port
from lazarus.infra.backends.local import chaos
from lazarus.infra.pool import LocalPool, claim_and_release
from lazarus.infra.processes import (
    any_exit,
    kill_and_wait,
    live_pids,
    node_groups,
    open_pidfds,
    start_locked,
)
from lazarus.infra.runfiles import RunFiles
from lazarus.infra.standbys import any_standby_alive, ensure_standbys, kill_standbys, order_launchers, order_prefetch
from lazarus.infra.survivors import await_followers, survivor_holders
from lazarus.schema.contract import (
    ENV_NODE,
    ENV_RUN_DIR,
    LaunchRecord,
    Rejoin,
    SurvivorSource,
    launcher_env,
)
from lazarus.schema.files import lock_is_held
from lazarus.schema.health_checks import run_check
from lazarus.schema.policy import RecoveryPolicy
from lazarus.schema.pool import PoolRecord, SpareWant
from lazarus.schema.records import Assignment, Inventory
from lazarus.schema.run import RunSpec
from lazarus.schema.rundir import RunDir


class LocalCluster(RunFiles):
    """Runs' nodes as rank processes on this machine, with state under `home/runs/<run_id>`."""

    backend = "local"
    quick_observe = True  # the run directory's files and the pool's record
    vets_spares = True  # a spare's health check runs here, where its ranks would
    shares_host = True  # the ranks are this machine's processes
    keeps_survivors = True  # a survivor node's launcher follows its ranks (trainer/agent/follow.py)
    shares_paths = True

    def __init__(self, home: str | Path, python: str = sys.executable):
        super().__init__(home)
        self.python = python  # the interpreter that runs the node launchers and standbys
        self.pool = LocalPool(self.home)
        # Processes this object started, reaped as they end so they do not linger as zombies;
        # after a restart the lock files tell liveness.
        self._children: list[subprocess.Popen] = []

    # --- run state: the run's nodes come from the home's pool (infra/pool.py) ------------

    def create(self, run_id: str, spec: RunSpec) -> RunDir:
        """Create the run's directory and spec, and give it its active nodes from the pool (adding
        nodes where the pool has too few free, and hot spares until `cluster.spare_nodes` are
        free); a second call finds them and checks the spec."""
        run = self.run_dir(run_id)
        if run.spec_file.exists():
            return self.write_spec(run_id, spec)  # checks that it is the same spec
        run.root.mkdir(parents=True, exist_ok=True)
        self.pool.provision(run_id, spec.cluster.active_nodes, spec.cluster.spare_nodes)
        pool = self.pool.read()
        unknown = sorted({f.node for f in spec.faults if pool.node(f.node) is None})
        if unknown:
            self.pool.release(run_id)
            raise ClusterError(
                f"faults.node: {', '.join(unknown)} is not a node of the pool under {self.home} "
                f"(it has {pool.nodes[0].name} .. {pool.nodes[-1].name}; `lazarus pool` lists them)"
            )
        # The spec is written last: its presence means the run directory is complete.
        return self.write_spec(run_id, spec)

    def inventory(self, run_id: str) -> Inventory:
        """The run's active nodes, the nodes it quarantined, and the pool's free nodes as its spares."""
        self._existing(run_id)
        cluster = self.spec(run_id).cluster
        return self.pool.inventory(run_id, allowance=cluster.active_nodes + cluster.spare_nodes)

    def dead_nodes(self, assignment: Assignment) -> dict[str, datetime]:
        """The assignment's nodes the pool has seen die, and when."""
        mine = set(assignment.nodes)
        return {name: died or datetime.now(UTC) for name, died in self.pool.unhealthy().items() if name in mine}

    def update_nodes(self, run_id: str, changes: dict[str, dict]) -> Inventory:
        """Apply health changes (healthy, died_at, note) to named nodes of the pool; returns the run's inventory."""
        self._existing(run_id)
        return self.pool.inventory(run_id, self.pool.set_health(changes))

    def rendezvous_port(self, run_id: str) -> int:
        """A free port of this machine: every incarnation's ranks run here."""
        return free_port()

    def commit_assignment(
        self, run_id: str, assignment: Assignment, claims: Sequence[str] = (), releases: Sequence[str] = ()
    ) -> Assignment:
        """Record an incarnation's assignment, claim the nodes it uses and release leftover nodes to
        the pool, exactly once, whatever other runs of the home do at the same time.

        Under the pool's lock: if the incarnation already has an assignment (an earlier attempt
        wrote it), that one is returned and its claims completed; otherwise every node must be
        free and healthy or already the run's. The claim is written before the assignment, so
        an attempt killed between the two leaves nodes the run's retry finds its own.
        """
        run = self._existing(run_id)
        key, why = (run_id, assignment.incarnation), f"incarnation {assignment.incarnation}"
        assigning = self.pool.assigning

        def claim(pool: PoolRecord) -> Assignment:
            # An attempt whose claim went into this same commit has not written its assignment yet.
            recorded = self.assignment(run_id, assignment.incarnation) or assigning.get(key)
            if recorded is not None:
                claim_and_release(pool, run_id, recorded.nodes, list(releases), f"incarnation {recorded.incarnation}")
                return recorded
            claim_and_release(pool, run_id, assignment.nodes, list(releases), why)
            assigning[key] = assignment
            return assignment

        def write(claimed: Assignment) -> Assignment:
            return claimed if claimed is not assignment else self.record_assignment(run_id, assignment)

        recorded = self.pool.change(claim, then=write)
        # Standbys this run keeps on nodes another run now holds would only idle.
        held = {n.name for n in self.pool.inventory(run_id).nodes}
        kill_standbys(run, [d.name for d in run.standbys() if d.name not in held], wait=False)
        return recorded

    def quarantine(self, run_id: str, nodes: list[str], reason: str, counted: bool = True) -> None:
        """Hold the nodes out of every run of the pool (drain, after a fault), and end their
        standbys: a quarantined node runs nothing, even if it comes back to life. The pool's
        quarantine breaker counts them unless not `counted` (QuarantineRefused when it is open)."""
        self._existing(run_id)
        self.pool.quarantine(run_id, nodes, reason, counted)
        self._kill_standbys_on(nodes)

    def vet_spare(self, run_id: str, node: str) -> str | None:
        """Run the run's health check (spec health.command) for a free node before the run claims it,
        as the node's launcher would run it (this machine, the node's name in LAZARUS_NODE); a node
        that fails it leaves the pool (LocalPool.reject_spare). Returns why it failed; None when it
        passed or the run has no check."""
        run, checks = self._existing(run_id), self.spec(run_id).health
        held = self.pool.read().node(node)
        if not self.vets_spares or not checks.command or held is None or held.role != "free":
            return None  # no check; or not a spare (a retried claim's own node): the claim tells
        env = {**os.environ, ENV_RUN_DIR: str(run.root), ENV_NODE: node}
        failure = run_check(checks, cwd=run.work_dir if run.work_dir.is_dir() else None, env=env)
        if failure is not None:
            self.pool.reject_spare(node, f"failed run {run_id}'s health check before it was handed out: {failure}")
            self._kill_standbys_on([node])
        return failure

    def return_node(self, run_id: str, node: str) -> Inventory:
        """A repaired node goes back to the pool as a healthy free spare."""
        self._existing(run_id)
        self.pool.return_node(node)
        # Every live run of the pool may take the spare: each warms it now, not when it claims it.
        for run in self._runs():
            if run.spec_file.exists() and any_standby_alive(run):
                self.ensure_standbys(run.root.name)
        return self.pool.inventory(run_id)

    def want_spares(self, run_id: str, want: SpareWant) -> None:
        """Lodge the run's need of the pool's spares (every run's inventory shows it)."""
        self._existing(run_id)
        self.pool.want(want)

    def drop_want(self, run_id: str) -> None:
        """The run's recovery is over: its want goes."""
        self.pool.drop_want(run_id)

    def release_nodes(self, run_id: str) -> list[str]:
        """The run ended: its active nodes go back to the pool (what it quarantined stays out)."""
        self._existing(run_id)
        return self.pool.release(run_id)

    def _kill_standbys_on(self, nodes: list[str], wait: bool = True) -> None:
        """End every run's standby on these nodes (a spare of the pool may have one per run)."""
        for run in self._runs():
            kill_standbys(run, [n for n in nodes if run.standby(n).is_dir()], wait=wait)

    def _runs(self) -> list[RunDir]:
        runs = self.home / "runs"
        return [RunDir(path) for path in sorted(runs.iterdir())] if runs.is_dir() else []

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
