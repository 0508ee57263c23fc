"""The ranks that outlived a fault, as the controller sees them through the run's files: the state they
saved (which survivor holds each share of it, what the next incarnation restores), and, where they
keep their processes (RecoveryPolicy.in_process), whether each reached its step boundary, the
controller's order to fall back to the restart path, and which ranks rejoin."""

from __future__ import annotations

import time

from lazarus.schema.contract import Rejoin, SurvivorSource, read_heartbeat, read_survivors
from lazarus.schema.files import file_sha256, lock_is_held
from lazarus.schema.layout import Layout
from lazarus.schema.records import Assignment
from lazarus.schema.rundir import RunDir

BOUNDARY_POLL_SECONDS = 0.005
"""How often drain looks whether every survivor has reached its step boundary (seconds)."""

FOLLOW_WAIT_SECONDS = 2.0
"""How long a rejoining start waits for the survivor nodes' launchers to follow their ranks into the
new incarnation before it starts the other nodes anyway (seconds): they look every 10 ms."""


Place = tuple[int, int, int]
"""A rank's (pp, dp_shard, tp) coordinates: the share of the state it holds, whatever its replica."""


def place_of(layout: Layout, rank: int) -> Place:
    """The (pp, dp_shard, tp) place of `rank` in `layout`."""
    c = layout.coordinates(rank)
    return c["pp"], c["dp_shard"], c["tp"]


def survivor_holders(
    run: RunDir, incarnation: int, layout: Layout, verify: bool = True
) -> tuple[int, dict[Place, int]] | None:
    """The last step every survivor of `incarnation` completed, and for each (pp, dp_shard, tp)
    place of `layout` the survivor to load it from (None: no survivor saved it whole); None if
    no survivor saved anything.

    A rank may finish the step its peers failed in (its all-reduce completed before the fault
    broke theirs): the run completed only the step they all did, so that is the one restored.
    Every replica holds the same state at the same place, so any survivor there will do; each
    file must match its manifest, and a survivor whose file does not is passed over (unless not
    `verify`: for a hint that whoever reads the file checks anyway).
    """
    saved = read_survivors(run, incarnation, _world_size_of(run, incarnation))
    if not saved:
        return None
    step = min(m.step for m in saved.values())
    holders = {}
    for place in sorted({place_of(layout, rank) for rank in range(layout.world_size)}):
        at_place = [r for r, m in sorted(saved.items()) if m.step == step and m.place() == place]
        holders[place] = next((r for r in at_place if not verify or _matches(run, incarnation, r, saved[r])), None)
    return step, holders


def survivor_source(
    run: RunDir, incarnation: int, layout: Layout, after_step: int
) -> tuple[int, SurvivorSource] | None:
    """The state to restore from the survivors of `incarnation`: their last common step, if it is
    newer than `after_step` and saved for every place of `layout`, with the survivor each rank
    loads; None otherwise (no full replica survived, or a second fault cut a save short)."""
    found = survivor_holders(run, incarnation, layout)
    if found is None or found[0] <= after_step or None in found[1].values():
        return None
    step, holders = found
    ranks = {rank: holders[place_of(layout, rank)] for rank in range(layout.world_size)}
    return step, SurvivorSource(incarnation=incarnation, ranks=ranks)


def _world_size_of(run: RunDir, incarnation: int) -> int:
    path = run.assignment_file(incarnation)
    return Assignment.model_validate_json(path.read_text()).layout.world_size if path.exists() else 0


def _matches(run: RunDir, incarnation: int, rank: int, manifest) -> bool:
    """The survivor's state file is whole: its size and SHA-256 are the manifest's."""
    path = run.survivor_state(incarnation, rank)
    try:
        return path.stat().st_size == manifest.size and file_sha256(path) == manifest.sha256
    except FileNotFoundError:
        return False


def waiting_survivors(run: RunDir, assignment: Assignment, ranks=None) -> dict[int, int]:
    """The ranks of the assignment's incarnation (or of `ranks`) that wait at their step boundary,
    their processes alive, all at the same step: rank -> that step; {} when any of them does not,
    or the controller told them to fall back."""
    k = assignment.incarnation
    if run.fall_back_file(k).exists():
        return {}
    ranks = (
        [r for r in range(assignment.layout.world_size) if lock_is_held(run.lock_file(k, r))]
        if ranks is None
        else ranks
    )
    beats = {rank: read_heartbeat(run, k, rank) for rank in ranks}
    steps = {r: b.step for r, b in beats.items() if b is not None and b.phase == "waiting" and b.step is not None}
    if not ranks or len(steps) != len(ranks) or len(set(steps.values())) != 1:
        return {}
    return steps if all(lock_is_held(run.lock_file(k, rank)) for rank in ranks) else {}


def wait_at_boundary(run: RunDir, assignment: Assignment, lost: list[str], grace: float) -> dict[int, int]:
    """Wait up to `grace` seconds for every rank not on the `lost` nodes to wait at its step
    boundary (heartbeat phase "waiting", its process alive); returns rank -> the step each holds,
    all the same, or {} when one did not get there (it hangs, it holds another step) or ended."""
    per_node = assignment.layout.ranks_per_node
    kept = [
        rank
        for index, node in enumerate(assignment.nodes)
        if node not in lost
        for rank in range(index * per_node, (index + 1) * per_node)
    ]
    deadline = time.monotonic() + grace
    k = assignment.incarnation
    while not (steps := waiting_survivors(run, assignment, kept)):
        # A survivor whose process ended (a second node lost) will never wait: no need to wait for it.
        if time.monotonic() > deadline or not all(lock_is_held(run.lock_file(k, rank)) for rank in kept):
            return {}
        time.sleep(BOUNDARY_POLL_SECONDS)
    return steps


def fall_back(run: RunDir, incarnation: int) -> None:
    """Tell the survivors of `incarnation` waiting at their boundary to save their state and end,
    as on the restart path."""
    path = run.fall_back_file(incarnation)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()


def rejoin_of(old: Assignment, new: Assignment, kept: dict[int, int]) -> Rejoin | None:
    """How `new` starts with the survivors `kept` of `old` in their processes: the same layout, each
    kept rank's node at the same place, and a replica whose every rank was kept to send the state
    to the others; None where the new incarnation must start afresh."""
    layout = old.layout
    if new.layout != layout or not kept:
        return None
    if any(new.nodes[layout.node_of_rank(r)] != old.nodes[layout.node_of_rank(r)] for r in kept):
        return None
    whole = [
        d
        for d in range(layout.dp)
        if all(r in kept for r in range(d * layout.replica_ranks, (d + 1) * layout.replica_ranks))
    ]
    if not whole:
        return None
    return Rejoin(incarnation=old.incarnation, ranks=sorted(kept), source_replica=whole[0])


def await_followers(run: RunDir, assignment: Assignment, rejoin: Rejoin) -> list[int]:
    """Wait until the launcher of every node whose ranks rejoin the assignment's incarnation holds
    that incarnation's node lock (trainer/agent/follow.py), or FOLLOW_WAIT_SECONDS passed; returns
    the indexes of the other nodes, whose launchers are to start."""
    followed = {assignment.layout.node_of_rank(rank) for rank in rejoin.ranks}
    deadline = time.monotonic() + FOLLOW_WAIT_SECONDS
    k = assignment.incarnation
    while not all(lock_is_held(run.node_lock_file(k, i)) for i in followed) and time.monotonic() < deadline:
        time.sleep(BOUNDARY_POLL_SECONDS)
    return [i for i in range(len(assignment.nodes)) if i not in followed]
