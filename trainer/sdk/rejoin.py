"""A survivor that keeps its process when a peer's node is lost (RecoveryPolicy.in_process).

When a collective breaks, the rank gives up its process group without destroying it, waits at its
step boundary (heartbeat phase "waiting"), and when the controller starts the next incarnation
with the survivors rejoining (its launch record's `rejoin`), becomes a rank of that incarnation in
the same process: its lock, its pid record, its heartbeats move there, and it joins the new
incarnation's process group beside the replacement's fresh ranks.

gloo cannot abort a group (torch #130345), and its destructor can deadlock (trainer/agent/teardown.py),
so the broken groups stay referenced here and are never used again. That alone leaves the peers
that are not the dead rank's neighbours blocked in the collective until gloo's timeout: a survivor
that stays alive keeps its connections open, where a process that exits would have closed them.
So an abandoning survivor shuts down every connection its broken groups made (`cut_connections`),
which fails its peers' collectives at once, as an exit would.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from datetime import timedelta
from typing import TYPE_CHECKING

from lazarus.schema.contract import LaunchRecord, Rejoin, read_launch
from lazarus.schema.files import process_start_time, take_lock, write_json_atomic
from lazarus.schema.layout import Layout
from lazarus.schema.rundir import RunDir

if TYPE_CHECKING:
    from lazarus.trainer.sdk.session import TrainingSession

_ABANDONED: list = []
"""Process groups (and their stores) of incarnations this process left: referenced, never used again."""

_INHERITED_SOCKETS: dict[int, str] = {}
"""The sockets the process had before it joined any group (descriptor -> inode), which are not the groups'."""

ORDER_POLL_SECONDS = 0.005
"""How often a waiting survivor looks for the next incarnation's launch record (seconds): a stat."""


def _sockets() -> dict[int, str]:
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:"):
                found[int(fd)] = link
    return found


def remember_inherited_sockets() -> None:
    """Note the sockets this process has before it joins a process group (a forked rank inherits
    its standby's): `cut_connections` leaves them alone."""
    _INHERITED_SOCKETS.clear()
    _INHERITED_SOCKETS.update(_sockets())


def cut_connections() -> int:
    """Shut down every connected TCP socket made since `remember_inherited_sockets` (the broken
    groups' pairs and their store's clients); returns how many. Listening sockets stay: rank 0's old
    store serves no one now, and closing a server under its own thread is not this code's to do."""
    cut = 0
    for fd, link in _sockets().items():
        if _INHERITED_SOCKETS.get(fd) == link:
            continue
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if (
                sock.type == socket.SOCK_STREAM
                and sock.family in (socket.AF_INET, socket.AF_INET6)
                and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            ):
                sock.getpeername()  # raises for a socket that is not connected
                sock.shutdown(socket.SHUT_RDWR)
                cut += 1
        except OSError:
            pass
        finally:
            sock.close()
    return cut


def abandon_process_groups() -> int:
    """Leave every process group of this process (the default one and the mesh's) without
    destroying any, and fail the peers still blocked in them; returns the connections cut.
    Afterwards `init_process_group` can form a new default group."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    world = distributed_c10d._world
    _ABANDONED.extend(world.pg_map)
    cut = cut_connections()
    if dist.is_initialized():
        # Unregisters every group; for gloo the shutdown it asks for does nothing. The groups live on
        # in _ABANDONED, so no destructor runs.
        dist.destroy_process_group()
    return cut


def wait_for_rejoin(session: TrainingSession, step: int, timeout: float) -> LaunchRecord | None:
    """Wait at the boundary after `step` for the next incarnation to take this rank in: its launch
    record when it names this rank among the survivors that rejoin; None when it starts afresh,
    the controller fell back to the restart path or ended the incarnation, or `timeout` passed."""
    run, incarnation = session.run, session.incarnation
    session.heartbeat(step, "waiting")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # Read before the launch record: the controller ends this incarnation once the next one's
        # survivors rejoin, and a survivor that saw the end must still find the record written first.
        told_off = run.fall_back_file(incarnation).exists() or run.ended_file(incarnation).exists()
        launch = read_launch(run, incarnation + 1)
        if launch is not None:
            rejoin = launch.rejoin
            joins = rejoin is not None and rejoin.incarnation == incarnation and session.rank in rejoin.ranks
            return launch if joins else None
        if told_off:
            return None
        time.sleep(ORDER_POLL_SECONDS)
    return None


def move_rank(run: RunDir, rank: int, node: str, incarnation: int) -> None:
    """Make this process rank `rank` of `incarnation` in the run's files: its lock (held for the
    rest of the process), its pid record, and its log (a link to the one it writes, that of the
    incarnation before)."""
    fd = take_lock(run.lock_file(incarnation, rank))
    if fd is None:
        raise RuntimeError(f"rank {rank} of incarnation {incarnation} is held by another process")
    _ABANDONED.append(fd)  # kept open: the lock lives as long as this process
    record = {"pid": os.getpid(), "start_time": process_start_time(os.getpid()), "node": node}
    write_json_atomic(run.pid_file(incarnation, rank), record)
    log = run.log_file(incarnation, rank)
    log.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        log.symlink_to(run.log_file(incarnation - 1, rank).resolve())


def keep_process(session, step: int, state, timeout: float):
    """A script's survivor (`session`, its TrainingSession: keep_process there): abandon the broken groups, wait at the
    boundary after `step`, and where this rank rejoins the next incarnation, join its default
    process group (env://, the new incarnation's environment) and return `state`; None, with this
    rank still in its incarnation, where the controller starts the next one afresh."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_backend() != "gloo":
        return None  # NCCL's communicators would need aborting: only gloo's groups can be left behind
    abandon_process_groups()
    launch = wait_for_rejoin(session, step, timeout)
    if launch is None or launch.rejoin is None:
        return None
    session.move_to(session.incarnation + 1, launch.resume_step)
    session.wait_for_store()
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    return share_state(session.layout, session.rank, launch.rejoin, state)


def share_state(layout: Layout, rank: int, rejoin: Rejoin, state):
    """Every rank of an incarnation the survivors rejoined, on its default group: the source
    replica's rank at each (pp, dp_shard, tp) place sends its `state` (any picklable object) to
    that place's other replicas; a survivor goes on with its own, a new rank (`state` None) with
    what it received. A collective: call it before any other on the new group."""
    import torch.distributed as dist

    per_replica = layout.replica_ranks
    source = rejoin.source_replica * per_replica + rank % per_replica
    group = None  # one rank per replica: the default group is the place's
    if per_replica > 1:
        # Every rank creates every place's group, in the same order, as new_group requires.
        places = [dist.new_group([d * per_replica + p for d in range(layout.dp)]) for p in range(per_replica)]
        mine = places[rank % per_replica]
        group = mine if isinstance(mine, dist.ProcessGroup) else None
    box = [state if rank == source else None]
    dist.broadcast_object_list(box, src=source, group=group)
    return state if state is not None else box[0]
