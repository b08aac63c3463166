"""A CLIP-like dual tower with 0-dim parameters: for tests/test_scalar_params.py (FSDP2 cannot
shard a scalar; the emitted program keeps them replicated).

- ``image``: an MLP tower over flattened "pixels" (B, PIXELS);
- ``text``: token embeddings (B, T) and blocks with a ReZero gate each (``gate``: a 0-dim
  parameter inside a planned layer, an FSDP2 unit of its own), mean-pooled over the sequence;
- ``logit_scale`` (CLIP's, ``log(1/0.07)``) and ``logit_bias`` (SigLIP's): 0-dim parameters at
  the root, read outside any layer.

``forward(pixels, ids)`` -> one logit per pair, ``exp(logit_scale) * cos(image, text) +
logit_bias``; the loss is per pair (binary cross-entropy against "matched": half the pairs of a
batch are), so the loss of a batch is the mean of its samples' (no batch-coupled softmax).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

PIXELS, VOCAB, DIM, EMBED, LAYERS = 48, 64, 32, 16, 2


class GatedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)
        self.gate = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gate * self.down(F.gelu(self.up(self.norm(x))))


class DualTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Linear(PIXELS, DIM), nn.GELU(), nn.Linear(DIM, EMBED))
        self.tok = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(GatedBlock() for _ in range(LAYERS))
        self.text_proj = nn.Linear(DIM, EMBED)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        self.logit_bias = nn.Parameter(torch.tensor(-1.0))

    def forward(self, pixels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for block in self.blocks:
            x = block(x)
        text = F.normalize(self.text_proj(x.mean(1)), dim=-1)
        image = F.normalize(self.image(pixels), dim=-1)
        return self.logit_scale.exp() * (image * text).sum(-1) + self.logit_bias


def build_model() -> nn.Module:
    return DualTower()


def make_batch(batch_size: int, seq_len: int | None = None):
    seq_len = seq_len or 8
    ids = torch.randint(0, VOCAB, (batch_size, seq_len))
    matched = torch.arange(batch_size) % 2 == 0
    # a matched pair's pixels repeat its token ids (scaled); the others' are noise
    noise = torch.randn(batch_size, PIXELS)
    drawn = (ids.float() / VOCAB).repeat(1, PIXELS // seq_len + 1)[:, :PIXELS]
    pixels = torch.where(matched[:, None], drawn + 0.1 * noise, noise)
    return (pixels, ids), matched.float()


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(output.float(), target)
