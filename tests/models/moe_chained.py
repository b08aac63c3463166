"""A top-2 MoE whose ModuleList experts are chained (a test fixture of what expert parallelism
refuses): each routed expert reads the running output, which the experts before it wrote, not
the block's input alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HIDDEN, LAYERS, EXPERTS, TOP_K = 64, 32, 64, 2, 4, 2


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        x = x.reshape(-1, d)
        weights, chosen = torch.topk(self.gate(x), TOP_K, dim=-1)
        weights = F.softmax(weights, dim=-1)
        out = x
        for i, expert in enumerate(self.experts):
            rows, nth = torch.where(chosen == i)
            out = out.index_add(0, rows, weights[rows, nth, None] * expert(out[rows]))
        return out.view(b, t, d)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.moe = MoE()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.ln(x))


class ChainedMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model() -> nn.Module:
    return ChainedMoE()


def make_batch(batch_size: int, seq_len: int | None = None):
    t = seq_len or 16
    idx = torch.randint(0, VOCAB, (batch_size, t + 1))
    return (idx[:, :-1],), idx[:, 1:]
