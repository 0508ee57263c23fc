"""Record workflow histories from real runs for the replay test: .venv/bin/python -m tests.histories.record [NAME...]

Each history comes from a real run (dev server, local backend, trainer processes). The histories
kept here are the supported window: the versions of TrainingRun whose runs a new worker must
replay. A gate is added, deprecated and removed as they allow (the patch policy,
docs/concepts/run-as-workflow.md); a change gated with workflow.patched records new histories
beside these, which keep replaying its old branch. All of these were recorded with the code just
before its gates were deprecated (2026-12-05): they took each gate's new branch and carry its
patched marker, which workflow.deprecate_patch accepts. Recorded again with the deprecating code,
they carry deprecated markers only, and the deprecate_patch calls may go.

  clean.json         a run without a fault.
  hot_spare.json     a node killed, a spare takes its place (drain, reschedule and
                     replace_or_reshard as local activities).
  reshard.json       dp2 x pp2 without a spare: reshard to dp1, then watch the pool to regrow.
  override.json      an operator pauses, resumes, drains a node and reshards (updates).
  escalation.json    no capacity, the operator approves a reshard below the minimum.
  no_capacity.json   no spare and min_dp = dp, recovery.approval_wait_seconds 0: waits for
                     capacity, then fails without asking an operator.
  story.json         the demo's spec at 60 steps, a node killed at step 25: recorded once detect
                     reported no routine progress (the hourly safety interval) and every
                     activity carried a summary.
  rack.json          two runs lose a node each to one rack (simulated nodes); the one recorded
                     waits on its timer for the other to drain before it decides (GATHER_PATCH).
  grow.json          a node lost without a spare (reshard to dp 3), returned: the regrow claims it
                     before the ranks stop (regrow-claims-first); an operator reshards to dp 2 and
                     back to dp 4, the second claiming first (reshard-claims-first). Recorded
                     2026-12-07, after the others.
  held_drain.json    a node killed while a survivor is stopped (SIGSTOP): drain outlasts a local
                     activity's wait and goes on as an activity of its own (DrainResult.unfinished);
                     the status queried meanwhile. Recorded 2026-12-08: the window's newest.

`no_spare`, `hot_spare_v1`, `reshard_v1`, `restart_done_v1`, `restart_fault_v1` and `local_stages`
were dropped when the gates were deprecated: each took an old branch (or predated a gate), and
their paths are in the histories above or, for an operator's restart that meets a fault or the
end (restart-as-recovery), in tests/workflow/test_training_run.py, which replays its own runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from lazarus.client.config import Settings
from lazarus.client.runs import start_run
from lazarus.commands.demo_run import run_demo
from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.infra.backends.simulated.cluster import SimulatedCluster
from lazarus.infra.harness.temporal_server import local_environment
from lazarus.schema import RunState, controls, load_spec, parse_spec
from lazarus.schema.files import read_json
from lazarus.worker import build_worker
from lazarus.workflows.training_run import TrainingRun
from tests.support.runs import trained_step
from tests.support.waiting import wait_until

HERE = Path(__file__).resolve().parent
SMALL = HERE.parent / "specs" / "small.yaml"
SMALL_PP = HERE.parent / "specs" / "small-pp.yaml"
DEMO = HERE.parents[1] / "examples" / "demo.yaml"


def changed(path: Path, **sections) -> object:
    data = load_spec(path).model_dump(mode="json")
    for section, fields in sections.items():
        data[section].update(fields)
    return parse_spec(data)


async def record(name: str, spec, kill_at: int | None = None, drive=None) -> None:
    """Run `spec` on a fresh dev server (the demo's way, or `drive(client, settings, cluster, spec)`);
    save its history."""
    with tempfile.TemporaryDirectory() as home:
        env = await local_environment()
        try:
            settings = Settings(address=env.client.service_client.config.target_host, home=Path(home))
            if drive is None:
                with contextlib.redirect_stdout(io.StringIO()):
                    await run_demo(settings, spec, kill_at, as_json=True)
            else:
                settings = Settings(address=settings.address, home=Path(home), task_queue="record")
                cluster = LocalCluster(home)
                async with build_worker(env.client, settings.task_queue, cluster):
                    await drive(env.client, settings, cluster, spec)
            [execution] = [w async for w in env.client.list_workflows()]
            history = await env.client.get_workflow_handle(execution.id).fetch_history()
            (HERE / f"{name}.json").write_text(history.to_json())
            print(f"{name}: {len(history.events)} events -> {HERE / (name + '.json')}", file=sys.stderr)
        finally:
            await env.shutdown()


async def override(client, settings, cluster, spec) -> None:
    """Pause, resume, drain a node, reshard, let it finish."""
    run = cluster.run_dir("override")
    handle = await start_run(client, settings, spec, "override")
    await asyncio.to_thread(wait_until, lambda: trained_step(run) >= 12, "step 12", 120)
    await handle.execute_update(TrainingRun.pause, controls.PauseRequest(reason="record"))
    await handle.execute_update(TrainingRun.resume, controls.ResumeRequest())
    await handle.execute_update(TrainingRun.set_policy, controls.SetPolicyRequest(changes={"hang_after_seconds": 60}))
    await handle.execute_update(TrainingRun.drain_node, controls.DrainNodeRequest(node="node-1", reason="record"))
    await handle.execute_update(TrainingRun.reshard, controls.ReshardRequest(dp=2))
    await handle.result()


async def escalation(client, settings, cluster, spec) -> None:
    """No spare and min_dp = dp: the run escalates; approve a reshard below the minimum."""
    run = cluster.run_dir("escalation")
    handle = await start_run(client, settings, spec, "escalation")
    await asyncio.to_thread(wait_until, lambda: trained_step(run) >= 12, "step 12", 120)
    cluster.kill_node("escalation", "node-2")
    while (await handle.query(TrainingRun.status)).state != RunState.WAITING_FOR_APPROVAL:
        await asyncio.sleep(0.1)
    await handle.execute_update(TrainingRun.approve, controls.ApproveRequest(action="reshard_below_minimum"))
    await handle.result()


async def grow(client, settings, cluster, spec) -> None:
    """A node lost without a spare: reshard to dp 3; the node returned: the regrow claims it while
    the ranks train, then stops them and resumes at dp 4; an operator reshards to dp 2 and back to
    dp 4, the second claiming its nodes before the ranks stop."""
    run = cluster.run_dir("grow")
    handle = await start_run(client, settings, spec, "grow")
    await asyncio.to_thread(wait_until, lambda: trained_step(run) >= 12, "step 12", 120)
    cluster.kill_node("grow", "node-2")
    await wait_for_state(handle, lambda s: s.state == RunState.TRAINING and s.layout.dp == 3)
    await handle.execute_update(TrainingRun.return_node, controls.ReturnNodeRequest(node="node-2"))
    await wait_for_state(handle, lambda s: s.state == RunState.TRAINING and s.layout.dp == 4)
    await handle.execute_update(TrainingRun.reshard, controls.ReshardRequest(dp=2))
    await handle.execute_update(TrainingRun.reshard, controls.ReshardRequest(dp=4))
    await handle.result()


async def held_drain(client, settings, cluster, spec) -> None:
    """A survivor stopped as node-2 dies holds drain for the survivors' grace: its local call is
    cut at its cap and the rest runs as an activity; the status is asked while it waits."""
    run = cluster.run_dir("held_drain")
    handle = await start_run(client, settings, spec, "held_drain")
    await asyncio.to_thread(wait_until, lambda: trained_step(run) >= 12, "step 12", 120)
    survivor = run.pid_file(0, cluster.assignment("held_drain", 0).nodes.index("node-1") * spec.layout.ranks_per_node)
    os.kill(read_json(survivor)["pid"], signal.SIGSTOP)
    cluster.kill_node("held_drain", "node-2")
    await wait_for_state(handle, lambda s: s.state == RunState.DRAINING)
    await handle.result()


class SlowToLodge(SimulatedCluster):
    """The simulated backend, where run rack-b takes a second longer to lodge its need of spares
    at drain: rack-a reads the inventory before it, and waits."""

    def want_spares(self, run_id, want):
        if run_id == "rack-b":
            time.sleep(1.0)  # a slow backend call, as a busy worker's is
        super().want_spares(run_id, want)


async def rack(name: str) -> None:
    """Two runs (priorities 1 and 0, simulated nodes) lose a node each to one rack at once, with one
    spare in the pool; rack-a drains first and waits on its timer for rack-b (GATHER_PATCH), then
    takes the spare. Saves rack-a's history."""
    with tempfile.TemporaryDirectory() as home:
        env = await local_environment()
        cluster = SlowToLodge(Path(home), steps_per_second=50.0, startup_seconds=0.1, report_seconds=0.1)
        try:
            settings = Settings(
                address=env.client.service_client.config.target_host, home=Path(home), task_queue="record"
            )
            async with build_worker(env.client, settings.task_queue, cluster):
                handles = {}
                for run_id, priority in (("rack-a", 1), ("rack-b", 0)):
                    spec = {
                        "name": run_id,
                        "trainer": {"steps": 10_000_000, "checkpoint_every": 1_000_000},
                        "layout": {"dp": 2, "ranks_per_node": 1},
                        "cluster": {"active_nodes": 2, "spare_nodes": 1, "priority": priority},
                        "recovery": {"progress_every_seconds": 600},
                    }
                    handles[run_id] = await start_run(env.client, settings, parse_spec(spec), run_id)
                for handle in handles.values():
                    await wait_for_state(handle, lambda s: s.state == RunState.TRAINING and s.assignment is not None)
                pool = cluster.pool
                pool.set_domain([pool.read().held_by(run_id)[0].name for run_id in handles], "rack-1")
                pool.add(max(0, 1 - len(pool.read().free())), "spare")
                cluster.kill_domain("rack-1")
                status = await wait_for_state(
                    handles["rack-a"],
                    lambda s: (
                        s.state == RunState.TRAINING and s.assignment is not None and s.assignment.incarnation == 1
                    ),
                )
                assert status.incidents[0].decision.action == "replace", status.incidents[0].decision
                history = await handles["rack-a"].fetch_history()
                assert any(e.HasField("timer_started_event_attributes") for e in history.events), "rack-a did not wait"
                for handle in handles.values():
                    await handle.terminate("recorded")
            (HERE / f"{name}.json").write_text(history.to_json())
            print(f"{name}: {len(history.events)} events -> {HERE / (name + '.json')}", file=sys.stderr)
        finally:
            cluster.close()
            await env.shutdown()


async def wait_for_state(handle, holds, timeout: float = 60.0):
    """The run's status once `holds(status)`, queried every 0.1 s (AssertionError past `timeout`)."""
    deadline = time.monotonic() + timeout
    while not holds(status := await handle.query(TrainingRun.status)):
        assert time.monotonic() < deadline, f"{handle.id}: timed out: {status}"
        await asyncio.sleep(0.1)
    return status


async def main() -> None:
    names = set(sys.argv[1:]) or {
        "hot_spare",
        "reshard",
        "clean",
        "override",
        "escalation",
        "story",
        "no_capacity",
        "rack",
        "grow",
        "held_drain",
    }
    if "hot_spare" in names:
        await record("hot_spare", load_spec(SMALL), kill_at=15)
    if "reshard" in names:
        await record("reshard", changed(SMALL_PP, cluster={"spare_nodes": 0}), kill_at=15)
    if "clean" in names:
        await record("clean", load_spec(SMALL), kill_at=None)
    if "override" in names:
        await record("override", load_spec(SMALL), drive=override)
    if "escalation" in names:
        await record(
            "escalation",
            changed(
                SMALL,
                cluster={"spare_nodes": 0},
                recovery={"min_dp": 4, "capacity_wait_seconds": 2, "capacity_poll_seconds": 1},
            ),
            drive=escalation,
        )
    if "rack" in names:
        await rack("rack")
    if "grow" in names:
        await record("grow", changed(SMALL, cluster={"spare_nodes": 0}, trainer={"steps": 400}), drive=grow)
    if "held_drain" in names:
        await record("held_drain", changed(SMALL, recovery={"survivor_grace_seconds": 3}), drive=held_drain)
    if "story" in names:
        await record("story", changed(DEMO, trainer={"steps": 60}), kill_at=25)
    if "no_capacity" in names:
        await record(
            "no_capacity",
            changed(
                SMALL,
                cluster={"spare_nodes": 0},
                recovery={
                    "min_dp": 4,
                    "capacity_wait_seconds": 3,
                    "capacity_poll_seconds": 1,
                    "approval_wait_seconds": 0,
                },
            ),
            kill_at=15,
        )


if __name__ == "__main__":
    asyncio.run(main())
