"""What a node's warm standby prepares for the built-in trainer's ranks before they exist.

Before any fault the standby builds the whole model from the run's seed; once drain names the
fault's survivors it reads the states its node's ranks will load (`prefetch`). A rank forked
from the standby inherits both (copy-on-write) and takes them instead of building the model and
reading its file after the rendezvous: the restore leaves the critical path of a recovery. A
rank started any other way, or one whose survivor is not the one prefetched, builds and reads
for itself, so every path gives the same state.

Nothing here starts a thread: the standby stays safe to fork (trainer/agent/standby/ checks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lazarus.schema.contract import read_survivor
from lazarus.schema.run import TrainerSettings
from lazarus.schema.rundir import RunDir
from lazarus.trainer.sdk.survivors import read_state

if TYPE_CHECKING:
    from lazarus.trainer.gpt.model import GPT

_model: tuple[tuple, GPT, torch.Tensor] | None = None
"""(the settings it was built for, the whole GPT, the RNG state right after building it)."""

_states: dict[tuple[int, int], tuple[str, dict]] = {}
"""(incarnation, survivor rank) -> (SHA-256 of the file it was read from, the loaded state)."""


def _model_key(settings: TrainerSettings) -> tuple:
    return (
        settings.seed,
        settings.vocab_size,
        settings.seq_len,
        settings.d_model,
        settings.n_layers,
        settings.n_heads,
    )


def whole_model(settings: TrainerSettings) -> tuple[GPT, torch.Tensor]:
    """The whole GPT built from the run's seed, and the RNG state just after; the prepared one
    the first time a forked rank asks (it is then its own), else a new one."""
    global _model
    if _model is not None and _model[0] == _model_key(settings):
        _, model, rng = _model
        _model = None
        return model, rng
    from lazarus.trainer.gpt.model import GPT

    torch.manual_seed(settings.seed)
    model = GPT(settings.vocab_size, settings.seq_len, settings.d_model, settings.n_layers, settings.n_heads)
    return model, torch.get_rng_state()


def prepare_model(settings: TrainerSettings, data_ranks: int) -> None:
    """In the standby: build the model the next ranks will start from, and run one forward and
    backward pass of a rank's batch (`data_ranks`: dp x dp_shard) through it, so that the
    kernels' one-time setup is done before any rank exists; the model is left as built."""
    global _model
    torch.set_num_threads(1)  # as each rank does; a thread pool would make forking unsafe
    _model = None
    model, rng = whole_model(settings)
    from lazarus.trainer.gpt.data import batch, share

    inputs, targets = batch(
        settings.seed, 0, share(settings.global_batch, data_ranks, 0), settings.seq_len, settings.vocab_size
    )
    logits = model(inputs)
    torch.nn.functional.cross_entropy(logits.reshape(-1, settings.vocab_size), targets.reshape(-1)).backward()
    for param in model.parameters():
        param.grad = None
    _model = (_model_key(settings), model, rng)


def prefetch(run: RunDir, incarnation: int, ranks: list[int]) -> list[int]:
    """In the standby: read the named survivors' states (dropping any read before); returns
    those read. A file that does not match its manifest is skipped: its rank reads it itself
    and refuses it."""
    _states.clear()
    for rank in ranks:
        try:
            _states[(incarnation, rank)] = read_state(run, incarnation, rank)
        except (OSError, RuntimeError):
            continue
    return sorted(rank for _, rank in _states)


def forget_states() -> None:
    """In the standby, once its launcher is forked: the states live on in the ranks, not here."""
    _states.clear()


def survivor_state(run: RunDir, incarnation: int, rank: int) -> tuple[dict, bool]:
    """The state survivor `rank` of `incarnation` saved, and whether the standby had prefetched
    it. A prefetched state counts only if the manifest still names the bytes it was read from."""
    prefetched = _states.pop((incarnation, rank), None)
    if prefetched is not None:
        record = read_survivor(run, incarnation, rank)
        if record is not None and record.sha256 == prefetched[0]:
            return prefetched[1], True
    return read_state(run, incarnation, rank)[1], False
