"""A small decoder with top-2 mixture-of-experts MLPs whose experts' weights are stacked, written
the way people write one (torchtitan's and HF transformers' layout).

The router is a Linear over the hidden size; ``topk`` picks 2 of 4 experts per token and a softmax
over the 2 picked logits weights them; the experts are one module holding each weight for all
experts in one tensor (first dim = experts), called as ``experts(x, chosen, weights)``: it runs
each expert on the rows routed to it (``torch.where``) and sums them with their weights. The
block also returns the Switch-Transformer load-balancing loss, which the loss adds with weight
0.01.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HIDDEN, HEADS, LAYERS, EXPERTS, TOP_K, CTX = 64, 32, 48, 4, 2, 4, 2, 32
AUX_WEIGHT = 0.01


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
            h = F.linear(F.gelu(F.linear(x[rows], self.w1[e])), self.w2[e])
            out = out.index_add(0, rows, weights[rows, nth, None] * h)
        return out


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = Experts()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, d = x.shape
        x = x.reshape(-1, d)
        logits = self.gate(x)
        weights, chosen = torch.topk(logits, TOP_K, dim=-1)
        out = self.experts(x, chosen, F.softmax(weights, dim=-1))
        probs = F.softmax(logits, dim=-1)
        routed = F.one_hot(chosen, EXPERTS).float().sum(dim=1)
        aux = EXPERTS * (routed.mean(dim=0) / TOP_K * probs.mean(dim=0)).sum()
        return out.view(b, t, d), aux


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.ln2 = nn.LayerNorm(DIM)
        self.moe = MoE()

    def forward(self, x: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.ln1(x)
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        y, a = self.moe(self.ln2(x))
        return x + y, aux + a


class MoEGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(CTX, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        aux = torch.zeros((), device=x.device)
        for block in self.blocks:
            x, aux = block(x, aux)
        return self.head(self.ln_f(x)), aux / LAYERS


def build_model() -> nn.Module:
    return MoEGPT()


def make_batch(batch_size: int, seq_len: int | None = None):
    t = seq_len or 16
    idx = torch.randint(0, VOCAB, (batch_size, t + 1))
    return (idx[:, :-1],), idx[:, 1:]


def loss_fn(output, target: torch.Tensor) -> torch.Tensor:
    logits, aux = output
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    return ce + AUX_WEIGHT * aux
