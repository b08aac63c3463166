"""Head counts an attention block spells in its views, proven local by running it at local shapes.

Reference attention code sizes its views from module attributes: ``x.view(b, t, self.n_head,
self.head_dim)``, ``y.reshape(b, t, self.n_head * self.head_dim)``, HF's ``repeat_kv``
``expand(b, kv_heads, n_rep, t, d)``. The trace records those sizes as literals, so the layout
rules cannot tell ``self.n_head`` (which the emitted program divides by tp, ``MODULE_ATTRS``) from
a size read off a tensor's shape (already local at run time) or a constant in the code (wrong on
local heads).

This module settles it by provenance: a block whose direct ``nn.Linear`` children feed views is
run twice on meta with its inputs as the trace saw them, once at full shapes and once as a
Megatron pair leaves it at tp (every linear but the last called with ``out_features / tp``, the
last with ``in_features / tp``, its head-count attributes divided by tp exactly as the planner's
``module_attrs`` divides them), recording every ``view``/``reshape``/``expand`` it calls. Where
the local run completes with the full run's output shape and the same sequence of calls, each
literal of the local run is what that call computes on local heads; :func:`local_literals` maps
them onto the traced nodes (name -> tp -> local literal) and the layout rules accept a sharded
view whose local literal is the local size (``planner.layouts``). A constant in the code stays
the same in both runs (or the local run fails): refused as before. One proof per block kind
(structurally identical blocks share it), a few meta forwards of one block per degree.

Fewer kv heads than tp (multi-query attention's one, grouped-query attention's few, tp a
multiple of them): where the Megatron run fails at a degree, the block runs again with its kv
linears computing one head each (:func:`_grouped`) and its head counts as :func:`local_attrs`
gives them (query heads divided by tp, kv heads 1, query heads per kv head the local query
heads), as Megatron replicates kv heads: the query heads local, every rank holding the kv head
its query heads read (``planner.layouts.RP`` for one kv head, the style
``colwise_gather_heads``; ``K<d>`` for several, ``colwise_kv_heads``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from autopar.ir.graph import Node
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

HEAD_ATTRS = (
    "n_head",
    "n_heads",
    "num_heads",
    "num_attention_heads",
    "num_key_value_heads",
    "n_kv_heads",
    "n_kv_head",
    "num_kv_heads",
)
"""int attributes the emitted program divides by tp on a module whose linears are colwise."""
KV_ATTRS = ("num_key_value_heads", "n_kv_heads", "n_kv_head", "num_kv_heads")
"""the kv head counts among :data:`HEAD_ATTRS`."""
GROUP_ATTRS = ("n_rep", "num_key_value_groups", "num_kv_groups")
"""query heads per kv head: unchanged by a Megatron pair, a rank's local query heads where its
kv projections run grouped (:func:`local_attrs`)."""

_SIZED = {
    torch.Tensor.view: "view",
    torch.Tensor.reshape: "view",
    torch.reshape: "view",
    torch.Tensor.expand: "expand",
    torch.Tensor.unflatten: "unflatten",
    torch.unflatten: "unflatten",
    torch.Tensor.split: "split",
    torch.split: "split",
    torch.Tensor.repeat_interleave: "repeat",
    torch.repeat_interleave: "repeat",
}
_GRAPH_OPS = {
    "view": "view", "reshape": "view", "_unsafe_view": "view", "expand": "expand",
    "unflatten": "unflatten", "split_with_sizes": "split", "repeat_interleave": "repeat",
}  # fmt: skip
_MAX_TP = 64

Record = tuple[str, tuple[int, ...]]


def _head_attrs(m: nn.Module) -> dict[str, int]:
    return {k: v for k, v in vars(m).items() if k in HEAD_ATTRS and type(v) is int and v > 1}


def _count_attrs(m: nn.Module) -> dict[str, int]:
    """Head counts, and query heads per kv head where the block also names its head dim and
    holds three linears or more (HF Llama's ``num_key_value_groups``, its views sized ``-1``)."""
    counts = _head_attrs(m)
    groups = {k: v for k, v in vars(m).items() if k in GROUP_ATTRS and type(v) is int and v > 1}
    if counts or (groups and type(getattr(m, "head_dim", None)) is int and len(_linears(m)) > 2):
        counts.update(groups)
    return counts


def local_attrs(attrs: dict[str, int], tp: int, kv_heads: int | None = None) -> dict[str, int]:
    """The head-count attributes one rank's block holds at ``tp`` (those that change): under a
    Megatron pair every head count tp divides, divided; where the block's ``kv_heads`` kv heads
    are fewer than tp and its kv projections run grouped (each rank computing the one kv head
    its query heads read), the query head counts divided by tp, the kv head counts 1 and the
    query heads per kv head (:data:`GROUP_ATTRS`) the rank's local query heads. The proof runs
    the block with them (:func:`_run`); the plan's ``module_attrs`` are them."""
    out = {}
    for k, v in attrs.items():
        if type(v) is not int:
            continue
        if kv_heads is not None and k in KV_ATTRS and v == kv_heads:
            out[k] = 1
        elif kv_heads is not None and k in GROUP_ATTRS and v * kv_heads % tp == 0:
            out[k] = v * kv_heads // tp
        elif (
            k in HEAD_ATTRS
            and k not in KV_ATTRS + GROUP_ATTRS
            or (kv_heads is None and k in KV_ATTRS)
        ):
            if v % tp == 0:
                out[k] = v // tp
    return {k: v for k, v in out.items() if v != attrs[k]}


def _linears(m: nn.Module) -> dict[str, nn.Linear]:
    return {n: c for n, c in m.named_children() if isinstance(c, nn.Linear)}


def _kind(m: nn.Module) -> tuple:
    return (
        type(m),
        tuple(sorted(_count_attrs(m).items())),
        tuple((n, tuple(p.shape), p.dtype) for n, p in m.named_parameters()),
        tuple((n, tuple(b.shape), b.dtype) for n, b in m.named_buffers()),
    )


class _Inputs:
    """Shapes, dtypes and plain values of one call of a block, as the trace called it."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        self.spec = pytree.tree_map(_describe, (args, kwargs))

    def meta(self) -> tuple[tuple, dict]:
        return pytree.tree_map(_rebuild, self.spec, is_leaf=lambda x: isinstance(x, _TensorSpec))


class _TensorSpec:
    def __init__(self, t: torch.Tensor) -> None:
        self.shape = tuple(int(s) for s in t.shape)
        self.dtype = t.dtype


def _describe(x: Any) -> Any:
    return _TensorSpec(x) if isinstance(x, torch.Tensor) else x


def _rebuild(x: Any) -> Any:
    return torch.empty(x.shape, dtype=x.dtype, device="meta") if isinstance(x, _TensorSpec) else x


class _Sizes(TorchFunctionMode):
    """Records the sizes every view/reshape/expand is called with."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Record] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        name = _SIZED.get(func)
        if name == "repeat":  # repeat_interleave(x, repeats, dim): an int count of copies
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            if type(repeats) is int:
                self.calls.append((name, (repeats,)))
        elif name == "unflatten":  # (dim, sizes): the sizes
            sizes = _sizes(args[2:] or (kwargs.get("sizes", ()),))
            if sizes is not None:
                self.calls.append((name, sizes))
        elif name == "split":  # sections named one by one (a fused projection's pieces)
            sections = args[1] if len(args) > 1 else kwargs.get("split_size_or_sections")
            sizes = _sizes((sections,)) if isinstance(sections, list | tuple) else None
            if sizes is not None:
                self.calls.append((name, sizes))
        elif name is not None:
            sizes = _sizes(args[1:] or tuple(kwargs.get("shape", ())))
            if sizes is not None:
                self.calls.append((name, sizes))
        return func(*args, **kwargs)


def _sizes(rest: tuple) -> tuple[int, ...] | None:
    if len(rest) == 1 and isinstance(rest[0], tuple | list | torch.Size):
        rest = tuple(rest[0])
    if not rest or not all(isinstance(v, int) and not isinstance(v, bool) for v in rest):
        return None
    return tuple(int(v) for v in rest)


@contextlib.contextmanager
def capture(model: nn.Module) -> Iterator[dict[tuple, tuple[nn.Module, _Inputs]]]:
    """While the trace runs: the first call's inputs of one block per kind (blocks with a head
    count attribute and at least two direct linear children)."""
    seen: dict[tuple, tuple[nn.Module, _Inputs]] = {}
    handles = []

    def hook(m: nn.Module, args: tuple, kwargs: dict) -> None:
        key = _kind(m)
        if key not in seen:
            with contextlib.suppress(Exception):
                seen[key] = (m, _Inputs(args, kwargs))

    for m in model.modules():
        if _count_attrs(m) and len(_linears(m)) >= 2:
            handles.append(m.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def _run(
    m: nn.Module,
    inputs: _Inputs,
    tp: int,
    order: list[str],
    grouped: frozenset[str] = frozenset(),
    fused: frozenset[str] = frozenset(),
    kv_heads: int | None = None,
) -> tuple[list[Record], list[str], tuple] | None:
    """The block's sized calls, linears in call order and output shape, at local shapes for a
    Megatron pair at ``tp`` (1: full shapes), the linears in ``grouped`` computing one of their
    ``kv_heads`` heads (:func:`_grouped`), those in ``fused`` with their query rows local and
    their kv rows whole (:func:`_fused`); None where it does not run."""
    linears = _linears(m)
    attrs = local_attrs(_count_attrs(m), tp, kv_heads) if tp > 1 else {}
    state: dict[str, torch.Tensor] = {}
    for name, t in [*m.named_parameters(), *m.named_buffers()]:
        shape = list(t.shape)
        owner, _, leaf = name.rpartition(".")
        if tp > 1 and owner in linears and owner in order:
            if owner in grouped:  # one kv head (all of them where there is one)
                shape[0] //= kv_heads or 1
            elif owner in fused:  # the first in_features rows local, the rest whole
                width = linears[owner].in_features
                shape[0] = width // tp + shape[0] - width
            elif owner != order[-1]:  # colwise: out_features / tp (weight and bias)
                shape[0] //= tp
            elif leaf == "weight":  # rowwise: in_features / tp
                shape[1] //= tp
        state[name] = torch.empty(shape, dtype=t.dtype, device="meta")
    called: list[str] = []
    hooks = [
        c.register_forward_pre_hook(lambda mod, a, n=n: called.append(n))
        for n, c in linears.items()
    ]
    saved = {k: getattr(m, k) for k in attrs}
    modes = {x: x.training for x in m.modules()}
    rec = _Sizes()
    try:
        for k, v in attrs.items():
            setattr(m, k, v)
        m.train()
        args, kwargs = inputs.meta()
        with rec, torch.no_grad():
            out = torch.func.functional_call(m, state, args, kwargs, strict=False)
    except Exception:
        return None
    finally:
        for h in hooks:
            h.remove()
        for k, v in saved.items():
            setattr(m, k, v)
        for x, training in modes.items():
            x.training = training
    leaves = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
    return rec.calls, called, tuple(leaves[0].shape) if leaves else ()


def _query_heads(m: nn.Module, order: list[str]) -> int:
    """The block's query heads: its largest head count, else its widest linear before the last
    over its ``head_dim`` (HF Llama names no head count); 0 where neither says."""
    heads = _head_attrs(m)
    if heads:
        return max(heads.values())
    head_dim = getattr(m, "head_dim", None)
    widest = max(_linears(m)[n].out_features for n in order[:-1])
    return widest // head_dim if type(head_dim) is int and widest % head_dim == 0 else 0


class Proof(NamedTuple):
    """A block kind proven at one degree: each sized call (full, local), its linears run fused
    (:func:`_fused`), its kv linears run grouped and its kv heads (:func:`_grouped`)."""

    pairs: list[tuple[Record, Record]]
    fused: frozenset[str] = frozenset()
    grouped: frozenset[str] = frozenset()
    kv_heads: int = 0


def _prove(m: nn.Module, inputs: _Inputs) -> dict[int, Proof]:
    """tp -> (full call, local call) of every sized call, where the block runs consistently at
    that degree's local shapes."""
    full = _run(m, inputs, 1, [])
    if full is None or len(full[1]) < 2:
        return {}
    calls, order, out_shape = full
    if len(set(order)) != len(order):  # a linear called twice: not a plain Megatron pair
        return {}
    proofs: dict[int, Proof] = {}
    linears = _linears(m)
    heads = _query_heads(m, order)
    for tp in [tp for tp in range(2, min(heads, _MAX_TP) + 1) if heads % tp == 0]:
        if linears[order[-1]].in_features % tp:
            continue
        tries = [(frozenset(), frozenset(), None)]
        tries += [(g, frozenset(), n) for g, n in _grouped(m, order, tp, heads)]
        tries += [(frozenset(), f, None) for f in _fused(m, order, tp)]
        for grouped, fused, kv_heads in tries:
            sharded = [n for n in order[:-1] if n not in fused]
            if any(linears[n].out_features % tp for n in sharded):
                continue
            if grouped and len(grouped) == len(order) - 1:
                continue  # nothing left to shard
            local = _run(m, inputs, tp, order, grouped, fused, kv_heads)
            if local is None or local[2] != out_shape or local[1] != order:
                continue
            if [c[0] for c in local[0]] != [c[0] for c in calls]:
                continue
            if any(len(a[1]) != len(b[1]) for a, b in zip(calls, local[0])):
                continue
            proofs[tp] = Proof(list(zip(calls, local[0])), fused, grouped, kv_heads or 0)
            break
    return proofs


def _fused(m: nn.Module, order: list[str], tp: int) -> list[frozenset[str]]:
    """A fused q/k/v projection with fewer kv heads than tp (HF Falcon's ``query_key_value``:
    the query heads' rows first, as many as its input is wide, then the kv heads' rows, split
    unequally after it): Megatron's answer is the query rows split over tp and every rank
    computing the kv heads whole. Tried where the block's only linear before the last is wider
    than its input and tp divides that input: the block then runs with that linear's first
    ``in_features / tp`` rows and all of its kv rows."""
    if len(order) != 2:
        return []
    fused = _linears(m)[order[0]]
    wider = fused.out_features > fused.in_features
    return [frozenset(order[:1])] if wider and fused.in_features % tp == 0 else []


def _grouped(m: nn.Module, order: list[str], tp: int, heads: int) -> list[tuple]:
    """Fewer kv heads than tp (multi-query attention's one, grouped-query attention's few):
    Megatron's answer is the query heads split over tp and every rank computing the kv head its
    query heads read (rank r's read kv head ``r // (tp / kv_heads)`` where the kv heads are laid
    out kv-major, which the planner's layout rules check). Tried where the linears before the
    last narrower than the widest (the query projection) are equally wide, hold ``kv_heads``
    whole heads of ``widest / heads`` columns, tp is a multiple of them and divides their width
    (the weight split evenly): the block then runs with those linears computing one head."""
    linears = _linears(m)
    widths = {n: linears[n].out_features for n in order[:-1]}
    widest = max(widths.values())
    kv = [n for n, w in widths.items() if w < widest]
    if not kv or heads <= 0 or widest % heads or len({widths[n] for n in kv}) != 1:
        return []
    width = widths[kv[0]]
    head_dim = widest // heads
    kv_heads = width // head_dim
    if width % head_dim or kv_heads >= tp or tp % kv_heads or width % tp:
        return []
    return [(frozenset(kv), kv_heads)]


def gqa_blocks(
    model: nn.Module, seen: dict[tuple, tuple[nn.Module, _Inputs]]
) -> dict[str, tuple[int, int, str]]:
    """Block FQN -> (query heads, kv heads, its last linear) of the blocks of the kinds the
    trace ran whose kv projections are narrower than the query projection (grouped-query and
    multi-query attention), in the order the full run called them."""
    out: dict[str, tuple[int, int, str]] = {}
    kinds = {key: _run(m, inputs, 1, []) for key, (m, inputs) in seen.items()}
    for fqn, m in model.named_modules():
        full = kinds.get(_kind(m)) if _count_attrs(m) else None
        order = full[1] if full else []
        if len(order) < 3 or len(set(order)) != len(order):
            continue
        heads = _query_heads(m, order)
        widths = [_linears(m)[n].out_features for n in order[:-1]]
        kv = [w for w in widths if w < max(widths)]
        if heads and kv and max(widths) % heads == 0:
            kv_heads = kv[0] // (max(widths) // heads)
            out[fqn] = (heads, kv_heads, f"{fqn}.{order[-1]}" if fqn else order[-1])
    return out


Proofs = dict[tuple, dict[int, Proof]]
"""block kind -> tp -> (full call, local call) pairs, for the kinds proven at some degree."""


def prove(seen: dict[tuple, tuple[nn.Module, _Inputs]]) -> Proofs:
    """Run every captured block kind at its local shapes (:func:`_prove`)."""
    proofs = {key: _prove(m, inputs) for key, (m, inputs) in seen.items()}
    return {k: v for k, v in proofs.items() if v}


def local_literals(
    model: nn.Module, proofs: Proofs, nodes: list[Node]
) -> dict[str, dict[int, tuple[int, ...]]]:
    """Traced node name -> tp -> the sizes its view/reshape/expand takes on local heads, for the
    sized calls of proven blocks whose literal changes at that degree."""
    if not proofs:
        return {}
    by_module: dict[str, list[Node]] = {}
    for n in nodes:
        if n.kind == "compute" and _GRAPH_OPS.get(_op(n.op)) and n.module_stack:
            by_module.setdefault(n.module_fqn, []).append(n)
    out: dict[str, dict[int, tuple[int, ...]]] = {}
    for fqn, m in model.named_modules():
        proof = proofs.get(_kind(m)) if _count_attrs(m) else None
        if not proof:
            continue
        mine = by_module.get(fqn, [])
        for tp, found in proof.items():
            start = 0
            for (kind, full), (_, local) in found.pairs:
                if full == local:
                    continue
                for i in range(start, len(mine)):
                    n = mine[i]
                    if _GRAPH_OPS[_op(n.op)] == kind and _literal(n) == full:
                        out.setdefault(n.name, {})[tp] = local
                        start = i + 1
                        break
    return out


def fused_heads(model: nn.Module, proofs: Proofs) -> dict[str, tuple[int, ...]]:
    """Linear FQN -> the degrees at which its block runs it fused (:func:`_fused`): its first
    ``in_features`` rows the query heads, split over tp, its other rows kv heads every rank
    computes whole."""
    out: dict[str, tuple[int, ...]] = {}
    for fqn, m in model.named_modules():
        proof = proofs.get(_kind(m)) if _count_attrs(m) else None
        for tp, found in sorted((proof or {}).items()):
            for name in sorted(found.fused):
                key = f"{fqn}.{name}" if fqn else name
                out[key] = (*out.get(key, ()), tp)
    return out


def grouped_kv(model: nn.Module, proofs: Proofs) -> dict[str, dict[int, int]]:
    """kv linear FQN -> tp -> its block's kv heads, at the degrees where the block runs it
    grouped (:func:`_grouped`: fewer kv heads than tp, each rank computing the one its query
    heads read)."""
    out: dict[str, dict[int, int]] = {}
    for fqn, m in model.named_modules():
        proof = proofs.get(_kind(m)) if _count_attrs(m) else None
        for tp, found in sorted((proof or {}).items()):
            for name in sorted(found.grouped):
                key = f"{fqn}.{name}" if fqn else name
                out.setdefault(key, {})[tp] = found.kv_heads
    return out


def fused_blocks(
    model: nn.Module, seen: dict[tuple, tuple[nn.Module, _Inputs]], proofs: Proofs
) -> dict[str, tuple[int, ...]]:
    """Block FQN -> the tp degrees at which it is proven (any way), for the blocks of the kinds
    the trace ran whose first of two linears is wider than its input: a fused q/k/v projection
    (HF Falcon's ``query_key_value``) proven at some degree. At any other degree the planner
    could only keep its attention whole: ``planner.rules`` refuses those degrees. A block proven
    at none (nanoGPT's, which runs on DTensors instead) is not one of them."""
    out: dict[str, tuple[int, ...]] = {}
    for fqn, m in model.named_modules():
        key = _kind(m) if _count_attrs(m) else None
        linears = list(_linears(m).values())
        if key not in seen or not proofs.get(key) or len(linears) != 2:
            continue
        if linears[0].out_features > linears[0].in_features:
            out[fqn] = tuple(sorted(proofs.get(key, {})))
    return out


def _op(op: str) -> str:
    parts = op.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "aten" else op


def _literal(n: Node) -> tuple[int, ...] | None:
    at = 2 if _op(n.op) == "unflatten" else 1  # unflatten(x, dim, sizes)
    value = n.args[at] if len(n.args) > at else None
    if _op(n.op) == "repeat_interleave":  # an int count of copies
        return (value,) if type(value) is int else None
    return tuple(value) if isinstance(value, tuple | list) else None


# -- blocks that run on DTensors -----------------------------------------------------------------

# ops an attention block may run on its own (outside its linears) and still run on DTensors of
# full shape: views, the softmax attention and SDPA, masks built from its own buffers
_DTENSOR_OPS = frozenset(
    {
        "view", "reshape", "_unsafe_view", "expand", "transpose", "permute", "t", "contiguous",
        "clone", "alias", "detach", "unsqueeze", "squeeze", "slice", "select", "eq", "ne", "lt",
        "le", "gt", "ge", "logical_not", "masked_fill", "where", "mul", "div", "add", "sub",
        "neg", "softmax", "_softmax", "dropout", "native_dropout", "matmul", "bmm", "to",
        "_to_copy", "type_as", "tril", "triu", "scaled_dot_product_attention", "getitem",
        "split", "chunk", "silu", "gelu", "relu", "tanh", "sigmoid", "pow", "exp", "erf",
        "sqrt", "rsqrt", "clamp", "abs",
    }
)  # fmt: skip
_ACTIVATION_MODULES = ("torch.nn.modules.activation", "transformers.activations")


def _block_child(c: nn.Module) -> bool:
    """A child a block on DTensors may hold: a linear, a dropout, or a parameterless activation
    (``nn.SiLU``, HF's ``ACT2FN`` modules)."""
    if type(c) in (nn.Linear, nn.Dropout):
        return True
    return type(c).__module__ in _ACTIVATION_MODULES and not list(c.parameters(recurse=True))


def dtensor_blocks(model: nn.Module, proofs: Proofs, nodes: list[Node]) -> frozenset[str]:
    """Blocks whose views name full sizes and which can run their inner ops on DTensors instead.

    A block no local rewrite covers (its kind unproven at every degree: nanoGPT's ``C //
    self.n_head`` with ``view(B, T, C)``, a head count written as a number) stays right on local
    heads only if every op between its colwise linears and its rowwise one sees tensors of full
    shape: DTensors (``ColwiseParallel(use_local_output=False)``). That works where DTensor can
    carry everything the block does, which this checks on the traced graph:

    - its children are ``nn.Linear`` (two or more, each called once), ``nn.Dropout`` and
      parameterless activations only;
    - it runs only :data:`_DTENSOR_OPS` besides its linears, and at least one view, reshape or
      expand whose sizes are all named (no ``-1``: the views a local run gets wrong), or splits a
      linear's output into equal pieces (a fused gate/up, :func:`fused_linears`);
    - every tensor it reads from outside is read by its linears only (the activation) or is one
      of its own buffers (the emitted program lends those as replicated DTensors for the call);
      it creates no tensor of more than one element;
    - only its last linear's output (or what only that feeds: residual dropout) leaves it:
      nothing sharded escapes as a DTensor.
    """
    users = _users(nodes)
    within: dict[str, list[Node]] = {}  # module FQN -> the compute nodes run inside it
    for n in nodes:
        if n.kind == "compute":
            for fqn in n.module_stack:
                within.setdefault(fqn, []).append(n)
    out: set[str] = set()
    for fqn, m in model.named_modules():
        children = list(m.children())
        if (
            not fqn
            or sum(type(c) is nn.Linear for c in children) < 2
            or not all(_block_child(c) for c in children)
            or (_count_attrs(m) and _kind(m) in proofs)
        ):
            continue
        buffers = {"b_" + f"{fqn}.{b}".replace(".", "_") for b, _ in m.named_buffers()}
        if _runs_on_dtensors(fqn, within.get(fqn, []), users, buffers):
            out.add(fqn)
    return frozenset(out)


def _users(nodes: list[Node]) -> dict[str, list[Node]]:
    """Node name -> the nodes that read its output."""
    users: dict[str, list[Node]] = {}
    for n in nodes:
        for r in n.inputs:
            users.setdefault(r, []).append(n)
    return users


def _runs_on_dtensors(
    fqn: str, mine: list[Node], users: dict[str, list[Node]], buffers: set[str]
) -> bool:
    """The checks of :func:`dtensor_blocks` on the compute nodes ``mine`` run inside ``fqn``."""
    if not mine:
        return False
    inside = {n.name for n in mine}
    if any(_op(n.op) not in _DTENSOR_OPS for n in mine if n.op != "aten.linear.default"):
        return False
    own = [n for n in mine if n.module_fqn == fqn]
    sized = [
        n
        for n in own
        if _GRAPH_OPS.get(_op(n.op)) in ("view", "expand") and _literal(n) is not None
    ]
    named = any(-1 not in (_literal(n) or ()) for n in sized)
    if not named and not _splits_a_linear(own, mine):
        return False
    for n in mine:
        if not n.inputs and n.out is not None and n.out.numel > 1:
            return False  # a tensor made inside: it would meet DTensors as a plain tensor
        for r in n.inputs:
            if r in inside or r in buffers:
                continue
            if n.module_fqn == fqn:  # the block's own op reads a tensor from outside
                return False
    linear_calls = [n for n in mine if n.op == "aten.linear.default"]
    if len(linear_calls) != len({n.module_fqn for n in linear_calls}):
        return False  # a linear called twice
    if not linear_calls:
        return False
    after = {linear_calls[-1].name}  # the last linear's output, and what only it feeds (dropout)
    for n in mine:
        refs = [r for r in n.inputs if r in inside]
        if refs and all(r in after for r in refs):
            after.add(n.name)
    escaping = {n.name for n in mine if any(u.name not in inside for u in users.get(n.name, []))}
    return escaping <= after


def _splits_a_linear(own: list[Node], mine: list[Node]) -> bool:
    """Whether the block splits one of its linears' outputs into 2 or 3 equal pieces along the
    last dim (a fused gate/up or q/k/v: worth running on DTensors even with no view)."""
    outputs = {n.name: n for n in mine if n.op == "aten.linear.default" and n.out is not None}
    return any(
        n.inputs and n.inputs[0] in outputs
        and _equal_parts(n, outputs[n.inputs[0]].out.shape) in FUSED_PARTS
        for n in own
    )  # fmt: skip


FUSED_PARTS = (2, 3)
"""Equal pieces a fused linear's output may be split into (gate/up; q, k, v)."""


def fused_linears(nodes: list[Node], blocks: frozenset[str]) -> dict[str, int]:
    """Linear FQN -> k, for each linear of a block that runs on DTensors whose output goes only to
    one split into k equal pieces along its last dim (nanoGPT's ``c_attn(x).split(self.n_embd,
    dim=2)``): sharded so each rank holds its slice of every piece, q, k and v come out sharded
    alike (``colwise_fused{k}_dtensor``)."""
    users = _users(nodes)
    out: dict[str, int] = {}
    for n in nodes:
        fqn = n.module_fqn
        if n.op != "aten.linear.default" or fqn.rpartition(".")[0] not in blocks or not n.out:
            continue
        readers = users.get(n.name, [])
        parts = _equal_parts(readers[0], n.out.shape) if len(readers) == 1 else None
        if parts in FUSED_PARTS:
            out[fqn] = parts
    return out


def _equal_parts(node: Node, shape: tuple[int, ...]) -> int | None:
    """k where ``node`` splits a tensor of ``shape`` into k equal pieces along its last dim."""
    op = _op(node.op)
    if op not in ("split", "chunk") or len(node.args) < 2 or not isinstance(node.args[1], int):
        return None
    dim = node.args[2] if len(node.args) > 2 else dict(node.kwargs).get("dim", 0)
    if not isinstance(dim, int) or dim % len(shape) != len(shape) - 1:
        return None
    width = shape[-1]
    if op == "chunk":
        k = node.args[1]
        return k if k > 0 and width % k == 0 else None
    size = node.args[1]
    return width // size if size > 0 and width % size == 0 else None
