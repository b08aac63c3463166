"""The graph IR as JSON, and back: what a plan cache stores (no pickle, no code).

:func:`to_json` writes a :class:`~autopar.ir.graph.Graph` as plain JSON values; :func:`from_json`
rebuilds an equal graph. Only the IR's own dataclasses (those defined in :mod:`ir.graph`) are
rebuilt, by name, from their declared fields: a document that names anything else, or holds a
field a class does not declare, is refused with :class:`SerialError`, so reading a cache entry
never runs code and never builds an object the IR would not hold. The IR holds no torch objects
(``Node.args`` keep node references as :class:`~autopar.ir.graph.Ref` and lists as tuples); a
value outside the JSON kinds below cannot be written (:class:`SerialError`), and such a graph is
simply not cached.

Encoding: str, bool, int, None as themselves; a float as itself, non-finite ones as
``{"f": "inf"}``; a tuple ``{"t": [...]}``, a list ``[...]``, a frozenset ``{"s": [...]}``, a
dict ``{"d": [[key, value], ...]}`` (keys of any kind: ints in ``local_literals``), an IR
dataclass ``{"c": name, "v": {field: value}}``. Fields whose names start with ``_`` (indexes the
class rebuilds itself) are left out.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from autopar.ir import graph as _graph

__all__ = ["SerialError", "to_json", "from_json"]

FORMAT = 1
"""bumped when the encoding changes (a cache keys on it)."""

_CLASSES = {
    name: cls
    for name, cls in vars(_graph).items()
    if isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__module__ == _graph.__name__
}
_FIELDS = {
    name: {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}
    for name, cls in _CLASSES.items()
}


class SerialError(ValueError):
    """A value the encoding does not hold, or a document that is no encoded IR."""


def to_json(graph: _graph.Graph) -> dict:
    """``graph`` as JSON values (a dict that :func:`json.dumps` writes as is)."""
    return {"format": FORMAT, "graph": _encode(graph)}


def from_json(document: Any) -> _graph.Graph:
    """The graph :func:`to_json` wrote; raises SerialError for anything else."""
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise SerialError(f"not an IR document of format {FORMAT}")
    try:
        out = _decode(document.get("graph"))
    except (TypeError, ValueError, KeyError) as e:  # an unhashable key, a field of a wrong kind
        raise SerialError(f"not an IR document ({type(e).__name__}: {e})") from None
    if not isinstance(out, _graph.Graph):
        raise SerialError("the document holds no graph")
    return out


def _encode(value: Any) -> Any:
    if value is None or isinstance(value, str | bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"f": repr(value)}
    if isinstance(value, tuple):
        return {"t": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, frozenset):
        return {"s": [_encode(v) for v in sorted(value, key=repr)]}
    if isinstance(value, dict):
        return {"d": [[_encode(k), _encode(v)] for k, v in value.items()]}
    name = type(value).__name__
    if dataclasses.is_dataclass(value) and _CLASSES.get(name) is type(value):
        fields = {f: _encode(getattr(value, f)) for f in _FIELDS[name]}
        return {"c": name, "v": fields}
    raise SerialError(f"a {type(value).__qualname__} value has no JSON form in the IR encoding")


def _decode(value: Any) -> Any:
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict) or len(value) not in (1, 2):
        raise SerialError(f"unexpected value {str(value)[:60]!r}")
    if "t" in value and len(value) == 1:
        return tuple(_decode(v) for v in _items(value["t"]))
    if "s" in value and len(value) == 1:
        return frozenset(_decode(v) for v in _items(value["s"]))
    if "d" in value and len(value) == 1:
        pairs = [_pair(p) for p in _items(value["d"])]
        return {_decode(k): _decode(v) for k, v in pairs}
    if "f" in value and len(value) == 1 and value["f"] in ("inf", "-inf", "nan"):
        return float(value["f"])
    if set(value) == {"c", "v"} and value["c"] in _CLASSES and isinstance(value["v"], dict):
        name, fields = value["c"], value["v"]
        if set(fields) != _FIELDS[name]:
            raise SerialError(f"{name} with fields {sorted(fields)}, not {sorted(_FIELDS[name])}")
        return _CLASSES[name](**{k: _decode(v) for k, v in fields.items()})
    raise SerialError(f"unexpected value {str(value)[:60]!r}")


def _items(value: Any) -> list:
    if not isinstance(value, list):
        raise SerialError(f"expected a list, got {type(value).__name__}")
    return value


def _pair(value: Any) -> tuple[Any, Any]:
    if not isinstance(value, list) or len(value) != 2:
        raise SerialError("a dict entry is no [key, value] pair")
    return value[0], value[1]
