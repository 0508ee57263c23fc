"""The owner record of a run directory, read and changed under an exclusive flock of `owner.lock`.

`hold` is what every activity calls before it acts: it lets the owner through (recording a
later run of its chain as the owner), records the first execution that acts on a run without
an owner, and refuses everyone else with NotOwner. `take_over` is the one way a run changes
hands otherwise: the caller names the execution it takes the run from, so two executions that
both decided to take over cannot both win.

A stage that passed `hold` acts for a while after it; a take-over must not read the cluster
while a stage of the execution it replaces still acts on it (a reset lands while the old
execution's resume starts ranks). So a stage holds a shared flock of `acting.lock` from before
its check to its end (`share_acting`), and `take_over` takes it exclusively: it waits until every
such stage has ended, and none starts until the run has changed hands.
"""

from __future__ import annotations

import contextlib
import fcntl
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import IO, Literal

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
                    raise StillActing(
                        f"a stage of the execution that held run {run.root.name!r} still acts on it after "
                        f"{wait_seconds:g} s; the take-over waits until it has ended"
                    ) from None
                time.sleep(ACTING_POLL_SECONDS)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write(run: RunDir, record: Ownership) -> None:
    write_json_atomic(run.owner_file, record.model_dump_json(indent=1))


def hold(run: RunDir, owner: Owner) -> Ownership:
    """Let `owner` act on the run, or raise NotOwner. A run with no owner record (a new run, or
    one started before runs had owners) becomes `owner`'s; a later run of the owner's chain
    becomes the owner, as its predecessor continued as new."""
    with _locked(run):
        record = read_owner(run)
        now = datetime.now(UTC)
        if record is None:
            record = Ownership(owner=owner, since=now)
        elif not record.admits(owner):
            raise NotOwner(record.refusal(owner), record)
        elif record.owner.execution != owner.execution:
            record = record.model_copy(update={"owner": owner, "since": now})
        else:
            return record
        _write(run, record)
        return record


def take_over(
    run: RunDir, owner: Owner, previous: str, kind: Literal["reset", "adopt"], wait_seconds: float = 60.0
) -> tuple[Ownership, Owner | None]:
    """Make `owner` the run's owner in place of execution `previous` (the one whose refusal the
    caller saw), once no stage acts on the run (StillActing after `wait_seconds`); returns the
    new record and the owner it replaced (None when the run had no record). NotOwner when the
    run is held by an execution other than `previous` and `owner`: somebody else took it in
    between. Taking a run one already owns changes nothing."""
    with _no_stage_acting(run, wait_seconds), _locked(run):
        record = read_owner(run)
        now = datetime.now(UTC)
        if record is None:
            record = Ownership(owner=owner, since=now)
            _write(run, record)
            return record, None
        held = record.owner
        if held.execution == owner.execution:
            return record, None  # a retried take_over whose first attempt took it
        if held.execution != previous:
            raise NotOwner(
                f"run {owner.workflow_id!r} passed to execution {held.execution} since execution {previous} "
                f"was refused; {owner.execution} does not take it",
                record,
            )
        handover = Handover(kind=kind, from_execution=held.execution, to_execution=owner.execution, at=now)
        record = Ownership(owner=owner, since=now, handovers=[*record.handovers, handover][-HANDOVERS_KEPT:])
        _write(run, record)
        return record, held
