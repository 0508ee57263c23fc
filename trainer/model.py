"""A small GPT and its pipeline stages: token and position embeddings, pre-norm blocks, a head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Causal self-attention and an MLP, each behind a LayerNorm with a residual."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln_attn = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.ln_attn(x)).split(width, dim=2)
        heads = lambda t: t.view(batch, seq, self.n_heads, width // self.n_heads).transpose(1, 2)  # noqa: E731
        attended = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, width))
        return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):
    """Decoder-only language model, or one pipeline stage of it.

    Blocks are kept by their index in the whole model, so a stage's parameter names are the
    whole model's (`blocks.3.qkv.weight`), and a checkpoint written by any layout reads back
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
            x = self.token_embedding(x) + self.position_embedding(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            x = self.head(self.ln_out(x))
        return x


def stage_blocks(n_layers: int, stages: int, stage: int) -> range:
    """Indices of the blocks that pipeline stage `stage` of `stages` holds (balanced, in order)."""
    base, extra = divmod(n_layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def build_stage(
    vocab_size: int, seq_len: int, d_model: int, n_layers: int, n_heads: int, stage: int, stages: int
) -> GPT:
    """The whole model built from the current RNG state, cut down to one pipeline stage.

    Building the whole model first makes every parameter's initial value independent of
    the pipeline layout.
    """
    model = GPT(vocab_size, seq_len, d_model, n_layers, n_heads)
    keep = {str(i) for i in stage_blocks(n_layers, stages, stage)}
    for name in [name for name in model.blocks if name not in keep]:
        del model.blocks[name]
    if stage != 0:
        model.token_embedding = model.position_embedding = None
    if stage != stages - 1:
        model.ln_out = model.head = None
    return model
