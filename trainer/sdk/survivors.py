"""A surviving rank's state at its last completed step, saved when a collective breaks.

When a node dies mid-step, the ranks that survive it fail in their next collective, before the
optimizer step: their parameters, optimizer state and RNG are exactly those of the last step
they completed, the same in every replica at the same mesh coordinates. Each survivor saves its
own share (its FSDP shard, its tp slice, its pipeline stage) with torch.save, no collective
needed, and writes a manifest last, unless the controller has ended the incarnation (the fence
of every checkpoint). A rank of the next incarnation at the same (pp, dp_shard, tp) coordinates
loads it and goes on from that step instead of the newest periodic checkpoint.
"""

from __future__ import annotations

import hashlib
import io
import time

import torch

from lazarus.schema.contract import SurvivorManifest, read_survivor, write_survivor
from lazarus.schema.rundir import RunDir
from lazarus.trainer.sdk.faults import maybe_fail


def write_state(run: RunDir, incarnation: int, rank: int, coordinates: dict[str, int], step: int, state) -> bool:
    """Save `state`, rank `rank`'s share of the state after `step` steps (anything torch.save
    takes), with its manifest last; False, leaving no manifest, once the controller has ended
    the incarnation."""
    if run.ended_file(incarnation).exists():
        return False
    began = time.monotonic()
    # Serialised in memory and hashed there: the file is written once and never read back.
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getbuffer()
    path = run.survivor_state(incarnation, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_bytes(data)
    maybe_fail("survivor_save", step)  # a planned second fault, while the state is half saved
    partial.replace(path)
    manifest = SurvivorManifest(
        step=step, coordinates=coordinates, size=len(data), sha256=hashlib.sha256(data).hexdigest(), time=time.time()
    )
    recorded = write_survivor(run, incarnation, rank, manifest)
    print(
        f"lazarus trainer: saved the state of step {step} for the next incarnation in "
        f"{time.monotonic() - began:.3f} s ({len(data) / 1e6:.1f} MB)"
        + ("" if recorded else "; too late, not recorded"),
        flush=True,
    )
    return recorded


def read_state(run: RunDir, incarnation: int, rank: int) -> tuple[str, dict]:
    """Survivor `rank`'s saved state, read once and checked against its manifest: (its SHA-256,
    the state). Raises if the file is incomplete or not the one the manifest describes."""
    record = read_survivor(run, incarnation, rank)
    path = run.survivor_state(incarnation, rank)
    data = path.read_bytes()
    sha256 = hashlib.sha256(data).hexdigest()
    if record is None or record.size != len(data) or record.sha256 != sha256:
        raise RuntimeError(f"survivor state {path} is incomplete or does not match its manifest")
    return sha256, torch.load(io.BytesIO(data), weights_only=True)
