"""A GPT-style decoder (pre-norm, causal self-attention, GELU MLP): autopar's main example.

Model-file contract: ``build_model()`` returns the module (cheap under ``torch.device("meta")``),
``make_batch(batch_size, seq_len)`` returns ``((idx,), targets)``; the loss is the default
cross-entropy over the last dim.

Views use ``-1`` for the head count so that attention runs on the local heads of a
tensor-parallel rank unchanged.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

# Sizes: small enough that 8 gloo ranks on 2 cores run a step in about a second; override with
# environment variables to plan bigger shapes (GPT_LAYERS=96 GPT_DIM=12288 GPT_HEADS=96 ...).
VOCAB = int(os.environ.get("GPT_VOCAB", 256))
DIM = int(os.environ.get("GPT_DIM", 64))
HEADS = int(os.environ.get("GPT_HEADS", 4))
LAYERS = int(os.environ.get("GPT_LAYERS", 4))
MAX_SEQ = int(os.environ.get("GPT_MAX_SEQ", 256))


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.head_dim = dim // n_head
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, n_head)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, n_head: int, n_layer: int, max_seq: int) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Embedding(max_seq, dim)
        self.blocks = nn.ModuleList(Block(dim, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model() -> nn.Module:
    return GPT(VOCAB, DIM, HEADS, LAYERS, MAX_SEQ)


def make_batch(batch_size: int, seq_len: int | None = None) -> tuple[tuple, torch.Tensor]:
    seq_len = seq_len or 64
    idx = torch.randint(0, VOCAB, (batch_size, seq_len + 1))
    return (idx[:, :-1],), idx[:, 1:]
