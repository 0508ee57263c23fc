"""Recovery cost on the local backend: kill a node N times, print each stage's median seconds.

    .venv/bin/python bench/recovery.py [--kills 3] [--spec examples/demo.yaml] [--kill-at-step N] [--json]

Each kill is its own run (4 active nodes, 1 hot spare) on a private Temporal dev server and
one in-process worker. Stage times are those the workflow records (activity scheduled to
result, as the history shows them; detect spans the node's death to its report); MTTR is the
node's death to the first training step of the new incarnation (it ends inside resume, which
returns once it has seen that step). A stage starts when the workflow schedules its activity,
so Temporal's dispatch is inside the stage times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from infra.local import LocalCluster, free_port
from infra.temporal_server import temporal_cli
from lazarus.config import Settings
from lazarus.demo import DEFAULT_SPEC, default_kill_step, drive_run
from lazarus.worker import build_worker
from spec import STAGES, RunState, load_spec

COLUMNS = [*STAGES, "MTTR", "lost_steps"]


def row(incident) -> dict:
    return {**{name: incident.stages[name].seconds for name in STAGES},
            "MTTR": incident.mttr_seconds, "lost_steps": incident.lost_steps}


async def bench(spec_path: Path, kills: int, kill_at: int | None, quiet: bool) -> list[dict]:
    spec = load_spec(spec_path)
    kill_at = kill_at or default_kill_step(spec)
    env = await WorkflowEnvironment.start_local(dev_server_existing_path=temporal_cli(),
                                                data_converter=pydantic_data_converter, port=free_port())
    rows = []
    try:
        with tempfile.TemporaryDirectory() as home:
            settings = Settings(address=env.client.service_client.config.target_host, home=Path(home),
                                task_queue="bench")
            cluster = LocalCluster(home)
            started = time.monotonic()

            def say(message: str) -> None:
                if not quiet:
                    print(f"[{time.monotonic() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

            async with build_worker(env.client, settings.task_queue, cluster):
                for i in range(kills):
                    say(f"run {i + 1}/{kills}: kill a node at step {kill_at}")
                    final = await drive_run(env.client, settings, cluster, spec, f"bench-{i}", kill_at, say)
                    if final.state != RunState.COMPLETED or len(final.incidents) != 1:
                        raise SystemExit(f"bench: run {i + 1} ended {final.state.value} with "
                                         f"{len(final.incidents)} incident(s): {final.reason}")
                    rows.append(row(final.incidents[0]))
    finally:
        await env.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=3, help="runs, one node killed in each (default 3)")
    parser.add_argument("--spec", type=Path, default=DEFAULT_SPEC, help="run spec (default: examples/demo.yaml)")
    parser.add_argument("--kill-at-step", type=int, help="step at which the node dies (default: mid-run)")
    parser.add_argument("--json", action="store_true", help="print per-run rows and medians as JSON")
    args = parser.parse_args()
    if args.kills < 1:
        parser.error("--kills must be at least 1")

    rows = asyncio.run(bench(args.spec, args.kills, args.kill_at_step, quiet=args.json))
    medians = {c: statistics.median(r[c] for r in rows) for c in COLUMNS}
    if args.json:
        print(json.dumps({"runs": rows, "median": medians}, indent=2))
        return
    print(f"\nRecovery with a hot spare, {len(rows)} kill(s), spec {args.spec} (seconds)")
    widths = {c: max(len(c), 6) + 2 for c in COLUMNS}
    print("run     " + "".join(f"{c:>{widths[c]}}" for c in COLUMNS))
    for i, r in enumerate(rows, 1):
        print(f"{i:<8}" + "".join(f"{r[c]:>{widths[c]}.2f}" for c in COLUMNS))
    print("median  " + "".join(f"{medians[c]:>{widths[c]}.2f}" for c in COLUMNS))


if __name__ == "__main__":
    main()
