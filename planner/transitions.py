"""The intra-layer ILP's model inputs: A(n), the transitions each op node of the collapsed graph
may run (input layouts -> output layout, a unit's style), and each transition's cost parts
(compute, TP communication, gradient sync) for the :class:`CostInputs` of one mesh; the
formulation itself is :mod:`planner.ilp`'s docstring.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost_model import DeviceSpec, Link
from autopar.cost_model.estimate import (
    TP_OPS_PER_STYLED_CALL,
    blocking_collective_s,
    node_time_s,
    output_bytes,
    scaled,
)
from autopar.ir import Graph, Node
from autopar.planner.collapse import Collapsed, Unit
from autopar.planner.layouts import (
    DR,
    FUSED,
    KV,
    MODULE_STYLES,
    RP,
    SEQUENCE_STYLES,
    R,
    allowed_transitions,
    candidate_layouts,
    common_layouts,
    shard,
    style_layouts,
)


@dataclass(frozen=True)
class CostInputs:
    """What the ILP's costs depend on besides the graph: fixed per mesh."""

    tp: int
    batch_scale: float
    """local batch per rank / the batch the graph was traced with."""
    device: DeviceSpec
    dtype: str
    tp_link: Link
    grad_sync_s_per_byte: float = 0.0
    """data-parallel gradient traffic time per byte of local parameters (0 without DP)."""
    shard_all: bool = False
    """the user pinned this tp degree: shard as many modules as can be sharded at it (see
    :meth:`Solver.solve`), the cheapest such assignment, instead of the cheapest overall."""
    shared_input: bool = True
    """the program moves one collective per activation for all the column-parallel
    projections that read it: each of n sibling colwise calls is charged 1/n of its input's
    collectives. autopar's script does (``autopar_runtime.tensor_parallel.shared_input``), as
    Megatron-LM (fused QKV) and torchtitan (``PrepareModuleInput``) do; False prices torch's
    ColwiseParallel on its own, one per projection."""


@dataclass(frozen=True)
class Transition:
    ins: tuple[str, ...]
    out: str
    style: str | None = None
    scatter: bool = False
    """computed whole (R), then split along the sequence at the next layer's boundary."""


@dataclass(frozen=True)
class NodeCost:
    compute_s: float = 0.0
    comm_s: float = 0.0
    sync_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s + self.sync_s


def _data_input(node: Node) -> int:
    """Index, among the node's tensor inputs, of the activation a unit op reads (embedding:
    (weight, ids); Conv1D's addmm: (bias, x, weight))."""
    return 1 if node.op in ("aten.embedding.default", "aten.addmm.default") else 0


def _x_ref(c: Collapsed, node: Node) -> str:
    """The activation a unit's call reads (a folded norm: the norm's input)."""
    return c.group_input.get(node.name) or node.inputs[_data_input(node)]


def _domain(c: Collapsed, graph: Graph, name: str, tp: int) -> tuple[str, ...]:
    if name in c.fixed:
        return (R,)
    meta = graph.node(name).out
    own = candidate_layouts(meta, tp)
    if tp > 1 and name in c.fused and meta is not None:
        own = (*own, *(f"{FUSED}{d}" for d in range(len(meta.shape))))
    if tp > 1 and name in c.kv and meta is not None:
        rank = len(meta.shape)
        own = (*own, *(f"{KV}{d}" for d in range(rank)), *(f"KR{d}" for d in range(rank - 1)))
    return (*own, RP) if tp > 1 and name in c.partial else own


def node_transitions(
    c: Collapsed, graph: Graph, node: Node, unit: Unit | None, tp: int
) -> list[Transition]:
    """A(n): the transitions node n may run, restricted to its producers' and its own domains."""
    # in the first producer's domain's order (layouts.common_layouts: never a set's)
    in_domains = [
        tuple(common_layouts(_domain(c, graph, p, tp) for p in sorted(prods)))
        for prods in c.producers[node.name]
    ]
    own = set(_domain(c, graph, node.name, tp))
    if unit is None:
        if node.params:  # a parameter read outside a unit: whole inputs only
            in_domains = [(R,) for _ in in_domains]
        plain = [
            Transition(ins, out)
            for ins, out in allowed_transitions(node, graph, in_domains, tp)
            if out in own
        ]
        if node.name in c.scatter and shard(1) in own:
            plain += [Transition(t.ins, shard(1), scatter=True) for t in plain if t.out == R]
        return plain
    k = 0 if node.name in c.groups else _data_input(node)
    x_rank = len(graph.node(_x_ref(c, node)).out.shape)
    out_rank = len(node.out.shape)
    result = []
    scatter = node.name in c.scatter and shard(1) in own
    # one rank shards nothing: every style but replicate would only rename it (and give the
    # ILP choices that cost a CP-SAT solve to tell apart)
    styles = [s for s in unit.styles if s == "replicate"] if tp == 1 else unit.styles
    for style in styles or unit.styles:
        accepted, out = style_layouts(unit.kind, style, x_rank, out_rank)
        if out not in own or (scatter and out == shard(1)):
            # before a layer boundary where the sequence can be split, split it there: the
            # model's code in between may read the sequence length from this output (HF
            # models take positions from inputs_embeds.shape[1]), which a local shard breaks
            continue
        for lin in sorted(accepted & set(in_domains[k])):
            if lin == shard(1) and unit.fqn in c.sequence_sized:
                continue  # a local shard would give the module's own views the local length
            ins = tuple(lin if i == k else R for i in range(len(in_domains)))
            if all(x in d for x, d in zip(ins, in_domains)):
                result.append(Transition(ins, out, style))
                if scatter and out == R:
                    result.append(Transition(ins, shard(1), style, scatter=True))
    return result


def transition_cost(
    graph: Graph,
    node: Node,
    t: Transition,
    unit: Unit | None,
    k: CostInputs,
    *,
    group: tuple[str, ...] = (),
    x_ref: str | None = None,
    siblings: int = 1,
) -> NodeCost:
    """Forward + backward time of node n under transition t, split into parts. A folded norm
    (``group``: its nodes, ``x_ref``: its input) costs all its nodes; under a sequence-parallel
    style each of them is a DTensor op (2 dispatches, forward and backward) besides the style's
    own. ``siblings``: the Linear calls that read n's input and are column-parallel exactly when
    n is (the ILP ties them: ``ilp._sibling_groups``), n among them: with
    ``k.shared_input`` one collective on that input serves them all."""
    # ops on a kv head (K, KR) priced whole: they hold 1/kv_heads, not 1/tp
    whole = t.out in (R, RP) or t.out.startswith(KV)
    sharded = not whole and not t.scatter if t.style is None else t.style != "replicate"
    styled = t.style not in (None, "replicate")
    nodes = [graph.node(g) for g in group] if group else [node]
    compute = sum(
        node_time_s(
            graph,
            n,
            k.device,
            k.dtype,
            batch_scale=k.batch_scale,
            shards=k.tp if sharded else 1,
            tp_ops=(TP_OPS_PER_STYLED_CALL if n is nodes[0] else 2) if styled else 0,
        )
        for n in nodes
    )
    if unit is None:
        if t.scatter:  # split for free in forward; the gradient all-gathered in backward
            out = scaled(graph, node, output_bytes(graph, node.name), k.batch_scale)
            return NodeCost(compute, tp_collective_s("all_gather", out, k))
        return NodeCost(compute_s=compute)
    x_ref = x_ref or node.inputs[_data_input(node)]
    x_bytes = scaled(graph, node, output_bytes(graph, x_ref), k.batch_scale)
    out_bytes = scaled(graph, node, output_bytes(graph, node.name), k.batch_scale)
    siblings = max(1, siblings) if k.shared_input and unit.kind == "linear" else 1
    style = t.style or "replicate"
    if unit is not None and unit.kind == "fused_linear" and style == "colwise":
        style = "colwise_gather_heads"  # run fused: output gathered, its gradient summed
    comm = _style_comm(style, x_bytes, out_bytes, unit, k, siblings)
    if t.scatter:
        comm += tp_collective_s("all_gather", out_bytes, k)
    if t.ins[0 if group else _data_input(node)] == DR:
        # a gathered sequence: the readers' partial input gradients add up as DTensors and the
        # norm's reduce-scatter reduces them once (sequence_parallel_gather pays it)
        comm -= _style_comm("colwise", x_bytes, out_bytes, unit, k, siblings)
    return NodeCost(compute, comm, k.grad_sync_s_per_byte * _sync_bytes(t, unit, k.tp))


# every style but these shards the module's weight across the TP group
_SHARDS_PARAMS = {s for styles in MODULE_STYLES.values() for s in styles} - {
    "replicate",
    *SEQUENCE_STYLES,
}


def shards_weights(style: str) -> bool:
    """Whether ``style`` splits the module's weight across the TP group."""
    return style in _SHARDS_PARAMS


def tp_collective_s(kind: str, num_bytes: float, k: CostInputs) -> float:
    """One collective over the TP group, which the layer waits on
    (:func:`cost_model.estimate.blocking_collective_s`)."""
    return blocking_collective_s(kind, num_bytes, k.tp, k.tp_link, k.device)  # type: ignore[arg-type]


def _style_comm(
    style: str, x_bytes: float, out_bytes: float, unit: Unit, k: CostInputs, siblings: int = 1
) -> float:
    """Forward + backward collectives of one call of a styled module on the TP link; those on
    its input (a colwise style's) are shared with its ``siblings`` (``CostInputs.shared_input``)."""

    def coll(kind: str, num_bytes: float) -> float:
        return tp_collective_s(kind, num_bytes, k)

    parts = {
        "replicate": [],
        # the replicated input's gradient is a partial sum per rank: all-reduced in backward
        "colwise": [("all_reduce", x_bytes)],
        "colwise_gather": [("all_reduce", x_bytes), ("all_gather", out_bytes)],
        # its output's gradient, a partial sum per rank, reduce-scattered back
        "colwise_gather_heads": [
            ("all_reduce", x_bytes),
            ("all_gather", out_bytes),
            ("reduce_scatter", out_bytes),
        ],
        # the same for each rank's kv head: the whole output gathered, the rank's head kept
        "colwise_kv_heads": [
            ("all_reduce", x_bytes),
            ("all_gather", out_bytes),
            ("reduce_scatter", out_bytes),
        ],
        # a sequence-sharded input is all-gathered; its gradient reduce-scattered back
        "colwise_from_seq": [("all_gather", x_bytes), ("reduce_scatter", x_bytes)],
        "colwise_from_seq_gather": [
            ("all_gather", x_bytes),
            ("reduce_scatter", x_bytes),
            ("all_gather", out_bytes),
        ],
        "rowwise": [("all_reduce", out_bytes)],
        "rowwise_to_seq": [("reduce_scatter", out_bytes), ("all_gather", out_bytes)],
        "rowwise_from_replicate": [("all_reduce", out_bytes)],
        "rowwise_from_replicate_to_seq": [("reduce_scatter", out_bytes), ("all_gather", out_bytes)],
        # parameters stay replicated; their gradients (partial per rank) are all-reduced
        "sequence_parallel": [("all_reduce", unit.param_bytes)],
        # the same, the output a local tensor (for plain ops after the norm)
        "sequence_parallel_local": [("all_reduce", unit.param_bytes)],
        # a per-head norm on local heads: the same weight-gradient all-reduce
        "heads_parallel_local": [("all_reduce", unit.param_bytes)],
        # and the output all-gathered along the sequence (once for every colwise reader), its
        # gradient (the readers' partial sums added up) reduce-scattered back
        "sequence_parallel_gather": [
            ("all_reduce", unit.param_bytes),
            ("all_gather", out_bytes),
            ("reduce_scatter", out_bytes),
        ],
    }[style]
    # a colwise style's collectives on x (all but the gather of its output) serve its siblings
    shared = siblings if style.startswith("colwise") else 1
    return sum(
        coll(kind, b) / (1 if (kind, b) == ("all_gather", out_bytes) else shared)
        for kind, b in parts
    )


def _sync_bytes(t: Transition, unit: Unit | None, tp: int) -> float:
    """Local parameter bytes a call under transition t synchronises (its unit's share)."""
    if unit is None:
        return 0.0
    return unit.param_bytes / (tp if t.style in _SHARDS_PARAMS else 1) / len(unit.calls)
