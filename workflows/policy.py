"""The recovery decision as a pure function of the inventory (deterministic, no I/O)."""

from __future__ import annotations

from spec.records import Assignment, Decision, Inventory


def plan_recovery(inventory: Inventory, assignment: Assignment, lost: list[str]) -> Decision:
    """Decide how the next incarnation gets its nodes after `lost` nodes failed.

    A hot spare keeps the world size and so the math: each lost node that is part of the
    assignment gets one free healthy spare, in name order, at the same place in rank
    order. Without enough spares the run waits for capacity (resharding to fewer replicas
    is not done here).
    """
    lost_here = [node for node in assignment.nodes if node in set(lost)]
    spares = inventory.free_spares()
    if len(spares) < len(lost_here):
        return Decision(
            action="wait",
            layout=assignment.layout,
            reason=f"lost {len(lost_here)} node(s) ({', '.join(lost_here)}) but {len(spares)} free spare(s); waiting for capacity",
        )
    replacements = dict(zip(lost_here, spares))
    pairs = ", ".join(f"{old} -> {new}" for old, new in replacements.items())
    return Decision(
        action="replace",
        replacements=replacements,
        layout=assignment.layout,
        reason=f"hot spare replaces lost node, world size {assignment.layout.world_size} kept ({pairs})",
    )
