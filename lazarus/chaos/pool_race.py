"""Two runs of one pool racing for its one spare (tests/e2e/test_pool.py, tests/k8s/test_pool_race.py,
bench/pool.py), on either backend.

Run `a` (the given priority) and run `b` (priority 0) each train on two nodes of their own and
see one free spare. Both lose a node at once; the policy gives the spare to one, the other
reshards; then a's dead node is returned, and b grows back into it.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from temporalio import activity
from temporalio.client import Client

from lazarus.activities.failpoints import Failpoints
from lazarus.chaos.bed import POLL_SECONDS, ChaosError, wait_for
from lazarus.chaos.judge import Row, judge, train_without_fault
from lazarus.client.config import Settings
from lazarus.client.runs import start_run
from lazarus.infra.backend import ClusterBackend
from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.infra.harness.temporal_server import local_environment
from lazarus.schema import RunSpec, RunStatus, controls
from lazarus.schema.contract import read_metrics
from lazarus.schema.rundir import RunDir
from lazarus.worker import build_worker
from lazarus.workflows.training_run import TrainingRun


class AtOnce(Failpoints):
    """Holds each drain, after its quarantine, until `lodged()` counts both runs' wants in the pool:
    the faults are then at once for the policy, whatever the load of the machine."""

    def __init__(self, lodged: Callable[[], int]):
        super().__init__()
        self.lodged = lodged

    async def reach(self, name: str) -> None:
        if name != "drain.after_quarantine":
            return
        deadline = time.monotonic() + 60
        while self.lodged() < 2:
            if time.monotonic() > deadline:
                raise ChaosError("gave up after 60 s waiting for both runs' wants in the pool")
            activity.heartbeat()  # the drain is held on purpose, not lost
            await asyncio.sleep(POLL_SECONDS)


@dataclass
class Pool:
    """How to break and watch one backend's pool for the race."""

    cluster: ClusterBackend
    victims: dict[str, str]
    """Run key (a, b) -> the node of its own that dies."""
    kill: Callable[[str, str], object]
    """kill(run_id, node): the node dies, every process on it with it."""
    lodged: Callable[[], int]
    """How many runs' wants the pool holds."""
    repair: Callable[[str], object] = lambda node: None
    """repair(node): a dead node works again (on the local backend, returning it is the repair)."""


def local_pool(cluster: LocalCluster) -> Pool:
    """The local pool of a fresh home: a gets node-0 and node-1, b node-3 and node-4, node-2 is the spare."""
    return Pool(cluster, {"a": "node-1", "b": "node-3"}, cluster.kill_node, lambda: len(cluster.pool.read().wants))


@dataclass
class Race:
    """What the race left: each run's id, final status and directory."""

    ids: dict[str, str]
    status: dict[str, RunStatus]
    runs: dict[str, RunDir]


def _newest_step(run: RunDir, incarnation: int | None = None) -> int:
    lines = (
        [m for m in read_metrics(run) if incarnation is None or m.incarnation == incarnation]
        if run.metrics_file.exists()
        else []
    )
    return lines[-1].step if lines else 0


async def race_for_one_spare(
    client: Client, pool: Pool, spec: RunSpec, priority_a: int, kill_at: int = 10, spec_b: RunSpec | None = None
) -> Race:
    """Run the race on `pool` (nothing else running on it) with a worker of its own; returns once
    both runs ended. `spec` says where (backend, home); b runs `spec_b` if given (on Kubernetes
    emulated on one host, its own rendezvous port)."""
    cluster = pool.cluster
    first = spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"priority": priority_a})})
    queue = f"pool-{uuid.uuid4().hex[:6]}"
    ids = {"a": f"a-{uuid.uuid4().hex[:6]}", "b": f"b-{uuid.uuid4().hex[:6]}"}
    runs = {key: cluster.run_dir(run_id) for key, run_id in ids.items()}
    async with build_worker(client, queue, cluster, failpoints=AtOnce(pool.lodged)):
        settings = Settings(task_queue=queue, home=cluster.home)
        a = await start_run(client, settings, first, ids["a"])
        # a's launch first, so that each run's nodes are the ones `pool.victims` names.
        await wait_for(lambda: runs["a"].assignment_file(0).exists(), "a's launch")
        b = await start_run(client, settings, spec_b or spec, ids["b"])
        await wait_for(lambda: min(_newest_step(r) for r in runs.values()) >= kill_at, f"both at step {kill_at}")
        killers = [threading.Thread(target=pool.kill, args=(ids[key], node)) for key, node in pool.victims.items()]
        for killer in killers:
            killer.start()
        for killer in killers:
            killer.join()
        await wait_for(lambda: _newest_step(runs["b"], incarnation=1), "b training again after its recovery")
        # a's dead node, repaired, goes back to the pool through a: b may grow back into it.
        pool.repair(pool.victims["a"])
        returned = controls.ReturnNodeRequest(node=pool.victims["a"])
        await a.execute_update(TrainingRun.return_node, returned)
        deadline = time.monotonic() + RACE_END_SECONDS
        status = {key: await ended(handle, key, deadline - time.monotonic()) for key, handle in (("a", a), ("b", b))}
    return Race(ids, status, runs)


RACE_END_SECONDS = 200.0
"""How long both runs get to end once a's node is returned (seconds): a few times what they take
here, and short of the tests' own timeout, so that a race that hangs says where each run stands."""


async def ended(handle, key: str, timeout: float) -> RunStatus:
    """The run's final status; ChaosError naming its state, step, incidents and regrows at `timeout`."""
    try:
        return await asyncio.wait_for(handle.result(), max(1.0, timeout))
    except TimeoutError:
        status: RunStatus = await handle.query(TrainingRun.status)
        incidents = [(i.fault.kind, i.outcome, list(i.stages)) for i in status.incidents]
        regrows = [
            (g.outcome, g.to_dp, {n: s.ended_at is not None for n, s in g.stages.items()}) for g in status.regrowths
        ]
        raise ChaosError(
            f"run {key} had not ended {RACE_END_SECONDS:g} s after the return: {status.state.value} at step "
            f"{status.step}; incidents {incidents}; regrows (outcome, dp, stage ended) {regrows}"
        ) from None


RACE_ROW = "two-runs-one-spare"
"""The chaos matrix's row of the race (bench/chaos.py): two runs of the matrix's spec, shrunk to
two nodes each, lose a node at once with one spare between them."""


def race_spec(spec: RunSpec) -> RunSpec:
    """The matrix's spec for the race: dp 2 on two nodes of its own, one spare (local_pool's home)."""
    data = spec.model_dump(mode="json")
    data["layout"] |= {"dp": 2, "pp": 1, "dp_shard": 1, "tp": 1, "ranks_per_node": 1}
    data["cluster"] |= {"backend": "local", "active_nodes": 2, "spare_nodes": 1}
    data["faults"] = []
    return RunSpec.model_validate(data)


def judge_race(race: Race, spec: RunSpec, reference: dict[int, float]) -> Row:
    """The race as one row: each run judged as a scenario's (no checkpoint watch: none counted lost),
    and what the race must show: a (priority) replaced, b resharded and grew back once, no node in
    both runs' assignments, no claim lost and retried."""
    rows = {key: judge(f"{RACE_ROW}:{key}", spec, race.runs[key], race.status[key], reference, {}, {}) for key in "ab"}
    row = Row(scenario=RACE_ROW, notes=[f"{key}: {note}" for key, r in rows.items() for note in r.notes])
    row.state = "/".join(r.state for r in rows.values())
    row.recovered = all(r.recovered for r in rows.values())
    row.losses_equal = all(r.losses_equal for r in rows.values())
    differences = [r.max_loss_difference for r in rows.values() if r.max_loss_difference is not None]
    row.max_loss_difference = max(differences) if len(differences) == 2 else None
    for name in ("incidents", "new_incarnations", "duplicate_starts", "spares_claimed", "double_claims"):
        setattr(row, name, sum(getattr(r, name) for r in rows.values()))
    row.mttr_seconds = [m for r in rows.values() for m in r.mttr_seconds]
    row.restored_from = [f for r in rows.values() for f in r.restored_from]
    a, b = race.status["a"], race.status["b"]
    actions = [i.decision.action if i.decision else None for i in (*a.incidents, *b.incidents)]
    if actions != ["replace", "reshard"]:
        row.notes.append(f"FAIL decisions {actions}: a (priority 5) replaces, b reshards (one spare)")
    if [(g.outcome, g.to_dp) for g in b.regrowths] != [("regrown", 2)]:
        row.notes.append(f"FAIL b's regrows {[(g.outcome, g.to_dp) for g in b.regrowths]}: one, back to dp 2")
    if race.runs["b"].incarnations() != [0, 1, 2] or race.runs["a"].incarnations() != [0, 1]:
        row.notes.append(
            f"FAIL incarnations a {race.runs['a'].incarnations()}, b {race.runs['b'].incarnations()}: "
            "one per recovery and regrow"
        )
    shared = set(a.assignment.nodes) & set(b.assignment.nodes) if a.assignment and b.assignment else set()
    row.double_claims += len(shared)
    return row


async def race_row(folder: Path, spec: RunSpec) -> Row:
    """Run the race of the matrix's spec on a private dev server and a fresh home under `folder`."""
    started = time.monotonic()
    raced = race_spec(spec)
    reference = await asyncio.to_thread(train_without_fault, folder / "reference", raced)
    env = await local_environment()
    try:
        cluster = LocalCluster(folder / "home")
        race = await race_for_one_spare(env.client, local_pool(cluster), raced, priority_a=5)
    except ChaosError as error:
        return Row(scenario=RACE_ROW, notes=[f"FAIL {error}"], seconds=round(time.monotonic() - started, 1))
    finally:
        await env.shutdown()
    row = judge_race(race, raced, reference)
    row.seconds = round(time.monotonic() - started, 1)
    return row
