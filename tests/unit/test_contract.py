"""Which checkpoint may be loaded: complete, intact, newest; the rest skipped with the reason;
commits fenced by incarnation."""

from __future__ import annotations

import shutil

from lazarus.schema.files import write_json_atomic
from lazarus.schema.rundir import COMMIT_MARKER, RunDir, checkpoint_manifest, commit_checkpoint


def checkpoint(run: RunDir, step: int, commit: bool = True) -> None:
    folder = run.checkpoint(step)
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
    (folder / ".metadata").write_bytes(b"meta")
    if commit:
        write_json_atomic(folder / COMMIT_MARKER, {"step": step, "files": checkpoint_manifest(folder)})


def test_newest_intact_checkpoint_wins(tmp_path):
    run = RunDir(tmp_path)
    assert run.newest_checkpoint() == (0, {})
    checkpoint(run, 10)
    checkpoint(run, 20)
    assert run.newest_checkpoint() == (20, {})


def test_incomplete_newest_is_skipped(tmp_path):
    run = RunDir(tmp_path)
    checkpoint(run, 10)
    checkpoint(run, 20, commit=False)
    assert run.newest_checkpoint() == (10, {20: "incomplete (no commit marker)"})
    assert run.checkpoint_steps() == [10] and run.checkpoint_steps(complete_only=False) == [10, 20]


def test_truncated_file_is_corrupt(tmp_path):
    run = RunDir(tmp_path)
    checkpoint(run, 10)
    checkpoint(run, 20)
    shard = run.checkpoint(20) / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    step, skipped = run.newest_checkpoint()
    assert step == 10 and skipped[20] == "corrupt: __0_0.distcp has 100 bytes, the manifest says 1024"


def test_altered_and_missing_files_are_corrupt(tmp_path):
    run = RunDir(tmp_path)
    checkpoint(run, 10)
    checkpoint(run, 20)
    checkpoint(run, 30)
    shard = run.checkpoint(30) / "__0_0.distcp"
    shard.write_bytes(bytes(reversed(shard.read_bytes())))  # same size, other bytes
    (run.checkpoint(20) / "__0_0.distcp").unlink()
    step, skipped = run.newest_checkpoint()
    assert step == 10
    assert skipped == {30: "corrupt: __0_0.distcp does not match its SHA-256", 20: "corrupt: __0_0.distcp is missing"}


def written(run: RunDir, step: int, incarnation: int, fill: int) -> None:
    """Incarnation `incarnation`'s shards of checkpoint `step`, in its own folder, uncommitted."""
    folder = run.checkpoint_folder(step, incarnation)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "__0_0.distcp").write_bytes(bytes([fill]) * 1024)
    (folder / ".metadata").write_bytes(b"meta")


def test_a_commit_from_an_incarnation_the_controller_ended_does_not_count(tmp_path):
    run = RunDir(tmp_path)
    checkpoint(run, 10)
    written(run, 20, 0, fill=1)  # by incarnation 0, which the controller then ended
    run.end(0)
    assert commit_checkpoint(run, 20, incarnation=0) is False
    assert run.newest_checkpoint() == (10, {20: "incomplete (no commit marker)"})
    # The next incarnation writes and commits its own step 20.
    written(run, 20, 1, fill=2)
    assert commit_checkpoint(run, 20, incarnation=1) is True
    assert run.newest_checkpoint() == (20, {})
    assert run.checkpoint(20) == run.checkpoint_folder(20, 1)
    run.end(1)  # committed before its end: it still counts
    assert run.newest_checkpoint() == (20, {})


def test_a_fenced_incarnations_late_writes_and_commit_change_nothing_that_is_loaded(tmp_path):
    """A node cut off from the controller but not from the volume writes on after drain: its
    shards land in its own incarnation's folder, and a commit marker it writes after its end
    (past commit_checkpoint's check, a race) does not count. With one folder per step, the late
    shards would have replaced incarnation 1's and failed its manifest: an interval lost."""
    run = RunDir(tmp_path)
    checkpoint(run, 10)
    written(run, 20, 0, fill=1)
    run.end(0)
    first_end = run.ended_file(0).read_text()
    written(run, 20, 1, fill=2)
    assert commit_checkpoint(run, 20, incarnation=1)
    loaded = run.checkpoint(20)
    before = {p.name: p.read_bytes() for p in loaded.iterdir()}
    # The fenced incarnation's late shards and its late marker (its check passed before the end).
    written(run, 20, 0, fill=3)
    write_json_atomic(
        run.checkpoint_folder(20, 0) / COMMIT_MARKER,
        {"step": 20, "incarnation": 0, "files": checkpoint_manifest(run.checkpoint_folder(20, 0))},
    )
    run.end(0)  # a retried drain: the end keeps its first mark
    assert run.ended_file(0).read_text() == first_end
    assert run.newest_checkpoint() == (20, {}) and run.checkpoint(20) == loaded
    assert {p.name: p.read_bytes() for p in loaded.iterdir()} == before
    assert not run.committed(run.checkpoint_folder(20, 0))
    # Alone, the late commit is named for what it is.
    shutil.rmtree(loaded)
    assert run.newest_checkpoint() == (
        10,
        {20: "fenced: committed by incarnation 0 after the controller ended it"},
    )
