"""What a checkpoint costs the training loop: synchronous vs asynchronous save, and load time.

    .venv/bin/python bench/checkpoint.py [--spec examples/demo.yaml] [--d-model N] [--n-layers N] [--saves 5] [--json]
                                         [--markdown [PATH]]

Runs the spec's layout (dp x pp x dp_shard x tp ranks on this machine) with the built-in
trainer's own model, step and Checkpointer (for a spec that runs a script of its own, the
built-in model with the spec's layout and the trainer section's defaults). For each mode it
trains, saves every `--gap` steps, and measures on rank 0:
  blocked   seconds the training loop spends inside save() (sync: the whole write;
            async: staging a copy of the state and handing it to the writer thread)
  stall     extra seconds the steps from one save to the next take compared with steps
            without any save (async: includes the writer thread competing for the cores)
  committed seconds from save() until the checkpoint is complete on disk (the marker)
and the seconds to load the checkpoint into a fresh model and optimizer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import perf_page
from lazarus.infra.backend import free_port
from lazarus.schema import load_spec
from lazarus.schema.rundir import COMMIT_MARKER, RunDir
from lazarus.trainer.gpt.step import Trainer
from lazarus.trainer.sdk import checkpoint

PAGE_TITLE = "Checkpoint cost"
ABOUT = """What a checkpoint costs the training loop, on the spec's layout with the built-in trainer's
model, step and Checkpointer, measured on rank 0 for each mode: *blocked* is the seconds the loop
spends inside save() (synchronous: the whole write; asynchronous: staging a copy of the state and
handing it to the writer thread); *stall* is the extra seconds the steps from one save to the next
take against steps without a save (asynchronous: includes the writer thread competing for the
cores); *committed* is save() to the checkpoint's commit marker on disk. Each is the median over
the saves. Then the seconds to load the newest checkpoint into a fresh model and optimizer."""


def _rank(
    rank: int, world: int, port: int, settings_json: str, layout_json: str, saves: int, gap: int, folder: str
) -> None:
    from lazarus.schema import Layout, TrainerSettings

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    settings = TrainerSettings.model_validate_json(settings_json)
    layout = Layout.model_validate_json(layout_json)
    trainer = Trainer(settings, layout, rank)
    batch = settings.global_batch
    step = 0

    def train(n: int) -> list[float]:
        nonlocal step
        times = []
        for _ in range(n):
            start = time.perf_counter()
            trainer.step(step * batch)
            step += 1
            times.append(time.perf_counter() - start)
        return times

    train(3)  # warm-up: pipeline shape inference, allocator
    plain = statistics.median(train(2 * gap))
    result = {"plain_step_s": plain}
    for mode in ("sync", "async"):
        run = RunDir(Path(folder) / mode)
        saver = checkpoint.Checkpointer(run, incarnation=0, keep=2, asynchronous=mode == "async")
        blocked, stall, committed = [], [], []
        for _ in range(saves):
            dist.barrier()
            start, wall_start = time.perf_counter(), time.time()
            saver.save(trainer.model, trainer.optimizer, step, step * batch)
            saved_at = time.perf_counter()
            blocked.append(saved_at - start)
            # The folder by name: an async save may not have created it yet, and checkpoint(step)
            # would then answer a pre-incarnation path the commit never writes.
            marker = run.checkpoint_folder(step, saver.incarnation) / COMMIT_MARKER
            train(gap)
            stall.append(time.perf_counter() - start - gap * plain)
            saver.wait()
            if rank == 0:
                # The marker's mtime is when the commit landed (rank 0 writes it).
                committed.append(marker.stat().st_mtime - wall_start)
        result[mode] = {
            "blocked_s": statistics.median(blocked),
            "stall_s": statistics.median(stall),
            "committed_s": statistics.median(committed) if committed else None,
        }
    dist.barrier()
    fresh = Trainer(settings, layout, rank)
    newest = RunDir(Path(folder) / "async").checkpoint_steps()[-1]
    dist.barrier()
    start = time.perf_counter()
    checkpoint.load(RunDir(Path(folder) / "async"), fresh.model, fresh.optimizer, newest)
    result["load_s"] = time.perf_counter() - start
    size = sum(p.stat().st_size for p in RunDir(Path(folder) / "async").checkpoint(newest).iterdir())
    result["checkpoint_mb"] = size / 1e6
    # A DTensor's numel is the whole parameter's, not this rank's shard.
    result["parameters"] = sum(p.numel() for p in trainer.model.parameters())
    if rank == 0:
        (Path(folder) / "result.json").write_text(json.dumps(result))
    dist.barrier()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", type=Path, default=ROOT / "examples" / "demo.yaml")
    parser.add_argument("--d-model", type=int, help="override trainer.d_model (a bigger state shows the difference)")
    parser.add_argument("--n-layers", type=int, help="override trainer.n_layers")
    parser.add_argument("--saves", type=int, default=5, help="saves per mode (median reported)")
    parser.add_argument("--gap", type=int, default=10, help="training steps between saves")
    parser.add_argument("--json", action="store_true")
    perf_page.add_option(parser, __file__)
    args = parser.parse_args()
    sitting = perf_page.begin()

    spec = load_spec(args.spec)
    overrides = {k: v for k, v in {"d_model": args.d_model, "n_layers": args.n_layers}.items() if v}
    settings = spec.trainer.model_copy(update=overrides)
    world = spec.layout.world_size
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(
            _rank,
            args=(
                world,
                free_port(),
                settings.model_dump_json(),
                spec.layout.model_dump_json(),
                args.saves,
                args.gap,
                folder,
            ),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
        result = json.loads((Path(folder) / "result.json").read_text())
    if args.markdown:
        write_markdown(args, sitting, spec, result)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"layout {spec.layout.describe()}, {result['parameters']:,} parameters in rank 0's stage, "
        f"checkpoint {result['checkpoint_mb']:.1f} MB, step without a save {result['plain_step_s'] * 1000:.0f} ms"
    )
    print(f"{'mode':<8}{'blocked (s)':>14}{'stall (s)':>12}{'committed (s)':>16}")
    for mode in ("sync", "async"):
        row = result[mode]
        print(f"{mode:<8}{row['blocked_s']:>14.3f}{row['stall_s']:>12.3f}{row['committed_s']:>16.3f}")
    print(f"load into a fresh model and optimizer: {result['load_s']:.3f} s")


def write_markdown(args, sitting, spec, result: dict) -> None:
    caption = (
        f"layout {spec.layout.describe()}, {result['parameters']:,} parameters in rank 0's stage, "
        f"checkpoint {result['checkpoint_mb']:.1f} MB, step without a save {result['plain_step_s'] * 1000:.0f} ms; "
        f"median of {args.saves} saves, {args.gap} steps apart"
    )
    rows = [
        [
            mode,
            f"{result[mode]['blocked_s']:.3f}",
            f"{result[mode]['stall_s']:.3f}",
            f"{result[mode]['committed_s']:.3f}",
        ]
        for mode in ("sync", "async")
    ]
    table = perf_page.Table(["mode", "blocked (s)", "stall (s)", "committed (s)"], rows, caption)
    notes = [f"load into a fresh model and optimizer: {result['load_s']:.3f} s"]
    perf_page.write_page(
        args.markdown, sitting, title=PAGE_TITLE, doc=__doc__, about=ABOUT, tables=[table], notes=notes
    )


if __name__ == "__main__":
    main()
