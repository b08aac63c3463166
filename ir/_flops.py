"""FLOPs per aten op at the traced shapes, forward and backward.

Rules (estimates the cost model builds on):
- matmul-like ops (linear, mm, addmm, bmm, baddbmm, matmul, grouped_mm of stacked experts, einsum
  of two operands, convolutions)
  count 2 FLOPs per multiply-add, from ``torch.utils.flop_counter``'s formulas where it has one for
  the op and by the same 2*M*N*K rule where it has none (``aten.linear``, ``aten.matmul``). Their
  backward is 2x forward: one product for the gradient w.r.t. the input, one for the weight.
- scaled dot-product attention counts its two products, without discounting the causal mask (as
  ``flop_counter`` does); its backward is the five products of ``flop_counter``'s backward formula
  (the scores are recomputed): 2.5x forward when the head dims of q and v are equal.
- views and aliases count 0; every other op counts 1 FLOP per output element (an elementwise
  assumption: a softmax or a norm does a few per element, a gather none), with a backward equal to
  its forward when the output is floating point and 0 otherwise (no gradient flows through it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten

# Ops whose output aliases (a view of) an input: no arithmetic, nothing new saved for backward.
VIEW_OPS = frozenset(
    {
        "view",
        "_unsafe_view",
        "view_as",
        "transpose",
        "permute",
        "expand",
        "expand_as",
        "t",
        "unsqueeze",
        "squeeze",
        "alias",
        "slice",
        "select",
        "split",
        "split_with_sizes",
        "chunk",
        "unbind",
        "narrow",
        "diagonal",
        "movedim",
        "as_strided",
        "unflatten",
        "detach",
        "lift_fresh_copy",
        "_assert_tensor_metadata",
        "getitem",
    }
)
# Views only when their input is already contiguous (otherwise they copy).
_VIEW_IF_CONTIGUOUS = frozenset({"reshape", "contiguous", "flatten"})
_VIEW_IF_SAME_DTYPE = frozenset({"to", "_to_copy", "type_as"})

_ATTENTION = frozenset(
    {
        "scaled_dot_product_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_cudnn_attention",
    }
)
_CONV = {
    "conv1d": False,
    "conv2d": False,
    "conv3d": False,
    "conv_transpose1d": True,
    "conv_transpose2d": True,
    "conv_transpose3d": True,
}


def op_name(target: Any) -> str:
    """The overload packet's short name: ``linear`` for ``aten.linear.default``."""
    if isinstance(target, torch._ops.OpOverload):
        return target._opname
    return getattr(target, "__name__", str(target))


def is_alias(target: Any, args: tuple, out: Any) -> bool:
    """Whether the op's output aliases its first input (meta values as arguments)."""
    name = op_name(target)
    if name in VIEW_OPS:
        return True
    src = args[0] if args else None
    if not isinstance(src, torch.Tensor):
        return False
    if name in _VIEW_IF_CONTIGUOUS:
        return src.is_contiguous()
    if name in _VIEW_IF_SAME_DTYPE:
        return isinstance(out, torch.Tensor) and out.dtype == src.dtype
    return False


def node_flops(target: Any, args: tuple, kwargs: dict, out: Any) -> tuple[int, int]:
    """(forward, backward) FLOPs of one op, given its meta arguments and meta output."""
    name = op_name(target)
    if name in _ATTENTION:
        return _attention_flops(*args[:3])
    matmul = _matmul_fwd(target, name, args, kwargs, out)
    if matmul is not None:
        return matmul, 2 * matmul
    if is_alias(target, args, out):
        return 0, 0
    outs = [t for t in _tensors(out)]
    fwd = sum(t.numel() for t in outs)
    bwd = sum(t.numel() for t in outs if t.is_floating_point() or t.is_complex())
    return fwd, bwd


def _matmul_fwd(target: Any, name: str, args: tuple, kwargs: dict, out: Any) -> int | None:
    if name == "linear":
        return 2 * out.numel() * args[1].shape[-1]
    if name == "matmul" or "grouped_mm" in name:
        # grouped_mm (experts' weights stacked (E, K, N), token rows sorted by expert, offsets):
        # each row meets one expert's (K, N) matrix, 2*K*N per row, like one matmul
        return 2 * out.numel() * args[0].shape[-1]
    if name in _CONV:
        conv = flop_registry[aten.convolution]
        return int(conv(args[0], args[1], None, None, None, None, _CONV[name], out_val=out))
    if name == "einsum":
        return _einsum_flops(args[0], args[1])
    packet = getattr(target, "overloadpacket", None)
    formula: Callable[..., int] | None = flop_registry.get(packet)
    if formula is None:
        return None
    return int(formula(*args, **kwargs, out_val=out))


def _attention_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
    # q: (..., heads, Lq, E), k: (..., kv_heads, Lk, E), v: (..., kv_heads, Lk, Ev); grouped kv
    # heads are broadcast to the query heads, so the products run over q's batch dims.
    batch = math.prod(q.shape[:-2])
    lq, e = q.shape[-2], q.shape[-1]
    lk, ev = k.shape[-2], v.shape[-1]
    fwd = 2 * batch * lq * lk * (e + ev)  # q @ k^T, then scores @ v
    bwd = 2 * batch * lq * lk * (3 * e + 2 * ev)  # scores again, dScores, dV, dQ, dK
    return fwd, bwd


def _einsum_flops(equation: str, operands: Any) -> int | None:
    """2 x the product of all index sizes, for a two-operand einsum without ellipsis."""
    inputs = equation.replace(" ", "").split("->")[0].split(",")
    if len(inputs) != 2 or "..." in equation or len(operands) != 2:
        return None
    sizes: dict[str, int] = {}
    for letters, t in zip(inputs, operands):
        sizes.update(zip(letters, t.shape))
    return 2 * math.prod(sizes.values())


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []
