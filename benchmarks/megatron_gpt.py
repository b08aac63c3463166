"""GPT in Megatron-LM's 2021 layout, the model behind the Megatron rows of published_runs.py.

What differs from examples/gpt.py, each as Megatron-LM ran it (Narayanan et al. 2021; Shoeybi et
al. 2019), because each changes the work or the tensor-parallel traffic of a layer:

- one fused QKV projection (``ParallelAttention.query_key_value``): one column-parallel matmul,
  so one all-reduce of its input gradient per attention block, not one per projection;
- explicit attention, no flash kernel (it came in 2022): ``bmm`` of Q K^T scaled by 1/sqrt(d),
  causal mask and softmax over the s x s scores per head, dropout on the probabilities (p 0.1),
  ``bmm`` with V: the s x s tensors are read and written in memory (heads are laid out
  outermost before they merge with the batch, so that the planner's layouts shard them);
- dropout (p 0.1) on the attention and MLP outputs before each residual add, and on the
  embeddings.

Sizes from the same environment variables as examples/gpt.py (GPT_LAYERS, GPT_DIM, GPT_HEADS,
GPT_VOCAB, GPT_MAX_SEQ). Megatron fuses the mask with the softmax and the bias with GELU and with
dropout-add; here they are separate ops (eager torch), which the cost model charges a memory pass
each.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = int(os.environ.get("GPT_VOCAB", 256))
DIM = int(os.environ.get("GPT_DIM", 64))
HEADS = int(os.environ.get("GPT_HEADS", 4))
LAYERS = int(os.environ.get("GPT_LAYERS", 4))
MAX_SEQ = int(os.environ.get("GPT_MAX_SEQ", 256))
DROPOUT = 0.1


class Attention(nn.Module):
    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.head_dim = dim // n_head
        self.qkv = nn.Linear(dim, 3 * dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # [heads, b, t, 3 * head_dim]: the fused projection per head as Megatron lays it out,
        # heads outermost so that a rank's heads stay one block when heads and batch merge
        qkv = self.qkv(x).view(b, t, -1, 3 * self.head_dim).permute(2, 0, 1, 3)
        q, k, v = qkv.split(self.head_dim, dim=-1)
        q, k, v = (z.reshape(-1, t, self.head_dim) for z in (q, k, v))
        # Megatron folds the scale into baddbmm's alpha; scaling q instead costs a pass over q
        # (t x head_dim per head, small beside the t x t scores), and bmm shards over heads
        scores = torch.bmm(q * (1.0 / math.sqrt(self.head_dim)), k.transpose(1, 2))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        probs = torch.softmax(scores.masked_fill(mask, -1e4), dim=-1)
        probs = F.dropout(probs, DROPOUT, self.training)
        y = torch.bmm(probs, v).view(-1, b, t, self.head_dim).permute(1, 2, 0, 3)
        return self.o(y.reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, n_head)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + F.dropout(self.attn(self.ln1(x)), DROPOUT, self.training)
        return x + F.dropout(self.mlp(self.ln2(x)), DROPOUT, self.training)


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, n_head: int, n_layer: int, max_seq: int) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Embedding(max_seq, dim)
        self.blocks = nn.ModuleList(Block(dim, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = F.dropout(self.tok_emb(idx) + self.pos_emb(pos), DROPOUT, self.training)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model() -> nn.Module:
    return GPT(VOCAB, DIM, HEADS, LAYERS, MAX_SEQ)


def make_batch(batch_size: int, seq_len: int | None = None) -> tuple[tuple, torch.Tensor]:
    seq_len = seq_len or 64
    idx = torch.randint(0, VOCAB, (batch_size, seq_len + 1))
    return (idx[:, :-1],), idx[:, 1:]
