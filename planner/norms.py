"""Sequence parallelism's modules, recognised from the traced graph rather than by class: the
norms that can run on sequence shards (:func:`norm_modules`: a module with 1-D parameters of
the hidden size whose ops, fed a sequence shard, compute the sequence shard of their result,
by :func:`planner.layouts.propagate`), per-head norms (:func:`heads_norm`), and the layers where
a replicated tensor may enter the sequence-parallel region (:func:`scatter_layers`).
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.ir import Graph, Node
from autopar.planner.layouts import MODULE_OPS, R, _pkt, propagate, shard

__all__ = ["NormModule", "heads_norm", "norm_modules", "scatter_layers"]


@dataclass(frozen=True)
class NormModule:
    """A module that sequence parallelism can run on sequence shards (see :func:`norm_modules`)."""

    fqn: str
    nodes: tuple[str, ...]
    """its op nodes that output a tensor, in graph order."""
    input: str
    """the one activation it reads from outside."""
    output: str
    """its one node read from outside (the module's output)."""
    aliases: tuple[str, ...] = ()
    """its nodes that only alias its input (an fp32 ``.to(float32)`` of an fp32 input): the
    trace may show ops outside reading them, which in the model read the input itself."""


def norm_modules(graph: Graph) -> dict[str, NormModule]:
    """Modules that normalise (or scale) each position of a ``(batch, seq, ..., hidden)``
    activation on its own, recognised from the traced ops, whatever their class: parameters
    all 1-D of the hidden size; no submodules; one activation read from outside, called once;
    one output of the input's shape; and every op, fed the input sharded on the sequence dim
    (parameters whole), computes the sequence shard of its result (:func:`propagate`): a
    reduction over the hidden dim passes, one over the sequence does not. ``nn.LayerNorm``
    (one ``layer_norm`` op), ``nn.RMSNorm`` and HF's ``LlamaRMSNorm`` (pow, mean, rsqrt, mul in
    fp32) all pass; a Linear (2-D weight) or a module mixing positions does not."""
    users = graph.users
    outputs = {i for n in graph.nodes if n.kind == "output" for i in n.inputs}
    members: dict[str, list[Node]] = {}
    for n in graph.nodes:
        if n.kind == "compute":
            for fqn in n.module_stack:
                members.setdefault(fqn, []).append(n)
    found = {}
    for fqn, nodes in members.items():
        info = graph.modules.get(fqn)
        if not fqn or info is None or info.children or not info.params:
            continue
        sizes = {m.shape for m in info.params.values()}
        if len(sizes) != 1 or len(next(iter(sizes))) != 1:
            continue
        hidden = next(iter(sizes))[0]
        own = {f"{fqn}.{p}" for p in info.params}
        names = {n.name for n in nodes}
        if any(p not in own for n in nodes for p in n.params):
            continue
        ext = list(
            dict.fromkeys(
                r
                for n in nodes
                for r in n.inputs
                if r not in names and graph.node(r).kind not in ("param", "buffer")
            )
        )
        if len(ext) != 1 or graph.node(ext[0]).out is None:
            continue
        x = graph.node(ext[0]).out
        if len(x.shape) < 3 or x.shape[-1] != hidden:
            continue
        aliases = tuple(
            n.name
            for n in nodes
            if n.inputs == (ext[0],) and n.out == x and _pkt(n.op) in _ALIAS_OPS
        )
        leaving = [
            n.name
            for n in nodes
            if n.out is not None
            and n.name not in aliases
            and (n.name in outputs or any(u not in names for u in users.get(n.name, ())))
        ]
        if len(leaving) != 1 or graph.node(leaving[0]).out.shape != x.shape:
            continue
        lay = {ext[0]: shard(1)}
        ok = True
        for n in nodes:
            if n.out is None:
                continue
            got = propagate(n, graph, [lay.get(r, R) for r in n.inputs], 1)
            if got is None:
                ok = False
                break
            lay[n.name] = got
        if ok and lay.get(leaving[0]) == shard(1):
            kept = tuple(n.name for n in nodes if n.out is not None)
            found[fqn] = NormModule(fqn, kept, ext[0], leaving[0], aliases)
    return found


_ALIAS_OPS = {"to", "_to_copy", "alias", "clone", "contiguous", "detach"}


def heads_norm(graph: Graph, norm: NormModule) -> bool:
    """Whether ``norm`` reads a rank >= 4 activation (a ``(batch, seq, heads, head_dim)`` view)
    and its ops, fed that input sharded on dim 2 (local heads, parameters whole), compute the
    dim-2 shard of its result: a norm over ``head_dim`` only (Qwen3's q_norm/k_norm). Its weight
    gradient is then a partial sum per rank: the style runs it as a DTensor (all-reduced)."""
    x = graph.node(norm.input).out
    if x is None or len(x.shape) < 4:
        return False
    lay = {norm.input: shard(2)}
    for name in norm.nodes:
        n = graph.node(name)
        got = propagate(n, graph, [lay.get(r, R) for r in n.inputs], 1)
        if got is None:
            return False
        lay[name] = got
    return lay.get(norm.output) == shard(2)


def scatter_layers(graph: Graph, norms: dict[str, NormModule] | None = None) -> dict[str, str]:
    """node name -> the layer whose input it is, where a replicated activation may enter the
    sequence-parallel region at that layer's boundary (``PrepareModuleInput`` from Replicate to
    Shard(1) on the layer, its first positional argument): a ``(batch, seq, ...)`` tensor made
    outside the layer, read only by ops inside that one module layer (not a Linear or Embedding,
    not a norm), the layer's one outside input of its
    shape (so it is the residual stream the layer is called with) and of the shape of the
    layer's output, and not made by a copy of the same layer (a run of identical layers keeps
    one layout through the run)."""
    users = graph.users
    norms = norm_modules(graph) if norms is None else norms
    found = {}
    for n in graph.nodes:
        if n.kind != "compute" or n.out is None or len(n.out.shape) < 3:
            continue
        readers = {graph.node(u).layer for u in users.get(n.name, ())}
        if len(readers) != 1:
            continue
        fqn = next(iter(readers))
        layer = graph.layer(fqn)
        if not layer.is_module or fqn == n.layer or not fqn or fqn in norms:
            continue  # (a norm layer takes sequence shards through its own style)
        if graph.modules[fqn].type in MODULE_OPS or any(
            fqn not in graph.node(u).module_stack for u in users[n.name]
        ):
            continue  # read by ops the layer's module runs (not root-level ops joined to it)
        if graph.layer(n.layer).signature == layer.signature:
            continue
        inside = set(layer.nodes)
        last = next(
            (graph.node(m) for m in reversed(layer.nodes) if graph.node(m).out is not None),
            None,
        )
        if last is None or last.out.shape != n.out.shape:
            continue
        same = {
            r
            for m in layer.nodes
            for r in graph.node(m).inputs
            if r not in inside
            and graph.node(r).kind not in ("param", "buffer")
            and graph.node(r).out is not None
            and graph.node(r).out.shape == n.out.shape
        }
        if same == {n.name}:
            found[n.name] = fqn
    return found
