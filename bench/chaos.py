"""The chaos matrix: each fault of lazarus/chaos/scenarios.py broken into a real run, one row each.

    .venv/bin/python bench/chaos.py [--only NAME[,NAME...]] [--repeat N] [--spec examples/demo.yaml]
                                    [--kill-at-step N] [--in-process] [--slurm] [--json] [--keep DIR] [--list]
                                    [--markdown [PATH]]

Every scenario runs on a bed of its own: a Temporal dev server (a process on one SQLite file, so it
can be SIGKILLed and come back with its workflows), `lazarus worker` processes, the local backend
(with --slurm, a real Slurm cluster of this machine, its daemons started for the sitting) and the
real trainer. A row says whether the run recovered, how many incidents and new incarnations it
took, how many rank processes were started more than once, how many spares were claimed (and
claimed twice), how many complete checkpoints a recovery lost, whether the losses equal those of
the same spec trained without a fault (bit for bit; within 1e-4 relative after a reshard), and
each incident's MTTR. `passed` holds all of that at once.

Blame: of the rows whose scenario broke one node (killed, stopped, held in a collective or a loop,
slowed, made sick), the share whose first incident blamed exactly that node, and how many blamed a
node the scenario did not break (a survivor that only saw the broken collective). `--repeat N`
runs each scenario N times, for that share over repeated faults.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ is not an installed package

from bench import perf_page
from lazarus.chaos.judge import train_without_fault
from lazarus.chaos.pool_race import RACE_ROW, race_row
from lazarus.chaos.run import run_scenario
from lazarus.chaos.scenarios import BY_NAME, SCENARIOS
from lazarus.commands.demo_run import DEFAULT_SPEC, default_kill_step
from lazarus.commands.local_paths import anchor_paths
from lazarus.infra.harness.slurm_daemons import SlurmDaemons, why_not_startable
from lazarus.schema import load_spec
from lazarus.schema.load import SpecError

PAGE_TITLE = "Chaos matrix"
ABOUT = """Each fault of the chaos scenarios is broken into a real run, on a bed of its own: a Temporal
dev server (a process on one SQLite file, so it can be SIGKILLed and come back with its workflows),
`lazarus worker` processes, the local backend and the real trainer. A row says whether the run
recovered, how many incidents and new incarnations it took, how many rank processes were started
more than once, how many spares were claimed (and claimed twice), how many complete checkpoints a
recovery lost, whether the losses equal those of the same spec trained without a fault (bit for
bit; within 1e-4 relative after a reshard), each incident's MTTR (the fault to the first new
training step) and what each recovery restored from. *passed* holds all of that at once."""
RACE_WHAT = (
    "two runs of the spec on two nodes each lose a node at once, one spare between them: the one of higher "
    "priority replaces, the other reshards and grows back into the first's returned node"
)
COLUMNS = ["recovered", "incidents", "new_incarnations", "duplicate_starts", "spares_claimed", "double_claims"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated scenario names (default: all; --list shows them)")
    parser.add_argument("--spec", type=Path, default=DEFAULT_SPEC, help="run spec (default: examples/demo.yaml)")
    parser.add_argument("--kill-at-step", type=int, help="step at which each fault strikes (default: mid-run)")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON document")
    parser.add_argument(
        "--keep", type=Path, metavar="DIR", help="keep every scenario's bed (logs, run files) under DIR"
    )
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument("--repeat", type=int, default=1, help="run each scenario this many times (default 1)")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="with recovery.in_process: survivors of a lost node keep their processes; every other fault, and a "
        "survivor that does not reach its boundary, takes the restart path",
    )
    parser.add_argument(
        "--slurm",
        action="store_true",
        help="on a real Slurm cluster of 5 nodes, started on this machine for the sitting (needs Slurm and "
        "root: `make slurm-packages`), instead of the local backend",
    )
    perf_page.add_option(parser, __file__)
    args = parser.parse_args()
    if args.list:
        for scenario in SCENARIOS:
            print(f"{scenario.name:28} {scenario.what}")
        print(f"{RACE_ROW:28} {RACE_WHAT}")
        raise SystemExit(0)
    names = [n.strip() for n in args.only.split(",")] if args.only else [*(s.name for s in SCENARIOS), RACE_ROW]
    unknown = [n for n in names if n not in BY_NAME and n != RACE_ROW]
    if unknown:
        parser.error(f"--only: no scenario {', '.join(unknown)} (bench/chaos.py --list shows them)")
    if args.repeat < 1:
        parser.error("--repeat: at least 1")
    args.names = [name for name in names for _ in range(args.repeat)]
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    return args


async def matrix(args: argparse.Namespace, spec, kill_at: int, root: Path, say, slurm=None) -> list[dict]:
    say(f"reference: {spec.trainer.steps} steps of {args.spec.name} without a fault")
    reference = await asyncio.to_thread(train_without_fault, root / "reference", spec)
    rows = []
    for i, name in enumerate(args.names, 1):
        what = RACE_WHAT if name == RACE_ROW else BY_NAME[name].what
        say(f"[{i}/{len(args.names)}] {name}: {what}")
        if name == RACE_ROW:
            if slurm is not None:
                say("    skipped: the race runs on the local backend")
                continue
            row = await race_row(root / f"{name}-{i}", spec)
        else:
            try:
                row = await run_scenario(BY_NAME[name], root / f"{name}-{i}", spec, kill_at, reference, slurm=slurm)
            finally:
                if slurm is not None:
                    slurm.reset()  # every node up and free for the next scenario
        say(f"    {'passed' if row.passed else 'FAILED'} in {row.seconds:.0f} s; MTTR {row.mttr_seconds} {row.notes}")
        rows.append(row.as_dict())
    return rows


def blame(rows: list[dict]) -> str:
    """The blame line: of the rows that broke one node, how many blamed exactly it, and how many
    blamed a node that was not broken."""
    single = [r for r in rows if len(r["injected"]) == 1 and r["blamed"] is not None]
    if not single:
        return "blame: no scenario here broke one node"
    right = sum(1 for r in single if r["blamed"] == r["injected"])
    innocent = sum(1 for r in single if set(r["blamed"]) - set(r["injected"]))
    kinds = sorted({r["scenario"] for r in single})
    return (
        f"blame: {right} of {len(single)} incidents ({100 * right / len(single):.0f}%) blamed exactly the node the "
        f"scenario broke; {innocent} blamed a node it did not break ({', '.join(kinds)})"
    )


HEADER = ["scenario", *COLUMNS, "ckpts_lost", "losses", "MTTR s", "restored", "passed"]


def cells(r: dict) -> list[str]:
    """A row's cells after the scenario's name, as the matrix prints them."""
    losses = "-" if r["max_loss_difference"] is None else ("equal" if r["losses_equal"] else "DIFFER")
    return [str(r[c]) for c in COLUMNS] + [
        str(r["checkpoints_lost"]),
        losses,
        ",".join(f"{m:.2f}" for m in r["mttr_seconds"]) or "-",
        ",".join(r["restored_from"]) or "-",
        "yes" if r["passed"] else "NO",
    ]


def print_matrix(rows: list[dict], spec_path: str, kill_at: int) -> None:
    print(f"\nChaos matrix, spec {spec_path}, faults at step {kill_at}")
    print("  ".join(f"{h:>{max(len(h), 4)}}" if i else f"{h:28}" for i, h in enumerate(HEADER)))
    for r in rows:
        print(
            f"{r['scenario']:28}  "
            + "  ".join(f"{c:>{max(len(h), 4)}}" for c, h in zip(cells(r), HEADER[1:], strict=True))
        )
    for r in rows:
        for note in r["notes"]:
            print(f"  {r['scenario']}: {note}")
    print(f"\n{sum(r['passed'] for r in rows)} of {len(rows)} scenario(s) passed; {blame(rows)}")


def write_markdown(path: Path, sitting, rows: list[dict], spec_path: str, kill_at: int) -> None:
    table = perf_page.Table(
        HEADER,
        [[r["scenario"], *cells(r)] for r in rows],
        f"Chaos matrix, spec {spec_path}, faults at step {kill_at}: "
        f"{sum(r['passed'] for r in rows)} of {len(rows)} scenario(s) passed",
    )
    notes = [blame(rows)] + [f"{r['scenario']}: {note}" for r in rows for note in r["notes"]]
    perf_page.write_page(path, sitting, title=PAGE_TITLE, doc=__doc__, about=ABOUT, tables=[table], notes=notes)


@contextlib.contextmanager
def slurm_cluster(root: Path, say):
    """A real Slurm cluster of 5 nodes for the sitting, stopped at its end."""
    why = why_not_startable()
    if why is not None:
        raise SystemExit(f"bench/chaos.py --slurm: {why}")
    daemons = SlurmDaemons(root / "slurm", nodes=5)
    say(f"Slurm: starting 5 nodes in {daemons.folder}")
    daemons.start()
    try:
        yield daemons
    finally:
        daemons.stop()


def main() -> None:
    args = parse_args()
    sitting = perf_page.begin()
    # SIGTERM as Ctrl-C: every bed then ends the servers, workers and ranks it started.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        spec = anchor_paths(load_spec(args.spec), Path.cwd(), shares_paths=True)  # local, or one machine's Slurm
    except (SpecError, OSError) as error:
        raise SystemExit(f"bench/chaos.py: {error}") from None
    if args.in_process:
        spec = spec.model_copy(update={"recovery": spec.recovery.model_copy(update={"in_process": True})})
    kill_at = args.kill_at_step or default_kill_step(spec)
    started = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    with contextlib.nullcontext(str(args.keep)) if args.keep else tempfile.TemporaryDirectory() as root:
        with slurm_cluster(Path(root), say) if args.slurm else contextlib.nullcontext() as slurm:
            if slurm is not None:
                spec = spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"backend": "slurm"})})
            rows = asyncio.run(matrix(args, spec, kill_at, Path(root), say, slurm))
    label = f"{args.spec} with recovery.in_process" if args.in_process else str(args.spec)
    if args.markdown:
        write_markdown(args.markdown, sitting, rows, label, kill_at)
    if args.json:
        print(json.dumps({"spec": label, "kill_at_step": kill_at, "rows": rows}, indent=2))
    else:
        print_matrix(rows, label, kill_at)
    raise SystemExit(0 if all(r["passed"] for r in rows) else 1)


if __name__ == "__main__":
    from lazarus.client.runs import exit_after

    exit_after(main)  # past the native client's crash at interpreter exit
