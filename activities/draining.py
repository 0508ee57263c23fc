"""What drain does to the cluster, as two blocking calls (each activity's hop to a thread waits
for the worker's event loop, which a burst of faults keeps busy): hold the blamed nodes out, then
end the incarnation and clear what it left half done."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from lazarus.infra.backend import ClusterBackend, QuarantineRefused
from lazarus.infra.survivors import fall_back, wait_at_boundary
from lazarus.schema.stages import DrainInput, DrainResult, DrainWaits

T = TypeVar("T")


def hold_out(cluster: ClusterBackend, request: DrainInput) -> str:
    """Lodge the run's need of spares (first: a run recovering at the same moment must see it
    before it claims), then quarantine the blamed nodes; ClusterError names a node or run unknown.
    Returns why nothing was quarantined ('' when the nodes were): the pool's breaker is open, and
    the run, which will not recover, needs no spare."""
    if request.want is not None:
        cluster.want_spares(request.run_id, request.want)
    try:
        cluster.quarantine(request.run_id, request.nodes, request.reason, counted=request.breaker)
    except QuarantineRefused as refused:
        cluster.drop_want(request.run_id)
        return str(refused)
    return ""


class Waits:
    """The drain's waits for the ranks, each under its grace and all of this call's under its cap
    (DrainInput.wait_cap_seconds): a grace goes on from what an earlier call waited of it."""

    def __init__(self, request: DrainInput):
        self.waited = request.waited.model_copy() if request.waited is not None else DrainWaits()
        self.cap = request.wait_cap_seconds
        self.cut = False  # a wait ended at the cap with its grace running

    def wait(self, kind: str, grace: float, call: Callable[[float], T]) -> T:
        """`call(seconds)` for what is left of `grace` (kind: a DrainWaits field), at most what is
        left of the cap; sets `cut` when the cap, not the grace, ended it."""
        left = max(0.0, grace - getattr(self.waited, kind))
        spent = self.waited.survivors + self.waited.checkpoint + self.waited.boundary
        granted = left if self.cap is None else max(0.0, min(left, self.cap - spent))
        started = time.monotonic()
        result = call(granted)
        took = time.monotonic() - started
        setattr(self.waited, kind, getattr(self.waited, kind) + took)
        # The wait polls until its deadline or its condition: one that took its whole grant ran out.
        self.cut = granted < left and took >= granted
        return result

    def unfinished(self) -> DrainResult:
        """What a call cut at its cap returns: nothing done after the waits."""
        return DrainResult(quarantined=[], stopped_ranks=[], removed_partial_checkpoints=[], unfinished=self.waited)


def end_incarnation(cluster: ClusterBackend, request: DrainInput, held_back: str = "") -> DrainResult:
    """Read the newest step where asked, stop the ranks of a hung node, give the survivors and a
    checkpoint in flight their grace, stop every rank of the incarnation, and remove partial
    checkpoints and stale survivors' states; or, cut at the request's cap with a grace running,
    what was waited (DrainResult.unfinished), every rank as it was."""
    run_id, incarnation = request.run_id, request.incarnation
    waits = Waits(request)
    step = cluster.observe(run_id, incarnation).newest_step() if request.read_step else None
    if request.stop_first:
        cluster.stop_nodes(run_id, incarnation, request.stop_first)
    if request.boundary_grace_seconds > 0 and cluster.keeps_survivors:
        kept = keep_survivors(cluster, request, waits)
        if waits.cut:
            return waits.unfinished()
        if kept:
            stopped = cluster.stop_nodes(run_id, incarnation, request.nodes)
            # A survivor waits at its boundary only once it has given up its save in flight, whose
            # process group it left (trainer/gpt/train.py keep_process): uncommitted now, it never will be.
            in_flight, committed = cluster.await_checkpoint_in_flight(run_id, incarnation, 0)
            return DrainResult(
                quarantined=[] if held_back else sorted(request.nodes),
                held_back=held_back,
                stopped_ranks=stopped,
                removed_partial_checkpoints=cluster.remove_partial_checkpoints(run_id),
                in_flight_checkpoint=in_flight,
                in_flight_committed=committed,
                kept_survivors=kept,
                step=step,
            )
    survivors = {}
    if request.survivor_grace_seconds > 0:
        # Survivors that wait at their boundary (RecoveryPolicy.in_process) save and end as the others do.
        fall_back(cluster.run_dir(run_id), incarnation)
        survivors = waits.wait(
            "survivors", request.survivor_grace_seconds, lambda s: cluster.await_survivors(run_id, incarnation, s)
        )
        if waits.cut:
            return waits.unfinished()
    in_flight, committed = waits.wait(
        "checkpoint", request.save_grace_seconds, lambda s: cluster.await_checkpoint_in_flight(run_id, incarnation, s)
    )
    if waits.cut:
        return waits.unfinished()
    stopped = cluster.stop_incarnation(run_id, incarnation)
    removed = cluster.remove_partial_checkpoints(run_id)
    cluster.remove_stale_survivors(run_id, incarnation)
    return DrainResult(
        quarantined=[] if held_back else sorted(request.nodes),
        held_back=held_back,
        stopped_ranks=stopped,
        removed_partial_checkpoints=removed,
        in_flight_checkpoint=in_flight,
        in_flight_committed=committed,
        survivors=survivors,
        step=step,
    )


def keep_survivors(cluster: ClusterBackend, request: DrainInput, waits: Waits) -> dict[int, int]:
    """Wait for every rank off the blamed nodes to reach its step boundary: rank -> the step each
    holds; else tell those waiting to fall back to the restart path, and return {} (as well when
    the wait was cut at the call's cap, without a word to them)."""
    run, assignment = cluster.run_dir(request.run_id), cluster.assignment(request.run_id, request.incarnation)
    if assignment is None:
        return {}
    kept = waits.wait(
        "boundary",
        request.boundary_grace_seconds,
        lambda s: wait_at_boundary(run, assignment, request.nodes, s),
    )
    if not kept and not waits.cut:
        fall_back(run, request.incarnation)
    return kept
