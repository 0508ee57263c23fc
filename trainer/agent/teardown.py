"""A forked rank's process groups outlive its script: gloo's teardown deadlocks when it runs in
the rank (keep_destroyed_groups). Used by the warm standby (trainer/agent/standby/) in each rank it
forks; a rank exec'd cold is a fresh interpreter, as under torchrun."""

from __future__ import annotations

import sys
from typing import Any

_KEPT_GROUPS: list = []
"""Process groups a forked rank's script destroyed, kept from their C++ destructors: see keep_destroyed_groups."""


def keep_destroyed_groups() -> None:
    """Make torch.distributed.destroy_process_group keep the groups it destroys referenced, so
    that no ProcessGroupGloo destructor runs in the rank.

    That destructor joins gloo's worker threads while the caller holds the GIL, and a worker that
    is just then freeing its last collective (whose thread-local state holds a Python object
    that backward stashed) waits for the GIL: a deadlock, hit when DDP's Reducer, the group's last
    owner, is freed after `destroy_process_group()`, as the DDP tutorial scripts do when `main`
    returns. It needs the worker to miss the GIL for the moment between the last collective and
    the free, so it shows under CPU contention, for fresh processes under torchrun too. A forked
    rank ends with os._exit, so a group kept here is never destroyed at all; the group is still
    shut down and unregistered as torch does."""
    # Looked up, not imported (a script that never imports them needs no patch): torch's modules,
    # whose functions this replaces.
    distributed: Any = sys.modules.get("torch.distributed")
    c10d: Any = sys.modules.get("torch.distributed.distributed_c10d")
    if distributed is None or c10d is None or not distributed.is_available():
        return
    destroy = c10d.destroy_process_group
    if getattr(destroy, "keeps_groups", False):
        return

    def destroy_process_group(group=None):
        world = getattr(c10d, "_world", None)
        groups = list(getattr(world, "pg_map", {})) if group is None else [group]
        _KEPT_GROUPS.extend(g for g in groups if g is not None)
        return destroy(group)

    destroy_process_group.keeps_groups = True  # pyright: ignore[reportFunctionMemberAccess] - the patched one's mark
    destroy_process_group.__doc__ = destroy.__doc__
    c10d.destroy_process_group = distributed.destroy_process_group = destroy_process_group
