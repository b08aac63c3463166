"""Trace an unmodified nn.Module on meta tensors and lower it to autopar's graph IR.

``torch.export.export(strict=False)`` in training mode gives an fx graph of high-level aten ops
(``aten.linear``, ``aten.layer_norm``, ``aten.scaled_dot_product_attention``...) with the meta value,
the module stack and the user's stack trace on every node; HF transformers models need it. The
lowering keeps that graph op by op and adds FLOPs, parameters read, source lines and layers.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import linecache
import operator
import os
import re
import sys
import sysconfig
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import replace
from itertools import chain
from typing import Any

import torch
from autopar.ir import _heads as heads
from autopar.ir._calls import export_with_calls, outermost
from autopar.ir._flops import is_alias, node_flops, op_name
from autopar.ir._fold import find_folds, folded, unfold
from autopar.ir._layers import (
    assign_layers,
    build_layers,
    dtype_name,
    layer_candidates,
    module_infos,
    type_name,
)
from autopar.ir._linear_like import as_linears, linear_types
from autopar.ir._moe import find_moes
from autopar.ir._positions import find_positions
from autopar.ir._saved import SavedBytes, Target, measure_saved
from autopar.ir.graph import Graph, Layer, LayerCalls, Node, NodeKind, Ref, TensorMeta
from torch import fx, nn
from torch.export.graph_signature import InputKind

from autopar.errors import UserError

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_IR_DIR = os.path.dirname(__file__) + os.sep
_STDLIB_DIR = sysconfig.get_paths()["stdlib"] + os.sep
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in ')
_PLACEHOLDER_KINDS: dict[InputKind, NodeKind] = {
    InputKind.PARAMETER: "param",
    InputKind.BUFFER: "buffer",
    InputKind.CONSTANT_TENSOR: "buffer",
}


class TraceError(UserError):
    """The model's forward cannot be traced; one line naming the module, node or source line."""


def trace(
    model: nn.Module,
    args: tuple,
    kwargs: dict | None = None,
    *,
    seq_len: int | None = None,
    dtype: torch.dtype | None = None,
    saved_for: Target = "cuda",
    fold: bool = True,
    autocast: bool = False,
) -> Graph:
    """Export ``model(*args, **kwargs)`` on meta tensors and lower it to a Graph.

    The model is traced in training mode (dropout and the like included); its modes are restored.

    ``seq_len`` overrides the sequence length read from the inputs (the second dim of a rank-2
    integer first input, i.e. token ids).

    ``dtype`` (e.g. ``torch.bfloat16``) traces at that compute dtype: floating parameters, buffers
    and inputs are cast on meta for the trace, as ``model.to(dtype)`` would, and restored after;
    every dtype in the Graph (node outputs, parameter bytes, saved bytes) is then the real one,
    including ops the model forces to fp32. ``None`` traces at the model's own dtypes.

    The bytes autograd saves for backward are measured per node and layer (``Node.saved_bytes``,
    ``Layer.saved_bytes``, ``Layer.saved_bytes_checkpointed``) by running the exported graph on meta
    under saved-tensor hooks; ``saved_for`` names the device type whose attention and dropout
    kernels the measurement follows (see ``ir._saved``); ``autocast`` measures what
    ``torch.autocast(dtype)`` over fp32 parameters saves instead of a model cast to ``dtype``
    (the emitted script's bf16 regime without FSDP2; ``ir._saved`` emulates autocast's casts).
    A trace at bf16 without ``autocast`` measures both: the cast model's figures in
    ``saved_bytes`` and autocast's in ``saved_bytes_autocast`` (nodes and layers), so a plan
    charges the regime its mesh trains in (``cost_model.precision``).

    ``fold``: trace a run of >= 3 identical blocks as two and replicate them in the IR
    (:mod:`ir._fold`; the same Graph up to node names, in a fraction of the time); the whole model
    is traced where that is not sound. ``False`` always traces the whole model.
    """
    kwargs = dict(kwargs or {})
    if "use_cache" in inspect.signature(model.forward).parameters:
        kwargs.setdefault("use_cache", False)
    with _cast(model, dtype):
        args, kwargs = _cast_inputs((tuple(args), kwargs), dtype)
        # a bf16 trace also measures what autocast over fp32 parameters saves (the regime of a
        # bf16 plan without FSDP2: cost_model.precision)
        both = not autocast and dtype == torch.bfloat16
        with heads.capture(model) as blocks:
            nodes, layers, calls = _traced(model, args, kwargs, saved_for, fold, autocast, both)
        modules = linear_types(module_infos(model), nodes)
        proofs = heads.prove(blocks)
        local_literals = heads.local_literals(model, proofs, nodes)
        dtensor_blocks = heads.dtensor_blocks(model, proofs, nodes)
        # read by block kind, whose key holds the dtypes the trace ran at: inside the cast
        fused_heads = heads.fused_heads(model, proofs)
        fused_blocks = heads.fused_blocks(model, blocks, proofs)
        grouped_kv = heads.grouped_kv(model, proofs)
        gqa_blocks = heads.gqa_blocks(model, blocks)
    batch_size, traced_seq_len = _batch_dims(args, kwargs)
    graph = Graph(
        nodes=tuple(nodes),
        modules=modules,
        layers=tuple(layers),
        batch_size=batch_size,
        seq_len=seq_len if seq_len is not None else traced_seq_len,
        root_type=type_name(model),
        saved_for=saved_for,
        local_literals=local_literals,
        dtensor_blocks=dtensor_blocks,
        fused_linears=heads.fused_linears(nodes, dtensor_blocks),
        fused_heads=fused_heads,
        fused_blocks=fused_blocks,
        grouped_kv=grouped_kv,
        gqa_blocks=gqa_blocks,
        positions=find_positions(nodes, traced_seq_len),
        calls=replace(calls, shared_state=_shared_state(model)),
    )
    return replace(graph, moes=find_moes(graph)) if _has_topk(nodes) else graph


def _shared_state(model: nn.Module) -> dict[str, str]:
    """Every other name of a tensor with several (a tied weight) -> the name the graph uses."""
    return {k: v for k, v in _canonical_state_names(model).items() if k != v}


def _has_topk(nodes: list[Node]) -> bool:
    return any(n.op.startswith("aten.topk") for n in nodes)


def _traced(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    saved_for: Target,
    fold: bool,
    autocast: bool = False,
    also_autocast: bool = False,
) -> tuple[list[Node], list[Layer], LayerCalls]:
    """Nodes, layers and layer calls of the model; repeated blocks traced once where that is
    sound (:mod:`ir._fold`), else the whole model."""
    folds = find_folds(model) if fold else []
    if folds:
        try:
            with folded(folds):
                nodes, layers, calls = _traced_whole(
                    model, args, kwargs, saved_for, autocast, also_autocast
                )
            for f in folds:
                nodes, layers = unfold(nodes, layers, f)
            return nodes, layers, calls
        except Exception:  # CannotFold, or a forward that needs every block: trace it whole
            pass
    return _traced_whole(model, args, kwargs, saved_for, autocast, also_autocast)


def _traced_whole(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    saved_for: Target,
    autocast: bool = False,
    also_autocast: bool = False,
) -> tuple[list[Node], list[Layer], LayerCalls]:
    """Nodes, layers and layer calls of the whole model; ``also_autocast``: the saved bytes
    under autocast too (``saved_bytes_autocast``), beside those of the trace's own regime."""
    candidates = layer_candidates(model)
    ep, calls = export_with_calls(
        model, outermost(candidates), lambda keep: _export(model, args, kwargs, keep)
    )
    nodes, state_fqn, aliases, routed = _lower(ep, model)
    layer_of = assign_layers(nodes, candidates)
    saved = _measure_or_none(ep, layer_of, saved_for, autocast, routed=routed.concrete)
    also = None
    if saved is not None and also_autocast:
        also = _measure_or_none(
            ep, layer_of, saved_for, True, "plans under autocast are charged the bf16 model's",
            routed=routed.concrete,
        )  # fmt: skip
    nodes = [_with_saved(n, saved, also) for n in _with_layers(nodes, layer_of)]
    nodes, folded = as_linears(model, nodes)  # FalconLinear's ``x @ w.T + b``: a linear
    layer_of = {k: v for k, v in layer_of.items() if k not in folded}
    layers = [
        replace(
            layer,
            saved_bytes=saved.per_layer[layer.fqn],
            saved_bytes_checkpointed=saved.checkpointed[layer.fqn],
            saved_bytes_autocast=None if also is None else also.per_layer[layer.fqn],
            saved_bytes_checkpointed_autocast=None
            if also is None
            else also.checkpointed[layer.fqn],
        )
        if saved is not None
        else replace(
            layer,
            saved_bytes=layer.activation_bytes,
            saved_bytes_checkpointed=layer.activation_bytes,
        )
        for layer in build_layers(model, nodes, layer_of, state_fqn, aliases)
    ]
    return nodes, layers, calls


def _with_saved(n: Node, saved: SavedBytes | None, autocast: SavedBytes | None = None) -> Node:
    """``n`` with its measured saved bytes (and under autocast, where measured too), and its
    backward FLOPs scaled by the share of its backward that autograd runs (frozen parameters,
    a frozen prefix: ``ir._saved``)."""
    if saved is None:
        return n
    share = saved.backward_share.get(n.name, 1.0)
    return replace(
        n,
        saved_bytes=saved.per_node.get(n.name, n.saved_bytes),
        saved_bytes_autocast=None if autocast is None else autocast.per_node.get(n.name, 0),
        bwd_flops=round(n.bwd_flops * share),
    )


def _measure_or_none(
    ep: torch.export.ExportedProgram,
    layer_of: dict[str, str],
    saved_for: Target,
    autocast: bool = False,
    fallback: str = "using the estimate",
    routed: Callable[[fx.Node], Any] | None = None,
) -> SavedBytes | None:
    """The measured saved bytes, or None (with a warning ending in ``fallback``) where the
    exported graph does not run eagerly on meta; the layers then keep the conservative estimate
    (``activation_bytes``, with and without checkpointing), or for the second, autocast pass of
    a bf16 trace the cast model's figures."""
    try:
        return measure_saved(ep, layer_of, saved_for, autocast=autocast, routed=routed)
    except Exception as e:  # an op without an eager meta kernel: estimate, do not fail the trace
        what = "under autocast " if autocast else ""
        warnings.warn(
            f"saved activations {what}could not be measured on meta ({type(e).__name__}: "
            f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); {fallback}",
            stacklevel=3,
        )
        return None


@contextlib.contextmanager
def at_dtype(model: nn.Module, inputs: Any, dtype: torch.dtype | None) -> Iterator[Any]:
    """The model cast to ``dtype`` as :func:`trace` casts it (restored on exit), yielding
    ``inputs`` cast alike: for other meta runs of the model that must see what the trace saw."""
    with _cast(model, dtype):
        yield _cast_inputs(inputs, dtype)


@contextlib.contextmanager
def _cast(model: nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """Cast floating parameters (in place, same Parameter objects) and buffers to ``dtype``;
    restore them on exit."""
    if dtype is None:
        yield
        return
    params = {id(p): p for p in model.parameters()}
    old_data = {i: p.data for i, p in params.items()}
    old_buffers = [
        (m, name, b)
        for m in model.modules()
        for name, b in m._buffers.items()
        if b is not None and b.is_floating_point()
    ]
    try:
        for p in params.values():
            if p.is_floating_point():
                p.data = p.data.to(dtype)
        for m, name, b in old_buffers:
            m._buffers[name] = b.to(dtype)
        yield
    finally:
        for i, p in params.items():
            p.data = old_data[i]
        for m, name, b in old_buffers:
            m._buffers[name] = b


def _cast_inputs(value: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, list | tuple):
        return type(value)(_cast_inputs(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_inputs(v, dtype) for k, v in value.items()}
    return value


def _export(
    model: nn.Module, args: tuple, kwargs: dict, keep: tuple[str, ...] = ()
) -> torch.export.ExportedProgram:
    """The export of the forward, with the call signatures of the modules ``keep`` names."""
    # On failure export prints a partial graph to stderr; the TraceError says it in one line, so
    # hold stderr back and replay it only on success (it may hold the model's warnings).
    held = io.StringIO()
    modes = {m: m.training for m in model.modules()}
    try:
        with contextlib.redirect_stderr(held):
            ep = torch.export.export(
                model.train(), args, kwargs, strict=False, preserve_module_call_signature=keep
            )
    except Exception as e:
        raise _trace_error(e, model) from e
    finally:
        for m, training in modes.items():
            m.training = training
    sys.stderr.write(held.getvalue())
    return ep


def _lower(
    ep: torch.export.ExportedProgram, model: nn.Module
) -> tuple[list[Node], dict[str, str], set[str], _RoutedSizes]:
    """IR nodes (layer not yet set), param/buffer node -> FQN, names of view nodes.

    A tied tensor (``head.weight = tok_emb.weight``) gets one node under its first FQN (the one
    ``named_parameters()`` keeps); export's duplicate placeholders are folded into it.
    """
    specs = {s.arg.name: s for s in ep.graph_signature.input_specs if hasattr(s.arg, "name")}
    canonical = _canonical_state_names(model)
    types_by_fqn = {fqn: type_name(m) for fqn, m in model.named_modules()}
    state_fqn: dict[str, str] = {}  # param/buffer node -> FQN
    node_of_state: dict[str, str] = {}  # FQN -> param/buffer node
    rename: dict[str, str] = {}  # folded duplicate placeholder -> the node kept
    param_nodes: set[str] = set()
    aliases: set[str] = set()
    routed = _RoutedSizes()
    nodes = []
    for n in ep.graph.nodes:
        routed.see(n)
        kind, op = _kind_op(n, specs)
        params: tuple[str, ...] = ()
        fwd = bwd = 0
        if n.op == "placeholder" and kind in ("param", "buffer"):
            fqn = canonical.get(specs[n.name].target, specs[n.name].target)
            if fqn in node_of_state:
                rename[n.name] = node_of_state[fqn]
                continue
            state_fqn[n.name], node_of_state[fqn] = fqn, n.name
            if kind == "param":
                param_nodes.add(n.name)
                params = (fqn,)
        elif kind == "compute":
            vals = fx.node.map_arg((n.args, n.kwargs), lambda a: routed.concrete(a))
            out = routed.concrete(n)
            fwd, bwd = node_flops(n.target, vals[0], vals[1], out)
            if is_alias(n.target, vals[0], out):
                aliases.add(n.name)
            inputs = (rename.get(a.name, a.name) for a in n.all_input_nodes)
            params = tuple(dict.fromkeys(state_fqn[i] for i in inputs if i in param_nodes))
        stack = _module_stack(n)
        nodes.append(
            Node(
                name=n.name,
                kind=kind,
                op=op,
                args=_convert(n.args, rename),
                kwargs=tuple(sorted((k, _convert(v, rename)) for k, v in n.kwargs.items())),
                outputs=_outputs(n, routed),
                module_stack=stack,
                module_type=types_by_fqn.get(stack[-1] if stack else "", type_name(model)),
                layer="",
                fwd_flops=fwd,
                bwd_flops=bwd,
                params=params,
                source=_source(n.meta.get("stack_trace")),
            )
        )
    return nodes, state_fqn, aliases, routed


def _canonical_state_names(model: nn.Module) -> dict[str, str]:
    """Every parameter/buffer FQN -> the first FQN of the same tensor."""
    first: dict[int, str] = {}
    named = chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    )
    return {fqn: first.setdefault(id(t), fqn) for fqn, t in named}


def _kind_op(n: fx.Node, specs: dict) -> tuple[NodeKind, str]:
    if n.op == "placeholder":
        kind = _PLACEHOLDER_KINDS.get(specs[n.name].kind, "input")
        return kind, kind
    if n.op == "output":
        return "output", "output"
    if n.op == "get_attr":  # a submodule or constant of a higher-order op
        return "buffer", "buffer"
    if n.target is operator.getitem:
        return "compute", "getitem"
    if isinstance(n.target, torch._ops.OpOverload):
        return "compute", str(n.target)
    return "compute", getattr(n.target, "__name__", str(n.target))


def _with_layers(nodes: list[Node], layer_of: dict[str, str]) -> list[Node]:
    """Set ``layer`` on every node: params, buffers and inputs take their first reader's layer;
    the output node takes its producer's."""
    first_reader: dict[str, str] = {}
    for n in nodes:
        if n.name in layer_of:
            for i in n.inputs:
                first_reader.setdefault(i, layer_of[n.name])
    fallback = next(iter(layer_of.values()), "")
    out = []
    for n in nodes:
        if n.name in layer_of:
            layer = layer_of[n.name]
        elif n.kind == "output":
            producers = [layer_of[i] for i in n.inputs if i in layer_of]
            layer = producers[-1] if producers else fallback
        else:
            layer = first_reader.get(n.name, fallback)
        out.append(replace(n, layer=layer))
    return out


def _module_stack(n: fx.Node) -> tuple[str, ...]:
    stack = n.meta.get("nn_module_stack") or {}
    paths = (_norm_path(path) for path, _ in stack.values())
    return tuple(p for p in paths if p)


def _norm_path(path: str) -> str:
    """``L['self'].blocks[0].attn`` (older torch) or ``blocks.0.attn`` -> ``blocks.0.attn``."""
    path = re.sub(r"^(L\['self'\]|L__self__|self)", "", path)
    path = re.sub(r"\._modules\['([^']*)'\]|\['([^']*)'\]|\[(\d+)\]", r".\1\2\3", path)
    return path.strip(".")


class _RoutedSizes:
    """Sizes that depend on routing decisions, taken at balanced routing.

    A mixture-of-experts block written as people write it (``for i, e in enumerate(experts):
    idx, nth = torch.where(top_k_index == i); out[idx] += w[idx, nth, None] * e(x[idx])``) traces
    with data-dependent (unbacked) sizes: how many tokens each expert gets. Such a size that
    follows a ``topk`` in the graph is taken as the balanced share ``ceil(tokens * k / choices)``
    of the nearest preceding ``topk`` (over ``choices`` in its last dim, ``tokens`` = the other
    elements), the assumption the cost model makes about routing too. A data-dependent size with
    no ``topk`` before it stays a trace error.
    """

    def __init__(self) -> None:
        self.share: int | None = None
        self.sizes: dict[Any, int] = {}

    def see(self, n: fx.Node) -> None:
        """Note a ``topk`` (its balanced share), and give its share to every new unbacked size."""
        if n.op == "call_function" and op_name(n.target) == "topk":
            scores = n.args[0].meta.get("val")
            k = n.args[1] if len(n.args) > 1 else n.kwargs.get("k")
            if isinstance(scores, torch.Tensor) and isinstance(k, int) and scores.dim() >= 1:
                choices = int(scores.shape[-1])
                tokens = scores.numel() // max(choices, 1)
                self.share = -(-tokens * k // max(choices, 1))
        if self.share is None:
            return
        for v in _flat(n.meta.get("val")):
            dims = v.shape if isinstance(v, torch.Tensor) else [v]
            for d in dims:
                if isinstance(d, torch.SymInt):
                    for sym in d.node.expr.free_symbols:
                        self.sizes.setdefault(sym, self.share)

    def size(self, d: Any) -> int | None:
        if isinstance(d, int):
            return d
        if isinstance(d, torch.SymInt):
            expr = d.node.expr
            expr = expr.xreplace(self.sizes) if hasattr(expr, "xreplace") else expr
            if not getattr(expr, "free_symbols", None):
                return int(expr)
        return None

    def _tensor(self, val: Any) -> Any:
        if isinstance(val, torch.Tensor) and not all(isinstance(d, int) for d in val.shape):
            shape = [self.size(d) for d in val.shape]
            if None not in shape:
                return torch.empty(shape, dtype=val.dtype, device="meta")
        return val

    def concrete(self, a: fx.Node) -> Any:
        """The node's meta value with routed sizes made concrete (new meta tensors)."""
        val = a.meta.get("val")
        if isinstance(val, torch.SymInt):
            got = self.size(val)
            return val if got is None else got
        if isinstance(val, list | tuple):
            return type(val)(self._tensor(v) for v in val)
        return self._tensor(val)


def _outputs(n: fx.Node, routed: _RoutedSizes | None = None) -> tuple[TensorMeta | None, ...]:
    val = n.meta.get("val")
    if n.op == "output":
        val = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in _flat(n.args)]
    vals = val if isinstance(val, list | tuple) else [val]
    return tuple(_tensor_meta(v, n, routed) for v in vals)


def _tensor_meta(v: Any, n: fx.Node, routed: _RoutedSizes | None = None) -> TensorMeta | None:
    if not isinstance(v, torch.Tensor):
        return None
    shape = [routed.size(d) if routed is not None else d for d in v.shape]
    if all(isinstance(d, int) for d in shape):
        return TensorMeta(tuple(shape), dtype_name(v.dtype))
    if not all(isinstance(d, int) for d in v.shape):
        raise TraceError(
            f"model forward cannot be traced at {_where(_module_stack(n))} "
            f"({_source(n.meta.get('stack_trace')) or 'unknown source'}): node {n.name} "
            f"({n.target}) has a data-dependent shape {tuple(v.shape)}; make shapes depend on "
            f"input shapes or config only"
        )
    return TensorMeta(tuple(v.shape), dtype_name(v.dtype))


def _flat(value: Any) -> Iterator[Any]:
    if isinstance(value, list | tuple):
        for v in value:
            yield from _flat(v)
    else:
        yield value


def _convert(value: Any, rename: dict[str, str]) -> Any:
    """fx args -> IR args: Refs for nodes, tuples for lists, strings for torch objects."""
    if isinstance(value, fx.Node):
        return Ref(rename.get(value.name, value.name))
    if isinstance(value, list | tuple):
        return tuple(_convert(v, rename) for v in value)
    if isinstance(value, dict):
        return {k: _convert(v, rename) for k, v in value.items()}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return value.node.maybe_as_int() if isinstance(value, torch.SymInt) else str(value)
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    return str(value)


def _is_user_file(path: str) -> bool:
    """Whether a frame's file is model code: not torch, not the stdlib, not this package."""
    if path.startswith((_TORCH_DIR, _IR_DIR, "<")):
        return False
    return not path.startswith(_STDLIB_DIR) or "-packages" in path


def _user_frame(frames: list[tuple[str, int, str]]) -> tuple[str, int, str] | None:
    """The innermost frame outside torch and the stdlib, preferring code outside site-packages."""
    user = [f for f in frames if _is_user_file(f[0])]
    own = [f for f in user if "site-packages" not in f[0]]
    return (own or user or [None])[-1]


def _source(stack_trace: str | None) -> str | None:
    if not stack_trace:
        return None
    frames = []
    lines = stack_trace.splitlines()
    for i, line in enumerate(lines):
        m = _FRAME.match(line)
        if m:
            code = lines[i + 1] if i + 1 < len(lines) and not _FRAME.match(lines[i + 1]) else ""
            path, lineno = m["file"], int(m["line"])
            frames.append((path, lineno, code or linecache.getline(path, lineno)))
    return _format_frame(_user_frame(frames))


def _format_frame(frame: tuple[str, int, str] | None) -> str | None:
    if frame is None:
        return None
    path, line, code = frame
    return f"{os.path.basename(path)}:{line}: {code.strip()}"


def _where(stack: tuple[str, ...]) -> str:
    return stack[-1] if stack else "the root module"


def _trace_error(e: Exception, model: nn.Module) -> TraceError:
    """One line naming the module and user source line where tracing failed, and what to do."""
    fqns = {id(m): fqn for fqn, m in model.named_modules()}
    frames = _model_frames(e, fqns)
    fqn = next(
        (fqns[id(f.f_locals["self"])] for f, _ in reversed(frames) if _self_in(f, fqns)), None
    )
    user = _user_frame([(f.f_code.co_filename, line, "") for f, line in frames])
    src = None
    if user is not None:
        src = _format_frame((user[0], user[1], linecache.getline(user[0], user[1])))
    where = "the root module" if fqn == "" else (fqn or "an unknown module")
    if _is_data_dependent(e):
        reason = "data-dependent control flow; make the branch depend on shapes or config only"
    else:
        msg = str(e).strip().splitlines()
        reason = (
            f"{type(e).__name__}: {msg[0] if msg else ''}; make forward run on meta tensors "
            f"with these example inputs (no .item(), no real data, matching shapes)"
        )
    return TraceError(
        f"model forward cannot be traced at {where} ({src or 'unknown source'}): {reason}"
    )


def _model_frames(
    e: BaseException | None, fqns: dict[int, str]
) -> list[tuple[types.FrameType, int]]:
    """(frame, line) of the traceback from the first call into the model onwards, taken from the
    innermost exception of the chain that went through the model."""
    chain: list[BaseException] = []
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for exc in reversed(chain):
        frames = []
        tb = exc.__traceback__
        while tb is not None:
            frames.append((tb.tb_frame, tb.tb_lineno))
            tb = tb.tb_next
        start = next((i for i, (f, _) in enumerate(frames) if _self_in(f, fqns)), None)
        if start is not None:
            return frames[start:]
    return []


def _self_in(frame: types.FrameType, fqns: dict[int, str]) -> bool:
    return id(frame.f_locals.get("self")) in fqns


def _is_data_dependent(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e}".lower()
    return "datadependent" in text or "data-dependent" in text or "data dependent" in text


def _batch_dims(args: tuple, kwargs: dict) -> tuple[int, int | None]:
    first = next(
        (v for v in _flat(list(args) + list(kwargs.values())) if isinstance(v, torch.Tensor)), None
    )
    if first is None or first.dim() == 0:
        return 1, None
    ids = first.dim() == 2 and not (first.is_floating_point() or first.is_complex())
    return int(first.shape[0]), int(first.shape[1]) if ids else None
