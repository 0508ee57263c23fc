"""The contract between controller and trainer, in code: the environment's names and the typed
records of the run directory, each with the one function that writes it and the one that reads it.

trainer/CONTRACT.md says what every variable and file means; this module and schema/rundir.py
(where each file lives) are its only implementation, used by the launcher, the built-in trainer,
the session helper of user scripts and the backends alike.
"""

from __future__ import annotations

import json
from typing import IO, Literal, TypeVar

from pydantic import ConfigDict, Field, ValidationError

from lazarus.schema.base import Record
from lazarus.schema.files import read_text, write_json_atomic, write_once
from lazarus.schema.rundir import RunDir

ENV_RUN_DIR = "LAZARUS_RUN_DIR"
"""The run directory (set for every rank and launcher)."""
ENV_INCARNATION = "LAZARUS_INCARNATION"
"""The launch counter: 0 at start, one more per recovery (set for every rank)."""
ENV_NODE = "LAZARUS_NODE"
"""The name of the node the rank runs on (set for every rank)."""
ENV_RESUME_STEP = "LAZARUS_RESUME_STEP"
"""The step to restore, 0 for a start from scratch; the controller chooses and records it (set for every
rank)."""
ENV_FAIL_AT = "LAZARUS_FAIL_AT"
"""A planned fault on this node (`faults` in the spec): `step:N`, `checkpoint:N`, `survivor_save:N` or
`after:S`, with an optional effect suffix (`:raise`, `:disk_full`, `:stuck`); set only on its node."""
ENV_NODE_INDEX = "LAZARUS_NODE_INDEX"
"""The node's index in its incarnation, for a launcher the backend starts (Kubernetes, Slurm)."""
ENV_STANDBY_NODES = "LAZARUS_STANDBY_NODES"
"""The nodes one forked standby serves, comma-separated (local backend)."""
ENV_STANDBY_LOCK_FDS = "LAZARUS_STANDBY_LOCK_FDS"
"""The descriptors of the standby locks a forked standby inherits, one per node it serves (local backend)."""
ENV_STANDBY_ADDRESS = "LAZARUS_STANDBY_ADDRESS"
"""The address a node's standby listens on for orders, where a FIFO does not cross machines (Kubernetes,
Slurm)."""
ENV_LAUNCHER_LOCKS = "LAZARUS_LAUNCHER_LOCKS"
"""`1`: the launcher takes its node's lock itself, as no parent passed it one (Slurm)."""


def launcher_env(run_dir: str, incarnation: int, node: str, index: int, resume_step: int) -> dict[str, str]:
    """The contract's environment of a node's launcher, whoever starts it (every backend, and a warm
    standby on an order): the run directory, the incarnation, the node's name and index in it, and
    the step to resume from (trainer/CONTRACT.md). Its ranks see it too."""
    return {
        ENV_RUN_DIR: run_dir,
        ENV_INCARNATION: str(incarnation),
        ENV_NODE: node,
        ENV_NODE_INDEX: str(index),
        ENV_RESUME_STEP: str(resume_step),
    }


Phase = Literal["starting", "joined", "restored", "training", "waiting", "done", "stopped"]


class ContractError(ValueError):
    """A file of the run directory that does not hold the record the contract says."""


class Heartbeat(Record):
    """`incarnations/K/heartbeat/R.json`: a rank's newest progress, rewritten after every step."""

    rank: int = Field(ge=0, description="The rank that wrote it.")
    step: int | None = Field(
        ge=0,
        description=(
            "Newest step the rank completed (the resume step before its first); None when the rank reports that "
            "it lives but not its step (output as heartbeat without a progress pattern)."
        ),
    )
    phase: Phase = Field(
        description=(
            "starting, joined (process group), restored (checkpoint), training, waiting (a survivor at its step "
            "boundary, its process group broken, for the next incarnation: RecoveryPolicy.in_process), done, stopped."
        )
    )
    time: float = Field(description="When it was written (seconds since the epoch).")
    phases: dict[str, float] = Field(
        default_factory=dict, description="When this rank first reported each phase (seconds since the epoch)."
    )
    first_step_at: float | None = Field(
        default=None, description="When this process completed its first step (seconds since the epoch); None before."
    )
    first_step: int | None = Field(
        default=None,
        ge=0,
        description=(
            "The first step this process completed (so it restored the step before; 0 from a script that counts "
            "from 0, such as a progress bar's 0/N); None before."
        ),
    )
    advanced_at: float | None = Field(
        default=None,
        description=(
            "When the rank's output first named a step above its first (seconds since the epoch): for a script "
            "whose output shows the restored count before it trains (a progress bar's 10/40 after a restore), "
            "when the first step past the restore was done. None before, and where the rank reports for itself."
        ),
    )
    by: Literal["rank", "launcher"] = Field(
        default="rank",
        description="Who wrote it: the rank (lazarus.session, the built-in trainer) or its launcher, from its output.",
    )
    warning: str | None = Field(
        default=None,
        description=(
            "Something the operator should know though the rank trains on, such as a checkpoint lost to a full "
            "disk; the newest one the rank had, None when none."
        ),
    )
    compute_seconds: float | None = Field(
        default=None,
        ge=0,
        description=(
            "How long the rank's own work on its newest step took, before it waited for its peers in the step's "
            "collective (seconds): a node slower than its peers shows here, while every rank's step time is the "
            "slowest's. None from writers that do not measure it."
        ),
    )
    alive_at: float | None = Field(
        default=None,
        description=(
            "When the rank's process last ran (seconds since the epoch), rewritten by a thread of its own every "
            "heartbeat interval even while a step waits in a collective: of ranks whose steps stall, the one whose "
            "process stopped (a hung or cut-off host) is the one to blame. None from writers without that thread."
        ),
    )


class RankExit(Record):
    """`incarnations/K/exit/R.json`: how a rank ended; the rank writes it, else its launcher."""

    rank: int = Field(ge=0, description="The rank.")
    code: int = Field(description="Exit code; negative when a signal ended the process (as Popen reports it).")
    step: int | None = Field(ge=0, description="Newest step the rank completed; None when it reported none.")
    time: float = Field(description="When it ended (seconds since the epoch).")
    error: str = Field(default="", description="Last line of the exception that ended it, if any.")
    signal: str | None = Field(default=None, description="The signal that ended it, e.g. SIGKILL.")
    by: Literal["rank", "launcher"] = Field(default="rank", description="Who wrote the record.")


class RankObservation(Record):
    """One rank as its node's launcher sees it (schema/node_reports.py NodeReport), or as a
    backend's look found it from the rank's own files."""

    rank: int = Field(ge=0, description="The rank.")
    node: str = Field(description="The node that hosts it.")
    launched: bool = Field(description="Its launcher started it (or recorded that it could not).")
    alive: bool = Field(description="Its process runs.")
    heartbeat: Heartbeat | None = Field(default=None, description="Its newest heartbeat; None before its first.")
    exit: RankExit | None = Field(default=None, description="How it ended; None while it runs.")
    launcher_alive: bool = Field(
        default=False, description="The launcher of its node runs (it writes the exit record of a rank it outlives)."
    )
    idle_since: float | None = Field(
        default=None,
        description=(
            "Since when its process (every thread, and the processes it started) has used next to no CPU (under 2% "
            "of a core: threads that wake now and then) and its log has not changed, as its node's launcher samples "
            "it (trainer/agent/idle.py), in seconds since the epoch: the sample that last saw it active, or the first "
            "one; it stays put while the rank stays idle. None where unknown (not started yet, the process is gone, "
            "or no launcher watches it)."
        ),
    )
    held: str | None = Field(
        default=None,
        description=(
            "Its process's state letter where its launcher's last sample of it idle found it unable to run: T "
            "(stopped), t (stopped by a tracer), D (uninterruptible sleep, as on a stuck file system). None where it "
            "runs or waits as a process does, or no launcher watches it."
        ),
    )


class LaunchRecord(Record):
    """`incarnations/K/launch.json`: what the first launch of an incarnation restored, and when."""

    resume_step: int = Field(ge=0, description="Checkpoint step the incarnation restores (0: from scratch).")
    skipped: dict[int, str] = Field(
        default_factory=dict, description="Newer checkpoints not restored, with the reason (incomplete or corrupt)."
    )
    launched_at: float = Field(description="When the first launch started the ranks (seconds since the epoch).")
    survivors: SurvivorSource | None = Field(
        default=None,
        description="Restore the resume step from an earlier incarnation's survivors (None: the checkpoint).",
    )
    rejoin: Rejoin | None = Field(
        default=None,
        description=(
            "The survivors of an earlier incarnation join this one in the processes they kept, and the others "
            "receive the resume step's state from them in memory (None: every rank starts afresh)."
        ),
    )


class Rejoin(Record):
    """How an incarnation starts when the survivors of the one before kept their processes
    (RecoveryPolicy.in_process): they keep their rank numbers, nodes and state; the ranks on the
    replacement nodes are new and take the state from the source replica."""

    incarnation: int = Field(ge=0, description="The incarnation whose survivors wait at their step boundary.")
    ranks: list[int] = Field(description="The survivor ranks that join, in rank order (their numbers stay).")
    source_replica: int = Field(
        ge=0, description="The data-parallel replica (dp coordinate) whose ranks send the state to the new ranks."
    )


class SurvivorSource(Record):
    """Where an incarnation's ranks take the state of its resume step from, instead of a checkpoint:
    the ranks of an earlier incarnation that survived its fault and saved their state."""

    incarnation: int = Field(ge=0, description="The incarnation whose survivors saved the state.")
    ranks: dict[int, int] = Field(
        description="Each rank of this incarnation -> the survivor rank at the same (pp, dp_shard, tp) it loads."
    )


class SurvivorManifest(Record):
    """`incarnations/K/survivors/R.json`: rank R's state file after the last step it completed when
    incarnation K's collectives broke; written after the file, and only while K was not ended."""

    step: int = Field(ge=0, description="Optimizer steps the saved state has taken.")
    coordinates: dict[str, int] = Field(description="The rank's mesh coordinates: {dp, pp, dp_shard, tp}.")
    size: int = Field(ge=0, description="Size of the state file (bytes).")
    sha256: str = Field(description="SHA-256 of the state file, hex.")
    time: float = Field(description="When it was written (seconds since the epoch).")

    def place(self) -> tuple[int, int, int]:
        """The (pp, dp_shard, tp) coordinates: what any replica's rank there holds the same of."""
        return self.coordinates["pp"], self.coordinates["dp_shard"], self.coordinates["tp"]


class MetricsLine(Record):
    """One line of `metrics.jsonl`: rank 0's report of an optimizer step; a script's own metrics ride along."""

    model_config = ConfigDict(extra="allow")

    step: int = Field(ge=1, description="The optimizer step.")
    loss: float = Field(description="Loss of the global batch at that step.")
    incarnation: int = Field(ge=0, description="Incarnation that trained it; redone steps appear again under the next.")
    dp: int = Field(ge=1, description="Data-parallel degree it trained with (replicas).")


_R = TypeVar("_R", bound=Record)


def _parsed(model: type[_R], text: str | None, where) -> _R | None:
    if text is None:
        return None
    try:
        return model.model_validate_json(text)
    except ValidationError as error:
        raise ContractError(f"{where}: not a {model.__name__} ({error.errors()[0]['msg']})") from None


def write_heartbeat(run: RunDir, incarnation: int, beat: Heartbeat) -> None:
    """Replace the rank's heartbeat (atomically: a reader sees the old one or the new)."""
    write_json_atomic(run.heartbeat_file(incarnation, beat.rank), beat.model_dump_json())


def read_heartbeat(run: RunDir, incarnation: int, rank: int) -> Heartbeat | None:
    """The rank's newest heartbeat; None before its first."""
    path = run.heartbeat_file(incarnation, rank)
    return _parsed(Heartbeat, read_text(path), path)


def write_exit(run: RunDir, incarnation: int, ended: RankExit) -> bool:
    """Record how a rank ended, unless it already is (the rank's own record wins over its
    launcher's); True if this call wrote it."""
    return write_once(run.exit_file(incarnation, ended.rank), ended.model_dump_json())


def read_exit(run: RunDir, incarnation: int, rank: int) -> RankExit | None:
    """How the rank ended; None while nobody has recorded it."""
    path = run.exit_file(incarnation, rank)
    return _parsed(RankExit, read_text(path), path)


def write_launch(run: RunDir, incarnation: int, proposed: LaunchRecord) -> LaunchRecord:
    """Record the incarnation's launch unless one is recorded; returns the record in force, so a
    retried launch restores the same checkpoint as the ranks the first attempt may have started."""
    write_once(run.launch_file(incarnation), proposed.model_dump_json())
    in_force = read_launch(run, incarnation)
    assert in_force is not None, "written once just above, never removed"
    return in_force


def read_launch(run: RunDir, incarnation: int) -> LaunchRecord | None:
    """The incarnation's launch record; None before its first launch."""
    path = run.launch_file(incarnation)
    return _parsed(LaunchRecord, read_text(path), path)


def write_survivor(run: RunDir, incarnation: int, rank: int, manifest: SurvivorManifest) -> bool:
    """Record a survivor's saved state, last; False, writing nothing, once the controller has
    ended the incarnation (the fence every checkpoint commit has)."""
    if run.ended_file(incarnation).exists():
        return False
    write_json_atomic(run.survivor_manifest(incarnation, rank), manifest.model_dump_json())
    return True


def read_survivor(run: RunDir, incarnation: int, rank: int) -> SurvivorManifest | None:
    """What survivor `rank` of the incarnation saved; None if it saved nothing that counts (no
    manifest, or one written after the controller ended the incarnation: RunDir.counted_survivors)."""
    counted = run.counted_survivors(incarnation)
    return _survivor(run, incarnation, rank) if counted is None or rank in counted else None


def _survivor(run: RunDir, incarnation: int, rank: int) -> SurvivorManifest | None:
    path = run.survivor_manifest(incarnation, rank)
    return _parsed(SurvivorManifest, read_text(path), path)


def read_survivors(run: RunDir, incarnation: int, world_size: int) -> dict[int, SurvivorManifest]:
    """The survivors of an incarnation that saved their state (and count: read_survivor): rank -> its manifest."""
    counted = run.counted_survivors(incarnation)
    ranks = range(world_size) if counted is None else sorted(r for r in counted if r < world_size)
    found = {rank: _survivor(run, incarnation, rank) for rank in ranks}
    return {rank: manifest for rank, manifest in found.items() if manifest is not None}


class MetricsLog:
    """Rank 0's writer of metrics.jsonl: one line per optimizer step, flushed as it is written."""

    def __init__(self, run: RunDir):
        self._file: IO[str] = open(run.metrics_file, "a")

    def append(self, line: MetricsLine) -> None:
        self._file.write(line.model_dump_json() + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(run: RunDir) -> list[MetricsLine]:
    """Every complete line of metrics.jsonl, oldest first (none before the first step)."""
    text = read_text(run.metrics_file) or ""
    complete = text[: text.rfind("\n") + 1]  # a line being written has no newline yet
    lines = []
    for number, line in enumerate(complete.splitlines(), start=1):
        try:
            lines.append(MetricsLine.model_validate(json.loads(line)))
        except (json.JSONDecodeError, ValidationError) as error:
            raise ContractError(f"{run.metrics_file} line {number}: not a MetricsLine ({error})") from None
    return lines
