"""Judging an observation of an incarnation: fault, completion, or progress (pure)."""

from __future__ import annotations

from collections.abc import Mapping

from lazarus.activities.exits import exit_of, exit_step, judge_exits, judge_lingering
from lazarus.activities.hangs import judge_hangs
from lazarus.activities.look import Look, Verdict
from lazarus.infra.backend import Observation
from lazarus.schema.policy import RecoveryPolicy, hang_seconds


def judge(
    observation: Observation,
    policy: RecoveryPolicy,
    now: float,
    last_poll: float,
    total_steps: int,
    hang_after: float | None = None,
    quiet_after: float | None = None,
    still: Mapping[int, tuple[float, str]] | None = None,
) -> Verdict:
    """Decide what an observation shows.

    `last_poll` is when the incarnation was last seen healthy: a rank found gone with its launcher
    died after it, so that is the fault's time (MTTR errs long by at most the wait between looks);
    one whose launcher recorded its end died then. Blame needs evidence
    (DESIGN.md). A node is blamed only on evidence about the node: the backend saw it die; its ranks
    vanished (killed, no exit record); it went silent while every rank that failed lost a peer (a
    node whose death the backend has not learnt yet: its ranks cannot report, the survivors can; of
    several silent nodes, those whose address the errors name); its ranks stopped heartbeating (a
    hang: activities/hangs.py, whose hang time, unless the policy sets one, is `hang_after`, derived
    from the run's step times by activities/pace.py; of a script that reports no steps, `quiet_after`,
    derived from how long its ranks sat idle together before; of ranks busy while the step stalls,
    `still`: whose Python stacks stood still, from the dumps the watch took). A rank that exits with
    a code or an exception on a healthy node is the program's failure (rank_error): no node is
    blamed, and the rank that failed for a reason of its own is named, even when a peer's follow-on
    connection error came a few milliseconds before it. Every rank gone with code 0 is completion
    at the last step, and a stop (on request) before it; of a script whose ranks report no steps themselves, it is
    completion. Ranks still running `exit_grace_seconds` after another exited 0 are stuck in their
    teardown: completion too, with a warning that names them (`lingering`, to be ended).
    """
    if hang_after is None:  # no step times to derive it from
        hang_after = hang_seconds(policy)
    look = Look(observation, policy, now, last_poll, total_steps, hang_after, quiet_after, still)
    for check in (_dead_nodes, judge_exits, _all_ended_cleanly, judge_lingering, judge_hangs):
        verdict = check(look)
        if verdict is not None:
            return verdict
    return look.verdict()


def _dead_nodes(look: Look) -> Verdict | None:
    dead = look.observation.dead_nodes
    if not dead:
        return None
    blamed = [r for r in look.ranks if r.node in dead]
    died = min(dead.values()).timestamp()
    return look.fault("node_down", blamed, died, f"backend reports node {', '.join(sorted(dead))} dead", sorted(dead))


def _all_ended_cleanly(look: Look) -> Verdict | None:
    """Every rank exited with code 0: for a trainer, completion at the last step and a stop before
    it; for a script that does not report steps itself, completion (it decides when it is done)."""
    # Ended only once every process is gone too (the exit record is written just before a rank
    # exits, and each node's launcher outlives its ranks by a moment).
    ranks = look.ranks
    if not ranks or look.steady or look.observation.launchers_alive:
        return None
    if not all(r.exit is not None and r.exit.code == 0 and not r.alive for r in ranks):
        return None
    if look.source != "trainer":
        return look.verdict(completed=True)
    last = min(exit_step(r, look.observation.resume_step) for r in ranks)
    if look.fresh_and_untrained and last < look.total_steps:
        reason = (
            f"every rank exited with code 0 at step {last} without training a step "
            f"(trainer.steps is {look.total_steps})"
        )
        return look.fault("program_error", ranks, max(exit_of(r).time for r in ranks), reason)
    return look.verdict(step=last, completed=last >= look.total_steps, stopped=last < look.total_steps)
