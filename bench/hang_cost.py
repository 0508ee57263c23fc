"""What a hang costs against a death: one rank SIGKILLed in one run and SIGSTOPped in another (a
process that no longer runs, as a rank stuck in the kernel or stopped by a debugger looks), for
three kinds of trainer, in one sitting.

    .venv/bin/python bench/hang_cost.py [--repeat 1] [--only builtin,session,torchrun] [--json]

The trainers: the built-in one (examples/demo.yaml), a `lazarus.session` script
(examples/train_ddp.py, 4 nodes + 1 spare), and a torchrun-style script that knows nothing of
Lazarus (examples/torchrun_snapshot.py, its own snapshot every 100 epochs, steps read from its
output with `trainer.progress_pattern`). Each run trains on the local backend with a real worker
and dev server; once it passed step 60, rank 1's process is killed or stopped, and the run is
followed until the recovery's first step; then it is ended.

Printed per trainer and fault: the MTTR (the fault to the first new training step), detect's share
(the fault to its report), the hang time the watch judged by (from the fault's reason), the node
blamed against the one struck, and for the
stopped rank the excess over the killed rank's MTTR plus that hang time: the recovery after a hang
is found should cost what a death's does, so the excess stays within one look
(LEARNING_LOOK_SECONDS of activities/pace.py). Exit status 1 where it does not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ is not an installed package

from lazarus.activities.pace import LEARNING_LOOK_SECONDS
from lazarus.client.config import Settings
from lazarus.client.runs import start_run
from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.infra.harness.temporal_server import local_environment, quiet_runtime
from lazarus.schema import load_spec, parse_spec
from lazarus.schema.contract import read_metrics
from lazarus.schema.files import read_json
from lazarus.worker import build_worker
from lazarus.workflows.training_run import TrainingRun

REPO = Path(__file__).resolve().parent.parent
STRIKE_STEP = 60
"""The step after which rank 1 is killed or stopped."""
WAIT_SECONDS = 240.0
"""How long one run may take to reach the step and to recover (seconds)."""


def builtin_spec():
    data = load_spec(REPO / "examples" / "demo.yaml").model_dump(mode="json")
    data["trainer"]["steps"] = 5000  # ended once recovered: never trains to its end
    return parse_spec(data)


def session_spec():
    data = load_spec(REPO / "tests" / "specs" / "user-ddp.yaml").model_dump(mode="json")
    data["trainer"] |= {"command": ["python", str(REPO / "examples" / "train_ddp.py")], "steps": 5000}
    return parse_spec(data)


def torchrun_spec():
    script = str(REPO / "examples" / "torchrun_snapshot.py")
    return parse_spec(
        {
            "name": "torchrun-style",
            "trainer": {
                "command": ["python", script, "--epochs", "5000", "--save-every", "100"],
                "progress_pattern": r"Epoch (?P<step>\d+) \|",
            },
            "layout": {"dp": 4, "ranks_per_node": 1},
            "cluster": {"active_nodes": 4, "spare_nodes": 1},
            "recovery": {"heartbeat_interval_seconds": 0.05, "progress_every_seconds": 2},
        }
    )


TRAINERS = {"builtin": builtin_spec, "session": session_spec, "torchrun": torchrun_spec}


def newest_step(run, status_step: int | None) -> int:
    """The newest step the run reached: its metrics (built-in, session) or the workflow's report."""
    if run.metrics_file.exists():
        lines = read_metrics(run)
        if lines:
            return lines[-1].step
    return status_step or 0


async def one(env, kind: str, how: str, say) -> dict:
    """One run of `kind`, rank 1 killed (`how` kill) or stopped (stop) past STRIKE_STEP."""
    home = Path(tempfile.mkdtemp(prefix="hang-cost-"))
    cluster = LocalCluster(home)
    run_id = f"{kind}-{how}-{uuid.uuid4().hex[:4]}"
    run, queue = cluster.run_dir(run_id), f"hang-{uuid.uuid4().hex[:6]}"
    pid = None
    try:
        async with build_worker(env.client, queue, cluster):
            handle = await start_run(env.client, Settings(task_queue=queue, home=home), TRAINERS[kind](), run_id)
            deadline = time.monotonic() + WAIT_SECONDS
            while newest_step(run, (await handle.query(TrainingRun.status)).step) < STRIKE_STEP:
                if time.monotonic() > deadline:
                    raise SystemExit(f"bench/hang_cost.py: {run_id} did not reach step {STRIKE_STEP}")
                await asyncio.sleep(0.1)
            pid = read_json(run.pid_file(0, 1))["pid"]
            struck = cluster.assignment(run_id, 0).nodes[1]  # rank 1's node: one rank per node
            os.kill(pid, signal.SIGSTOP if how == "stop" else signal.SIGKILL)
            while not (status := await handle.query(TrainingRun.status)).incidents or (
                status.incidents[0].first_step_at is None and status.incidents[0].outcome == "recovering"
            ):
                if time.monotonic() > deadline:
                    raise SystemExit(f"bench/hang_cost.py: {run_id} did not recover in {WAIT_SECONDS:g} s")
                await asyncio.sleep(0.1)
            await handle.terminate("bench/hang_cost.py: measured")
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        cluster.stop_run(run_id)
    incident = status.incidents[0]
    found = re.search(r"hang time ([\d.]+) s|hang_after_seconds ([\d.]+)", incident.fault.reason)
    row = {
        "trainer": kind,
        "fault": how,
        "kind": incident.fault.kind,
        "outcome": incident.outcome,
        "mttr_s": incident.mttr_seconds,
        "detect_s": (incident.fault.detected_at - incident.fault.occurred_at).total_seconds(),
        "hang_time_s": float(next(g for g in found.groups() if g)) if found else None,
        "blamed": incident.fault.nodes,
        "struck": struck,
        "reason": incident.fault.reason[:200],
    }
    say(f"  {kind} {how}: {row['kind']}, MTTR {row['mttr_s']:.2f} s, detect {row['detect_s']:.2f} s")
    return row


def summary(rows: list[dict]) -> list[dict]:
    """Per trainer: the median MTTR of each fault, and the stopped rank's excess."""
    out = []
    for kind in dict.fromkeys(r["trainer"] for r in rows):
        mine = [r for r in rows if r["trainer"] == kind]
        killed = [r["mttr_s"] for r in mine if r["fault"] == "kill" and r["mttr_s"] is not None]
        stopped = [r for r in mine if r["fault"] == "stop" and r["mttr_s"] is not None]
        if not killed or not stopped:
            out.append({"trainer": kind, "passed": False, "why": "a run did not recover"})
            continue
        hang = statistics.median(r["hang_time_s"] or 0.0 for r in stopped)
        excess = statistics.median(r["mttr_s"] for r in stopped) - statistics.median(killed) - hang
        out.append(
            {
                "trainer": kind,
                "killed_mttr_s": statistics.median(killed),
                "stopped_mttr_s": statistics.median(r["mttr_s"] for r in stopped),
                "hang_time_s": hang,
                "excess_s": excess,
                "look_s": LEARNING_LOOK_SECONDS,
                "blamed_right": all(r["blamed"] == [r["struck"]] for r in mine),
                "passed": excess <= LEARNING_LOOK_SECONDS
                and all(r["kind"] == "hang" for r in stopped)
                and all(r["blamed"] == [r["struck"]] for r in mine),
            }
        )
    return out


async def sit(args, say) -> dict:
    env = await local_environment(runtime=quiet_runtime())  # the SDK's own lines stay off stdout
    rows = []
    try:
        for kind in args.only:
            for _ in range(args.repeat):
                for how in ("kill", "stop"):
                    rows.append(await one(env, kind, how, say))
    finally:
        await env.shutdown()
    return {"rows": rows, "summary": summary(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=1, help="runs of each trainer and fault (default 1)")
    parser.add_argument("--only", default=",".join(TRAINERS), help=f"trainers, comma-separated ({', '.join(TRAINERS)})")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON document")
    args = parser.parse_args()
    args.only = [k.strip() for k in args.only.split(",") if k.strip()]
    unknown = [k for k in args.only if k not in TRAINERS]
    if unknown or args.repeat < 1:
        parser.error(f"--only: no trainer {', '.join(unknown)}" if unknown else "--repeat: at least 1")
    started = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    result = asyncio.run(sit(args, say))
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        for row in result["summary"]:
            print(json.dumps(row))
    raise SystemExit(0 if all(r["passed"] for r in result["summary"]) else 1)


if __name__ == "__main__":
    from lazarus.client.runs import exit_after

    exit_after(main)  # past the native client's crash at interpreter exit
