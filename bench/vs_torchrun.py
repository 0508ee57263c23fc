"""Lazarus against torchrun elastic: a node killed at the same step, time to the first training step after.

    .venv/bin/python bench/vs_torchrun.py [--repetitions 3] [--kill-at-step 70] [--json] [--only NAME]
                                          [--markdown [PATH]]

One script for all three (bench/elastic_train.py: same model, data, global batch, checkpoint
interval), 2 nodes of 2 ranks each:
  torchrun_default  two torchrun agents as two nodes (c10d rendezvous, min 1 max 2 nodes),
                    torchrun's defaults but --max-restarts 10 (its default, 0, never restarts);
                    the first agent hosts the rendezvous store
  torchrun_tuned    the same with last_call_timeout=1, keep_alive_interval=1,
                    keep_alive_max_attempt=2, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and the store
                    in a process of its own (is_host=0), as ../shared/FIELD-NOTES.md tuned it
  lazarus           the local backend with one hot spare node and warm standbys, a Temporal
                    dev server and an in-process worker
In each repetition the second node dies (every process of it, SIGKILL) once the job reaches
--kill-at-step. MTTR is the kill to the first step the restarted job trains (rank 0's step
log); steps lost are the steps trained after the checkpoint it resumed from; world is the
world size after recovery. A recovery that has not trained within --timeout seconds failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import perf_page
from lazarus.infra.backend import free_port
from lazarus.infra.backends.local.cluster import LocalCluster

PAGE_TITLE = "Against torchrun elastic"
ABOUT = """One training script (bench/elastic_train.py: DDP, same model, data, global batch 256,
checkpoint every 20 steps) on 2 nodes of 2 ranks, the second node (every process of it) SIGKILLed
once the job reaches the kill step. *lazarus*: the local backend with one hot spare node and warm
standbys, the script using lazarus.session. *lazarus_launch*: torchrun's command line with its
first word changed to `lazarus launch` and `--spares 1`, the script keeping its own checkpoint.
*torchrun_tuned*: two torchrun agents with last_call_timeout=1, keep-alive 1 s x 2 and the
rendezvous store in a process of its own. *torchrun_default*: torchrun as it ships, with
--max-restarts 10. MTTR is the kill to the first step the restarted job trains (rank 0's step
log); steps lost are the steps trained after the checkpoint it resumed from; world is the world
size after recovery (torchrun has no spare and goes on with 2 ranks). A recovery that has not
trained within the timeout failed."""
SCRIPT = ROOT / "bench" / "elastic_train.py"
CHECKPOINT_EVERY = 20


@dataclass
class Trial:
    """One repetition."""

    mttr_s: float | None
    lost_steps: int | None
    world_after: int | None
    failed: bool


def step_log(path: Path) -> list[dict]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    # Rank 0 may be writing the last line as it is read: only whole lines count.
    return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]


def wait_for_step(path: Path, step: int, timeout: float) -> dict | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = step_log(path)
        if rows and rows[-1]["step"] >= step:
            return rows[-1]
        time.sleep(0.01)
    return None


def first_step_after(path: Path, restart: int, timeout: float) -> dict | None:
    """The first step logged by a later restart round (or incarnation) than `restart`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for row in step_log(path):
            if row["restart"] > restart:
                return row
        time.sleep(0.01)
    return None


def trial_from(log: Path, killed_at: float, before: dict, after: dict | None) -> Trial:
    if after is None:
        return Trial(None, None, None, failed=True)
    return Trial(after["time"] - killed_at, before["step"] - (after["step"] - 1), after["world"], failed=False)


def descendants(pid: int) -> list[int]:
    """pid and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += children.get(current, [])
    return found


def kill_tree(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def torchrun_flags(port: int) -> list[str]:
    """torchrun's flags of every torchrun trial: two agents as two nodes of two ranks."""
    return ["--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint"] + [
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "bench",
        "--max-restarts",
        "10",
    ]


def torchrun_trial(tuned: bool, kill_at: int, timeout: float, folder: Path) -> Trial:
    port = free_port()
    log = folder / "steps.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "INFO"}
    store = None
    conf = []
    if tuned:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        conf = ["--rdzv-conf", "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2,is_host=0"]
        store = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import time, torch.distributed as d; "
                f"s = d.TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False); "
                "time.sleep(1e6)",
            ],
            env=env,
            start_new_session=True,
        )
    command = [
        str(Path(sys.executable).parent / "torchrun"),
        *torchrun_flags(port),
        *conf,
        str(SCRIPT),
        "--step-log",
        str(log),
        "--checkpoint-dir",
        str(folder / "checkpoints"),
        "--checkpoint-every",
        str(CHECKPOINT_EVERY),
    ]
    agents = []
    try:
        for name in ("a", "b"):
            with open(folder / f"agent-{name}.log", "ab") as out:
                agents.append(
                    subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
                )
            time.sleep(0.5 if name == "a" else 0)  # the first agent up is the one that hosts the store
        before = wait_for_step(log, kill_at, timeout)
        if before is None or before["world"] != 4:
            return Trial(None, None, None, failed=True)
        victims = descendants(agents[1].pid)
        killed_at = time.time()
        kill_tree(victims)
        after = first_step_after(log, before["restart"], timeout)
        return trial_from(log, killed_at, before, after)
    finally:
        for agent in agents:
            kill_tree(descendants(agent.pid))
        if store:
            kill_tree([store.pid])
        for process in agents + ([store] if store else []):
            process.wait()


def launch_trial(index: int, kill_at: int, timeout: float, folder: Path, address: str) -> Trial:
    """One repetition of lazarus_launch: the torchrun command line with its first word changed."""
    log, home = folder / "steps.jsonl", folder / "home"
    run_id = f"launch-{index}"
    command = [sys.executable, "-m", "lazarus.cli", "launch", *torchrun_flags(free_port()), "--spares", "1"]
    command[command.index("bench")] = run_id  # --rdzv-id: the run's id
    command += [str(SCRIPT), "--step-log", str(log), "--checkpoint-dir", "checkpoints", "--no-helper"]
    env = {**os.environ, "LAZARUS_HOME": str(home), "LAZARUS_TEMPORAL_ADDRESS": address}
    with open(folder / "launch.log", "ab") as out:
        launcher = subprocess.Popen(command, env=env, cwd=folder, stdout=out, stderr=subprocess.STDOUT)
    cluster = LocalCluster(home)
    try:
        before = wait_for_step(log, kill_at, timeout)
        if before is None:
            return Trial(None, None, None, failed=True)
        killed_at = time.time()
        cluster.kill_node(run_id, "node-1")
        after = first_step_after(log, before["restart"], timeout)
        return trial_from(log, killed_at, before, after)
    finally:
        launcher.send_signal(signal.SIGINT)  # it terminates the run and stops its ranks
        try:
            launcher.wait(timeout=60)
        except subprocess.TimeoutExpired:
            launcher.kill()
        cluster.stop_run(run_id)


async def launch_trials(repetitions: int, kill_at: int, timeout: float, root: Path) -> list[Trial]:
    from lazarus.infra.harness.temporal_server import local_environment, quiet_runtime

    env = await local_environment(runtime=quiet_runtime())
    address = env.client.service_client.config.target_host
    try:
        trials = []
        for index in range(repetitions):
            folder = root / f"lazarus_launch-{index}"
            folder.mkdir()
            trials.append(await asyncio.to_thread(launch_trial, index, kill_at, timeout, folder, address))
        return trials
    finally:
        await env.shutdown()


async def lazarus_trials(repetitions: int, kill_at: int, timeout: float, folder: Path) -> list[Trial]:

    from lazarus.client.config import Settings
    from lazarus.client.runs import start_run
    from lazarus.infra.harness.temporal_server import local_environment, quiet_runtime
    from lazarus.schema import parse_spec
    from lazarus.worker import build_worker

    env = await local_environment(runtime=quiet_runtime())
    cluster = LocalCluster(folder / "home")
    trials = []
    try:
        async with build_worker(env.client, "vs-torchrun", cluster):
            for index in range(repetitions):
                log = folder / f"lazarus-{index}.jsonl"
                spec = parse_spec(
                    {
                        "name": "vs-torchrun",
                        "trainer": {
                            "command": [
                                "python",
                                str(SCRIPT),
                                "--step-log",
                                str(log),
                                "--checkpoint-every",
                                str(CHECKPOINT_EVERY),
                            ],
                            "steps": 100000,
                            "checkpoint_every": CHECKPOINT_EVERY,
                        },
                        "layout": {"dp": 4, "ranks_per_node": 2},
                        "cluster": {"active_nodes": 2, "spare_nodes": 1},
                        "recovery": {"heartbeat_interval_seconds": 0.05},
                    }
                )
                run_id = f"vs-torchrun-{index}"
                handle = await start_run(env.client, Settings(task_queue="vs-torchrun"), spec, run_id)
                try:
                    before = await asyncio.to_thread(wait_for_step, log, kill_at, timeout)
                    if before is None:
                        trials.append(Trial(None, None, None, failed=True))
                    else:
                        # The runs share the home's pool, so a later repetition has other nodes than
                        # node-0 and node-1: the second node is the one of ranks 2 and 3.
                        second = cluster.assignment(run_id, 0).nodes[1]
                        killed_at = time.time()
                        # In a thread: the worker shares this event loop, and the chaos is not its work.
                        await asyncio.to_thread(cluster.kill_node, run_id, second)
                        after = await asyncio.to_thread(first_step_after, log, before["restart"], timeout)
                        trials.append(trial_from(log, killed_at, before, after))
                finally:
                    # Terminating cancels the run's activities; each would log its cancellation.
                    logging.getLogger("temporalio").setLevel(logging.CRITICAL)
                    await handle.terminate("benchmark repetition done")
                    cluster.stop_run(run_id)
    finally:
        await env.shutdown()
    return trials


def summary(trials: list[Trial]) -> dict:
    good = [t for t in trials if not t.failed]
    mttrs = [t.mttr_s for t in good]
    return {
        "mttr_median_s": statistics.median(mttrs) if mttrs else None,
        "mttr_min_s": min(mttrs) if mttrs else None,
        "mttr_max_s": max(mttrs) if mttrs else None,
        "lost_steps": statistics.median([t.lost_steps for t in good]) if good else None,
        "world_after": statistics.median([t.world_after for t in good]) if good else None,
        "failed": sum(t.failed for t in trials),
        "trials": [asdict(t) for t in trials],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--kill-at-step", type=int, default=70)
    parser.add_argument(
        "--timeout", type=float, default=180.0, help="seconds a recovery may take before it counts as failed"
    )
    parser.add_argument(
        "--only", choices=["lazarus", "lazarus_launch", "torchrun_default", "torchrun_tuned"], action="append"
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--keep", type=Path, help="keep the agents' logs and step logs in this folder")
    perf_page.add_option(parser, __file__)
    args = parser.parse_args()
    sitting = perf_page.begin()
    names = args.only or ["lazarus", "lazarus_launch", "torchrun_tuned", "torchrun_default"]

    results = {}
    with tempfile.TemporaryDirectory() as temporary:
        root = args.keep or Path(temporary)
        root.mkdir(parents=True, exist_ok=True)
        for name in names:
            if name == "lazarus":
                folder = root / name
                folder.mkdir()
                trials = asyncio.run(lazarus_trials(args.repetitions, args.kill_at_step, args.timeout, folder))
            elif name == "lazarus_launch":
                trials = asyncio.run(launch_trials(args.repetitions, args.kill_at_step, args.timeout, root))
            else:
                trials = []
                for index in range(args.repetitions):
                    folder = root / f"{name}-{index}"
                    folder.mkdir()
                    trials.append(torchrun_trial(name == "torchrun_tuned", args.kill_at_step, args.timeout, folder))
            results[name] = summary(trials)
            if not args.json:
                print(f"{name}: {[round(t.mttr_s, 2) if t.mttr_s else 'failed' for t in trials]}", file=sys.stderr)
    if args.markdown:
        write_markdown(args, sitting, results)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"\nA node (2 of 4 ranks) killed at step {args.kill_at_step}, {args.repetitions} repetition(s)")
    print(f"{'':<18}{'MTTR median':>12}{'min':>8}{'max':>8}{'steps lost':>12}{'world after':>13}{'failed':>8}")
    for name, r in results.items():
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        print(
            f"{name:<18}{fmt(r['mttr_median_s']):>12}{fmt(r['mttr_min_s']):>8}{fmt(r['mttr_max_s']):>8}"
            f"{'-' if r['lost_steps'] is None else r['lost_steps']:>12}"
            f"{'-' if r['world_after'] is None else r['world_after']:>13}{r['failed']:>8}"
        )


def write_markdown(args, sitting, results: dict) -> None:
    def fmt(v):
        return "-" if v is None else f"{v:.2f}"

    rows = [
        [
            name,
            fmt(r["mttr_median_s"]),
            fmt(r["mttr_min_s"]),
            fmt(r["mttr_max_s"]),
            "-" if r["lost_steps"] is None else r["lost_steps"],
            "-" if r["world_after"] is None else r["world_after"],
            r["failed"],
        ]
        for name, r in results.items()
    ]
    caption = (
        f"A node (2 of 4 ranks) killed at step {args.kill_at_step}, {args.repetitions} repetition(s), "
        f"timeout {args.timeout:g} s (seconds)"
    )
    headers = ["", "MTTR median", "min", "max", "steps lost", "world after", "failed"]
    notes = [
        f"{name}, each repetition: "
        + ", ".join("failed" if t["failed"] else f"{t['mttr_s']:.2f} s" for t in r["trials"])
        for name, r in results.items()
    ]
    perf_page.write_page(
        args.markdown,
        sitting,
        title=PAGE_TITLE,
        doc=__doc__,
        about=ABOUT,
        tables=[perf_page.Table(headers, rows, caption)],
        notes=notes,
    )


if __name__ == "__main__":
    from lazarus.client.runs import exit_after

    exit_after(main)  # past the native client's crash at interpreter exit
