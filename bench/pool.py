"""Two runs of one pool racing for its one spare, measured: each run's ETTR, each recovery's MTTR,
and what the regrow cost.

    .venv/bin/python bench/pool.py [--repeat 3] [--spec tests/specs/pool.yaml] [--json] [--markdown [PATH]]

Run a (priority 5) and run b (priority 0) train on two nodes each of one LAZARUS_HOME, with one
free spare between them (lazarus/chaos/pool_race.py). Both lose a node at once: a gets the
spare, b reshards to dp 1; a's dead node is then returned, and b grows back to dp 2. Each repeat
is a fresh home on one private Temporal dev server, with one in-process worker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ is not an installed package

from bench import perf_page
from lazarus.chaos.pool_race import local_pool, race_for_one_spare
from lazarus.commands.report import summarize
from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.infra.harness.temporal_server import local_environment
from lazarus.schema import load_spec

REPO = Path(__file__).resolve().parents[1]
PAGE_TITLE = "Two runs racing for one spare"
ABOUT = """Run a (priority 5) and run b (priority 0) train on two nodes each of one pool, with one free
spare between them. Both lose a node at once: a gets the spare, b reshards to dp 1; a's dead node
is then returned, and b grows back to dp 2. Each race is a fresh home on one private Temporal dev
server, with one in-process worker and the local backend. Per race: each run's ETTR and MTTR, the
seconds b's regrow took (and each of its stages), and how long b trained at dp 1 before it."""
KEYS = ["a_ettr", "b_ettr", "a_mttr", "b_mttr", "regrow_seconds", "b_seconds_at_dp1"]


def figures(race) -> dict:
    """What one race cost each run."""
    a, b = race.status["a"], race.status["b"]
    [regrowth] = b.regrowths or [None]
    return {
        "a_ettr": summarize(a)["ettr"],
        "b_ettr": summarize(b)["ettr"],
        "a_decision": a.incidents[0].decision.action,
        "b_decision": b.incidents[0].decision.action,
        "a_mttr": a.incidents[0].mttr_seconds,
        "b_mttr": b.incidents[0].mttr_seconds,
        "regrow_seconds": regrowth.seconds if regrowth else None,
        "regrow_stages": {n: s.seconds for n, s in regrowth.stages.items()} if regrowth else {},
        "regrow_lost_steps": regrowth.lost_steps if regrowth else None,
        "b_seconds_at_dp1": (b.regrowths[0].started_at - b.incidents[0].first_step_at).total_seconds()
        if regrowth and b.incidents[0].first_step_at
        else None,
        "wall_seconds": {"a": summarize(a)["wall_seconds"], "b": summarize(b)["wall_seconds"]},
    }


async def measure(spec_path: Path, repeat: int) -> list[dict]:
    env = await local_environment()
    rows = []
    try:
        for attempt in range(repeat):
            with tempfile.TemporaryDirectory() as home:
                pool = local_pool(LocalCluster(home))
                race = await race_for_one_spare(env.client, pool, load_spec(spec_path), priority_a=5)
                rows.append(figures(race))
                print(f"race {attempt + 1}/{repeat}: {json.dumps(rows[-1], default=str)}", file=sys.stderr)
    finally:
        await env.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="races to run (default 3)")
    parser.add_argument("--spec", type=Path, default=REPO / "tests" / "specs" / "pool.yaml", help="each run's spec")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    perf_page.add_option(parser, __file__)
    args = parser.parse_args()
    sitting = perf_page.begin()
    rows = asyncio.run(measure(args.spec, args.repeat))
    if args.markdown:
        write_markdown(args.markdown, sitting, rows, args.spec)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return
    print(f"{'figure':<18} {'median':>8}  each race")
    for key in KEYS:
        values = [r[key] for r in rows if r[key] is not None]
        median = statistics.median(values) if values else float("nan")
        print(f"{key:<18} {median:8.3f}  {', '.join(f'{v:.3f}' for v in values)}")
    stages = {n for r in rows for n in r["regrow_stages"]}
    for name in sorted(stages):
        values = [r["regrow_stages"][name] for r in rows if r["regrow_stages"].get(name) is not None]
        print(f"regrow {name:<11} {statistics.median(values):8.3f}  {', '.join(f'{v:.3f}' for v in values)}")
    print(
        f"decisions: a {rows[0]['a_decision']}, b {rows[0]['b_decision']}; regrow lost steps: "
        f"{[r['regrow_lost_steps'] for r in rows]}"
    )


def write_markdown(path: Path, sitting, rows: list[dict], spec: Path) -> None:
    table = []
    for key in KEYS:
        values = [r[key] for r in rows if r[key] is not None]
        median = statistics.median(values) if values else float("nan")
        table.append([key, f"{median:.3f}", ", ".join(f"{v:.3f}" for v in values)])
    for name in sorted({n for r in rows for n in r["regrow_stages"]}):
        values = [r["regrow_stages"][name] for r in rows if r["regrow_stages"].get(name) is not None]
        table.append([f"regrow {name}", f"{statistics.median(values):.3f}", ", ".join(f"{v:.3f}" for v in values)])
    notes = [
        f"decisions: a {rows[0]['a_decision']}, b {rows[0]['b_decision']}; regrow lost steps: "
        f"{[r['regrow_lost_steps'] for r in rows]}"
    ]
    caption = f"{len(rows)} race(s), spec {spec} (ETTR as a fraction, times in seconds)"
    perf_page.write_page(
        path,
        sitting,
        title=PAGE_TITLE,
        doc=__doc__,
        about=ABOUT,
        tables=[perf_page.Table(["figure", "median", "each race"], table, caption)],
        notes=notes,
    )


if __name__ == "__main__":
    from lazarus.client.runs import exit_after

    exit_after(main)  # past the native client's crash at interpreter exit
