"""Full fencing: a node the controller gave up on (cut off from it, not from the volume) trains on
and writes its checkpoint after the next incarnation wrote the same step. Its shards land in its
own incarnation's folder and its late commit does not count, so what resume loads is exactly
what the replacement committed, and no checkpoint interval is lost (issue: warm pods, full fencing)."""

from __future__ import annotations

import json
import time

import pytest

from lazarus.infra.backend import free_port
from lazarus.schema.rundir import RunDir
from tests.support.ranks import start_ranks
from tests.trainer.fencing_ranks import FIRST, LAST, fenced_rank, replacement_rank

pytestmark = pytest.mark.timeout(180)


def test_a_fenced_nodes_late_checkpoint_changes_nothing_that_resume_loads(tmp_path):
    run = RunDir(tmp_path)
    fenced = start_ranks(fenced_rank, (free_port(), str(tmp_path)), 2, join=False)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"saved-{rank}").exists() for rank in range(2)):
            assert time.monotonic() < deadline, "incarnation 0 never checkpointed step 3"
            assert fenced.join(timeout=0.1) is False, "incarnation 0 ended early"
        run.end(0)  # drain gives up on incarnation 0: its processes live on
        assert run.newest_checkpoint() == (FIRST, {})
        start_ranks(replacement_rank, (free_port(), str(tmp_path)), 2)
        replaced = {p.name: p.read_bytes() for p in run.checkpoint_folder(LAST, 1).iterdir()}
        (tmp_path / "go-late").touch()
        while not fenced.join(timeout=1):
            pass
    finally:
        for process in fenced.processes:
            process.kill()
    late = run.checkpoint_folder(LAST, 0)
    assert sorted(p.suffix for p in late.iterdir() if p.suffix == ".distcp"), "incarnation 0 wrote no late shards"
    assert (late / "COMMITTED").is_file() and not run.committed(late)
    # Resume's choice: the replacement's step 6, whole and untouched; nothing lost to the late writes.
    assert run.newest_checkpoint() == (LAST, {})
    assert run.checkpoint(LAST) == run.checkpoint_folder(LAST, 1)
    assert {p.name: p.read_bytes() for p in run.checkpoint_folder(LAST, 1).iterdir()} == replaced
    for rank in range(2):
        report = json.loads((tmp_path / f"fenced-{rank}.json").read_text())
        assert report["keys"] > 20 and report["differ"] == []
        assert report["progress"]["step"] == LAST
        assert report["own_differs"], "the fenced rank's state must differ, or its late writes prove nothing"
