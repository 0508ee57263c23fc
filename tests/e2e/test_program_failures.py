"""Faults of the program, not of a node, with a script that knows nothing of Lazarus
(tests/user_script/inplace_checkpoints.py), on real ranks of the local backend: a crash loop ends
the run with the script's own exception and costs no healthy node; the root cause is the rank
that failed on its own; a rank that never leaves its teardown does not hold the run."""

from __future__ import annotations

import re
import uuid

import pytest
from temporalio.client import WorkflowFailureError

from lazarus.client.config import Settings
from lazarus.client.runs import run_status, start_run
from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.schema import RunState, parse_spec
from lazarus.worker import build_worker
from tests.support.runs import REPO

SCRIPT = REPO / "tests" / "user_script" / "inplace_checkpoints.py"
TUTORIAL = REPO / "tests" / "user_script" / "ddp_tutorial.py"
STEP_LINE = re.compile(r"^step (\d+) loss (\S+)$", re.MULTILINE)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def script_spec(
    name: str, workdir, nodes: int = 4, spares: int = 1, args=(), pattern=r"^step (?P<step>\d+) loss", **more
):
    """A run of the script, every rank on a node of its own, steps read from its output."""
    return parse_spec(
        {
            "name": name,
            "trainer": {
                "command": ["python", str(SCRIPT), *args],
                "workdir": str(workdir),
                "progress_pattern": pattern,
            },
            "layout": {"dp": nodes, "ranks_per_node": 1},
            "cluster": {"active_nodes": nodes, "spare_nodes": spares},
            "recovery": {"heartbeat_interval_seconds": 0.05, "progress_every_seconds": 2, **more.pop("recovery", {})},
            **more,
        }
    )


async def run_to_end(dev_env, home, spec):
    """Start the run on a worker of its own; its final status, failed or not, and its run directory."""
    queue, run_id = f"prog-{uuid.uuid4().hex[:8]}", f"{spec.name}-{uuid.uuid4().hex[:6]}"
    cluster = LocalCluster(home)
    async with build_worker(dev_env.client, queue, cluster):
        handle = await start_run(dev_env.client, Settings(task_queue=queue), spec, run_id)
        try:
            await handle.result()
        except WorkflowFailureError:
            pass
        status = await run_status(dev_env.client, run_id)
    return status, cluster.run_dir(run_id)


async def test_a_half_written_checkpoint_folder_is_a_crash_loop_not_a_string_of_bad_nodes(dev_env, home, tmp_path):
    """node-0 (rank 0, the one that saves) dies in the middle of writing checkpoint-10; every
    later start crashes on the folder's missing state file, the same way."""
    spec = script_spec(
        "half-saved",
        tmp_path,
        args=["--steps", "40", "--save-every", "10", "--slow-save", "3"],
        faults=[{"node": "node-0", "step": 11}],
    )
    status, run = await run_to_end(dev_env, home, spec)

    assert status.state == RunState.FAILED
    assert status.reason.startswith("crash loop: the same failure again after a restart in place")
    assert "FileNotFoundError" in status.reason and "trainer_state.json" in status.failure.error
    # The killed node alone is quarantined; the healthy ones that crashed on the folder are not.
    assert status.quarantined_nodes == ["node-0"]
    first, restart, loop = status.incidents
    assert first.fault.kind == "rank_exit" and first.decision.replacements == {"node-0": "node-4"}
    assert restart.fault.kind == loop.fault.kind == "rank_error" and restart.fault.nodes == loop.fault.nodes == []
    assert restart.decision.action == "replace" and restart.decision.replacements == {}
    # Never resharded: every incarnation ran the full world.
    assert all(i.new_assignment is None or i.new_assignment.layout.dp == 4 for i in status.incidents)
    assert status.layout.dp == 4
    # What the ranks did: incarnation 0 trained past step 10 and left the folder half-written;
    # incarnations 1 and 2 trained nothing and died on it.
    assert (tmp_path / "out" / "checkpoint-10" / "model.pt").is_file()
    assert not (tmp_path / "out" / "checkpoint-10" / "trainer_state.json").exists()
    assert max(int(s) for s, _ in STEP_LINE.findall(run.log_file(0, 1).read_text())) >= 10
    for incarnation in (1, 2):
        assert not STEP_LINE.findall(run.log_file(incarnation, 1).read_text())
        assert "FileNotFoundError" in run.log_file(incarnation, 1).read_text()


@pytest.mark.parametrize("record", [False, True], ids=["log", "record"])
async def test_the_failure_names_the_rank_that_raised_not_the_peer_that_lost_it(dev_env, home, tmp_path, record):
    """Rank 3 raises a ValueError at step 6; rank 2 (and the others) then fail on the broken
    collective. With torch's @record the exception comes from TORCHELASTIC_ERROR_FILE, else from
    the traceback in the rank's log."""
    args = ["--steps", "30", "--raise-at", "3:6"] + (["--record"] if record else [])
    status, run = await run_to_end(dev_env, home, script_spec("raises", tmp_path, spares=0, args=args))

    assert status.state == RunState.FAILED and status.quarantined_nodes == []
    failure = status.failure
    assert (failure.kind, failure.rank, failure.node) == ("rank_error", 3, "node-3")
    assert failure.error == "ValueError: rank 3 found a bad batch at step 6"
    assert "rank 3 on node-3 exited with code 1: ValueError: rank 3 found a bad batch at step 6" in status.reason
    assert run.error_file(0, 3).is_file() == record
    # Restarted once in place, on the same nodes, and it trained the same steps again.
    [restart, _loop] = status.incidents
    assert restart.new_assignment.nodes == ["node-0", "node-1", "node-2", "node-3"]
    for incarnation in (0, 1):
        steps = [int(s) for s, _ in STEP_LINE.findall(run.log_file(incarnation, 0).read_text())]
        assert steps == list(range(1, 6))


async def test_a_one_off_exception_on_a_fresh_run_without_step_reports_restarts_in_place_and_completes(
    dev_env, home, tmp_path
):
    """Rank 1 raises a ValueError once, at step 12 of the run's first start, a script whose steps
    nobody reads: a first failure may be transient (many hardware faults reach Python as
    exceptions), so the run restarts in place from the script's own checkpoint, costs no node, and
    trains to its end; the failure is named with what was seen, not with a step nobody reported."""
    args = ["--steps", "30", "--raise-at", "1:12", "--raise-once"]
    status, run = await run_to_end(dev_env, home, script_spec("once", tmp_path, args=args, pattern=None))

    assert status.state == RunState.COMPLETED, status.reason
    [incident] = status.incidents
    fault = incident.fault
    assert (fault.kind, fault.rank, fault.node, fault.nodes) == ("rank_error", 1, "node-1", [])
    assert fault.error == "ValueError: rank 1 found a bad batch at step 12"
    assert "rank 1 on node-1 exited with code 1: ValueError" in fault.reason
    assert "s of its start; the script reports no steps" in fault.reason and "before" not in fault.reason
    assert status.quarantined_nodes == [] and incident.new_assignment.nodes == incident.old_assignment.nodes
    # What the ranks computed: the first start trained to step 11, the restart from checkpoint-10 to the end.
    first = [int(s) for s, _ in STEP_LINE.findall(run.log_file(0, 0).read_text())]
    again = [int(s) for s, _ in STEP_LINE.findall(run.log_file(1, 0).read_text())]
    assert first == list(range(1, 12)) and again == list(range(11, 31))


async def test_a_rank_that_never_leaves_its_teardown_does_not_hold_the_run(dev_env, home, tmp_path):
    """Rank 1 never returns after the last step: the run completes once the exit grace has passed,
    with a warning that names it, and the rank is ended."""
    spec = script_spec(
        "teardown",
        tmp_path,
        nodes=2,
        spares=0,
        args=["--steps", "8", "--hang-at-exit", "1"],
        recovery={"exit_grace_seconds": 2},
    )
    status, run = await run_to_end(dev_env, home, spec)

    assert status.state == RunState.COMPLETED and status.incidents == [] and status.step == 8
    [warning] = [w for w in status.warnings if "did not exit" in w]
    assert "rank(s) 1 on node-1 did not exit 2 s after rank 0 exited with code 0" in warning
    for rank in (0, 1):
        steps = [int(s) for s, _ in STEP_LINE.findall(run.log_file(0, rank).read_text())]
        assert steps == list(range(1, 9))
    assert not LocalCluster(home).observe(status.run_id, 0).ranks[1].alive


async def test_the_ddp_tutorial_script_that_destroys_its_group_and_returns_ends_on_its_own(dev_env, home, tmp_path):
    """pytorch/examples' DDP tutorial script calls destroy_process_group() and returns: every rank
    exits by itself, with no exit grace used (it is set far beyond the test's time)."""
    spec = parse_spec(
        {
            "name": "tutorial",
            "trainer": {"command": ["python", str(TUTORIAL), "12", "5"], "workdir": str(tmp_path)},
            "layout": {"dp": 4, "ranks_per_node": 1},
            "cluster": {"active_nodes": 4, "spare_nodes": 0},
            "recovery": {"heartbeat_interval_seconds": 0.05, "exit_grace_seconds": 3600},
        }
    )
    status, run = await run_to_end(dev_env, home, spec)

    assert status.state == RunState.COMPLETED and status.incidents == [] and status.warnings == []
    for rank in range(4):
        epochs = re.findall(rf"^\[GPU{rank}\] Epoch (\d+) \|", run.log_file(0, rank).read_text(), re.MULTILINE)
        assert epochs == [str(e) for e in range(12)]
    assert (tmp_path / "snapshot.pt").is_file()


async def test_a_progress_bar_read_with_the_natural_pattern_gives_exact_lost_steps_and_mttr(dev_env, home, tmp_path):
    """A tqdm-style bar (`\\r 35%|███▌      | 14/40 [...`), read with the pattern a user writes for
    it: node-1 is killed once its bar shows 14; the script restores its checkpoint-10 folder on
    the spare, its bar showing 10/40 at once; the incident's restore point, lost steps and MTTR are
    those of step 11, the first one trained again."""
    spec = script_spec(
        "bar",
        tmp_path,
        args=["--steps", "40", "--save-every", "10", "--bar", "--step-seconds", "0.1"],
        faults=[{"node": "node-1", "step": 15}],
        pattern=r"(?P<step>\d+)/40\s\[",
    )
    status, run = await run_to_end(dev_env, home, spec)

    assert status.state == RunState.COMPLETED and status.steps_from == "output" and status.step == 40
    [incident] = status.incidents
    assert incident.fault.kind == "rank_exit" and incident.fault.nodes == ["node-1"]
    shown = [int(n) for n in re.findall(r"\| (\d+)/40 \[", run.log_file(0, 1).read_text())]
    assert incident.fault.step == max(shown) == 14  # the newest redraw, read though no line end follows it
    assert "resumed from out/checkpoint-10" in run.log_file(1, 0).read_text()
    assert incident.resumed_from_step == 10 and incident.lost_steps == 4
    # MTTR ends when the bar first advanced past the restored count, not at its first redraw (10/40).
    beats = [r.heartbeat for r in LocalCluster(home).observe(status.run_id, 1).ranks]
    assert all(beat.first_step == 10 and beat.advanced_at > beat.first_step_at for beat in beats)
    # (a datetime keeps microseconds)
    assert incident.first_step_at.timestamp() == pytest.approx(max(beat.advanced_at for beat in beats), abs=1e-6)
    assert incident.mttr_seconds == (incident.first_step_at - incident.fault.occurred_at).total_seconds() > 0
