"""A CLIP-style dual tower trained with a contrastive loss over the batch (a test fixture for
tests/test_batch_coupled.py).

``forward(pixels, ids)`` -> (image embeddings, text embeddings), each (B, EMBED) and unit norm;
``loss_fn`` scores every image against every text of the batch (a B x B similarity matrix) and
takes the cross-entropy of each row and column against the diagonal (CLIP's symmetric InfoNCE).
The loss of a sample depends on every other sample of the batch: under data parallelism each
rank sees only its slice's negatives. ``loss_fn`` takes ``gather``: given it (``plan
--gather-loss``), it gathers the text and image embeddings of every data-parallel rank (with
their gradients) and scores this rank's samples against the whole global batch, as the
single-process model does.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

PIXELS, VOCAB, SEQ, DIM, EMBED = 48, 64, 6, 32, 16


class ImageTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(PIXELS, DIM), nn.Linear(DIM, EMBED)

    def forward(self, pixels):
        return self.fc2(torch.relu(self.fc1(pixels)))


class TextTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.fc1, self.fc2 = nn.Linear(DIM, DIM), nn.Linear(DIM, EMBED)

    def forward(self, ids):
        x = self.embed(ids).mean(dim=1)
        return self.fc2(torch.relu(self.fc1(x)))


class DualTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.image = ImageTower()
        self.text = TextTower()
        self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0)))

    def forward(self, pixels, ids):
        image = F.normalize(self.image(pixels), dim=-1)
        text = F.normalize(self.text(ids), dim=-1)
        return image * self.logit_scale.exp(), text


def build_model() -> nn.Module:
    return DualTower()


def make_batch(batch_size: int, seq_len: int | None = None):
    pixels = torch.randn(batch_size, PIXELS)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ))
    return (pixels, ids), torch.zeros(batch_size)  # the target is the diagonal: unused


def loss_fn(output, target, *, gather=None):
    """CLIP's symmetric contrastive loss. ``gather(t)``: ``t`` of every data-parallel rank,
    concatenated in rank order along dim 0, with gradients flowing back to each rank's part, and
    the offset of this rank's rows (None: single process, the batch is the whole)."""
    image, text = output
    offset = 0
    all_image, all_text = image, text
    if gather is not None:
        (all_image, offset), (all_text, _) = gather(image), gather(text)
    labels = torch.arange(offset, offset + image.shape[0], device=image.device)
    per_image = F.cross_entropy(image @ all_text.T, labels)
    per_text = F.cross_entropy(text @ all_image.T, labels)
    return (per_image + per_text) / 2
