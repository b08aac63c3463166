"""A small decoder with top-2 mixture-of-experts MLPs, written the way people write one.

The router is a Linear over the hidden size; ``topk`` picks 2 of 4 experts per token and a softmax
over the 2 picked logits weights them (the Mixtral recipe); each expert is an ordinary MLP in an
``nn.ModuleList``, run on the tokens routed to it (``torch.where``); the block returns its output
and the Switch-Transformer load-balancing loss, which the loss adds with weight 0.01.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HIDDEN, HEADS, LAYERS, EXPERTS, TOP_K, CTX = 64, 32, 64, 4, 2, 4, 2, 32
AUX_WEIGHT = 0.01


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

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, d = x.shape
        x = x.reshape(-1, d)
        logits = self.gate(x)
        weights, chosen = torch.topk(logits, TOP_K, dim=-1)
        weights = F.softmax(weights, dim=-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows, nth = torch.where(chosen == i)
            out[rows] += weights[rows, nth, None] * expert(x[rows])
        # load balancing: fraction of tokens sent to each expert x mean router probability
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
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, VOCAB, (batch_size, t + 1), generator=g)
    return (idx[:, :-1],), idx[:, 1:]


def loss_fn(output, target: torch.Tensor) -> torch.Tensor:
    logits, aux = output
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    return ce + AUX_WEIGHT * aux
