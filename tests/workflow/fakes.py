"""Fake recovery activities under the real names, scripted per test, and helpers to run TrainingRun."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

from temporalio import activity
from temporalio.exceptions import ApplicationError

from lazarus.schema import (
    Assignment,
    DetectResult,
    FaultReport,
    Inventory,
    NodeRecord,
    RankProgress,
    RunStart,
    RunStatus,
    parse_spec,
)
from lazarus.schema.stages import (
    DetectInput,
    DrainInput,
    DrainResult,
    DrainWaits,
    LaunchInput,
    LaunchResult,
    ReleaseInput,
    ReplaceInput,
    RescheduleInput,
    ResumeInput,
    ResumeResult,
    ReturnNodeInput,
    StopInput,
    StopResult,
)
from lazarus.worker import QueueWorkers, queue_workers
from lazarus.workflows.training_run import TrainingRun

ACTIVE = ["node-0", "node-1", "node-2", "node-3"]


def _now() -> datetime:
    return datetime.now(UTC)


def make_spec(stages: dict | None = None, cluster: dict | None = None, **recovery):
    return parse_spec(
        {
            "name": "wf",
            "trainer": {"steps": 40},
            "cluster": cluster or {},
            "recovery": {"progress_every_seconds": 1, "capacity_poll_seconds": 5, **recovery, "stages": stages or {}},
        }
    )


def fault(nodes=("node-2",), step=15, incarnation=0) -> FaultReport:
    at = _now()
    return FaultReport(
        kind="node_down",
        nodes=list(nodes),
        incarnation=incarnation,
        occurred_at=at - timedelta(seconds=0.5),
        detected_at=at,
        step=step,
        reason="test fault",
    )


DRAINED_STEP = 37
"""The newest step the fake drain reads when asked: past any step the fake watch reports."""


async def heartbeat_until(gate: asyncio.Event) -> None:
    """Hold the calling activity open, heartbeating, until the test sets `gate`."""
    while not gate.is_set():
        activity.heartbeat()
        await asyncio.sleep(0.05)


class FakeStages:
    """The recovery activities, scripted: detect plays `watch` in order ("gate": wait, heartbeating,
    until `detect_gate` is set, then play the next item), resume plays `resumes`
    ("done": the checkpoint is the last step; a FaultReport: a fault before the first step; then
    a resume that trains), and each call is recorded."""

    def __init__(
        self,
        watch: list,
        spares=("node-4",),
        drain_failures=0,
        resume_timeouts=0,
        resume_sleep=0.0,
        spare_returns_at_read: int | None = None,
        spare_dies_before_claim: bool = False,
        claim_lost_at: int | None = None,
        resume_gate: asyncio.Event | None = None,
        resumes: list | None = None,
        return_gate: asyncio.Event | None = None,
        claimed_before: str | None = None,
        survivors_gate: asyncio.Event | None = None,
    ):
        self.watch = list(watch)
        self.resumes = list(resumes or [])
        self.return_gate = return_gate
        self.resume_gate = resume_gate
        self.spare_dies_before_claim = spare_dies_before_claim
        self.claim_lost_at = claim_lost_at  # that replace_or_reshard call finds its new nodes taken by another run
        self.spare_returns_at_read = spare_returns_at_read
        # A spare an earlier attempt of the stages claimed after this one read the pool: the claim
        # returns its assignment, whatever this attempt decided.
        self.claimed_before = claimed_before
        self.spares = list(spares)
        self.drain_failures = drain_failures
        self.resume_timeouts = resume_timeouts
        self.resume_sleep = resume_sleep
        self.calls: list[tuple[str, int]] = []
        self.drains: list[DrainInput] = []  # every drain's request, retries included
        # Survivors that end only once the test sets it: drain waits for them under its cap.
        self.survivors_gate = survivors_gate
        self.drains_local: list[bool] = []  # whether each drain call ran as a local activity
        self.detect_cancelled = asyncio.Event()
        self.detect_gate = asyncio.Event()
        self.watch_over = asyncio.Event()  # clear while a detect blocks
        self.watch_over.set()
        self.nodes = {name: "active" for name in ACTIVE}
        self.nodes.update({name: "spare" for name in spares})
        self.dead: set[str] = set()
        self.regrow_asks: list[int | None] = []  # regrow_nodes of each "capacity" watch

    async def _after_the_watch(self) -> None:
        # The next activity (not local) after a cancelled watch starts once that watch has ended:
        # the time-skipping server, shared by the session, never skips time again after a
        # workflow completed with a cancelled activity still running (its late cancellation is
        # refused). The local stages cannot wait for it: the cancellation goes to the server with
        # the workflow task, which a running local activity holds open (until 80 % of the task
        # timeout, 8 s by default), and waiting there cost each such test those 8 s.
        await self.watch_over.wait()

    def _called(self, name: str) -> int:
        attempt = activity.info().attempt
        self.calls.append((name, attempt))
        return attempt

    def names(self) -> list[str]:
        """Activity names in call order, one entry per call (retries included)."""
        return [name for name, _ in self.calls]

    @activity.defn(name="launch")
    async def launch(self, request: LaunchInput) -> LaunchResult:
        self._called("launch")
        return LaunchResult(
            run_dir="/nowhere",
            assignment=Assignment(incarnation=0, nodes=ACTIVE, layout=request.spec.layout, master_port=29400),
        )

    @activity.defn(name="detect")
    async def detect(self, request: DetectInput) -> DetectResult:
        self._called("detect")
        step = self.watch.pop(0) if self.watch else "block"
        if step == "gate":
            await heartbeat_until(self.detect_gate)
            step = self.watch.pop(0)
        if step == "block":
            # Watch until cancelled, as the real detect does.
            self.watch_over.clear()
            try:
                while True:
                    activity.heartbeat()
                    await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                self.detect_cancelled.set()
                raise
            finally:
                self.watch_over.set()
        if step == "done":
            return DetectResult(completed=True, progress=RankProgress(step=request.total_steps, at=_now()))
        if step == "capacity":
            # A repaired node joins the pool; the report says so only to a watch that asked.
            self.nodes["node-9"] = "spare"
            self.regrow_asks.append(request.regrow_nodes)
            capacity = request.regrow_nodes is not None
            return DetectResult(progress=RankProgress(step=20, at=_now()), capacity=capacity)
        if isinstance(step, FaultReport):
            return DetectResult(
                fault=step.model_copy(update={"incarnation": request.incarnation}),
                progress=RankProgress(step=step.step, at=_now()),
            )
        return DetectResult(progress=RankProgress(step=step, at=_now()))

    @activity.defn(name="drain")
    async def drain(self, request: DrainInput) -> DrainResult:
        attempt = self._called("drain")
        self.drains.append(request)
        self.drains_local.append(activity.info().is_local)
        if attempt <= self.drain_failures:
            raise RuntimeError(f"transient drain failure on attempt {attempt}")
        if self.survivors_gate is not None and request.wait_cap_seconds is not None:
            try:
                await asyncio.wait_for(self.survivors_gate.wait(), request.wait_cap_seconds)
            except TimeoutError:
                waited = DrainWaits(survivors=request.wait_cap_seconds)
                return DrainResult(quarantined=[], stopped_ranks=[], removed_partial_checkpoints=[], unfinished=waited)
        elif self.survivors_gate is not None:
            await heartbeat_until(self.survivors_gate)
        for node in request.nodes:
            self.nodes[node] = "quarantined"
        return DrainResult(
            quarantined=request.nodes,
            stopped_ranks=[0, 1, 2, 3],
            removed_partial_checkpoints=[20],
            in_flight_checkpoint=20,
            # Asked for a fault whose step is only the workflow's last report (an operator's, a signal's).
            step=DRAINED_STEP if request.read_step else None,
        )

    @activity.defn(name="reschedule")
    async def reschedule(self, request: RescheduleInput) -> Inventory:
        self._called("reschedule")
        if self.names().count("reschedule") == self.spare_returns_at_read:
            self.nodes["node-9"] = "spare"  # a repaired node comes back while the run waits
        return Inventory(
            nodes=[NodeRecord(name=n, role=role, healthy=n not in self.dead) for n, role in sorted(self.nodes.items())]
        )

    @activity.defn(name="replace_or_reshard")
    async def replace_or_reshard(self, request: ReplaceInput) -> Assignment:
        self._called("replace_or_reshard")
        decision, old = request.decision, request.old_assignment
        if self.names().count("replace_or_reshard") == self.claim_lost_at:
            taken = [node for node in decision.nodes if node not in old.nodes]
            for node in taken:
                self.nodes[node] = "taken"  # active in another run: this run's inventory no longer offers it
            raise ApplicationError(f"{taken} no longer free spares", type="SpareUnavailable", non_retryable=True)
        if self.spare_dies_before_claim:
            self.spare_dies_before_claim = False
            # A spare that dies while free is dead, not this run's quarantine.
            self.dead.update(request.decision.replacements.values())
            raise ApplicationError("node-4 is no longer a free spare", type="SpareUnavailable", non_retryable=True)
        nodes = decision.nodes
        if self.claimed_before is not None:
            nodes = [self.claimed_before if n in decision.replacements.values() else n for n in nodes]
        for node in nodes:
            self.nodes[node] = "active"
        for node in decision.released_nodes:
            self.nodes[node] = "spare"
        return old.model_copy(update={"incarnation": old.incarnation + 1, "nodes": nodes, "layout": decision.layout})

    @activity.defn(name="resume")
    async def resume(self, request: ResumeInput) -> ResumeResult:
        await self._after_the_watch()
        attempt = self._called("resume")
        if self.resume_gate is not None:
            # The test holds this resume open. Not a drain: drain is a local activity, and while one
            # runs, the workflow answers queries and updates only at its workflow task's heartbeats.
            gate, self.resume_gate = self.resume_gate, None
            await heartbeat_until(gate)
        if attempt <= self.resume_timeouts:
            await asyncio.sleep(self.resume_sleep)  # longer than the stage's timeout
        outcome = self.resumes.pop(0) if self.resumes else None
        if outcome == "done":
            return ResumeResult(resumed_from_step=request.total_steps, completed=True)
        if isinstance(outcome, FaultReport):
            fault = outcome.model_copy(update={"incarnation": request.assignment.incarnation})
            return ResumeResult(resumed_from_step=10, fault=fault)
        return ResumeResult(resumed_from_step=10, first_step_at=_now())

    @activity.defn(name="stop")
    async def stop(self, request: StopInput) -> StopResult:
        await self._after_the_watch()
        self._called("stop")
        return StopResult(step=17, checkpoint_step=17, clean=True)

    @activity.defn(name="return_node")
    async def return_node(self, request: ReturnNodeInput) -> Inventory:
        self._called("return_node")
        if self.return_gate is not None:
            gate, self.return_gate = self.return_gate, None
            await gate.wait()  # the test holds this return open
        self.nodes[request.node] = "spare"
        return Inventory(
            nodes=[NodeRecord(name=n, role=role, healthy=n not in self.dead) for n, role in sorted(self.nodes.items())]
        )

    @activity.defn(name="release")
    async def release(self, request: ReleaseInput) -> list[str]:
        await self._after_the_watch()
        self._called("release")
        held = sorted(n for n, role in self.nodes.items() if role == "active")
        for node in held:
            self.nodes[node] = "spare"
        return held

    def all(self) -> list:
        return [
            self.launch,
            self.detect,
            self.drain,
            self.reschedule,
            self.replace_or_reshard,
            self.resume,
            self.stop,
            self.return_node,
            self.release,
        ]


def fake_worker(env, stages: FakeStages, queue: str) -> QueueWorkers:
    """The workers of TrainingRun over the fakes (its watches on their own queue, as lazarus/worker.py
    runs them); heartbeats are not throttled, so a cancelled watch learns of its cancellation at once
    (Temporal cancels an activity in a heartbeat's answer)."""
    return queue_workers(
        env.client,
        queue,
        stages.all(),
        workflows=[TrainingRun],
        max_heartbeat_throttle_interval=timedelta(milliseconds=50),
    )


async def run_workflow(env, stages: FakeStages, spec, during=None) -> RunStatus:
    """Run TrainingRun on a fresh task queue against the fakes; `during(handle)` runs alongside."""
    queue = f"wf-{uuid.uuid4()}"
    async with fake_worker(env, stages, queue):
        handle = await env.client.start_workflow(
            TrainingRun.run,
            RunStart(spec=spec),
            id=f"run-{uuid.uuid4()}",
            task_queue=queue,
        )
        if during is not None:
            await during(handle)
        return await handle.result()
