"""The controls-in-drain row: an operator's query and update answered while a drain waits."""

from __future__ import annotations

from lazarus.chaos.bed import wait_for
from lazarus.chaos.trial import Trial
from lazarus.schema import RunState

CONTROL_ANSWER_SECONDS = 1.0
"""The most an operator's query or update may take to be answered during a drain (seconds)."""
SURVIVOR_HOLD_SECONDS = 5.0
"""controls-in-drain: the survivors' grace, which its stopped survivor holds drain for (seconds)."""


async def controls_in_drain(trial: Trial, kill_at: int) -> None:
    """A survivor stopped (SIGSTOP) as a node dies holds drain for the whole survivors' grace: the
    run's status query and an operator's update are answered meanwhile, each timed into the notes."""
    await trial.at_step(kill_at)
    k, per_node = trial.incarnation(), trial.spec.layout.ranks_per_node
    survivor = trial.assignment(k).nodes.index(trial.node(1)) * per_node
    trial.stop_processes([trial.run.pid_file(k, survivor)])
    await trial.kill_nodes(trial.node(2))

    async def draining() -> bool:
        return await trial.in_state(RunState.DRAINING)

    await wait_for(draining, "the run to drain", 60)
    query, update = await trial.answer_times()
    still = await draining()
    trial.notes.append(
        f"while rank {survivor} held drain: status answered in {query:.2f} s, pause answered in {update:.2f} s"
    )
    if not still:
        trial.notes.append("FAIL the drain ended before the answers came: the row measured nothing")
    if max(query, update) > CONTROL_ANSWER_SECONDS:
        trial.notes.append(f"FAIL an answer took longer than {CONTROL_ANSWER_SECONDS:g} s")
    await wait_for(lambda: trial.trained_in(k + 1), f"incarnation {k + 1} to train", timeout=180)
    alive = trial.continue_stopped()
    if alive:
        trial.notes.append("FAIL the stopped survivor outlived drain")
