r"""The intra-layer ILP: which tensor-parallel style each module gets, for one TP degree.

Solved with OR-Tools CP-SAT on the traced aten graph, *collapsed*: a run of identical consecutive
layers (equal :attr:`ir.Layer.signature`) is represented by its first layer, whose costs count
once per member, so a 126-layer model costs the same to solve as a 1-layer one.

Sets
  T            tensor nodes of the collapsed graph (op outputs; inputs and parameters are "R")
  U            parallelizable units: Linear / Embedding modules and norms (any module
               :func:`layouts.norm_modules` recognises) whose parameters no other op reads; each
               unit is called by one or more op nodes; a norm's ops are folded into one node
               (its output) that reads the norm's input
  S(u)         styles of unit u (:data:`planner.layouts.MODULE_STYLES`, "replicate" included)
  L(t)         candidate layouts of tensor t: R, S<d> for dims tp divides, D1, DR
  A(n)         allowed transitions of op node n: (input layouts, output layout) pairs for which
               running n on local pieces computes the right piece (:func:`layouts.propagate`);
               for a unit's call node, one transition per (style, accepted input layout)
  P(n, i)      producers of input i of node n: in a collapsed run, input i of the representative
               reads the previous layer's output for the first member and its own output for
               the others, so P(n, i) holds both

Variables (booleans)
  x[u, s]      unit u uses style s
  b[t, l]      tensor t has layout l
  y[n, a]      node n runs transition a

Constraints
  one_style:        sum_s x[u, s] = 1                                  for u in U
  one_layout:       sum_l b[t, l] = 1                                  for t in T
  one_transition:   sum_a y[n, a] = 1                                  for n in T
  output_link:      b[n, l] = sum_{a in A(n): out(a) = l} y[n, a]      for n, l
  input_link:       b[p, l] = sum_{a in A(n): in_i(a) = l} y[n, a]     for n, i, p in P(n, i), l
  style_link:       x[u, s] = sum_{a in A(n): style(a) = s} y[n, a]    for u, n a call of u
  graph_output:     b[t, R] = 1                                        for t read by the output

Objective (integer nanoseconds)
  minimise  sum_{n, a} m(n) * (compute(n, a) + comm(n, a) + sync(n, a)) * y[n, a]

  m(n)           layers the node stands for (run length in a collapsed run, else 1)
  compute(n, a)  roofline time of n's forward and backward, divided by tp when the output of
                 a (or the unit's style) is sharded, plus per-op and DTensor dispatch overhead
  comm(n, a)     the style's collectives on the TP link (forward and backward), e.g. colwise:
                 all-reduce of the input gradient; rowwise: all-reduce of the output
  sync(n, a)     gradient synchronisation of the unit's local parameters across data parallel
                 ranks (bytes / tp when the style shards them) at the search's per-byte rate

Pinned tp (``CostInputs.shard_all``): a TP degree the user pinned must shard. Let
``E(u)`` be the styles of unit u that shard its weight evenly at tp (:func:`even_styles`: a
Linear's colwise styles need tp | out_features, its rowwise styles tp | in_features; an
Embedding's vocab-parallel styles tp | num_embeddings, its colwise tp | embedding_dim) and w(u)
the modules u stands for. A first solve finds

  K = max  sum_u w(u) * sum_{s in E(u)} x[u, s]          (the most modules that can shard)

and the cost solve adds  sum_u w(u) * sum_{s in E(u)} x[u, s] = K: the cheapest assignment among
those that shard every module that can be sharded at that degree (norms keep their free choice:
sequence parallelism shards activations, not weights).

Sequence parallelism: a norm's styles ``sequence_parallel`` (S1/D1 -> D1),
``sequence_parallel_local`` (S1/D1 -> S1, a plain local tensor) and
``sequence_parallel_gather`` (S1/D1 -> DR: the all-gather along the sequence done once for all
the colwise linears reading it, its backward one reduce-scatter) run the norm on 1/tp of the
sequence; ``rowwise_to_seq`` reduce-scatters a rowwise output to S1; the residual adds and
dropouts between them propagate S1 like any op. A tensor of :func:`layouts.scatter_layers`
may also take S1 from R at its layer's boundary (a transition with ``scatter``: computed
whole, split for free, its gradient all-gathered): the plan styles that layer
``sequence_scatter``.

Resharding happens only inside unit styles (an input taken as Shard(1) is all-gathered, an output
is all-reduced or reduce-scattered); a transition that would need resharding between plain ops
does not exist in A(n), which is how the ILP never picks a sharding that the ops between two
linears cannot run locally. :func:`brute_force` enumerates every style assignment and propagates
layouts to check the solver on small graphs.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from itertools import product

from autopar.cost_model import DeviceSpec, Link
from autopar.cost_model.estimate import (
    TP_OPS_PER_STYLED_CALL,
    collective_time_s,
    node_time_s,
    output_bytes,
    scaled,
)
from autopar.ir import Graph, Node
from autopar.planner.layouts import (
    CONV1D,
    DR,
    DTENSOR_STYLES,
    MODULE_OPS,
    MODULE_STYLES,
    SEQUENCE_STYLES,
    NormModule,
    R,
    allowed_transitions,
    candidate_layouts,
    heads_norm,
    norm_modules,
    scatter_layers,
    shard,
    style_layouts,
)
from ortools.sat.python import cp_model


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
    shared_input: bool = False
    """the program moves one collective per block input for all the column-parallel
    projections that read it (``cost_model.precision.shares_tp_block_input``): each of n
    sibling colwise calls is charged 1/n of its input's collectives."""


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


@dataclass(frozen=True)
class TPSolution:
    """The chosen styles (all layers, real FQNs) and the cost parts of the choice."""

    tp: int
    styles: dict[str, str]
    """module FQN -> style, for every non-replicated module of the model."""
    layouts: dict[str, str]
    """collapsed node name -> layout."""
    compute_s: float
    comm_s: float
    sync_s: float
    objective_ns: int
    activation_bytes: dict[str, float] = field(default_factory=dict)
    """layer FQN -> bytes saved for backward per rank at the local batch (measured by the trace;
    a node's saved tensors count as sharded when the input it reads is)."""
    sharded_param_bytes: int = 0
    """bytes of parameters (whole model) that the styles shard across the TP group."""
    layer_parts: dict[str, NodeCost] = field(default_factory=dict)
    """layer FQN -> its compute, TP communication and gradient-sync time (fwd + bwd)."""
    layer_sharded_param_bytes: dict[str, int] = field(default_factory=dict)
    """layer FQN -> bytes of its parameters that the styles shard."""


# -- collapsing ----------------------------------------------------------------------------------


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
            for n, fqn in scatter_layers(graph, norms).items()
            if n in producers and mult.get(n, 1) == 1 and n not in outputs
        },
        sequence_sized=_sequence_sized(graph, units),
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
        pbytes = sum(m.num_bytes for m in mod.params.values())
        units.append(Unit(fqn, kind, tuple(names), pbytes, styles))
    return tuple(units)


# -- transitions and costs -----------------------------------------------------------------------


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
    return candidate_layouts(graph.node(name).out, tp)


def node_transitions(
    c: Collapsed, graph: Graph, node: Node, unit: Unit | None, tp: int
) -> list[Transition]:
    """A(n): the transitions node n may run, restricted to its producers' and its own domains."""
    in_domains = [
        tuple(set.intersection(*(set(_domain(c, graph, p, tp)) for p in prods)))
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
    for style in unit.styles:
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
) -> NodeCost:
    """Forward + backward time of node n under transition t, split into parts. A folded norm
    (``group``: its nodes, ``x_ref``: its input) costs all its nodes; under a sequence-parallel
    style each of them is a DTensor op (2 dispatches, forward and backward) besides the style's
    own."""
    sharded = t.out != R and not t.scatter if t.style is None else t.style != "replicate"
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
            return NodeCost(compute, collective_time_s("all_gather", out, k.tp, k.tp_link))
        return NodeCost(compute_s=compute)
    x_ref = x_ref or node.inputs[_data_input(node)]
    x_bytes = scaled(graph, node, output_bytes(graph, x_ref), k.batch_scale)
    out_bytes = scaled(graph, node, output_bytes(graph, node.name), k.batch_scale)
    siblings = 1
    if k.shared_input and unit.kind == "linear":
        # the Linear calls reading the same input: one collective serves them all
        x = node.inputs[_data_input(node)]
        siblings = max(1, sum(graph.node(u).op == node.op for u in graph.users.get(x, ())))
    comm = _style_comm(t.style or "replicate", x_bytes, out_bytes, unit, k, siblings)
    if t.scatter:
        comm += collective_time_s("all_gather", out_bytes, k.tp, k.tp_link)
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


def _style_comm(
    style: str, x_bytes: float, out_bytes: float, unit: Unit, k: CostInputs, siblings: int = 1
) -> float:
    """Forward + backward collectives of one call of a styled module on the TP link; those on
    its input (a colwise style's) are shared with its ``siblings`` (``CostInputs.shared_input``)."""

    def coll(kind: str, num_bytes: float) -> float:
        return collective_time_s(kind, num_bytes, k.tp, k.tp_link)

    parts = {
        "replicate": [],
        # the replicated input's gradient is a partial sum per rank: all-reduced in backward
        "colwise": [("all_reduce", x_bytes)],
        "colwise_gather": [("all_reduce", x_bytes), ("all_gather", out_bytes)],
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


# -- the solver ----------------------------------------------------------------------------------


def _unit_of(c: Collapsed) -> dict[str, Unit]:
    return {call: u for u in c.units for call in u.calls}


def _sync_bytes(t: Transition, unit: Unit | None, tp: int) -> float:
    """Local parameter bytes a call under transition t synchronises (its unit's share)."""
    if unit is None:
        return 0.0
    return unit.param_bytes / (tp if t.style in _SHARDS_PARAMS else 1) / len(unit.calls)


def _cost_key(k: CostInputs) -> tuple:
    """What the costs depend on besides tp and the sync rate."""
    return (k.batch_scale, repr(k.device), k.dtype, repr(k.tp_link), k.shared_input)


def _opt_key(k: CostInputs) -> tuple:
    """What an optimum depends on besides tp and the sync rate: the costs and the forcing."""
    return (*_cost_key(k), k.shard_all)


def even_styles(graph: Graph, unit: Unit, tp: int) -> tuple[str, ...]:
    """The styles of ``unit`` that shard its weight evenly over ``tp`` ranks (a pinned tp
    shards every unit that has one, where the graph lets it)."""
    weight = graph.modules[unit.fqn].params.get("weight")
    if weight is None or len(weight.shape) != 2 or tp == 1:
        return ()
    rows, cols = weight.shape
    if graph.modules[unit.fqn].type == CONV1D:  # stored (in, out)
        rows, cols = cols, rows
    # the weight dim each style splits: Linear (out, in), Embedding (num_embeddings, dim)
    split = {
        "linear": lambda s: rows if s.startswith("colwise") else cols,
        "embedding": lambda s: rows if s.startswith("rowwise") else cols,
    }.get(unit.kind)
    if split is None:
        return ()
    return tuple(s for s in unit.styles if s in _SHARDS_PARAMS and split(s) % tp == 0)


def _ns(c: Collapsed, name: str, cost: NodeCost) -> int:
    return int(round(c.mult.get(name, 1) * cost.total_s * 1e9))


# 1 us per byte (1 MB/s): slower than any link data-parallel gradients travel on
_SLOWEST_SYNC_S_PER_BYTE = 1e-6


class Solver:
    """The intra-layer ILP of one graph at one TP degree, with what its solves share: the
    collapsed graph, each node's transitions, the CP-SAT constraints (each solve adds its
    objective to a copy), the cost tables met so far, the optima along the sync rate and the
    solutions. A search holds one per degree for its lifetime; nothing is kept elsewhere."""

    def __init__(self, graph: Graph, tp: int, collapsed: Collapsed | None = None) -> None:
        self.graph, self.tp = graph, tp
        c = self.c = collapsed if collapsed is not None else collapse(graph)
        self.unit_of = _unit_of(c)
        self.transitions = {
            n.name: node_transitions(c, graph, n, self.unit_of.get(n.name), tp) for n in c.nodes
        }
        self.sync_bytes = {
            name: [_sync_bytes(t, self.unit_of.get(name), tp) for t in ts]
            for name, ts in self.transitions.items()
        }
        """node -> per transition, local parameter bytes whose gradients it synchronises."""
        self._model: tuple[cp_model.CpModel, dict[tuple[str, int], cp_model.IntVar]] | None = None
        self._x: dict[tuple[str, str], cp_model.IntVar] = {}
        """(unit FQN, style) -> its x variable in the cached model."""
        self._forced: cp_model.CpModel | None = None
        """the cached model with the pinned-tp constraint (every module that can shard does)."""
        self.forced_count: int | None = None
        """K of the pinned-tp constraint: the most modules that can shard at once."""
        self._costs: dict[tuple, dict[str, list[NodeCost]]] = {}
        """cost key -> node -> per transition, cost without the sync."""
        self._optima: dict[tuple, list[tuple[float, tuple]]] = {}
        """cost key -> (rate, optimal assignment) pairs proven optimal."""
        self._solutions: dict[tuple, TPSolution] = {}
        self.solves = 0
        """CP-SAT solves run (tp = 1 needs none)."""

    def _cp(self) -> tuple[cp_model.CpModel, dict[tuple[str, int], cp_model.IntVar]]:
        """The CP-SAT variables and constraints (no objective), built on first use."""
        if self._model is None:
            c, graph, tp, transitions = self.c, self.graph, self.tp, self.transitions
            m = cp_model.CpModel()
            y = {
                (n, i): m.new_bool_var(f"y[{n},{i}]")
                for n, ts in transitions.items()
                for i in range(len(ts))
            }
            b: dict[tuple[str, str], cp_model.IntVar] = {}
            for n in transitions:
                for layout in _domain(c, graph, n, tp):
                    b[n, layout] = m.new_bool_var(f"b[{n},{layout}]")
            _add_one_transition_constraint(m, transitions, y)
            _add_output_link_constraint(m, c, graph, transitions, y, b, tp)
            _add_input_link_constraint(m, c, transitions, y, b)
            self._x = _add_style_link_constraint(m, c, transitions, y)
            _add_dtensor_block_constraint(m, c, graph, self._x)
            _add_graph_output_constraint(m, c, b)
            self._model = (m, y)
        return self._model

    def _sharded_count(self) -> cp_model.LinearExpr:
        """sum_u w(u) * sum_{s in E(u)} x[u, s] over the cached model's x variables."""
        terms, weights = [], []
        for u in self.c.units:
            for s in even_styles(self.graph, u, self.tp):
                terms.append(self._x[u.fqn, s])
                weights.append(len(self.c.unit_members[u.fqn]))
        return cp_model.LinearExpr.weighted_sum(terms, weights)

    def _cp_forced(self, time_limit_s: float) -> cp_model.CpModel:
        """The constraints plus: as many modules shard evenly as can (module docstring)."""
        if self._forced is None:
            base, _ = self._cp()
            count = self._sharded_count()
            probe = base.clone()
            probe.maximize(count)
            solver, _ = self._run(probe, time_limit_s)
            self.forced_count = round(solver.objective_value)
            forced = base.clone()
            forced.add(count == self.forced_count)
            self._forced = forced
        return self._forced

    def tables(self, k: CostInputs) -> dict[str, list[tuple[Transition, NodeCost]]]:
        """node -> its transitions with their costs under k."""
        key = _cost_key(k)
        base = self._costs.get(key)
        if base is None:
            k0 = replace(k, grad_sync_s_per_byte=0.0)
            base = self._costs[key] = {
                name: [
                    transition_cost(
                        self.graph,
                        self.graph.node(name),
                        t,
                        self.unit_of.get(name),
                        k0,
                        group=self.c.groups.get(name, ()),
                        x_ref=self.c.group_input.get(name),
                    )
                    for t in ts
                ]
                for name, ts in self.transitions.items()
            }
        rate = k.grad_sync_s_per_byte
        return {
            name: [
                (t, NodeCost(cost.compute_s, cost.comm_s, rate * nb))
                for t, cost, nb in zip(self.transitions[name], base[name], self.sync_bytes[name])
            ]
            for name in self.transitions
        }

    def solve(self, k: CostInputs, *, time_limit_s: float = 30.0) -> TPSolution:
        """The cheapest legal style assignment at this TP degree (see the module docstring).

        Solves are saved along the gradient sync rate: the objective is a_y + rate * b_y for
        assignment y, so the optimum min_y (a_y + rate b_y) is concave and piecewise linear in
        the rate, and an assignment optimal at rates r1 < r2 is optimal on all of [r1, r2]. A
        rate between two known rates with the same optimal assignment takes it without a solve
        (up to the objective's rounding to whole nanoseconds per node)."""
        if k.tp != self.tp:
            raise ValueError(f"a solver for tp={self.tp} asked to solve tp={k.tp}")
        key = _opt_key(k)
        rate = k.grad_sync_s_per_byte
        hit = self._solutions.get((key, round(rate * 1e15)))
        if hit is not None:
            return hit
        tables = self.tables(k)
        if key not in self._optima:
            # bracket every rate a search will meet: if the optima at 0 and at a rate no link is
            # that slow agree, no other rate needs a solve
            self._optima[key] = []
            for edge in (0.0, _SLOWEST_SYNC_S_PER_BYTE):
                at = self.tables(replace(k, grad_sync_s_per_byte=edge))
                pick, optimal = self._solve_cp(at, time_limit_s, k.shard_all)
                if optimal:
                    self._optima[key].append((edge, pick))
        known = self._optima[key]
        below = [e for e in known if e[0] <= rate]
        above = [e for e in known if e[0] >= rate]
        pick = None
        if below and above:
            lo, hi = max(below, key=lambda e: e[0]), min(above, key=lambda e: e[0])
            if lo[1] == hi[1]:
                pick = lo[1]
        if pick is None:
            pick, optimal = self._solve_cp(tables, time_limit_s, k.shard_all)
            if optimal:
                known.append((rate, pick))
        chosen = {n: tables[n][i][0] for n, i in pick}
        styles = {u.fqn: chosen[u.calls[0]].style or "replicate" for u in self.c.units}
        objective = sum(_ns(self.c, n, tables[n][i][1]) for n, i in pick)
        sol = _solution(self.graph, self.c, tables, chosen, styles, k, objective)
        self._solutions[key, round(rate * 1e15)] = sol
        return sol

    def _solve_cp(self, tables, time_limit_s: float, shard_all: bool = False):
        """(the optimal transition index per node as sorted (node, index) pairs, whether proven
        optimal). A graph where every node has one transition (tp = 1) needs no solver.
        ``shard_all``: among the assignments that shard the most modules (pinned tp)."""
        if all(len(t) == 1 for t in tables.values()):
            return tuple((n, 0) for n in sorted(tables)), True
        base, y = self._cp()
        if shard_all:
            base = self._cp_forced(time_limit_s)
        m = base.clone()  # the objective goes on a copy: the cached model stays constraints only
        keys = list(y)
        m.minimize(
            cp_model.LinearExpr.weighted_sum(
                [y[key] for key in keys],
                [_ns(self.c, key[0], tables[key[0]][key[1]][1]) for key in keys],
            )
        )
        solver, status = self._run(m, time_limit_s)
        pick = tuple(sorted((n, i) for (n, i), var in y.items() if solver.value(var)))
        return pick, status == cp_model.OPTIMAL

    def _run(self, model: cp_model.CpModel, time_limit_s: float) -> tuple[cp_model.CpSolver, int]:
        """One CP-SAT solve on one worker (deterministic), counted in ``solves``; no solution
        at all is a bug (every model admits the all-replicated assignment)."""
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = time_limit_s
        solver.parameters.num_workers = 1
        status = solver.solve(model)
        self.solves += 1
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            raise RuntimeError(
                f"tensor-parallel ILP at tp={self.tp} has no solution "
                f"({solver.status_name(status)})"
            )
        return solver, status


def solve(graph: Graph, k: CostInputs, *, time_limit_s: float = 30.0) -> TPSolution:
    """One ILP solve on a fresh :class:`Solver` (a search keeps one per degree instead)."""
    return Solver(graph, k.tp).solve(k, time_limit_s=time_limit_s)


def _add_one_transition_constraint(m, transitions, y) -> None:
    for n, ts in transitions.items():
        m.add_exactly_one(y[n, i] for i in range(len(ts)))


def _add_output_link_constraint(m, c, graph, transitions, y, b, tp) -> None:
    for n, ts in transitions.items():
        for layout in _domain(c, graph, n, tp):
            m.add(b[n, layout] == sum(y[n, i] for i, t in enumerate(ts) if t.out == layout))


def _add_input_link_constraint(m, c, transitions, y, b) -> None:
    for n, ts in transitions.items():
        for pos, prods in enumerate(c.producers[n]):
            for p in prods:
                if p in c.fixed:
                    continue  # fixed R: transitions already only take R there
                for (q, layout), var in b.items():
                    if q != p:
                        continue
                    m.add(var == sum(y[n, i] for i, t in enumerate(ts) if t.ins[pos] == layout))


def _add_style_link_constraint(m, c, transitions, y) -> dict[tuple[str, str], cp_model.IntVar]:
    x = {}
    for u in c.units:
        for s in u.styles:
            x[u.fqn, s] = m.new_bool_var(f"x[{u.fqn},{s}]")
        m.add_exactly_one(x[u.fqn, s] for s in u.styles)
        for call in u.calls:
            for s in u.styles:
                m.add(
                    x[u.fqn, s]
                    == sum(y[call, i] for i, t in enumerate(transitions[call]) if t.style == s)
                )
    return x


def _add_dtensor_block_constraint(m, c, graph, x) -> None:
    """A block that runs on DTensors (``Graph.dtensor_blocks``) shards all of its colwise linears
    or none, and its last linear is rowwise exactly when they are: inside it, a plain tensor
    meeting a DTensor would not run."""
    blocks: dict[str, list[Unit]] = {}
    for u in c.units:
        parent = u.fqn.rpartition(".")[0]
        if u.kind == "linear" and parent in graph.dtensor_blocks:
            blocks.setdefault(parent, []).append(u)
    order = {n.name: i for i, n in enumerate(graph.nodes)} if blocks else {}
    for units in blocks.values():
        *cols, last = sorted(units, key=lambda u: order[u.calls[0]])
        rowwise = cp_model.LinearExpr.sum(
            [x[last.fqn, s] for s in last.styles if s.startswith("rowwise")]
        )
        for u in cols:
            sharded = [x[u.fqn, s] for s in u.styles if s in DTENSOR_STYLES]
            m.add(cp_model.LinearExpr.sum(sharded) == rowwise)


def _add_graph_output_constraint(m, c, b) -> None:
    for name in c.outputs:
        if (name, R) in b:
            m.add(b[name, R] == 1)


def _solution(graph, c, tables, chosen, styles, k, objective_ns) -> TPSolution:
    parts: dict[str, list[float]] = {}
    act: dict[str, float] = {}
    for n, table in tables.items():
        t = chosen[n]
        cost = next(cost for tt, cost in table if tt == t)
        node = graph.node(n)
        acc = parts.setdefault(node.layer, [0.0, 0.0, 0.0])
        acc[0] += cost.compute_s
        acc[1] += cost.comm_s
        acc[2] += cost.sync_s
        div = k.tp if _saved_layout(node, t) not in (R, DR) else 1
        held = sum(
            scaled(graph, m, m.saved_bytes, k.batch_scale) / div
            for m in (graph.node(g) for g in c.groups.get(n, (n,)))
        )
        act[node.layer] = act.get(node.layer, 0.0) + held
    full_styles: dict[str, str] = {}
    for n, t in chosen.items():
        if t.scatter:
            full_styles[c.scatter[n]] = "sequence_scatter"
    rep_sharded: dict[str, int] = {}
    for u in c.units:
        s = styles[u.fqn]
        if s != "replicate":
            full_styles.update(dict.fromkeys(c.unit_members[u.fqn], s))
        if s in _SHARDS_PARAMS:
            layer = graph.node(u.calls[0]).layer
            rep_sharded[layer] = rep_sharded.get(layer, 0) + u.param_bytes
    layer_act, layer_parts, layer_sharded = {}, {}, {}
    for rep, fqns in c.members.items():
        cost = NodeCost(*parts.get(rep, (0.0, 0.0, 0.0)))
        for fqn in fqns:
            layer_act[fqn] = act.get(rep, 0.0)
            layer_parts[fqn] = cost
            layer_sharded[fqn] = rep_sharded.get(rep, 0)
    return TPSolution(
        tp=k.tp,
        styles=dict(sorted(full_styles.items(), key=lambda kv: _fqn_key(kv[0]))),
        layouts={n: t.out for n, t in chosen.items()},
        compute_s=sum(p.compute_s for p in layer_parts.values()),
        comm_s=sum(p.comm_s for p in layer_parts.values()),
        sync_s=sum(p.sync_s for p in layer_parts.values()),
        objective_ns=objective_ns,
        activation_bytes=layer_act,
        sharded_param_bytes=sum(layer_sharded.values()),
        layer_parts=layer_parts,
        layer_sharded_param_bytes=layer_sharded,
    )


def _saved_layout(node: Node, t: Transition) -> str:
    """Layout of what a node saves for backward: mostly its (data) input (a linear keeps its
    input, gelu its input, SDPA q/k/v, a folded norm its input and the steps between); an op
    without tensor inputs keeps its output. A colwise linear reading a sequence shard keeps the
    all-gathered input (torch's DTensor does; Megatron-LM would gather it again in backward)."""
    if not t.ins:
        return t.out
    if t.style in ("colwise_from_seq", "colwise_from_seq_gather"):
        return R
    return t.ins[_data_input(node) if t.style is not None and len(t.ins) > 1 else 0]


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


# -- brute force (tests) -------------------------------------------------------------------------


def brute_force(graph: Graph, k: CostInputs, *, limit: int = 200_000) -> tuple[int, dict[str, str]]:
    """Minimum objective (ns) over every style assignment, by propagating layouts; for tests.
    With ``k.shard_all``, over the legal assignments that shard the most modules evenly."""
    solver = Solver(graph, k.tp)
    c, tables, unit_of = solver.c, solver.tables(k), solver.unit_of
    units = list(c.units)
    count = math.prod(len(u.styles) for u in units) * 2 ** len(c.scatter)
    assert count <= limit, f"{count} assignments: too many to enumerate"
    even = {u.fqn: even_styles(graph, u, k.tp) for u in units}
    best: tuple[tuple[int, int], dict[str, str]] | None = None
    scatters = sorted(c.scatter)  # each may enter the sequence-parallel region or not
    for combo in product(*(u.styles for u in units), *([False, True] for _ in scatters)):
        styles = {u.fqn: s for u, s in zip(units, combo)}
        split = dict(zip(scatters, combo[len(units) :]))
        total = _evaluate(c, tables, unit_of, styles, split)
        if total is None:
            continue
        sharded = sum(len(c.unit_members[u.fqn]) for u in units if styles[u.fqn] in even[u.fqn])
        rank = (-sharded if k.shard_all else 0, total)
        if best is None or rank < best[0]:
            best = (rank, styles)
    assert best is not None, "no legal assignment"
    return best[0][1], best[1]


def _evaluate(c, tables, unit_of, styles, split=None) -> int | None:
    """Objective of one style assignment: layouts are propagated in order; each node must find
    exactly the transition its producers' layouts (all agreeing) and its style dictate
    (``split``: node -> whether it enters the sequence-parallel region, for scatter nodes)."""
    split = split or {}
    layout: dict[str, str] = {}
    total = 0
    for n in c.nodes:
        ins = []
        for prods in c.producers[n.name]:
            got = {layout.get(p, R) if p in c.fixed else layout.get(p) for p in prods}
            # in a collapsed run the representative's own output is not known on first visit:
            # its producers must agree with the layout it will get, checked after the pass
            got.discard(None)
            if len(got) != 1:
                return None
            ins.append(next(iter(got)))
        unit = unit_of.get(n.name)
        match = [
            (t, cost)
            for t, cost in tables[n.name]
            if t.ins == tuple(ins)
            and (unit is None or t.style == styles[unit.fqn])
            and t.scatter == split.get(n.name, False)
        ]
        if not match:
            return None
        t, cost = match[0]
        layout[n.name] = t.out
        total += _ns(c, n.name, cost)
    for n in c.nodes:  # loop-carried inputs of collapsed runs
        for prods in c.producers[n.name]:
            if len({R if p in c.fixed else layout[p] for p in prods}) != 1:
                return None
    for name in c.outputs:
        if layout.get(name, R) != R:
            return None
    return total
