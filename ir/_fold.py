"""Trace each distinct block once: repeated blocks are traced twice and replicated in the IR.

A 126-block model costs torch.export ~40 ms a block on meta, so tracing it whole takes seconds
while its blocks are identical. Where a ``ModuleList`` or ``Sequential`` ends in a run of >= 3
structurally identical children (the same key as :func:`ir._layers.layer_candidates`: types,
parameter shapes, child names; the children before the run, e.g. DeepSeek-V3's dense layers
before its MoE layers, are traced as they are), :func:`folded` swaps in a container of the
children before the run and the run's first two for the trace; :func:`unfold` then rebuilds the IR of the whole model from the traced one: children
2 .. N-1 are copies of child 1 (nodes, parameters, saved bytes, layer), renamed, reading from the
copy before them where child 1 reads from child 0; whatever follows the run reads from the last
copy where it read from child 1.

Two children, not one, are traced so that the link between consecutive blocks is seen (what
block i + 1 reads of block i), and so that the fold can be checked: the two traced children must
be layers with equal signatures, and nothing after the run may read child 0 (a model that keeps
every block's hidden states does). A model that fails a check, or whose forward does not run on
two children (e.g. it indexes blocks by a configured count), is traced whole instead
(:class:`CannotFold`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from autopar.ir._layers import layer_candidates, structural_keys
from autopar.ir.graph import Layer, Node, Ref
from torch import nn

_MIN_RUN = 3  # a container of fewer children gains nothing from folding


class CannotFold(Exception):
    """The traced IR of the folded model cannot stand for the whole model."""


@dataclass(frozen=True)
class Fold:
    """One container traced with its first two children."""

    fqn: str
    """the container's FQN (``blocks``, ``model.layers``)."""
    count: int
    """children of the real container."""
    parent: nn.Module
    name: str
    container: nn.Module
    start: int = 0
    """the first child of the run of identical children (the ones before it differ, e.g.
    DeepSeek-V3's dense layers before its MoE layers): children start .. count-1 fold."""


def find_folds(model: nn.Module) -> list[Fold]:
    """The containers to fold: exactly ModuleList/Sequential, >= 3 children that are distinct
    modules with parameters, all with one structural key, no parameter shared with anything
    outside the child, and not inside another folded container."""
    keys = structural_keys(model)
    layers = layer_candidates(model)
    folds: list[Fold] = []
    for fqn, m in model.named_modules():
        if type(m) not in (nn.ModuleList, nn.Sequential) or len(m) < _MIN_RUN:
            continue
        if any(fqn.startswith(f.fqn + ".") for f in folds):
            continue
        children = list(m.children())
        if len({id(c) for c in children}) != len(m):
            continue
        start = _run_start(children, keys)
        if len(m) - start < _MIN_RUN or next(children[start].parameters(), None) is None:
            continue
        if f"{fqn}.{start}" not in layers:  # e.g. a ModuleList of experts inside a block: the
            continue  # block is the layer, and its forward may loop over every child
        parent_fqn, _, name = fqn.rpartition(".")
        folds.append(Fold(fqn, len(m), model.get_submodule(parent_fqn), name, m, start))
    if folds:  # a parameter of a folded child also reachable under another name: trace whole
        uses: dict[int, int] = {}
        for _, p in model.named_parameters(remove_duplicate=False):
            uses[id(p)] = uses.get(id(p), 0) + 1
        folds = [f for f in folds if all(uses[id(p)] == 1 for p in f.container.parameters())]
    return folds


def _run_start(children: list[nn.Module], keys: dict[int, str]) -> int:
    """Where the last run of structurally identical children starts (0: all alike)."""
    start = len(children) - 1
    while start > 0 and keys[id(children[start - 1])] == keys[id(children[-1])]:
        start -= 1
    return start


@contextlib.contextmanager
def folded(folds: list[Fold]) -> Iterator[None]:
    """Swap each folded container for one holding its first two children; restore on exit."""
    try:
        for f in folds:
            f.parent._modules[f.name] = type(f.container)(*_first_two(f.container, f.start))
        yield
    finally:
        for f in folds:
            f.parent._modules[f.name] = f.container


def _first_two(container: nn.Module, start: int = 0) -> tuple[Any, ...]:
    """The children before the run and the run's first two."""
    children = list(container.children())[: start + 2]
    return (children,) if isinstance(container, nn.ModuleList) else tuple(children)


def unfold(nodes: list[Node], layers: list[Layer], fold: Fold) -> tuple[list[Node], list[Layer]]:
    """The IR with fold.fqn's children 2 .. count-1 restored (see the module docstring)."""
    first, second = f"{fold.fqn}.{fold.start}", f"{fold.fqn}.{fold.start + 1}"
    by_fqn = {layer.fqn: layer for layer in layers}
    if first not in by_fqn or second not in by_fqn:
        raise CannotFold(f"{fold.fqn}: its children are not layers")
    l0, l1 = by_fqn[first], by_fqn[second]
    if l0.signature != l1.signature or len(l0.nodes) != len(l1.nodes):
        raise CannotFold(f"{fold.fqn}: its first two children differ once traced")
    index = {n.name: i for i, n in enumerate(nodes)}
    in0 = set(l0.nodes)
    # compute nodes of child 1 by position <-> child 0; state (params/buffers) of child 1
    partner = dict(zip(l0.nodes, l1.nodes))
    state1 = [n for n in nodes if n.kind in ("param", "buffer") and n.layer == second]
    last1 = max(index[name] for name in l1.nodes)
    for n in nodes[last1 + 1 :]:
        if any(i in in0 for i in n.inputs):
            raise CannotFold(f"{n.name} after {fold.fqn} reads its first child")
    taken = set(index)

    def clone_name(name: str, i: int) -> str:
        out = f"{name}__{i}"
        if out in taken:
            raise CannotFold(f"node name {out} taken")
        return out

    old = _prefix_re(second)
    copies: list[list[Node]] = []  # per child i >= 2: its compute nodes
    state_copies: list[tuple[str, Node]] = []  # (kind, copy): params and buffers apart
    prev = {name: name for name in l1.nodes}  # child 1's node -> the same node of child i - 1
    new_layers = []
    for i in range(fold.start + 2, fold.count):
        new = f"{fold.fqn}.{i}"
        rename = {n.name: clone_name(n.name, i) for n in state1}
        rename.update({name: clone_name(name, i) for name in l1.nodes})
        # child 1 reads child 0's node x: child i reads child i - 1's copy of x's partner
        reads = {x: prev[partner[x]] for x in in0}
        mapping = {**reads, **rename}
        for n in state1:
            state_copies.append((n.kind, _copy(n, rename[n.name], mapping, old, new)))
        copies.append([_copy(nodes[index[name]], rename[name], mapping, old, new)
                       for name in l1.nodes])  # fmt: skip
        new_layers.append(replace(l1, fqn=new, nodes=tuple(rename[name] for name in l1.nodes)))
        prev = {name: rename[name] for name in l1.nodes}
    out: list[Node] = []
    # export lists every parameter, then every buffer: each copy goes after its kind's last
    last_state1 = {
        kind: max((index[n.name] for n in state1 if n.kind == kind), default=-1)
        for kind in ("param", "buffer")
    }
    for j, n in enumerate(nodes):
        if j > last1:
            n = _remap(n, prev)  # what follows the run reads the last child
            if n.layer == second:  # the output node takes its producer's layer
                n = replace(n, layer=f"{fold.fqn}.{fold.count - 1}")
        out.append(n)
        for kind, last in last_state1.items():
            if j == last:
                out.extend(copy for k, copy in state_copies if k == kind)
        if j == last1:
            out.extend(node for copy in copies for node in copy)
    pos = next(j for j, layer in enumerate(layers) if layer.fqn == second)
    return out, [*layers[: pos + 1], *new_layers, *layers[pos + 1 :]]


def _prefix_re(fqn: str) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(fqn)}(?=\.|$)")


def _copy(n: Node, name: str, mapping: dict[str, str], old: re.Pattern[str], new: str) -> Node:
    """Node n of child 1 as the same node of child ``new``."""
    sub = lambda fqn: old.sub(new, fqn)  # noqa: E731
    return replace(
        _remap(n, mapping),
        name=name,
        module_stack=tuple(sub(m) for m in n.module_stack),
        layer=sub(n.layer),
        params=tuple(sub(p) for p in n.params),
    )


def _remap(n: Node, mapping: dict[str, str]) -> Node:
    if not any(i in mapping for i in n.inputs):
        return n
    return replace(
        n,
        args=_map(n.args, mapping),
        kwargs=tuple((k, _map(v, mapping)) for k, v in n.kwargs),
    )


def _map(value: Any, mapping: dict[str, str]) -> Any:
    if isinstance(value, Ref):
        return Ref(mapping.get(value.name, value.name))
    if isinstance(value, tuple | list):
        return type(value)(_map(v, mapping) for v in value)
    if isinstance(value, dict):
        return {k: _map(v, mapping) for k, v in value.items()}
    return value
