"""Batch coupling: where a model, or its loss, mixes the samples of one batch.

Data parallelism (and gradient accumulation, and pipeline microbatches) gives each forward a
slice of the global batch. For most models that changes nothing but the reduction order: the
loss of a batch is the mean of its samples'. A model is *batch-coupled* where a sample's output
or loss depends on the other samples of its batch; there each rank's run means something else
than the single-process model on the global batch. Found here:

- ``batch_norm``: batch normalization in training mode (``nn.BatchNorm1d/2d/3d``): it
  normalizes with the mean and variance of the batch it sees (in eval mode, or with running
  statistics only, it does not couple);
- ``batch_product``: a matrix product of two batch-major activations whose result is
  batch x batch (CLIP's image-text similarity, a contrastive loss's logits): a sample is scored
  against the other samples of its batch;
- ``routing``: a mixture of experts' router, whose load-balancing statistics are taken over
  the batch it routes (a per-slice statistic by design, as Megatron and HF compute it).

:func:`graph_coupling` reads the traced graph (the forward); :func:`loss_coupling` runs the
model file's ``loss_fn`` once on meta tensors and reads the ops it calls. Both are pure
analyses; the rule that turns a coupling into a warning or a refusal lives in
``planner.request.batch_coupling_rule``.
"""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from autopar.ir.graph import Graph, Node
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["Coupling", "CouplingKind", "graph_coupling", "loss_coupling", "takes_gather"]

CouplingKind = Literal["batch_norm", "batch_product", "routing"]

# aten batch norms -> the position of their ``training`` argument (None: always training)
_BATCH_NORMS = {
    "aten.batch_norm.default": 5,
    "aten.native_batch_norm.default": 5,
    "aten._native_batch_norm_legit.default": 5,
    "aten._native_batch_norm_legit_functional.default": 5,
    "aten.cudnn_batch_norm.default": 5,
    "aten._batch_norm_with_update.default": None,
    "aten._batch_norm_with_update_functional.default": None,
}
_PRODUCTS = ("aten.mm.default", "aten.matmul.default", "aten.bmm.default")


@dataclass(frozen=True)
class Coupling:
    """One place that mixes the samples of a batch."""

    kind: CouplingKind
    where: str
    """the module FQN (``""``: the root module's own forward), or ``"loss_fn"``."""
    op: str
    """the aten op (``aten.batch_norm.default``) or, for ``routing``, the MoE block's FQN."""
    module_type: str = ""
    """the module's class name (``BatchNorm2d``); empty in ``loss_fn``."""
    source: str | None = None
    """the user's source line, ``file:line``, where known."""


def graph_coupling(graph: Graph) -> tuple[Coupling, ...]:
    """The couplings of the traced forward, in graph order (one per module and kind)."""
    found: dict[tuple[str, str], Coupling] = {}
    batch = graph.batch_size
    for node in graph.nodes:
        if node.kind != "compute":
            continue
        kind = _node_kind(graph, node, batch)
        if kind is not None and (node.module_fqn, kind) not in found:
            source = node.source.split(": ", 1)[0] if node.source else None
            found[(node.module_fqn, kind)] = Coupling(
                kind, node.module_fqn, node.op, node.module_type.rsplit(".", 1)[-1], source
            )
    for moe in graph.moes:
        found[(moe.fqn, "routing")] = Coupling("routing", moe.fqn, moe.fqn, "MoE")
    return tuple(found.values())


def _node_kind(graph: Graph, node: Node, batch: int | None) -> CouplingKind | None:
    if node.op in _BATCH_NORMS:
        at = _BATCH_NORMS[node.op]
        training = True if at is None else (node.args[at] if len(node.args) > at else False)
        return "batch_norm" if training is True else None
    if node.op in _PRODUCTS and batch is not None:
        operands = [graph.node(name) for name in node.inputs[:2]]
        activations = all(o.kind in ("compute", "input") for o in operands)
        out = node.out
        if activations and out is not None and out.shape[-2:] == (batch, batch):
            return "batch_product"
    return None


def loss_coupling(
    loss_fn: Callable[..., Any], output: Any, target: Any, batch: int
) -> tuple[Coupling, ...]:
    """The couplings of ``loss_fn(output, target)`` run once on meta tensors whose batch (dim
    0) is ``batch`` (pick one no other dim of the model has): each matrix product whose result
    is ``batch x batch``. Whatever the loss raises propagates (the caller names the file)."""
    mode = _Products(batch)
    with torch.no_grad(), mode:
        loss_fn(output, target)
    return tuple(Coupling("batch_product", "loss_fn", op, "", src) for op, src in mode.found)


def takes_gather(loss_fn: Callable[..., Any] | None) -> bool:
    """Whether ``loss_fn`` accepts a ``gather`` keyword (the model file's contract for a loss
    over the data-parallel ranks' global batch: ``loss_fn(output, target, *, gather=None)``)."""
    if loss_fn is None:
        return False
    try:
        params = inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):
        return False
    gather = params.get("gather")
    return gather is not None and gather.kind in (
        inspect.Parameter.KEYWORD_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    )


class _Products(TorchDispatchMode):
    """Records each matrix product (as aten dispatches it: mm, bmm) of a ``batch x batch``
    result, with the first line of the user's code that called it."""

    def __init__(self, batch: int) -> None:
        super().__init__()
        self.batch, self.found = batch, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = f"aten.{func.__name__}"
        if func.__name__ in ("mm.default", "bmm.default", "matmul.default"):
            tensors = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
            square = tuple(out.shape[-2:]) == (self.batch, self.batch)
            if square and all(self.batch in t.shape for t in tensors[:2]):
                self.found.append((name, _user_line()))
        return out


def _user_line() -> str | None:
    """``file:line`` of the innermost frame outside torch and this module."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace("\\", "/")
        if "/torch/" not in path and not path.endswith("ir/coupling.py"):
            return f"{path.rsplit('/', 1)[-1]}:{frame.lineno}"
    return None
