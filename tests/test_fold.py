"""Tracing each distinct block once (ir/_fold.py): the folded trace must give the Graph the whole
trace gives (node for node, up to names), and the same plan; where folding is not sound the
whole model is traced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from autopar.cost_model import parse_cluster
from autopar.ir._fold import find_folds
from autopar.ir.trace import trace
from autopar.planner.plan import ModelRef, Training
from autopar.planner.search import search
from torch import nn

from autopar.model_file import build_on_meta, example_inputs, load_model_file

ROOT = Path(__file__).resolve().parents[1]


def assert_same_graph(folded, whole) -> None:
    """Equal up to node names: same nodes in the same order, same edges, same layers."""
    assert len(folded.nodes) == len(whole.nodes)
    pos_f = {n.name: i for i, n in enumerate(folded.nodes)}
    pos_w = {n.name: i for i, n in enumerate(whole.nodes)}
    for x, y in zip(folded.nodes, whole.nodes):
        key = lambda n: (n.kind, n.op, n.outputs, n.module_stack, n.module_type, n.layer,  # noqa: E731
                         n.params, n.fwd_flops, n.bwd_flops, n.saved_bytes)  # fmt: skip
        assert key(x) == key(y), (x.name, y.name)
        assert [pos_f[i] for i in x.inputs] == [pos_w[i] for i in y.inputs], (x.name, y.name)
    assert [layer.fqn for layer in folded.layers] == [layer.fqn for layer in whole.layers]
    for a, b in zip(folded.layers, whole.layers):
        assert [pos_f[n] for n in a.nodes] == [pos_w[n] for n in b.nodes]
        assert a == type(a)(**{**b.__dict__, "nodes": a.nodes}), a.fqn
    assert folded.modules == whole.modules
    assert folded.num_params == whole.num_params
    assert (folded.batch_size, folded.seq_len) == (whole.batch_size, whole.seq_len)


def _gpt(monkeypatch, layers: int):
    monkeypatch.setenv("GPT_LAYERS", str(layers))
    mf = load_model_file(str(ROOT / "examples" / "gpt.py"))
    model = build_on_meta(mf)
    args, _ = example_inputs(mf, model, 2, 32)
    return mf, model, tuple(args)


def _folded_names(graph) -> int:
    return sum("__" in n.name for n in graph.nodes)


def test_gpt_folded_equals_whole_and_plans_the_same(monkeypatch):
    mf, model, args = _gpt(monkeypatch, 6)
    assert [f.fqn for f in find_folds(model)] == ["blocks"]
    folded = trace(model, args, dtype=torch.bfloat16)
    whole = trace(model, args, dtype=torch.bfloat16, fold=False)
    assert _folded_names(folded) > 0 and _folded_names(whole) == 0  # the fold really ran
    assert_same_graph(folded, whole)
    cluster = parse_cluster("4x8xH100")
    training = Training(global_batch=64, seq_len=32, dtype="bf16")
    plans = [search(g, cluster, training, model=ModelRef(file=mf.path)) for g in (folded, whole)]
    a, b = (p.model_dump(exclude={"planning_time_s"}) for p in plans)
    assert a == b


@pytest.mark.parametrize("name,key", [("tiny-llama", "num_hidden_layers"),
                                      ("tiny-gpt2", "n_layer"),
                                      ("tiny-bert", "num_hidden_layers")])  # fmt: skip
def test_hf_folded_equals_whole(tmp_path, name, key):
    pytest.importorskip("transformers")
    config = json.loads((ROOT / "examples" / "hf" / f"{name}.json").read_text())
    config[key] = 4
    path = tmp_path / f"{name}-4.json"
    path.write_text(json.dumps(config))
    mf = load_model_file(f"hf:{path}")
    model = build_on_meta(mf)
    args, _ = example_inputs(mf, model, 2, 16)
    assert len(find_folds(model)) == 1
    folded = trace(model, args, seq_len=16)
    whole = trace(model, args, seq_len=16, fold=False)
    assert _folded_names(folded) > 0
    assert_same_graph(folded, whole)


class _Block(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.relu(self.fc(x))


class _KeepsAll(nn.Module):
    """Reads every block's output after the loop: child 0 is read after the run."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        outs = []
        for b in self.blocks:
            x = b(x)
            outs.append(x)
        return self.head(torch.stack(outs).sum(0))


class _Indexed(nn.Module):
    """Indexes blocks by a configured count: two children are not enough to run."""

    def __init__(self):
        super().__init__()
        self.n = 4
        self.blocks = nn.ModuleList(_Block() for _ in range(4))

    def forward(self, x):
        for i in range(self.n):
            x = self.blocks[i](x)
        return x


class _Shared(nn.Module):
    """Blocks share one weight with the head: a parameter reachable under two names."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        self.head = nn.Linear(16, 16)
        self.head.weight = self.blocks[3].fc.weight

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@pytest.mark.parametrize("cls,folds", [(_KeepsAll, 1), (_Indexed, 1), (_Shared, 0)])
def test_unsound_folds_trace_the_whole_model(cls, folds):
    with torch.device("meta"):
        model = cls()
    assert len(find_folds(model)) == folds
    x = torch.empty(2, 16, device="meta")
    got = trace(model, (x,))
    assert _folded_names(got) == 0  # traced whole
    assert_same_graph(got, trace(model, (x,), fold=False))
    assert len([layer for layer in got.layers if layer.fqn.startswith("blocks.")]) == 4
