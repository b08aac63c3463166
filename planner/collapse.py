"""The intra-layer ILP's block reuse: the traced graph collapsed onto its first layer of each run of
identical layers (equal :attr:`ir.Layer.signature`), whose costs then count once per member,
and the parallelizable units (Linear / Embedding modules and norms) the ILP styles. The sets T,
U and P(n, i) of :mod:`planner.ilp`'s formulation are built here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from autopar.ir import Graph, Node
from autopar.planner.layouts import (
    MODULE_OPS,
    MODULE_STYLES,
    PARTIAL_KEEP,
    gqa,
)
from autopar.planner.norms import NormModule, heads_norm, norm_modules, scatter_layers


@dataclass(frozen=True)
class Unit:
    fqn: str
    kind: str
    """linear | embedding | norm."""
    calls: tuple[str, ...]
    """node names of the op calls of this unit (in the collapsed graph)."""
    param_bytes: int
    styles: tuple[str, ...]


@dataclass(frozen=True)
class Collapsed:
    """The graph with runs of identical layers folded onto their first layer."""

    nodes: tuple[Node, ...]
    """tensor-producing compute nodes kept, in topological order."""
    mult: dict[str, int]
    producers: dict[str, tuple[tuple[str, ...], ...]]
    """node -> per tensor input, the producer names (remapped into the collapsed graph)."""
    fixed: set[str]
    """producers whose layout is fixed to R: user inputs, parameters, buffers."""
    outputs: set[str]
    """nodes read by the graph output."""
    units: tuple[Unit, ...]
    members: dict[str, tuple[str, ...]]
    """representative layer FQN -> FQNs of all layers it stands for."""
    unit_members: dict[str, tuple[str, ...]]
    """unit FQN -> the module FQNs it stands for (one per member layer of its run)."""
    module_rank: dict[str, int]
    """every FQN of unit_members -> its rank in model order."""
    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """a norm's output node -> every op node of the norm (folded into the output node)."""
    group_input: dict[str, str] = field(default_factory=dict)
    """a norm's output node -> the activation the norm reads."""
    scatter: dict[str, str] = field(default_factory=dict)
    """node -> the layer where it may enter the sequence-parallel region (scatter_layers)."""
    sequence_sized: frozenset[str] = frozenset()
    """linear units whose enclosing module names the sequence length in its ops' literal sizes
    (:func:`_sequence_sized`): they may not read a plain local sequence shard."""
    partial: frozenset[str] = frozenset()
    """nodes that may take ``layouts.RP`` (a one-head kv projection: ``partial_nodes``)."""
    fused: frozenset[str] = frozenset()
    """nodes that may take ``layouts.FUSED`` (a fused q/k/v projection's output and its views
    up to its split: ``fused_nodes``)."""
    kv: frozenset[str] = frozenset()
    """nodes that may take ``layouts.KV`` (several kv heads fewer than tp: ``kv_nodes``)."""
    norm_modules: frozenset[str] = frozenset()
    """the FQNs of the norms :func:`planner.norms.norm_modules` recognises."""
    scatter_modules: frozenset[str] = frozenset()
    """the FQNs of the layers whose input may enter the sequence-parallel region (every value
    of :func:`planner.norms.scatter_layers`)."""
    fqn_keys: dict[str, list] = field(default_factory=dict)
    """memo of :func:`_fqn_key` (model order) for the FQNs the ILP's solutions sort."""


def _runs(graph: Graph) -> list[list[str]]:
    """Consecutive layers with equal signatures, as lists of layer FQNs."""
    runs: list[list[str]] = []
    for layer in graph.layers:
        if runs and graph.layer(runs[-1][0]).signature == layer.signature:
            runs[-1].append(layer.fqn)
        else:
            runs.append([layer.fqn])
    return runs


def collapse(graph: Graph) -> Collapsed:
    """The graph with runs of identical layers folded onto their first layer (compute once per
    graph and share it across TP degrees: :class:`Solver` takes it)."""
    return _collapse(graph)


def _collapse(graph: Graph) -> Collapsed:
    rename: dict[str, str] = {}
    mult: dict[str, int] = {}
    members: dict[str, tuple[str, ...]] = {}
    for run in _runs(graph):
        rep = graph.layer(run[0])
        members[rep.fqn] = tuple(run)
        for fqn in run:
            layer = graph.layer(fqn)
            assert len(layer.nodes) == len(rep.nodes), (fqn, rep.fqn)
            for own, rep_name in zip(layer.nodes, rep.nodes):
                rename[own] = rep_name
        for name in rep.nodes:
            mult[name] = len(run)
    fixed = {n.name for n in graph.nodes if n.kind in ("input", "param", "buffer")}
    producers: dict[str, list[set[str]]] = {}
    outputs: set[str] = set()
    for n in graph.nodes:
        if n.kind == "output":
            outputs.update(rename.get(i, i) for i in n.inputs)
            continue
        if n.kind != "compute" or n.out is None:
            continue
        rep = rename[n.name]
        slots = producers.setdefault(rep, [set() for _ in n.inputs])
        for slot, i in zip(slots, n.inputs):
            slot.add(rename.get(i, i))
    norms = norm_modules(graph)
    groups, group_input = _fold_norms(graph, producers, norms)
    kept = tuple(graph.node(name) for name in producers)
    units = _units(graph, kept, groups, norms)
    unit_members = {u.fqn: tuple(_member_fqns(graph, members, u.fqn)) for u in units}
    every = sorted({f for fqns in unit_members.values() for f in fqns}, key=_fqn_key)
    scatter = scatter_layers(graph, norms)
    return Collapsed(
        nodes=kept,
        mult=mult,
        producers={k: tuple(tuple(sorted(s)) for s in v) for k, v in producers.items()},
        fixed=fixed,
        outputs=outputs,
        units=units,
        members=members,
        unit_members=unit_members,
        module_rank={f: i for i, f in enumerate(every)},
        groups=groups,
        group_input=group_input,
        scatter={
            n: fqn
            for n, fqn in scatter.items()
            if n in producers and mult.get(n, 1) == 1 and n not in outputs
        },
        norm_modules=frozenset(norms),
        scatter_modules=frozenset(scatter.values()),
        sequence_sized=_sequence_sized(graph, units),
        partial=partial_nodes(graph),
        fused=fused_nodes(graph),
        kv=kv_nodes(graph),
    )


def _ints(args) -> Iterator[int]:
    for a in args:
        if isinstance(a, (tuple, list)):
            yield from _ints(a)
        elif isinstance(a, int) and not isinstance(a, bool):
            yield a


def _sequence_sized(graph: Graph, units: tuple[Unit, ...]) -> frozenset[str]:
    """Linear units whose enclosing module has an op with the sequence length (dim 1 of the
    unit's input) among its literal sizes.

    The trace records sizes as literals, whatever their source. Where the module computed one
    from its input's shape (``hidden_states.shape[:-1]`` in HF BERT and Llama attention, ``B, T,
    C = x.size()`` in nanoGPT), a plain local sequence shard as that input (the
    ``sequence_parallel_local`` norm's output) gives the module the local length, and its views
    of the all-gathered q/k/v come out wrong. A DTensor input reports its global shape, so
    ``colwise_from_seq`` stays open with a DTensor (``D1``) input."""
    out = set()
    for unit in units:
        if unit.kind != "linear" or not any(s.startswith("colwise_from_seq") for s in unit.styles):
            continue
        x = graph.node(graph.node(unit.calls[0]).inputs[0]).out
        parent = unit.fqn.rpartition(".")[0]
        if x is None or len(x.shape) < 3 or not parent:
            continue
        seq = x.shape[1]
        if any(
            parent in n.module_stack and seq in _ints(n.args)
            for n in graph.nodes
            if n.kind == "compute" and not n.params
        ):
            out.add(unit.fqn)
    return frozenset(out)


def _fold_norms(
    graph: Graph, producers: dict[str, list[set[str]]], norms: dict[str, NormModule]
) -> tuple[dict[str, tuple[str, ...]], dict[str, str]]:
    """Fold each kept norm (:func:`layouts.norm_modules`) onto its output node, in place: the
    output node reads the norm's input (the producers of the slot that reads it), the norm's
    other nodes leave the ILP. Returns (output -> the norm's nodes, output -> its input)."""
    groups, group_input = {}, {}
    for norm in norms.values():
        if norm.output not in producers or any(n not in producers for n in norm.nodes):
            continue  # a copy of a norm in a collapsed run: its representative stands for it
        slot = next(
            slots[i]
            for name in norm.nodes
            for i, ref in enumerate(graph.node(name).inputs)
            if ref == norm.input
            for slots in (producers[name],)
        )
        for name in norm.nodes:
            if name != norm.output:
                del producers[name]
        producers[norm.output] = [set(slot)]
        if norm.aliases:  # ops outside that read an alias of the input read the input
            for slots in producers.values():
                for other in slots:
                    if other & set(norm.aliases):
                        other -= set(norm.aliases)
                        other |= slot
        groups[norm.output] = norm.nodes
        group_input[norm.output] = norm.input
    return groups, group_input


def _units(
    graph: Graph,
    kept: tuple[Node, ...],
    groups: dict[str, tuple[str, ...]],
    norms: dict[str, NormModule],
) -> tuple[Unit, ...]:
    """Parallelizable modules. A unit may take a TP style only if the parameters its calls read
    are its own and nothing else reads them (a tied weight stays replicated). A folded norm's
    call is its output node, standing for all its nodes."""
    readers: dict[str, set[str]] = {}
    for n in graph.nodes:
        for p in n.params if n.kind == "compute" else ():
            readers.setdefault(p, set()).add(n.name)
    every_call: dict[str, set[str]] = {}
    for n in graph.nodes:
        info = MODULE_OPS.get(n.module_type)
        if info and n.op == info[1] and n.module_fqn in graph.modules:
            every_call.setdefault(n.module_fqn, set()).add(n.name)
    for norm in norms.values():
        every_call[norm.fqn] = set(norm.nodes)
    calls: dict[str, list[str]] = {}
    for n in kept:
        fqn = next((f for f in n.module_stack if f in norms and n.name in groups), n.module_fqn)
        if n.name in every_call.get(fqn, ()):
            calls.setdefault(fqn, []).append(n.name)
    units = []
    for fqn, names in calls.items():
        mod = graph.modules[fqn]
        kind = "norm" if fqn in norms else MODULE_OPS[mod.type][0]
        if fqn in graph.fused_heads:  # a fused q/k/v projection: colwise runs it fused
            kind = "fused_linear"
        all_calls = every_call[fqn]
        read = {
            p for name in names for g in groups.get(name, (name,)) for p in graph.node(g).params
        }
        own = bool(read) and all(
            p.rpartition(".")[0] == fqn and readers[p] <= all_calls for p in read
        )
        styles = tuple(MODULE_STYLES[kind]) if own else ("replicate",)
        if kind == "norm" and not heads_norm(graph, norms[fqn]):
            styles = tuple(x for x in styles if x != "heads_parallel_local")
        if fqn not in graph.grouped_kv or set(graph.grouped_kv[fqn].values()) == {1}:
            styles = tuple(x for x in styles if x != "colwise_kv_heads")
        pbytes = sum(m.num_bytes for m in mod.params.values())
        units.append(Unit(fqn, kind, tuple(names), pbytes, styles))
    return tuple(units)


def _fqn_key(fqn: str) -> list:
    return [int(p) if p.isdigit() else p for p in fqn.split(".")]


def _member_fqns(graph: Graph, members: dict[str, tuple[str, ...]], fqn: str) -> Iterator[str]:
    """The FQNs a representative module stands for, one per member layer of its run."""
    for rep, fqns in members.items():
        if graph.layer(rep).is_module and (fqn == rep or fqn.startswith(rep + ".")):
            rel = fqn[len(rep) :]
            for member in fqns:
                yield member + rel
            return
    yield fqn


def partial_nodes(graph: Graph) -> frozenset[str]:
    """Nodes that may take :data:`RP`: from the one-head k or v an expand to local heads or an
    SDPA with ``enable_gqa`` reads, back through views and transposes to its linear's call
    (a one-head kv projection of a block proven on local query heads, ``ir._heads``)."""
    blocks = {graph.node(n).module_fqn for n in graph.local_literals}
    blocks |= {fqn.rpartition(".")[0] for fqn in graph.fused_heads}
    if not blocks:
        return frozenset()
    starts: list[str] = []
    for n in graph.nodes:
        if n.kind != "compute" or n.module_fqn not in blocks or not n.inputs:
            continue
        op = _op_name(n.op)
        if op == "expand" and n.name in graph.local_literals:
            starts.append(n.inputs[0])
        elif op == "scaled_dot_product_attention" and gqa(n):
            starts += [r for r in n.inputs[1:3] if _shape(graph, r)[1:2] == (1,)]
    out: set[str] = set()
    grad = _needs_grad(graph) if graph.fused_heads else set()
    for ref in starts:
        fused = _from_fused(graph, ref, grad) if graph.fused_heads else None
        if fused:
            out |= fused
            continue
        chain = []
        node = graph.node(ref)
        while (
            node.kind == "compute" and _op_name(node.op) in PARTIAL_KEEP and len(node.inputs) == 1
        ):
            chain.append(node.name)
            node = graph.node(node.inputs[0])
        if node.op == "aten.linear.default":
            out.update((*chain, node.name))
    return frozenset(out)


_VIEWS = ("view", "reshape", "_unsafe_view")


def kv_nodes(graph: Graph) -> frozenset[str]:
    """Nodes that may take ``layouts.KV``: from the calls of kv projections that run grouped
    (``Graph.grouped_kv``, several kv heads) forward through their block's ops up to its SDPA,
    leaving out any op that also reads a tensor needing a gradient from elsewhere (its
    gradient would be a partial sum per rank with nothing to sum it)."""
    linears = {f for f, degrees in graph.grouped_kv.items() if max(degrees.values()) > 1}
    if not linears:
        return frozenset()
    grad = _needs_grad(graph)
    out = {n.name for n in graph.nodes if n.op == "aten.linear.default" and n.module_fqn in linears}
    blocks = {f.rpartition(".")[0] for f in linears}
    for n in graph.nodes:
        if n.kind != "compute" or n.module_fqn not in blocks or n.name in out:
            continue
        if _op_name(n.op) == "scaled_dot_product_attention":
            continue
        if any(r in out for r in n.inputs) and all(r in out or r not in grad for r in n.inputs):
            out.add(n.name)
    return frozenset(out)


def fused_nodes(graph: Graph) -> frozenset[str]:
    """Nodes that may take ``layouts.FUSED``: the calls of the fused q/k/v projections
    (``Graph.fused_heads``), the views of their outputs, and what splits those into pieces."""
    out: set[str] = set()
    readers: dict[str, list[Node]] = {}
    for n in graph.nodes:
        for r in n.inputs:
            readers.setdefault(r, []).append(n)
    for n in graph.nodes:
        if n.op != "aten.linear.default" or n.module_fqn not in graph.fused_heads:
            continue
        front = [n]
        while front:
            node = front.pop()
            out.add(node.name)
            if node.op == "aten.linear.default" or _op_name(node.op) in _VIEWS:
                front += readers.get(node.name, [])
            elif _op_name(node.op) == "split_with_sizes":
                out.update(r.name for r in readers.get(node.name, []) if r.op == "getitem")
    return frozenset(out)


def _needs_grad(graph: Graph) -> set[str]:
    """Nodes whose output depends on a trainable parameter (gets a gradient)."""
    out: set[str] = set()
    for n in graph.nodes:
        if (n.kind == "param" and n.params and _trainable(graph, n.params[0])) or any(
            i in out for i in n.inputs
        ):
            out.add(n.name)
    return out


def _trainable(graph: Graph, fqn: str) -> bool:
    owner, _, leaf = fqn.rpartition(".")
    info = graph.modules.get(owner)
    return info is None or leaf not in info.frozen


_ROTARY = frozenset({"neg", "mul", "add", "sub", "slice", "cat", "unsqueeze", "contiguous"})


def _from_fused(graph: Graph, start: str, grad: set[str]) -> set[str] | None:
    """The nodes from a kv piece of a fused projection (a getitem of its split, a select of its
    view) to ``start`` through views and rotary ops whose other inputs need no gradient (cos and
    sin), or None where ``start`` does not come from one."""
    seen: set[str] = set()
    front = [start]
    while front:
        node = graph.node(front.pop())
        if node.name in seen:
            continue
        seen.add(node.name)
        op = _op_name(node.op)
        if node.op == "getitem" or op == "select":
            src = graph.node(node.inputs[0])
            if _op_name(src.op) in ("split_with_sizes", *_VIEWS) and src.module_fqn:
                continue  # a piece: layouts._fused_heads decides
            return None
        if node.kind != "compute" or op not in PARTIAL_KEEP | _ROTARY:
            return None
        front += [r for r in node.inputs if r in grad]
    return seen


def _op_name(op: str) -> str:
    parts = op.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "aten" else op


def _shape(graph: Graph, ref: str) -> tuple[int, ...]:
    meta = graph.node(ref).out
    return meta.shape if meta is not None else ()
