"""A node's report of its ranks (`incarnations/K/nodes/I.report.json`): the one file a look reads
of a node while its launcher runs, with its one writer and its one reader.

The file is two lines: a NodeSummary, then the NodeReport it sums up. A look parses every node's
summary (a few numbers) and the ranks themselves only of a node whose summary shows something:
a rank not training, an exit, a stale heartbeat. So a look at a healthy run of 2,048 nodes of 8
ranks parses 2,048 small records, not 16,384 ranks (bench/large_run.py).
"""

from __future__ import annotations

import os

from pydantic import Field, TypeAdapter, ValidationError

from lazarus.schema.base import Record
from lazarus.schema.contract import ContractError, RankObservation
from lazarus.schema.files import write_json_atomic
from lazarus.schema.rundir import RunDir


class StepTime(Record):
    """A step and how long a rank of the node took over it: from its heartbeat of the step before to
    its own."""

    step: int = Field(ge=0, description="The step.")
    seconds: float = Field(ge=0, description="How long the rank took over it (seconds).")


class NodeReport(Record):
    """Node I's launcher's view of its ranks, rewritten on every change (a step, an exit) and at
    least every heartbeat interval. Detect reads one file per node instead of a heartbeat, an exit
    record and a lock per rank, so a look at a run of 2,048 nodes of 8 ranks is 2,048 reads, not
    49,152."""

    node: str = Field(description="The node.")
    time: float = Field(description="When it was written (seconds since the epoch).")
    ranks: list[RankObservation] = Field(description="The node's ranks, in rank order.")
    sick: str | None = Field(
        default=None,
        description="Why the node's health check (the spec's health.command) failed; None: healthy so far.",
    )
    slowest_step: StepTime | None = Field(
        default=None,
        description=(
            "Of the steps the node's ranks completed over the last few seconds (trainer/agent/node_report.py "
            "STEP_WINDOW_SECONDS), the one a rank took longest over; None: no rank completed two steps in a row."
        ),
    )
    last_step: StepTime | None = Field(
        default=None, description="The newest step a rank of the node was timed over; None: as slowest_step."
    )


class NodeSummary(Record):
    """The first line of a node's report: its ranks in the few numbers a look needs of a node whose
    every rank trains. The figures are over the ranks that have a heartbeat."""

    node: str = Field(description="The node.")
    steady: bool = Field(
        description=(
            "Every rank is launched, its process runs, it has no exit record, and its heartbeat has a step, a "
            "phase past starting and no warning: the node's ranks need reading only if a figure below is past "
            "a limit of the policy."
        )
    )
    lowest_step: int | None = Field(description="The lowest step a rank's heartbeat reports (None: none does).")
    highest_step: int | None = Field(description="The highest step a rank's heartbeat reports (None: none does).")
    oldest_beat: float | None = Field(description="The oldest heartbeat's time (seconds since the epoch; None: none).")
    newest_beat: float | None = Field(description="The newest heartbeat's time (seconds since the epoch; None: none).")
    oldest_alive: float | None = Field(
        description="The oldest `alive_at` of a heartbeat that has one (seconds since the epoch; None: none has)."
    )
    by_rank: bool = Field(description="Some rank wrote a heartbeat with a step itself (not its launcher).")
    trained: bool = Field(description="Some rank's process completed its first step (first_step_at is set).")
    compute_seconds: float | None = Field(
        default=None,
        description="The longest own work per step a rank reports (Heartbeat.compute_seconds; None: none does).",
    )
    sick: str | None = Field(
        default=None, description="Why the node's health check failed (NodeReport.sick); None: healthy."
    )
    reported_at: float | None = Field(
        default=None,
        description=(
            "When the launcher wrote the report (NodeReport.time, seconds since the epoch; None: not known). The "
            "launcher rewrites it at least every heartbeat interval, so a report newer than a fault shows its node "
            "outlived the fault even while every rank on it is blocked."
        ),
    )
    slowest_step: StepTime | None = Field(
        default=None,
        description=(
            "The report's slowest recent step (NodeReport.slowest_step), from which detect learns the run's step "
            "times however seldom it looks (activities/pace.py); None: not known."
        ),
    )
    last_step: StepTime | None = Field(
        default=None, description="The report's newest timed step (NodeReport.last_step)."
    )

    @classmethod
    def of(
        cls,
        node: str,
        ranks: list[RankObservation],
        sick: str | None = None,
        reported_at: float | None = None,
        slowest_step: StepTime | None = None,
        last_step: StepTime | None = None,
    ) -> NodeSummary:
        """The summary of a node's ranks (and of its health, `sick`, and its timed steps), reported at
        `reported_at`."""
        beats = [r.heartbeat for r in ranks if r.heartbeat is not None]
        steps = [beat.step for beat in beats if beat.step is not None]
        times = [beat.time for beat in beats]
        alive = [beat.alive_at for beat in beats if beat.alive_at]
        steady = bool(ranks) and all(
            r.launched
            and r.alive
            and r.exit is None
            and r.heartbeat is not None
            and r.heartbeat.step is not None
            and r.heartbeat.phase != "starting"
            and not r.heartbeat.warning
            for r in ranks
        )
        return cls(
            node=node,
            steady=steady,
            lowest_step=min(steps, default=None),
            highest_step=max(steps, default=None),
            oldest_beat=min(times, default=None),
            newest_beat=max(times, default=None),
            oldest_alive=min(alive, default=None),
            by_rank=any(beat.by == "rank" and beat.step is not None for beat in beats),
            trained=any(beat.first_step_at for beat in beats),
            compute_seconds=max((b.compute_seconds for b in beats if b.compute_seconds is not None), default=None),
            sick=sick,
            reported_at=reported_at,
            slowest_step=slowest_step,
            last_step=last_step,
        )


class NodeReading:
    """One node's ranks as a look found them: from its launcher's report (the summary at once, the
    ranks parsed on first use) or from each rank's own files (no summary)."""

    __slots__ = ("summary", "_ranks", "_file", "_start", "_path")

    def __init__(
        self,
        summary: NodeSummary | None = None,
        ranks: list[RankObservation] | None = None,
        report: bytes = b"",
        start: int = 0,
        path: str = "",
    ):
        self.summary = summary
        # The report's bytes stay where they were read (`start` on): most are never parsed.
        self._ranks, self._file, self._start, self._path = ranks, report, start, path

    @classmethod
    def of_ranks(cls, ranks: list[RankObservation]) -> NodeReading:
        """A node read rank by rank."""
        return cls(ranks=ranks)

    @property
    def ranks(self) -> list[RankObservation]:
        """The node's ranks, in rank order (parsed from the report on first use)."""
        if self._ranks is None:
            try:
                self._ranks = NodeReport.model_validate_json(self._file[self._start :]).ranks
            except ValidationError as error:
                raise ContractError(f"{self._path}: not a NodeReport ({error.errors()[0]['msg']})") from None
        return self._ranks


def write_node_report(run: RunDir, incarnation: int, node_index: int, report: NodeReport) -> None:
    """Replace the node's report (atomically): its summary, a newline, then the report, whose
    fields at their defaults are left out (which keeps the file, and the time to read it, small)."""
    summary = NodeSummary.of(report.node, report.ranks, report.sick, report.time, report.slowest_step, report.last_step)
    text = f"{summary.model_dump_json()}\n{report.model_dump_json(exclude_defaults=True)}"
    write_json_atomic(run.node_report_file(incarnation, node_index), text)


def read_node_reports(run: RunDir, incarnation: int, node_indexes) -> dict[int, NodeReading]:
    """The newest report of each node given that has one: what one look at a run reads (an open
    and a read a node, relative to the folder; only the summaries are parsed)."""
    folder = f"{run.incarnation(incarnation) / 'nodes'}{os.sep}"
    try:
        folder_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return {}
    try:
        return _read_reports(folder, folder_fd, node_indexes)
    finally:
        os.close(folder_fd)


def _read_reports(folder: str, folder_fd: int, node_indexes) -> dict[int, NodeReading]:
    found, files, summaries = [], [], []
    for index in node_indexes:
        name = f"{index}.report.json"
        try:
            fd = os.open(name, _read_flags[0], dir_fd=folder_fd)
        except FileNotFoundError:
            continue
        except PermissionError:
            if _read_flags[0] == os.O_RDONLY:
                raise
            _read_flags[0] = os.O_RDONLY  # O_NOATIME is only for the file's owner
            fd = os.open(name, os.O_RDONLY, dir_fd=folder_fd)
        try:
            data = os.read(fd, READ_AT_ONCE)
            while len(data) % READ_AT_ONCE == 0 and (more := os.read(fd, READ_AT_ONCE)):
                data += more
        finally:
            os.close(fd)
        newline = data.find(b"\n")
        if newline < 0:
            raise ContractError(f"{folder}{name}: not a node report (a NodeSummary line, then a NodeReport)")
        found.append(index)
        files.append(data)
        summaries.append(data[:newline])
    return {
        index: NodeReading(summary, report=data, start=len(line) + 1, path=f"{folder}{index}.report.json")
        for index, summary, data, line in zip(
            found, _parse_summaries(folder, found, summaries), files, summaries, strict=True
        )
    }


def _parse_summaries(folder: str, indexes: list[int], lines: list[bytes]) -> list[NodeSummary]:
    """The summary lines parsed in one call (a look's largest share of work after the reads: one
    call for 2,048 lines costs less than 2,048 calls); a bad line is named by its file."""
    try:
        parsed = _summaries_of_json(b"[" + b",".join(lines) + b"]")
        if len(parsed) == len(lines):  # a line of two records would shift every later one
            return parsed
    except ValidationError:
        pass
    for index, line in zip(indexes, lines, strict=True):
        try:
            NodeSummary.model_validate_json(line)
        except ValidationError as error:
            message = error.errors()[0]["msg"]
            raise ContractError(f"{folder}{index}.report.json: not a NodeSummary ({message})") from None
    raise ContractError(f"{folder}: a summary line holds more than one NodeSummary")


_summaries_of_json = TypeAdapter(list[NodeSummary]).validate_json

_read_flags = [os.O_RDONLY | getattr(os, "O_NOATIME", 0)]
"""How read_node_reports opens a report: without updating its access time where the reader may (it
owns the file). Every report is rewritten each heartbeat interval, so on a filesystem mounted
relatime the first read after each rewrite would write the inode too."""

READ_AT_ONCE = 1 << 13
"""Bytes read_node_reports asks of a report at a time: a node of 8 ranks reports about 2 KB."""
