"""The layers' calls as torch.export keeps them: the facts that decide where a pipeline can cut.

The emitted program cuts the model into pipeline stages on an export of its forward with every
planned layer's call signature preserved (``autopar_runtime.stages``). The trace exports the
same way (``preserve_module_call_signature`` of the outermost layer candidates, the modules
that become layers), so one export gives both the graph the planner costs and what a cut needs
(:class:`ir.graph.LayerCalls`), without exporting or running the model again:

- a layer called with a string or an object (a forward pre-hook sees every call's arguments):
  torch.export cannot keep it in a call signature, so the export is retried without those
  layers' signatures (the cut inlines a layer without parameters; one with parameters cannot
  be cut out at all);
- a tensor a layer is called with that no op reads (a causal mask the layer ignores): the
  export drops it from the call, so a stage cannot pass it;
- an export that cannot keep the signatures at all: its error, and the graph of a plain export.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
from autopar.ir.graph import LayerCalls
from torch import nn
from torch.export.graph_signature import TensorArgument

_PLAIN = (torch.Tensor, int, float, bool, type(None))

Export = Callable[[tuple[str, ...]], torch.export.ExportedProgram]
"""exports the model with the call signatures of the given module FQNs preserved."""


def outermost(candidates: Iterable[str]) -> list[str]:
    """The candidates inside no other candidate (a node's layer is its outermost candidate)."""
    found = set(candidates)
    out = []
    for fqn in found:
        parts = fqn.split(".")
        if not any(".".join(parts[:i]) in found for i in range(1, len(parts))):
            out.append(fqn)
    return sorted(out)


def export_with_calls(
    model: nn.Module, layers: list[str], export: Export
) -> tuple[torch.export.ExportedProgram, LayerCalls]:
    """The export of the forward with ``layers``' call signatures kept, where it can keep them,
    and what the calls tell a pipeline cut (see the module docstring). A forward that does not
    export at all raises the plain export's error."""
    with _odd_args(model, layers) as odd:
        try:
            ep = export(tuple(layers))
            return ep, _calls(ep, layers, odd)
        except Exception as e:  # export raises many kinds: the plain export says if it is ours
            failed = e
        ep = export(())
        held = [f for f in odd if next(model.get_submodule(f).parameters(), None) is not None]
        if odd and not held:  # a layer without parameters is inlined: keep the others' calls
            kept = [f for f in layers if f not in odd]
            try:
                again = export(tuple(kept))
                return again, _calls(again, kept, odd)
            except Exception as e:  # noqa: BLE001 - as above
                failed = e
    cause = failed.__cause__ or failed  # the export's own error, not the trace's wrapping
    return ep, LayerCalls(odd_args=dict(odd), error=None if held else _describe(cause))


@contextlib.contextmanager
def _odd_args(model: nn.Module, layers: list[str]) -> Iterator[dict[str, str]]:
    """Layer FQN -> its first argument that no call signature can hold, as the forward runs."""
    found: dict[str, str] = {}

    def hook(fqn: str):
        def record(module, args, kwargs) -> None:
            leaves = torch.utils._pytree.tree_leaves((args, kwargs))
            odd = [x for x in leaves if not isinstance(x, _PLAIN)]
            if odd and fqn not in found:
                text = repr(odd[0]) if isinstance(odd[0], str) else "object"
                found[fqn] = f"{type(odd[0]).__name__} {text}"[:80]

        return record

    handles = [
        model.get_submodule(f).register_forward_pre_hook(hook(f), with_kwargs=True) for f in layers
    ]
    try:
        yield found
    finally:
        for h in handles:
            h.remove()


def _calls(ep: torch.export.ExportedProgram, layers: list[str], odd: dict) -> LayerCalls:
    nodes = {n.name: n for n in ep.graph.nodes}
    unread = {}
    kept = set(layers)
    for entry in ep.module_call_graph:
        if entry.fqn not in kept or entry.signature is None:
            continue
        for arg in entry.signature.inputs:
            if isinstance(arg, TensorArgument) and arg.name in nodes and not nodes[arg.name].users:
                unread.setdefault(entry.fqn, arg.name)
    return LayerCalls(odd_args=dict(odd), unread_args=unread)


def _describe(e: BaseException) -> str:
    """An exception in a few words: its type and the first line of its message."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text[:160]}" if text else type(e).__name__
