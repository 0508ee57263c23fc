"""The run state of the backends whose nodes come from one pool per home (infra/pool.py): the local
backend's processes and the simulated backend's records. A run holds its active nodes, quarantines
what failed, and claims free nodes as spares, whatever the other runs of the home do at the same
time. What a node runs is the backend's: the hooks here (a node's warm standbys) do nothing."""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from lazarus.infra.backend import ClusterError, free_port
from lazarus.infra.pool import LocalPool, claim_and_release
from lazarus.infra.runfiles import RunFiles
from lazarus.schema.contract import ENV_NODE, ENV_RUN_DIR
from lazarus.schema.health_checks import run_check
from lazarus.schema.pool import PoolRecord, SpareWant
from lazarus.schema.records import Assignment, Inventory
from lazarus.schema.run import RunSpec
from lazarus.schema.rundir import RunDir


class PooledRunFiles(RunFiles):
    """Runs under `home/runs/<run_id>` whose nodes come from the home's pool."""

    vets_spares = True  # a spare's health check runs on this machine, where its ranks would

    def __init__(self, home: str | Path):
        super().__init__(home)
        self.pool = LocalPool(self.home)

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
        self._drop_standbys_off(run, {n.name for n in self.pool.inventory(run_id).nodes})
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
        self._warm_returned()
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

    def _runs(self) -> list[RunDir]:
        runs = self.home / "runs"
        return [RunDir(path) for path in sorted(runs.iterdir())] if runs.is_dir() else []

    # --- what a node runs: the backend's (no standbys here) -------------------------------

    def _kill_standbys_on(self, nodes: list[str], wait: bool = True) -> None:
        """End every run's standby on these nodes."""

    def _drop_standbys_off(self, run: RunDir, held: set[str]) -> None:
        """End the run's standbys on nodes it no longer holds (another run may have claimed them)."""

    def _warm_returned(self) -> None:
        """A node came back to the pool: the live runs that keep standbys warm it."""
