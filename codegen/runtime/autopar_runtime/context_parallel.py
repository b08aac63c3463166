"""Context parallel: each rank of a cp group trains on its share of every sample's tokens."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils import _pytree as pytree

from .common import Constants, fail, has_submodule

__all__ = ["ContextParallel", "apply_context_parallel", "cp_active", "cp_shard"]


# CONTEXT_PARALLEL (mesh cp > 1): each rank of a cp group trains on its 1/cp of every sample's
# tokens. The sequence is cut into 2 cp chunks and rank r holds chunks r and 2 cp - 1 - r
# (head-tail: under causal attention every rank then does the same work). The layers before
# CONTEXT_PARALLEL["shard_at"] (the embeddings) run on the whole sequence; a forward pre-hook on
# that layer and every later one keeps only this rank's positions of each tensor argument whose
# dim 1 is the whole sequence (the hidden states; position tables such as rotary cos/sin), and
# the targets are cut the same way, so the loss is this rank's tokens' mean. Attention: a
# TorchFunctionMode, entered by each of those layers' forward while cp is on (cp_active, around
# the step's forward and backward: checkpointed layers recompute inside backward), replaces
# F.scaled_dot_product_attention: keys and values are
# all-gathered over the cp group in one collective (their gradients reduce-scattered back in
# one), put in sequence order, and each local query chunk attends to
# the keys up to its own end with a lower-right causal mask (torch.nn.attention.bias). torch
# 2.13's own context_parallel has no rule for the CPU SDPA op; this form runs on gloo and nccl.
# Parameters are FSDP-sharded over fsdp x cp and gradients averaged over dp x fsdp x cp, so the
# ranks' mean of their local-token losses trains exactly like the whole batch.
class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim`` over ``group`` (rank order); backward: the sum of the ranks'
    gradients of this rank's part. One collective each way (what the cost model charges per
    attention layer): the backward is reduce_scatter_tensor over the parts laid end to end, not
    the list form, which gloo runs as one all-reduce per rank."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, grad):
        rank, world = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        parts = grad.chunk(world, ctx.dim)
        flat = torch.cat([p.reshape(-1) for p in parts])
        out = torch.empty(parts[rank].numel(), dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_tensor(out, flat, group=ctx.group)
        return out.view(parts[rank].shape), None, None


class ContextParallel:
    """One rank's view of the cp group: its positions and the attention that replaces SDPA."""

    def __init__(self, c: Constants, cp_mesh: DeviceMesh) -> None:
        self.group, self.size = cp_mesh.get_group(), cp_mesh.size()
        self.rank, self.seq_len = cp_mesh.get_local_rank(), c.SEQ_LEN
        self.chunk = c.SEQ_LEN // (2 * self.size)
        chunks = (self.rank, 2 * self.size - 1 - self.rank)
        self.positions = torch.cat(
            [torch.arange(k * self.chunk, (k + 1) * self.chunk) for k in chunks]
        )
        self.on = False

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's positions of ``x`` along dim 1 (a whole sequence)."""
        return x.index_select(1, self.positions.to(x.device))

    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        if not self.on:
            return None

        # nested too: HF decoder layers take position_embeddings=(cos, sin)
        return pytree.tree_map(self.pre_hook_cut, (tuple(args), dict(kwargs)))

    def pre_hook_cut(self, x: Any) -> Any:
        """``x`` cut to this rank's positions if it is a tensor over the whole sequence."""
        whole = isinstance(x, torch.Tensor) and x.dim() > 1 and x.shape[1] == self.seq_len
        return self.shard(x) if whole else x

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        **kw: Any,
    ) -> torch.Tensor:
        if attn_mask is not None or dropout_p:
            fail("context parallel: attention with a mask or dropout cannot be split; re-plan "
                 "without cp")  # fmt: skip
        k, v = self._gather_kv(k, v)
        if not is_causal:
            return F.scaled_dot_product_attention(q, k, v, **kw)
        # imported here: torch.nn.attention.bias loads torch._dynamo (~1.4 s of CPU at start-up
        # on every rank of a run that has no context parallel)
        from torch.nn.attention.bias import causal_lower_right

        n, outs = self.chunk, []
        for i, chunk in enumerate((self.rank, 2 * self.size - 1 - self.rank)):
            end = (chunk + 1) * n  # this query chunk sees the keys before its own end
            mask = causal_lower_right(n, end)
            outs.append(F.scaled_dot_product_attention(
                q[:, :, i * n : (i + 1) * n], k[:, :, :end], v[:, :, :end], attn_mask=mask, **kw
            ))  # fmt: skip
        return torch.cat(outs, 2)

    def _gather_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values over the whole sequence, in order: one all-gather of both, laid side
        by side on the head dim (their head dims may differ, as in MLA), where their other dims
        and dtypes agree; else one each."""
        if k.shape[:-1] != v.shape[:-1] or k.dtype != v.dtype:
            return tuple(self._in_order(_GatherSequence.apply(t, self.group, 2)) for t in (k, v))
        kv = self._in_order(_GatherSequence.apply(torch.cat([k, v], -1), self.group, 2))
        return kv.split([k.shape[-1], v.shape[-1]], -1)

    def _in_order(self, gathered: torch.Tensor) -> torch.Tensor:
        """Gathered chunks (rank r's chunks r and 2 cp - 1 - r, rank by rank) in sequence order."""
        slot = {k: 2 * k if k < self.size else 2 * (2 * self.size - 1 - k) + 1
                for k in range(2 * self.size)}  # fmt: skip
        n = self.chunk
        return torch.cat([gathered[:, :, slot[k] * n : (slot[k] + 1) * n] for k in slot], 2)


class _ContextParallelAttention(torch.overrides.TorchFunctionMode):
    def __init__(self, cp: ContextParallel) -> None:
        super().__init__()
        self.cp = cp

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            return self.cp.attention(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def apply_context_parallel(c: Constants, model: nn.Module, mesh: DeviceMesh) -> None:
    """Before TP, checkpointing and FSDP: the sequence cut at CONTEXT_PARALLEL["shard_at"] and
    every later planned layer (see above); the state rides on the model (``autopar_cp``)."""
    cp = ContextParallel(c, mesh["cp"])
    start = c.LAYERS.index(c.CONTEXT_PARALLEL["shard_at"])
    for fqn in c.LAYERS[start:]:
        if has_submodule(model, fqn):
            layer = model.get_submodule(fqn)
            layer.register_forward_pre_hook(cp.pre_hook, with_kwargs=True)
            layer.forward = _with_cp_attention(cp, layer.forward)
    model.autopar_cp = cp


def _with_cp_attention(cp: ContextParallel, forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` with SDPA replaced while cp is on: per layer, so that the recomputation of a
    checkpointed layer in backward (which the autograd engine runs outside any mode entered
    around the step) attends like its forward did."""

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not cp.on:
            return forward(*args, **kwargs)
        with _ContextParallelAttention(cp):
            return forward(*args, **kwargs)

    return run


@contextlib.contextmanager
def cp_active(cp: ContextParallel | None) -> Iterator[None]:
    """Context parallel on for the forward and backward inside (nothing without cp)."""
    if cp is None:
        yield
        return
    cp.on = True
    try:
        yield
    finally:
        cp.on = False


def cp_shard(cp: ContextParallel | None, target: Any) -> Any:
    """The targets of this rank's tokens (all of them without cp): every tensor of the target
    whose dim 1 is the whole sequence, cut like the hidden states."""
    if cp is None:
        return target
    return pytree.tree_map(cp.pre_hook_cut, target)
