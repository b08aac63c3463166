"""Where a model can be cut into pipeline stages, decided once from the traced graph
(autopar._cuts.cuts): the boundaries the emitted script can cut, and the refused ones named with
why, before the one search."""

from __future__ import annotations

import torch
from autopar.ir import trace
from autopar.planner import search as search_module
from torch import nn

from autopar._cuts import cuts
from autopar.api import plan_model_file
from autopar.model_file import load_model_file

DIM, VOCAB, SEQ = 16, 32, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, kind: str = "plain") -> torch.Tensor:
        y = torch.tanh(self.fc(x))
        return x + (y if kind == "plain" else -y)


class Net(nn.Module):
    """embed, 8 identical blocks (a ModuleList the trace folds), head. ``tied``: the head shares
    the embedding's weight; ``by_count``: the forward indexes the blocks by a configured count
    (traced whole); ``kinds``: blocks 0 and 1 get a string; ``twice``: block 0 runs again after
    block 1; ``root_weight``: the root reads the embedding's weight for the logits."""

    def __init__(self, **kw) -> None:
        super().__init__()
        self.kw = kw
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(8))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if kw.get("tied"):
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        blocks = [self.blocks[i] for i in range(8)] if self.kw.get("by_count") else self.blocks
        for i, block in enumerate(blocks):
            h = block(h, "odd") if self.kw.get("kinds") and i < 2 else block(h)
            if self.kw.get("twice") and i == 1:
                h = self.blocks[0](h)
        if self.kw.get("root_weight"):
            return h @ self.embed.weight.t()
        return self.head(h)


LAYERS = ["embed", *(f"blocks.{i}" for i in range(8)), "head"]


def _cuts(**kw):
    with torch.device("meta"):
        model = Net(**kw)
    graph = trace(model, (torch.zeros(2, SEQ, dtype=torch.long, device="meta"),))
    return graph, cuts(graph)


def test_a_plain_model_cuts_at_every_block_boundary() -> None:
    for kw in ({}, {"by_count": True}):
        graph, c = _cuts(**kw)
        assert [layer.fqn for layer in graph.layers][: len(LAYERS)] == LAYERS[: len(graph.layers)]
        assert c.allowed == frozenset(range(1, len(graph.layers))) and not c.why, (kw, c)
        assert c.refused is None


def test_a_tied_weight_keeps_its_layers_in_one_stage() -> None:
    graph, c = _cuts(tied=True)
    layers = [layer.fqn for layer in graph.layers]
    assert c.allowed == frozenset() and c.refused is None  # embed .. head: every boundary
    assert len(c.why) == len(layers) - 1
    assert all("head.weight is tied to embed.weight" in why for _, why in c.why), c.why


def test_a_weight_read_at_the_root_keeps_its_readers_in_one_stage() -> None:
    graph, c = _cuts(root_weight=True)
    assert c.allowed == frozenset() and c.why, c
    assert "embed.weight is read by layers embed and" in c.why[0][1], c.why


def test_a_layer_called_again_later_cannot_be_cut_from_what_runs_between() -> None:
    graph, c = _cuts(twice=True)
    assert 2 not in c.allowed and {1, 3, 4} <= c.allowed, c
    assert dict(c.why)[2].startswith("the forward runs blocks.0 after blocks.1"), c.why


def test_a_string_called_layer_with_parameters_refuses_every_cut() -> None:
    graph, c = _cuts(kinds=True)
    assert c.allowed == frozenset() and c.refused is not None
    assert c.refused.startswith("layer blocks.0 is called with a str 'odd' argument and holds")
    assert graph.calls is not None and graph.calls.odd_args == {
        "blocks.0": "str 'odd'",
        "blocks.1": "str 'odd'",
    }


class Box:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class Boxed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> Box:
        return Box(self.fc(x))


class BoxNet(nn.Module):
    """A layer hands the next one an object (no tensor): no stage can pass it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.box, self.head = nn.Embedding(VOCAB, DIM), Boxed(), nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.box(self.embed(tokens)).t)


def test_a_layer_that_returns_an_object_refuses_every_cut() -> None:
    with torch.device("meta"):
        model = BoxNet()
    c = cuts(trace(model, (torch.zeros(2, SEQ, dtype=torch.long, device="meta"),)))
    assert c.allowed == frozenset() and c.refused is not None
    assert c.refused.startswith("cannot export BoxNet to cut it into pipeline stages"), c.refused


def test_a_pipeline_plan_searches_once(monkeypatch) -> None:
    """The cut is decided before the search: a pinned pipeline plans with one search."""
    calls = []
    real = search_module.search

    def counted(*args, **kwargs):
        calls.append(kwargs.get("cuts"))
        return real(*args, **kwargs)

    monkeypatch.setattr("autopar.api.search", counted)
    mf = load_model_file(str(__import__("_plans").ROOT / "examples" / "gpt.py"))
    plan = plan_model_file(mf, "cpu:2", global_batch=4, seq_len=SEQ, mesh="pp=2")
    assert plan.mesh.pp == 2 and len(calls) == 1
    assert calls[0] is not None and calls[0].allowed == frozenset(range(1, len(plan.layers)))
