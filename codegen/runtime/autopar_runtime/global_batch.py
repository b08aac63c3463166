"""A batch-coupled model over the global batch: batch norms synced over the data-parallel ranks
(SYNC_BATCHNORM) and a loss given the data-parallel ranks' outputs (GATHER_LOSS).

Under data parallelism each rank's forward sees its slice of the batch. A batch norm in training
mode normalizes with its batch's mean and variance; a contrastive loss scores each sample
against the others of its batch: per slice, both mean something else than the single-process
model on the global batch (the planner names them: plan.json's ``batch_coupling``).

- SYNC_BATCHNORM: each batch norm's training forward takes its statistics over the
  data-parallel ranks (two autograd all-reduces: the sums, then the squared deviations from the
  global mean, so the variance is computed as the single-process model computes it). Not
  torch.nn.SyncBatchNorm: in torch 2.13 its forward raises on CPU tensors ("SyncBatchNorm
  expected input tensor to be on GPU"), and gloo on CPU is what the tests run. The modules keep
  their class, names and parameters (the forward is replaced on the instance), so FSDP2, DCP and
  --verify see the model's own FQNs. Running statistics follow nn.BatchNorm's update (momentum,
  or the cumulative mean when momentum is None; the unbiased variance).
- GATHER_LOSS: the model file's ``loss_fn(output, target, *, gather=None)`` is called with
  ``gather(t) -> (every data-parallel rank's t concatenated along dim 0 in rank order, the
  offset of this rank's rows)``; the gradient of each rank's part flows back to it (summed over
  the ranks' losses), and the data-parallel mean of the gradients then equals the gradient of
  the global batch's loss.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .common import Constants

__all__ = ["data_parallel_group", "apply_sync_batchnorm", "with_gather"]


def data_parallel_group(c: Constants, mesh: DeviceMesh) -> dist.ProcessGroup:
    """The process group of this rank's data-parallel peers (dp x fsdp, in dp_rank_of's order:
    dp major, fsdp minor, as the batch is sliced). Every rank calls it alike (a flattened mesh
    dim is created once, then reused)."""
    if c.MESH["dp"] > 1 and c.MESH["fsdp"] > 1:
        try:
            return mesh["dp_fsdp"].get_group()
        except (KeyError, RuntimeError):
            return mesh["dp", "fsdp"]._flatten("dp_fsdp").get_group()
    return mesh["dp" if c.MESH["dp"] > 1 else "fsdp"].get_group()


def apply_sync_batchnorm(c: Constants, model: nn.Module, mesh: DeviceMesh) -> int:
    """Sync every batch norm of ``model`` over the data-parallel ranks (see above); returns how
    many it synced."""
    group = data_parallel_group(c, mesh)
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for norm in norms:
        norm.forward = types.MethodType(functools.partial(_synced_forward, group=group), norm)
    return len(norms)


class _SumOverRanks(torch.autograd.Function):
    """An all-reduce (sum) over ``group`` whose backward all-reduces the gradient: every rank's
    output reads every rank's input. (torch.distributed.nn.functional.all_reduce does the same
    and warns that it is deprecated in torch 2.13.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _SumOverRanks.apply(grad, ctx.group), None


class _GatherRows(torch.autograd.Function):
    """Every rank's ``x`` concatenated along dim 0 in ``group``'s rank order, ``rows[r]`` rows
    from rank r (uneven shares padded for the collective, then cut); backward: the sum over
    ranks of the gradient of the whole, this rank's rows of it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, rows: list[int]) -> torch.Tensor:
        rank, most = dist.get_rank(group), max(rows)
        padded = x.new_zeros((most, *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in rows]
        dist.all_gather(parts, padded, group=group)
        ctx.group, ctx.start, ctx.stop = group, sum(rows[:rank]), sum(rows[: rank + 1])
        return torch.cat([part[:n] for part, n in zip(parts, rows)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.start : ctx.stop], None, None


def _synced_forward(norm: nn.modules.batchnorm._BatchNorm, x: torch.Tensor, group) -> Any:
    if not norm.training and norm.track_running_stats:
        return type(norm).forward(norm, x)
    channels = x.shape[1]
    dims = [0, *range(2, x.dim())]
    shape = [1, channels] + [1] * (x.dim() - 2)
    count = torch.full((1,), x.numel() // channels, dtype=x.dtype, device=x.device)
    sums = _SumOverRanks.apply(torch.cat([x.sum(dims), count]), group)
    n = sums[-1]
    mean = sums[:channels] / n
    centered = x - mean.view(shape)
    var = _SumOverRanks.apply(centered.square().sum(dims), group) / n
    y = centered * torch.rsqrt(var.view(shape) + norm.eps)
    if norm.affine:
        y = y * norm.weight.view(shape) + norm.bias.view(shape)
    if norm.training and norm.track_running_stats:
        with torch.no_grad():
            norm.num_batches_tracked.add_(1)
            m = norm.momentum
            m = 1.0 / float(norm.num_batches_tracked) if m is None else m
            norm.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
            norm.running_var.mul_(1 - m).add_(var.detach() * (n / (n - 1)), alpha=m)
    return y


def with_gather(c: Constants, loss_fn: Callable, mesh: DeviceMesh) -> Callable:
    """``loss_fn`` with ``gather`` bound (GATHER_LOSS), else ``loss_fn`` itself."""
    if not c.GATHER_LOSS:
        return loss_fn
    group = data_parallel_group(c, mesh)
    rank = dist.get_rank(group)

    def gather(t: torch.Tensor) -> tuple[torch.Tensor, int]:
        count = torch.tensor([t.shape[0]], device=t.device)
        counts = [torch.empty_like(count) for _ in range(dist.get_world_size(group))]
        dist.all_gather(counts, count, group=group)
        rows = [int(n) for n in counts]
        return _GatherRows.apply(t, group, rows), sum(rows[:rank])

    return functools.partial(loss_fn, gather=gather)
