"""Attention as reference code writes it, for tests of tensor parallelism through attention (a
test fixture, not an example). Every variant sizes its views from module attributes or constants,
never ``-1``:

- ``megatron``: a Megatron-style GPT block: separate q/k/v, ``view(B, T, self.n_head,
  self.head_dim)``, explicit softmax attention (``q @ k.transpose(-2, -1)``, a registered
  ``(1, 1, S, S)`` causal mask buffer sliced to the sequence, ``masked_fill``, softmax, dropout,
  ``att @ v``), the heads merged with ``view(B, T, self.n_head * self.head_dim)``;
- ``llama``: a from-scratch Llama block: grouped-query attention whose ``repeat_kv`` expands with
  the module's own kv-head count (``expand(b, self.n_kv_heads, self.n_rep, t, d)``), RMSNorm,
  a SiLU-gated MLP, SDPA;
- ``interleave``: the same grouped-query attention with its kv heads expanded by
  ``repeat_interleave(self.n_rep, dim=1)`` (as many hand-written Llamas and Mistrals write it);
- ``mqa``: multi-query attention as Falcon writes it: 4 query heads and one kv head, expanded
  with ``expand`` to the query heads (fewer kv heads than any tp > 1);
- ``gqa_one_kv``: grouped-query attention with one kv head handed to SDPA as it is
  (``enable_gqa=True``, HF's way under ``TRANSFORMERS_SDPA_FORCE_GQA``);
- ``nanogpt``: nanoGPT's own sizes: ``B, T, C = x.size()``, ``view(B, T, self.n_head,
  C // self.n_head)`` and ``view(B, T, C)``: ``C`` is the input's full width, so on local heads
  the head dim comes out tp times too large: it cannot run on local heads (the emitted program
  runs it on DTensors of full shape instead);
- ``mingpt``: minGPT's first attention: nanoGPT's sizes with separate key/query/value, explicit
  softmax over a registered (persistent) mask buffer, attention and residual dropout;
- ``fused``: nanoGPT's attention verbatim: one ``c_attn`` split into q, k, v along its output;
- ``constant``: the head count written as a number (``view(b, t, 4, 16)``): wrong on local heads.

Dropout defaults to 0 so that ``--verify`` compares like with like.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, LAYERS, MAX_SEQ = 128, 2, 64


class MegatronAttention(nn.Module):
    def __init__(self, dim: int, n_head: int, max_seq: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.n_head = n_head
        self.head_dim = dim // n_head
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(dropout)
        causal = torch.tril(torch.ones(max_seq, max_seq)).view(1, 1, max_seq, max_seq)
        self.register_buffer("bias", causal, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.size()  # noqa: N806 (reference code's names)
        q = self.q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, self.n_head * self.head_dim)
        return self.proj(y)


class NanoGPTAttention(MegatronAttention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # noqa: N806
        q = self.q(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = self.k(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = self.v(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class NanoGPTFusedAttention(nn.Module):
    """nanoGPT's CausalSelfAttention as published (its flash path): one fused ``c_attn`` whose
    output ``split(self.n_embd, dim=2)`` cuts into q, k, v, nanoGPT's sizes, SDPA with dropout
    in training, residual dropout."""

    def __init__(self, dim: int, n_head: int, max_seq: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head = n_head
        self.n_embd = dim
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # noqa: N806
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MinGPTAttention(nn.Module):
    """minGPT's CausalSelfAttention as first published: separate key/query/value, nanoGPT's sizes
    (``C // self.n_head``, ``view(B, T, C)``) and explicit softmax over a registered mask."""

    def __init__(self, dim: int, n_head: int, max_seq: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.key = nn.Linear(dim, dim)
        self.query = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)
        self.proj = nn.Linear(dim, dim)
        mask = torch.tril(torch.ones(max_seq, max_seq)).view(1, 1, max_seq, max_seq)
        self.register_buffer("mask", mask)
        self.n_head = n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # noqa: N806
        k = self.key(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = self.query(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = self.value(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class ConstantAttention(MegatronAttention):
    """Sizes written as numbers: only right for the shapes they were written for."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.size()
        q = self.q(x).view(b, t, 4, 16).transpose(1, 2)
        k = self.k(x).view(b, t, 4, 16).transpose(1, 2)
        v = self.v(x).view(b, t, 4, 16).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, 64))


class LlamaAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.n_rep = n_heads // n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def repeat_kv(self, x: torch.Tensor) -> torch.Tensor:
        """(b, t, kv_heads, d) -> (b, t, kv_heads * n_rep, d), sized from the module."""
        b, t = x.shape[:2]
        x = x[:, :, :, None, :].expand(b, t, self.n_kv_heads, self.n_rep, self.head_dim)
        return x.reshape(b, t, self.n_kv_heads * self.n_rep, self.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        k, v = self.repeat_kv(k), self.repeat_kv(v)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class InterleaveAttention(LlamaAttention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        k = k.repeat_interleave(self.n_rep, dim=1)
        v = v.repeat_interleave(self.n_rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class MultiQueryAttention(LlamaAttention):
    """Falcon-style multi-query attention: one kv head shared by every query head."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, 1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, 1, self.head_dim).transpose(1, 2)
        k = k.expand(b, self.n_heads, t, self.head_dim)
        v = v.expand(b, self.n_heads, t, self.head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class GroupedSDPAAttention(LlamaAttention):
    """Grouped-query attention handing its kv heads to SDPA as they are (``enable_gqa``, as HF
    does under ``TRANSFORMERS_SDPA_FORCE_GQA``), built with one kv head: fewer than any tp."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, dim: int, gated: bool) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim, bias=not gated)
        self.gate = nn.Linear(dim, 4 * dim, bias=False) if gated else None
        self.down = nn.Linear(4 * dim, dim, bias=not gated)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x)))


ATTENTION = {
    "megatron": lambda dim, heads, seq: MegatronAttention(dim, heads, seq),
    "nanogpt": lambda dim, heads, seq: NanoGPTAttention(dim, heads, seq),
    "constant": lambda dim, heads, seq: ConstantAttention(dim, heads, seq),
    "mingpt": lambda dim, heads, seq: MinGPTAttention(dim, heads, seq),
    "fused": lambda dim, heads, seq: NanoGPTFusedAttention(dim, heads, seq),
    "llama": lambda dim, heads, seq: LlamaAttention(dim, heads, heads // 2),
    "interleave": lambda dim, heads, seq: InterleaveAttention(dim, heads, heads // 2),
    "mqa": lambda dim, heads, seq: MultiQueryAttention(dim, heads, 1),
    "gqa_one_kv": lambda dim, heads, seq: GroupedSDPAAttention(dim, heads, 1),
}


class Block(nn.Module):
    def __init__(self, kind: str, dim: int, heads: int, max_seq: int) -> None:
        super().__init__()
        llama = kind in ("llama", "interleave", "mqa", "gqa_one_kv")
        self.ln1 = nn.RMSNorm(dim) if llama else nn.LayerNorm(dim)
        self.ln2 = nn.RMSNorm(dim) if llama else nn.LayerNorm(dim)
        self.attn = ATTENTION[kind](dim, heads, max_seq)
        self.mlp = MLP(dim, gated=llama)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(
        self, kind: str, dim: int = 64, heads: int = 4, layers: int = LAYERS, max_seq: int = MAX_SEQ
    ) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Block(kind, dim, heads, max_seq) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model() -> nn.Module:
    return GPT("megatron")


def build_megatron() -> nn.Module:
    return GPT("megatron")


def build_llama() -> nn.Module:
    return GPT("llama")


def build_interleave() -> nn.Module:
    return GPT("interleave")


def build_mqa() -> nn.Module:
    return GPT("mqa")


def build_gqa_one_kv() -> nn.Module:
    return GPT("gqa_one_kv")


def build_nanogpt() -> nn.Module:
    return GPT("nanogpt")


def build_mingpt() -> nn.Module:
    return GPT("mingpt")


def build_fused() -> nn.Module:
    return GPT("fused")


def build_constant() -> nn.Module:
    return GPT("constant")


def make_batch(batch_size: int, seq_len: int | None = None) -> tuple[tuple, torch.Tensor]:
    seq_len = seq_len or 16
    idx = torch.randint(0, VOCAB, (batch_size, seq_len + 1))
    return (idx[:, :-1],), idx[:, 1:]
