"""A small UNet (a test fixture): a convolutional encoder whose feature maps skip over the
bottleneck to the decoder level of the same resolution (``torch.cat`` on channels), max-pool
down, transposed convolution up, per-pixel regression of the input image's channels.
"""

from __future__ import annotations

import torch
from torch import nn

CHANNELS, WIDTH, SIZE = 3, 8, 16


class DoubleConv(nn.Sequential):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__(
            nn.Conv2d(cin, cout, 3, padding=1),
            nn.GroupNorm(2, cout),
            nn.ReLU(),
            nn.Conv2d(cout, cout, 3, padding=1),
            nn.GroupNorm(2, cout),
            nn.ReLU(),
        )


class Down(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.pool = nn.MaxPool2d(2)
        self.conv = DoubleConv(cin, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.pool(x))


class Up(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cin // 2, 2, stride=2)
        self.conv = DoubleConv(cin, cout)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([skip, self.up(x)], dim=1))


class UNet(nn.Module):
    def __init__(self, channels: int = CHANNELS, width: int = WIDTH) -> None:
        super().__init__()
        self.inc = DoubleConv(channels, width)
        self.down1 = Down(width, 2 * width)
        self.down2 = Down(2 * width, 4 * width)
        self.up1 = Up(4 * width, 2 * width)
        self.up2 = Up(2 * width, width)
        self.outc = nn.Conv2d(width, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.inc(x)
        x2 = self.down1(x1)
        x3 = self.down2(x2)
        y = self.up1(x3, x2)
        y = self.up2(y, x1)
        return self.outc(y)


def build_model() -> nn.Module:
    return UNet()


def make_batch(batch_size: int, seq_len: int | None = None):
    x = torch.randn(batch_size, CHANNELS, SIZE, SIZE)
    return (x,), x.flip(-1)
