"""Do runs of pytorch/examples' DDP tutorial script end on their own? Under `lazarus launch` and
under torchrun, with or without CPU contention.

    .venv/bin/python bench/teardown.py [--runs 10] [--epochs 30] [--busy 0] [--only lazarus|torchrun] [--json]
                                       [--markdown [PATH]]

The script (tests/user_script/ddp_tutorial.py) calls `destroy_process_group()` and returns from
`main`; gloo's teardown can then deadlock a rank (lazarus.trainer.agent.teardown.keep_destroyed_groups).
Each run trains 4 ranks, one per node, no fault:
  lazarus   `lazarus launch --nnodes 4 --nproc-per-node 1 --spares 0` (ranks forked from warm
            standbys), with recovery.exit_grace_seconds at 600 s so that a stuck rank shows as a
            run that does not end by itself within --timeout, rather than being ended
  torchrun  `torchrun --standalone --nproc-per-node 4`
--busy K runs K busy loops beside the runs (the deadlock needs a rank's gloo thread to miss the
GIL for a moment, which contention makes likely). A run counts as clean when every rank exited
with code 0 on its own within --timeout seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # bench/ is not an installed package

from bench import perf_page

PAGE_TITLE = "Teardown: do runs end on their own?"
ABOUT = """pytorch/examples' DDP tutorial script calls destroy_process_group() and returns from main;
gloo's teardown can then deadlock a rank (a ProcessGroupGloo destructor joining gloo's threads
while holding the GIL). Each run trains 4 ranks, one per node, with no fault: under `lazarus
launch --nnodes 4 --nproc-per-node 1 --spares 0` (ranks forked from warm standbys, with
recovery.exit_grace_seconds at 600 s so that a stuck rank shows as a run that does not end by
itself) and under `torchrun --standalone --nproc-per-node 4`. Busy loops beside the runs add CPU
contention, which makes the deadlock likely. A run counts as clean when every rank exited with
code 0 on its own within the timeout."""
SCRIPT = ROOT / "tests" / "user_script" / "ddp_tutorial.py"
SPEC = "name: ddp-tutorial\nrecovery:\n  exit_grace_seconds: 600\n"


@contextmanager
def busy_loops(count: int):
    """`count` processes spinning on a core each, stopped on leaving."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def one_run(command: list[str], env: dict, folder: Path, timeout: float) -> dict:
    """Run `command` in `folder` in a session of its own; whether it ended by itself, its status, seconds."""
    began = time.time()
    with open(folder / "output.log", "wb") as out:
        process = subprocess.Popen(
            command, env=env, cwd=folder, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = process.wait(timeout=timeout)
            ended = True
        except subprocess.TimeoutExpired:
            ended, code = False, None
            os.killpg(process.pid, signal.SIGTERM)  # lazarus launch ends its run's processes on SIGTERM
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    return {"ended": ended, "code": code, "seconds": round(time.time() - began, 1)}


def lazarus_command(home: Path, epochs: int, spec: Path) -> tuple[list[str], dict]:
    launch = [sys.executable, "-m", "lazarus.cli", "launch", "--nnodes", "4", "--nproc-per-node", "1", "--spares", "0"]
    command = [*launch, "--spec", str(spec), str(SCRIPT), str(epochs), "5"]
    return command, {**os.environ, "LAZARUS_HOME": str(home)}


def torchrun_command(epochs: int) -> tuple[list[str], dict]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    return [*torchrun, str(SCRIPT), str(epochs), "5"], {**os.environ, "OMP_NUM_THREADS": "1"}


def stop_server(home: Path) -> None:
    """Stop the dev server the first `lazarus launch` started in this bench's own home."""
    env = {**os.environ, "LAZARUS_HOME": str(home)}
    subprocess.run([sys.executable, "-m", "lazarus.cli", "server", "--stop"], env=env, capture_output=True, timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--busy", type=int, default=0, help="busy loops beside the runs")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a run gets to end by itself")
    parser.add_argument("--only", choices=["lazarus", "torchrun"])
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    perf_page.add_option(parser, __file__)
    args = parser.parse_args()
    sitting = perf_page.begin()

    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="lazarus-teardown-") as scratch, busy_loops(args.busy):
        root = Path(scratch)
        home, spec = root / "home", root / "spec.yaml"
        spec.write_text(SPEC)
        try:
            for name in ("lazarus", "torchrun"):
                if args.only not in (None, name):
                    continue
                for index in range(args.runs):
                    folder = root / f"{name}-{index}"
                    folder.mkdir()
                    command, env = (
                        lazarus_command(home, args.epochs, spec) if name == "lazarus" else torchrun_command(args.epochs)
                    )
                    run = one_run(command, env, folder, args.timeout)
                    results.setdefault(name, []).append(run)
                    print(f"{name} {index + 1}/{args.runs}: {run}", file=sys.stderr, flush=True)
        finally:
            stop_server(home)
    table = {
        name: {"clean": sum(r["ended"] and r["code"] == 0 for r in runs), "runs": len(runs), "trials": runs}
        for name, runs in results.items()
    }
    if args.markdown:
        write_markdown(args, sitting, table)
    if args.json:
        print(json.dumps({"epochs": args.epochs, "busy": args.busy, "results": table}))
        return
    print(f"DDP tutorial script, {args.epochs} epochs, 4 ranks, {args.busy} busy loop(s) beside")
    print(f"{'launcher':<10} {'ended by itself, code 0':>24} {'median s':>9}")
    for name, row in table.items():
        seconds = sorted(r["seconds"] for r in row["trials"])
        print(f"{name:<10} {row['clean']:>17} of {row['runs']:<4} {seconds[len(seconds) // 2]:>9}")


def write_markdown(args, sitting, table: dict) -> None:
    rows = []
    for name, row in table.items():
        seconds = sorted(r["seconds"] for r in row["trials"])
        rows.append([name, f"{row['clean']} of {row['runs']}", seconds[len(seconds) // 2]])
    caption = (
        f"DDP tutorial script, {args.epochs} epochs, 4 ranks, {args.busy} busy loop(s) beside, "
        f"timeout {args.timeout:g} s"
    )
    perf_page.write_page(
        args.markdown,
        sitting,
        title=PAGE_TITLE,
        doc=__doc__,
        about=ABOUT,
        tables=[perf_page.Table(["launcher", "ended by itself, code 0", "median s"], rows, caption)],
    )


if __name__ == "__main__":
    main()
