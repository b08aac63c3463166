"""Linear subclasses that multiply by their weight themselves, seen as the linear they compute.

HF Falcon's ``FalconLinear(nn.Linear)`` computes ``input @ self.weight.T`` and adds its bias
separately (unfused on purpose, for bf16 rounding). ``torch.export`` records that as a
transpose of the weight, a ``matmul`` and an ``add``, not ``aten.linear``, so the planner would
not know the module as a linear and would never shard it. torch's ``ColwiseParallel`` and
``RowwiseParallel`` take any ``nn.Linear`` subclass and shard its weight (and bias) the same
way; its own forward then runs on DTensors, where ``x @ w.T (+ b)`` gives the same shards as
``F.linear``.

:func:`as_linears` folds exactly that pattern, and nothing else, into one ``aten.linear``
node inside a module that is an ``nn.Linear`` subclass: a transpose of its weight read only by a
``matmul(x, w.T)``, optionally followed by an ``add`` of its bias, with no other op in the module.
The folded node keeps the last node's name (its readers stay as they are), the FLOPs and saved
bytes of the nodes it replaces, and records the module as ``torch.nn.Linear``
(:data:`LINEAR`), the type the planner styles. Any other forward stays as traced.
"""

from __future__ import annotations

from dataclasses import replace

from autopar.ir.graph import ModuleInfo, Node, Ref
from torch import nn

LINEAR = "torch.nn.modules.linear.Linear"
_TRANSPOSES = {"aten.numpy_T.default", "aten.t.default", "aten.transpose.int"}


def _subclasses(model: nn.Module) -> dict[str, nn.Linear]:
    return {
        fqn: m
        for fqn, m in model.named_modules()
        if isinstance(m, nn.Linear) and type(m) is not nn.Linear
    }


def as_linears(model: nn.Module, nodes: list[Node]) -> tuple[list[Node], set[str]]:
    """``nodes`` with each linear subclass's ``x @ w.T (+ b)`` folded into one ``aten.linear``
    node; and the names of the nodes folded away."""
    subs = _subclasses(model)
    if not subs:
        return nodes, set()
    own: dict[str, list[Node]] = {}
    for n in nodes:
        if n.kind == "compute" and n.module_fqn in subs:
            own.setdefault(n.module_fqn, []).append(n)
    users: dict[str, int] = {}
    for n in nodes:
        for r in n.inputs:
            users[r] = users.get(r, 0) + 1
    params = {n.name: n.params[0] for n in nodes if n.kind == "param" and n.params}
    folded: dict[str, Node] = {}  # the last node's name -> the linear node
    gone: set[str] = set()
    for fqn, mine in own.items():
        # a module called twice has its pattern twice: fold each call
        i = 0
        while i < len(mine):
            call = _fold(fqn, mine[i : i + 3], users, params)
            if call is None:
                break
            linear, names = call
            folded[linear.name] = linear
            gone |= names
            i += len(names) + 1
        else:
            continue
        for name in list(folded):  # an unmatched call: keep the module as traced
            if folded[name].module_fqn == fqn:
                gone -= {n.name for n in mine}
                del folded[name]
    out = [folded.get(n.name, n) for n in nodes if n.name not in gone]
    return out, gone


def _fold(
    fqn: str, run: list[Node], users: dict[str, int], params: dict[str, str]
) -> tuple[Node, set[str]] | None:
    """The linear node for one call (``run`` starts at the weight's transpose), and the names of
    the nodes it replaces; None where the call is anything else."""
    if len(run) < 2:
        return None
    t, mm = run[0], run[1]
    weight, bias = f"{fqn}.weight", f"{fqn}.bias"
    if (
        t.op not in _TRANSPOSES
        or len(t.inputs) != 1
        or params.get(t.inputs[0]) != weight
        or (t.op == "aten.transpose.int" and sorted(t.args[1:3]) not in ([-2, -1], [0, 1]))
        or mm.op != "aten.matmul.default"
        or len(mm.inputs) != 2
        or mm.inputs[1] != t.name
        or users.get(t.name) != 1
    ):
        return None
    last, args = mm, (mm.args[0], Ref(t.inputs[0]))
    add = run[2] if len(run) > 2 else None
    if (
        add is not None
        and add.op == "aten.add.Tensor"
        and not add.kwargs
        and len(add.inputs) == 2
        and add.inputs[0] == mm.name
        and params.get(add.inputs[1]) == bias
        and users.get(mm.name) == 1
    ):
        last, args = add, (*args, Ref(add.inputs[1]))
    parts = [t, mm] if last is mm else [t, mm, add]
    linear = replace(
        last,
        op="aten.linear.default",
        args=args,
        kwargs=(),
        module_type=LINEAR,
        fwd_flops=sum(n.fwd_flops for n in parts),
        bwd_flops=sum(n.bwd_flops for n in parts),
        params=tuple(dict.fromkeys(p for n in parts for p in n.params)),
        source=mm.source,
        saved_bytes=sum(n.saved_bytes for n in parts),
        saved_bytes_autocast=None
        if last.saved_bytes_autocast is None
        else sum(n.saved(autocast=True) for n in parts),
    )
    return linear, {n.name for n in parts if n is not last}


def linear_types(modules: dict[str, ModuleInfo], nodes: list[Node]) -> dict[str, ModuleInfo]:
    """``modules`` with every module whose call :func:`as_linears` folded recorded as
    :data:`LINEAR`."""
    fqns = {
        n.module_fqn for n in nodes if n.op == "aten.linear.default" and n.module_type == LINEAR
    }
    return {
        fqn: replace(info, type=LINEAR) if fqn in fqns and info.type != LINEAR else info
        for fqn, info in modules.items()
    }
