"""Where the model can be cut into pipeline stages, decided once from the traced graph.

The emitted script cuts the model on an export of its forward in which every layer is one call
(``codegen/runtime/autopar_runtime/stages.py``): a layer call runs in the stage that lists the
layer, the ops between calls ("glue": root-level ops, containers, the base model) run as late as
they can (in their first reader's stage), and only tensors pass between stages. The trace
exported the forward the same way and kept what the calls show (:class:`ir.graph.LayerCalls`),
so the boundaries a script can cut are known before the search, from the graph alone, and the
search runs once with them (:class:`planner.stages.Cuts`). A boundary b (between layers b - 1
and b) is refused, with the reason, where:

- a value made in a later layer reaches an earlier one, directly or through glue: stages
  follow the order the forward calls layers in (a module called twice, a skip connection
  read backwards);
- a tensor has several names held by layers on both sides (a head tied to the embedding), or
  a parameter or buffer read by glue has readers on both sides: a pipeline cannot share a
  tensor between stages;
- a value that is no tensor made on one side is read on the other;
- a layer called with a string and no parameters (inlined by the script, no call of its own)
  would start a stage: it joins the stage of the layer before it (after it, at the start).

The whole model is refused where torch.export cannot keep the layers' calls, where a layer
holding parameters is called with a string or an object, or where a layer is called with a
tensor no op reads (the export drops it from the call). Where the graph cannot tell, a
boundary is refused rather than allowed; the script still checks its cut when it starts
(``split_into_stages``).
"""

from __future__ import annotations

from autopar.ir import Graph
from autopar.planner.stages import Cuts

_PP1 = "plan without pipeline parallelism (--mesh pp=1)"


def cuts(graph: Graph) -> Cuts:
    """The layer boundaries of ``graph`` where the emitted script can cut it into stages."""
    layers = [layer.fqn for layer in graph.layers]
    calls = graph.calls
    everywhere = frozenset(range(1, len(layers)))
    if calls is None:  # a graph built without the calls (hand-made): nothing to refuse
        return Cuts(allowed=everywhere)
    refused = _refused(graph, layers)
    if refused is not None:
        return Cuts(allowed=frozenset(), refused=refused)
    why: dict[int, str] = {}

    def refuse(first: int, last: int, reason: str) -> None:
        """Refuse boundaries first .. last (the layers first - 1 and last stay together)."""
        for b in range(max(first, 1), min(last, len(layers) - 1) + 1):
            why.setdefault(b, reason)

    _order_and_state(graph, layers, refuse)
    _tied(graph, layers, refuse)
    _inlined(graph, layers, refuse)
    return Cuts(allowed=everywhere - set(why), why=tuple(sorted(why.items())))


def _refused(graph: Graph, layers: list[str]) -> str | None:
    """Why no boundary can be cut, or None."""
    calls = graph.calls
    assert calls is not None
    model = graph.root_type.rpartition(".")[2]
    if calls.error is not None:
        return f"cannot export {model} to cut it into pipeline stages ({calls.error}): {_PP1}"
    held = [f for f in layers if f in calls.odd_args and _holds_params(graph, f)]
    if held:
        return (
            f"layer {held[0]} is called with a {calls.odd_args[held[0]]} argument and holds "
            "parameters: torch.export cannot keep a string or an object in a call signature, "
            "so a pipeline stage cannot call it; pass tensors, ints or floats to it, or "
            f"{_PP1}"
        )
    unread = [f for f in layers if f in calls.unread_args]
    if unread:
        name = calls.unread_args[unread[0]]
        node = next((n for n in graph.nodes if n.name == name), None)
        where = f" ({node.source})" if node is not None and node.source else ""
        hinted = _torch_transformer_layer(graph, unread[0])
        if hinted is not None:
            return (
                f"layer {unread[0]} ({hinted}) is called with a mask that no op reads "
                f"({name}{where}) and the is_causal hint: nn.MultiheadAttention leaves the "
                "mask to SDPA's own causal masking, torch.export drops it from the layer's call "
                "and the layer, called without it, refuses the hint, so a pipeline stage "
                "cannot call it; pass "
                "the causal mask with is_causal=False (tgt_is_causal=False for "
                f"nn.TransformerDecoder): the layers read it and the model cuts; or {_PP1}"
            )
        return (
            f"layer {unread[0]} is called with a tensor that no op reads ({name}{where}, e.g. "
            "a mask the layer ignores): torch.export drops it from the layer's call, so a "
            f"pipeline stage cannot pass it; pass only what the layer reads, or {_PP1}"
        )
    return None


_TORCH_LAYERS = {
    f"torch.nn.modules.transformer.{name}": f"torch.nn.{name}"
    for name in ("TransformerEncoderLayer", "TransformerDecoderLayer")
}


def _torch_transformer_layer(graph: Graph, fqn: str) -> str | None:
    """torch's own transformer layer class ``fqn`` is, or the one it is the first of (a layer
    that is an nn.TransformerEncoder holds its layers), else None."""
    for m, info in sorted(graph.modules.items()):
        if (m == fqn or m.startswith(fqn + ".")) and info.type in _TORCH_LAYERS:
            return _TORCH_LAYERS[info.type]
    return None


def _holds_params(graph: Graph, fqn: str) -> bool:
    return any(
        info.params for m, info in graph.modules.items() if m == fqn or m.startswith(fqn + ".")
    )


def _called(graph: Graph, layers: list[str]) -> dict[str, int]:
    """Layer FQN -> its index, for the layers the script calls (modules, not inlined)."""
    odd = graph.calls.odd_args if graph.calls is not None else {}
    return {
        layer.fqn: i
        for i, layer in enumerate(graph.layers)
        if layer.is_module and layer.fqn not in odd
    }


def _order_and_state(graph: Graph, layers: list[str], refuse) -> None:
    """Values read against the forward's order, state shared across a boundary, non-tensor
    values crossing one (see the module docstring)."""
    called = _called(graph, layers)
    last = len(layers) - 1

    def call_of(node) -> int | None:
        for fqn in node.module_stack:
            if fqn in called:
                return called[fqn]
        return None

    index = {n.name: call_of(n) if n.kind == "compute" else None for n in graph.nodes}
    kinds = {n.name: n.kind for n in graph.nodes}
    # glue: the latest layer it must follow (made from), and the earliest it runs in (read by)
    made: dict[str, tuple[int, str]] = {}
    for n in graph.nodes:
        if n.kind != "compute":
            continue
        sources = [
            (index[i], layers[index[i]]) if index[i] is not None else made.get(i, (-1, ""))
            for i in n.inputs
        ]
        latest = max(sources, default=(-1, ""))
        i = index[n.name]
        if i is None:
            made[n.name] = latest
        elif latest[0] > i:
            refuse(i + 1, latest[0], f"the forward runs {layers[i]} after {latest[1]}: stages "
                                     "must follow the order the forward calls layers in")  # fmt: skip
    runs_in: dict[str, int] = {}
    for n in reversed(graph.nodes):
        if n.kind == "output":
            continue
        users = graph.users[n.name]
        readers = [index[u] if index[u] is not None else runs_in.get(u) for u in users
                   if kinds[u] != "output"]  # fmt: skip
        readers = [r for r in readers if r is not None]
        if readers or any(kinds[u] == "output" for u in users):
            runs_in[n.name] = min(readers, default=last)
    for n in graph.nodes:
        if n.kind in ("param", "buffer"):
            _state(graph, n, index, runs_in, layers, refuse)
        elif n.kind == "compute" and n.outputs and all(o is None for o in n.outputs):
            here = index[n.name] if index[n.name] is not None else made[n.name][0]
            there = [index[u] for u in graph.users[n.name] if index.get(u) is not None]
            if here >= 0 and there and max(there) > here:
                refuse(here + 1, max(there), f"the cut after {layers[here]} would pass a value "
                       f"that is no tensor ({n.name}): pipeline stages pass only tensors; cut "
                       "at another layer boundary")  # fmt: skip


def _state(graph: Graph, n, index, runs_in, layers, refuse) -> None:
    """A parameter or buffer read by glue: every reader in one stage."""
    users = graph.users[n.name]
    if all(index.get(u) is not None for u in users):
        return  # read inside layer calls only (a tied weight is :func:`_tied`'s)
    stages = {index[u] if index.get(u) is not None else runs_in.get(u) for u in users}
    stages.discard(None)  # a reader nothing reads runs with what it reads
    if len(stages) > 1:
        fqn = n.params[0] if n.params else n.name
        refuse(min(stages) + 1, max(stages), f"{fqn} is read by layers {layers[min(stages)]} "
               f"and {layers[max(stages)]}: a pipeline cannot share a tensor between stages; "
               "plan its readers into one stage")  # fmt: skip


def _owner(fqn: str, called: dict[str, int]) -> int | None:
    parts = fqn.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if ".".join(parts[:i]) in called:
            return called[".".join(parts[:i])]
    return None


def _tied(graph: Graph, layers: list[str], refuse) -> None:
    """A tensor with several names, held by layers on both sides of a boundary."""
    called = _called(graph, layers)
    assert graph.calls is not None
    for alias, name in graph.calls.shared_state.items():
        here, there = _owner(name, called), _owner(alias, called)
        if here is None or there is None or here == there:
            continue
        first, second = (name, alias) if here < there else (alias, name)
        refuse(min(here, there) + 1, max(here, there), f"{second} is tied to {first}: a "
               "pipeline cannot share a weight between stages; plan without pipeline "
               "parallelism, or untie (tie_word_embeddings=false)")  # fmt: skip


def _inlined(graph: Graph, layers: list[str], refuse) -> None:
    """A layer the script inlines (called with a string, no parameters) never starts a stage."""
    called = _called(graph, layers)
    if not called:
        return
    first = min(called.values())
    for i, fqn in enumerate(layers):
        if fqn in called:
            continue
        reason = (
            f"layer {fqn} holds no module the forward calls (a layer without parameters called "
            "with a string is inlined), so it cannot start a stage; cut at another layer boundary"
        )
        if i < first:
            refuse(i + 1, i + 1, reason)  # with the first called layer after it
        else:
            refuse(i, i, reason)  # with the layer before it
