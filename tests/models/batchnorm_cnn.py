"""A small CNN with BatchNorm (a test fixture for tests/test_batch_coupled.py): two conv blocks
(``nn.Conv2d`` -> ``nn.BatchNorm2d`` -> ReLU), global average pooling, an MLP head with
``nn.BatchNorm1d``, a classifier. In training mode each BatchNorm normalizes with the mean and
variance of the batch it sees: under data parallelism, of one rank's slice only (the batch is
coupled), unless the program converts the norms to ``nn.SyncBatchNorm`` (``plan
--sync-batchnorm``).
"""

from __future__ import annotations

import torch
from torch import nn

CHANNELS, SIDE, CLASSES, HIDDEN = 3, 8, 5, 16


class Block(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block1 = Block(CHANNELS, 8)
        self.block2 = Block(8, HIDDEN)
        self.fc = nn.Linear(HIDDEN, HIDDEN)
        self.bn = nn.BatchNorm1d(HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        x = self.block2(self.block1(x)).mean(dim=(2, 3))
        return self.head(torch.relu(self.bn(self.fc(x))))


def build_model() -> nn.Module:
    return SmallCNN()


def make_batch(batch_size: int, seq_len: int | None = None):
    x = torch.randn(batch_size, CHANNELS, SIDE, SIDE)
    return (x,), torch.randint(0, CLASSES, (batch_size,))
