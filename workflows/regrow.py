"""Regrow: a run below the dp it wants (the spec's layout.dp, or an operator's reshard's) grows
back once the pool has the nodes again: a node returned, a spare freed, a run ended.

The watch asks detect to look at the pool with each progress report (regrow_nodes); when the
nodes are there, the run reads the pool again, decides (workflows/policy.py plan_regrow), has its
ranks checkpoint and stop at a step boundary, claims the nodes and resumes at the larger dp from
that checkpoint: no completed step is lost, and the global batch and sample order are kept. A
mixin of TrainingRun; the operator holds it with `recovery.regrow: false` (set_policy).
"""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from lazarus.activities.recovery import RecoveryActivities
    from lazarus.schema.records import Decision, Regrowth
    from lazarus.schema.stages import RescheduleInput
    from lazarus.workflows.policy import batch_said, plan_regrow, regrow_nodes
from lazarus.workflows.run_parts import RunParts
from lazarus.workflows.stage_calls import StageRefused

# Deprecated patches: each id's workflow.deprecate_patch stands where its workflow.patched stood, so
# that histories with the id's marker replay (the patch policy: docs/concepts/run-as-workflow.md).
REGROW_PATCH = "regrow"
"""Deprecated patch id: a run below its wanted dp grows back when the pool has the nodes (before: it stayed small)."""
CLAIM_LOST_PATCH = "regrow-claim-lost"
"""Patch id: a regrow whose nodes another run claimed after the ranks stopped resumes on the held
nodes (before: the run failed on the refused claim)."""


class Regrowing(RunParts):
    """Watching the pool for the nodes a smaller run wants back, and growing into them."""

    def _node_limit(self) -> int:
        cluster = self._start.spec.cluster
        return cluster.active_nodes + cluster.spare_nodes

    def _regrow_watch(self) -> int | None:
        """How many more nodes the watch should look for in the pool, or None when the run may not grow."""
        status = self._status
        if not self._policy.regrow or status.assignment is None:
            return None
        more = regrow_nodes(status.assignment, status.wanted_dp or self._start.spec.layout.dp)
        if more is not None:
            workflow.deprecate_patch(REGROW_PATCH)
        return more

    async def _regrow(self) -> bool:
        """Grow back into the pool's nodes; True when training is done."""
        status = self._status
        assert status.assignment is not None, "only a launched run regrows (_regrow_watch)"
        regrowth = Regrowth(
            number=len(status.regrowths) + 1,
            started_at=workflow.now(),
            from_dp=status.layout.dp,
            to_dp=status.layout.dp,
        )
        status.regrowths.append(regrowth)
        reading = RescheduleInput(run_id=status.run_id)
        inventory = await self._stage("reschedule", RecoveryActivities.reschedule, reading, regrowth)
        wanted = status.wanted_dp or self._start.spec.layout.dp
        decision = batch_said(
            plan_regrow(inventory, status.assignment, wanted, self._node_limit()), status.steps_from == "trainer"
        )
        regrowth.reason = decision.reason
        if decision.action == "wait":
            regrowth.outcome = "capacity gone"  # another run took the nodes between the two reads
            return False
        regrowth.to_dp = decision.layout.dp
        regrowth.nodes = [n for n in decision.nodes if n not in status.assignment.nodes]
        stopped = await self._stop_ranks(f"regrow to dp={decision.layout.dp}", timing=regrowth)
        regrowth.stopped_at_step = stopped.step if stopped is not None else None
        try:
            resumed = await self._replace_and_resume(decision, None, "regrow", timing=regrowth)
            regrowth.outcome = "regrown"
        except StageRefused as refused:
            if not (refused.spare_lost and workflow.patched(CLAIM_LOST_PATCH)):
                raise
            # Another run claimed a node between the pool's read and the claim, after the ranks
            # stopped: they start again on the nodes the run holds, and the watch tries again later.
            held = status.assignment
            regrowth.to_dp, regrowth.nodes = held.layout.dp, []
            regrowth.outcome = "capacity gone"
            regrowth.reason = f"{decision.reason}; at the claim, {refused}: resumed at dp={held.layout.dp}"
            # The refused decision's action: the run stays in the state it entered for the claim.
            stay = Decision(action=decision.action, nodes=held.nodes, layout=held.layout, reason=regrowth.reason)
            resumed = await self._replace_and_resume(stay, None, "regrow", timing=regrowth)
        regrowth.resumed_from_step, regrowth.first_step_at = resumed.resumed_from_step, resumed.first_step_at
        self._next_fault = resumed.fault  # a fault before its first step: the next incident
        return resumed.completed
