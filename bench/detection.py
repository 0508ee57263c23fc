"""False alarms of the detectors beyond death: fault-free demo runs, and a run slowed everywhere.

    .venv/bin/python bench/detection.py [--runs 20] [--uniform-steps 500] [--window 5] [--json] [--markdown [PATH]]

Each run trains examples/demo.yaml (4 nodes, the built-in trainer) on the local backend while a
watch looks at it every heartbeat interval exactly as detect does (activities/running.py `look`,
with its Pace: the derived hang time and the straggler search), without Temporal, and counts
what would have been reported: hangs, stragglers and every other fault. Stragglers are sought
with a window of --window seconds (the policy's default is 60 s; a shorter window is the harder
test). Printed per run: steps, the derived hang time at the end, the longest stall the watch saw
(the time between two looks that saw the step advance), the largest ratio of a node's median
work per step to its peers', and the alarms.

--uniform-steps N adds a run of N steps with every node slowed 2x (infra/backends/local/slow_node.py, every node
stopped and continued together): a run slow everywhere must raise nothing.

--scripts adds fault-free runs of a script that reports no steps and knows nothing of Lazarus
(tests/user_script/inplace_checkpoints.py, 4 ranks, its step lines unread): plain; with every rank
blocked 6 s every 25 steps, as on slow reads from shared storage; with rank 0 evaluating 15 s every
25 steps while the others wait at a barrier. Their hang time is derived from how long the ranks sat
idle together (recovery.quiet_hang_seconds, activities/pace.py); printed per run: the longest such
stretch, the hang time at the end, and the alarms.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ is not an installed package

from bench import perf_page
from lazarus.activities.pace import Pace
from lazarus.activities.running import look
from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.infra.backends.local.slow_node import slow_node
from lazarus.schema.records import Assignment
from lazarus.schema.run import RunSpec

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "examples" / "demo.yaml"
PAGE_TITLE = "False alarms"
ABOUT = """Fault-free runs of examples/demo.yaml (4 nodes, the built-in trainer) on the local backend,
watched every heartbeat interval exactly as detect watches a run (the same look, with its derived
hang time and straggler search) but without Temporal, counting what would have been reported:
hangs, stragglers and every other fault. Stragglers are sought with the given window (the policy's
default is 60 s; a shorter window is the harder test). Per run: the steps, the derived hang time at
the end, the longest stall the watch saw (the time between two looks that saw the step advance),
the largest ratio of a node's median work per step to its peers', and the alarms. The last run,
unless left out, has every node slowed 2x together: a run slow everywhere must raise nothing. With
--scripts, fault-free runs of a script that reports no steps follow (plain, with slow reads that
block every rank 6 s, with 15 s evaluations on rank 0): their hang time is derived from the longest
stretch every rank sat idle together ("longest quiet"), at least 10 s. On one machine every node
shares the same cores, which a real cluster's nodes do not."""


SCRIPT = ROOT / "tests" / "user_script" / "inplace_checkpoints.py"
SCRIPT_RUNS = {
    "plain": [],
    "slow reads": ["--pause-every", "25", "--pause-seconds", "6"],
    "long evaluations": ["--eval-every", "25", "--eval-seconds", "15"],
}
"""Fault-free runs of a script without step reports (--scripts): its arguments, by kind."""


def script_spec(folder: Path, args: list[str]) -> RunSpec:
    """80 steps of the user-style script on 4 ranks, one per node, its step lines unread."""
    command = ["python", str(SCRIPT), "--steps", "80", "--save-every", "20", *args]
    return RunSpec.model_validate(
        {
            "name": "quiet",
            "trainer": {"command": command, "workdir": str(folder)},
            "layout": {"dp": 4, "ranks_per_node": 1},
            "cluster": {"active_nodes": 4, "spare_nodes": 0},
        }
    )


def demo_spec(window: float, steps: int | None) -> RunSpec:
    """The demo spec with the straggler window, and `steps` where given."""
    data = yaml.safe_load(DEMO.read_text())
    data["recovery"]["stragglers"] = {"window_seconds": window}
    if steps is not None:
        data["trainer"]["steps"] = steps
    return RunSpec.model_validate(data)


def one_run(folder: Path, spec: RunSpec, window: float, slow_every_node: bool) -> dict:
    """Train `spec` once under the watch; what the watch would have reported."""
    cluster = LocalCluster(folder)
    run_id = "detection"
    cluster.create(run_id, spec)
    active = sorted(n.name for n in cluster.inventory(run_id).nodes if n.role == "active")
    port = cluster.rendezvous_port(run_id)
    cluster.commit_assignment(run_id, Assignment(incarnation=0, nodes=active, layout=spec.layout, master_port=port))
    cluster.start_ranks(run_id, 0, 0)
    pace = Pace(spec.recovery)
    done = threading.Event()
    # Every node stopped and continued together: slowed alike, as a cluster-wide slowdown is.
    slowers = [
        threading.Thread(target=slow_node, args=(cluster.run_dir(run_id), active, 2.0, lambda: not done.is_set()))
    ][: 1 if slow_every_node else 0]
    alarms, worst, step, last_poll = [], (1.0, ""), None, time.time()
    try:
        for slower in slowers:
            slower.start()
        while True:
            verdict, now = look(cluster, run_id, 0, spec.recovery, last_poll, spec.trainer.steps, pace)
            step = verdict.step if verdict.step is not None else step  # None throughout: no step reports
            if verdict.fault is not None:
                alarms.append(f"{verdict.fault.kind}: {verdict.fault.reason}")
                break
            if verdict.straggler is not None and not any(a.startswith("straggler") for a in alarms):
                alarms.append(verdict.straggler.describe(window))
            for node, (work, peers) in pace.ratios().items():
                if peers > 0 and work / peers > worst[0]:
                    worst = (work / peers, node)
            if verdict.completed or verdict.stopped:
                break
            last_poll = now
            time.sleep(spec.recovery.heartbeat_interval_seconds)
    finally:
        done.set()
        for slower in slowers:
            slower.join()
        cluster.stop_incarnation(run_id, 0)
    return {
        "steps": step,
        "hang_after_seconds": round(pace.hang_after() if step is not None else pace.quiet_after(), 3),
        "longest_quiet_seconds": round(pace.longest_quiet, 3),
        "longest_stall_seconds": round(max(pace.gaps, default=0.0), 3),
        "worst_node_ratio": round(worst[0], 3),
        "worst_node": worst[1],
        "alarms": alarms,
        "slowed_everywhere": slow_every_node,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="fault-free demo runs (default 20)")
    parser.add_argument("--uniform-steps", type=int, default=500, help="steps of the run slowed everywhere (0: none)")
    parser.add_argument("--window", type=float, default=5.0, help="straggler window (seconds, default 5)")
    parser.add_argument("--scripts", action="store_true", help="add runs of a script that reports no steps")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON document")
    perf_page.add_option(parser, __file__)
    args = parser.parse_args()
    sitting = perf_page.begin()
    rows = []
    plan = [("fault-free", None, False)] * args.runs
    plan += [("slowed 2x everywhere", args.uniform_steps, True)] if args.uniform_steps else []
    plan += [(f"script without steps, {kind}", kind, False) for kind in SCRIPT_RUNS] if args.scripts else []
    for i, (what, steps, slowed) in enumerate(plan, 1):
        with tempfile.TemporaryDirectory(prefix="lazarus-detection-") as folder:
            spec = (
                script_spec(Path(folder), SCRIPT_RUNS[steps]) if steps in SCRIPT_RUNS else demo_spec(args.window, steps)
            )
            row = {"kind": what, **one_run(Path(folder), spec, args.window, slowed)}
        rows.append(row)
        if not args.json:
            print(
                f"[{i}/{len(plan)}] {what}: {row['steps'] if row['steps'] is not None else 'no'} steps, hang time "
                f"{row['hang_after_seconds']:.2f} s, longest stall {row['longest_stall_seconds']:.2f} s, longest quiet "
                f"{row['longest_quiet_seconds']:.2f} s, worst node {row['worst_node'] or '-'} at "
                f"{row['worst_node_ratio']:.2f}x its peers; alarms: {'; '.join(row['alarms']) or 'none'}",
                flush=True,
            )
    alarmed = sum(1 for row in rows if row["alarms"])
    factor = RunSpec.model_validate(yaml.safe_load(DEMO.read_text())).recovery.stragglers.factor
    summary = f"{len(rows)} runs, {alarmed} with an alarm; straggler factor {factor:g}, window {args.window:g} s"
    if args.markdown:
        write_markdown(args.markdown, sitting, rows, summary)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"\n{summary}")


def write_markdown(path: Path, sitting, rows: list[dict], summary: str) -> None:
    cells = [
        [
            i,
            row["kind"],
            "-" if row["steps"] is None else row["steps"],
            f"{row['hang_after_seconds']:.2f}",
            f"{row['longest_stall_seconds']:.2f}",
            f"{row['longest_quiet_seconds']:.2f}",
            row["worst_node"] or "-",
            f"{row['worst_node_ratio']:.2f}",
            "; ".join(row["alarms"]) or "none",
        ]
        for i, row in enumerate(rows, 1)
    ]
    headers = [
        "run",
        "kind",
        "steps",
        "hang time (s)",
        "longest stall (s)",
        "longest quiet (s)",
        "worst node",
        "x its peers",
        "alarms",
    ]
    table = perf_page.Table(headers, cells, summary)
    perf_page.write_page(path, sitting, title=PAGE_TITLE, doc=__doc__, about=ABOUT, tables=[table])


if __name__ == "__main__":
    main()
