"""A deterministic token stream keyed by global sample index, and each rank's share of a batch.

Sample i depends only on (seed, i), so any rank in any incarnation and any world size
produces the same sample for the same index: the data position is one integer.
"""

from __future__ import annotations

import numpy as np
import torch


def sample_tokens(seed: int, index: int, seq_len: int, vocab_size: int) -> np.ndarray:
    """Tokens of sample `index`: seq_len+1 tokens of a noisy arithmetic sequence mod vocab_size.

    Each sample has its own start and stride, so the model has to infer the stride from
    the context; one token in ten is noise, so the loss has a floor above zero.
    """
    rng = np.random.default_rng([seed, index])
    start = rng.integers(vocab_size)
    stride = rng.integers(1, max(2, vocab_size // 4))
    tokens = (start + stride * np.arange(seq_len + 1)) % vocab_size
    noise = rng.random(seq_len + 1) < 0.1
    tokens[noise] = rng.integers(vocab_size, size=int(noise.sum()))
    return tokens


def share(global_batch: int, dp: int, replica: int) -> range:
    """Offsets within a step's global batch that replica `replica` of `dp` trains on.

    Shares differ by at most one sample, so any dp up to the batch size is possible.
    """
    base, extra = divmod(global_batch, dp)
    start = replica * base + min(replica, extra)
    return range(start, start + base + (1 if replica < extra else 0))


def batch(
    seed: int, first_index: int, offsets: range, seq_len: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets for the samples first_index + offsets."""
    rows = np.stack([sample_tokens(seed, first_index + o, seq_len, vocab_size) for o in offsets])
    tokens = torch.from_numpy(rows).long()
    return tokens[:, :-1], tokens[:, 1:]
