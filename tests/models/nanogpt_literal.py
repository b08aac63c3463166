"""A GPT written the way reference code writes attention (a test fixture, not an example).

- head counts are module attributes used literally in views (``view(b, t, self.n_head,
  self.head_dim)``), never ``-1``;
- explicit softmax attention: ``q @ k.transpose(-2, -1)`` scaled, a causal mask buffer sliced
  to the sequence and broadcast over batch and heads, ``masked_fill``, softmax, dropout,
  ``att @ v``;
- factory ``build_explicit``: the same attention with ``-1`` for the head count in its views;
- factory ``build_gqa``: Llama-style grouped-query attention with HF's ``repeat_kv``
  (``expand`` + ``reshape`` with literal kv-head sizes) and RMSNorm / SiLU-gated MLP.

Dropout defaults to 0 so that ``--verify`` compares like with like.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, KV_HEADS, LAYERS, MAX_SEQ = 128, 64, 4, 2, 2, 64


class CausalSelfAttention(nn.Module):
    def __init__(
        self, dim: int, n_head: int, max_seq: int, dropout: float = 0.0, literal: bool = True
    ) -> None:
        super().__init__()
        self.literal = literal
        self.n_head = n_head
        self.head_dim = dim // n_head
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)
        self.attn_dropout = nn.Dropout(dropout)
        mask = torch.tril(torch.ones(max_seq, max_seq)).view(1, 1, max_seq, max_seq)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.size()
        h = self.n_head if self.literal else -1
        q = self.q_proj(x).view(b, t, h, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, h, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, h, self.head_dim).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        att = att.masked_fill(self.mask[:, :, :t, :t] == 0, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = att @ v
        width = self.n_head * self.head_dim if self.literal else -1
        return self.out_proj(y.transpose(1, 2).contiguous().view(b, t, width))


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """HF's repeat_kv: (b, kv_heads, t, d) -> (b, kv_heads * n_rep, t, d)."""
    b, kv_heads, t, d = x.shape
    if n_rep == 1:
        return x
    x = x[:, :, None, :, :].expand(b, kv_heads, n_rep, t, d)
    return x.reshape(b, kv_heads * n_rep, t, d)


class GQAttention(nn.Module):
    def __init__(self, dim: int, n_head: int, n_kv_heads: int, max_seq: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.n_kv_heads = n_kv_heads
        self.head_dim = dim // n_head
        self.n_rep = n_head // n_kv_heads
        self.q_proj = nn.Linear(dim, n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_head * self.head_dim, dim, bias=False)
        mask = torch.tril(torch.ones(max_seq, max_seq)).view(1, 1, max_seq, max_seq)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)
        att = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        att = att.masked_fill(self.mask[:, :, :t, :t] == 0, float("-inf"))
        att = F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype)
        y = torch.matmul(att, v).transpose(1, 2).reshape(b, t, self.n_head * self.head_dim)
        return self.o_proj(y)


class MLP(nn.Module):
    def __init__(self, dim: int, gated: bool) -> None:
        super().__init__()
        self.gated = gated
        self.up = nn.Linear(dim, 4 * dim, bias=not gated)
        self.gate = nn.Linear(dim, 4 * dim, bias=False) if gated else None
        self.down = nn.Linear(4 * dim, dim, bias=not gated)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, gqa: bool, literal: bool) -> None:
        super().__init__()
        norm = nn.RMSNorm if gqa else nn.LayerNorm
        self.ln1, self.ln2 = norm(DIM), norm(DIM)
        self.attn = (
            GQAttention(DIM, HEADS, KV_HEADS, MAX_SEQ)
            if gqa
            else CausalSelfAttention(DIM, HEADS, MAX_SEQ, literal=literal)
        )
        self.mlp = MLP(DIM, gated=gqa)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, gqa: bool = False, literal: bool = True) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(gqa, literal) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model() -> nn.Module:
    return GPT()


def build_explicit() -> nn.Module:
    """The same explicit softmax attention with ``-1`` for the head count in its views."""
    return GPT(literal=False)


def build_gqa() -> nn.Module:
    return GPT(gqa=True)


def make_batch(batch_size: int, seq_len: int | None = None) -> tuple[tuple, torch.Tensor]:
    seq_len = seq_len or 16
    idx = torch.randint(0, VOCAB, (batch_size, seq_len + 1))
    return (idx[:, :-1],), idx[:, 1:]
