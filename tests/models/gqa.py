"""Grouped-query attention with fewer kv heads than tp, for tests of Megatron's split of it (a
test fixture, not an example): 8 query heads, 2 kv heads, head dim 8, sized from module
attributes as reference code sizes them:

- ``repeat_kv``: a from-scratch Llama's ``repeat_kv``: ``x[:, :, :, None, :].expand(b, t,
  self.n_kv_heads, self.n_rep, self.head_dim)`` merged with ``reshape(b, t, self.n_kv_heads *
  self.n_rep, self.head_dim)``;
- ``interleave``: the kv heads expanded by ``repeat_interleave(self.n_rep, dim=1)``;
- ``sdpa_gqa``: the kv heads handed to SDPA as they are (``enable_gqa=True``);
- ``rep_major``: the query heads' kv copies laid out rep-major (query head j reads kv head
  ``j % n_kv``: ``expand(b, t, self.n_rep, self.n_kv_heads, d)``), which no contiguous split of
  the query heads gives one kv head per rank: it must never be planned as grouped.

At tp=4 each pair of ranks shares a kv head (rank r's query heads read kv head r // 2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, KV_HEADS, LAYERS = 128, 64, 8, 2, 2


class GroupedAttention(nn.Module):
    def __init__(self, kind: str, dim: int = DIM, n_heads: int = HEADS, n_kv: int = KV_HEADS):
        super().__init__()
        self.kind = kind
        self.n_heads = n_heads
        self.n_kv_heads = n_kv
        self.n_rep = n_heads // n_kv
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def _repeat(self, x: torch.Tensor) -> torch.Tensor:
        """(b, t, kv_heads, d) -> (b, heads, t, d), the query heads' kv copies."""
        b, t = x.shape[:2]
        if self.kind == "repeat_kv":
            x = x[:, :, :, None, :].expand(b, t, self.n_kv_heads, self.n_rep, self.head_dim)
            x = x.reshape(b, t, self.n_kv_heads * self.n_rep, self.head_dim)
        elif self.kind == "rep_major":
            x = x[:, :, None, :, :].expand(b, t, self.n_rep, self.n_kv_heads, self.head_dim)
            x = x.reshape(b, t, self.n_rep * self.n_kv_heads, self.head_dim)
        else:  # interleave
            return x.transpose(1, 2).repeat_interleave(self.n_rep, dim=1)
        return x.transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        if self.kind == "sdpa_gqa":
            k, v = k.transpose(1, 2), v.transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            y = F.scaled_dot_product_attention(q, self._repeat(k), self._repeat(v), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class Block(nn.Module):
    def __init__(self, kind: str, dim: int = DIM, heads: int = HEADS) -> None:
        super().__init__()
        self.ln1 = nn.RMSNorm(dim)
        self.attn = GroupedAttention(kind, dim, heads)
        self.ln2 = nn.RMSNorm(dim)
        self.up = nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.down(F.silu(self.up(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, kind: str, layers: int = LAYERS, dim: int = DIM, heads: int = HEADS):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Block(kind, dim, heads) for _ in range(layers))
        self.ln_f = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model() -> nn.Module:
    return GPT("repeat_kv")


def build_repeat_kv() -> nn.Module:
    return GPT("repeat_kv")


def build_interleave() -> nn.Module:
    return GPT("interleave")


def build_sdpa_gqa() -> nn.Module:
    return GPT("sdpa_gqa")


def build_rep_major() -> nn.Module:
    return GPT("rep_major")


def make_batch(batch_size: int, seq_len: int | None = None) -> tuple[tuple, torch.Tensor]:
    seq_len = seq_len or 16
    idx = torch.randint(0, VOCAB, (batch_size, seq_len + 1))
    return (idx[:, :-1],), idx[:, 1:]
