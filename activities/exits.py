"""Judging how the ranks of an incarnation ended: killed (their node's fault), failed on their own
(the program's), gave up on a lost peer (a witness of a fault elsewhere), or done while others
linger in their teardown. Part of judge (activities/health.py), which passes each its look."""

from __future__ import annotations

from lazarus.activities.look import Look, Verdict
from lazarus.infra.backend import RankObservation
from lazarus.schema.contract import RankExit

PROGRAM_ERROR_SETTLE_SECONDS = 2.0
"""How long after the first rank of a fresh run fails before its first step the others get to end
too, so that the rank that failed for a reason of its own is told from those that lost it. Either
way the failure restarts in place (a rank_error): a first failure may be a transient fault that
reached Python as an exception; the same failure again is the crash loop that ends the run."""

PEER_LOSS_SETTLE_SECONDS = 2.0
"""How long after the first rank reports a lost peer the silent ranks get to report how they
ended (a live launcher writes its ranks' records within milliseconds) before their node is
blamed as dead, though the backend does not know it yet."""

PEER_LOST_ERRORS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "remote process exited",
    "ncclremoteerror",
    "connection refused",
    "socket closed",
)
"""Parts of the errors gloo and NCCL raise in a rank whose peer went away: the rank that
raised one is a witness of a fault elsewhere, not its cause."""


PEER_WAIT_ERRORS = ("wait timeout", "timed out", "timeout")
"""Parts of the errors of a rank that gave up waiting for its peers (a rendezvous, a store key):
a witness too, of a peer that never came."""

PROGRAM_ERROR_TYPES = frozenset(
    "AttributeError AssertionError ImportError IndexError KeyError ModuleNotFoundError NameError "
    "NotImplementedError SyntaxError TypeError UnboundLocalError ValueError ZeroDivisionError".split()
)
"""Python exceptions no lost peer raises: a rank that raised one failed for a reason of its own,
whatever words its message holds (an AttributeError about a `timeout` attribute is no timeout)."""


def waited_in_vain(ended: RankExit) -> bool:
    """Whether a rank's exit record says it gave up waiting for a peer, or lost one."""
    error = ended.error.lower()
    return lost_a_peer(ended) or (not _own_type(ended) and any(part in error for part in PEER_WAIT_ERRORS))


def lost_a_peer(ended: RankExit) -> bool:
    """Whether a rank's exit record says it ended because a peer went away."""
    error = ended.error.lower()
    return not _own_type(ended) and any(part in error for part in PEER_LOST_ERRORS)


def _own_type(ended: RankExit) -> bool:
    """Whether the exception in the record is of a type only a program's own failure raises."""
    return ended.error.split(":", 1)[0].strip().rsplit(".", 1)[-1] in PROGRAM_ERROR_TYPES


def ended_words(rank: RankObservation) -> str:
    """How a rank ended, in the words of a fault's reason."""
    if rank.exit is None:
        return f"rank {rank.rank} on {rank.node} ended without an exit record (killed with its node)"
    if rank.exit.signal:
        return f"rank {rank.rank} on {rank.node} was killed by {rank.exit.signal}"
    error = f": {rank.exit.error}" if rank.exit.error else ""
    return f"rank {rank.rank} on {rank.node} exited with code {rank.exit.code}{error}"


def exit_of(rank: RankObservation) -> RankExit:
    """The exit record of a rank the checks kept for having one."""
    assert rank.exit is not None, f"rank {rank.rank} was judged by an exit record it does not have"
    return rank.exit


def exit_step(rank: RankObservation, resume_step: int) -> int:
    """The step an ended rank reached: its exit record's, else the resume step (it reported none)."""
    step = exit_of(rank).step
    return resume_step if step is None else step


def judge_exits(look: Look) -> Verdict | None:
    """Ranks that ended before the last step: killed, failed on their own, or lost a peer."""
    # A rank gone without an exit record while its launcher lives: the launcher is about to
    # write one. Judge it on the next look, when the record says how it ended.
    gone = [r for r in look.ranks if r.launched and not r.alive and (r.exit is not None or not r.launcher_alive)]
    killed = [r for r in gone if r.exit is None or r.exit.signal]
    if killed:
        # A launcher timed its ranks' ends; a rank gone with its launcher died after the last look.
        ends = [r.exit.time if r.exit is not None else look.last_poll for r in killed]
        return look.fault("rank_exit", killed, min(ends), "; ".join(ended_words(r) for r in killed))
    failed = sorted((r for r in gone if exit_of(r).code != 0), key=lambda r: exit_of(r).time)
    if not failed:
        return None
    first = failed[0]
    never_started = [r for r in look.ranks if not r.launched]
    if never_started and all(waited_in_vain(exit_of(r)) for r in failed):
        # Ranks give up on a rendezvous whose peers never came: the node that did not start its
        # ranks (its standby or launcher hung) is the one at fault, not those that waited for it.
        reason = f"rank(s) {', '.join(str(r.rank) for r in never_started)} never started; then {ended_words(first)}"
        return look.fault("rank_exit", never_started, exit_of(first).time, reason)
    every_ended = not look.steady and all(r.exit is not None and not r.alive for r in look.ranks)
    if look.fresh_and_untrained and not every_ended and look.now - exit_of(first).time < PROGRAM_ERROR_SETTLE_SECONDS:
        return look.verdict()  # the others may be about to end too: the one that failed first on its own is the cause
    own = [r for r in failed if not waited_in_vain(exit_of(r))]
    if own:
        # The root cause: the first rank that failed for a reason of its own; its peers' broken
        # collectives follow it, sometimes by a few milliseconds before its own record.
        culprit = own[0]
        followers = len(failed) - 1
        then = f"; then {followers} other rank(s) failed" if followers else ""
        reason = (
            f"{ended_words(culprit)}{_when(look, culprit)} (the program's failure on a healthy node: no node is "
            f"blamed){then}"
        )
        return look.fault("rank_error", [culprit], exit_of(culprit).time, reason, nodes=[])
    if all(lost_a_peer(exit_of(r)) for r in failed):
        verdict = _silent_peer(look, failed)
        if verdict is not None:
            return verdict
    if look.now - exit_of(first).time < PEER_LOSS_SETTLE_SECONDS:
        return look.verdict()  # the rank whose failure they witnessed may be about to record it
    reason = (
        f"{ended_words(first)}{_when(look, first)}; every rank that failed lost a peer or gave up waiting for one, "
        "and no node went silent"
    )
    return look.fault("rank_error", [first], exit_of(first).time, reason, nodes=[])


def _when(look: Look, rank: RankObservation) -> str:
    """When a rank failed, in the words of a fault's reason, where its step does not say: before
    the run's first step, or how long after the start of a script that reports no steps."""
    launched = look.observation.launched_at
    if launched is None or not (look.source is None or look.fresh_and_untrained):
        return ""
    seconds = max(0.0, exit_of(rank).time - launched)
    after = f"within {seconds:.1f} s of its start" if look.fresh_and_untrained else f"{seconds:.0f} s after its start"
    if look.source is None:
        return f", {after}; the script reports no steps"
    return f", before the run's first step, {after}"


def _silent_peer(look: Look, failed: list[RankObservation]) -> Verdict | None:
    """Every rank that failed lost a peer: blame the nodes gone silent (once their ranks had time
    to report), those the errors name where they name any; None when no node is silent."""
    first = failed[0]
    silent_nodes = look.silent_nodes(since=exit_of(first).time)
    # Where the errors name the lost peer's address (gloo does), a silent node they name is the
    # dead one; one they do not name is a survivor slow to notice.
    named = {
        node
        for node, address in look.observation.node_addresses.items()
        if any(f"[{address}]" in exit_of(r).error for r in failed)
    }
    if silent_nodes & named:
        silent_nodes &= named
    if not silent_nodes:
        return None
    if look.now - exit_of(first).time < PEER_LOSS_SETTLE_SECONDS:
        return look.verdict()
    silent = look.ranks_on(silent_nodes)
    reason = (
        f"node {', '.join(sorted(silent_nodes))} went silent (no exit record, no heartbeat) "
        f"while its peers lost their connections to it; first: {ended_words(first)}"
    )
    return look.fault("node_down", silent, exit_of(first).time, reason, sorted(silent_nodes))


def judge_lingering(look: Look) -> Verdict | None:
    """Some ranks exited with code 0 and the others are still running `exit_grace_seconds` later:
    the run is done (a script decides its end; a trainer is past its last step) and those ranks are
    stuck in their teardown. Completion, with a warning that names them; they are to be ended."""
    clean = [r for r in look.ranks if r.exit is not None and r.exit.code == 0 and not r.alive]
    if not clean:
        return None
    first_clean = min(exit_of(r).time for r in clean)
    if look.now - first_clean < look.policy.exit_grace_seconds:
        return None
    every = [r for node in look.observation.nodes for r in node.ranks]  # steady nodes' too: rare, at the end
    running = [r for r in every if r.exit is None and r.alive]
    if not running or any(r.exit is not None and r.exit.code != 0 for r in every):
        return None
    if look.source == "trainer":
        last = min(exit_step(r, look.observation.resume_step) for r in clean)
        if last < look.total_steps:
            return None  # a rank ended early: not the end of training (a stop, or a fault to come)
    names = ", ".join(f"{r.rank} on {r.node}" for r in running)
    warning = (
        f"rank(s) {names} did not exit {look.policy.exit_grace_seconds:g} s after rank {clean[0].rank} exited "
        "with code 0 (recovery.exit_grace_seconds): ended by Lazarus, the run is complete"
    )
    verdict = look.verdict(completed=True, step=look.total_steps if look.source == "trainer" else look.step)
    verdict.warnings.append(warning)
    verdict.lingering.extend(r.rank for r in running)
    return verdict
