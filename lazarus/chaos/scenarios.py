"""The chaos matrix: every fault we can name, as a scenario that breaks a real run on purpose.

Each scenario's `act` breaks the run of a Trial once it trains (at `kill_at`, mid-run between two
checkpoints) and returns; the run is then followed to its end and judged (lazarus.chaos.judge).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from lazarus.activities.failpoints import STAGE_FAILPOINTS
from lazarus.chaos.bed import ChaosError, wait_for
from lazarus.chaos.controls import SURVIVOR_HOLD_SECONDS, controls_in_drain
from lazarus.chaos.swaps import SICK_CHECK, SLOW_FACTOR, STRAGGLER_WINDOW_SECONDS, node_sick, node_slowed
from lazarus.chaos.trial import Trial
from lazarus.schema import STAGES
from lazarus.schema.run import FaultInjection, RunSpec

SERVER_DOWN_MID_RECOVERY_SECONDS = 5.0
"""How long the Temporal server stays dead when it is killed mid-recovery (seconds)."""
SERVER_DOWN_AT_FAULT_SECONDS = 10.0
"""How long it stays dead when it is already down as the node dies (seconds)."""
DERIVED_HANG_LIMIT_SECONDS = 5.0
"""The hang scenarios keep the derived hang time (activities/pace.py: for the chaos spec's steps,
the floor of 1 s or a few step times more): a stop must be found within this (seconds); the bench
prints when it was."""


HANG_FOUND_MARGIN_SECONDS = 1.0
"""With the policy's own hang_after_seconds: how much later than it after the stop a hang may be reported: a heartbeat's
period and a poll of detect (seconds)."""


@dataclass(frozen=True)
class Scenario:
    """One row of the matrix."""

    name: str
    what: str
    act: Callable[[Trial, int], Awaitable[None]]
    failpoints: tuple[str, ...] = ()
    spares: int | None = None
    recovery: dict = field(default_factory=dict)
    health: dict = field(default_factory=dict)  # the spec's health section
    faults: Callable[[RunSpec, int], list[dict]] | None = None  # planned faults for (spec, kill_at)
    own_bed: bool = False  # it kills the worker or the server: a bed no other scenario shares

    def spec_for(self, spec: RunSpec, kill_at: int) -> RunSpec:
        """`spec` with this scenario's spares, recovery settings and planned faults."""
        data = spec.model_dump(mode="json")
        if self.spares is not None:
            data["cluster"]["spare_nodes"] = self.spares
        data["recovery"] |= self.recovery
        data["health"] |= self.health
        if self.faults is not None:
            data["faults"] = self.faults(spec, kill_at)
        return RunSpec.model_validate(data)


def worker_killed_in(stage: str) -> Scenario:
    """The worker SIGKILLed inside `stage`, at its failpoint, once a second worker serves."""
    failpoint = STAGE_FAILPOINTS[stage]

    async def act(trial: Trial, kill_at: int) -> None:
        await trial.at_step(kill_at)
        armed = trial.bed.workers[-1]
        await trial.kill_nodes(trial.node(2))
        await trial.bed.reached(failpoint, armed)
        await trial.bed.take_over(armed)

    return Scenario(
        f"worker-in-{stage}",
        f"the worker SIGKILLed inside {stage}, a second one standing by",
        act,
        failpoints=(failpoint,),
        own_bed=True,
    )


async def worker_killed_in_every_stage(trial: Trial, kill_at: int) -> None:
    """The worker SIGKILLed inside each stage of one recovery in turn, each time a fresh worker
    armed at the next stage taking over, and a plain one at the end."""
    await trial.at_step(kill_at)
    await trial.kill_nodes(trial.node(2))
    for i, stage in enumerate(STAGES):
        armed = trial.bed.workers[-1]
        await trial.bed.reached(STAGE_FAILPOINTS[stage], armed)
        await trial.bed.take_over(armed, *(STAGE_FAILPOINTS[s] for s in STAGES[i + 1 : i + 2]))


async def server_killed_mid_recovery(trial: Trial, kill_at: int) -> None:
    await trial.at_step(kill_at)
    node = trial.node(2)
    await trial.kill_nodes(node)
    await trial.quarantined(node)
    trial.bed.server.kill()
    trial.notes.append(f"server killed {trial.where()}")
    await asyncio.sleep(SERVER_DOWN_MID_RECOVERY_SECONDS)  # the outage the scenario is about
    await asyncio.to_thread(trial.bed.server.start)


async def server_down_at_fault(trial: Trial, kill_at: int) -> None:
    await trial.at_step(kill_at)
    trial.bed.server.kill()
    await trial.kill_nodes(trial.node(2))
    await asyncio.sleep(SERVER_DOWN_AT_FAULT_SECONDS)  # the outage the scenario is about
    await asyncio.to_thread(trial.bed.server.start)


async def two_nodes_at_once(trial: Trial, kill_at: int) -> None:
    await trial.at_step(kill_at)
    await trial.kill_nodes(trial.node(1), trial.node(2))


async def node_killed(trial: Trial, kill_at: int) -> None:
    """Nothing but the planned faults of the spec, or one node killed at `kill_at`."""
    if not trial.spec.faults:
        await trial.at_step(kill_at)
        await trial.kill_nodes(trial.node(2))


def planted(effect: Literal["raise", "stuck", "spin"]):
    """Planned faults: node-2's ranks meet `effect` at `kill_at` (schema/run.py FaultInjection)."""
    return lambda spec, kill_at: [FaultInjection(node="node-2", step=kill_at, effect=effect).model_dump(mode="json")]


def second_fault_in_resume(node_of_second: Callable[[RunSpec], str]):
    """Planned faults: node-1's ranks die before step `kill_at`; in the next incarnation, the ranks
    of `node_of_second(spec)` die before the same step, its first new one (the survivors held the
    step before it)."""

    def faults(spec: RunSpec, kill_at: int) -> list[dict]:
        return [
            FaultInjection(node="node-1", step=kill_at).model_dump(mode="json"),
            FaultInjection(node=node_of_second(spec), step=kill_at, incarnation=1).model_dump(mode="json"),
        ]

    return faults


def first_spare(spec: RunSpec) -> str:
    return f"node-{spec.cluster.active_nodes}"


async def spare_dies_before_claim(trial: Trial, kill_at: int) -> None:
    await trial.at_step(kill_at)
    node, spare = trial.node(2), trial.spare()
    await trial.kill_nodes(node)
    await trial.quarantined(node)
    await trial.kill_nodes(spare)
    trial.notes.append(f"spare {spare} killed {trial.where()}")


async def rank_hung(trial: Trial, kill_at: int) -> None:
    await trial.at_step(kill_at)
    k, rank = trial.incarnation(), 2 * trial.spec.layout.ranks_per_node
    trial.stop_processes([trial.run.pid_file(k, rank)])
    await hang_judged(trial, k, trial.node(2), time.time())


async def node_hung(trial: Trial, kill_at: int) -> None:
    await trial.at_step(kill_at)
    k, node = trial.incarnation(), trial.node(2)
    index = trial.assignment(k).nodes.index(node)
    per_node = trial.spec.layout.ranks_per_node
    pid_files = [trial.run.node_pid_file(k, index)]
    pid_files += [trial.run.pid_file(k, r) for r in range(index * per_node, (index + 1) * per_node)]
    standby = trial.run.standby(node) / "pid"
    trial.stop_processes(pid_files + ([standby] if standby.exists() else []))
    await hang_judged(trial, k, node, time.time())


async def hang_judged(trial: Trial, k: int, node: str, stopped_at: float) -> None:
    """Once the next incarnation trains, continue what was stopped (a partition that heals) and
    note how soon the hang was found; a stopped process that outlived drain is a failure."""
    await wait_for_incarnation(trial, k + 1)
    await trial.at_step(trial.step() + 1)
    alive = trial.continue_stopped()
    trial.notes.append(f"{len(trial.stopped)} process(es) stopped; {alive} still alive once the run went on")
    if alive:
        trial.notes.append("FAIL stopped processes outlived drain")
    trial.hang = (node, stopped_at)


async def wait_for_incarnation(trial: Trial, k: int) -> None:
    await wait_for(lambda: trial.trained_in(k), f"incarnation {k} to train", timeout=180)


def corrupt(path: Path) -> None:
    """Flip one byte in the middle of `path`."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def corrupt_checkpoints(newest_only: bool):
    async def act(trial: Trial, kill_at: int) -> None:
        await trial.at_step(kill_at)
        steps = trial.run.checkpoint_steps(complete_only=True)
        if not steps:
            raise ChaosError(f"no complete checkpoint at step {trial.step()} to corrupt")
        for step in steps[-1:] if newest_only else steps:
            shard = max(
                (p for p in trial.run.checkpoint(step).iterdir() if p.suffix == ".distcp"),
                key=lambda p: p.stat().st_size,
            )
            corrupt(shard)
            trial.corrupted.add(step)
        await trial.kill_nodes(trial.node(2))
        trial.notes.append(f"corrupted checkpoint(s) {sorted(trial.corrupted)}")

    return act


def full_checkpoint(spec: RunSpec, kill_at: int) -> int:
    """The newest checkpoint step before `kill_at`: the one the full disk loses."""
    return kill_at // spec.trainer.checkpoint_every * spec.trainer.checkpoint_every


async def disk_full_then_node(trial: Trial, kill_at: int) -> None:
    """The save of the checkpoint before `kill_at` fails on a full disk; the run must go on, say so,
    and when a node dies at `kill_at`, resume from the checkpoint before the lost one."""
    lost = full_checkpoint(trial.spec, kill_at)
    trial.disk_full = lost
    await trial.at_step(kill_at)
    # The asynchronous write fails in the background, some steps after it began (more under load):
    # the node of the full disk dies the moment its rank has told of the loss in its heartbeat, its
    # launcher with it, so no report of that node ever carries the warning: detect reads every
    # rank's last heartbeat at the fault, and the run's status must hold it all the same
    # (disk_full_checks).
    said = f"checkpoint of step {lost} not written"
    await wait_for(lambda: trial.warned(said), f"the warning '{said}'", 120)
    await trial.kill_nodes(trial.node(1))


async def node_in_async_save(trial: Trial, kill_at: int) -> None:
    """The planned fault kills node-1 while the checkpoint before `kill_at` is being written."""
    trial.in_flight = full_checkpoint(trial.spec, kill_at)


def in_async_save(spec: RunSpec, kill_at: int) -> list[dict]:
    step = full_checkpoint(spec, kill_at)
    return [FaultInjection(node="node-1", step=step, point="checkpoint").model_dump(mode="json")]


def in_survivor_save(spec: RunSpec, kill_at: int) -> list[dict]:
    """node-2 dies before step `kill_at`; node-0 dies while it saves the step before as a survivor,
    or, where survivors keep their processes, at the boundary where it would wait with that step."""
    point = "boundary" if spec.recovery.in_process else "survivor_save"
    return [
        FaultInjection(node="node-2", step=kill_at).model_dump(mode="json"),
        FaultInjection(node="node-0", step=kill_at - 1, point=point).model_dump(mode="json"),
    ]


async def node_in_survivor_save(trial: Trial, kill_at: int) -> None:
    """The planned faults do it; the judge checks that node-0 did die half-way through its save
    (or at its boundary)."""
    trial.half_saved = "node-0"


async def worker_and_node(trial: Trial, kill_at: int) -> None:
    await trial.at_step(kill_at)
    worker = trial.bed.workers[-1]
    await asyncio.gather(asyncio.to_thread(worker.kill), trial.kill_nodes(trial.node(2)))
    trial.bed.start_worker()


NO_SURVIVORS = {"survivor_grace_seconds": 0, "in_process": False}
"""Recovery without the survivors' state, saved or kept in their processes, so that resume must take a checkpoint."""

SCENARIOS = [
    Scenario("node-killed", "one node SIGKILLed mid-run (the baseline)", node_killed),
    *(worker_killed_in(stage) for stage in STAGES),
    Scenario(
        "worker-in-every-stage",
        "the worker SIGKILLed inside each stage of one recovery in turn, a fresh one standing by",
        worker_killed_in_every_stage,
        failpoints=(STAGE_FAILPOINTS[STAGES[0]],),
        own_bed=True,
    ),
    Scenario(
        "server-mid-recovery",
        "the Temporal server SIGKILLed mid-recovery, back 5 s later",
        server_killed_mid_recovery,
        own_bed=True,
    ),
    Scenario(
        "server-down-at-fault",
        "the Temporal server down when the node dies, back 10 s later",
        server_down_at_fault,
        own_bed=True,
    ),
    Scenario("two-nodes-two-spares", "two nodes dying at once, two spares", two_nodes_at_once, spares=2),
    Scenario("two-nodes-one-spare", "two nodes dying at once, one spare (reshard)", two_nodes_at_once, spares=1),
    Scenario(
        "second-node-in-resume",
        "a second node dying in resume, before the first new step",
        node_killed,
        faults=second_fault_in_resume(lambda spec: "node-2"),
    ),
    Scenario("spare-before-claim", "the spare dying before it is claimed", spare_dies_before_claim),
    Scenario(
        "spare-after-claim",
        "the spare dying after its claim, before its first step",
        node_killed,
        faults=second_fault_in_resume(first_spare),
    ),
    Scenario(
        "slow-node",
        f"a node {SLOW_FACTOR:g}x slower than its peers (a straggler), swapped at a step boundary",
        node_slowed,
        recovery={"stragglers": {"window_seconds": STRAGGLER_WINDOW_SECONDS}},
    ),
    Scenario(
        "sick-node", "a node's health check failing mid-run, swapped at a step boundary", node_sick, health=SICK_CHECK
    ),
    Scenario(
        "rank-in-collective",
        "one rank waiting forever in a collective its peers never join, every process running",
        node_killed,
        faults=planted("stuck"),
    ),
    Scenario(
        "rank-spinning",
        "one rank looping forever on the CPU before the step's collective, its peers waiting in it",
        node_killed,
        faults=planted("spin"),
    ),
    Scenario("rank-hung", "one rank stopped (SIGSTOP)", rank_hung),
    Scenario("node-hung", "every process of a node stopped (a partitioned host)", node_hung),
    Scenario(
        "rank-raises",
        "one rank raising a Python exception, its peers fine",
        node_killed,
        faults=planted("raise"),
    ),
    Scenario(
        "newest-checkpoint-corrupt",
        "the newest checkpoint corrupted (one byte), no survivors",
        corrupt_checkpoints(True),
        recovery=NO_SURVIVORS,
    ),
    Scenario(
        "all-checkpoints-corrupt",
        "every checkpoint corrupted, no survivors",
        corrupt_checkpoints(False),
        recovery=NO_SURVIVORS,
    ),
    Scenario(
        "disk-full",
        "the disk full while a checkpoint is written (ENOSPC), then a node lost, no survivors",
        disk_full_then_node,
        recovery=NO_SURVIVORS,
        faults=lambda spec, kill_at: [
            FaultInjection(
                node="node-1", step=full_checkpoint(spec, kill_at), point="checkpoint", effect="disk_full"
            ).model_dump(mode="json")
        ],
    ),
    Scenario(
        "node-in-async-save",
        "a node dying while an async checkpoint is written",
        node_in_async_save,
        faults=in_async_save,
    ),
    Scenario(
        "second-node-in-survivor-save",
        "a second node dying while the survivors save the interrupted step (kept in their processes: at its boundary)",
        node_in_survivor_save,
        faults=in_survivor_save,
    ),
    Scenario("worker-and-node", "the worker and a node dying together", worker_and_node, own_bed=True),
    Scenario(
        "controls-in-drain",
        f"a node lost while a survivor is stopped, which holds drain {SURVIVOR_HOLD_SECONDS:g} s; the status query "
        "and a pause answered meanwhile",
        controls_in_drain,
        recovery={"survivor_grace_seconds": SURVIVOR_HOLD_SECONDS},
    ),
]
BY_NAME = {s.name: s for s in SCENARIOS}
