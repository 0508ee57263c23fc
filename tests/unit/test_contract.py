"""Which checkpoint may be loaded: complete, intact, newest; the rest skipped with the reason;
commits fenced by incarnation."""

from __future__ import annotations

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


def test_a_commit_from_an_incarnation_the_controller_ended_does_not_count(tmp_path):
    run = RunDir(tmp_path)
    checkpoint(run, 10)
    checkpoint(run, 20, commit=False)  # written by incarnation 0, which the controller then ended
    run.ended_file(0).parent.mkdir(parents=True)
    run.ended_file(0).touch()
    assert commit_checkpoint(run, 20, incarnation=0) is False
    assert run.newest_checkpoint() == (10, {20: "incomplete (no commit marker)"})
    # The next incarnation's commit counts.
    assert commit_checkpoint(run, 20, incarnation=1) is True
    assert run.newest_checkpoint() == (20, {})
