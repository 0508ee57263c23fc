"""The training script bench/vs_torchrun.py runs under both torchrun and Lazarus: same model,
data, global batch and checkpoint interval.

Rank 0 appends one JSON line per step to --step-log: {"step", "time", "world", "restart"},
where restart is TORCHELASTIC_RESTART_COUNT (torchrun's restart round; Lazarus's incarnation).
Under Lazarus it uses lazarus.session for checkpoints and heartbeats, unless --no-helper; under
torchrun (or with --no-helper) it keeps its own checkpoint in --checkpoint-dir (rank 0 writes it,
renames it into place when complete), as torchrun's elastic docs tell a script to.

    .venv/bin/torchrun --standalone --nproc-per-node 4 bench/elastic_train.py --steps 300 \
        --step-log /tmp/steps.jsonl --checkpoint-dir /tmp/checkpoints [--markdown [PATH]]

With --markdown, rank 0 writes its training speed (no fault) as a page: the step times of the
job vs_torchrun.py breaks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ is not an installed package

from bench import perf_page

GLOBAL_BATCH = 256
PAGE_TITLE = "The vs_torchrun training script, without a fault"
ABOUT = """How fast bench/elastic_train.py trains when nothing breaks: the script bench/vs_torchrun.py
runs under torchrun and Lazarus (DDP on gloo, an MLP 64-512-512-1, global batch 256 split over
the ranks, one thread a rank, a checkpoint every --checkpoint-every steps). Rank 0 times every
step it trains, checkpoints included: the median step, and the steps a second from its first
step to its last. Its MTTRs on the vs_torchrun page are to be read against this step time."""


def launcher_command() -> list[str] | None:
    """The torchrun command line that started this rank: its agent is the parent process."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    try:
        argv = [a.decode() for a in Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return None
    # The agent's interpreter comes from torchrun's shebang line, not from what was typed.
    if len(argv) > 1 and Path(argv[1]).name == "torchrun":
        argv = argv[1:]
    relative = os.path.relpath(argv[0]) if argv else ""
    return [relative if argv and not relative.startswith("..") else a for a in argv[:1]] + argv[1:]


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the step's global batch, keyed by step: any world size sees the same samples."""
    generator = torch.Generator().manual_seed(step)
    inputs = torch.randn(GLOBAL_BATCH, 64, generator=generator)
    share = torch.tensor_split(inputs, world)[rank]
    return share, torch.sin(share).sum(dim=1, keepdim=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100000)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--checkpoint-dir", type=Path)
    parser.add_argument("--step-log", type=Path, required=True)
    parser.add_argument("--no-helper", action="store_true", help="never import lazarus.session, even under Lazarus")
    perf_page.add_option(parser, __file__)
    args = parser.parse_args()

    torch.set_num_threads(1)
    session = None
    if "LAZARUS_RUN_DIR" in os.environ and not args.no_helper:
        from lazarus.session import TrainingSession

        session = TrainingSession.from_environ()
        session.wait_for_store()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sitting = perf_page.begin(launcher_command()) if args.markdown and rank == 0 else None
    step_times: list[float] = []

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1))
    ddp = DDP(model, find_unused_parameters=True)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)

    step = 0
    resume = session.resume_checkpoint / "state.pt" if session and session.resume_checkpoint else None
    if session is None and args.checkpoint_dir and (args.checkpoint_dir / "state.pt").exists():
        resume = args.checkpoint_dir / "state.pt"
    if resume:
        state = torch.load(resume)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log = open(args.step_log, "a") if rank == 0 else None
    total = session.total_steps if session else args.steps
    while step < total:
        step += 1
        inputs, targets = batch(step, rank, world)
        loss = F.mse_loss(ddp(inputs), targets) * len(inputs) / GLOBAL_BATCH * world
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if log:
            now = time.time()
            log.write(json.dumps({"step": step, "time": now, "world": world, "restart": restart}) + "\n")
            log.flush()
            step_times.append(now)
        if session:
            session.step_done(step, loss.item())
        if step % args.checkpoint_every == 0:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
            if session:
                if rank == 0:
                    torch.save(state, session.checkpoint_dir(step) / "state.pt")
                dist.barrier()
                session.commit_checkpoint(step)
            elif rank == 0 and args.checkpoint_dir:
                args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
                torch.save(state, args.checkpoint_dir / "state.pt.tmp")
                os.replace(args.checkpoint_dir / "state.pt.tmp", args.checkpoint_dir / "state.pt")
    if session:
        session.finish(step)
    if sitting is not None and len(step_times) > 1:
        write_markdown(args, sitting, step_times, world, restart, checkpoints=bool(session or args.checkpoint_dir))
    dist.destroy_process_group()


def write_markdown(args, sitting, step_times: list[float], world: int, restart: int, checkpoints: bool) -> None:
    seconds = step_times[-1] - step_times[0]
    gaps = [b - a for a, b in zip(step_times, step_times[1:], strict=False)]
    row = [
        world,
        len(step_times),
        f"{seconds:.2f}",
        f"{statistics.median(gaps) * 1000:.1f}",
        f"{(len(step_times) - 1) / seconds:.1f}",
        restart,
    ]
    headers = ["world", "steps trained", "seconds", "median step (ms)", "steps/s", "restart round"]
    saving = f"a checkpoint every {args.checkpoint_every} steps" if checkpoints else "no checkpoint"
    caption = f"Rank 0, global batch {GLOBAL_BATCH}, {saving}"
    perf_page.write_page(
        args.markdown,
        sitting,
        title=PAGE_TITLE,
        doc=__doc__,
        about=ABOUT,
        tables=[perf_page.Table(headers, [row], caption)],
    )


if __name__ == "__main__":
    main()
