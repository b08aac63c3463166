"""A small decoder whose forward takes a dict and returns a dict, with dropout everywhere:
for tests/test_inputs.py (inputs and outputs of any pytree shape; dropout under --verify and
in training).

``forward(batch)`` reads ``batch["input_ids"]`` (B, T) and ``batch["mask"]`` (B, T, float: 1
keeps a token's embedding) and returns ``{"logits": (B, T, vocab), "aux": scalar}``; the loss
adds ``aux`` (a penalty on the hidden states) to the cross-entropy. Dropout: nn.Dropout on the
embeddings and after each MLP, SDPA's dropout_p on attention weights, F.dropout on the
attention output (a float attribute, as HF models do).

Environment (test hooks): DICT_SAME_ROWS=1 makes every sample of a batch the same sample;
DICT_LOSS_LOG=PATH appends "rank loss" for every loss this process computes.
"""

import os

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, LAYERS, P = 96, 32, 4, 2, 0.1


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(DIM, DIM) for _ in range(3))
        self.o = nn.Linear(DIM, DIM)
        self.dropout = P

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            f(x).view(b, t, -1, DIM // HEADS).transpose(1, 2) for f in (self.q, self.k, self.v)
        )
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = self.o(y.transpose(1, 2).reshape(b, t, -1))
        return F.dropout(y, p=self.dropout, training=self.training)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = Attention()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.drop = nn.Dropout(P)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.down(F.gelu(self.up(self.ln2(x)))))


class DictLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.drop = nn.Dropout(P)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, batch: dict) -> dict:
        x = self.drop(self.tok(batch["input_ids"]) * batch["mask"].unsqueeze(-1))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        return {"logits": self.head(x), "aux": x.pow(2).mean()}


def build_model() -> nn.Module:
    return DictLM()


def make_batch(batch_size: int, seq_len: int | None = None):
    seq_len = seq_len or 16
    rows = 1 if os.environ.get("DICT_SAME_ROWS") == "1" else batch_size
    ids = torch.randint(0, VOCAB, (rows, seq_len + 1)).expand(batch_size, -1)
    mask = (torch.rand(rows, seq_len) > 0.1).float().expand(batch_size, -1)
    return ({"input_ids": ids[:, :-1], "mask": mask},), ids[:, 1:]


def loss_fn(output: dict, target: torch.Tensor) -> torch.Tensor:
    logits = output["logits"]
    loss = F.cross_entropy(logits.flatten(0, -2).float(), target.flatten()) + 0.1 * output["aux"]
    log = os.environ.get("DICT_LOSS_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{os.environ.get('RANK', '0')} {loss.item():.9f}\n")
    return loss
