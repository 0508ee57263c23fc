"""Recovery cost on the local backend: kill a node N times, print each stage's median seconds.

    .venv/bin/python bench/recovery.py [--kills 3] [--spec examples/demo.yaml] [--spares N] [--kill-at-step N]
                                       [--path both|restart|in_process] [--json] [--keep DIR] [--markdown [PATH]]

With --path both (the default), each kill is made once on each recovery path in the same sitting: the
restart path (every rank restarts as a fork of its warm standby) and in-process recovery
(recovery.in_process: the survivors keep their processes, the spare's ranks join them), and a first
table sets them side by side: the survivors' stall (the fault to the slowest survivor's next step),
full width (the fault to the step every rank, the new ones too, has done: the MTTR) and the steps lost.

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
PATHS = {"restart": False, "in_process": True}
SIDE_BY_SIDE = ["survivors_stall", "full_width", "lost_steps"]
SPLIT = ["detect", "work", "wf_task", "dispatch", "overhead_pct"]
RECOVERY_STAGES = ["drain", "reschedule", "replace_or_reshard", "resume"]


def row(incident) -> dict:
    layout, lost = incident.old_assignment.layout, set(incident.fault.nodes)
    survivors = [
        stall
        for rank, stall in incident.stalls.items()
        if incident.old_assignment.nodes[layout.node_of_rank(rank)] not in lost
    ]
    return {
        **{name: incident.stages[name].seconds for name in STAGES},
        "MTTR": incident.mttr_seconds,
        "lost_steps": incident.lost_steps,
        "restored_from": incident.restored_from,
        "survivors_stall": max(survivors, default=None),
        "full_width": max(incident.stalls.values(), default=None),
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
    spec_path: Path,
    kills: int,
    kill_at: int | None,
    quiet: bool,
    keep: Path | None = None,
    spares: int | None = None,
    paths: list[str] = ("restart",),
) -> dict[str, tuple[list[dict], list[dict]]]:
    """Per recovery path: each kill's row and its MTTR's split. The paths alternate run by run, so
    that a machine busier at one moment weighs on both alike."""
    spec = anchor_paths(load_spec(spec_path), Path.cwd(), shares_paths=True)  # the local backend
    if spares is not None:
        spec = spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"spare_nodes": spares})})
    kill_at = kill_at or default_kill_step(spec)
    env = await local_environment()
    results: dict[str, tuple[list[dict], list[dict]]] = {path: ([], []) for path in paths}
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
                    for path in paths:
                        on_path = spec.model_copy(
                            update={"recovery": spec.recovery.model_copy(update={"in_process": PATHS[path]})}
                        )
                        run_id = f"bench-{path.replace('_', '-')}-{i}"
                        say(f"run {i + 1}/{kills}, {path}: kill a node at step {kill_at}")
                        final = await drive_run(env.client, settings, cluster, on_path, run_id, kill_at, say, kill)
                        if final.state != RunState.COMPLETED or len(final.incidents) != 1:
                            raise SystemExit(
                                f"bench: run {i + 1} ({path}) ended {final.state.value} with "
                                f"{len(final.incidents)} incident(s): {final.reason}"
                            )
                        # The killed node repaired, as between the kills of a real sitting: back in the
                        # pool, so that the quarantine breaker counts no earlier kill against the next.
                        for node in final.incidents[0].fault.nodes:
                            await asyncio.to_thread(cluster.return_node, run_id, node)
                        rows, splits = results[path]
                        rows.append(row(final.incidents[0]))
                        parts = await split(env.client, run_id, final.incidents[0], list(metrics.spans))
                        parts["resume"] = resume_parts(
                            cluster.run_dir(run_id), final.incidents[0], parts.pop("resume_started")
                        )
                        splits.append(parts)
    finally:
        if chaos is not None:
            chaos.shutdown()
        await env.shutdown()
    return results


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
    parser.add_argument(
        "--path",
        choices=["both", *PATHS],
        default="both",
        help="recovery path: restart (every rank restarts), in_process (survivors keep their processes), or both "
        "side by side (default)",
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
    paths = list(PATHS) if args.path == "both" else [args.path]
    results = asyncio.run(
        bench(
            args.spec, args.kills, args.kill_at_step, quiet=args.json, keep=args.keep, spares=args.spares, paths=paths
        )
    )
    summaries = {path: summarize(*results[path]) for path in paths}
    if args.markdown:
        write_markdown(args.markdown, sitting, summaries, args)
    if args.json:
        print(json.dumps(summaries, indent=2))
        return
    print_side_by_side(summaries)
    for path, summary in summaries.items():
        print_tables(path, summary, args)


def summarize(rows: list[dict], splits: list[dict]) -> dict:
    """One path's rows and splits with their medians."""
    return {
        "runs": rows,
        "median": {c: statistics.median(r[c] for r in rows) for c in [*COLUMNS, *SIDE_BY_SIDE]},
        "split": splits,
        "split_median": {c: statistics.median(r[c] for r in splits) for c in SPLIT},
        "resume_median": {c: statistics.median(r["resume"][c] for r in splits) for c in RESUME_PARTS},
    }


def side_by_side(summaries: dict) -> tuple[list[str], list[list]]:
    """Each path's medians of the survivors' stall, full width and lost steps."""
    body = [[path, *(f"{s['median'][c]:.2f}" for c in SIDE_BY_SIDE), len(s["runs"])] for path, s in summaries.items()]
    return ["path", *SIDE_BY_SIDE, "kills"], body


def print_side_by_side(summaries: dict) -> None:
    columns, body = side_by_side(summaries)
    print("\nThe recovery paths side by side (medians; seconds from the fault, lost steps)")
    print("".join(f"{c:>16}" for c in columns))
    for line in body:
        print("".join(f"{v:>16}" for v in line))


def print_tables(path: str, summary: dict, args) -> None:
    """One path's per-run rows and medians, as three tables."""
    rows, splits = summary["runs"], summary["split"]
    medians, split_medians, resume_medians = summary["median"], summary["split_median"], summary["resume_median"]
    how = "by resharding" if args.spares == 0 else "with a hot spare"
    print(f"\nRecovery {how}, {path} path, {len(rows)} kill(s), spec {args.spec} (seconds)")
    widths = {c: max(len(c), 6) + 2 for c in COLUMNS}
    print("run     " + "".join(f"{c:>{widths[c]}}" for c in COLUMNS))
    for i, r in enumerate(rows, 1):
        print(f"{i:<8}" + "".join(f"{r[c]:>{widths[c]}.2f}" for c in COLUMNS))
    print("median  " + "".join(f"{medians[c]:>{widths[c]}.2f}" for c in COLUMNS))
    print(f"restored from: {restored_from(rows)}")
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


def restored_from(rows: list[dict]) -> str:
    sources = [r["restored_from"] for r in rows]
    return ", ".join(f"{name} {sources.count(name)}/{len(rows)}" for name in sorted(set(sources)))


def write_markdown(path, sitting, summaries: dict, args) -> None:
    """The side-by-side table, then the three tables print_tables prints for each path, as a page."""
    how = "by resharding" if args.spares == 0 else "with a hot spare"

    def table(columns, runs, median, fmt, caption):
        body = [[i, *(f"{r[c]:{fmt}}" for c in columns)] for i, r in enumerate(runs, 1)]
        body.append(["median", *(f"{median[c]:{fmt}}" for c in columns)])
        return perf_page.Table(["run", *columns], body, caption)

    columns, body = side_by_side(summaries)
    tables = [
        perf_page.Table(columns, body, "The recovery paths side by side (medians; seconds from the fault, lost steps)")
    ]
    for name, summary in summaries.items():
        rows, splits = summary["runs"], summary["split"]
        tables += [
            table(
                COLUMNS,
                rows,
                summary["median"],
                ".2f",
                f"Recovery {how}, {name} path, {len(rows)} kill(s), spec {args.spec} (seconds); "
                f"restored from: {restored_from(rows)}",
            ),
            table(
                SPLIT,
                splits,
                summary["split_median"],
                ".3f",
                f"{name}: where the MTTR goes (seconds; overhead = wf_task + dispatch, % of MTTR)",
            ),
            table(
                RESUME_PARTS,
                [r["resume"] for r in splits],
                summary["resume_median"],
                ".3f",
                f"{name}: inside resume, by the slowest rank (seconds): processes up, rendezvous, restored, first step",
            ),
        ]
    perf_page.write_page(path, sitting, title=PAGE_TITLE, doc=__doc__, about=ABOUT, tables=tables)


if __name__ == "__main__":
    from lazarus.client.runs import exit_after

    exit_after(main)  # past the native client's crash at interpreter exit
