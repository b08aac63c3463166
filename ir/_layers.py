"""Modules, layers and layer signatures of a traced model.

A layer is the first module on a node's module stack (outermost first, root excluded) that is not
a container (ModuleList/ModuleDict/Sequential) and either is one of the repeated children of a
container or holds no repeated container in its subtree. A container repeats when >= 2 of its
children that hold parameters are structurally identical (same types, parameter shapes, child
names): so ``blocks.0`` of a ModuleList of blocks is a layer even if its MLP is a Sequential of two
equal Linears, and parameter-free repeats (two ReLUs) do not split a module. Nodes outside every
layer (root-level ops) join the layer of the preceding compute node (the following one at the
start). A model without any layer is one layer ``""``.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from typing import Any

from autopar.ir.graph import Layer, ModuleInfo, Node, Ref, TensorMeta
from torch import nn

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def type_name(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def module_infos(model: nn.Module) -> dict[str, ModuleInfo]:
    """ModuleInfo of every module (shared modules under their first FQN)."""
    out = {}
    for fqn, m in model.named_modules():
        out[fqn] = ModuleInfo(
            fqn=fqn,
            type=type_name(m),
            params={
                n: TensorMeta(tuple(p.shape), dtype_name(p.dtype))
                for n, p in m.named_parameters(recurse=False)
            },
            int_attrs={
                k: v for k, v in vars(m).items() if type(v) is int and not k.startswith("_")
            },
            children=tuple(_join(fqn, n) for n, _ in m.named_children()),
            frozen=tuple(n for n, p in m.named_parameters(recurse=False) if not p.requires_grad),
        )
    return out


def structural_keys(model: nn.Module) -> dict[int, str]:
    """module id -> a hash of its type, direct parameters' names, shapes, dtypes and whether they
    require grad, and its children's names and keys: equal keys, structurally identical modules
    (a frozen block is not a copy of a trainable one: it has no gradients or optimizer state)."""
    key: dict[int, str] = {}
    for _, m in reversed(list(model.named_modules())):  # children before parents
        parts = (
            type_name(m),
            [
                (n, tuple(p.shape), str(p.dtype), p.requires_grad)
                for n, p in m.named_parameters(recurse=False)
            ],
            [(n, key[id(c)]) for n, c in m.named_children()],
        )
        key[id(m)] = hashlib.sha1(repr(parts).encode()).hexdigest()
    return key


def layer_candidates(model: nn.Module) -> set[str]:
    """FQNs of the modules that may be layers (see the module docstring)."""
    key = structural_keys(model)
    repeats: dict[int, bool] = {}  # module id -> its subtree holds a repeated container
    repeated_children: set[int] = set()
    modules = list(model.named_modules())
    for _, m in reversed(modules):  # pre-order reversed: children before parents
        children = list(m.named_children())
        repeats[id(m)] = any(repeats[id(c)] for _, c in children)
        if isinstance(m, _CONTAINERS):
            weighted = [c for _, c in children if next(c.parameters(), None) is not None]
            counts = Counter(key[id(c)] for c in weighted)
            again = {id(c) for c in weighted if counts[key[id(c)]] >= 2}
            repeated_children |= again
            repeats[id(m)] |= bool(again)
    return {
        fqn
        for fqn, m in modules[1:]
        if not isinstance(m, _CONTAINERS) and (id(m) in repeated_children or not repeats[id(m)])
    }


def assign_layers(nodes: list[Node], candidates: set[str]) -> dict[str, str]:
    """compute node name -> layer FQN."""
    own = {}
    for n in nodes:
        if n.kind == "compute":
            own[n.name] = next((m for m in n.module_stack if m in candidates), None)
    if all(v is None for v in own.values()):
        return dict.fromkeys(own, "")
    first = next(v for v in own.values() if v is not None)
    out, prev = {}, first
    for name, layer in own.items():
        prev = layer if layer is not None else prev
        out[name] = prev
    return out


def build_layers(
    model: nn.Module,
    nodes: list[Node],
    layer_of: dict[str, str],
    state_fqn: dict[str, str],
    aliases: set[str],
) -> tuple[Layer, ...]:
    """The layers, in order of first appearance, from the compute node -> layer assignment."""
    fqns = list(dict.fromkeys(layer_of.values())) or [""]
    members: dict[str, list[str]] = {fqn: [] for fqn in fqns}
    for name, fqn in layer_of.items():
        members[fqn].append(name)
    params = _layer_params(model, fqns, nodes, layer_of)
    ctx = _LayerInputs(model, {n.name: n for n in nodes}, state_fqn, aliases)
    return tuple(_build_layer(f, members[f], params[f], ctx) for f in fqns)


@dataclass
class _LayerInputs:
    """What :func:`_build_layer` needs besides the layer's own nodes."""

    model: nn.Module
    nodes: dict[str, Node]
    state_fqn: dict[str, str]
    """param/buffer node name -> FQN of the parameter or buffer."""
    aliases: set[str]
    """compute nodes whose output aliases an input (views)."""


def _build_layer(fqn: str, names: list[str], params: list[Any], ctx: _LayerInputs) -> Layer:
    """The Layer of module ``fqn`` from its compute nodes and the parameters it owns."""
    nodes = [ctx.nodes[n] for n in names]
    frozen = [p for p in params if not p.requires_grad]
    return Layer(
        fqn=fqn,
        is_module=True,
        nodes=tuple(names),
        signature=_signature(fqn, nodes, ctx),
        param_numel=sum(p.numel() for p in params),
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        frozen_numel=sum(p.numel() for p in frozen),
        frozen_bytes=sum(p.numel() * p.element_size() for p in frozen),
        fwd_flops=sum(n.fwd_flops for n in nodes),
        bwd_flops=sum(n.bwd_flops for n in nodes),
        # Estimate, to be replaced by measurement: every non-view output is kept for backward.
        activation_bytes=sum(
            sum(t.num_bytes for t in n.outputs if t is not None)
            for n in nodes
            if n.name not in ctx.aliases
        ),
    )


def _layer_params(
    model: nn.Module, layers: list[str], nodes: list[Node], owner: dict[str, str]
) -> dict[str, list[Any]]:
    """layer FQN -> the distinct parameters it owns; a tied parameter counts once, in its first
    layer; parameters outside every layer go to the layer of their first reader (else the first
    layer)."""
    by_layer: dict[str, list[Any]] = {fqn: [] for fqn in layers}
    seen: set[int] = set()
    for fqn in layers:
        for p in model.get_submodule(fqn).parameters():
            if id(p) not in seen:
                seen.add(id(p))
                by_layer[fqn].append(p)
    named = dict(model.named_parameters(remove_duplicate=False))
    reader = {}
    for n in nodes:
        for p in n.params:
            reader.setdefault(p, owner.get(n.name))
    for name, p in named.items():
        if id(p) not in seen:
            seen.add(id(p))
            by_layer[reader.get(name) or layers[0]].append(p)
    return by_layer


def _signature(fqn: str, nodes: list[Node], ctx: _LayerInputs) -> str:
    pos = {n.name: i for i, n in enumerate(nodes)}
    external: dict[str, int] = {}

    def ref(r: Ref) -> str:
        if r.name in pos:
            return f"%{pos[r.name]}"
        state = ctx.state_fqn.get(r.name)
        if state is not None and _under(state, fqn):
            return f"state:{_rel(state, fqn)}"
        i = external.setdefault(r.name, len(external))
        return f"in{i}:{ctx.nodes[r.name].outputs}"

    ops = [
        (
            n.op,
            n.outputs,
            _rel(n.module_fqn, fqn) if _under(n.module_fqn, fqn) else "^",
            _map_refs(n.args, ref),
            _map_refs(n.kwargs, ref),
        )
        for n in nodes
    ]
    mod = ctx.model.get_submodule(fqn)
    structure: list[Any] = [(rel, type_name(m)) for rel, m in mod.named_modules()]
    structure += [(rel, tuple(p.shape), str(p.dtype)) for rel, p in mod.named_parameters()]
    text = repr((structure, ops))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _map_refs(value: Any, ref: Any) -> Any:
    if isinstance(value, Ref):
        return ref(value)
    if isinstance(value, tuple | list):
        return tuple(_map_refs(v, ref) for v in value)
    if isinstance(value, dict):
        return {k: _map_refs(v, ref) for k, v in value.items()}
    return value


def _under(name: str, prefix: str) -> bool:
    return not prefix or name == prefix or name.startswith(prefix + ".")


def _rel(name: str, prefix: str) -> str:
    if not prefix:
        return name
    return "" if name == prefix else name[len(prefix) + 1 :]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
