"""One run of one chaos scenario: start it on a bed, break it as the scenario says, follow it to its
end across worker and server deaths, and judge what it left."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

from temporalio.client import WorkflowFailureError, WorkflowUpdateFailedError
from temporalio.service import RPCError

from lazarus.chaos.bed import ChaosBed, ChaosError, CheckpointWatch, wait_for
from lazarus.client.runs import connect, run_status, start_run
from lazarus.schema.contract import read_heartbeat, read_metrics
from lazarus.schema.controls import PauseRequest
from lazarus.schema.files import read_json
from lazarus.schema.records import Assignment, RunState, RunStatus
from lazarus.schema.run import RunSpec
from lazarus.workflows.training_run import TrainingRun

RPC_RETRY_SECONDS = 0.2
"""Wait between calls to a Temporal server that did not answer (seconds)."""


def process_state(pid: int) -> str | None:
    """The process's state letter from /proc (R, S, T, Z, ...), None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def process_group_members(pgid: int) -> list[int]:
    """Pids of the live processes in process group `pgid` (read from /proc)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


class Trial:
    """A run of `spec` on `bed`, with what a scenario needs to break it and to judge it."""

    def __init__(self, bed: ChaosBed, spec: RunSpec, run_id: str):
        self.bed, self.spec, self.run_id = bed, spec, run_id
        self.run = bed.cluster.run_dir(run_id)
        self.corrupted: set[int] = set()
        self.notes: list[str] = []
        self.stopped: list[int] = []
        self.hang: tuple[str, float] | None = None  # (node, when it was stopped) in the hang scenarios
        self.killed: list[str] = []  # nodes whose processes the scenario SIGKILLed
        # (node, fault kind, when it was broken) of a planned swap: slowed, sick
        self.swapped: tuple[str, str, float] | None = None
        self.disk_full: int | None = None  # the checkpoint step a full disk lost, in that scenario
        self.in_flight: int | None = None  # the checkpoint step a node died writing, in that scenario
        self.half_saved: str | None = None  # the node that dies saving its survivor state, in that scenario
        self.client = None
        self.handle = None
        self.watch: CheckpointWatch | None = None

    async def start(self, timeout: float = 30.0) -> None:
        """Connect, start the run's workflow and the watch on its checkpoints."""
        deadline = time.monotonic() + timeout
        while self.client is None:
            try:
                self.client = await connect(self.bed.settings)
            except RuntimeError as error:
                # A dev server answers on its port a moment before its frontend serves, and the
                # answer that ended the bed's wait may have been another process's, for a moment.
                starting = "Unavailable" in str(error) or (
                    "Connection refused" in str(error) and self.bed.server.running
                )
                if not starting or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(RPC_RETRY_SECONDS)
        self.handle = await start_run(self.client, self.bed.settings, self.spec, self.run_id)
        self.watch = CheckpointWatch(self.run)

    def step(self) -> int:
        """Newest step rank 0 reported (0 before the first)."""
        lines = read_metrics(self.run) if self.run.metrics_file.exists() else []
        return lines[-1].step if lines else 0

    def trained_in(self, incarnation: int) -> bool:
        """Whether `incarnation` (or a later one) has reported a step."""
        lines = read_metrics(self.run) if self.run.metrics_file.exists() else []
        return any(m.incarnation >= incarnation for m in lines)

    def where(self) -> str:
        """Where the recovery stands, as the run's files show it (the server may be down)."""
        roles = {n.name: n.role for n in self.bed.cluster.inventory(self.run_id).nodes}
        quarantined = sorted(n for n, role in roles.items() if role == "quarantined")
        return f"with {', '.join(quarantined) or 'no node'} quarantined, newest incarnation {self.incarnation()}"

    async def at_step(self, step: int, timeout: float = 180.0) -> None:
        """Wait until the run has trained `step`."""
        await wait_for(lambda: self.step() >= step, f"step {step} of {self.run_id}", timeout)

    def warned(self, words: str, incarnation: int = 0) -> bool:
        """Whether a rank of `incarnation` has put a warning with `words` in its heartbeat."""
        for rank in range(self.spec.layout.world_size):
            heartbeat = read_heartbeat(self.run, incarnation, rank)
            if heartbeat is not None and heartbeat.warning and words in heartbeat.warning:
                return True
        return False

    async def heard(self, words: str) -> bool:
        """Whether the run's status holds a warning with `words` (the controller heard it)."""
        assert self.handle is not None, "start() started the run"
        status = await self.handle.query(TrainingRun.status)
        return any(words in warning for warning in status.warnings)

    async def in_state(self, state: RunState) -> bool:
        """Whether the run's status query says it is in `state`."""
        assert self.handle is not None, "start() started the run"
        return (await self.handle.query(TrainingRun.status)).state == state

    async def answer_times(self) -> tuple[float, float]:
        """How long the run's status query, then an operator's pause, took to be answered (seconds)."""
        assert self.handle is not None, "start() started the run"
        asked = time.monotonic()
        await self.handle.query(TrainingRun.status)
        answered = time.monotonic()
        try:
            await self.handle.execute_update(TrainingRun.pause, PauseRequest(reason="chaos: asked during a drain"))
        except WorkflowUpdateFailedError:
            pass  # refused (the run is not training) is an answer
        return answered - asked, time.monotonic() - answered

    def incarnation(self) -> int:
        """The newest incarnation with an assignment."""
        return max(k for k in self.run.incarnations() if self.run.assignment_file(k).exists())

    def assignment(self, incarnation: int | None = None) -> Assignment:
        """The assignment of `incarnation` (default: the newest)."""
        k = self.incarnation() if incarnation is None else incarnation
        return Assignment.model_validate_json(self.run.assignment_file(k).read_text())

    def node(self, index: int) -> str:
        """The node at `index` of the newest assignment."""
        return self.assignment().nodes[index]

    def spare(self) -> str:
        """A spare of the run's inventory that is healthy and unclaimed."""
        return self.bed.cluster.inventory(self.run_id).free_spares()[0]

    async def kill_nodes(self, *nodes: str) -> None:
        """SIGKILL every process of each node, at once (each in a thread of its own)."""
        self.killed += nodes
        await asyncio.gather(*(asyncio.to_thread(self.bed.kill_node, self.run_id, n) for n in nodes))

    async def quarantined(self, node: str, timeout: float = 60.0) -> None:
        """Wait until drain has quarantined `node`."""
        await wait_for(
            lambda: self.bed.cluster.inventory(self.run_id).node(node).role == "quarantined",
            f"drain to quarantine {node}",
            timeout,
        )

    def stop_processes(self, pid_files: list[Path]) -> None:
        """SIGSTOP what `pid_files` record, as a hung or partitioned host looks: a whole process group
        where the record names one (a launcher, a standby), else the one process (a rank)."""
        for pid_file in pid_files:
            record = read_json(pid_file)
            if record is None:
                raise ChaosError(f"no pid record {pid_file}")
            if "pgid" in record:
                self.stopped += process_group_members(record["pgid"])
                os.killpg(record["pgid"], signal.SIGSTOP)
            else:
                self.stopped.append(record["pid"])
                os.kill(record["pid"], signal.SIGSTOP)

    def continue_stopped(self) -> int:
        """SIGCONT what stop_processes stopped; returns how many of those processes still lived (a
        zombie, killed but not yet reaped, does not count)."""
        alive = 0
        for pid in self.stopped:
            if process_state(pid) not in (None, "Z"):
                os.kill(pid, signal.SIGCONT)
                alive += 1
        return alive

    async def outcome(self, timeout: float = 600.0) -> RunStatus:
        """The run's final status, waiting out servers that are down and workers that are gone."""
        assert self.client is not None and self.handle is not None, "start() connected and started the run"
        deadline = time.monotonic() + timeout
        while True:
            try:
                await asyncio.wait_for(self.handle.result(), max(1.0, deadline - time.monotonic()))
                break
            except WorkflowFailureError:
                break
            except RPCError:
                await asyncio.sleep(RPC_RETRY_SECONDS)
            except TimeoutError:
                raise ChaosError(f"run {self.run_id} did not end within {timeout:.0f} s") from None
            if time.monotonic() > deadline:
                raise ChaosError(f"run {self.run_id} did not end within {timeout:.0f} s")
        while True:
            try:
                return await run_status(self.client, self.run_id)
            except RPCError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(RPC_RETRY_SECONDS)
