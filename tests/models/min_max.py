"""A small decoder with T5-style relative position buckets (a test fixture): the bucket of each
query-key distance is clamped with an elementwise ``torch.min`` of two tensors (T5's
``torch.min(val_if_large, torch.full_like(val_if_large, num_buckets - 1))``), the attention
scores with an elementwise ``torch.max`` of two tensors, and the MLP with a ``torch.min`` of
two activations. Explicit softmax attention, heads sized with ``-1`` in the views.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, LAYERS, BUCKETS, MAX_DISTANCE = 128, 64, 4, 2, 16, 32


def relative_buckets(relative: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """T5's bucketing of (key - query) distances, unidirectional (a decoder)."""
    relative = -torch.min(relative, torch.zeros_like(relative))
    exact = num_buckets // 2
    small = relative < exact
    large = exact + (
        torch.log(relative.float() / exact + 1e-6)
        / math.log(max_distance / exact)
        * (num_buckets - exact)
    ).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return torch.where(small, relative, large)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.bias = nn.Embedding(BUCKETS, n_heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        pos = torch.arange(t, device=x.device)
        buckets = relative_buckets(pos[None, :] - pos[:, None], BUCKETS, MAX_DISTANCE)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        scores = scores + self.bias(buckets).permute(2, 0, 1)
        floor = torch.full_like(scores, -1e4)
        scores = torch.max(scores, floor)  # elementwise, two tensors
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        y = F.softmax(scores, dim=-1) @ v
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, n_heads)
        self.ln2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.gate = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        h = self.ln2(x)
        return x + self.down(torch.min(F.gelu(self.up(h)), self.gate(h)))


class MinMaxLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM, HEADS) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def build_model() -> nn.Module:
    return MinMaxLM()
