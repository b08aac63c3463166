"""A small decoder whose MoE blocks put a shared expert beside routed stacked experts (the
DeepSeek-MoE layout, written by hand; a test fixture): every token goes through the shared MLP,
and top-2 of 4 routed experts (one module holding each weight for all experts, first dim =
experts, called as ``experts(x, chosen, weights)``) add theirs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HIDDEN, HEADS, LAYERS, EXPERTS, TOP_K, CTX = 64, 32, 48, 4, 2, 4, 2, 32


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_experts = EXPERTS
        self.w1 = nn.Parameter(torch.empty(EXPERTS, HIDDEN, DIM))
        self.w2 = nn.Parameter(torch.empty(EXPERTS, DIM, HIDDEN))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w1, std=1 / math.sqrt(DIM))
        nn.init.normal_(self.w2, std=1 / math.sqrt(HIDDEN))

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor):
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            rows, nth = torch.where(chosen == e)
            h = F.linear(F.silu(F.linear(x[rows], self.w1[e])), self.w2[e])
            out = out.index_add(0, rows, weights[rows, nth, None] * h)
        return out


class SharedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.up(x)))


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = Experts()
        self.shared_expert = SharedMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        x = x.reshape(-1, d)
        probs = F.softmax(self.gate(x), dim=-1)
        weights, chosen = torch.topk(probs, TOP_K, dim=-1)
        routed = self.experts(x, chosen, weights / weights.sum(-1, keepdim=True))
        return (self.shared_expert(x) + routed).view(b, t, d)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.RMSNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.ln2 = nn.RMSNorm(DIM)
        self.moe = MoE()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.moe(self.ln2(x))


class SharedMoEGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(CTX, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model() -> nn.Module:
    return SharedMoEGPT()


def make_batch(batch_size: int, seq_len: int | None = None):
    t = seq_len or 16
    idx = torch.randint(0, VOCAB, (batch_size, t + 1))
    return (idx[:, :-1],), idx[:, 1:]
