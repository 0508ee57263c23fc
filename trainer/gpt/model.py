"""A small GPT and its pipeline stages: token and position embeddings, pre-norm blocks, a head;
and the tensor-parallel plan of a block (Megatron's column/row split of attention and MLP)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Causal self-attention and an MLP, each behind a LayerNorm with a residual.

    q, k and v are separate projections so that a column split over tp ranks gives each rank
    whole heads (of a fused qkv matrix it would get all of q and part of k). The forward reads
    the head count from the projection's width, so it runs on a rank's share of the heads.
    """

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.head_dim = d_model // n_heads
        self.ln_attn = nn.LayerNorm(d_model)
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        normed = self.ln_attn(x)
        heads = lambda t: t.view(batch, seq, -1, self.head_dim).transpose(1, 2)  # noqa: E731
        q, k, v = heads(self.q(normed)), heads(self.k(normed)), heads(self.v(normed))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, -1))
        return x + self.mlp(self.ln_mlp(x))


def tensor_parallel_plan() -> dict:
    """How a Block splits over a tp group: q, k, v and the MLP's first layer by columns (each rank
    computes whole heads and a slice of the hidden layer), proj and the MLP's second layer by
    rows, whose partial outputs are summed; so a block costs two all-reduces forward and two
    backward, and everything outside the blocks stays replicated."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    columns, rows = ColwiseParallel(), RowwiseParallel()
    return {"q": columns, "k": columns, "v": columns, "proj": rows, "mlp.0": columns, "mlp.2": rows}


class GPT(nn.Module):
    """Decoder-only language model, or one pipeline stage of it.

    Blocks are kept by their index in the whole model, so a stage's parameter names are the
    whole model's (`blocks.3.q.weight`), and a checkpoint written by any layout reads back
    into any other with the same stages.
    """

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, n_layers: int, n_heads: int):
        super().__init__()
        self.token_embedding: nn.Embedding | None = nn.Embedding(vocab_size, d_model)
        self.position_embedding: nn.Embedding | None = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleDict({str(i): Block(d_model, n_heads) for i in range(n_layers)})
        self.ln_out: nn.LayerNorm | None = nn.LayerNorm(d_model)
        self.head: nn.Linear | None = nn.Linear(d_model, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.token_embedding is not None:
            assert self.position_embedding is not None, "the first stage has both embeddings (cut_to_stage)"
            x = self.token_embedding(x) + self.position_embedding(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            assert self.ln_out is not None, "the last stage has the final norm and the head (cut_to_stage)"
            x = self.head(self.ln_out(x))
        return x


def stage_blocks(n_layers: int, stages: int, stage: int) -> range:
    """Indices of the blocks that pipeline stage `stage` of `stages` holds (balanced, in order)."""
    base, extra = divmod(n_layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def cut_to_stage(model: GPT, stage: int, stages: int) -> GPT:
    """`model`, the whole GPT, cut down to pipeline stage `stage` of `stages` (in place).

    The whole model is built first, so that every parameter's initial value is independent of
    the pipeline layout.
    """
    keep = {str(i) for i in stage_blocks(len(model.blocks), stages, stage)}
    for name in [name for name in model.blocks if name not in keep]:
        del model.blocks[name]
    if stage != 0:
        model.token_embedding = model.position_embedding = None
    if stage != stages - 1:
        model.ln_out = model.head = None
    return model
