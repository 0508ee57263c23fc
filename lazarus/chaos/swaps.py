"""The chaos matrix's planned swaps: a node made slow (a straggler) or sick (its health check
fails), found and swapped for the spare at a step boundary while nothing has died."""

from __future__ import annotations

import asyncio
import time

from lazarus.chaos.trial import Trial
from lazarus.infra.backends.local.slow_node import slow_node

SLOW_FACTOR = 2.0
"""How much slower the straggler scenario makes its node (dimensionless)."""
SLOW_FROM_STEP = 3
"""The step from which it is slow: early, so that the run trains for the straggler window after it."""
STRAGGLER_WINDOW_SECONDS = 5.0
"""recovery.stragglers.window_seconds of the straggler scenario (seconds; the default is 60): the
demo's run is 40 s."""


async def node_slowed(trial: Trial, kill_at: int) -> None:
    """A node made slow (infra/backends/local/slow_node.py) until the run leaves it: a planned swap for the spare."""
    await trial.at_step(SLOW_FROM_STEP)
    k, node = trial.incarnation(), trial.node(2)
    started = time.time()
    trial.swapped = (node, "straggler", started)

    def slowing() -> bool:
        unswapped = trial.incarnation() == k and trial.step() < trial.spec.trainer.steps
        return unswapped and time.time() - started < 120

    # In the tool's cycles of 0.1 s: on this machine's shared cores a node stopped in finer cycles
    # loses less than 1/factor of its time, its peers taking the cores it leaves.
    cycles = await asyncio.to_thread(slow_node, trial.run, node, SLOW_FACTOR, slowing)
    trial.notes.append(f"{node} slowed {SLOW_FACTOR:g}x for {time.time() - started:.1f} s ({cycles} cycles)")


SICK_AT_STEP = 10
"""The step at which the sick-node scenario's node turns sick (or the fault step, if earlier): the
chaos spec's run is short, and the swap must come before its end."""
SICK_MARK = "sick-{node}"
"""The file in the run directory whose presence fails the sick-node scenario's health check."""
SICK_CHECK = {
    "command": ["sh", "-c", f'test ! -e "$LAZARUS_RUN_DIR/{SICK_MARK.format(node="$LAZARUS_NODE")}"'],
    "interval_seconds": 0.5,
    "timeout_seconds": 0.5,
}
"""The sick-node scenario's health section: a site's check that fails once the node is marked."""


async def node_sick(trial: Trial, kill_at: int) -> None:
    """A node whose health check starts failing mid-run (a GPU falling off the bus, seen by
    `nvidia-smi` before it crashes anything): a planned swap for the spare."""
    await trial.at_step(min(kill_at, SICK_AT_STEP))
    node = trial.node(2)
    (trial.run.root / SICK_MARK.format(node=node)).write_text("")
    trial.swapped = (node, "sick", time.time())
