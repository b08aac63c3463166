"""A DeepSeek-style MoE block written by hand with its routed experts' weights stacked on the
block itself (first dim = experts) beside its router and a shared expert (a test fixture):
expert parallelism cannot wrap such experts (no module of their own), so ep is refused at plan
time with one line.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HIDDEN, LAYERS, EXPERTS, TOP_K = 64, 32, 48, 2, 4, 2


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        self.w1 = nn.Parameter(torch.empty(EXPERTS, HIDDEN, DIM))
        self.w2 = nn.Parameter(torch.empty(EXPERTS, DIM, HIDDEN))
        self.shared = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.SiLU(), nn.Linear(HIDDEN, DIM))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w1, std=1 / math.sqrt(DIM))
        nn.init.normal_(self.w2, std=1 / math.sqrt(HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        x = x.reshape(-1, d)
        weights, chosen = torch.topk(F.softmax(self.gate(x), dim=-1), TOP_K, dim=-1)
        out = self.shared(x)
        for e in range(EXPERTS):
            rows, nth = torch.where(chosen == e)
            h = F.linear(F.silu(F.linear(x[rows], self.w1[e])), self.w2[e])
            out = out.index_add(0, rows, weights[rows, nth, None] * h)
        return out.view(b, t, d)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.moe = MoE()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.ln(x))


class InlineMoE(nn.Module):
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
    return InlineMoE()


def make_batch(batch_size: int, seq_len: int | None = None):
    t = seq_len or 16
    idx = torch.randint(0, VOCAB, (batch_size, t + 1))
    return (idx[:, :-1],), idx[:, 1:]
