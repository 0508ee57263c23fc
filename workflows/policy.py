"""The recovery decision as a pure function of the inventory (deterministic, no I/O).

Capacity is counted in model replicas, not nodes: a lost node takes down every replica
(its pipeline stages, FSDP shard groups and tensor-parallel groups) that has a rank on it.
"""

from __future__ import annotations

from lazarus.schema.layout import Layout
from lazarus.schema.pool import SpareWant
from lazarus.schema.records import Assignment, Decision, FaultReport, Inventory


def nodes_for(layout: Layout, dp: int) -> int | None:
    """Nodes that dp replicas of this layout fill exactly; None if they would leave a node part-used."""
    ranks = dp * layout.replica_ranks
    return ranks // layout.ranks_per_node if ranks % layout.ranks_per_node == 0 else None


def broken_replicas(assignment: Assignment, lost: set[str]) -> list[int]:
    """Replicas with at least one rank on a lost node."""
    layout = assignment.layout
    return sorted(
        {
            layout.replica_of_rank(rank)
            for index, node in enumerate(assignment.nodes)
            if node in lost
            for rank in range(index * layout.ranks_per_node, (index + 1) * layout.ranks_per_node)
        }
    )


def _fits(layout: Layout, dp: int, nodes: int) -> bool:
    """Whether dp replicas of the layout fill whole nodes, and at most `nodes` of them."""
    needed = nodes_for(layout, dp)
    return needed is not None and needed <= nodes


def spare_want(run_id: str, assignment: Assignment, fault: FaultReport, priority: int) -> SpareWant:
    """What a fault makes the run need of the pool's spares: one per lost node, ranked by the run's
    priority and then by the ranks of the replicas the fault broke."""
    lost = set(fault.nodes) & set(assignment.nodes)
    return SpareWant(
        run_id=run_id,
        incarnation=fault.incarnation,
        needed=len(lost),
        priority=priority,
        lost_ranks=len(broken_replicas(assignment, lost)) * assignment.layout.replica_ranks,
        fault_at=fault.occurred_at,
    )


def shared_spares(
    inventory: Inventory, want: SpareWant | None, node_limit: int | None, needed: int
) -> tuple[list[str], str]:
    """The pool's free spares this run may take now (Inventory.spares_for), and what the other
    runs and the run's own allowance had to do with it, as a clause of the decision's reason."""
    spares, ahead = inventory.spares_for(want, node_limit)
    notes = []
    if len(spares) < needed:
        for rival in ahead:
            if rival.placed and rival.got == 0:
                continue  # it went without spares itself
            said = f"took {rival.got}" if rival.placed else f"needs {rival.needed}"
            why = rival.why_before(want) if want is not None else "a recovery comes before a regrow"
            notes.append(f"run {rival.run_id} {said} of the pool's spares first ({why})")
        if len(inventory.spares_for(want, None)[0]) > len(spares):
            notes.append(
                f"this run holds {inventory.held()} node(s), active and quarantined, of the {node_limit} its spec "
                "allows (cluster.active_nodes + cluster.spare_nodes)"
            )
    elif want is not None:
        behind = [w for w in inventory.wants if not w.placed and w.needed and want.outranks(w)]
        notes += [f"ahead of run {w.run_id} for the pool's spares ({want.why_before(w)})" for w in behind]
    return spares, "; ".join(notes)


def plan_recovery(
    inventory: Inventory,
    assignment: Assignment,
    lost: list[str],
    target_dp: int,
    min_dp: int,
    want: SpareWant | None = None,
    node_limit: int | None = None,
) -> Decision:
    """Decide how the next incarnation gets its nodes after `lost` nodes failed.

    Prefer hot spares: each lost node gets a free healthy spare at the same place in rank
    order, so the world size and the math stay the same. The spares are the pool's: other
    runs' needs that outrank `want` come first, and the run holds at most `node_limit` nodes
    (shared_spares). Without enough spares, reshard to the largest dp >= min_dp that the intact
    replicas, the healthy nodes of broken replicas and the spares it may take can fill; healthy
    nodes left over go back to the pool. If not even min_dp fits, wait for capacity.
    """
    if inventory.claimed is not None:
        return plan_claimed(assignment, inventory.claimed, lost, target_dp)
    lost_set = set(lost) & set(assignment.nodes)
    lost_here = [node for node in assignment.nodes if node in lost_set]
    broken = broken_replicas(assignment, lost_set)
    spares, contest = shared_spares(inventory, want, node_limit, len(lost_here))
    decision = _plan(assignment, lost_set, lost_here, broken, spares, target_dp, min_dp)
    rivals = sorted({w.run_id for w in inventory.wants})
    reason = f"{decision.reason}; {contest}" if contest else decision.reason
    return decision.model_copy(update={"reason": reason, "rivals": rivals})


def _plan(assignment, lost_set, lost_here, broken, spares, target_dp, min_dp) -> Decision:
    """plan_recovery's rule, on the spares the run may take."""
    layout = assignment.layout
    if not lost_here:
        # The program's own failure (no node blamed): torchrun's restart, on the same nodes.
        return Decision(
            action="replace",
            layout=layout,
            nodes=list(assignment.nodes),
            below_target_dp=layout.dp < target_dp,
            reason=f"restart in place on the same nodes: no node is blamed, world size {layout.world_size} kept",
        )
    if len(spares) >= len(lost_here):
        return _replace_in_place(assignment, lost_here, spares, broken, target_dp)

    pool = _reshard_pool(assignment, lost_set, broken) + spares
    fitting = (dp for dp in range(layout.dp - 1, 0, -1) if _fits(layout, dp, len(pool)))
    new_dp = next(fitting, 0)
    if new_dp < min_dp:
        return Decision(
            action="wait",
            layout=layout,
            lost_replicas=broken,
            below_target_dp=True,
            reason=(
                f"lost {len(lost_here)} node(s) ({', '.join(lost_here)}) and replica(s) "
                f"{', '.join(map(str, broken))}; {len(spares)} free spare(s); "
                f"the healthy nodes fit dp={new_dp}, below recovery.min_dp={min_dp}; waiting for capacity"
            ),
        )
    new_layout = layout.model_copy(update={"dp": new_dp})
    nodes = pool[: nodes_for(layout, new_dp)]
    released = [n for n in assignment.nodes if n not in lost_set and n not in nodes]
    return Decision(
        action="reshard",
        layout=new_layout,
        nodes=nodes,
        lost_replicas=broken,
        released_nodes=released,
        below_target_dp=new_dp < target_dp,
        reason=(
            f"lost replica(s) {', '.join(map(str, broken))} with node(s) {', '.join(lost_here)}; "
            f"{len(spares)} free spare(s); reshard dp {layout.dp} -> {new_dp} (global batch kept)"
            + (f"; {', '.join(released)} back to the spare pool" if released else "")
        ),
    )


def plan_claimed(assignment: Assignment, claimed: Assignment, lost: list[str], target_dp: int) -> Decision:
    """The decision an earlier execution of the same stages made and claimed (Inventory.claimed).
    They ran again after a workflow task timeout or a worker's death; the pool now counts the
    claimed nodes as the run's own, not as free spares, so deciding afresh would reshard a run whose
    spare is in hand already (or pick another spare the claim never gets)."""
    layout, lost_set = assignment.layout, set(lost) & set(assignment.nodes)
    released = [n for n in assignment.nodes if n not in lost_set and n not in claimed.nodes]
    again = f"incarnation {claimed.incarnation} was claimed on {', '.join(claimed.nodes)} before these stages ran again"
    if claimed.layout != layout:
        return Decision(
            action="reshard",
            layout=claimed.layout,
            nodes=list(claimed.nodes),
            lost_replicas=broken_replicas(assignment, lost_set),
            released_nodes=released,
            below_target_dp=claimed.layout.dp < target_dp,
            reason=f"reshard dp {layout.dp} -> {claimed.layout.dp}: {again}",
        )
    replacements = {old: new for old, new in zip(assignment.nodes, claimed.nodes, strict=True) if old != new}
    pairs = ", ".join(f"{old} -> {new}" for old, new in replacements.items())
    kept = (
        f"hot spare replaces lost node, world size {layout.world_size} kept ({pairs})" if pairs else "restart in place"
    )
    return Decision(
        action="replace",
        replacements=replacements,
        layout=layout,
        nodes=list(claimed.nodes),
        lost_replicas=broken_replicas(assignment, lost_set),
        released_nodes=released,
        below_target_dp=layout.dp < target_dp,
        reason=f"{kept}: {again}",
    )


def _replace_in_place(
    assignment: Assignment, lost_here: list[str], spares: list[str], broken: list[int], target_dp: int
) -> Decision:
    layout = assignment.layout
    # There may be more free spares than lost nodes: the first ones, in name order, are taken.
    replacements = dict(zip(lost_here, spares[: len(lost_here)], strict=True))
    pairs = ", ".join(f"{old} -> {new}" for old, new in replacements.items())
    return Decision(
        action="replace",
        replacements=replacements,
        layout=layout,
        nodes=[replacements.get(node, node) for node in assignment.nodes],
        lost_replicas=broken,
        below_target_dp=layout.dp < target_dp,
        reason=f"hot spare replaces lost node, world size {layout.world_size} kept ({pairs})",
    )


def _reshard_pool(assignment: Assignment, lost: set[str], broken: list[int]) -> list[str]:
    """The run's healthy nodes a reshard may use, in the order it fills them: the nodes of intact
    replicas, then the survivors of broken ones."""
    layout = assignment.layout
    per_node = layout.ranks_per_node
    replicas_of_node = [
        {layout.replica_of_rank(rank) for rank in range(i * per_node, (i + 1) * per_node)}
        for i in range(len(assignment.nodes))
    ]
    intact = [n for i, n in enumerate(assignment.nodes) if not replicas_of_node[i] & set(broken)]
    orphans = [n for i, n in enumerate(assignment.nodes) if replicas_of_node[i] & set(broken) and n not in lost]
    return intact + orphans


def batch_said(decision: Decision, lazarus_keeps_batch: bool) -> Decision:
    """The decision with its reason true to the script: Lazarus keeps the global batch through a
    reshard (gradient accumulation) only for the built-in trainer and lazarus.session scripts; any
    other script's own arithmetic decides it."""
    if lazarus_keeps_batch or "global batch kept" not in decision.reason:
        return decision
    kept = "the script's own arithmetic decides its global batch"
    return decision.model_copy(update={"reason": decision.reason.replace("global batch kept", kept)})


def plan_operator_reshard(inventory: Inventory, assignment: Assignment, dp: int, target_dp: int) -> Decision:
    """An operator's reshard to `dp` replicas: the current nodes first, then free spares.

    Returns action "wait" (with the reason) when the nodes do not fit `dp`.
    """
    if inventory.claimed is not None:
        return plan_claimed(assignment, inventory.claimed, [], target_dp)
    layout = assignment.layout
    needed = nodes_for(layout, dp)
    pool = list(assignment.nodes) + inventory.free_spares()
    if needed is None or needed > len(pool):
        why = (
            f"dp={dp} would leave a node part-used"
            if needed is None
            else f"dp={dp} needs {needed} nodes; the run holds {len(assignment.nodes)} "
            f"and {len(pool) - len(assignment.nodes)} spare(s) are free"
        )
        return Decision(action="wait", layout=layout, reason=why)
    nodes = pool[:needed]
    released = [node for node in assignment.nodes if node not in nodes]
    return Decision(
        action="reshard",
        layout=layout.model_copy(update={"dp": dp}),
        nodes=nodes,
        released_nodes=released,
        below_target_dp=dp < target_dp,
        reason=f"operator: reshard dp {layout.dp} -> {dp}"
        + (f"; {', '.join(released)} back to the spare pool" if released else ""),
    )


def regrow_nodes(assignment: Assignment, wanted_dp: int) -> int | None:
    """The fewest more nodes that take the run to a larger dp, at most `wanted_dp`, on whole nodes;
    None when it runs at `wanted_dp` already (or no larger dp fills whole nodes)."""
    layout = assignment.layout
    more = [nodes_for(layout, dp) for dp in range(layout.dp + 1, wanted_dp + 1)]
    counts = [n - len(assignment.nodes) for n in more if n is not None]
    return min(counts) if counts else None


def plan_regrow(inventory: Inventory, assignment: Assignment, wanted_dp: int, node_limit: int | None) -> Decision:
    """Grow to the largest dp <= `wanted_dp` that the run's nodes and the spares it may take fill:
    spares no other run's recovery needs (a recovery comes before a regrow), within `node_limit`.
    The run's nodes keep their places; the new ones come after. Action "wait" when none fits."""
    if inventory.claimed is not None:
        return plan_claimed(assignment, inventory.claimed, [], wanted_dp)
    layout = assignment.layout
    spares, contest = shared_spares(inventory, None, node_limit, needed=1)
    pool = list(assignment.nodes) + spares
    fitting = [dp for dp in range(wanted_dp, layout.dp, -1) if _fits(layout, dp, len(pool))]
    if not fitting:
        why = f"no larger dp than {layout.dp} fits the run's {len(assignment.nodes)} node(s) and {len(spares)} spare(s)"
        return Decision(action="wait", layout=layout, reason=f"{why}; {contest}" if contest else why)
    dp = fitting[0]
    nodes = pool[: nodes_for(layout, dp)]
    added = [n for n in nodes if n not in assignment.nodes]
    return Decision(
        action="reshard",
        layout=layout.model_copy(update={"dp": dp}),
        nodes=nodes,
        below_target_dp=dp < wanted_dp,
        rivals=sorted({w.run_id for w in inventory.wants}),
        reason=f"regrow: the pool has the nodes again; dp {layout.dp} -> {dp} with {', '.join(added)} "
        "(global batch kept)",
    )
