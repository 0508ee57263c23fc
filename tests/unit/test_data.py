"""The token stream and each replica's share of a batch."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from lazarus.trainer.gpt.data import batch, sample_tokens, share


@given(global_batch=st.integers(1, 512), dp=st.integers(1, 64))
def test_shares_partition_the_batch_and_differ_by_at_most_one(global_batch, dp):
    if dp > global_batch:
        return
    shares = [share(global_batch, dp, r) for r in range(dp)]
    assert [i for s in shares for i in s] == list(range(global_batch))
    sizes = {len(s) for s in shares}
    assert max(sizes) - min(sizes) <= 1


def test_a_sample_depends_only_on_seed_and_index():
    a = sample_tokens(3, 1234, 16, 64)
    assert np.array_equal(a, sample_tokens(3, 1234, 16, 64))
    assert not np.array_equal(a, sample_tokens(3, 1235, 16, 64))
    assert not np.array_equal(a, sample_tokens(4, 1234, 16, 64))
    assert a.shape == (17,) and a.min() >= 0 and a.max() < 64


def test_batch_targets_are_inputs_shifted_by_one():
    inputs, targets = batch(0, 100, range(2, 5), 8, 32)
    assert inputs.shape == targets.shape == (3, 8)
    assert (inputs[:, 1:] == targets[:, :-1]).all()
    assert np.array_equal(inputs[0].numpy(), sample_tokens(0, 102, 8, 32)[:-1])
