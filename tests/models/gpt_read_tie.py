"""GPTs that read a module's weight outside that module (test fixtures, not examples).

``build_model``: the output head is ``F.linear(x, self.wte.weight)`` at the root, a tie without a
shared module (no ``lm_head`` module at all). ``build_bias_read``: an untied ``head`` module,
and weights and biases read other ways: every block runs its MLP's output projection by hand
(``h @ self.down.weight.t() + self.down.bias``, ``down`` never called), and the root applies
the final norm by hand (``F.layer_norm(x, ..., self.ln_f.weight, self.ln_f.bias)``). Dropout is
absent so ``--verify`` compares like with like.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, LAYERS, MAX_SEQ = 96, 32, 4, 2, 32


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split(DIM, dim=2)
        q, k, v = (z.view(b, t, -1, DIM // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, DIM))


class Block(nn.Module):
    def __init__(self, by_hand: bool) -> None:
        super().__init__()
        self.by_hand = by_hand
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = Attention()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        h = F.gelu(self.up(self.ln2(x)))
        if self.by_hand:  # the down projection's weight and bias, read outside ``down``
            return x + (h @ self.down.weight.t() + self.down.bias)
        return x + self.down(h)


class GPT(nn.Module):
    def __init__(self, by_hand: bool = False) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.wpe = nn.Embedding(MAX_SEQ, DIM)
        self.blocks = nn.ModuleList(Block(by_hand) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False) if by_hand else None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        if self.head is not None:  # the final norm's weight and bias, read outside ``ln_f``
            return self.head(F.layer_norm(x, (DIM,), self.ln_f.weight, self.ln_f.bias))
        return F.linear(self.ln_f(x), self.wte.weight)  # the head: the embedding's weight


def build_model() -> nn.Module:
    return GPT()


def build_bias_read() -> nn.Module:
    return GPT(by_hand=True)


def make_batch(batch_size: int, seq_len: int | None = None) -> tuple[tuple, torch.Tensor]:
    seq_len = seq_len or 16
    idx = torch.randint(0, VOCAB, (batch_size, seq_len + 1))
    return (idx[:, :-1],), idx[:, 1:]
