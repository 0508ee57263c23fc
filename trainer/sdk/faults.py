"""Planned faults: what a rank does when the spec's `faults` (LAZARUS_FAIL_AT) name a point and step
of it, so the chaos bed breaks real ranks the ways real runs break."""

from __future__ import annotations

import os
import signal
import sys

from lazarus.schema.contract import ENV_FAIL_AT


class PlannedFault(RuntimeError):
    """The exception a planned fault with `effect: raise` raises in a rank."""


def maybe_fail(point: str, step: int, environ=os.environ) -> None:
    """A planned fault (LAZARUS_FAIL_AT=point:step[:raise|:stuck|:spin], `faults` in the spec) at this
    point: die as a dead node's process does, by SIGKILL, raise PlannedFault as a buggy rank would,
    wait forever in a collective as a hung one does, or loop forever, busy, as a rank in a bug's
    endless loop does."""
    planned = environ.get(ENV_FAIL_AT, "")
    if planned == f"{point}:{step}:raise":
        raise PlannedFault(f"planned fault: this rank raises at {point} {step}")
    if planned == f"{point}:{step}:stuck":
        wait_for_the_peer_that_never_comes()
    if planned == f"{point}:{step}:spin":
        spin_forever()
    if planned == f"{point}:{step}":
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def wait_for_the_peer_that_never_comes() -> None:
    """A planned `stuck` fault: receive from a peer that never sends, so this rank waits in a
    collective forever and its peers wait behind it in the step's (a mismatched collective, a rank
    on the wrong code path)."""
    import torch
    import torch.distributed as dist

    print("lazarus trainer: planned fault: waiting in a receive no peer answers", file=sys.stderr, flush=True)
    dist.recv(torch.zeros(1), src=(dist.get_rank() + 1) % dist.get_world_size())


def spin_forever() -> None:
    """A planned `spin` fault: loop forever on the CPU, never reaching the step's collective; its
    peers wait in it. Its Python stack does not move: that is how it is found."""
    print("lazarus trainer: planned fault: looping forever", file=sys.stderr, flush=True)
    turns = 0
    while True:
        turns += 1


def planned_disk_full(step: int, environ=os.environ) -> bool:
    """Whether a planned fault fills the disk while the checkpoint of `step` is written."""
    return environ.get(ENV_FAIL_AT, "") == f"checkpoint:{step}:disk_full"
