"""Regrow: a run below the dp it wants (the spec's layout.dp, or an operator's reshard's) grows
back once the pool has the nodes again: a node returned, a spare freed, a run ended.

The watch asks detect to look at the pool with each progress report (regrow_nodes); when the
nodes are there, the run reads the pool again, decides (workflows/policy.py plan_regrow), has its
ranks checkpoint and stop at a step boundary, claims the nodes and resumes at the larger dp from
that checkpoint: no completed step is lost, and the global batch and sample order are kept. A
mixin of TrainingRun; the operator holds it with `recovery.regrow: false` (set_policy).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from lazarus.activities.recovery import RecoveryActivities
    from lazarus.schema.records import Assignment, Decision, Regrowth, RunState
    from lazarus.workflows.policy import batch_said, plan_regrow, regrow_nodes
from lazarus.workflows.run_parts import RunParts
from lazarus.workflows.stage_calls import StageRefused

# Deprecated patches: each id's workflow.deprecate_patch stands where its workflow.patched stood, so
# that histories with the id's marker replay (the patch policy: docs/concepts/run-as-workflow.md).
REGROW_PATCH = "regrow"
"""Deprecated patch id: a run below its wanted dp grows back when the pool has the nodes (before: it stayed small)."""
CLAIM_FIRST_PATCH = "regrow-claims-first"
"""Patch id: a regrow claims its nodes while the ranks train on and stops them only once it holds
the nodes; a lost claim costs nothing but a read, and the next try backs off (before: it stopped the
ranks, then claimed, and a lost claim restarted them for nothing)."""
RESHARD_CLAIMS_FIRST_PATCH = "reshard-claims-first"
"""Patch id: an operator's reshard that grows claims the new nodes before it stops the ranks, and a
claim another run won refuses the request with the ranks still training (before: it stopped them,
then claimed, and a lost claim failed the run)."""
REGROW_BACKOFF_SECONDS = 5.0
"""After a regrow lost its claim to another run: the first wait before the watch looks for nodes
again (seconds); it doubles with each claim lost in a row, up to REGROW_BACKOFF_CAP_SECONDS, and is
drawn between half and one and a half of that, so that runs that lost together do not race again
together."""
REGROW_BACKOFF_CAP_SECONDS = 120.0
"""The longest wait before a regrow that keeps losing its claims tries again (seconds)."""
CLAIM_LOST_PATCH = "regrow-claim-lost"
"""Patch id: a regrow whose nodes another run claimed after the ranks stopped resumes on the held
nodes (before: the run failed on the refused claim)."""


class Regrowing(RunParts):
    """Watching the pool for the nodes a smaller run wants back, and growing into them."""

    _claims_lost: int = 0
    """Regrows in a row whose claim another run won (the backoff's exponent)."""
    _regrow_after: datetime | None = None
    """Until when the watch does not look for nodes to regrow into (a backoff); None: no wait."""

    def _node_limit(self) -> int:
        cluster = self._start.spec.cluster
        return cluster.active_nodes + cluster.spare_nodes

    def _regrow_watch(self) -> int | None:
        """How many more nodes the watch should look for in the pool, or None when the run may not grow."""
        status = self._status
        if not self._policy.regrow or status.assignment is None:
            return None
        if self._regrow_after is not None and workflow.now() < self._regrow_after:
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
        inventory = await self._stage("reschedule", RecoveryActivities.reschedule, self._reading(), regrowth)
        wanted = status.wanted_dp or self._start.spec.layout.dp
        decided = plan_regrow(inventory, status.assignment, wanted, self._node_limit())
        decision = batch_said(decided, status.steps_from == "trainer")
        regrowth.reason = decision.reason
        if decision.action == "wait":
            regrowth.outcome = "capacity gone"  # another run took the nodes between the two reads
            return False
        regrowth.to_dp = decision.layout.dp
        regrowth.nodes = [n for n in decision.nodes if n not in status.assignment.nodes]
        if workflow.patched(CLAIM_FIRST_PATCH):
            return await self._claim_and_grow(decision, regrowth)
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

    async def _claim_and_grow(self, decision: Decision, regrowth: Regrowth) -> bool:
        """Claim the regrow's nodes while the ranks train on; holding them, checkpoint and stop the
        ranks and resume on the larger layout. True when training is done. A claim another run won
        leaves the ranks as they were and backs the next try off."""
        status = self._status
        assert status.assignment is not None, "only a launched run regrows (_regrow_watch)"
        claimed = await self._claim_while_training(decision, "regrow", regrowth)
        if isinstance(claimed, StageRefused):
            regrowth.to_dp, regrowth.nodes, regrowth.outcome = status.assignment.layout.dp, [], "capacity gone"
            wait = self._back_off_regrow()
            regrowth.reason = f"{decision.reason}; at the claim, {claimed}: trained on, next look in {wait:.0f} s"
            return False
        assert claimed is not None, "a regrow adds nodes (plan_regrow), so it claims them first"
        self._claims_lost, self._regrow_after = 0, None
        stopped = await self._stop_ranks(f"regrow to dp={claimed.layout.dp}", timing=regrowth)
        regrowth.stopped_at_step = stopped.step if stopped is not None else None
        self._enter(RunState.RESHARDING)
        resumed = await self._take_up(claimed, None, timing=regrowth)
        regrowth.outcome = "regrown"
        regrowth.resumed_from_step, regrowth.first_step_at = resumed.resumed_from_step, resumed.first_step_at
        self._next_fault = resumed.fault  # a fault before its first step: the next incident
        return resumed.completed

    async def _claim_while_training(
        self, decision: Decision, kind: str, timing: Regrowth | None = None
    ) -> Assignment | StageRefused | None:
        """Claim the nodes a larger layout adds while the ranks train on (a regrow; an operator's
        reshard that grows): the claimed assignment, or the refusal when another run won a node,
        the ranks untouched. None where nothing is claimed first: a shrink frees its nodes once
        the ranks stopped, and an operator's reshard of a history from before this patch claims after."""
        status = self._status
        assert status.assignment is not None, "only a launched run changes its dp"
        if not [n for n in decision.nodes if n not in status.assignment.nodes]:
            return None
        if kind == "operator" and not workflow.patched(RESHARD_CLAIMS_FIRST_PATCH):
            return None
        try:
            return await self._claim(decision, kind, timing)
        except StageRefused as refused:
            if not refused.spare_lost:
                raise
            return refused

    def _back_off_regrow(self) -> float:
        """Hold the watch's look for regrow nodes off after a lost claim; returns the wait (seconds)."""
        self._claims_lost += 1
        ceiling = min(REGROW_BACKOFF_CAP_SECONDS, REGROW_BACKOFF_SECONDS * 2 ** (self._claims_lost - 1))
        wait = ceiling * (0.5 + workflow.random().random())
        self._regrow_after = workflow.now() + timedelta(seconds=wait)
        return wait
