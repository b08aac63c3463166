"""A decoder whose blocks are told their attention type as a string (a test fixture), the way
Gemma-style code alternates local (sliding-window) and global attention:
``block(h, "sliding")`` / ``block(h, "full")``, the mask chosen inside the block.

torch.export cannot keep a call signature that holds a string, so a pipeline stage cannot call
such a block: the planner refuses pipeline plans of this model at plan time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, LAYERS, WINDOW = 128, 32, 4, 4, 4


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, window: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.window = window
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.mlp_norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, attention_type: str) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, -1, d // self.n_heads).unbind(2)
        i = torch.arange(t, device=x.device)
        mask = i[None, :] <= i[:, None]
        if attention_type == "sliding":
            mask = mask & (i[:, None] - i[None, :] < self.window)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM, HEADS, WINDOW) for _ in range(LAYERS))
        self.layer_types = ["sliding" if i % 2 == 0 else "full" for i in range(LAYERS)]
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block, kind in zip(self.blocks, self.layer_types, strict=True):
            h = block(h, kind)
        return self.head(h)


def build_model() -> nn.Module:
    return Decoder()
