"""A GPT whose output head shares the token embedding's weight (a test fixture, not an example).

``self.head.weight = self.tok_emb.weight``, the way nanoGPT and HF GPT-2 tie them: one tensor,
registered under two modules. Factory ``build_model`` is that model; ``build_untied`` the same
model with its own head weight (for comparisons). Dropout is absent so ``--verify`` compares
like with like.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, LAYERS, MAX_SEQ = 96, 32, 4, 2, 32


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n_head = HEADS
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split(DIM, dim=2)
        q, k, v = (z.view(b, t, -1, DIM // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, DIM))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = Attention()
        self.fc, self.out = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, DIM)
        self.pos_emb = nn.Embedding(MAX_SEQ, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.tok_emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model() -> nn.Module:
    return GPT()


def build_untied() -> nn.Module:
    return GPT(tied=False)


def make_batch(batch_size: int, seq_len: int | None = None) -> tuple[tuple, torch.Tensor]:
    seq_len = seq_len or 16
    idx = torch.randint(0, VOCAB, (batch_size, seq_len + 1))
    return (idx[:, :-1],), idx[:, 1:]
