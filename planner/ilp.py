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
sequence parallelism shards activations, not weights). The output projection of attention with
fewer kv heads than tp (``Graph.gqa_blocks``) counts only rowwise: its heads split wherever the
layouts allow it (``rules.whole_attention_rule`` refuses the pin where they do not).

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
from dataclasses import dataclass, field, replace
from itertools import product

from autopar.cost_model.estimate import (
    scaled,
)
from autopar.ir import Graph, Node
from autopar.planner import sat
from autopar.planner.collapse import Collapsed, Unit, _fqn_key, collapse
from autopar.planner.layouts import (
    CONV1D,
    DR,
    DTENSOR_STYLES,
    RP,
    R,
)
from autopar.planner.transitions import (
    _SHARDS_PARAMS,
    CostInputs,
    NodeCost,
    Transition,
    _data_input,
    _domain,
    _sync_bytes,
    node_transitions,
    shards_weights,
    transition_cost,
)

__all__ = [
    "Collapsed",
    "CostInputs",
    "NodeCost",
    "Solver",
    "TPSolution",
    "Transition",
    "Unit",
    "brute_force",
    "collapse",
    "even_styles",
    "node_transitions",
    "shards_weights",
    "solve",
    "transition_cost",
]


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
    activation_bytes_autocast: dict[str, float] = field(default_factory=dict)
    """the same under ``torch.autocast`` over fp32 parameters (``Node.saved_bytes_autocast``;
    ``activation_bytes`` where the trace did not measure it)."""
    sharded_param_bytes: int = 0
    """bytes of parameters (whole model) that the styles shard across the TP group."""
    layer_parts: dict[str, NodeCost] = field(default_factory=dict)
    """layer FQN -> its compute, TP communication and gradient-sync time (fwd + bwd)."""
    layer_sharded_param_bytes: dict[str, int] = field(default_factory=dict)
    """layer FQN -> bytes of its parameters that the styles shard."""

    def activations(self, autocast: bool = False) -> dict[str, float]:
        """layer FQN -> bytes saved for backward per rank, as the precision regime's forward
        saves them (``Precision.autocast``)."""
        return self.activation_bytes_autocast if autocast else self.activation_bytes


# -- collapsing ----------------------------------------------------------------------------------


# -- transitions and costs -----------------------------------------------------------------------


# -- the solver ----------------------------------------------------------------------------------


def _unit_of(c: Collapsed) -> dict[str, Unit]:
    return {call: u for u in c.units for call in u.calls}


def _cost_key(k: CostInputs, spec=repr) -> tuple:
    """What the costs depend on besides tp and the sync rate (``spec``: how a spec is written,
    ``repr`` or a memo of it)."""
    return (k.batch_scale, spec(k.device), k.dtype, spec(k.tp_link), k.shared_input)


def _opt_key(k: CostInputs, spec=repr) -> tuple:
    """What an optimum depends on besides tp and the sync rate: the costs and the forcing."""
    return (*_cost_key(k, spec), k.shard_all)


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
        # a fused q/k/v projection: its query rows (as many as its input is wide) are split
        "fused_linear": lambda s: cols if s == "colwise" else rows,
    }.get(unit.kind)
    if split is None:
        return ()
    styles = tuple(s for s in unit.styles if s in _SHARDS_PARAMS and split(s) % tp == 0)
    if any(out == unit.fqn and kv < tp for _, kv, out in graph.gqa_blocks.values()):
        # the output projection of attention with fewer kv heads than tp: sharded only
        # paired (rowwise), so a pinned tp splits the heads wherever that is legal
        styles = tuple(s for s in styles if s.startswith("rowwise"))
    return styles


def _ns(c: Collapsed, name: str, cost: NodeCost) -> int:
    return int(round(c.mult.get(name, 1) * cost.total_s * 1e9))


# 1 us per byte (1 MB/s): slower than any link data-parallel gradients travel on
_SLOWEST_SYNC_S_PER_BYTE = 1e-6


class Solver:
    """The intra-layer ILP of one graph at one TP degree, with what its solves share: the
    collapsed graph, each node's transitions, the CP-SAT constraints (each solve adds its
    objective to a copy), the cost tables met so far, the optima along the sync rate and the
    solutions. A search holds one per degree for its lifetime; nothing is kept elsewhere."""

    def __init__(
        self, graph: Graph, tp: int, collapsed: Collapsed | None = None, optima: dict | None = None
    ) -> None:
        self.graph, self.tp = graph, tp
        c = self.c = collapsed if collapsed is not None else collapse(graph)
        self.unit_of = _unit_of(c)
        self.transitions = {
            n.name: node_transitions(c, graph, n, self.unit_of.get(n.name), tp) for n in c.nodes
        }
        self.siblings = _sibling_groups(c, graph, self.transitions, self.unit_of)
        """node -> the Linear calls (it among them) that read its input and may be colwise:
        all colwise or none (:func:`_add_sibling_constraint`), one input collective for all."""
        self.readers = {n: _readers(graph, n) for n in self.siblings}
        """sibling node -> how many calls share its input's collective (:func:`_readers`)."""
        self.sync_bytes = {
            name: [_sync_bytes(t, self.unit_of.get(name), tp) for t in ts]
            for name, ts in self.transitions.items()
        }
        """node -> per transition, local parameter bytes whose gradients it synchronises."""
        self._model: tuple[sat.Model, dict[tuple[str, int], int]] | None = None
        self._x: dict[tuple[str, str], int] = {}
        """(unit FQN, style) -> its x variable in the cached model."""
        self._forced: sat.Model | None = None
        """the cached model with the pinned-tp constraint (every module that can shard does)."""
        self.forced_count: int | None = None
        """K of the pinned-tp constraint: the most modules that can shard at once."""
        self._costs: dict[tuple, dict[str, list[NodeCost]]] = {}
        """cost key -> node -> per transition, cost without the sync."""
        self._optima: dict[tuple, list[tuple[float, tuple]]] = {} if optima is None else optima
        """cost key -> (rate, optimal assignment) pairs proven optimal: ``optima`` where the
        caller shares them across searches of this graph at this tp (a planning session, its
        plan cache), else this solver's own."""
        for known in self._optima.values():  # answers kept elsewhere: only those of this graph
            known[:] = [(rate, pick) for rate, pick in known if self._is_assignment(pick)]
        self._solutions: dict[tuple, TPSolution] = {}
        self._picked: dict[tuple, _Picked] = {}
        """(cost key, assignment) -> the rate-free parts of its solutions."""
        self._specs: dict[int, tuple[object, str]] = {}
        """id of a spec -> (the spec, held; its repr) (:meth:`_spec`)."""
        self.solves = 0
        """CP-SAT solves run (tp = 1 needs none)."""

    def _is_assignment(self, pick: tuple) -> bool:
        """Whether ``pick`` is one transition index per node of this solver, in node order."""
        names = sorted(self.transitions)
        return len(pick) == len(names) and all(
            n == name and 0 <= i < len(self.transitions[n]) for (n, i), name in zip(pick, names)
        )

    def _cp(self) -> tuple[sat.Model, dict[tuple[str, int], int]]:
        """The CP-SAT variables and constraints (no objective), built on first use."""
        if self._model is None:
            c, graph, tp, transitions = self.c, self.graph, self.tp, self.transitions
            m = sat.Model()
            y = {
                (n, i): m.bool_var(f"y[{n},{i}]")
                for n, ts in transitions.items()
                for i in range(len(ts))
            }
            b: dict[tuple[str, str], int] = {}
            for n in transitions:
                for layout in _domain(c, graph, n, tp):
                    b[n, layout] = m.bool_var(f"b[{n},{layout}]")
            _add_one_transition_constraint(m, transitions, y)
            _add_output_link_constraint(m, c, graph, transitions, y, b, tp)
            _add_input_link_constraint(m, c, transitions, y, b)
            self._x = _add_style_link_constraint(m, c, transitions, y)
            _add_dtensor_block_constraint(m, c, graph, self._x)
            _add_sibling_constraint(m, self.siblings, transitions, y)
            _add_graph_output_constraint(m, c, b)
            self._model = (m, y)
        return self._model

    def _sharded_count(self) -> list[tuple[int, int]]:
        """sum_u w(u) * sum_{s in E(u)} x[u, s] over the cached model's x variables, as terms."""
        return [
            (self._x[u.fqn, s], len(self.c.unit_members[u.fqn]))
            for u in self.c.units
            for s in even_styles(self.graph, u, self.tp)
        ]

    def _cp_forced(self, time_limit_s: float) -> sat.Model:
        """The constraints plus: as many modules shard evenly as can (module docstring)."""
        if self._forced is None:
            base, _ = self._cp()
            count = self._sharded_count()
            probe = base.clone()
            probe.maximize(count)
            self.forced_count = round(self._run(probe, time_limit_s).objective)
            forced = base.clone()
            forced.equal(count, self.forced_count)
            self._forced = forced
        return self._forced

    def _spec(self, spec: object) -> str:
        """``repr`` of a frozen spec (a device, a link), written once per object this solver
        meets (a search asks thousands of times for the same few; the object is held)."""
        hit = self._specs.get(id(spec))
        if hit is None or hit[0] is not spec:
            hit = self._specs[id(spec)] = (spec, repr(spec))
        return hit[1]

    def tables(self, k: CostInputs) -> dict[str, list[tuple[Transition, NodeCost]]]:
        """node -> its transitions with their costs under k."""
        key = _cost_key(k, self._spec)
        base = self._costs.get(key)
        if base is None:
            k0 = replace(k, grad_sync_s_per_byte=0.0)
            base = self._costs[key] = {
                name: [self._cost(name, t, k0) for t in ts] for name, ts in self.transitions.items()
            }
        rate = k.grad_sync_s_per_byte
        return {
            name: [
                (t, NodeCost(cost.compute_s, cost.comm_s, rate * nb))
                for t, cost, nb in zip(self.transitions[name], base[name], self.sync_bytes[name])
            ]
            for name in self.transitions
        }

    def _cost(self, name: str, t: Transition, k0: CostInputs) -> NodeCost:
        """Transition ``t`` of node ``name`` priced under ``k0`` (no sync rate)."""
        return transition_cost(
            self.graph,
            self.graph.node(name),
            t,
            self.unit_of.get(name),
            k0,
            group=self.c.groups.get(name, ()),
            x_ref=self.c.group_input.get(name),
            siblings=self.readers.get(name, 1),
        )

    def solve(self, k: CostInputs, *, time_limit_s: float = 30.0) -> TPSolution:
        """The cheapest legal style assignment at this TP degree (see the module docstring).

        Solves are saved along the gradient sync rate: the objective is a_y + rate * b_y for
        assignment y, so the optimum min_y (a_y + rate b_y) is concave and piecewise linear in
        the rate, and an assignment optimal at rates r1 < r2 is optimal on all of [r1, r2]. A
        rate between two known rates with the same optimal assignment takes it without a solve
        (up to the objective's rounding to whole nanoseconds per node)."""
        if k.tp != self.tp:
            raise ValueError(f"a solver for tp={self.tp} asked to solve tp={k.tp}")
        key = _opt_key(k, self._spec)
        rate = k.grad_sync_s_per_byte
        hit = self._solutions.get((key, round(rate * 1e15)))
        if hit is not None:
            return hit
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
            pick, optimal = self._solve_cp(self.tables(k), time_limit_s, k.shard_all)
            if optimal:
                known.append((rate, pick))
        picked = self._picked.get((_cost_key(k, self._spec), pick))
        if picked is None:
            picked = self._picked[_cost_key(k, self._spec), pick] = self._pick_parts(k, pick)
        sol = picked.at_rate(self.c, rate)
        self._solutions[key, round(rate * 1e15)] = sol
        return sol

    def _pick_parts(self, k: CostInputs, pick: tuple) -> _Picked:
        """What a solution of assignment ``pick`` under k's costs holds that does not depend on
        the sync rate (the costs without the sync: :meth:`tables`' base)."""
        base = self._costs.get(_cost_key(k, self._spec))
        index = dict(pick)
        chosen = {n: self.transitions[n][i] for n, i in pick}
        styles = {u.fqn: chosen[u.calls[0]].style or "replicate" for u in self.c.units}
        # per node, in the graph's order: (node, layer, its cost without the sync, sync bytes);
        # where no solve priced every transition (an answer kept from an earlier search), only
        # the chosen ones are priced, as tables() prices them
        k0 = replace(k, grad_sync_s_per_byte=0.0)
        nodes = tuple(
            (
                n,
                self.graph.node(n).layer,
                base[n][index[n]] if base is not None else self._cost(n, chosen[n], k0),
                self.sync_bytes[n][index[n]],
            )
            for n in self.transitions
        )
        return _Picked(self.graph, self.c, chosen, styles, k, nodes)

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
        m.minimize((var, _ns(self.c, n, tables[n][i][1])) for (n, i), var in y.items())
        result = self._run(m, time_limit_s)
        pick = tuple(sorted((n, i) for (n, i), var in y.items() if result.values[var]))
        return pick, result.optimal

    def _run(self, model: sat.Model, time_limit_s: float) -> sat.Result:
        """One CP-SAT solve on one worker (deterministic), counted in ``solves``; no solution
        at all is a bug (every model admits the all-replicated assignment)."""
        result = sat.solve(model, time_limit_s)
        self.solves += 1
        if not result.solved:
            raise RuntimeError(
                f"tensor-parallel ILP at tp={self.tp} has no solution ({result.status})"
            )
        return result


def solve(graph: Graph, k: CostInputs, *, time_limit_s: float = 30.0) -> TPSolution:
    """One ILP solve on a fresh :class:`Solver` (a search keeps one per degree instead)."""
    return Solver(graph, k.tp).solve(k, time_limit_s=time_limit_s)


def _add_one_transition_constraint(m, transitions, y) -> None:
    for n, ts in transitions.items():
        m.exactly_one(y[n, i] for i in range(len(ts)))


def _add_output_link_constraint(m, c, graph, transitions, y, b, tp) -> None:
    for n, ts in transitions.items():
        for layout in _domain(c, graph, n, tp):
            m.equal(
                [(b[n, layout], 1), *((y[n, i], -1) for i, t in enumerate(ts) if t.out == layout)]
            )


def _add_input_link_constraint(m, c, transitions, y, b) -> None:
    for n, ts in transitions.items():
        for pos, prods in enumerate(c.producers[n]):
            for p in prods:
                if p in c.fixed:
                    continue  # fixed R: transitions already only take R there
                for (q, layout), var in b.items():
                    if q != p:
                        continue
                    ys = [y[n, i] for i, t in enumerate(ts) if t.ins[pos] == layout]
                    m.equal([(var, 1), *((v, -1) for v in ys)])


def _add_style_link_constraint(m, c, transitions, y) -> dict[tuple[str, str], int]:
    x = {}
    for u in c.units:
        for s in u.styles:
            x[u.fqn, s] = m.bool_var(f"x[{u.fqn},{s}]")
        m.exactly_one(x[u.fqn, s] for s in u.styles)
        for call in u.calls:
            for s in u.styles:
                ys = [y[call, i] for i, t in enumerate(transitions[call]) if t.style == s]
                m.equal([(x[u.fqn, s], 1), *((v, -1) for v in ys)])
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
        rowwise = [x[last.fqn, s] for s in last.styles if s.startswith("rowwise")]
        for u in cols:
            sharded = [x[u.fqn, s] for s in u.styles if s in DTENSOR_STYLES]
            m.equal([*((v, 1) for v in sharded), *((v, -1) for v in rowwise)])


def _colwise(style: str | None) -> bool:
    """Whether ``style`` is column-parallel (its call pays its input's collectives)."""
    return (style or "").startswith("colwise")


def _sibling_groups(c, graph, transitions, unit_of) -> dict[str, tuple[str, ...]]:
    """node -> the Linear calls, it among them, that read the same input and each have a
    column-parallel transition (groups of two or more): the emitted program hands them one
    prepared DTensor of that input, one collective for all (``autopar_runtime.tensor_parallel.
    shared_input``)."""
    groups: dict[str, list[str]] = {}
    for name, ts in transitions.items():
        unit = unit_of.get(name)
        if unit is None or unit.kind != "linear" or not any(_colwise(t.style) for t in ts):
            continue
        node = graph.node(name)
        groups.setdefault(node.inputs[_data_input(node)], []).append(name)
    return {n: tuple(g) for g in groups.values() if len(g) > 1 for n in g}


def _readers(graph: Graph, name: str) -> int:
    """The calls of ``name``'s op that read its input in the whole graph (collapsed runs of
    identical layers stand for theirs)."""
    node = graph.node(name)
    return sum(
        graph.node(u).op == node.op for u in graph.users.get(node.inputs[_data_input(node)], ())
    )


def _add_sibling_constraint(m, siblings, transitions, y) -> None:
    """Sibling Linear calls (:func:`_sibling_groups`) are column-parallel all or none: each is
    charged its share of the one collective on their input, which is exact only then."""
    for group in set(siblings.values()):
        first, *rest = (
            [y[n, i] for i, t in enumerate(transitions[n]) if _colwise(t.style)] for n in group
        )
        for other in rest:
            m.equal([*((v, 1) for v in first), *((v, -1) for v in other)])


def _add_graph_output_constraint(m, c, b) -> None:
    for name in c.outputs:
        if (name, R) in b:
            m.equal([(b[name, R], 1)], 1)


class _Picked:
    """One assignment's solution under one cost key: the parts the gradient sync rate does not
    change (styles, layouts, activations, sharded bytes, per-layer compute and communication),
    computed once, and its :class:`TPSolution` at any rate (:meth:`at_rate`), which adds
    rate x each chosen transition's sync bytes, node by node in the graph's order, as
    :meth:`Solver.tables` prices them: a search meets hundreds of rates and few assignments."""

    def __init__(self, graph, c, chosen, styles, k, nodes) -> None:
        self.tp, self.nodes = k.tp, nodes
        parts: dict[str, list[float]] = {}
        act: dict[str, float] = {}
        act_autocast: dict[str, float] = {}
        for n, layer, cost, _ in nodes:
            t = chosen[n]
            acc = parts.setdefault(layer, [0.0, 0.0])
            acc[0] += cost.compute_s
            acc[1] += cost.comm_s
            div = k.tp if _saved_layout(graph.node(n), t) not in (R, DR, RP) else 1
            members = [graph.node(g) for g in c.groups.get(n, (n,))]
            held = sum(scaled(graph, m, m.saved_bytes, k.batch_scale) / div for m in members)
            act[layer] = act.get(layer, 0.0) + held
            if any(m.saved_bytes_autocast is not None for m in members):  # a bf16 trace
                held = sum(scaled(graph, m, m.saved(True), k.batch_scale) / div for m in members)
            act_autocast[layer] = act_autocast.get(layer, 0.0) + held
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
        self.parts = parts
        self.members = tuple((rep, fqns) for rep, fqns in c.members.items())
        self.activation_bytes = {f: act.get(rep, 0.0) for rep, fqns in self.members for f in fqns}
        self.activation_bytes_autocast = {
            f: act_autocast.get(rep, 0.0) for rep, fqns in self.members for f in fqns
        }
        self.layer_sharded = {
            f: rep_sharded.get(rep, 0) for rep, fqns in self.members for f in fqns
        }
        self.styles = dict(sorted(full_styles.items(), key=lambda kv: _order(c, kv[0])))
        self.layouts = {n: t.out for n, t in chosen.items()}

    def at_rate(self, c: Collapsed, rate: float) -> TPSolution:
        sync: dict[str, float] = {}
        objective = 0
        for n, layer, cost, nb in self.nodes:
            s = rate * nb
            sync[layer] = sync.get(layer, 0.0) + s
            objective += int(round(c.mult.get(n, 1) * (cost.compute_s + cost.comm_s + s) * 1e9))
        layer_parts = {}
        for rep, fqns in self.members:
            part = self.parts.get(rep)
            cost = NodeCost(part[0], part[1], sync[rep]) if part else NodeCost(0.0, 0.0, 0.0)
            for fqn in fqns:
                layer_parts[fqn] = cost
        return TPSolution(
            tp=self.tp,
            styles=self.styles,
            layouts=self.layouts,
            compute_s=sum(p.compute_s for p in layer_parts.values()),
            comm_s=sum(p.comm_s for p in layer_parts.values()),
            sync_s=sum(p.sync_s for p in layer_parts.values()),
            objective_ns=objective,
            activation_bytes=self.activation_bytes,
            activation_bytes_autocast=self.activation_bytes_autocast,
            sharded_param_bytes=sum(self.layer_sharded.values()),
            layer_parts=layer_parts,
            layer_sharded_param_bytes=self.layer_sharded,
        )


def _order(c: Collapsed, fqn: str) -> list:
    """:func:`_fqn_key`, remembered on ``c`` (every solution sorts the same FQNs)."""
    key = c.fqn_keys.get(fqn)
    if key is None:
        key = c.fqn_keys[fqn] = _fqn_key(fqn)
    return key


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
    groups = set(solver.siblings.values())
    for combo in product(*(u.styles for u in units), *([False, True] for _ in scatters)):
        styles = {u.fqn: s for u, s in zip(units, combo)}
        if any(len({_colwise(styles[unit_of[n].fqn]) for n in g}) > 1 for g in groups):
            continue  # siblings colwise all or none (_add_sibling_constraint)
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
