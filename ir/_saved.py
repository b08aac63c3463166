"""Bytes autograd saves for backward, measured per node and per layer on meta tensors.

The exported program's graph (``ep.graph_module``: parameters, buffers and constants are its
leading placeholders) is run node by node by an :class:`torch.fx.Interpreter` on meta tensors
(no real data), with parameters requiring grad as the model's do (a frozen parameter,
``requires_grad=False``, does not: autograd saves nothing for a frozen prefix of the model), inside
``torch.autograd.graph.saved_tensors_hooks``.
The pack hook sees every tensor autograd saves and charges it to the fx node that is executing, so
to that node's layer. User inputs (the batch) need no grad, as in training.

Counting rules:
- every saved tensor is counted once, by storage: a view and its base, or the same tensor saved by
  two ops, count once (the storage's bytes: what the saved view keeps alive), charged to the first
  node that saves it. On meta every storage has a null data pointer, so the identity is the storage
  object (``untyped_storage()._cdata``, shared by views); each counted tensor is kept alive until the
  end so no identity is reused.
- storages of parameters, buffers and lifted constants are excluded (a weight saved by a linear,
  ``weight.t()`` saved by ``mm``, a slice of a causal-mask buffer saved by ``masked_fill``).
- ``saved_bytes_checkpointed`` of a layer: with the layer wrapped in (non-reentrant) activation
  checkpointing autograd saves nothing inside it; only the layer's inputs stay alive, held by the
  checkpoint for the recompute. They are the distinct storages of the non-parameter tensors that
  the layer's nodes read and that are produced outside the layer (hidden states, masks, rotary
  cos/sin, token ids), at their storage size. An input shared by several layers (rotary cos/sin)
  is counted in each: an upper bound by a few small tensors.

The sum over layers of ``saved_bytes`` is what one microbatch's forward keeps until its backward.

The same run tells which nodes autograd runs backward for (``backward_share``): none for a node
whose output needs no gradient (every node of a frozen prefix), and half a matmul's backward where
one of its operands needs no gradient (a frozen weight: only the input's gradient; the first
trainable matmul after a frozen prefix: only the weight's). The trace scales the nodes' backward
FLOPs by it.

Where the meta device would not run what the target runs, ops are replaced by the ones the
target's kernels use (``target``):
- ``scaled_dot_product_attention``: on meta the dispatcher picks the math path (it saves the
  s x s attention probabilities, even upcast to fp32 for bf16); CPU and CUDA training run a fused
  kernel (flash / memory-efficient) that saves q, k, v, the output and the fp32 logsumexp
  (b x heads x s), plus on CUDA an RNG seed/offset of a few bytes, and the attention mask where
  one is given (a bool mask converted to a float bias of the mask's shape, a new tensor per call). The interpreter runs
  ``_scaled_dot_product_flash_attention_for_cpu`` instead, which saves exactly those (a grouped
  k/v unexpanded where ``enable_gqa`` is set).
  For ``target="cpu"`` with ``dropout_p > 0`` the original op runs: CPU falls back to math there.
- ``autocast=True``: what ``torch.autocast(bf16)`` over fp32 parameters saves (the emitted
  script's bf16 regime where FSDP2 does not apply: DDP, TP or a pipeline alone, one rank), on a
  graph exported at bf16. Autocast does not act on meta tensors, so the interpreter applies its
  policy itself: floating parameters, buffers and inputs are fp32; the ops autocast runs in
  bf16 (linear, matmul, bmm, addmm, baddbmm, convolutions, SDPA) get bf16 copies of their fp32
  inputs, a new copy per call, as autocast makes them (each copy is what the op saves; a copy of
  a parameter is excluded: the memory model counts autocast's weight copies as buffers); for
  ``target="cuda"`` the ops autocast runs in fp32 there (softmax, log-softmax, layer norm, norms,
  pow, exp, log, sum, ...) get fp32 copies of bf16 inputs; every other op runs on what it gets,
  so the residual stream stays fp32, as it does under autocast. Casts the traced code bakes in
  (``.to(torch.bfloat16)`` where the trace saw bf16) stay as traced.
- ``rms_norm`` (``target="cuda"``: ``nn.RMSNorm``, ``F.rms_norm``): CUDA runs torch's fused kernel
  (``_fused_rms_norm``), which saves its input and the fp32 reciprocal RMS per row (and the
  weight); CPU and meta decompose it, saving an fp32 copy of the input and the normalized
  tensor besides. The interpreter saves what the fused kernel saves for CUDA. Norms written
  as their ops (HF's ``LlamaRMSNorm``) are measured as written: CUDA runs them op by op too.
- ``dropout`` (``target="cuda"``): CPU (and meta) dropout multiplies by a mask of the input's dtype
  and saves that mask (2 bytes an element in bf16); CUDA runs ``native_dropout``, which saves a
  1-byte bool mask. The interpreter runs ``native_dropout`` for CUDA.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import fx
from torch.export.graph_signature import InputKind
from torch.utils._pytree import tree_leaves, tree_map

aten = torch.ops.aten

Target = Literal["cuda", "cpu"]
_STATE_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


@dataclass
class SavedBytes:
    """Measured bytes saved for backward."""

    per_node: Counter[str] = field(default_factory=Counter)
    """fx node name -> bytes of the storages first saved while that node ran."""
    per_layer: Counter[str] = field(default_factory=Counter)
    """layer FQN -> bytes saved by its nodes, without checkpointing."""
    checkpointed: Counter[str] = field(default_factory=Counter)
    """layer FQN -> bytes of its inputs (what stays saved with the layer checkpointed)."""
    backward_share: dict[str, float] = field(default_factory=dict)
    """fx node name -> the share of its backward that autograd runs, where not all of it: 0 where
    its output needs no gradient (a frozen prefix), 1/2 for a matmul one of whose two operands
    needs none (a frozen weight: no weight gradient; an input that needs no gradient)."""


def measure_saved(
    ep: torch.export.ExportedProgram,
    layer_of: dict[str, str],
    target: Target = "cuda",
    *,
    autocast: bool = False,
    routed: Callable[[fx.Node], Any] | None = None,
) -> SavedBytes:
    """Run ``ep`` on meta under saved-tensor hooks; see the module docstring for the rules
    (``autocast``: under an emulated ``torch.autocast(bf16)`` over fp32 state).

    ``layer_of`` maps fx node names to layer FQNs (nodes absent from it belong to no layer: their
    saved bytes still appear in ``per_node``). ``routed``: a node -> its meta value at the sizes
    the trace took (``ir.trace``'s balanced routing); an op whose size depends on the data (the
    rows ``torch.where`` routes to an expert), which meta cannot run, yields that value, and the
    ops after it run on those sizes.
    """
    gm = ep.graph_module
    specs = [s for s in ep.graph_signature.input_specs if hasattr(s.arg, "name")]
    kinds = {s.arg.name: s.kind for s in specs}
    frozen = {
        s.arg.name
        for s in specs
        if s.kind is InputKind.PARAMETER
        and getattr(ep.state_dict.get(s.target), "requires_grad", True) is False
    }
    interp = _Interpreter(gm, layer_of, target, autocast, routed)
    args = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        trainable = kinds.get(n.name) is InputKind.PARAMETER and n.name not in frozen
        value = _meta_like(n.meta.get("val"), requires_grad=trainable, fp32=autocast)
        if kinds.get(n.name) in _STATE_KINDS:
            interp.exclude(value)
        args.append(value)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(interp.pack, _unpack):
        interp.run(*args)
    return interp.result


def _meta_like(val: Any, requires_grad: bool, fp32: bool = False) -> Any:
    """A fresh meta tensor with ``val``'s shape, strides and dtype (``val`` itself if not one;
    ``fp32``: a low-precision floating dtype becomes fp32)."""
    if not isinstance(val, torch.Tensor):
        return val
    dtype = val.dtype
    if fp32 and dtype in (torch.bfloat16, torch.float16):
        dtype = torch.float32
    t = torch.empty_strided(val.shape, val.stride(), dtype=dtype, device="meta")
    return t.requires_grad_(requires_grad and (t.is_floating_point() or t.is_complex()))


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


# matmuls and convolutions whose backward is one product per operand (the gradient of each)
_MATMUL_OPERANDS = {
    aten.linear.default: (0, 1),
    aten.mm.default: (0, 1),
    aten.bmm.default: (0, 1),
    aten.matmul.default: (0, 1),
    aten.addmm.default: (1, 2),
    aten.baddbmm.default: (1, 2),
    aten.conv1d.default: (0, 1),
    aten.conv2d.default: (0, 1),
    aten.conv3d.default: (0, 1),
    aten.convolution.default: (0, 1),
    aten.conv_transpose1d.default: (0, 1),
    aten.conv_transpose2d.input: (0, 1),
    aten.conv_transpose3d.input: (0, 1),
}


def _needs_grad(value: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(value))


def _backward_share(target: Any, args: tuple, out: Any) -> float:
    """The share of a node's backward that autograd runs (see ``SavedBytes.backward_share``)."""
    if not _needs_grad(out):
        return 0.0
    if target is aten.einsum.default and len(args) > 1:  # one product per operand's gradient
        return sum(map(_needs_grad, args[1])) / max(1, len(args[1]))
    operands = _MATMUL_OPERANDS.get(target)
    if operands is None or len(args) <= max(operands):
        return 1.0
    return sum(_needs_grad(args[i]) for i in operands) / len(operands)


def _model_dtype(value: Any) -> Any:
    return torch.float32 if value is torch.bfloat16 else value


# autocast's op lists (torch/csrc/autograd/autocast_mode.cpp), the ops models use
_AUTOCAST_LOW = {
    aten.linear.default,
    aten.matmul.default,
    aten.mm.default,
    aten.bmm.default,
    aten.addmm.default,
    aten.baddbmm.default,
    aten.addbmm.default,
    aten.conv1d.default,
    aten.conv2d.default,
    aten.conv3d.default,
    aten.convolution.default,
    aten.scaled_dot_product_attention.default,
}
_AUTOCAST_FP32_CUDA = {
    aten.softmax.int,
    aten._softmax.default,
    aten.log_softmax.int,
    aten._log_softmax.default,
    aten.layer_norm.default,
    aten.native_layer_norm.default,
    aten.group_norm.default,
    aten.rms_norm.default,
    aten.pow.Tensor_Scalar,
    aten.pow.Tensor_Tensor,
    aten.exp.default,
    aten.log.default,
    aten.rsqrt.default,
    aten.reciprocal.default,
    aten.sum.dim_IntList,
    aten.sum.default,
    aten.prod.default,
    aten.cumsum.default,
    aten.norm.Scalar,
    aten.softplus.default,
    aten.cross_entropy_loss.default,
    aten.nll_loss_nd.default,
    aten.mse_loss.default,
}


_DATA_DEPENDENT = {
    aten.where.default,
    aten.nonzero.default,
    aten.nonzero_numpy.default,
    aten.masked_select.default,
}
"""ops whose output size depends on the data, which meta cannot run (``torch.where(cond)``,
one tensor per dim of its indices)."""


class _Interpreter(fx.Interpreter):
    def __init__(
        self,
        gm: fx.GraphModule,
        layer_of: dict[str, str],
        target: Target,
        autocast: bool = False,
        routed: Callable[[fx.Node], Any] | None = None,
    ) -> None:
        super().__init__(gm)
        self.layer_of = layer_of
        self.target = target
        self.autocast = autocast
        self.routed = routed
        self.current: fx.Node | None = None
        self.seen: set[int] = set()  # storage identities already counted or excluded
        self.keep: list[torch.Tensor] = []  # alive until the end: storage identities stay unique
        self.state: set[int] = set()  # storage identities of parameters, buffers, constants
        self.inputs_seen: dict[str, set[int]] = {}  # layer -> storages of its inputs counted
        self.result = SavedBytes()

    def exclude(self, value: Any) -> None:
        for t in tree_leaves(value):
            if isinstance(t, torch.Tensor):
                self.seen.add(t.untyped_storage()._cdata)
                self.state.add(t.untyped_storage()._cdata)
                self.keep.append(t)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in self.seen and self.current is not None:
            self.seen.add(storage._cdata)
            self.keep.append(t)
            self.result.per_node[self.current.name] += storage.nbytes()
            layer = self.layer_of.get(self.current.name)
            if layer is not None:
                self.result.per_layer[layer] += storage.nbytes()
        return t

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        layer = self.layer_of.get(n.name) if n.op not in ("placeholder", "output") else None
        if layer is not None:
            self._count_inputs(n, layer)
        out = super().run_node(n)
        if n.op == "call_function":
            share = _backward_share(n.target, self.fetch_args_kwargs_from_env(n)[0], out)
            if share != 1.0:
                self.result.backward_share[n.name] = share
        return out

    def _count_inputs(self, n: fx.Node, layer: str) -> None:
        counted = self.inputs_seen.setdefault(layer, set())
        for m in n.all_input_nodes:
            if self.layer_of.get(m.name) == layer or m.op == "get_attr":
                continue
            for t in tree_leaves(self.env[m]):
                if not isinstance(t, torch.Tensor):
                    continue
                storage = t.untyped_storage()
                if storage._cdata in counted or storage._cdata in self.state:
                    continue
                counted.add(storage._cdata)
                self.keep.append(t)
                self.result.checkpointed[layer] += storage.nbytes()

    def _cast(self, value: Any, src: torch.dtype, dst: torch.dtype) -> Any:
        """``value`` with its ``src`` floating tensors copied to ``dst`` (autocast's casts); a
        copy of a parameter, buffer or constant is excluded like its original."""
        if isinstance(value, tuple | list):
            return type(value)(self._cast(v, src, dst) for v in value)
        if not isinstance(value, torch.Tensor) or value.dtype != src:
            return value
        out = value.to(dst)
        if value.untyped_storage()._cdata in self.state:
            self.exclude(out)
        return out

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if self.autocast and target is aten._assert_tensor_metadata.default:
            # export's check of a traced dtype: under autocast a tensor the trace saw in bf16
            # may be fp32 (the model's dtype) or bf16 (a matmul's output), so it is not checked
            return None
        if self.autocast:
            # the trace's bf16 is the model's dtype, fp32 in the autocast run: a cast to it
            # (``x.to(input_dtype)``), a factory's dtype, a dtype assertion
            args, kwargs = tree_map(_model_dtype, (args, kwargs))
            pair = None
            if target in _AUTOCAST_LOW:
                pair = (torch.float32, torch.bfloat16)
            elif self.target == "cuda" and target in _AUTOCAST_FP32_CUDA:
                pair = (torch.bfloat16, torch.float32)
            if pair is not None:
                args = self._cast(args, *pair)
                kwargs = {k: self._cast(v, *pair) for k, v in kwargs.items()}
        if target is aten.scaled_dot_product_attention.default:
            return self._sdpa(*args, **kwargs)
        if target in _DATA_DEPENDENT and self.routed is not None and self.current is not None:
            value = self.routed(self.current)  # meta cannot run it: the sizes the trace took
            if all(_sized(v) for v in tree_leaves(value) if isinstance(v, torch.Tensor)):
                return tree_map(_fresh_meta, value)
        if target is aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            # HF's stacked experts under autocast: fp32 inputs, which the meta kernel refuses
            return _MetaGroupedMM.apply(*_grouped_mm_args(*args, **kwargs))
        if target is aten.rms_norm.default and self.target == "cuda":
            return _FusedRMSNorm.apply(*_rms_norm_args(*args, **kwargs))
        if target is aten.dropout.default and self.target == "cuda":
            x, p, train = args
            if train and 0 < p < 1 and x.numel() > 0:
                return aten.native_dropout.default(x, p, train)[0]
        return super().call_function(target, args, kwargs)

    def _sdpa(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        *,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        fused = (
            q.dim() == k.dim() == v.dim() == 4
            and q.size(-1) == k.size(-1) == v.size(-1)
            and q.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
            and (q.size(1) == k.size(1) or enable_gqa)
            and not (self.target == "cpu" and dropout_p > 0)
        )
        if not fused:
            return aten.scaled_dot_product_attention.default(
                q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
            )
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            # as sdpa does before choosing a kernel: a float bias, a new tensor on every call
            bias = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device)
            attn_mask = bias.masked_fill_(attn_mask.logical_not(), float("-inf"))
        out, _ = aten._scaled_dot_product_flash_attention_for_cpu.default(
            q, k, v, 0.0, is_causal, attn_mask=attn_mask, scale=scale
        )
        return out


def _sized(t: torch.Tensor) -> bool:
    """Every size of ``t`` known (none left data-dependent)."""
    return all(isinstance(d, int) for d in t.shape)


def _fresh_meta(v: Any) -> Any:
    """A new meta tensor like ``v`` (a tensor), else ``v``."""
    if not isinstance(v, torch.Tensor):
        return v
    return torch.empty(tuple(v.shape), dtype=v.dtype, device="meta")


def _grouped_mm_args(
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple:
    return a, b, offs, bias, out_dtype


class _MetaGroupedMM(torch.autograd.Function):
    """``aten._grouped_mm`` on meta at a dtype its meta kernel refuses: it follows the CUDA
    kernel (bf16 only), where the CPU kernel also takes fp32 and autocast leaves the op alone (no
    autocast kernel), so HF's stacked experts run it at fp32 under autocast over fp32 weights.
    The output's shape from a bf16 call, in the dtype the real kernel gives; saved for backward
    what the op's autograd saves: both operands and the offsets. Its backward is never run."""

    @staticmethod
    def forward(ctx, a, b, offs, bias, out_dtype):  # type: ignore[override]
        with torch.no_grad():
            low = (x if x is None else x.to(torch.bfloat16) for x in (a, b, bias))
            a16, b16, bias16 = low
            out = aten._grouped_mm.default(a16, b16, offs, bias16).to(out_dtype or a.dtype)
        ctx.save_for_backward(*(t for t in (a, b, offs) if t is not None))
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        raise NotImplementedError("a meta measurement, never differentiated")


def _rms_norm_args(
    x: torch.Tensor,
    normalized_shape: list[int],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> tuple:
    return x, weight, tuple(normalized_shape), eps


class _FusedRMSNorm(torch.autograd.Function):
    """``rms_norm`` as CUDA's fused kernel runs it under autograd: the output computed without
    recording its steps, and saved for backward only the input, the weight and the reciprocal RMS
    per row (fp32 for low-precision inputs, as the kernel accumulates). Run on meta to measure
    what is saved; its backward is never run."""

    @staticmethod
    def forward(ctx, x, weight, normalized_shape, eps):  # type: ignore[override]
        with torch.no_grad():
            out = aten.rms_norm.default(x, list(normalized_shape), weight, eps)
        acc = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype
        rows = (*x.shape[: x.dim() - len(normalized_shape)], *([1] * len(normalized_shape)))
        ctx.save_for_backward(x, weight, x.new_empty(rows, dtype=acc))
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        raise NotImplementedError("measured on meta only: the saved tensors, not the backward")
