"""Models built from torch's own transformer layers and from scan-style token mixers, for the
pipeline cuts of tests/test_mixers.py (issue 28, item 7): each is a plain stack of layers.

- ``build_encoder``: a causal LM on ``nn.TransformerEncoder`` (two ``nn.TransformerEncoderLayer``,
  a causal mask from ``nn.Transformer.generate_square_subsequent_mask`` and ``is_causal=True``);
- ``build_encoder_decoder``: ``nn.TransformerEncoder`` and ``nn.TransformerDecoder`` (two layers
  each): the encoder reads the tokens, the decoder the same tokens with a causal mask and the
  encoder's output as memory;
- ``build_encoder_mask``, ``build_encoder_decoder_mask``: the same with the causal mask passed
  without the ``is_causal`` hint (``is_causal=False``, ``tgt_is_causal=False``): the layers
  read the mask (with the hint, ``nn.MultiheadAttention`` drops it and asks SDPA for causal
  attention itself);
- ``build_cumsum``: a token mixer of our own: the running mean over the sequence
  (``torch.cumsum`` divided by the position), between linears;
- ``build_loop``: the same kind of mixer as a recurrence written with a python loop over the
  sequence (``h_t = a * h_{t-1} + x_t``), the outputs stacked;
- ``build_loop_inplace``: the same recurrence writing each step into a preallocated output
  (``out[:, t] = state``).

``forward(ids)`` (B, T) -> logits (B, T, VOCAB); the default cross-entropy loss.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, DIM, HEADS, FF, LAYERS = 64, 32, 4, 64, 2


def _causal(t: int, device: torch.device) -> torch.Tensor:
    return nn.Transformer.generate_square_subsequent_mask(t, device=device)


class EncoderLM(nn.Module):
    def __init__(self, hint: bool = True) -> None:
        super().__init__()
        self.hint = hint
        self.embed = nn.Embedding(VOCAB, DIM)
        layer = nn.TransformerEncoderLayer(DIM, HEADS, FF, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = _causal(ids.shape[1], ids.device)
        return self.head(self.encoder(self.embed(ids), mask=mask, is_causal=self.hint))


class EncoderDecoderLM(nn.Module):
    def __init__(self, hint: bool = True) -> None:
        super().__init__()
        self.hint = hint
        self.embed = nn.Embedding(VOCAB, DIM)
        enc = nn.TransformerEncoderLayer(DIM, HEADS, FF, dropout=0.0, batch_first=True)
        dec = nn.TransformerDecoderLayer(DIM, HEADS, FF, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(enc, LAYERS, enable_nested_tensor=False)
        self.decoder = nn.TransformerDecoder(dec, LAYERS)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        memory = self.encoder(x)
        mask = _causal(ids.shape[1], ids.device)
        return self.head(self.decoder(x, memory, tgt_mask=mask, tgt_is_causal=self.hint))


class CumsumMixer(nn.Module):
    """The running mean of a projection over the sequence, mixed back in."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.inp = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(self.norm(x))
        steps = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)
        return x + self.out(torch.cumsum(h, dim=1) / steps[:, None])


class LoopMixer(CumsumMixer):
    """A decaying recurrence over the sequence, one step per position in a python loop."""

    def __init__(self, decay: float = 0.9) -> None:
        super().__init__()
        self.decay = decay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(self.norm(x))
        state = torch.zeros_like(h[:, 0])
        outs = []
        for t in range(h.shape[1]):
            state = self.decay * state + h[:, t]
            outs.append(state)
        return x + self.out(torch.stack(outs, dim=1))


class InplaceLoopMixer(LoopMixer):
    """The same recurrence writing each step into a preallocated output (``out[:, t] = ...``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(self.norm(x))
        out = torch.empty_like(h)
        state = torch.zeros_like(h[:, 0])
        for t in range(h.shape[1]):
            state = self.decay * state + h[:, t]
            out[:, t] = state
        return x + self.out(out)


class MixerLM(nn.Module):
    def __init__(self, mixer: type[nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(mixer() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_encoder() -> nn.Module:
    return EncoderLM()


def build_encoder_decoder() -> nn.Module:
    return EncoderDecoderLM()


def build_encoder_mask() -> nn.Module:
    return EncoderLM(hint=False)


def build_encoder_decoder_mask() -> nn.Module:
    return EncoderDecoderLM(hint=False)


def build_cumsum() -> nn.Module:
    return MixerLM(CumsumMixer)


def build_loop() -> nn.Module:
    return MixerLM(LoopMixer)


def build_loop_inplace() -> nn.Module:
    return MixerLM(InplaceLoopMixer)


build_model = build_encoder


def make_batch(batch_size: int, seq_len: int | None = None) -> tuple[tuple, torch.Tensor]:
    seq_len = seq_len or 8
    ids = torch.randint(0, VOCAB, (batch_size, seq_len + 1))
    return (ids[:, :-1],), ids[:, 1:]
