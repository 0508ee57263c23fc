"""Recovery cost on the local backend: kill a node N times, print each stage's median seconds.

    .venv/bin/python bench/recovery.py [--kills 3] [--spec examples/demo.yaml] [--spares N] [--kill-at-step N]
                                       [--json] [--keep DIR] [--markdown [PATH]]

Each kill is its own run (the spec's nodes, with its hot spares or --spares) on a private
Temporal dev server and one in-process worker. Stage times are those the workflow records (activity scheduled to
result, as the history shows them; detect spans the node's death to its report); MTTR is the
node's death to the first training step of the new incarnation (it ends inside resume, which
returns once it has seen that step). A stage starts when the workflow schedules its activity,
so Temporal's dispatch is inside the stage times.

The second table splits each MTTR into what the stages did and what orchestration cost,
from the spans the activities time themselves and the run's history:
  detect      the fault to its report (detect polls every heartbeat interval)
  work        inside drain, reschedule and replace_or_reshard, and resume's start to the
              first training step of the new incarnation
  wf_task     an activity's end (as it timed itself) to the next one's ActivityTaskScheduled:
              the completion RPC and a workflow task; for a stage run as a local activity
              (drain, reschedule, replace_or_reshard), which has no such event, to its start
  dispatch    ActivityTaskScheduled to the activity's start: matching, the poll, the worker;
              none for a local activity, which the worker runs in its own workflow task
The four add up to the MTTR; overhead is wf_task + dispatch, as a share of MTTR.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ is not an installed package

from bench import perf_page
from lazarus.activities.metrics import Metrics
from lazarus.client.config import Settings
from lazarus.commands.demo_run import DEFAULT_SPEC, default_kill_step, drive_run
from lazarus.commands.local_paths import anchor_paths
from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.infra.harness.temporal_server import local_environment
from lazarus.schema import STAGES, RunState, load_spec
from lazarus.schema.contract import read_heartbeat
from lazarus.worker import build_worker

PAGE_TITLE = "Recovery on the local backend"
ABOUT = """Each kill is its own run of the spec (its nodes, with its hot spares unless told otherwise)
on a private Temporal dev server, one in-process worker and the local backend: a node is killed
mid-run, and each stage's seconds are those the workflow records (activity scheduled to result, as
the history shows them; detect spans the node's death to its report). MTTR is the node's death to
the first training step of the new incarnation. The second table splits each MTTR: *detect* (the
fault to its report), *work* (inside drain, reschedule and replace_or_reshard, and resume's start
to the first step), *wf_task* (an activity's end to the next one being scheduled: the completion
RPC and a workflow task) and *dispatch* (scheduled to started: matching, the poll, the worker);
the four add up to the MTTR, and overhead is wf_task + dispatch as a share of it. The third splits
resume by the new incarnation's slowest rank: processes up, rendezvous, checkpoint restored, first
step."""
COLUMNS = [*STAGES, "MTTR", "lost_steps"]
SPLIT = ["detect", "work", "wf_task", "dispatch", "overhead_pct"]
RECOVERY_STAGES = ["drain", "reschedule", "replace_or_reshard", "resume"]


def row(incident) -> dict:
    return {
        **{name: incident.stages[name].seconds for name in STAGES},
        "MTTR": incident.mttr_seconds,
        "lost_steps": incident.lost_steps,
        "restored_from": incident.restored_from,
    }


RESUME_PARTS = ["start", "rendezvous", "restore", "first_step"]


def resume_parts(run, incident, resume_started: float) -> dict:
    """Resume's share of the MTTR by the new incarnation's slowest rank: rank processes started
    (fork or exec, imports, session), rendezvous done, checkpoint restored, first step done."""
    k = incident.new_assignment.incarnation
    beats = [read_heartbeat(run, k, rank) for rank in range(incident.new_assignment.layout.world_size)]
    marks = (
        [resume_started]
        + [
            max(b.phases.get(p, float("nan")) if b else float("nan") for b in beats)
            for p in ("starting", "joined", "restored")
        ]
        + [incident.first_step_at.timestamp()]
    )
    return {part: marks[i + 1] - marks[i] for i, part in enumerate(RESUME_PARTS)}


async def split(client, run_id: str, incident, spans: list) -> dict:
    """The incident's MTTR as detect + work + wf_task + dispatch (see the module's docstring)."""
    fault_at = incident.fault.occurred_at.timestamp()
    scheduled = {}
    async for event in client.get_workflow_handle(run_id).fetch_history_events():
        attributes = event.activity_task_scheduled_event_attributes
        name = attributes.activity_type.name if event.HasField("activity_task_scheduled_event_attributes") else None
        if name in RECOVERY_STAGES and event.event_time.ToDatetime().timestamp() > fault_at:
            scheduled.setdefault(name, event.event_time.ToMicroseconds() / 1e6)
    inside = {}
    for span in spans:
        if span.workflow_id == run_id and span.stage in RECOVERY_STAGES and span.started > fault_at:
            inside.setdefault(span.stage, span)
    first_step = incident.first_step_at.timestamp()
    detected = incident.fault.detected_at.timestamp()
    work = (
        sum(inside[s].ended - inside[s].started for s in RECOVERY_STAGES[:-1]) + first_step - inside["resume"].started
    )
    previous_end, hops = detected, {}
    for stage in RECOVERY_STAGES:
        if stage in scheduled:
            hops[stage] = {
                "wf_task": scheduled[stage] - previous_end,
                "dispatch": inside[stage].started - scheduled[stage],
            }
        else:  # a local activity: no task to schedule or dispatch
            hops[stage] = {"wf_task": inside[stage].started - previous_end, "dispatch": 0.0}
        previous_end = inside[stage].ended
    wf_task = sum(h["wf_task"] for h in hops.values())
    dispatch = sum(h["dispatch"] for h in hops.values())
    mttr = incident.mttr_seconds
    return {
        "detect": detected - fault_at,
        "work": work,
        "wf_task": wf_task,
        "dispatch": dispatch,
        "overhead_pct": 100 * (wf_task + dispatch) / mttr,
        "hops": hops,
        "resume_started": inside["resume"].started,
    }


def _kill_node(home: str, run_id: str, node: str) -> list[int]:
    return LocalCluster(home).kill_node(run_id, node)


async def bench(
    spec_path: Path, kills: int, kill_at: int | None, quiet: bool, keep: Path | None = None, spares: int | None = None
) -> list[dict]:
    spec = anchor_paths(load_spec(spec_path), Path.cwd(), shares_paths=True)  # the local backend
    if spares is not None:
        spec = spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"spare_nodes": spares})})
    kill_at = kill_at or default_kill_step(spec)
    env = await local_environment()
    rows, splits = [], []
    metrics = Metrics()
    chaos = None
    try:
        with contextlib.nullcontext(str(keep)) if keep else tempfile.TemporaryDirectory() as home:
            settings = Settings(
                address=env.client.service_client.config.target_host, home=Path(home), task_queue="bench"
            )
            cluster = LocalCluster(home)
            started = time.monotonic()

            def say(message: str) -> None:
                if not quiet:
                    print(f"[{time.monotonic() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

            # The chaos monkey kills from a process of its own (started once, before any run), so its
            # waiting for the node's processes to die takes nothing from the worker's event loop.
            chaos = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(chaos, sorted, [])

            async def kill(run_id: str, node: str) -> list[int]:
                return await loop.run_in_executor(chaos, _kill_node, home, run_id, node)

            async with build_worker(env.client, settings.task_queue, cluster, metrics=metrics):
                for i in range(kills):
                    say(f"run {i + 1}/{kills}: kill a node at step {kill_at}")
                    final = await drive_run(env.client, settings, cluster, spec, f"bench-{i}", kill_at, say, kill)
                    if final.state != RunState.COMPLETED or len(final.incidents) != 1:
                        raise SystemExit(
                            f"bench: run {i + 1} ended {final.state.value} with "
                            f"{len(final.incidents)} incident(s): {final.reason}"
                        )
                    rows.append(row(final.incidents[0]))
                    parts = await split(env.client, f"bench-{i}", final.incidents[0], list(metrics.spans))
                    parts["resume"] = resume_parts(
                        cluster.run_dir(f"bench-{i}"), final.incidents[0], parts.pop("resume_started")
                    )
                    splits.append(parts)
    finally:
        if chaos is not None:
            chaos.shutdown()
        await env.shutdown()
    return rows, splits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=3, help="runs, one node killed in each (default 3)")
    parser.add_argument("--spec", type=Path, default=DEFAULT_SPEC, help="run spec (default: examples/demo.yaml)")
    parser.add_argument("--kill-at-step", type=int, help="step at which the node dies (default: mid-run)")
    parser.add_argument("--json", action="store_true", help="print per-run rows and medians as JSON")
    parser.add_argument(
        "--keep", type=Path, metavar="DIR", help="keep the runs' directories (logs, heartbeats) under DIR/runs"
    )
    parser.add_argument(
        "--spares", type=int, metavar="N", help="hot spares instead of the spec's (0: every recovery reshards)"
    )
    perf_page.add_option(parser, __file__)
    args = parser.parse_args()
    if args.spares is not None and args.spares < 0:
        parser.error("--spares must be 0 or more")
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        if (args.keep / "runs").exists() and any((args.keep / "runs").iterdir()):
            parser.error(f"--keep {args.keep}: holds runs already; give an empty or new folder")
    if args.kills < 1:
        parser.error("--kills must be at least 1")
    sitting = perf_page.begin()

    rows, splits = asyncio.run(
        bench(args.spec, args.kills, args.kill_at_step, quiet=args.json, keep=args.keep, spares=args.spares)
    )
    medians = {c: statistics.median(r[c] for r in rows) for c in COLUMNS}
    split_medians = {c: statistics.median(r[c] for r in splits) for c in SPLIT}
    resume_medians = {c: statistics.median(r["resume"][c] for r in splits) for c in RESUME_PARTS}
    if args.markdown:
        write_markdown(args.markdown, sitting, rows, splits, medians, split_medians, resume_medians, args)
    if args.json:
        print(
            json.dumps(
                {
                    "runs": rows,
                    "median": medians,
                    "split": splits,
                    "split_median": split_medians,
                    "resume_median": resume_medians,
                },
                indent=2,
            )
        )
        return
    print_tables(rows, splits, medians, split_medians, resume_medians, args)


def print_tables(rows, splits, medians, split_medians, resume_medians, args) -> None:
    """The per-run rows and medians, as three tables."""
    how = "by resharding" if args.spares == 0 else "with a hot spare"
    print(f"\nRecovery {how}, {len(rows)} kill(s), spec {args.spec} (seconds)")
    widths = {c: max(len(c), 6) + 2 for c in COLUMNS}
    print("run     " + "".join(f"{c:>{widths[c]}}" for c in COLUMNS))
    for i, r in enumerate(rows, 1):
        print(f"{i:<8}" + "".join(f"{r[c]:>{widths[c]}.2f}" for c in COLUMNS))
    print("median  " + "".join(f"{medians[c]:>{widths[c]}.2f}" for c in COLUMNS))
    sources = [r["restored_from"] for r in rows]
    print("restored from: " + ", ".join(f"{name} {sources.count(name)}/{len(rows)}" for name in sorted(set(sources))))
    print("\nWhere the MTTR goes (seconds; overhead = wf_task + dispatch, % of MTTR)")
    print("run     " + "".join(f"{c:>14}" for c in SPLIT))
    for i, r in enumerate(splits, 1):
        print(f"{i:<8}" + "".join(f"{r[c]:>14.3f}" for c in SPLIT))
    print("median  " + "".join(f"{split_medians[c]:>14.3f}" for c in SPLIT))
    print("\nInside resume, by the slowest rank (seconds): processes up, rendezvous, checkpoint restored, first step")
    print("run     " + "".join(f"{c:>14}" for c in RESUME_PARTS))
    for i, r in enumerate(splits, 1):
        print(f"{i:<8}" + "".join(f"{r['resume'][c]:>14.3f}" for c in RESUME_PARTS))
    print("median  " + "".join(f"{resume_medians[c]:>14.3f}" for c in RESUME_PARTS))


def write_markdown(path, sitting, rows, splits, medians, split_medians, resume_medians, args) -> None:
    """The three tables print_tables prints, as a page."""
    how = "by resharding" if args.spares == 0 else "with a hot spare"
    sources = [r["restored_from"] for r in rows]
    restored = ", ".join(f"{name} {sources.count(name)}/{len(rows)}" for name in sorted(set(sources)))

    def table(columns, runs, median, fmt, caption):
        body = [[i, *(f"{r[c]:{fmt}}" for c in columns)] for i, r in enumerate(runs, 1)]
        body.append(["median", *(f"{median[c]:{fmt}}" for c in columns)])
        return perf_page.Table(["run", *columns], body, caption)

    tables = [
        table(
            COLUMNS,
            rows,
            medians,
            ".2f",
            f"Recovery {how}, {len(rows)} kill(s), spec {args.spec} (seconds); restored from: {restored}",
        ),
        table(
            SPLIT,
            splits,
            split_medians,
            ".3f",
            "Where the MTTR goes (seconds; overhead = wf_task + dispatch, % of MTTR)",
        ),
        table(
            RESUME_PARTS,
            [r["resume"] for r in splits],
            resume_medians,
            ".3f",
            "Inside resume, by the slowest rank (seconds): processes up, rendezvous, checkpoint restored, first step",
        ),
    ]
    perf_page.write_page(path, sitting, title=PAGE_TITLE, doc=__doc__, about=ABOUT, tables=tables)


if __name__ == "__main__":
    from lazarus.client.runs import exit_after

    exit_after(main)  # past the native client's crash at interpreter exit
