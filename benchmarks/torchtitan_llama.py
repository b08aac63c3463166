"""Llama in torchtitan's own layout, the model behind the torchtitan rows of published_runs.py
that name it (``tt:`` models).

torchtitan trains its own Llama, not HF's ``LlamaForCausalLM``. What differs, each because it
changes what a layer saves for backward (so the memory a run needs) or its work:

- the RMSNorms are one fused op (torchtitan's ``fused_rmsnorm`` Triton kernel in 2024, torch's
  fused ``rms_norm`` on CUDA since): it saves its input and the reciprocal RMS per row, where
  HF's ``LlamaRMSNorm``, written as its ops, also saves an fp32 copy of its input and the
  normalized tensor (``ir._saved`` measures ``F.rms_norm`` as CUDA's fused kernel runs it);
- rotary embeddings rotate (even, odd) pairs of each head in fp32 and cast back (torchtitan's
  complex multiply by ``freqs_cis``; written here with real cos and sin buffers, the same
  arithmetic and, as the multiplier needs no gradient, nothing saved but the buffers);
- separate q, k, v projections (``wq``, ``wk``, ``wv``), SDPA with ``is_causal``, a SwiGLU feed
  forward (``w1``, ``w3``, ``w2``), untied output head.

Sizes from environment variables: TT_LAYERS, TT_DIM, TT_HEADS, TT_KV_HEADS, TT_FFN (the SwiGLU
hidden size), TT_VOCAB, TT_MAX_SEQ.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

LAYERS = int(os.environ.get("TT_LAYERS", 2))
DIM = int(os.environ.get("TT_DIM", 64))
HEADS = int(os.environ.get("TT_HEADS", 4))
KV_HEADS = int(os.environ.get("TT_KV_HEADS", HEADS))
FFN = int(os.environ.get("TT_FFN", 4 * DIM))
VOCAB = int(os.environ.get("TT_VOCAB", 256))
MAX_SEQ = int(os.environ.get("TT_MAX_SEQ", 256))
THETA = 10000.0
EPS = 1e-5


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Each (even, odd) pair of ``x`` (batch, seq, heads, head_dim) turned by its position's
    angle, in fp32, cast back to ``x``'s dtype."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    turned = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return turned.flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq = nn.Linear(DIM, HEADS * self.head_dim, bias=False)
        self.wk = nn.Linear(DIM, KV_HEADS * self.head_dim, bias=False)
        self.wv = nn.Linear(DIM, KV_HEADS * self.head_dim, bias=False)
        self.wo = nn.Linear(HEADS * self.head_dim, DIM, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            enable_gqa=KV_HEADS != HEADS,
        )
        return self.wo(y.transpose(1, 2).contiguous().view(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, FFN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM, eps=EPS)
        self.attention = Attention()
        self.ffn_norm = nn.RMSNorm(DIM, eps=EPS)
        self.feed_forward = FeedForward()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM, eps=EPS)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        half = DIM // HEADS // 2
        freqs = THETA ** (-torch.arange(half, dtype=torch.float32) / half)
        angles = torch.outer(torch.arange(MAX_SEQ, dtype=torch.float32), freqs)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        # (seq, head_dim / 2) broadcast over batch and heads: (1, seq, 1, head_dim / 2)
        cos, sin = self.cos[:s].view(1, s, 1, -1), self.sin[:s].view(1, s, 1, -1)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def build_model() -> nn.Module:
    return Llama()


def make_batch(batch_size: int, seq_len: int | None = None) -> tuple[tuple, torch.Tensor]:
    s = seq_len or MAX_SEQ
    tokens = torch.randint(0, VOCAB, (batch_size, s + 1))
    return (tokens[:, :-1],), tokens[:, 1:]
