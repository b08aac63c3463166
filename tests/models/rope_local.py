"""Rotary positions computed inside attention from the length it sees (a test fixture).

Two ways reference code writes it, both right on one process and wrong on a context-parallel
rank, which sees only its chunks of the sequence:

- ``build_arange``: ``torch.arange(t)`` of the input's length, then cos/sin, in every attention
  call (GPT-NeoX-style rotary modules computed on the fly);
- ``build_sliced``: the attention module's own cos/sin buffers sliced to the input's length
  (``self.cos[:t]``).

The same Llama otherwise (tests/models/llama_rope.py).
"""

from __future__ import annotations

import torch
from llama_rope import KV_HEADS
from llama_rope import Attention as _Attention
from llama_rope import Block as _Block
from llama_rope import Llama as _Llama
from torch import nn

MAX_SEQ, THETA = 64, 10000.0


def _frequencies(head_dim: int) -> torch.Tensor:
    return 1.0 / THETA ** (torch.arange(0, head_dim, 2).float() / head_dim)


class ArangeAttention(_Attention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        positions = torch.arange(t, device=x.device).float()
        freqs = torch.outer(positions, _frequencies(self.head_dim).to(x.device))
        emb = torch.cat((freqs, freqs), dim=-1)
        return self._attend(x, emb.cos(), emb.sin())

    def _attend(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return super().forward(x, cos, sin)  # llama_rope's attention, given the tables


class SlicedAttention(ArangeAttention):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__(dim, n_heads, n_kv_heads)
        freqs = torch.outer(torch.arange(MAX_SEQ).float(), _frequencies(self.head_dim))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        return self._attend(x, self.cos[:t], self.sin[:t])


class Block(_Block):
    def __init__(self, attention: nn.Module, dim: int) -> None:
        super().__init__(dim, attention.n_heads, attention.n_kv_heads)
        self.attention = attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(_Llama):
    def __init__(self, attention: type, dim: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__(dim=dim, n_heads=heads, n_layers=layers, max_seq=MAX_SEQ)
        self.layers = nn.ModuleList(
            Block(attention(dim, heads, KV_HEADS), dim) for _ in range(layers)
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def build_arange() -> nn.Module:
    return Llama(ArangeAttention)


def build_sliced() -> nn.Module:
    return Llama(SlicedAttention)


build_model = build_arange
