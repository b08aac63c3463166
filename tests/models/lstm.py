"""A stacked LSTM language model (a test fixture): token embedding, two ``nn.LSTM`` layers
with ``batch_first=True`` (each returns ``(output, (h, c))``; the output is read with
``out, _ = lstm(x)``), dropout-free, a linear head over the vocabulary.
"""

from __future__ import annotations

from torch import nn

VOCAB, DIM, HIDDEN = 96, 32, 48


class LSTMLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = DIM, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm1 = nn.LSTM(dim, hidden, batch_first=True)
        self.lstm2 = nn.LSTM(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        x, _ = self.lstm1(x)
        x, _ = self.lstm2(x)
        return self.head(x)


def build_model() -> nn.Module:
    return LSTMLM()
