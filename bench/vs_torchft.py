"""Lazarus's in-process recovery against torchft: one of two data-parallel replicas killed mid-run.

    .venv/bin/python bench/vs_torchft.py [--kills 3] [--spec examples/demo.yaml] [--kill-at-step N]
                                         [--timeout 180] [--json] [--markdown [PATH]]

Both sides train the same model on the same data: the built-in trainer's GPT and token stream
(lazarus.trainer.gpt), at the spec's sizes and global batch, as 2 data-parallel replicas of one rank
each over gloo on CPU, for the spec's steps. Once the second replica reaches the kill step, every
process of it dies (SIGKILL). The kills alternate, torchft then Lazarus, in one sitting, so that a
machine busier at one moment weighs on both alike.

  torchft   torchft-nightly (installed on first use into bench/.torchft, beside the venv's torch):
            a lighthouse (min_replicas 1, heartbeat timeout 0.5 s, join timeout 0.1 s) and two
            replica groups, each one process with its own TCPStore, a torchft Manager and
            ProcessGroupGloo with a 1 s timeout, healing over the process group (PGTransport).
            The killed group is started again at once as a fresh process, as torchft's examples
            restart one; it heals from the survivor. Each group logs every committed step: the
            wall time, the step, the replicas that took part and the quorum's id.
  lazarus   the local backend, 2 active nodes and 1 hot spare, recovery.in_process: the survivor
            keeps its process and waits at its step boundary; the spare's rank joins it and
            receives the state in memory. A Temporal dev server and an in-process worker drive it.

The figures, each from the kill:
  survivors_stall      to the surviving replica's next completed step in a group without the dead
                       one: torchft, the survivor's first step committed in a quorum other than
                       the one of the kill; Lazarus, the largest stall of the ranks not on the
                       killed node (incident.stalls: the fault to the rank's first step past the
                       restore).
  full_width           to the first step completed by both replicas again: torchft, the later of
                       the two groups' first steps with 2 participants after the kill; Lazarus,
                       the MTTR (the largest stall over all ranks).
  reduced_width_steps  steps the survivor committed in between with 1 replica, on half the global
                       batch: torchft trains on; Lazarus's survivor waits, so 0 by design.
  lost_steps           committed steps redone: torchft, how far the survivor's step went back
                       (it keeps its state); Lazarus, the incident's lost_steps.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # bench/ is not an installed package

# Only perf_page (stdlib and yaml) at the top: this file is also the torchft processes' program, and
# they run with bench/.torchft first on their path, whose protobuf is older than the one Temporal's
# client needs. The Lazarus side's imports are inside its functions.
from bench import perf_page

PAGE_TITLE = "Against torchft"
ABOUT = """One of two data-parallel replicas (one rank each, gloo on CPU) SIGKILLed at the same step,
both sides training the built-in trainer's GPT on its token stream at the spec's sizes, global batch
and steps; the kills alternate between the two in one sitting. *torchft*: torchft-nightly 2026.10.26,
tuned: lighthouse heartbeat timeout 0.5 s and join timeout 0.1 s, Manager and gloo timeout 1 s,
healing over the process group; the killed replica group restarts at once as a fresh process.
*lazarus*: the local backend with one hot spare node (warm standbys) and `recovery.in_process`,
a Temporal dev server and an in-process worker. *survivors_stall*: the kill to the surviving
replica's next completed step without the dead one. *full_width*: the kill to the first step both
replicas complete again (Lazarus: the MTTR). *reduced_width_steps*: steps trained in between by
the survivor alone, on half the global batch (torchft trains on; Lazarus's survivor waits).
*lost_steps*: committed steps trained again."""

TORCHFT_DIR = ROOT / "bench" / ".torchft"  # ignored by git
# Two folders, installed apart so that neither pip run overwrites the other's files (both have a bin/).
# torchft never with its dependencies: they name torch, and the venv's torch must stay the only one.
TORCHFT_INSTALLS = {
    "torchft": ["--no-deps", "torchft-nightly==2026.10.26"],
    # Pinned: newer ones failed to import here (../shared/FIELD-NOTES.md). torchft imports only the
    # OTLP HTTP exporter (torchft/otel.py), and only when TORCHFT_USE_OTEL is set, which it never is.
    "deps": [
        "opentelemetry-api==1.39.1",
        "opentelemetry-sdk==1.39.1",
        "opentelemetry-exporter-otlp-proto-http==1.39.1",
        "importlib-metadata==8.7.0",
    ],
}
INSTALLED_MARK = TORCHFT_DIR / "installed"

# torchft's tuning: each value far below its default (join 60 s, heartbeat 5 s, timeouts 60 s).
JOIN_TIMEOUT_MS = 100  # the lighthouse's wait for a straggler before a quorum without it
HEARTBEAT_TIMEOUT_MS = 500  # a replica silent this long is dead to the lighthouse
TORCHFT_TIMEOUT_S = 1.0  # Manager's timeout and gloo's: a collective with a dead peer fails after it
HEAL_TIMEOUT_S = 10.0  # the state's transfer to a healing replica (train_ddp.py's value)

REPLICAS = 2
VICTIM = 1  # the replica killed: the second, as on the Lazarus side (the middle node of two)
SIDES = ["torchft", "lazarus"]
FIGURES = ["survivors_stall", "full_width", "reduced_width_steps", "lost_steps"]
EXTRA = {"torchft": ["replacement_up"], "lazarus": ["restored_from"]}
EXTRA_CAPTIONS = {
    "torchft": "replacement_up: the kill to the new process's Manager being up, a part of full_width",
    "lazarus": "restored_from: where the recovered state came from",
}


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- torchft: installation ---------------------------------------------------------------------


def ensure_torchft() -> list[Path]:
    """The folders to put on the torchft processes' path, installed on first use."""
    folders = [TORCHFT_DIR / name for name in TORCHFT_INSTALLS]
    if INSTALLED_MARK.exists() and json.loads(INSTALLED_MARK.read_text()) == TORCHFT_INSTALLS:
        return folders
    say(f"installing torchft into {TORCHFT_DIR.relative_to(ROOT)} (once)")
    for folder, packages in zip(folders, TORCHFT_INSTALLS.values(), strict=True):
        say(f"  pip install --target {folder.relative_to(ROOT)} {' '.join(packages)}")
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--upgrade", "--target", str(folder), *packages],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")]
            raise SystemExit(f"vs_torchft: cannot install {packages[-1]}: {(errors or ['pip failed'])[-1]}")
    INSTALLED_MARK.write_text(json.dumps(TORCHFT_INSTALLS) + "\n")
    return folders


def torchft_env(folders: list[Path]) -> dict[str, str]:
    """The torchft processes' environment: torchft on the path, gloo on loopback, no telemetry."""
    path = os.pathsep.join([*map(str, folders), str(ROOT)])
    return {
        **os.environ,
        "PYTHONPATH": path,
        "GLOO_SOCKET_IFNAME": "lo",  # gloo's sockets on 127.0.0.1 only
        "OMP_NUM_THREADS": "1",  # as Lazarus's launcher sets it for ranks
        "TORCHFT_USE_OTEL": "false",
    }


# --- torchft: the processes (this file run with --torchft-lighthouse / --torchft-replica) -------


def lighthouse_process() -> None:
    """Serve a lighthouse on a free loopback port, print the port, and serve until stdin closes."""
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=1,
        join_timeout_ms=JOIN_TIMEOUT_MS,
        heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
    )
    print(server.address().rsplit(":", 1)[1], flush=True)  # the address names the host, not 127.0.0.1
    sys.stdin.read()
    server.shutdown()


def bind_manager_to_loopback() -> None:
    """Manager binds its server to [::] (every interface); this bench keeps everything on 127.0.0.1."""
    import torchft.manager

    server = torchft.manager.ManagerServer

    def loopback(**kwargs):
        kwargs["bind"] = "127.0.0.1:" + kwargs["bind"].rsplit(":", 1)[1]
        return server(**kwargs)

    torchft.manager.ManagerServer = loopback


def replica_group(config: dict):
    """A replica group's one rank: the built-in trainer's GPT under a torchft Manager; (the group's
    store, which must outlive the Manager, the Manager, the model wrapped for torchft's DDP, the
    optimizer wrapped for its commits)."""
    import torch
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    from lazarus.trainer.gpt.model import GPT

    bind_manager_to_loopback()
    torch.set_num_threads(1)
    t = config["trainer"]
    torch.manual_seed(t["seed"])
    model = GPT(t["vocab_size"], t["seq_len"], t["d_model"], t["n_layers"], t["n_heads"])
    inner = torch.optim.AdamW(model.parameters(), lr=t["learning_rate"])

    def load_state_dict(state: dict) -> None:  # a healing replica's state, from a peer
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    # The replica group's own store (torchrun would host it): the Manager and the group's ranks meet there.
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=TORCHFT_TIMEOUT_S))
    manager = Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        min_replica_size=1,
        timeout=timedelta(seconds=TORCHFT_TIMEOUT_S),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=config["lighthouse"],
        replica_id=f"vs_torchft_{config['replica']}",
        hostname="127.0.0.1",
        checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=HEAL_TIMEOUT_S), device=torch.device("cpu")),
    )
    return store, manager, DistributedDataParallel(manager, model), Optimizer(manager, inner)


def replica_process(config: dict) -> None:
    """One replica group: train to the spec's steps, logging when it is up and each committed step."""
    import torch

    from lazarus.trainer.gpt.data import batch, share

    t = config["trainer"]
    with open(config["log"], "a", buffering=1) as log:
        _store, manager, ddp, optimizer = replica_group(config)
        log.write(json.dumps({"t": time.time(), "ready": True}) + "\n")
        offsets = share(t["global_batch"], REPLICAS, config["replica"])
        while (step := manager.current_step()) < t["steps"]:
            optimizer.zero_grad()  # starts the step's quorum (and a heal, for a new replica)
            inputs, targets = batch(t["seed"], step * t["global_batch"], offsets, t["seq_len"], t["vocab_size"])
            logits = ddp(inputs)
            torch.nn.functional.cross_entropy(logits.reshape(-1, t["vocab_size"]), targets.reshape(-1)).backward()
            optimizer.step()  # steps only if every replica's allreduce went through (should_commit)
            if manager.current_step() > step:
                # The quorum's id is not public API; it tells a step of the old group from one of the new.
                line = {"t": time.time(), "step": manager.current_step(), "participants": manager.num_participants()}
                log.write(json.dumps({**line, "quorum": manager._quorum_id}) + "\n")
    # As bench/teardown.py found for gloo: a group's teardown can hang at exit; nothing is left to save.
    os._exit(0)


# --- torchft: one trial -------------------------------------------------------------------------

STARTED: list[subprocess.Popen] = []
"""Every process this bench started, so that each one is stopped at the end, whatever happened."""
STOPPING = threading.Event()
"""Set as the sitting ends: a torchft trial still running in its thread (an interrupt) stops too."""


def start(args: list[str], env: dict, output: Path, *, piped: bool = False) -> subprocess.Popen:
    """This file run as one of torchft's processes, its output to `output` (with `piped`, stdin and
    stdout are pipes to this process instead: the lighthouse says its port on stdout)."""
    with open(output, "ab") as out:
        pipe = subprocess.PIPE if piped else None
        process = subprocess.Popen(
            [sys.executable, __file__, *args], env=env, stdin=pipe, stdout=pipe or out, stderr=out
        )
    STARTED.append(process)
    return process


def stop(processes: list[subprocess.Popen]) -> None:
    """SIGKILL each of these processes still running (by its pid) and reap it."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
        process.wait()


def start_lighthouse(env: dict, folder: Path) -> tuple[subprocess.Popen, str]:
    process = start(["--torchft-lighthouse"], env, folder / "lighthouse.log", piped=True)
    ready, _, _ = select.select([process.stdout], [], [], 60)
    port = process.stdout.readline().decode().strip() if ready else ""
    if not port.isdigit():
        raise SystemExit(f"vs_torchft: the lighthouse did not start: {tail(folder / 'lighthouse.log')}")
    return process, f"http://127.0.0.1:{port}"


def start_replica(replica: int, log: Path, trainer: dict, lighthouse: str, env: dict, folder: Path):
    config = {"replica": replica, "log": str(log), "trainer": trainer, "lighthouse": lighthouse}
    return start(["--torchft-replica", json.dumps(config)], env, folder / f"{log.stem}.out")


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"


def read_log(path: Path) -> list[dict]:
    """A replica's records (when it was up, then each committed step); only whole lines: it may be
    writing the last one."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]


def steps_of(records: list[dict]) -> list[dict]:
    return [r for r in records if "step" in r]


def wait_until(done, processes: list[subprocess.Popen], deadline: float, what: str, folder: Path) -> None:
    """Poll `done()` every 10 ms; a replica that ends badly, the deadline or the sitting's end
    (an interrupt) ends the trial."""
    while not done():
        for process in processes:
            if process.poll() not in (None, 0):
                outputs = "\n".join(f"--- {p.name}\n{tail(p)}" for p in sorted(folder.glob("*.out")))
                raise SystemExit(f"vs_torchft: a torchft replica exited {process.returncode} {what}:\n{outputs}")
        if time.monotonic() > deadline:
            raise SystemExit(f"vs_torchft: torchft trial timed out {what}")
        if STOPPING.is_set():
            raise SystemExit("vs_torchft: interrupted")
        time.sleep(0.01)


def torchft_trial(trainer: dict, kill_at: int, folder: Path, env: dict, timeout: float) -> dict:
    """Two replica groups; the second SIGKILLed at `kill_at` and started again at once; the figures."""
    folder.mkdir(parents=True)
    deadline = time.monotonic() + timeout
    mine: list[subprocess.Popen] = []
    try:
        lighthouse, address = start_lighthouse(env, folder)
        mine.append(lighthouse)
        logs = [folder / f"replica{i}.jsonl" for i in range(REPLICAS)]
        replicas = [start_replica(i, logs[i], trainer, address, env, folder) for i in range(REPLICAS)]
        mine += replicas

        def reached() -> bool:
            return any(r["step"] >= kill_at for r in steps_of(read_log(logs[VICTIM])))

        wait_until(reached, replicas, deadline, f"before step {kill_at}", folder)
        killed_at = time.time()
        stop([replicas[VICTIM]])
        say(f"torchft: killed replica group {VICTIM} at step {steps_of(read_log(logs[VICTIM]))[-1]['step']}")
        # At once, as a supervisor (torchx, Slurm's requeue, a Kubernetes Job) would start it again.
        restarted = folder / f"replica{VICTIM}.restarted.jsonl"
        replicas[VICTIM] = start_replica(VICTIM, restarted, trainer, address, env, folder)
        mine.append(replicas[VICTIM])
        wait_until(lambda: all(p.poll() == 0 for p in replicas), replicas, deadline, "after the kill", folder)
        return torchft_figures(killed_at, read_log(logs[1 - VICTIM]), read_log(restarted))
    finally:
        stop(mine)


def torchft_figures(killed_at: float, survivor: list[dict], replacement: list[dict]) -> dict:
    """The figures (see the module's docstring) from the survivor's and the replacement's logs."""
    survivor, ready = steps_of(survivor), [r["t"] for r in replacement if "ready" in r]
    before = [r for r in survivor if r["t"] <= killed_at]
    after = [r for r in survivor if r["t"] > killed_at]
    regrouped = [r for r in after if r["quorum"] != before[-1]["quorum"]]
    full = [r for r in regrouped if r["participants"] == REPLICAS]
    rejoined = [r for r in steps_of(replacement) if r["participants"] == REPLICAS]
    if not full or not rejoined:
        raise SystemExit("vs_torchft: torchft's replicas ended before both trained together again")
    return {
        "survivors_stall": regrouped[0]["t"] - killed_at,
        "full_width": max(full[0]["t"], rejoined[0]["t"]) - killed_at,
        "reduced_width_steps": sum(r["participants"] < REPLICAS for r in regrouped if r["t"] < full[0]["t"]),
        "lost_steps": max(0, before[-1]["step"] + 1 - after[0]["step"]),
        # Of full_width: the new process's start (interpreter, imports, model, Manager) to its Manager's being up.
        "replacement_up": ready[0] - killed_at,
    }


# --- Lazarus: one trial ---------------------------------------------------------------------------


def two_replica_spec(path: Path):
    """The spec at `path` as 2 replicas of one rank, 2 active nodes and 1 hot spare, in-process recovery."""
    from lazarus.commands.local_paths import anchor_paths
    from lazarus.schema import load_spec

    spec = anchor_paths(load_spec(path), Path.cwd(), shares_paths=True)  # the local backend
    return spec.model_copy(
        update={
            "layout": spec.layout.model_copy(update={"dp": REPLICAS, "pp": 1, "tp": 1, "ranks_per_node": 1}),
            "cluster": spec.cluster.model_copy(update={"active_nodes": REPLICAS, "spare_nodes": 1}),
            "recovery": spec.recovery.model_copy(update={"in_process": True}),
        }
    )


def lazarus_figures(incident) -> dict:
    """The figures (see the module's docstring) from the run's one incident."""
    layout, lost = incident.old_assignment.layout, set(incident.fault.nodes)
    survivors = [
        stall
        for rank, stall in incident.stalls.items()
        if incident.old_assignment.nodes[layout.node_of_rank(rank)] not in lost
    ]
    if not survivors:
        raise SystemExit(f"vs_torchft: the Lazarus incident has no survivor's stall: {incident.stalls}")
    return {
        "survivors_stall": max(survivors),
        "full_width": incident.mttr_seconds,
        "reduced_width_steps": 0,  # the survivor waits at its step boundary: by design, not measured
        "lost_steps": incident.lost_steps,
        "restored_from": incident.restored_from,
    }


def _kill_node(home: str, run_id: str, node: str) -> list[int]:
    from lazarus.infra.backends.local.cluster import LocalCluster

    return LocalCluster(home).kill_node(run_id, node)


async def lazarus_trial(client, settings, cluster, spec, run_id: str, kill_at: int, kill) -> dict:
    from lazarus.commands.demo_run import abandon, drive_run
    from lazarus.schema import RunState

    try:
        final = await drive_run(client, settings, cluster, spec, run_id, kill_at, say, kill)
    except BaseException:
        await abandon(client, cluster, run_id)  # its ranks and spare must not outlive the bench
        raise
    if final.state != RunState.COMPLETED or len(final.incidents) != 1:
        raise SystemExit(
            f"vs_torchft: Lazarus run {run_id} ended {final.state.value} with {len(final.incidents)} "
            f"incident(s): {final.reason}"
        )
    # The killed node repaired, as between the kills of a real sitting: back in the pool, so that the
    # quarantine breaker (half the pool in 5 minutes) counts no earlier kill against the next.
    for node in final.incidents[0].fault.nodes:
        await asyncio.to_thread(cluster.return_node, run_id, node)
    return lazarus_figures(final.incidents[0])


# --- the sitting -----------------------------------------------------------------------------------


async def sitting(spec, kills: int, kill_at: int, timeout: float, env: dict) -> dict[str, list[dict]]:
    """`kills` trials of each side, alternating, on one Temporal dev server and one worker."""
    from lazarus.client.config import Settings
    from lazarus.infra.backends.local.cluster import LocalCluster
    from lazarus.infra.harness.temporal_server import local_environment
    from lazarus.worker import build_worker

    trainer = spec.trainer.model_dump(mode="json")
    temporal = await local_environment()
    results: dict[str, list[dict]] = {side: [] for side in SIDES}
    chaos = None
    try:
        with tempfile.TemporaryDirectory() as home:
            settings = Settings(
                address=temporal.client.service_client.config.target_host, home=Path(home), task_queue="bench"
            )
            cluster = LocalCluster(home)
            # As bench/recovery.py: the kill comes from a process of its own, off the worker's event loop.
            chaos = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(chaos, sorted, [])

            async def kill(run_id: str, node: str) -> list[int]:
                return await loop.run_in_executor(chaos, _kill_node, home, run_id, node)

            async with build_worker(temporal.client, settings.task_queue, cluster):
                for i in range(kills):
                    say(f"kill {i + 1}/{kills}, torchft: kill replica group {VICTIM} at step {kill_at}")
                    folder = Path(home) / f"torchft-{i}"
                    trial = asyncio.to_thread(torchft_trial, trainer, kill_at, folder, env, timeout)
                    results["torchft"].append(await trial)
                    say(f"kill {i + 1}/{kills}, lazarus: kill a node at step {kill_at}")
                    trial = lazarus_trial(temporal.client, settings, cluster, spec, f"vs-torchft-{i}", kill_at, kill)
                    results["lazarus"].append(await asyncio.wait_for(trial, timeout))
    finally:
        STOPPING.set()
        if chaos is not None:
            chaos.shutdown()
        await temporal.shutdown()
    return results


def median(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def cell(value: object) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def summarize(results: dict[str, list[dict]]) -> dict:
    return {
        side: {"runs": runs, "median": {f: median([r[f] for r in runs]) for f in FIGURES}}
        for side, runs in results.items()
    }


def side_by_side(summary: dict) -> perf_page.Table:
    rows = [[side, *(cell(s["median"][f]) for f in FIGURES), len(s["runs"])] for side, s in summary.items()]
    return perf_page.Table(
        ["system", *FIGURES, "kills"], rows, "One of 2 replicas killed: medians (seconds from the kill; steps)"
    )


def per_kill(side: str, runs: list[dict]) -> perf_page.Table:
    columns = [*FIGURES, *EXTRA[side]]
    rows = [[i, *(cell(r[c]) for c in columns)] for i, r in enumerate(runs, 1)]
    return perf_page.Table(["kill", *columns], rows, f"{side}: each kill ({EXTRA_CAPTIONS[side]})")


def page_notes(spec, kill_at: int) -> list[str]:
    """What the tables do not say: where the two sides are not alike."""
    t = spec.trainer
    return [
        f"Killed at step {kill_at} of {t.steps}; GPT d_model {t.d_model}, {t.n_layers} layers, seq_len {t.seq_len}, "
        f"global batch {t.global_batch} ({t.global_batch // REPLICAS} per replica).",
        "torchft's replacement is a fresh process (interpreter, torch, torchft, model: replacement_up), as its "
        "examples restart one; Lazarus forks the spare's rank from a warm standby that has imported torch already.",
        "torchft's survivor trains its reduced-width steps on its own share, half the global batch.",
        "torchft's Manager binds its server to [::]; the bench binds it to 127.0.0.1, nothing else of torchft changed.",
        "The Temporal dev server and the worker stay up, idle, during torchft's trials.",
    ]


def print_table(table: perf_page.Table) -> None:
    print(f"\n{table.caption}")
    print("".join(f"{h:>21}" for h in table.headers))
    for row in table.rows:
        print("".join(f"{v!s:>21}" for v in row))


def parse_args() -> argparse.Namespace:
    from lazarus.commands.demo_run import DEFAULT_SPEC

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--kills", type=int, default=3, help="kills on each side, alternating (default 3)")
    parser.add_argument(
        "--spec",
        type=Path,
        default=DEFAULT_SPEC,
        help="model, data, steps (default examples/demo.yaml); its layout and nodes become 2 replicas",
    )
    parser.add_argument("--kill-at-step", type=int, help="step at which the replica dies (default: mid-run)")
    parser.add_argument("--timeout", type=float, default=180, help="seconds one trial may take (default 180)")
    parser.add_argument("--json", action="store_true", help="print the runs and medians as one JSON document")
    perf_page.add_option(parser, __file__)
    args = parser.parse_args()
    if args.kills < 1:
        parser.error("--kills must be at least 1")
    return args


def main() -> None:
    from lazarus.commands.demo_run import default_kill_step

    args = parse_args()
    spec = two_replica_spec(args.spec)
    kill_at = args.kill_at_step or default_kill_step(spec)
    if not 1 <= kill_at < spec.trainer.steps:
        raise SystemExit(f"vs_torchft: --kill-at-step must be between 1 and {spec.trainer.steps - 1}")
    env = torchft_env(ensure_torchft())
    # A SIGTERM ends the bench as Ctrl-C does (asyncio.run cancels the sitting), through the finally
    # clauses that stop its processes.
    signal.signal(signal.SIGTERM, lambda *_: signal.raise_signal(signal.SIGINT))
    measured = perf_page.begin()
    try:
        summary = summarize(asyncio.run(sitting(spec, args.kills, kill_at, args.timeout, env)))
    finally:
        stop(STARTED)
    tables = [side_by_side(summary), *(per_kill(side, s["runs"]) for side, s in summary.items())]
    if args.markdown:
        perf_page.write_page(
            args.markdown,
            measured,
            title=PAGE_TITLE,
            doc=__doc__,
            about=ABOUT,
            tables=tables,
            notes=page_notes(spec, kill_at),
        )
    if args.json:
        print(json.dumps({"kill_at_step": kill_at, **summary}, indent=2))
        return
    for table in tables:
        print_table(table)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--torchft-lighthouse"]:
        lighthouse_process()
    elif sys.argv[1:2] == ["--torchft-replica"]:
        replica_process(json.loads(sys.argv[2]))
    else:
        from lazarus.client.runs import exit_after

        exit_after(main)  # past the native client's crash at interpreter exit
