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

from temporalio import activity
from temporalio.client import Client

from lazarus.activities.failpoints import Failpoints
from lazarus.chaos.bed import POLL_SECONDS, ChaosError, wait_for
from lazarus.client.config import Settings
from lazarus.client.runs import start_run
from lazarus.infra.backend import ClusterBackend
from lazarus.infra.backends.local.cluster import LocalCluster
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
        status = {"a": await a.result(), "b": await b.result()}
    return Race(ids, status, runs)
