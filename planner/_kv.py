"""Layout rules for kv heads fewer than tp, as Megatron splits such attention: the query heads
sharded over tp, every rank computing the kv head(s) its query heads read.

- ``RP`` (:func:`_partial`): one kv head (multi-query attention), whole on every rank.
- ``K<d>`` (:func:`grouped`): a block's n kv heads (1 < n < tp, tp a multiple of n) along dim d,
  rank r holding kv head ``r // (tp / n)`` (``colwise_kv_heads``). Views keep it where d stays
  outermost in its group and its size is ``-1`` or proven local (n times smaller, ``ir._heads``);
  transposes, unsqueezes, elementwise ops with whole operands broadcast on d (rotary's cos and
  sin: ``collapse.kv_nodes`` admits only operands that need no gradient), slices and cats along
  other dims keep it. ``KR<d>``: an expand of the dim after d from 1 to the rank's query heads
  per kv head (proven local: tp / n times smaller), kv-major as ``repeat_kv`` lays them out; a
  reshape merging exactly dims d and d + 1 (size ``-1`` or proven local) gives the query heads
  ``S<d>``. ``repeat_interleave`` along d by a count proven local gives ``S<d>``, and SDPA with
  ``enable_gqa`` reads ``K1`` keys and values beside queries ``S1``. A rep-major expand (query
  head j reading kv head j mod n) matches none of these: such a block keeps its heads whole.

Each rank reads only its query heads' share of its kv head: the gradient of a ``RP`` or ``K``
tensor is a partial sum per rank, summed by the style that made it (reduce-scattered onto the
weight shards), so nothing else may read one.
"""

from __future__ import annotations

from collections.abc import Sequence

from autopar.ir import Graph, Node
from autopar.planner._op_sets import BINARY, UNARY
from autopar.planner.layouts import (
    KV,
    RP,
    R,
    _along,
    _broadcast,
    _local_literal,
    _permute,
    _pkt,
    _reshape,
    _reshape_groups,
    _select,
    _shape,
    _squeeze,
    _unsqueeze,
    gqa,
    shard,
    shard_dim,
)

KR = "KR"
_VIEWS = ("view", "reshape", "_unsafe_view")


def _partial(node: Node, graph: Graph, ins: Sequence[str], tp: int) -> str | None:
    """Ops on :data:`RP` (a one-head kv projection, whole on every rank, each rank reading only
    its query heads' share of it): views and transposes keep it; an expand of its one head to
    a head count proven local (:func:`_local_literal`) gives the local heads (multi-query
    attention's ``k.expand(b, self.n_heads, t, d)``); SDPA with ``enable_gqa`` reads it beside q
    sharded on heads. Nothing else may read it: its gradient is a partial sum per rank."""
    op = _pkt(node.op)
    if op in PARTIAL_KEEP and all(x == RP for x in ins):
        return RP
    # rotary on the kv head (cos and sin whole, needing no gradient: collapse.partial_nodes)
    if op in UNARY | BINARY | {"slice", "cat"} and all(x in (R, RP) for x in ins):
        return RP
    if op == "expand" and ins[0] == RP:
        return _expand_heads(node, graph, tp)
    if op == "scaled_dot_product_attention" and tuple(ins[:3]) == (shard(1), RP, RP):
        one_head = all(_shape(graph, r)[1:2] == (1,) for r in node.inputs[1:3])
        if gqa(node) and one_head and all(x == R for x in ins[3:]):
            return shard(1)
    return None


PARTIAL_KEEP = frozenset(
    {"view", "reshape", "_unsafe_view", "transpose", "permute", "unsqueeze", "contiguous",
     "clone", "alias"}
)  # fmt: skip


def _expand_heads(node: Node, graph: Graph, tp: int) -> str | None:
    """The expand of one head (a dim of size 1) to a size proven local on local heads: each
    rank gets its local heads' copies."""
    src = _shape(graph, node.inputs[0]) if node.inputs else ()
    sizes = node.args[1] if len(node.args) > 1 else ()
    if not isinstance(sizes, tuple | list) or len(sizes) < len(src):
        return None
    lead = len(sizes) - len(src)
    for od in range(lead, len(sizes)):
        if src[od - lead] == 1 and sizes[od] != -1 and _local_literal(node, graph, tp, od):
            return shard(od)
    return None


def kv_heads(graph: Graph, block: str, tp: int) -> int | None:
    """The kv heads of ``block`` where its kv projections run grouped at ``tp``, else None."""
    for degrees in graph.grouped_kv_by_block.get(block, ()):
        if tp in degrees:
            return degrees[tp]
    return None


def _as_shard(x: str) -> str:
    return shard(int(x[len(KV) :])) if x.startswith(KV) and not x.startswith(KR) else x


def _as_kv(x: str | None) -> str | None:
    d = shard_dim(x) if x is not None else None
    return f"{KV}{d}" if d is not None else None


def grouped(node: Node, graph: Graph, ins: Sequence[str], tp: int) -> str | None:
    """The layout of ``node``'s output where an input is ``K<d>`` or ``KR<d>`` (the module
    docstring), or None where running it on each rank's kv head would be wrong."""
    n = kv_heads(graph, node.module_fqn, tp)
    op = _pkt(node.op)
    if n is None or n < 2 or not node.inputs:
        return None
    if ins[0].startswith(KR):
        return _merge(node, graph, int(ins[0][len(KR) :]), tp) if op in _VIEWS else None
    if any(x.startswith(KR) or (x != R and not x.startswith(KV)) for x in ins[1:]):
        if op == "scaled_dot_product_attention":
            return _sdpa(node, graph, ins)
        return None
    if ins[0] != R and not ins[0].startswith(KV):
        return _sdpa(node, graph, ins) if op == "scaled_dot_product_attention" else None
    plain = [_as_shard(x) for x in ins]
    rank = len(_shape(graph, node.inputs[0]))
    rule = {
        "transpose": lambda: _permute(node, plain, rank),
        "swapaxes": lambda: _permute(node, plain, rank),
        "permute": lambda: _permute(node, plain, rank),
        "unsqueeze": lambda: _unsqueeze(node, plain, rank),
        "squeeze": lambda: _squeeze(node, graph, plain),
        "slice": lambda: _along(node, graph, plain, rank, tp, 1),
        "cat": lambda: _along(node, graph, plain, rank, tp, 1),
        "select": lambda: _select(node, plain, rank),
        **{v: lambda: _reshape(node, graph, plain, tp, pieces=n) for v in _VIEWS},
    }.get(op)
    if node.op == "getitem" or op in UNARY:
        return ins[0] if all(x == R for x in ins[1:]) else None
    if op in BINARY:
        return _as_kv(_broadcast(node, graph, plain))
    if op == "expand":
        return _expand(node, graph, int(ins[0][len(KV) :]), tp, n)
    if op == "repeat_interleave":
        return _repeat(node, graph, int(ins[0][len(KV) :]), tp, n)
    return _as_kv(rule()) if rule is not None else None


def _sizes(node: Node, graph: Graph, tp: int) -> tuple[tuple, tuple]:
    """(full, local) sizes a view or expand names: the local ones as its block's proof ran it
    at ``tp`` (the full ones where it recorded none)."""
    full = tuple(node.args[1]) if len(node.args) > 1 else ()
    local = graph.local_literals.get(node.name, {}).get(tp, full)
    return full, tuple(local)


def _expand(node: Node, graph: Graph, d: int, tp: int, n: int) -> str | None:
    """expand of ``K<d>``: dim d named ``-1`` or n times smaller locally; the dim after it, of
    size 1, expanded to a count tp / n times smaller locally (kv-major: ``KR<d>``), or nothing
    else expanded (``K<d>``). Every other size the same on every rank."""
    src = _shape(graph, node.inputs[0])
    full, local = _sizes(node, graph, tp)
    if len(full) != len(local) or len(full) < len(src):
        return None
    od = d + len(full) - len(src)
    if full[od] != -1 and local[od] * n != full[od]:
        return None
    rep = od + 1 < len(full) and src[od + 1 - len(full) + len(src)] == 1 and full[od + 1] != 1
    if rep and (full[od + 1] == -1 or local[od + 1] * (tp // n) != full[od + 1]):
        return None
    skip = (od, od + 1) if rep else (od,)
    if any(lo != fu for k, (lo, fu) in enumerate(zip(local, full)) if k not in skip):
        return None
    return f"{KR}{od}" if rep else f"{KV}{od}"


def _merge(node: Node, graph: Graph, d: int, tp: int) -> str | None:
    """A view of ``KR<d>`` merging exactly dims d and d + 1 into the rank's query heads."""
    src = _shape(graph, node.inputs[0])
    dst = node.out.shape if node.out else ()
    full = tuple(node.args[1]) if len(node.args) > 1 else ()
    for gi, gj in _reshape_groups(src, dst):
        if d not in gi:
            continue
        sized_i = [k for k in gi if src[k] != 1]
        sized_j = [k for k in gj if dst[k] != 1]
        if sized_i != [d, d + 1] or len(sized_j) != 1 or len(full) != len(dst):
            return None
        od = sized_j[0]
        ok = full[od] == -1 or _local_literal(node, graph, tp, od)
        return shard(od) if ok else None
    return None


def _repeat(node: Node, graph: Graph, d: int, tp: int, n: int) -> str | None:
    """repeat_interleave of ``K<d>`` along d by a count tp / n times smaller locally: each
    rank's kv head copied to its query heads (``S<d>``); along another dim it keeps ``K<d>``."""
    args, kwargs = node.args, dict(node.kwargs)
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    count = args[1] if len(args) > 1 else None
    rank = len(_shape(graph, node.inputs[0]))
    if len(node.inputs) != 1 or type(count) is not int or not isinstance(dim, int):
        return None
    if len(args) > 3 or kwargs.get("output_size") is not None:
        return None  # a full size named
    if dim % rank != d:
        return f"{KV}{d}"
    local = graph.local_literals.get(node.name, {}).get(tp)
    return shard(d) if local is not None and local[0] * (tp // n) == count else None


def _sdpa(node: Node, graph: Graph, ins: Sequence[str]) -> str | None:
    """SDPA with ``enable_gqa``: queries ``S1`` (local heads), keys and values ``K1`` (the kv
    head they read), masks whole and broadcast over heads."""
    if tuple(ins[:3]) != (shard(1), f"{KV}1", f"{KV}1") or not gqa(node):
        return None
    for ref, x in zip(node.inputs[3:], ins[3:]):
        shp = _shape(graph, ref)
        if x != R or (len(shp) == 4 and shp[1] != 1):
            return None
    return shard(1)
