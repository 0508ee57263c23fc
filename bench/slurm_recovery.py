"""Recovery cost on the Slurm backend, on a real Slurm cluster of this machine, beside the local
backend's in the same sitting.

    .venv/bin/python bench/slurm_recovery.py [--kills 3] [--json] [--only BACKEND] [--markdown [PATH]]

Needs root and Debian's Slurm packages (`make slurm-packages`); it starts a cluster of its own
(lazarus.infra.harness.slurm_daemons: 5 nodes, every node this host) and stops it at the end. Each kill
is its own run of the demo spec (4 active nodes and 1 hot spare, warm standbys) on a private
Temporal dev server with one in-process worker: on Slurm, the nodes held in one allocation, each
node's standby and launcher job steps. Three rows of runs:

- slurm: a node dies as its slurmd and every process of its steps are SIGKILLed; the survivors'
  broken collectives and the ranks' vanished locks tell the controller first (slurmctld learns of
  it about SlurmdTimeout later);
- slurm-silent: its slurmd is SIGKILLed and its processes SIGSTOPped, sockets open: no peer and no
  lock says anything, and only slurmctld (the node not responding) or the hang time tells;
- local: the same kill on the local backend.

Stage times are those the workflow records (as in bench/recovery.py); `unseen` is the time from the
kill to the fault's best known time, before detect's clock starts (a silent node's share).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ is not an installed package

from bench import perf_page
from bench.recovery import COLUMNS, row
from lazarus.client.config import Settings
from lazarus.commands.demo_run import DEFAULT_SPEC, default_kill_step, drive_run
from lazarus.commands.local_paths import anchor_paths
from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.infra.backends.slurm.cluster import SlurmCluster
from lazarus.infra.harness.slurm_daemons import SlurmDaemons, why_not_startable
from lazarus.infra.harness.temporal_server import local_environment
from lazarus.schema import RunState, load_spec
from lazarus.worker import build_worker

BACKENDS = ("slurm", "slurm-silent", "local")
"""The rows of runs: a node killed on Slurm, a node silenced on Slurm, a node killed on the local backend."""
PAGE_TITLE = "Recovery on Slurm"
ABOUT = """The demo spec (4 active nodes and 1 hot spare, warm standbys) on a real Slurm cluster the
bench starts on this machine (5 nodes, every node this host), beside the local backend in the same
sitting; each kill is its own run on a private Temporal dev server with one in-process worker. On
Slurm the nodes are held in one allocation, with each node's standby and launcher as job steps.
*slurm*: a node dies as its slurmd and every process of its steps are SIGKILLed (the survivors'
broken collectives and the ranks' vanished locks tell the controller first). *slurm-silent*: its
slurmd is SIGKILLed and its processes SIGSTOPped, sockets open, so only slurmctld (the node not
responding) or the hang time tells. *local*: the same kill on the local backend. Stage times are
those the workflow records; *unseen* is the time from the kill to the fault's best known time,
before detect's clock starts (a silent node's share)."""


async def kills_on(backend: str, kills: int, say) -> list[dict]:
    """`kills` runs of the demo spec on `backend` ("slurm", "slurm-silent" or "local"), a node killed
    (or silenced) mid-run in each; one row (bench/recovery.py's columns) per run."""
    spec = anchor_paths(load_spec(DEFAULT_SPEC), Path.cwd(), shares_paths=True)  # one machine's Slurm cluster
    on_slurm = backend.startswith("slurm")
    if on_slurm:
        spec = spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"backend": "slurm"})})
    kill_at = default_kill_step(spec)
    scratch = Path(tempfile.mkdtemp(prefix=f"lazarus-bench-{backend}-"))
    daemons = SlurmDaemons(scratch / "slurm", nodes=5) if on_slurm else None
    sig = signal.SIGSTOP if backend == "slurm-silent" else signal.SIGKILL
    env = await local_environment()
    rows = []
    try:
        if daemons is not None:
            daemons.start()
        home = scratch / "home"
        cluster = SlurmCluster(home, environ=daemons.env) if daemons else LocalCluster(home)
        settings = Settings(address=env.client.service_client.config.target_host, home=home, task_queue="bench")

        killed_at: list[float] = []

        async def kill(run_id: str, node: str) -> list[int]:
            killed_at.append(time.time())
            if daemons is None:
                return await asyncio.to_thread(cluster.kill_node, run_id, node)
            return await asyncio.to_thread(daemons.kill_node, node, sig)

        async with build_worker(env.client, settings.task_queue, cluster):
            for i in range(kills):
                say(f"{backend} run {i + 1}/{kills}: kill a node at step {kill_at}")
                final = await drive_run(env.client, settings, cluster, spec, f"bench-{i}", kill_at, say, kill)
                if final.state != RunState.COMPLETED or len(final.incidents) != 1:
                    raise SystemExit(
                        f"bench: {backend} run {i + 1} ended {final.state.value} with "
                        f"{len(final.incidents)} incident(s): {final.reason}"
                    )
                incident = final.incidents[0]
                # Before detect's clock starts: from the kill to the fault's best known time (the
                # backend's death time; for a silent node, when slurmctld stopped hearing from it).
                unseen = max(0.0, incident.fault.occurred_at.timestamp() - killed_at[-1])
                rows.append({"unseen": unseen, **row(incident), "fault": incident.fault.kind})
                # The killed node repaired for the next run: back in the pool (and resumed in Slurm,
                # its slurmd running again).
                if daemons is not None:
                    daemons.reset()
                cluster.repair_after(f"bench-{i}")
    finally:
        await env.shutdown()
        if daemons is not None:
            daemons.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=3, help="runs per backend, one node killed in each (default 3)")
    parser.add_argument("--json", action="store_true", help="print per-run rows and medians as JSON")
    parser.add_argument(
        "--only", action="append", choices=BACKENDS, help="run only these rows of runs (repeatable; default: all)"
    )
    perf_page.add_option(parser, __file__)
    args = parser.parse_args()
    if args.kills < 1:
        parser.error("--kills must be at least 1")
    why = why_not_startable()
    if why is not None:
        raise SystemExit(f"bench: cannot start a Slurm cluster here: {why}")
    sitting = perf_page.begin()
    started = time.monotonic()

    def say(message: str) -> None:
        if not args.json:
            print(f"[{time.monotonic() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    backends = args.only or BACKENDS
    results = {backend: asyncio.run(kills_on(backend, args.kills, say)) for backend in backends}
    columns = ["unseen", *COLUMNS]
    medians = {b: {c: statistics.median(r[c] for r in rows) for c in columns} for b, rows in results.items()}
    if args.markdown:
        write_markdown(args.markdown, sitting, results, medians, columns, args.kills)
    if args.json:
        print(json.dumps({"runs": results, "median": medians}, indent=2))
        return
    print(f"\nRecovery with a hot spare, demo spec, {args.kills} kill(s) per backend, one sitting (seconds)")
    widths = {c: max(len(c), 6) + 2 for c in columns}
    print(f"{'backend':<22}" + "".join(f"{c:>{widths[c]}}" for c in columns))
    for backend, rows in results.items():
        for i, r in enumerate(rows, 1):
            print(f"{backend + ' ' + str(i):<22}" + "".join(f"{r[c]:>{widths[c]}.2f}" for c in columns))
        print(f"{backend + ' median':<22}" + "".join(f"{medians[backend][c]:>{widths[c]}.2f}" for c in columns))
    for backend, rows in results.items():
        for what, key in (("seen as", "fault"), ("restored from", "restored_from")):
            said = [r[key] for r in rows]
            print(f"{backend} {what}: " + ", ".join(f"{s} {said.count(s)}/{len(rows)}" for s in sorted(set(said))))


def write_markdown(path: Path, sitting, results: dict, medians: dict, columns: list[str], kills: int) -> None:
    body = []
    for backend, rows in results.items():
        body += [[f"{backend} {i}", *(f"{r[c]:.2f}" for c in columns)] for i, r in enumerate(rows, 1)]
        body.append([f"{backend} median", *(f"{medians[backend][c]:.2f}" for c in columns)])
    caption = f"Recovery with a hot spare, demo spec, {kills} kill(s) per backend, one sitting (seconds)"
    notes = []
    for backend, rows in results.items():
        for what, key in (("seen as", "fault"), ("restored from", "restored_from")):
            said = [r[key] for r in rows]
            notes.append(
                f"{backend} {what}: " + ", ".join(f"{s} {said.count(s)}/{len(rows)}" for s in sorted(set(said)))
            )
    table = perf_page.Table(["backend", *columns], body, caption)
    perf_page.write_page(path, sitting, title=PAGE_TITLE, doc=__doc__, about=ABOUT, tables=[table], notes=notes)


if __name__ == "__main__":
    from lazarus.client.runs import exit_after

    exit_after(main)  # past the native client's crash at interpreter exit
