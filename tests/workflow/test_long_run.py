"""A run the size of Llama 3's: 2,048 nodes x 8 ranks, many incidents over its life (150 here;
Llama 3's 470 with LAZARUS_LONG_RUN_INCIDENTS=470, about a minute), through continue-as-new.
Every payload the workflow sent or received and every history stays within its limit, and the
final report holds every incident (the archived ones read back from the run directory).

The activities are fakes that answer as the real ones would for a run of that size: each fault
blames one node of the current assignment, drain stops every other rank and names the survivors,
reschedule returns the whole pool (the quarantined nodes come back repaired two incidents later),
and resume reports a first step; archive_incidents is the real activity.
"""

from __future__ import annotations

import os
import random
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from temporalio import activity

from lazarus.activities.recovery import RecoveryActivities
from lazarus.client.history import chain_histories, incident_spans, largest_payloads
from lazarus.commands.report import summarize, with_archived
from lazarus.infra.runfiles import RunFiles
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
from lazarus.schema.rundir import RunDir
from lazarus.schema.stages import (
    DetectInput,
    DrainInput,
    DrainResult,
    LaunchInput,
    LaunchResult,
    ReleaseInput,
    ReplaceInput,
    RescheduleInput,
    ResumeInput,
    ResumeResult,
)
from lazarus.worker import queue_workers
from lazarus.workflows.training_run import TrainingRun

# The time-skipping environment is shared by the session, so this test runs in its event loop.
pytestmark = pytest.mark.asyncio(loop_scope="session")

NODES, SPARES, RANKS_PER_NODE = 2048, 8, 8
INCIDENTS = int(os.environ.get("LAZARUS_LONG_RUN_INCIDENTS", "150"))
STEPS_PER_INCIDENT = 100
PAYLOAD_LIMIT = 256 * 1024  # the bound the run keeps to; Temporal's own is 2 MB
EVENTS_PER_INCIDENT = 20  # drain, reschedule and replace_or_reshard are markers of one workflow task
HISTORY_LIMIT = max(100, INCIDENTS * EVENTS_PER_INCIDENT // 5)  # about five continues-as-new
# Llama 3's 54 days: most interruptions were hardware (a node lost), then software, then hangs.
KINDS = ["node_down"] * 78 + ["rank_exit"] * 13 + ["hang"] * 9
LOG_TAIL = "\n".join(f"[rank 1234] step {s}: loss 2.{s:04d} tokens/s 31250 mfu 0.41" for s in range(20))


def _now() -> datetime:
    return datetime.now(UTC)


class LlamaSizedRun:
    """The recovery activities, faked for a 2,048-node run with a fault after every 100 steps."""

    def __init__(self, home):
        self.home = home
        self.rng = random.Random(3)
        self.roles = {f"node-{i}": "active" for i in range(NODES)}
        self.roles.update({f"node-{i}": "spare" for i in range(NODES, NODES + SPARES)})
        self.repairs: list[tuple[int, str]] = []  # (incident after which it is back, node)
        self.assignment: Assignment | None = None
        self.faults = 0
        self.lost_steps = 0

    @activity.defn(name="launch")
    async def launch(self, request: LaunchInput) -> LaunchResult:
        nodes = [f"node-{i}" for i in range(NODES)]
        self.assignment = Assignment(incarnation=0, nodes=nodes, layout=request.spec.layout, master_port=29400)
        return LaunchResult(run_dir=str(RunDir(self.home / "runs" / request.run_id).root), assignment=self.assignment)

    @activity.defn(name="detect")
    async def detect(self, request: DetectInput) -> DetectResult:
        step = self.faults * STEPS_PER_INCIDENT + 57
        if self.faults == INCIDENTS:
            return DetectResult(completed=True, progress=RankProgress(step=request.total_steps, at=_now()))
        self.faults += 1
        kind = self.rng.choice(KINDS)
        node = self.rng.choice(self.assignment.nodes)
        rank = self.assignment.nodes.index(node) * RANKS_PER_NODE + self.rng.randrange(RANKS_PER_NODE)
        at = _now()
        fault = FaultReport(
            kind=kind,
            nodes=[node],
            incarnation=request.incarnation,
            occurred_at=at - timedelta(seconds=2),
            detected_at=at,
            step=step,
            rank=rank,
            reason=f"rank {rank} on {node}: {kind}",
            error="RuntimeError: NCCL error: unhandled cuda error" if kind == "rank_exit" else "",
            log_tail=LOG_TAIL if kind == "rank_exit" else "",
        )
        return DetectResult(fault=fault, progress=RankProgress(step=step, at=at))

    @activity.defn(name="drain")
    async def drain(self, request: DrainInput) -> DrainResult:
        lost = {self.assignment.nodes.index(node) for node in request.nodes}
        alive = [r for r in range(NODES * RANKS_PER_NODE) if r // RANKS_PER_NODE not in lost]
        for node in request.nodes:
            self.roles[node] = "quarantined"
            self.repairs.append((self.faults + 2, node))
        step = self.faults * STEPS_PER_INCIDENT + 57
        return DrainResult(
            quarantined=request.nodes,
            stopped_ranks=alive,
            removed_partial_checkpoints=[],
            # The survivors of one replica finished the step the others failed in (gloo's ring ends unevenly).
            survivors={r: step - (r // 128 != 7) for r in alive},
        )

    @activity.defn(name="reschedule")
    async def reschedule(self, request: RescheduleInput) -> Inventory:
        for due, node in [r for r in self.repairs if r[0] <= self.faults]:
            self.roles[node] = "spare"  # repaired and returned to the pool
            self.repairs.remove((due, node))
        return Inventory(nodes=[NodeRecord(name=n, role=role) for n, role in self.roles.items()])

    @activity.defn(name="replace_or_reshard")
    async def replace_or_reshard(self, request: ReplaceInput) -> Assignment:
        decision = request.decision
        for node in decision.nodes:
            self.roles[node] = "active"
        self.assignment = request.old_assignment.model_copy(
            update={"incarnation": request.old_assignment.incarnation + 1, "nodes": decision.nodes}
        )
        return self.assignment

    @activity.defn(name="resume")
    async def resume(self, request: ResumeInput) -> ResumeResult:
        resumed = request.fault_step - 1  # the survivors' step: one step trained again
        self.lost_steps += 1
        return ResumeResult(
            resumed_from_step=resumed, restored_from="survivors", first_step_at=_now(), step=resumed + 1
        )

    @activity.defn(name="release")
    async def release(self, request: ReleaseInput) -> list[str]:
        return []

    def every(self) -> list:
        archive = RecoveryActivities(RunFiles(self.home))  # archive_incidents needs only the run directories
        stages = (self.launch, self.detect, self.drain, self.reschedule, self.replace_or_reshard, self.resume)
        return [*stages, self.release, archive.archive_incidents]


async def test_a_llama_sized_run_keeps_every_payload_and_history_within_its_limit(time_skipping_env, tmp_path):
    spec = parse_spec(
        {
            "name": "llama-sized",
            "trainer": {
                "steps": INCIDENTS * STEPS_PER_INCIDENT + 1000,
                "n_heads": 8,
                "n_layers": 16,
                "global_batch": 1024,
            },
            "layout": {"dp": 128, "pp": 16, "tp": 8, "ranks_per_node": RANKS_PER_NODE},
            "cluster": {"active_nodes": NODES, "spare_nodes": SPARES},
            "recovery": {"max_incidents": 1000, "history_limit_events": HISTORY_LIMIT},
        }
    )
    fakes = LlamaSizedRun(tmp_path)
    queue, run_id = f"wf-{uuid.uuid4()}", f"llama-{uuid.uuid4().hex[:8]}"
    async with queue_workers(time_skipping_env.client, queue, fakes.every(), workflows=[TrainingRun]):
        handle = await time_skipping_env.client.start_workflow(
            TrainingRun.run, RunStart(run_id=run_id, spec=spec), id=run_id, task_queue=queue
        )
        final: RunStatus = await handle.result()
        queried = await handle.query(TrainingRun.status)

    # Every run of the chain: its length, and every payload in it.
    histories = await chain_histories(time_skipping_env.client, run_id, handle.first_execution_run_id)
    lengths = [len(events) for events in histories]
    spans = [span for events in histories for span in incident_spans(events)]
    largest: dict[str, int] = {}
    for events in histories:
        for label, size in largest_payloads(events).items():
            largest[label] = max(largest.get(label, 0), size)
    assert len(lengths) >= 4, f"expected several continues-as-new, got {len(lengths)} workflow runs"
    assert final.segments == len(lengths)
    assert max(lengths) < HISTORY_LIMIT + 2 * EVENTS_PER_INCIDENT, lengths
    assert len(spans) == INCIDENTS and max(spans) <= EVENTS_PER_INCIDENT, sorted(set(spans))
    # Everything else (the watches, the archives, each continue-as-new) adds a few events per incident.
    assert sum(lengths) <= INCIDENTS * (EVENTS_PER_INCIDENT + 3), (sum(lengths), lengths)
    assert max(largest.values()) < PAYLOAD_LIMIT, largest
    assert len(queried.model_dump_json()) < PAYLOAD_LIMIT

    # What the run carried is bounded, and the report holds every incident.
    assert final.incident_count == INCIDENTS and len(final.incidents) <= 20
    assert final.earlier_incidents.count == INCIDENTS - len(final.incidents)
    report = summarize(with_archived(final))
    assert report["incidents"] == INCIDENTS and report["incidents_only_tallied"] == 0
    assert len(report["mttr_seconds"]) == INCIDENTS and all(m is not None and m > 0 for m in report["mttr_seconds"])
    assert report["lost_steps"] == fakes.lost_steps == INCIDENTS
    assert [i.number for i in with_archived(final).incidents] == list(range(1, INCIDENTS + 1))
    # Each incident replaced its node by a spare: the run ends on 2,048 distinct nodes.
    assert len(set(final.assignment.nodes)) == NODES and final.assignment.incarnation == INCIDENTS
    # Read without the run directory, the tally still adds up to the same bill.
    blind = summarize(final)
    assert blind["incidents"] == INCIDENTS and blind["lost_steps"] == INCIDENTS
    assert abs(blind["lost_seconds"]["recovery"] - report["lost_seconds"]["recovery"]) < 1e-6
