"""Rank processes for the trainer tests, forked from one server process that imported torch once.

A spawned rank imports torch again (about 1.2 s of CPU each here, a dozen ranks a test). The
forkserver imports it once per session and forks every rank from a process that never ran a torch
op, so no rank inherits an OpenMP pool or other threads (as the warm standbys do it).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "lazarus.trainer.gpt.step"]
"""What the forkserver imports before its first fork: what every rank module imports."""


def start_ranks(rank_main: Callable, args: tuple, nprocs: int, join: bool = True):
    """torch.multiprocessing.start_processes with rank processes forked by the forkserver; the same
    ProcessContext (join=False) or None (join=True, every rank exited 0, else ProcessRaisedException)."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    return mp.start_processes(rank_main, args=args, nprocs=nprocs, join=join, start_method="forkserver")
