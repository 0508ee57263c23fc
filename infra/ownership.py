"""The owner record of a run directory, read and changed under an exclusive flock of `owner.lock`.

`hold` is what every activity calls before it acts: it lets the owner through (recording a
later run of its chain as the owner), records the first execution that acts on a run without
an owner, and refuses everyone else with NotOwner. `take_over` is the one way a run changes
hands otherwise: the caller names the execution it takes the run from, so two executions that
both decided to take over cannot both win.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from datetime import UTC, datetime

from lazarus.infra.backend import ClusterError
from lazarus.schema.files import write_json_atomic
from lazarus.schema.ownership import HANDOVERS_KEPT, Handover, Owner, Ownership
from lazarus.schema.rundir import RunDir


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


def take_over(run: RunDir, owner: Owner, previous: str, kind: str) -> tuple[Ownership, Owner | None]:
    """Make `owner` the run's owner in place of execution `previous` (the one whose refusal the
    caller saw); returns the new record and the owner it replaced (None when the run had no
    record). NotOwner when the run is held by an execution other than `previous` and `owner`:
    somebody else took it in between. Taking a run one already owns changes nothing."""
    with _locked(run):
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
