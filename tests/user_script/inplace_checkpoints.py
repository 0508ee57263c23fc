"""A training script in the style of a Trainer that saves checkpoint folders in place, and nothing of
Lazarus: every `--save-every` steps rank 0 writes `OUTPUT/checkpoint-N/` (the weights first, then
`trainer_state.json`, straight into the folder, no temp-and-rename), and at start every rank
resumes from the newest `checkpoint-*` folder it finds. A node killed in the middle of a save
leaves a folder without its state file, and every later start crashes on it the same way.

    torchrun --nproc-per-node 4 inplace_checkpoints.py --steps 40 --save-every 10

Faults of the program itself, on purpose: `--raise-at RANK:STEP` raises a ValueError in that
rank before that step (its peers then fail on the broken collective), with `--raise-once` only the
first time (a transient fault: a reset connection, a flaky read); `--hang-at-exit RANK`
keeps that rank from ever exiting after the last step, as a rank stuck in its teardown does;
`--stuck-at RANK:STEP` makes that rank wait at that step, once, in a receive no peer answers;
`--spin-at RANK:STEP` makes it loop forever at that step, once, busy, as a rank in a bug's endless
loop does.
`--record` wraps main in torch's @record, which writes the exception to TORCHELASTIC_ERROR_FILE.
Fault-free pauses, as real runs have them: `--pause-every N --pause-seconds S` has every rank
block S seconds every N steps, as on a slow read from shared storage (no CPU, no output);
`--eval-every N --eval-seconds S` has rank 0 evaluate for S seconds every N steps (busy) while the
others wait for it at a barrier.
Every rank prints `step N loss L` per step, or with `--bar` a progress bar as tqdm draws one:
redrawn after a carriage return, showing the count done (`10/40 [` at once after a restore).
"""

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


def newest_checkpoint(output: Path) -> Path | None:
    """The newest checkpoint folder, by its step, as such Trainers find it (complete or not)."""
    folders = sorted(output.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    return folders[-1] if folders else None


def save_weights(output: Path, step: int, weights: torch.Tensor) -> Path:
    """Start checkpoint-STEP in place: the folder and the weights (the state file comes later)."""
    folder = output / f"checkpoint-{step}"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(weights, folder / "model.pt")
    return folder


def save_state(folder: Path, step: int, slow_save: float) -> None:
    """End the checkpoint: a slow moment (a large file still being written), then the state."""
    print(f"saving {folder.name}", flush=True)
    time.sleep(slow_save)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))


def bar(done: int, total: int, began: float) -> None:
    """Redraw a tqdm-style bar: `\r 25%|██▌       | 10/40 [00:01<00:03,  9.87it/s]`, no line end."""
    elapsed = time.time() - began
    filled = done * 10 // total
    rate = done / elapsed if elapsed > 0 else 0.0
    bar_text = "█" * filled + " " * (10 - filled)
    sys.stdout.write(
        f"\r{done * 100 // total:3d}%|{bar_text}| {done}/{total} [00:{elapsed:02.0f}<00:00, {rate:5.2f}it/s]"
    )
    sys.stdout.flush()


def wait_for_the_peer_that_never_comes(rank: int) -> None:
    """Receive from a peer that never sends: this rank waits in a collective forever, and its peers
    in the step's all-reduce behind it (a mismatched collective, a rank on the wrong code path)."""
    dist.recv(torch.zeros(1), src=(rank + 1) % dist.get_world_size())


def evaluate(seconds: float) -> None:
    """Evaluate on the CPU for `seconds`: busy, printing only at the end, as an eval loop does."""
    ended, a = time.time() + seconds, torch.rand(64, 64)
    while time.time() < ended:
        a = torch.tanh(a @ a)
    print(f"eval done: {float(a.sum()):.3f}", flush=True)


def spin_forever() -> None:
    """Loop forever on the CPU: this rank never reaches the step's all-reduce, its peers wait in it."""
    turns = 0
    while True:
        turns += 1


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--slow-save", type=float, default=0.0, help="seconds between the weights and the state")
    parser.add_argument("--step-seconds", type=float, default=0.05)
    parser.add_argument("--output-dir", default="out")
    parser.add_argument("--raise-at", default="", help="RANK:STEP")
    parser.add_argument("--raise-once", action="store_true", help="--raise-at raises only the first time")
    parser.add_argument("--hang-at-exit", type=int, default=-1, help="RANK")
    parser.add_argument("--stuck-at", default="", help="RANK:STEP, once: waits in a collective nobody completes")
    parser.add_argument(
        "--spin-at", default="", help="RANK:STEP, once: loops forever, busy, before the step's all-reduce"
    )
    parser.add_argument("--pause-every", type=int, default=0, help="steps between slow reads (0: none)")
    parser.add_argument("--pause-seconds", type=float, default=0.0, help="how long each slow read blocks every rank")
    parser.add_argument("--eval-every", type=int, default=0, help="steps between rank 0's evaluations (0: none)")
    parser.add_argument("--eval-seconds", type=float, default=0.0, help="how long rank 0 evaluates, busy")
    parser.add_argument("--bar", action="store_true", help="a tqdm-style progress bar instead of step lines")
    return parser.parse_args()


def main() -> None:
    args = parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    output = Path(args.output_dir)
    weights, start = torch.zeros(8), 0
    found = newest_checkpoint(output)
    if found is not None:
        state = json.loads((found / "trainer_state.json").read_text())  # a half-written folder: FileNotFoundError
        weights, start = torch.load(found / "model.pt"), state["global_step"]
        print(f"resumed from {found}", flush=True)
    fail_rank, _, fail_step = args.raise_at.partition(":")
    began = time.time()
    if args.bar:
        bar(start, args.steps, began)
    for step in range(start + 1, args.steps + 1):
        if fail_rank and int(fail_rank) == rank and int(fail_step) == step:
            if not (args.raise_once and (output / "raised-once").exists()):
                output.mkdir(parents=True, exist_ok=True)
                (output / "raised-once").write_text("")
                raise ValueError(f"rank {rank} found a bad batch at step {step}")
        if args.stuck_at == f"{rank}:{step}" and not (output / "stuck-once").exists():
            (output / "stuck-once").parent.mkdir(parents=True, exist_ok=True)
            (output / "stuck-once").write_text("")
            wait_for_the_peer_that_never_comes(rank)
        if args.spin_at == f"{rank}:{step}" and not (output / "spun-once").exists():
            (output / "spun-once").parent.mkdir(parents=True, exist_ok=True)
            (output / "spun-once").write_text("")
            spin_forever()
        grad = torch.full((8,), float(step + rank))
        dist.all_reduce(grad)
        weights -= 0.001 * grad
        # The weights go to disk before the step is logged (so a fault due at this step finds
        # them there), the state file after it.
        saving = rank == 0 and step % args.save_every == 0
        folder = save_weights(output, step, weights) if saving else None
        if args.bar:
            bar(step, args.steps, began)
        else:
            print(f"step {step} loss {float(weights.pow(2).sum()):.6f}", flush=True)
        if folder is not None:
            save_state(folder, step, args.slow_save)
        if args.pause_every and step % args.pause_every == 0:
            time.sleep(args.pause_seconds)  # a blocking read of the next shard
        if args.eval_every and step % args.eval_every == 0 and rank == 0:
            evaluate(args.eval_seconds)
        dist.barrier()
        time.sleep(args.step_seconds)
    dist.destroy_process_group()
    if args.bar:
        print()  # tqdm ends its bar with a line end
    sys.stdout.flush()
    if rank == args.hang_at_exit:
        threading.Event().wait()  # never returns, as a teardown that deadlocked


if __name__ == "__main__":
    if "--record" in sys.argv:
        sys.argv.remove("--record")
        record(main)()
    else:
        main()
    sys.stdout.flush()
    os._exit(0)  # gloo on this CPU build can abort at interpreter exit (FIELD-NOTES)
