"""A residual MLP classifier: autopar's non-transformer example.

Model-file contract: ``build_model()`` returns the module (cheap under ``torch.device("meta")``),
``make_batch(batch_size, seq_len=None)`` returns ``((x,), y)``: float features and integer class
targets; there is no sequence, so ``seq_len`` is ignored. The loss is the default cross-entropy.

Each block is ``x + Linear(GELU(Linear(LayerNorm(x))))``, the shape tensor parallelism splits
Megatron-style: ``up`` colwise, ``down`` rowwise.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

# Sizes: tiny, so that 4 gloo ranks on 2 cores take a fraction of a second a step; override with
# environment variables to plan bigger shapes.
IN_FEATURES = int(os.environ.get("MLP_IN_FEATURES", 32))
WIDTH = int(os.environ.get("MLP_WIDTH", 64))
BLOCKS = int(os.environ.get("MLP_BLOCKS", 4))
CLASSES = int(os.environ.get("MLP_CLASSES", 10))


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ResidualMLP(nn.Module):
    def __init__(self, in_features: int, width: int, num_blocks: int, classes: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(num_blocks))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model() -> nn.Module:
    return ResidualMLP(IN_FEATURES, WIDTH, BLOCKS, CLASSES)


def make_batch(batch_size: int, seq_len: int | None = None) -> tuple[tuple, torch.Tensor]:
    x = torch.randn(batch_size, IN_FEATURES)
    y = torch.randint(0, CLASSES, (batch_size,))
    return (x,), y
