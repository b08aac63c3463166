"""A causal LM built from torch's own nn.TransformerEncoder, dropout 0.1 in every form a model
writes it: for tests/test_dropout_forms.py (--verify turns every one off, in both runs).

- ``drop``: nn.Dropout on the embeddings, at the root (outside any planned layer: a pipeline
  stage runs it as an exported ``aten.dropout`` op);
- ``encoder``: nn.TransformerEncoder of two nn.TransformerEncoderLayer (dropout=0.1):
  nn.MultiheadAttention's attention dropout (F.multi_head_attention_forward, which calls SDPA
  with ``dropout_p`` inside it) and the layer's nn.Dropout modules; causal mask, is_causal;
- ``mix``: a block of our own with q/k/v/o linears, ``F.scaled_dot_product_attention(dropout_p=
  ...)``, ``F.dropout(training=self.training)`` and a functional attention that calls
  ``F.multi_head_attention_forward`` on its own parameters with ``dropout_p``.

``forward(ids)`` (B, T) -> logits (B, T, VOCAB); the default cross-entropy loss.
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, FF, P = 64, 32, 4, 64, 0.1


class Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))
        self.in_proj = nn.Parameter(torch.randn(3 * DIM, DIM) * DIM**-0.5)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (
            f(h).view(b, t, -1, DIM // HEADS).transpose(1, 2) for f in (self.q, self.k, self.v)
        )
        p = P if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=mask is not None)
        x = x + F.dropout(self.o(y.transpose(1, 2).reshape(b, t, -1)), P, training=self.training)
        h = self.ln2(x).transpose(0, 1)  # (T, B, DIM): the functional form's layout
        y, _ = F.multi_head_attention_forward(
            h, h, h, DIM, HEADS, self.in_proj, None, None, None, False, P, self.out.weight,
            self.out.bias, training=self.training, need_weights=False, attn_mask=mask,
            is_causal=mask is not None,
        )  # fmt: skip
        return x + y.transpose(0, 1)


class EncoderLM(nn.Module):
    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(64, DIM)
        self.drop = nn.Dropout(P)
        layer = nn.TransformerEncoderLayer(DIM, HEADS, FF, dropout=P, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.mix = Mix()
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        x = self.drop(self.tok(ids) + self.pos(torch.arange(t, device=ids.device)))
        mask = None
        if self.causal:
            mask = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
        x = self.encoder(x, mask=mask, is_causal=self.causal)
        x = self.mix(x, mask)
        return self.head(self.ln_f(x))


def build_model() -> nn.Module:
    return EncoderLM(causal=True)


def build_bidirectional() -> nn.Module:
    """The same without the causal mask (a token tagger): torch.export turns a mask built from
    shapes alone into a constant that it drops from the layers' call signatures, so the causal
    model cannot be cut into pipeline stages (refused at plan time); this one can."""
    return EncoderLM(causal=False)


def make_batch(batch_size: int, seq_len: int | None = None):
    seq_len = seq_len or 16
    ids = torch.randint(0, VOCAB, (batch_size, seq_len + 1))
    return (ids[:, :-1],), ids[:, 1:]
