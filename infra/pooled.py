"""The run state of the backends whose nodes come from the store's pool (infra/pool.py): the local
backend's processes and the simulated backend's records. A run holds its active nodes, quarantines
what failed, and claims free nodes as spares, whatever the other runs of the pool do at the same
time. What a node runs is the backend's: the hooks here (a node's warm standbys) do nothing."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from lazarus.infra.backend import ClusterError, free_port
from lazarus.infra.ownership import OwnerRecords
from lazarus.infra.ownership_rows import StoreOwnerRecords
from lazarus.infra.pool import NodePool, open_pool
from lazarus.infra.pool_import import import_old_pool
from lazarus.infra.runfiles import RunFiles
from lazarus.infra.store import Store, default_url, open_store
from lazarus.schema.contract import ENV_NODE, ENV_RUN_DIR
from lazarus.schema.health_checks import run_check
from lazarus.schema.pool import SpareWant
from lazarus.schema.records import Assignment, Inventory
from lazarus.schema.run import RunSpec
from lazarus.schema.rundir import RunDir


class PooledRunFiles(RunFiles):
    """Runs under `runs/<run_id>` (RunFiles) whose nodes come from the pool of the store at `store` (a
    URL, infra/store; None: the home's own SQLite file)."""

    vets_spares = True  # a spare's health check runs on this machine, where its ranks would

    @classmethod
    def open(cls, options):
        """The backend on options.home and options.store (a BackendOptions, infra/registry.py), its
        store reached: StoreError or StoreURLError, one line, where it cannot be."""
        cluster = cls(options.home, store=options.store, runs=options.runs)
        cluster.pool  # noqa: B018 - opened now, so that a worker with a wrong store says so as it starts
        return cluster

    def __init__(self, home: str | Path, store: str | None = None, runs: str | Path | None = None):
        super().__init__(home, runs)
        self.store_url = store or default_url(self.home)

    @functools.cached_property
    def store(self) -> Store:
        """The store of the pool, opened (its tables made, a home's old pool file imported) when first
        needed: a backend made and not used writes nothing."""
        store = open_store(self.store_url)
        import_old_pool(store, self.home)
        return store

    @functools.cached_property
    def _owners(self) -> OwnerRecords:
        # In the store, beside the pool, which every controller of the fleet shares.
        return StoreOwnerRecords(self.store)

    @functools.cached_property
    def pool(self) -> NodePool:
        """The pool of the runs' nodes, in the store; its standbys' markers beside the runs' folder."""
        return open_pool(self.store, self.runs.parent)

    def create(self, run_id: str, spec: RunSpec) -> RunDir:
        """Create the run's directory and spec, and give it its active nodes from the pool (adding
        nodes where the pool has too few free, and hot spares until `cluster.spare_nodes` are
        free); a second call finds them and checks the spec."""
        run = self.run_dir(run_id)
        if run.spec_file.exists():
            return self.write_spec(run_id, spec)  # checks that it is the same spec
        run.root.mkdir(parents=True, exist_ok=True)
        self.pool.provision(run_id, spec.cluster.active_nodes, spec.cluster.spare_nodes)
        unknown = sorted({f.node for f in spec.faults if self.pool.node(f.node) is None})
        if unknown:
            self.pool.release(run_id)
            raise ClusterError(
                f"faults.node: {', '.join(unknown)} is not a node of the pool of {self.store.url} "
                "(`lazarus pool` lists them)"
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
        return {name: died or datetime.now(UTC) for name, died in self.pool.dead_among(assignment.nodes).items()}

    def update_nodes(self, run_id: str, changes: dict[str, dict]) -> Inventory:
        """Apply health changes (healthy, died_at, note) to named nodes of the pool; returns the run's inventory."""
        self._existing(run_id)
        self.pool.set_health(changes)
        return self.pool.inventory(run_id)

    def rendezvous_port(self, run_id: str) -> int:
        """A free port of this machine: every incarnation's ranks run here."""
        return free_port()

    def claimed_assignment(self, run_id: str, incarnation: int) -> Assignment | None:
        """The incarnation's assignment as the pool recorded it with its claim (the file comes after;
        a run claimed before the store kept claims has the file alone)."""
        self._existing(run_id)
        return self.pool.claimed(run_id, incarnation) or self.assignment(run_id, incarnation)

    def commit_assignment(
        self, run_id: str, assignment: Assignment, claims: Sequence[str] = (), releases: Sequence[str] = ()
    ) -> Assignment:
        """Record an incarnation's assignment, claim the nodes it uses and release leftover nodes to
        the pool, exactly once, whatever other runs of the home do at the same time.

        In one transaction of the store: if the incarnation already claimed its nodes (an earlier
        attempt did), that assignment is returned and its claims completed; otherwise every node
        must be free and healthy or already the run's. The claim is recorded with the assignment,
        and the assignment's file written after: an attempt killed between the two leaves a claim
        the run's retry finds and completes.
        """
        run = self._existing(run_id)
        recorded = self.assignment(run_id, assignment.incarnation)  # a run claimed before the store kept claims
        claimed = self.pool.claim(run_id, recorded or assignment, list(releases))
        if recorded is None:
            claimed = self.record_assignment(run_id, claimed)
        self._drop_standbys_off(run)
        return claimed

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
        that fails it leaves the pool (NodePool.reject_spare). Returns why it failed; None when it
        passed or the run has no check."""
        run, checks = self._existing(run_id), self.spec(run_id).health
        held = self.pool.node(node)
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
        runs = self.runs
        return [RunDir(path) for path in sorted(runs.iterdir())] if runs.is_dir() else []

    # --- what a node runs: the backend's (no standbys here) -------------------------------

    def _kill_standbys_on(self, nodes: list[str], wait: bool = True) -> None:
        """End every run's standby on these nodes."""

    def _drop_standbys_off(self, run: RunDir) -> None:
        """End the run's standbys on nodes another run holds now (it may have claimed them)."""

    def _warm_returned(self) -> None:
        """A node came back to the pool: the live runs that keep standbys warm it."""
