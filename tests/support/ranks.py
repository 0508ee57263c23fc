"""Rank processes for the trainer tests, forked from the session's forkserver (tests/support/forks.py).

A spawned rank imports torch again (about 1.2 s of CPU each here, a dozen ranks a test).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.multiprocessing as mp

from tests.support.forks import context


def start_ranks(rank_main: Callable, args: tuple, nprocs: int, join: bool = True):
    """torch.multiprocessing.start_processes with rank processes forked by the forkserver; the same
    ProcessContext (join=False) or None (join=True, every rank exited 0, else ProcessRaisedException)."""
    context()
    return mp.start_processes(rank_main, args=args, nprocs=nprocs, join=join, start_method="forkserver")
