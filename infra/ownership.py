"""Who may act on a run (schema/ownership.py), recorded where every controller that serves it reads it.

`hold` is what every activity calls before it acts: it lets the owner through (recording a
later run of its chain as the owner), records the first execution that acts on a run without
an owner, and refuses everyone else with NotOwner. `take_over` is the one way a run changes
hands otherwise: the caller names the execution it takes the run from, so two executions that
both decided to take over cannot both win.

A stage that passed `hold` acts for a while after it; a take-over must not read the cluster
while a stage of the execution it replaces still acts on it (a reset lands while the old
execution's resume starts ranks). So a stage says it acts from before its check to its end
(`share_acting`), and `take_over` waits until every such stage has ended, and none starts until
the run has changed hands.

Two homes for the records, one interface (OwnerRecords):
- the store that the controllers of a fleet share (infra/ownership_rows.py), for the backends whose
  pool is there (local, Slurm, simulated): a row per run, and a stage's acting a lease that its
  process renews, so no controller needs a lock on a shared disk;
- the run directory (FileOwnerRecords, below): `owner.json` under a flock of `owner.lock`, a stage's
  acting a shared flock of `acting.lock`, for Kubernetes, whose pool is in the API server and whose
  runs' directories are on the cluster's volume.
"""

from __future__ import annotations

import contextlib
import fcntl
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import IO, Literal, Protocol

from lazarus.infra.backend import ClusterError
from lazarus.schema.files import write_json_atomic
from lazarus.schema.ownership import HANDOVERS_KEPT, Handover, Owner, Ownership
from lazarus.schema.rundir import RunDir

ACTING_POLL_SECONDS = 0.05
"""How often a stage or a take-over tries `acting.lock` again while the other holds it (seconds)."""


class StillActing(ClusterError):
    """A stage of the execution being replaced still acts on the run after the take-over's wait."""


class NotOwner(ClusterError):
    """Another execution owns the run; `record` says which."""

    def __init__(self, message: str, record: Ownership):
        super().__init__(message)
        self.record = record


class Acting(Protocol):
    """A stage's word that it acts on a run (`share_acting`); `close` ends it."""

    def close(self) -> None: ...


class OwnerRecords(Protocol):
    """Where a backend keeps its runs' owner records."""

    def read(self, run_id: str) -> Ownership | None:
        """The run's owner record; None when no execution has acted on it under ownership yet."""
        ...

    def hold(self, run_id: str, owner: Owner) -> Ownership:
        """Let `owner` act on the run, or raise NotOwner (held_record)."""
        ...

    def share_acting(self, run_id: str) -> Acting | None:
        """Say that a stage acts on the run until the returned Acting is closed; None while a take-over
        is being recorded (to be tried again)."""
        ...

    def take_over(
        self, run_id: str, owner: Owner, previous: str, kind: Literal["reset", "adopt"], wait_seconds: float = 60.0
    ) -> tuple[Ownership, Owner | None]:
        """Make `owner` the owner in place of execution `previous` once no stage acts on the run
        (StillActing after `wait_seconds`); the new record and the owner replaced (taken_record)."""
        ...


def start_acting(owners: OwnerRecords, run_id: str, owner: Owner) -> Acting | None:
    """Say that a stage of `owner` acts on the run and check that it may (`hold`): the Acting to close
    when the stage ends; None while a take-over is being recorded; NotOwner (acting on nothing)."""
    acting = owners.share_acting(run_id)
    if acting is None:
        return None
    try:
        owners.hold(run_id, owner)
    except BaseException:
        acting.close()
        raise
    return acting


def held_record(record: Ownership | None, owner: Owner, now: datetime) -> Ownership | None:
    """The record once `owner` acts, None where it stays as it is; NotOwner where `owner` may not act.
    A run with no owner record (a new run, or one started before runs had owners) becomes
    `owner`'s; a later run of the owner's chain becomes the owner, as its predecessor continued as new."""
    if record is None:
        return Ownership(owner=owner, since=now)
    if not record.admits(owner):
        raise NotOwner(record.refusal(owner), record)
    if record.owner.execution != owner.execution:
        return record.model_copy(update={"owner": owner, "since": now})
    return None


def taken_record(
    record: Ownership | None, owner: Owner, previous: str, kind: Literal["reset", "adopt"], now: datetime
) -> tuple[Ownership | None, Owner | None]:
    """The record once `owner` takes the run from execution `previous` (None where it stays as it is:
    a retried take-over whose first attempt took it) and the owner it replaced (None when the run had
    no record). NotOwner when an execution other than `previous` and `owner` holds it: somebody else
    took it in between."""
    if record is None:
        return Ownership(owner=owner, since=now), None
    held = record.owner
    if held.execution == owner.execution:
        return None, None
    if held.execution != previous:
        raise NotOwner(
            f"run {owner.workflow_id!r} passed to execution {held.execution} since execution {previous} "
            f"was refused; {owner.execution} does not take it",
            record,
        )
    handover = Handover(kind=kind, from_execution=held.execution, to_execution=owner.execution, at=now)
    return Ownership(owner=owner, since=now, handovers=[*record.handovers, handover][-HANDOVERS_KEPT:]), held


def still_acting(run_id: str, wait_seconds: float) -> StillActing:
    """The take-over's error when a stage of the execution it replaces outlasts its wait."""
    return StillActing(
        f"a stage of the execution that held run {run_id!r} still acts on it after "
        f"{wait_seconds:g} s; the take-over waits until it has ended"
    )


def read_owner(run: RunDir) -> Ownership | None:
    """The run's owner record; None when no execution has acted on it under ownership yet."""
    try:
        return Ownership.model_validate_json(run.owner_file.read_text())
    except FileNotFoundError:
        return None


@contextlib.contextmanager
def _locked(run: RunDir) -> Iterator[None]:
    run.root.mkdir(parents=True, exist_ok=True)
    with open(run.root / "owner.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def share_acting(run: RunDir) -> IO | None:
    """The open `acting.lock` under a shared flock, which the stage holds while it acts (closing
    the file ends it); None when a take-over holds it, to be tried again."""
    run.root.mkdir(parents=True, exist_ok=True)
    handle = open(run.root / "acting.lock", "a")  # noqa: SIM115 - the caller closes it when the stage ends
    try:
        fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


@contextlib.contextmanager
def _no_stage_acting(run: RunDir, wait_seconds: float) -> Iterator[None]:
    """Hold `acting.lock` exclusively: once every stage that holds it has ended (StillActing
    after `wait_seconds`), and until the take-over is recorded."""
    run.root.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + wait_seconds
    with open(run.root / "acting.lock", "a") as handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise still_acting(run.root.name, wait_seconds) from None
                time.sleep(ACTING_POLL_SECONDS)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class FileOwnerRecords:
    """The owner records in the runs' directories (OwnerRecords): `owner.json` under a flock."""

    def __init__(self, runs):
        self.runs = runs  # what names a run's directory (infra/runfiles.py RunFiles.run_dir)

    def read(self, run_id: str) -> Ownership | None:
        return read_owner(self.runs.run_dir(run_id))

    def hold(self, run_id: str, owner: Owner) -> Ownership:
        run = self.runs.run_dir(run_id)
        with _locked(run):
            record = read_owner(run)
            changed = held_record(record, owner, datetime.now(UTC))
            if changed is None:
                assert record is not None
                return record
            write_json_atomic(run.owner_file, changed.model_dump_json(indent=1))
            return changed

    def share_acting(self, run_id: str) -> Acting | None:
        return share_acting(self.runs.run_dir(run_id))

    def take_over(
        self, run_id: str, owner: Owner, previous: str, kind: Literal["reset", "adopt"], wait_seconds: float = 60.0
    ) -> tuple[Ownership, Owner | None]:
        run = self.runs.run_dir(run_id)
        with _no_stage_acting(run, wait_seconds), _locked(run):
            record = read_owner(run)
            changed, replaced = taken_record(record, owner, previous, kind, datetime.now(UTC))
            if changed is None:
                assert record is not None
                return record, None
            write_json_atomic(run.owner_file, changed.model_dump_json(indent=1))
            return changed, replaced
