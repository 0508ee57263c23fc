"""A survivor that keeps its process gives up its checkpoint save in flight (RecoveryPolicy.in_process):
the save went over the process groups it left, so rank 0 must never commit it, however late it ends."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch
import torch.distributed as dist

from lazarus.schema.rundir import COMMIT_MARKER, RunDir
from lazarus.trainer.sdk import checkpoint


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def saving(run: RunDir, monkeypatch, step: int) -> tuple[checkpoint.Checkpointer, Future]:
    """A Checkpointer with the save of `step` in flight: its write ends when the test says (the
    returned future), and its folder holds a file, so that a commit would succeed."""
    written: Future = Future()
    monkeypatch.setattr(checkpoint.state_dict_saver, "async_save", lambda *args, **kwargs: written)
    run.checkpoint_folder(step, 0).mkdir(parents=True)
    (run.checkpoint_folder(step, 0) / "__0_0.distcp").write_bytes(b"shard")
    saver = checkpoint.Checkpointer(run, incarnation=0, keep=3, asynchronous=True)
    model = torch.nn.Linear(2, 2)
    saver.save(model, torch.optim.SGD(model.parameters(), lr=0.1), step, step * 4)
    return saver, written


def test_a_save_given_up_is_never_committed_and_one_not_given_up_is(world_of_one, tmp_path, monkeypatch):
    run = RunDir(tmp_path / "run")
    saver, written = saving(run, monkeypatch, 5)
    assert saver._in_flight is not None
    committer = saver._in_flight[2]
    assert committer is not None
    # Its write has not ended: given up, but it may still write into the folder.
    assert saver.abandon(timeout=0.01) is False
    written.set_result(None)  # the write ends late, whole
    committer.join(timeout=30)
    assert not committer.is_alive()
    assert not (run.checkpoint_folder(5, 0) / COMMIT_MARKER).exists()
    assert run.checkpoint_steps() == []
    assert saver.abandon(timeout=0.01) is True  # nothing in flight any more

    # The same save, not given up, commits once written.
    saver, written = saving(run, monkeypatch, 10)
    written.set_result(None)
    saver.wait()
    assert run.checkpoint_steps() == [10]
