"""The graph IR as JSON and back (ir.serial): what a plan cache stores, no pickle."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from _plans import ROOT
from autopar.ir import serial
from autopar.ir.graph import Graph, Ref
from autopar.ir.trace import trace

from autopar.model_file import build_on_meta, load_model_file

MODELS = ROOT / "tests" / "models"


def _traced(spec: str, seq: int = 16) -> Graph:
    mf = load_model_file(spec)
    model = build_on_meta(mf)
    idx = torch.zeros(2, seq, dtype=torch.long, device="meta")
    return trace(model, (idx,))


def _same(a: Graph, b: Graph) -> None:
    assert a == b
    for name in ("local_literals", "dtensor_blocks", "fused_linears"):
        assert getattr(a, name) == getattr(b, name), name
    assert [n.inputs for n in a.nodes] == [n.inputs for n in b.nodes]


@pytest.mark.parametrize(
    "spec",
    [
        str(ROOT / "examples" / "gpt.py"),
        # the rest in the slow tier: local literals keyed by int tp; DTensor blocks (a
        # frozenset) and fused linears; MoE blocks
        pytest.param(f"{MODELS / 'heads.py'}:build_llama", marks=pytest.mark.slow),
        pytest.param(f"{MODELS / 'heads.py'}:build_fused", marks=pytest.mark.slow),
        pytest.param(str(MODELS / "moe.py"), marks=pytest.mark.slow),
    ],
)
def test_a_graph_round_trips_through_json_text(spec: str) -> None:
    graph = _traced(spec)
    text = json.dumps(serial.to_json(graph))
    back = serial.from_json(json.loads(text))
    _same(graph, back)
    assert back.node(graph.nodes[-1].name) == graph.nodes[-1]  # the index is rebuilt


def test_non_finite_floats_and_nested_kinds_round_trip() -> None:
    graph = _traced(str(ROOT / "examples" / "gpt.py"))
    node = graph.nodes[-2]
    odd = dataclasses.replace(node, args=(Ref("x"), float("-inf"), [1, (2, 3)], None))
    nodes = (*graph.nodes[:-2], odd, graph.nodes[-1])
    g = Graph(**{**{f: getattr(graph, f) for f in graph.__dataclass_fields__}, "nodes": nodes})
    back = serial.from_json(json.loads(json.dumps(serial.to_json(g))))
    assert back.nodes[-2].args == (Ref("x"), float("-inf"), [1, (2, 3)], None)


@pytest.mark.parametrize(
    "document",
    [
        None,
        {"format": 999, "graph": {}},
        {"format": serial.FORMAT, "graph": {"c": "Path", "a": []}},  # no IR class
        {"format": serial.FORMAT, "graph": {"c": "Ref", "a": ["x", 1]}},  # a field too many
        {"format": serial.FORMAT, "graph": {"c": "Ref", "a": ["x"]}},  # no graph
        {"format": serial.FORMAT, "graph": {"c": "Ref", "v": {"name": "x"}}},  # format 1
        {"format": serial.FORMAT, "graph": {"d": [[[1], 2]]}},  # an unhashable key
        {"format": serial.FORMAT, "graph": {"__reduce__": "os.system"}},
    ],
)
def test_anything_but_an_encoded_graph_is_refused(document) -> None:
    with pytest.raises(serial.SerialError):
        serial.from_json(document)


def test_a_value_outside_the_encoding_cannot_be_written() -> None:
    graph = _traced(str(ROOT / "examples" / "gpt.py"))
    node = graph.nodes[-2]
    odd = dataclasses.replace(node, args=(torch.float32,))
    g = Graph(**{**{f: getattr(graph, f) for f in graph.__dataclass_fields__}, "nodes": (odd,)})
    with pytest.raises(serial.SerialError, match="dtype"):
        serial.to_json(g)
