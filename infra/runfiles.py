"""What every backend keeps in the run directory, whoever runs the ranks: the spec, each
incarnation's assignment and launch record, what each rank reported, logs and checkpoints.

The backends (infra/backends/local/, infra/backends/kubernetes/) build on RunFiles, so the part
of an observation that comes from files, and the preamble of every call about an incarnation, are
written once here.
"""

from __future__ import annotations

import functools
import shutil
import time
from datetime import datetime
from pathlib import Path
from typing import Generic, TypeVar

from lazarus.infra.backend import ClusterError, Observation, RankObservation
from lazarus.infra.ownership import FileOwnerRecords, OwnerRecords
from lazarus.infra.stacks import STACKS_WAIT_SECONDS, capture_stacks
from lazarus.schema.contract import (
    LaunchRecord,
    Rejoin,
    SurvivorSource,
    read_exit,
    read_heartbeat,
    read_launch,
    read_survivors,
    write_launch,
)
from lazarus.schema.files import write_json_atomic, write_once
from lazarus.schema.names import check_run_id
from lazarus.schema.node_reports import NodeReading, read_node_reports
from lazarus.schema.records import Assignment
from lazarus.schema.run import RunSpec
from lazarus.schema.rundir import RunDir

K = TypeVar("K")
V = TypeVar("V")


class Kept(Generic[K, V]):
    """What a backend keeps of records that never change once written, the oldest dropped past
    `size` entries (a worker serves runs for months)."""

    def __init__(self, size: int = 20_000):
        self.size = size
        self._entries: dict[K, V] = {}

    def get(self, key: K) -> V | None:
        return self._entries.get(key)

    def __contains__(self, key: K) -> bool:
        return key in self._entries

    def keep(self, key: K, value: V) -> V:
        """Keep `value` under `key`; returns it."""
        if len(self._entries) >= self.size:
            del self._entries[next(iter(self._entries))]
        self._entries[key] = value
        return value


COMMIT_POLL_SECONDS = 0.02
"""How often drain looks for the commit marker of a checkpoint in flight (seconds)."""


class RunFiles:
    """Run directories under `runs/<run_id>` (`runs`: by default `home/runs`)."""

    keeps_survivors = False
    """Whether survivors may keep their processes at a recovery (rejoin_ranks): the backend starts an
    incarnation's launchers on some nodes only, and a survivor node's launcher follows its ranks."""

    records_stages = False
    quick_observe = False
    shares_host = False
    shares_paths = False
    quarantines_in_cluster = False

    @classmethod
    def open(cls, options):
        """The backend on options.home and options.runs (a BackendOptions, infra/registry.py)."""
        return cls(options.home, runs=options.runs)

    @classmethod
    def placement(cls, cluster) -> str:
        """Where a run's nodes are, as words that follow "N node(s)" ("" for this machine)."""
        return ""

    def __init__(self, home: str | Path, runs: str | Path | None = None):
        self.home = Path(home).resolve()
        # Where the runs' directories live: the home's own, or a folder the workers of a fleet share
        # (each worker has a home of its own: LAZARUS_RUNS).
        self.runs = Path(runs).resolve() if runs is not None else self.home / "runs"
        # What never changes once written, read once: a watch looks at every run a few times a
        # second, and a run's directory, spec, assignments and launch records are the same each time.
        self._run_dirs: Kept[str, RunDir] = Kept()
        self._specs: Kept[str, RunSpec] = Kept()
        self._assignments: Kept[tuple[str, int], Assignment] = Kept()
        self._launches: Kept[tuple[str, int], LaunchRecord] = Kept()

    @property
    def owners(self) -> OwnerRecords:
        """Who may act on each run (infra/ownership.py), made once: in the run's directory, where a
        backend keeps no store that its controllers share."""
        return self._owners

    @functools.cached_property
    def _owners(self) -> OwnerRecords:
        return FileOwnerRecords(self)

    def run_dir(self, run_id: str) -> RunDir:
        """The run's directory (it may not exist yet); ClusterError for a run id that is not one,
        whichever door it came in by: a run's files never land outside the runs' folder."""
        known = self._run_dirs.get(run_id)
        if known is not None:
            return known
        try:
            check_run_id(run_id)
        except ValueError as error:
            raise ClusterError(str(error)) from None
        runs = self.runs
        root = runs / run_id
        # The rule above already refuses separators and `..`; a symlink planted under runs/ is the
        # one way left out, and following it would write another directory's files.
        if root.resolve().parent != runs.resolve():
            raise ClusterError(f"run directory {root} leads outside {runs}")
        return self._run_dirs.keep(run_id, RunDir(root))

    def _existing(self, run_id: str) -> RunDir:
        run = self.run_dir(run_id)
        if run_id not in self._specs and not run.spec_file.exists():
            raise ClusterError(f"no run {run_id!r} under {self.runs}")
        return run

    def _incarnation(self, run_id: str, incarnation: int) -> tuple[RunDir, Assignment]:
        """The run's directory and the incarnation's assignment; ClusterError when either is missing."""
        run = self._existing(run_id)
        assignment = self.assignment(run_id, incarnation)
        if assignment is None:
            raise ClusterError(f"incarnation {incarnation} of run {run_id!r} has no assignment")
        return run, assignment

    def spec(self, run_id: str) -> RunSpec:
        """The run's spec as recorded at launch (read once per run)."""
        spec = self._specs.get(run_id)
        if spec is None:
            spec = self._specs.keep(run_id, RunSpec.model_validate_json(self._existing(run_id).spec_file.read_text()))
        return spec

    def write_spec(self, run_id: str, spec: RunSpec) -> RunDir:
        """Create the run directory with its spec; a second call finds it and checks the spec is the same."""
        run = self.run_dir(run_id)
        run.root.mkdir(parents=True, exist_ok=True)
        if run.spec_file.exists():
            if RunSpec.model_validate_json(run.spec_file.read_text()) != spec:
                raise ClusterError(f"run directory {run.root} belongs to another run with a different spec")
            return run
        write_json_atomic(run.spec_file, spec.model_dump(mode="json"))
        return run

    def claimed_assignment(self, run_id: str, incarnation: int) -> Assignment | None:
        """The incarnation's claimed assignment: here the claim and its record are one write."""
        return self.assignment(run_id, incarnation)

    def assignment(self, run_id: str, incarnation: int) -> Assignment | None:
        """The recorded assignment of an incarnation, if any (written once: read once)."""
        known = self._assignments.get((run_id, incarnation))
        if known is not None:
            return known
        try:
            text = self.run_dir(run_id).assignment_file(incarnation).read_text()
        except FileNotFoundError:
            return None
        return self._assignments.keep((run_id, incarnation), Assignment.model_validate_json(text))

    def launch(self, run: RunDir, incarnation: int) -> LaunchRecord | None:
        """The incarnation's launch record; None before its first launch (written once: read once)."""
        key = (run.root.name, incarnation)
        known = self._launches.get(key)
        if known is None:
            known = read_launch(run, incarnation)
            if known is not None:
                self._launches.keep(key, known)
        return known

    def record_assignment(self, run_id: str, assignment: Assignment) -> Assignment:
        """Write the incarnation's assignment unless one exists; returns the one recorded first."""
        path = self.run_dir(run_id).assignment_file(assignment.incarnation)
        write_once(path, assignment.model_dump_json())
        return Assignment.model_validate_json(path.read_text())

    def record_launch(
        self,
        run_id: str,
        incarnation: int,
        resume_step: int,
        skipped: dict[int, str] | None,
        survivors: SurvivorSource | None = None,
        rejoin: Rejoin | None = None,
    ) -> LaunchRecord:
        """The incarnation's launch record, written by its first launch (a retried launch restores
        the same state as the ranks the first attempt may have started)."""
        proposed = LaunchRecord(
            resume_step=resume_step, skipped=skipped or {}, launched_at=time.time(), survivors=survivors, rejoin=rejoin
        )
        return write_launch(self._existing(run_id), incarnation, proposed)

    def _observation(
        self, run: RunDir, incarnation: int, dead_nodes: dict[str, datetime], addresses: dict[str, str] | None = None
    ) -> Observation:
        """An observation of what the files say (the launch record, what the spec says the ranks
        report) and the dead nodes given; no ranks yet."""
        launch = self.launch(run, incarnation)
        trainer = self.spec(run.root.name).trainer
        return Observation(
            incarnation,
            launch.launched_at if launch else None,
            launch.resume_step if launch else 0,
            dead_nodes=dead_nodes,
            node_addresses=addresses or {},
            steps_from="trainer" if trainer.built_in else "output" if trainer.progress_pattern else None,
            heartbeats_expected=trainer.built_in or trainer.output_is_heartbeat,
        )

    def _nodes(
        self, run: RunDir, assignment: Assignment, launchers: list[bool], launched, rank_alive=None
    ) -> list[NodeReading]:
        """Every node's ranks: from its report where the node's launcher runs (one read a node),
        else from each rank's own files, with the backend's view of the rank (`launched(rank)`,
        `rank_alive(rank)`; None where it sees only the launcher)."""
        k, per_node = assignment.incarnation, assignment.layout.ranks_per_node
        reports = read_node_reports(run, k, [i for i, alive in enumerate(launchers) if alive])
        nodes: list[NodeReading] = []
        for index, launcher_alive in enumerate(launchers):
            report = reports.get(index)
            nodes.append(
                report
                if report is not None
                else NodeReading.of_ranks(
                    [
                        self._rank(
                            run, assignment, r, launched(r), rank_alive(r) if rank_alive else None, launcher_alive
                        )
                        for r in range(index * per_node, (index + 1) * per_node)
                    ]
                )
            )
        return nodes

    @staticmethod
    def _rank(
        run: RunDir, assignment: Assignment, rank: int, launched: bool, alive: bool | None, launcher_alive: bool
    ) -> RankObservation:
        """A rank as its files say, with the backend's view of its processes: `alive` whether the
        rank's own process runs, or None where the backend sees only its node's launcher (then a
        rank lives while its launcher does and it has no exit record). A rank with an exit record
        was launched, if only to fail (its launcher records a command it could not start)."""
        ended = read_exit(run, assignment.incarnation, rank)
        return RankObservation(
            rank=rank,
            node=assignment.nodes[assignment.layout.node_of_rank(rank)],
            launched=launched or ended is not None,
            alive=alive if alive is not None else launcher_alive and ended is None,
            heartbeat=read_heartbeat(run, assignment.incarnation, rank),
            exit=ended,
            launcher_alive=launcher_alive,
        )

    def log_tail(self, run_id: str, incarnation: int, rank: int, lines: int = 20) -> str:
        """The last lines of a rank's log ('' if it has none)."""
        path = self.run_dir(run_id).log_file(incarnation, rank)
        try:
            with open(path, "rb") as handle:
                handle.seek(max(0, path.stat().st_size - 16384))
                text = handle.read().decode(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def capture_stacks(
        self, run_id: str, incarnation: int, ranks: list[int] | None = None, wait_seconds: float = STACKS_WAIT_SECONDS
    ) -> dict[int, str]:
        """Each running rank's Python stacks, dumped now (infra/stacks.py): asked through the run
        directory and carried out by each node's launcher beside its ranks, so it needs no access
        to their processes from here."""
        return capture_stacks(self._existing(run_id), incarnation, ranks, wait_seconds)

    def wait_for_commit(self, run_id: str, grace: float, alive) -> tuple[int | None, bool]:
        """If a checkpoint was being written when the fault hit, give it `grace` seconds to commit
        while `alive()` (some rank of the incarnation still runs).

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
        while step not in run.checkpoint_steps():
            if not alive() or time.monotonic() > deadline:
                return step, False
            time.sleep(COMMIT_POLL_SECONDS)
        return step, True

    def wait_for_survivors(self, run_id: str, incarnation: int, grace: float, alive) -> dict[int, int]:
        """Give the ranks that outlived the fault `grace` seconds to save their state and end while
        `alive()` (some rank of the incarnation still runs); returns rank -> the step each saved.

        The built-in trainer's ranks save and exit as soon as a collective breaks, so the wait
        usually ends within a few tens of milliseconds of the fault; a hung rank costs the grace.
        """
        run, assignment = self._incarnation(run_id, incarnation)
        deadline = time.monotonic() + grace
        while alive() and time.monotonic() < deadline:
            time.sleep(COMMIT_POLL_SECONDS)
        saved = read_survivors(run, incarnation, assignment.layout.world_size)
        return {rank: manifest.step for rank, manifest in saved.items()}

    def remove_partial_checkpoints(self, run_id: str) -> list[int]:
        """Delete checkpoint folders that never got their commit marker; returns their steps.

        Called only once nothing can still be writing them: no rank of the run is alive, or every
        live one waits at its step boundary, its save in flight given up (RecoveryPolicy.in_process).
        """
        run = self._existing(run_id)
        complete = set(run.checkpoint_steps())
        partial = [s for s in run.checkpoint_steps(complete_only=False) if s not in complete]
        for step in partial:
            for folder in run.checkpoint_folders(step):
                shutil.rmtree(folder, ignore_errors=True)
        return partial

    def remove_stale_survivors(self, run_id: str, incarnation: int) -> list[int]:
        """Delete the survivors' states of incarnations before `incarnation`; returns those incarnations.

        Only the survivors of the incarnation a fault ended are ever restored, into the next one,
        whose ranks have read them once it faults in turn: drain of `incarnation` calls this.
        """
        run = self._existing(run_id)
        stale = [k for k in run.incarnations() if k < incarnation and run.survivors(k).is_dir()]
        for k in stale:
            shutil.rmtree(run.survivors(k), ignore_errors=True)
        return stale

    def close(self) -> None:
        """Release what the backend holds for its lifetime (the Kubernetes backend's watches); nothing here."""

    def rejoin_ranks(
        self, run_id: str, incarnation: int, resume_step: int, rejoin: Rejoin, skipped: dict[int, str] | None = None
    ) -> LaunchRecord:
        """Start an incarnation that the survivors of the one before rejoin (keeps_survivors)."""
        raise ClusterError("this backend restarts every rank at a recovery: it cannot keep survivors")

    def record_stage(self, run_id: str, stage: str, message: str) -> None:
        """Note a recovery stage where the cluster's own tools show it (Kubernetes: an Event); here nothing."""
