"""Find the embedding tables a forward indexes by token position.

A learned absolute position embedding (examples/gpt.py's ``pos_emb``, nanoGPT's and GPT-2's
``wpe``, OPT's ``embed_positions``) is looked up with indices the forward computes itself:
``arange(T)``, ``arange(T) + past``, ``cumsum(ones(b, T)) - 1 + 2``. A sequence longer than the
table reads past its last row. On meta tensors nothing fails (a meta lookup has no values to
check), so the planner must see it: every ``aten.embedding`` whose indices derive from
constants alone (no input, parameter or buffer upstream) is evaluated here, for real, on CPU at
the traced shapes; indices that step by one along a last dim of the traced sequence length are
positions, and the table is a :class:`PositionTable` (``first`` = the row token 0 reads).

Indices read from an input (token ids) or a buffer (BERT's ``position_ids`` buffer, whose values
a meta model does not hold) are not positions found here; an HF config states the limit of those
itself (``autopar.hf.position_tables``). Indices too large to compute cheaply (more than
``MAX_ELEMENTS`` elements in a node on the way) or made by an op that does not run on CPU are
skipped: the check never fails a trace, it only finds what it can prove.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from autopar.ir.graph import Node, PositionTable, Ref

EMBEDDING = "aten.embedding.default"
MAX_ELEMENTS = 1 << 22
"""the most elements of any one value computed on the way to an index (32 MiB of int64)."""


def find_positions(nodes: Sequence[Node], seq_len: int | None) -> tuple[PositionTable, ...]:
    """The position tables among the embedding lookups of ``nodes`` (topologically ordered, as
    traced at sequence length ``seq_len``; None, or a length below 2, finds none)."""
    if seq_len is None or seq_len < 2:
        return ()
    by_name = {n.name: n for n in nodes}
    order = {n.name: i for i, n in enumerate(nodes)}
    values: dict[str, Any] = {}
    tables = []
    for n in nodes:
        if n.op != EMBEDDING or len(n.args) < 2 or not isinstance(n.args[1], Ref):
            continue
        with torch.device("cpu"):  # factory ops without a device: on CPU, not the caller's meta
            index = _evaluate(n.args[1].name, by_name, order, values)
        first = _first_position(index, seq_len)
        weight = by_name[n.args[0].name].out if isinstance(n.args[0], Ref) else None
        if first is not None and weight is not None:
            tables.append(PositionTable(fqn=n.module_fqn, rows=weight.shape[0], first=first))
    return tuple(tables)


def _first_position(index: Any, seq_len: int) -> int | None:
    """``p`` where ``index`` holds ``p, p + 1, ..., p + seq_len - 1`` along its last dim in
    every row (positions of one sequence, broadcast or repeated over the batch), else None."""
    if not isinstance(index, torch.Tensor) or index.dim() == 0 or index.shape[-1] != seq_len:
        return None
    if index.device.type != "cpu" or index.is_floating_point() or index.is_complex():
        return None
    if index.dtype == torch.bool:
        return None
    rows = index.reshape(-1, seq_len)
    if not bool((rows.diff(dim=-1) == 1).all()) or not bool((rows[:, 0] == rows[0, 0]).all()):
        return None
    return int(rows[0, 0])


def _evaluate(
    name: str, by_name: dict[str, Node], order: dict[str, int], values: dict[str, Any]
) -> Any:
    """The value of node ``name`` computed on CPU, or None where it cannot be (it reads an
    input, parameter or buffer, an op that does not run here, or too many elements); ``order``
    is every node's place in the graph. ``values`` memoizes every node computed (None included)."""
    todo: set[str] = set()
    stack = [name]
    while stack:  # the node's ancestors not yet computed, then evaluated in graph order
        current = stack.pop()
        if current not in todo and current not in values:
            todo.add(current)
            stack.extend(by_name[current].inputs)
    for current in sorted(todo, key=order.__getitem__):
        values[current] = _run(by_name[current], values)
    return values[name]


def _run(node: Node, values: dict[str, Any]) -> Any:
    if node.kind != "compute" or any(values.get(i) is None for i in node.inputs):
        return None
    if any(o is not None and o.numel > MAX_ELEMENTS for o in node.outputs):
        return None
    fn = _op(node.op)
    if fn is None:
        return None
    args = _literal(node.args, values)
    kwargs = {k: _literal(v, values) for k, v in node.kwargs}
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, TypeError, ValueError, IndexError, NotImplementedError):
        return None  # not computable here (e.g. an op without a CPU kernel): not checked


def _op(name: str) -> Any:
    """The callable of an IR op name: ``aten.arange.default`` -> ``torch.ops.aten.arange.default``,
    ``getitem`` -> ``operator.getitem``; None for any other op."""
    if name == "getitem":
        return operator.getitem
    parts = name.split(".")
    if len(parts) != 3 or parts[0] != "aten":
        return None
    packet = getattr(torch.ops.aten, parts[1], None)
    return getattr(packet, parts[2], None) if packet is not None else None


def _literal(value: Any, values: dict[str, Any]) -> Any:
    """An IR argument back as torch takes it: Refs as their computed values, devices as CPU,
    dtype, layout and memory-format names as torch objects (the IR keeps them as strings)."""
    if isinstance(value, Ref):
        return values[value.name]
    if isinstance(value, tuple):
        return tuple(_literal(v, values) for v in value)
    if isinstance(value, dict):
        return {k: _literal(v, values) for k, v in value.items()}
    if isinstance(value, str):
        if value in ("meta", "cpu") or value.startswith("cuda"):
            return torch.device("cpu")
        named = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(named, torch.dtype | torch.layout | torch.memory_format):
            return named
    return value
