"""Mixture-of-experts blocks in the traced graph: router, experts, dispatch/combine, aux loss.

Found from the graph and the module tree alone, for hand-written and HF models alike:

- the **router** is a ``topk`` node over scores with ``E`` choices in the last dim (``k`` picked
  per token); its gate is the nearest node before it (through softmax/sigmoid/casts) that reads a
  parameter with a dim of size ``E``;
- the **experts** are the parameters read by nodes that depend on the ``topk`` in the same layer,
  keeping those that come in ``E``: either stacked (a parameter whose first dim is ``E``: HF
  Mixtral/Qwen3-MoE ``gate_up_proj``/``down_proj``, torchtitan's grouped experts), owned by one
  module (the grouped experts module), or the ``E`` structurally identical children of a container
  (an ``nn.ModuleList`` of expert MLPs), one module each;
- **dispatch and combine** are the nodes between the ``topk`` and the experts and back; the block
  (:attr:`MoE.fqn`) is the innermost module holding the gate and the experts;
- the **auxiliary load-balancing loss** is a scalar that depends on the routing and reaches the
  model's output.

Sizes that depend on the routing (tokens per expert) are taken at balanced routing by the tracer
(``tokens * k / E`` per expert); expert FLOPs in the IR follow from it.
"""

from __future__ import annotations

from collections import deque

from autopar.ir.graph import Graph, ModuleInfo, MoE, Node

_PASS_THROUGH = 6  # nodes walked back from the topk to find the gate


def find_moes(graph: Graph) -> tuple[MoE, ...]:
    """Every mixture-of-experts block of the graph, in model order."""
    out = []
    for n in graph.nodes:
        if n.kind == "compute" and n.op.startswith("aten.topk"):
            moe = _moe_at(graph, n)
            if moe is not None:
                out.append(moe)
    return tuple(out)


def _moe_at(graph: Graph, topk: Node) -> MoE | None:
    scores = graph.node(topk.inputs[0])
    if scores.out is None or not scores.out.shape:
        return None
    num = scores.out.shape[-1]
    k = topk.args[1] if len(topk.args) > 1 else dict(topk.kwargs).get("k")
    if not isinstance(k, int) or num < 2 or k >= num:
        return None
    gate = _gate(graph, scores, num)
    if gate is None:
        return None
    after = _descendants(graph, topk.name)
    in_layer = [graph.node(a) for a in after if graph.node(a).layer == topk.layer]
    params: dict[str, None] = {}
    for n in in_layer:
        params.update(dict.fromkeys(n.params))
        for i in n.inputs:  # a view of a parameter (transpose of stacked experts) feeding them
            src = graph.node(i)
            if src.kind == "compute" and src.params and i not in after:
                params.update(dict.fromkeys(src.params))
    for p in gate.params:
        params.pop(p, None)
    experts, expert_params, grouped = _experts(graph, list(params), num)
    if not experts:
        return None
    fqn = _common_prefix([gate.module_fqn, *experts])
    inside = [n for n in in_layer if any(e in n.module_stack for e in experts)]
    hidden = _hidden(graph, gate)
    numel = sum(_param(graph, p)[1].numel for p in expert_params)
    nbytes = sum(_param(graph, p)[1].num_bytes for p in expert_params)
    aux = _aux_loss(graph, after)
    return MoE(
        fqn=fqn,
        layer=topk.layer,
        router=gate.module_fqn,
        topk_node=topk.name,
        experts=tuple(experts),
        expert_params=tuple(expert_params),
        grouped=grouped,
        num_experts=num,
        top_k=k,
        tokens=scores.out.numel // num,
        hidden=hidden,
        expert_param_numel=numel,
        expert_param_bytes=nbytes,
        expert_fwd_flops=sum(n.fwd_flops for n in inside),
        expert_bwd_flops=sum(n.bwd_flops for n in inside),
        aux_loss=aux,
        rows=0 if grouped else _listed_rows(graph, experts, topk.layer, hidden),
    )


def _listed_rows(graph: Graph, experts: list[str], layer: str, hidden: int) -> int:
    """Rows the experts of a module list receive in all: per expert, each distinct tensor its
    nodes read from outside it (its input rows; a weight is no input), at ``hidden`` wide. 0
    where an input is not ``hidden`` wide (the rows are not read then). An expert of a dense
    dispatch does not depend on the ``topk``: its nodes are read from the whole ``layer``."""
    nodes = [graph.node(name) for name in graph.layer(layer).nodes]
    rows = 0
    for e in experts:
        mine = [n for n in nodes if e in n.module_stack]
        own = {n.name for n in mine}
        reads = {
            i
            for n in mine
            for i in n.inputs
            if i not in own and graph.node(i).kind not in ("param", "buffer")
        }
        for i in reads:
            out = graph.node(i).out
            if out is None or not out.shape or out.shape[-1] != hidden:
                return 0
            rows += out.numel // hidden
    return rows


def _gate(graph: Graph, scores: Node, num: int) -> Node | None:
    """The nearest node at or before ``scores`` reading a parameter with a dim of ``num``."""
    seen, queue = set(), deque([(scores.name, 0)])
    while queue:
        name, depth = queue.popleft()
        n = graph.node(name)
        if n.kind == "compute" and any(num in _param(graph, p)[1].shape for p in n.params):
            return n
        if depth < _PASS_THROUGH:
            for i in n.inputs:
                if i not in seen:
                    seen.add(i)
                    queue.append((i, depth + 1))
    return None


def _param(graph: Graph, fqn: str) -> tuple[ModuleInfo, object]:
    owner, _, local = fqn.rpartition(".")
    info = graph.modules[owner]
    return info, info.params[local]


def _experts(graph: Graph, params: list[str], num: int) -> tuple[list[str], list[str], bool]:
    """(expert module FQNs, expert parameter FQNs, grouped) among the parameters read after
    the topk."""
    stacked = [p for p in params if len(_param(graph, p)[1].shape) >= 2]
    stacked = [p for p in stacked if _param(graph, p)[1].shape[0] == num]
    if stacked:
        owners = list(dict.fromkeys(p.rpartition(".")[0] for p in stacked))
        return owners, stacked, True
    # a container with `num` children, each reading its own parameters
    for info in graph.modules.values():
        if len(info.children) != num:
            continue
        mine = [p for p in params if any(_under(p, c) for c in info.children)]
        if mine and all(any(_under(p, c) for p in mine) for c in info.children):
            every = [
                f"{m.fqn}.{local}" if m.fqn else local
                for m in graph.modules.values()
                if any(_under(m.fqn, c) for c in info.children)
                for local in m.params
            ]
            return list(info.children), every, False
    return [], [], False


def _hidden(graph: Graph, gate: Node) -> int:
    """Size of one dispatched token: the last dim of the tokens the gate scores (read by the
    gate node, or by its user where the gate node only casts the weight: DeepSeek-V3)."""
    for n in (gate, *(graph.node(u) for u in graph.users[gate.name])):
        for i in n.inputs:
            src = graph.node(i)
            if i != gate.name and src.kind != "param" and src.out is not None and src.out.shape:
                return src.out.shape[-1]
    return 0


def _aux_loss(graph: Graph, after: set[str]) -> bool:
    """Whether a floating scalar that depends on the routing reaches the output."""
    scalars = [
        graph.node(a)
        for a in after
        if graph.node(a).out is not None
        and graph.node(a).out.shape == ()
        and graph.node(a).out.dtype.startswith(("float", "bfloat"))
    ]
    return any(any(graph.node(u).kind == "output" for u in _users_upto(graph, s)) for s in scalars)


def _users_upto(graph: Graph, n: Node) -> set[str]:
    return _descendants(graph, n.name) | {n.name}


def _descendants(graph: Graph, name: str) -> set[str]:
    seen: set[str] = set()
    stack = list(graph.users[name])
    while stack:
        u = stack.pop()
        if u not in seen:
            seen.add(u)
            stack.extend(graph.users[u])
    return seen


def _under(name: str, prefix: str) -> bool:
    return not prefix or name == prefix or name.startswith(prefix + ".")


def _common_prefix(fqns: list[str]) -> str:
    parts = [f.split(".") if f else [] for f in fqns]
    common = []
    for group in zip(*parts):
        if len(set(group)) != 1:
            break
        common.append(group[0])
    return ".".join(common)


def ep_why(graph: Graph, moe: MoE) -> str | None:
    """Why the emitted program cannot split ``moe``'s experts over ep ranks (None: it can).
    Stacked experts: where a module holds them and nothing else (the emitted all-to-all wraps
    it; a shared expert or a router beside them in one module has no such boundary). A module
    list's experts (one module each) run under ep by record and replay of the block that
    calls them (``autopar_runtime.expert_parallel``), which needs each expert called from the
    forward of the list's parent module, with one tensor (its rows), on inputs that no
    expert's output feeds (no expert chained after another)."""
    if moe.grouped:
        return _stacked_why(graph, moe)
    container = moe.experts[0].rpartition(".")[0]
    block = container.rpartition(".")[0]
    inside: dict[str, str] = {}  # node -> the expert it ran in
    for n in graph.nodes:
        expert = next((e for e in moe.experts if e in n.module_stack), None)
        if n.kind == "compute" and expert is not None:
            inside[n.name] = expert
            if block and block not in n.module_stack:
                return (
                    f"its expert {expert} is called from outside the forward of {block}, "
                    "the module holding the experts' list"
                )
    after: set[str] = set()  # every node an expert's output reaches
    stack = [u for name in inside for u in graph.users[name]]
    while stack:
        u = stack.pop()
        if u not in after:
            after.add(u)
            stack.extend(graph.users[u])
    feeds: dict[str, set[str]] = {}
    for name, expert in inside.items():
        for i in graph.node(name).inputs:
            src = graph.node(i)
            if inside.get(i) != expert and src.kind not in ("param", "buffer"):
                feeds.setdefault(expert, set()).add(i)
    for expert, inputs in feeds.items():
        if len(inputs) > 1:
            return (
                f"its expert {expert} reads {len(inputs)} tensors from outside the expert "
                "(expert parallelism sends an expert one tensor, its rows)"
            )
        if inputs & after:
            return (
                f"its expert {expert} reads another expert's output (experts chained; expert "
                "parallelism records the block's calls to its experts, then runs them at once)"
            )
    return None


def _stacked_why(graph: Graph, moe: MoE) -> str | None:
    """Why a module holding stacked experts cannot be split whole (None: it holds only them)."""
    for owner in moe.experts:
        for m in graph.modules.values():
            if not _under(m.fqn, owner):
                continue
            odd = [n for n, t in m.params.items() if m.fqn != owner or t.shape[:1] != (
                moe.num_experts,)]  # fmt: skip
            if odd:
                name = f"{m.fqn}.{odd[0]}" if m.fqn != owner else odd[0]
                return (
                    f"its stacked experts' module {owner or 'the model'} also holds "
                    f"{name}, not an expert weight (expert parallelism splits a module holding "
                    "only the experts' weights, first dim = experts, called as "
                    "experts(hidden, top_k_index, top_k_weights))"
                )
    return None
