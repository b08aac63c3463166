"""Tensor layouts under tensor parallelism, and which ops can run on local shards.

The emitted program runs TP the torchtitan way: parallelized modules (``nn.Linear``,
``nn.Embedding``, norms) get a ``parallelize_module`` style and return *local* tensors
(``use_local_output=True``); every other op of the model runs unchanged on whatever local piece
of a tensor its rank holds. A sharding is therefore only correct when each op between two
parallelized modules computes, on local pieces, exactly the piece of the full result. This module
decides that, op by op, on the traced aten graph.

Layouts of one tensor on the ranks of a TP group (strings, so plans and tests read them):

- ``"R"``: every rank holds the whole tensor;
- ``"S<d>"``: rank i holds the i-th of tp equal slices along dim d (a plain local tensor);
- ``"D1"``: a DTensor sharded on dim 1, as ``SequenceParallel`` returns it; only a module style
  that takes ``Shard(1)`` input may consume it.
- ``"DR"``: a DTensor replicated on every rank: a sequence-parallel norm's output all-gathered
  along the sequence (Megatron's g), once for every colwise linear that reads it; only a
  colwise style may consume it (it takes a replicated DTensor as it is).

Sequence parallelism (Megatron-LM, Korthikanti et al. 2022): norms run on sequence shards
(``S1``/``D1`` in, the all-gather before the colwise linears in their style), rowwise linears
reduce-scatter their output to ``S1`` (``rowwise_to_seq``) and the residual adds and dropouts
between them run on local sequence shards. A norm is recognised from the traced graph, not by
class (:func:`planner.norms.norm_modules`): a module with 1-D parameters of the hidden size whose ops, fed a
sequence shard, compute the sequence shard of their result (LayerNorm, RMSNorm, HF's
``LlamaRMSNorm``...). A replicated tensor enters the sequence-parallel region at a layer
boundary (:func:`planner.norms.scatter_layers`): the layer's input is split along the sequence (no
communication; its gradient is all-gathered).

There is no "partial" layout: a pending sum is resolved inside the module style that creates it
(``RowwiseParallel`` all-reduces or reduce-scatters its output), because plain ops cannot.

:func:`propagate` maps the input layouts of one op to its output layout, or ``None`` where local
execution would be wrong (a view whose literal size spans a sharded dim, a split along it, a
softmax over it, a reduction over it, ...). Unknown ops run only on replicated inputs: correct, if
conservative. :data:`MODULE_STYLES` gives, per parallelizable module kind, each TP style's input and
output layout.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from itertools import product

from autopar.ir import Graph, Node, TensorMeta
from autopar.planner._op_sets import BINARY as _BINARY
from autopar.planner._op_sets import FACTORY as _FACTORY
from autopar.planner._op_sets import REDUCE as _REDUCE
from autopar.planner._op_sets import UNARY as _UNARY

R = "R"
KV = "K"
"""``K<d>``: a tensor whose dim d holds a block's n kv heads (n fewer than tp), each rank holding
the one its query heads read (``colwise_kv_heads``); ``KR<d>`` that kv head expanded to the
rank's query heads over dims d and d + 1 (:mod:`planner._kv`)."""
D1 = "D1"
DR = "DR"
RP = "RP"
FUSED = "F"
"""``F<d>``: a fused q/k/v projection's output run fused (``Graph.fused_heads``): along dim d,
each rank's query heads, then the kv heads whole (``colwise_fused_heads``). Views that keep d
outermost with ``-1`` keep it; the split into its pieces gives the query heads ``S<d>`` and each
kv piece :data:`RP` (:func:`_fused_heads`)."""
"""A one-head kv projection's output, whole on every rank, each rank reading only its query
heads' share: its gradient a partial sum per rank (``colwise_gather_heads`` sums it; the
nodes that may hold it: ``collapse.partial_nodes``)."""


def shard(dim: int) -> str:
    return f"S{dim}"


def shard_dim(layout: str) -> int | None:
    """The sharded dim of ``S<d>``, else None."""
    return int(layout[1:]) if layout.startswith("S") else None


def candidate_layouts(meta: TensorMeta | None, tp: int) -> tuple[str, ...]:
    """Layouts a tensor may take: replicated, or sharded on a dim that tp divides."""
    if meta is None or tp == 1:
        return (R,)
    out = [R] + [shard(d) for d, size in enumerate(meta.shape) if size % tp == 0 and size >= tp]
    if len(meta.shape) >= 3 and meta.shape[1] % tp == 0:
        out += [D1, DR]
    return tuple(out)


# -- module styles -------------------------------------------------------------------------------

# kind -> style -> (input layout, output layout); ``-1`` stands for the last dim of the tensor.
# "replicate" means no style: the module must see the whole input on every rank, or its
# parameter gradients would differ across the TP group with nothing to reduce them.
MODULE_STYLES: dict[str, dict[str, tuple[tuple[str, ...], str]]] = {
    "linear": {
        "replicate": ((R,), R),
        "colwise": ((R, DR), "S-1"),
        "colwise_from_seq": (("S1", D1), "S-1"),
        "colwise_gather": ((R, DR), R),
        # a one-head kv projection read on local query heads (partial_nodes): all-gathered,
        # its gradient summed over the TP group
        "colwise_gather_heads": ((R, DR), RP),
        # several kv heads fewer than tp (ir._heads.grouped_kv): each rank keeps the kv head
        # its query heads read (planner._kv), its gradient summed over the TP group
        "colwise_kv_heads": ((R, DR), "K-1"),
        "colwise_from_seq_gather": (("S1", D1), R),
        "rowwise": (("S-1",), R),
        "rowwise_to_seq": (("S-1",), "S1"),
    },
    "embedding": {
        "replicate": ((R,), R),
        "rowwise_from_replicate": ((R,), R),
        "rowwise_from_replicate_to_seq": ((R,), "S1"),
        "colwise": ((R,), "S-1"),
        "colwise_gather": ((R,), R),
    },
    # any module norm_modules recognises (LayerNorm, RMSNorm, a model's own RMSNorm class)
    "norm": {
        "replicate": ((R,), R),
        "sequence_parallel": (("S1", D1), D1),
        "sequence_parallel_gather": (("S1", D1), DR),
        "sequence_parallel_local": (("S1", D1), "S1"),
        # a per-head norm (Qwen3's q_norm/k_norm over head_dim) on local heads of a
        # (batch, seq, heads, head_dim) view: only where heads_norm says so
        "heads_parallel_local": (("S2",), "S2"),
    },
    # a layer whose input enters the sequence-parallel region (scatter_layers)
    "layer": {
        "replicate": ((R,), R),
        "sequence_scatter": ((R,), "S1"),
    },
    # a fused q/k/v projection (Graph.fused_heads): colwise runs it fused, the plan's
    # colwise_fused_heads (fused_style)
    "fused_linear": {
        "replicate": ((R,), R),
        "colwise": ((R,), "F-1"),
        "colwise_gather": ((R,), R),
    },
}

# kinds whose styles leave the module's parameters whole (activations are what they shard)
SEQUENCE_STYLES = frozenset(
    {
        "sequence_parallel",
        "sequence_parallel_gather",
        "sequence_parallel_local",
        "heads_parallel_local",
        "sequence_scatter",
    }
)

# in a block that runs on DTensors (``Graph.dtensor_blocks``), the colwise styles that hand on a
# sharded output hand it on as a DTensor of full shape (``use_local_output=False``); a fused
# linear split into k pieces (``Graph.fused_linears``) holds its slice of every piece
DTENSOR_STYLES = {"colwise": "colwise_dtensor", "colwise_from_seq": "colwise_from_seq_dtensor"}


def dtensor_style(style: str, parts: int | None) -> str:
    """The colwise ``style`` of a linear in a block that runs on DTensors, split into ``parts``
    pieces after it (None: not fused)."""
    name = DTENSOR_STYLES.get(style, style)
    if parts and name != style:
        return name.replace("_dtensor", f"_fused{parts}_dtensor")
    return name


def plain_style(style: str) -> str:
    """The ILP's style behind a style :func:`dtensor_style` or :func:`fused_style` renamed."""
    return re.sub(r"(_fused\d)?_dtensor$|_fused_heads$|(?<=_kv_heads)\d+$", "", style)


def fused_style(graph: Graph, styles: dict[str, str], tp: int) -> dict[str, str]:
    """``styles`` as the emitted program spells them: a fused q/k/v projection that ``colwise``
    runs fused at ``tp`` (``Graph.fused_heads``) is ``colwise_fused_heads``; a kv projection of
    n heads each rank keeps the one of (``colwise_kv_heads``) is ``colwise_kv_heads<n>``."""
    return {
        fqn: f"{s}_fused_heads"
        if s == "colwise" and tp in graph.fused_heads.get(fqn, ())
        else f"{s}{graph.grouped_kv[fqn][tp]}"
        if s == "colwise_kv_heads"
        else s
        for fqn, s in styles.items()
    }


CONV1D = "transformers.pytorch_utils.Conv1D"
"""HF's Conv1D (GPT-2's c_attn, c_proj, c_fc): a linear with its weight stored (in, out), computed
as ``addmm(bias, x.view(-1, in), weight).view(..., nf)``; the emitted program shards it as a
linear, its own views running on DTensors of full shape (``codegen`` runtime: Colwise/Rowwise)."""

MODULE_OPS = {
    "torch.nn.modules.linear.Linear": ("linear", "aten.linear.default"),
    "torch.nn.modules.sparse.Embedding": ("embedding", "aten.embedding.default"),
    CONV1D: ("linear", "aten.addmm.default"),
}


def resolve(layout: str, rank: int) -> str:
    """Turn ``S-1`` into ``S<rank-1>`` (``F-1`` into ``F<rank-1>``)."""
    if layout in ("S-1", "F-1", "K-1"):
        return f"{layout[0]}{rank - 1}"
    return layout


def style_layouts(kind: str, style: str, in_rank: int, out_rank: int) -> tuple[set[str], str]:
    ins, out = MODULE_STYLES[kind][style]
    return {resolve(i, in_rank) for i in ins}, resolve(out, out_rank)


# -- op rules ------------------------------------------------------------------------------------


def _pkt(op: str) -> str:
    """``aten.gelu.default`` -> ``gelu``."""
    parts = op.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "aten" else op


def _norm_dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _shape(graph: Graph, ref: str) -> tuple[int, ...]:
    meta = graph.node(ref).out
    return meta.shape if meta is not None else ()


def _ints(value: object) -> bool:
    """None, an int or a sequence of ints (a dims argument)."""
    if value is None or isinstance(value, int):
        return True
    return isinstance(value, tuple | list) and all(isinstance(v, int) for v in value)


def _dims_arg(value: object, rank: int) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, int):
        return (_norm_dim(value, rank),)
    return tuple(_norm_dim(int(v), rank) for v in value)  # type: ignore[union-attr]


def _broadcast(node: Node, graph: Graph, ins: Sequence[str]) -> str | None:
    """Elementwise ops with broadcasting: all sharded inputs must shard the same output dim, and
    a replicated input must not span that dim (size 1 or absent there)."""
    out_rank = len(node.out.shape) if node.out else 0
    shapes = [_shape(graph, r) for r in node.inputs]
    target: int | None = None
    for layout, shp in zip(ins, shapes):
        if layout == D1:
            return None
        d = shard_dim(layout)
        if d is None:
            continue
        od = d + out_rank - len(shp)
        if shp[d] == 1 or (target is not None and od != target):
            return None
        target = od
    if target is None:
        return R
    for layout, shp in zip(ins, shapes):
        if layout == R:
            rd = target - (out_rank - len(shp))
            if 0 <= rd < len(shp) and shp[rd] != 1:
                return None
    return shard(target)


def _reshape_groups(
    src: tuple[int, ...], dst: tuple[int, ...]
) -> list[tuple[list[int], list[int]]]:
    """Pair runs of input dims with runs of output dims that have equal products."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        gi, gj = [], []
        pi = pj = 1
        if i < len(src):
            gi.append(i)
            pi = src[i]
            i += 1
        if j < len(dst):
            gj.append(j)
            pj = dst[j]
            j += 1
        while pi != pj:
            if pi < pj and i < len(src):
                pi *= src[i]
                gi.append(i)
                i += 1
            elif j < len(dst):
                pj *= dst[j]
                gj.append(j)
                j += 1
            else:
                break
        # trailing size-1 dims join the current group
        while j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            gj.append(j)
            j += 1
        groups.append((gi, gj))
    return groups


def _reshape(
    node: Node, graph: Graph, ins: Sequence[str], tp: int, pieces: int | None = None
) -> str | None:
    layout = ins[0]
    if layout == R:
        return R
    d = shard_dim(layout)
    if d is None:
        return None
    src = _shape(graph, node.inputs[0])
    dst = node.out.shape if node.out else ()
    literal = node.args[1] if len(node.args) > 1 else ()
    for gi, gj in _reshape_groups(src, dst):
        if d not in gi:
            continue
        # the shard must be on the outermost dim of its group on both sides (so each rank's piece
        # stays one contiguous block), and the local view must not name the full size: the
        # literal there has to be -1 (inferred locally).
        gi_sized = [k for k in gi if src[k] != 1]
        gj_sized = [k for k in gj if dst[k] != 1]
        if not gi_sized or not gj_sized or d != gi_sized[0]:
            return None
        od = gj_sized[0]
        if dst[od] % (pieces or tp) != 0:
            return None
        if (
            isinstance(literal, tuple)
            and len(literal) == len(dst)
            and literal[od] != -1
            and not _local_literal(node, graph, tp, od, pieces)
        ):
            return None
        return shard(od)
    return None


def _local_literal(node: Node, graph: Graph, tp: int, od: int, ratio: int | None = None) -> bool:
    """The sizes ``node`` names are the full ones, but on local heads it names the local size at
    ``od`` and the same sizes elsewhere: its attention block, run at a Megatron pair's local shapes
    with its head counts divided as ``module_attrs`` divides them, proved it (``ir._heads``).
    In a block that runs on DTensors (``Graph.dtensor_blocks``) every op sees full shapes: the
    full sizes are the right ones."""
    if node.module_fqn in graph.dtensor_blocks:
        return True
    info = graph.modules.get(node.module_fqn)
    if info is not None and info.type == CONV1D:  # its views run on DTensors once it is styled
        return True
    local = graph.local_literals.get(node.name, {}).get(tp)
    full = node.args[1] if len(node.args) > 1 else None
    if local is None or not isinstance(full, tuple) or len(full) != len(local):
        return False
    return all(
        (lo * (ratio or tp) == fu) if k == od else (lo == fu)
        for k, (lo, fu) in enumerate(zip(local, full))
    )


def _flatten(node: Node, graph: Graph, ins: Sequence[str], rank: int) -> str | None:
    """flatten(start, end): a shard on the outermost flattened dim of size > 1 stays outermost
    (each rank's block contiguous); on an inner one it would interleave."""
    d = shard_dim(ins[0])
    if ins[0] == R or d is None:
        return R if ins[0] == R else None
    start = _norm_dim(int(node.args[1]) if len(node.args) > 1 else 0, rank)
    end = _norm_dim(int(node.args[2]) if len(node.args) > 2 else -1, rank)
    if d < start:
        return ins[0]
    if d > end:
        return shard(d - (end - start))
    src = _shape(graph, node.inputs[0])
    return shard(start) if all(src[k] == 1 for k in range(start, d)) else None


def _unflatten(node: Node, graph: Graph, ins: Sequence[str], rank: int, tp: int) -> str | None:
    """unflatten(dim, sizes): the shard moves to the first new dim, whose size must be ``-1``
    or proven local on local heads (``fused.reshape(..., self.num_heads, 3, ...)``)."""
    d = shard_dim(ins[0])
    if ins[0] == R or d is None:
        return R if ins[0] == R else None
    dim = _norm_dim(int(node.args[1]), rank)
    sizes = tuple(node.args[2])
    if d != dim:
        return shard(d if d < dim else d + len(sizes) - 1)
    local = graph.local_literals.get(node.name, {}).get(tp)
    proven = local is not None and local[0] * tp == sizes[0] and local[1:] == sizes[1:]
    return shard(dim) if sizes[0] == -1 or proven else None


def _permute(node: Node, ins: Sequence[str], rank: int) -> str | None:
    layout = ins[0]
    d = shard_dim(layout)
    if layout == R or d is None:
        return R if layout == R else None
    op = _pkt(node.op)
    if op in ("transpose", "swapaxes"):
        a, b = (_norm_dim(int(x), rank) for x in node.args[1:3])
        return shard(b if d == a else a if d == b else d)
    if op == "t":
        return shard(1 - d) if rank == 2 else layout
    perm = tuple(_norm_dim(int(x), rank) for x in node.args[1])
    return shard(perm.index(d))


def _softmax(node: Node, ins: Sequence[str], rank: int) -> str | None:
    d = shard_dim(ins[0])
    if ins[0] == R:
        return R
    if d is None or d == _norm_dim(int(node.args[1]), rank):
        return None
    return ins[0]


def _reduce(node: Node, ins: Sequence[str], rank: int) -> str | None:
    if ins[0] == R and len(ins) == 1:
        return R
    d = shard_dim(ins[0])
    if d is None or len(ins) > 1:  # a second tensor input: no reduction this rule knows
        return None
    dims_value = node.args[1] if len(node.args) > 1 else None
    if not _ints(dims_value):
        return None
    dims = _dims_arg(dims_value, rank)
    if dims is None or d in dims:
        return None
    keep = bool(node.args[2]) if len(node.args) > 2 else dict(node.kwargs).get("keepdim", False)
    return shard(d if keep else d - sum(1 for x in dims if x < d))


def _unsqueeze(node: Node, ins: Sequence[str], rank: int) -> str | None:
    d = shard_dim(ins[0])
    if ins[0] == R:
        return R
    if d is None:
        return None
    at = _norm_dim(int(node.args[1]), rank + 1)
    return shard(d + 1 if at <= d else d)


def _squeeze(node: Node, graph: Graph, ins: Sequence[str]) -> str | None:
    d = shard_dim(ins[0])
    if ins[0] == R:
        return R
    if d is None:
        return None
    src = _shape(graph, node.inputs[0])
    if len(node.args) > 1:
        dims = _dims_arg(node.args[1], len(src)) or ()
    else:
        dims = tuple(k for k, s in enumerate(src) if s == 1)
    dims = tuple(k for k in dims if src[k] == 1)
    return shard(d - sum(1 for k in dims if k < d))


def _expand(node: Node, graph: Graph, ins: Sequence[str], tp: int) -> str | None:
    """expand: the sharded dim must be passed as -1 (kept), or as a size that is local on local
    heads (:func:`_local_literal`), not as its full size."""
    d = shard_dim(ins[0])
    if ins[0] == R:
        return R
    if d is None:
        return None
    src = _shape(graph, node.inputs[0])
    sizes = node.args[1]
    od = d + len(sizes) - len(src)
    return shard(od) if sizes[od] == -1 or _local_literal(node, graph, tp, od) else None


def _along(
    node: Node, graph: Graph, ins: Sequence[str], rank: int, tp: int, dim_pos: int, default: int = 0
) -> str | None:
    """Ops along one dim (split, slice, cat, index_select...): fine unless that dim is sharded
    (or the op splits a fused linear's output into its pieces: :func:`_fused_split`)."""
    if all(x == R for x in ins):
        return R
    layouts = {x for x in ins}
    if len(layouts) != 1:
        return None
    layout = next(iter(layouts))
    d = shard_dim(layout)
    args = node.args
    dim = int(args[dim_pos]) if len(args) > dim_pos else int(dict(node.kwargs).get("dim", default))
    if d is None:
        return None
    if d == _norm_dim(dim, rank):
        return layout if _fused_split(node, graph, tp, d) else None
    return layout


def _fused_split(node: Node, graph: Graph, tp: int, d: int) -> bool:
    """The split of a fused linear's output into its k pieces (``Graph.fused_linears``): each
    rank holds its slice of every piece, so each piece comes out sharded on ``d``, if tp
    divides a piece."""
    if _pkt(node.op) not in ("split", "chunk") or node.module_fqn not in graph.dtensor_blocks:
        return False
    src = graph.node(node.inputs[0])
    k = graph.fused_linears.get(src.module_fqn) if src.op == "aten.linear.default" else None
    return k is not None and src.out is not None and src.out.shape[d] % (k * tp) == 0


def _repeat_interleave(node: Node, ins: Sequence[str], rank: int) -> str | None:
    """repeat_interleave(x, n, dim) with an int ``n``: each element's copies are contiguous, so
    a block of x along ``dim`` gives the same block of the output (grouped-query attention
    expanding its local kv heads to its local query heads); sharded on another dim, it is
    elementwise there. Tensor repeats, a flattening call (no dim) or an ``output_size`` (a
    full size) need whole inputs."""
    if all(x == R for x in ins):
        return R
    d = shard_dim(ins[0])
    args, kwargs = node.args, dict(node.kwargs)
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    size = args[3] if len(args) > 3 else kwargs.get("output_size")  # a full size, if named
    if d is None or len(ins) > 1 or not isinstance(dim, int) or size is not None:
        return None
    return ins[0] if len(args) > 1 and isinstance(args[1], int) else None


def _select(node: Node, ins: Sequence[str], rank: int) -> str | None:
    d = shard_dim(ins[0])
    if ins[0] == R:
        return R
    if d is None:
        return None
    dim = _norm_dim(int(node.args[1]), rank)
    if dim == d:
        return None
    return shard(d - 1 if dim < d else d)


def _sdpa(node: Node, graph: Graph, ins: Sequence[str]) -> str | None:
    """q, k, v of shape (batch, heads, seq, head_dim): all replicated, or all sharded on the same
    batch or heads dim; an attention mask must be replicated and broadcast on that dim (k and v
    of one head beside q sharded on heads: :func:`_partial`)."""
    qkv, rest = ins[:3], ins[3:]
    if len(set(qkv)) != 1:
        return None
    layout = qkv[0]
    if layout == R:
        return R if all(x == R for x in rest) else None
    if layout not in ("S0", "S1"):
        return None
    d = shard_dim(layout)
    for ref, x in zip(node.inputs[3:], rest):
        shp = _shape(graph, ref)
        if x != R or (len(shp) == 4 and shp[d] != 1):
            return None
    return layout


def _fused_heads(node: Node, graph: Graph, ins: Sequence[str], tp: int) -> str | None:
    """Ops on :data:`FUSED` ``F<d>``: views keeping d outermost with ``-1`` there; the split into
    the pieces (sizes proven local: the query heads' count divided by tp, ``ir._heads``), a slice
    of the query heads (all but the trailing kv heads) and a select of a kv head (a negative
    index). The query heads' piece comes out ``S<d>``, each kv piece :data:`RP`."""
    if len(ins) != 1:
        return None
    d = int(ins[0][len(FUSED) :])
    op = _pkt(node.op)
    src = _shape(graph, node.inputs[0])
    if node.op == "getitem":
        index = node.args[1] if len(node.args) > 1 else None
        return shard(d) if index == 0 else RP if isinstance(index, int) else None
    if op in ("view", "reshape", "_unsafe_view"):
        dst = node.out.shape if node.out else ()
        literal = node.args[1] if len(node.args) > 1 else ()
        for gi, gj in _reshape_groups(src, dst):
            sized_i = [k for k in gi if src[k] != 1]
            sized_j = [k for k in gj if dst[k] != 1]
            if d in gi:
                ok = sized_i[:1] == [d] and sized_j and len(literal) == len(dst)
                return f"{FUSED}{sized_j[0]}" if ok and literal[sized_j[0]] == -1 else None
        return None
    linear = _fused_source(graph, node.inputs[0], tp)
    if (
        linear is None
        or _norm_dim(int(node.args[1 if op != "split_with_sizes" else 2]), len(src)) != d
    ):
        return None
    q_rows, out_rows = linear
    trailing = 1
    for size in src[d + 1 :]:
        trailing *= size
    kv = (out_rows - q_rows) // trailing
    if op == "split_with_sizes":
        sizes = tuple(node.args[1])
        local = graph.local_literals.get(node.name, {}).get(tp)
        fits = sizes[0] * trailing == q_rows and sum(sizes[1:]) == kv
        return ins[0] if fits and local == (sizes[0] // tp, *sizes[1:]) else None
    if op == "slice":
        start, end = (tuple(node.args[2:4]) + (None, None))[:2]
        step = node.args[4] if len(node.args) > 4 else 1
        return shard(d) if start in (0, None) and end == -kv and step == 1 else None
    if op == "select":
        index = node.args[2]
        return RP if isinstance(index, int) and -kv <= index < 0 else None
    return None


def _fused_source(graph: Graph, ref: str, tp: int) -> tuple[int, int] | None:
    """(query rows, all rows) of the fused projection whose output ``ref`` views, where it runs
    fused at ``tp`` (``Graph.fused_heads``)."""
    node = graph.node(ref)
    while _pkt(node.op) in ("view", "reshape", "_unsafe_view") and len(node.inputs) == 1:
        node = graph.node(node.inputs[0])
    info = graph.modules.get(node.module_fqn)
    if node.op != "aten.linear.default" or tp not in graph.fused_heads.get(node.module_fqn, ()):
        return None
    weight = info.params.get("weight") if info is not None else None
    return (weight.shape[1], weight.shape[0]) if weight is not None else None


def gqa(node: Node) -> bool:
    """Whether an SDPA call passes ``enable_gqa=True``."""
    return dict(node.kwargs).get("enable_gqa") is True


def _matmul(node: Node, graph: Graph, ins: Sequence[str]) -> str | None:
    """Functional matmul/bmm of a (..., m, k) and b (..., k, n): batch dims sharded alike on both
    (or on one, where the other broadcasts there), rows of a, or columns of b."""
    a, b = ins[0], ins[1]
    sa, sb = _shape(graph, node.inputs[0]), _shape(graph, node.inputs[1])
    ra, rb = len(sa), len(sb)
    out_rank = len(node.out.shape) if node.out else 0
    if a == R and b == R:
        return R
    if D1 in (a, b) or ra < 2 or rb < 2:
        return None
    da, db = shard_dim(a), shard_dim(b)
    oa = None if da is None else da + out_rank - ra
    ob = None if db is None else db + out_rank - rb
    if da is not None and db is not None:
        return shard(oa) if da < ra - 2 and db < rb - 2 and oa == ob else None
    if da is not None:  # b replicated
        if da == ra - 1:
            return None  # contracting dim sharded: a partial sum
        bd = oa - (out_rank - rb)
        if da < ra - 2 and 0 <= bd < rb - 2 and sb[bd] != 1:
            return None
        return shard(oa)
    if db == rb - 1:  # a replicated, columns of b sharded
        return shard(out_rank - 1)
    ad = ob - (out_rank - ra)
    if db < rb - 2 and not (0 <= ad < ra - 2 and sa[ad] != 1):
        return shard(ob)
    return None


def _norm_fn(node: Node, ins: Sequence[str], rank: int) -> str | None:
    """Functional layer_norm / rms_norm without parameters: shard outside the normalized dims."""
    if ins[0] == R:
        return R if all(x == R for x in ins[1:]) else None
    d = shard_dim(ins[0])
    if d is None or any(x != R for x in ins[1:]):
        return None
    normalized = len(node.args[1]) if len(node.args) > 1 else 1
    return ins[0] if d < rank - normalized else None


def propagate(node: Node, graph: Graph, ins: Sequence[str], tp: int) -> str | None:
    """Layout of ``node``'s output when its tensor inputs have layouts ``ins`` and the op runs on
    local pieces; ``None`` where that would not compute the right piece."""
    op = _pkt(node.op)
    rank = len(_shape(graph, node.inputs[0])) if node.inputs else 0
    if not node.inputs:
        return R
    if D1 in ins or DR in ins:
        return None  # DTensors go into module styles only
    if any(x.startswith(FUSED) for x in ins):
        return _fused_heads(node, graph, ins, tp)
    if RP in ins:
        return _partial(node, graph, ins, tp)
    if any(x.startswith(KV) for x in ins):
        return _kv.grouped(node, graph, ins, tp)
    if node.op == "getitem" or op in _UNARY:
        return ins[0] if all(x == R for x in ins[1:]) and ins[0] != D1 else None
    if op in _BINARY or (op in ("min", "max") and len(node.inputs) == 2):
        # torch.min(a, b) / torch.max(a, b) of two tensors (aten min.other / max.other): the
        # elementwise minimum / maximum, not a reduction
        return _broadcast(node, graph, ins)
    rule: Callable[[], str | None] | None = {
        "view": lambda: _reshape(node, graph, ins, tp),
        "reshape": lambda: _reshape(node, graph, ins, tp),
        "_unsafe_view": lambda: _reshape(node, graph, ins, tp),
        "transpose": lambda: _permute(node, ins, rank),
        "swapaxes": lambda: _permute(node, ins, rank),
        "t": lambda: _permute(node, ins, rank),
        "permute": lambda: _permute(node, ins, rank),
        "softmax": lambda: _softmax(node, ins, rank),
        "_softmax": lambda: _softmax(node, ins, rank),
        "log_softmax": lambda: _softmax(node, ins, rank),
        "_log_softmax": lambda: _softmax(node, ins, rank),
        "unsqueeze": lambda: _unsqueeze(node, ins, rank),
        "flatten": lambda: _flatten(node, graph, ins, rank),
        "unflatten": lambda: _unflatten(node, graph, ins, rank, tp),
        "squeeze": lambda: _squeeze(node, graph, ins),
        "expand": lambda: _expand(node, graph, ins, tp),
        "split": lambda: _along(node, graph, ins, rank, tp, 2),
        "split_with_sizes": lambda: _along(node, graph, ins, rank, tp, 2),
        "chunk": lambda: _along(node, graph, ins, rank, tp, 2),
        "unbind": lambda: _along(node, graph, ins, rank, tp, 1),
        "slice": lambda: _along(node, graph, ins, rank, tp, 1),
        "narrow": lambda: _along(node, graph, ins, rank, tp, 1),
        "cat": lambda: _along(node, graph, ins, rank, tp, 1),
        "index_select": lambda: _along(node, graph, ins, rank, tp, 1),
        "select": lambda: _select(node, ins, rank),
        "repeat_interleave": lambda: _repeat_interleave(node, ins, rank),
        "scaled_dot_product_attention": lambda: _sdpa(node, graph, ins),
        "matmul": lambda: _matmul(node, graph, ins),
        "bmm": lambda: _matmul(node, graph, ins),
        "layer_norm": lambda: _norm_fn(node, ins, rank),
        "rms_norm": lambda: _norm_fn(node, ins, rank),
    }.get(op)
    if op in _REDUCE:
        return _reduce(node, ins, rank)
    if op in _FACTORY:
        return R if all(x == R for x in ins) else None
    if rule is not None:
        return rule()
    # unknown op: correct only when every input is whole on every rank
    return R if all(x == R for x in ins) else None


def common_layouts(domains: Iterable[Sequence[str]]) -> list[str]:
    """The layouts every domain holds, once each, in the first domain's order (never a set's:
    that order follows the process's string hashing, and a plan cache keeps the ILP's answers
    as indices into the transitions built from these)."""
    first, *rest = [tuple(d) for d in domains]
    others = [set(d) for d in rest]
    return [x for x in dict.fromkeys(first) if all(x in d for d in others)]


def allowed_transitions(
    node: Node, graph: Graph, domains: Sequence[Sequence[str]], tp: int
) -> list[tuple[tuple[str, ...], str]]:
    """Every (input layouts, output layout) pair that ``node`` supports, over the inputs' domains."""
    if len(domains) > 4:
        # wide ops (cat of many): only uniform layouts
        combos = [tuple([x] * len(domains)) for x in common_layouts(domains)]
    else:
        combos = list(product(*domains))
    out = []
    for ins in combos:
        res = propagate(node, graph, ins, tp)
        if res is not None:
            out.append((ins, res))
    return out


__all__ = [
    "CONV1D",
    "D1",
    "DR",
    "FUSED",
    "KV",
    "MODULE_OPS",
    "MODULE_STYLES",
    "PARTIAL_KEEP",
    "R",
    "RP",
    "SEQUENCE_STYLES",
    "allowed_transitions",
    "candidate_layouts",
    "common_layouts",
    "gqa",
    "propagate",
    "shard",
    "shard_dim",
    "style_layouts",
]


from autopar.planner import _kv  # noqa: E402 (its rules read this module's helpers)
from autopar.planner._kv import PARTIAL_KEEP, _partial  # noqa: E402
