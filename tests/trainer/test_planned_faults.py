"""Planned faults as the ranks carry them out: raise instead of dying, and a disk that fills up."""

from __future__ import annotations

import errno
import traceback

import pytest

from lazarus.schema.contract import ENV_FAIL_AT
from lazarus.trainer.sdk.faults import PlannedFault, maybe_fail, planned_disk_full


def test_a_planned_raise_raises_at_its_point_and_step_only():
    environ = {ENV_FAIL_AT: "step:3:raise"}
    maybe_fail("step", 2, environ)
    maybe_fail("checkpoint", 3, environ)
    with pytest.raises(PlannedFault, match="step 3"):
        maybe_fail("step", 3, environ)


def test_a_full_disk_is_planned_for_one_checkpoint_and_kills_nothing():
    environ = {ENV_FAIL_AT: "checkpoint:10:disk_full"}
    assert planned_disk_full(10, environ) and not planned_disk_full(20, environ)
    maybe_fail("checkpoint", 10, environ)  # returns: the write fails, the process lives


def test_a_save_failed_on_the_disk_is_told_from_a_broken_collective():
    from torch.distributed.checkpoint.api import CheckpointException

    from lazarus.trainer.sdk.checkpoint import disk_error

    full = OSError(errno.ENOSPC, "No space left on device")
    summary = traceback.StackSummary()
    assert disk_error(CheckpointException("save", {2: (full, summary)})) is full
    assert disk_error(full) is full
    peer_gone = RuntimeError("Connection reset by peer")
    assert disk_error(CheckpointException("save", {1: (full, summary), 2: (peer_gone, summary)})) is None
    assert disk_error(peer_gone) is None
