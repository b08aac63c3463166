"""HF Falcon under tensor parallelism (issue 28, item 6): Megatron's split of its attention.

Falcon's ``FalconLinear`` multiplies by its weight itself (``input @ self.weight.T``, the bias
added apart); the trace records it as the linear it is (``ir._linear_like``), so its
projections are styled like any ``nn.Linear``. Its fused ``query_key_value`` packs the query
heads and the kv heads in one weight:

- multi-query (one kv head, ``multi_query=True``) and the new architecture with one kv head:
  the query rows split over tp, the kv heads whole on every rank (``colwise_fused_heads``),
  ``dense`` rowwise, the attention's head count divided by tp;
- the new architecture with kv heads tp divides, and multi-head (per-head q, k, v rows): plain
  Megatron pairs (``colwise`` / ``rowwise``);
- the new architecture with several kv heads fewer than tp: refused with one line.

The runs (``--verify`` against one process, shards read back per rank) are the slow tier.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from autopar.planner.search import PlanningError

from autopar.api import plan_model_file
from autopar.model_file import load_model_file

pytest.importorskip("transformers", reason="hf: models need the optional extra 'hf'")

TINY = {
    "model_type": "falcon", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "tie_word_embeddings": False, "alibi": False, "bias": False,
}  # fmt: skip
CONFIGS = {
    # Falcon-7B's layout: one kv head, the parallel attention/MLP block (in-place residual add)
    "multi_query": {
        **TINY, "multi_query": True, "new_decoder_architecture": False, "parallel_attn": True,
    },
    # Falcon-40B's layout with one kv group: the kv heads after each group's query heads
    "new_one_kv": {**TINY, "new_decoder_architecture": True, "num_kv_heads": 1},
    "new_two_kv": {**TINY, "new_decoder_architecture": True, "num_kv_heads": 2},
    # per-head interleaved q, k, v rows, with biases
    "multi_head": {
        **TINY, "multi_query": False, "new_decoder_architecture": False, "parallel_attn": False,
        "bias": True,
    },
}  # fmt: skip
STYLES = {
    "multi_query": "colwise_fused_heads",
    "new_one_kv": "colwise_fused_heads",
    "new_two_kv": "colwise",
    "multi_head": "colwise",
}
ATTN = "transformer.h.{i}.self_attention."


def _spec(name: str, tmp_path: Path) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(CONFIGS[name]))
    return f"hf:{path}"


def _plan(spec: str, mesh: str, cluster: str = "cpu:2"):
    return plan_model_file(
        load_model_file(spec), cluster, global_batch=4, seq_len=16, mesh=mesh, optimizer="sgd"
    )


def test_multi_query_falcon_gets_megatron_attention_at_tp2(tmp_path: Path) -> None:
    """The fused query_key_value runs its query heads split and its one kv head whole, dense
    rowwise, and the block's head count is the local one; the MLP's FalconLinears pair too."""
    plan = _plan(_spec("multi_query", tmp_path), "tp=2")
    styles = plan.tensor_parallel
    for i in range(2):
        attn = ATTN.format(i=i)
        assert styles[attn + "query_key_value"] == "colwise_fused_heads", styles
        assert styles[attn + "dense"] == "rowwise", styles
        assert plan.module_attrs[attn.rstrip(".")] == {"num_heads": 2}, plan.module_attrs
        mlp = f"transformer.h.{i}.mlp."
        assert styles[mlp + "dense_h_to_4h"] == "colwise", styles
        assert styles[mlp + "dense_4h_to_h"] == "rowwise", styles


def test_several_kv_heads_fewer_than_tp_are_refused_in_one_line(tmp_path: Path) -> None:
    """2 kv heads at tp=4: a rank's query heads would read both kv groups, which no split of
    the fused weight gives; the attention would run whole, so the pinned tp is refused."""
    with pytest.raises(PlanningError) as info:
        _plan(_spec("new_two_kv", tmp_path), "tp=4", "cpu:4")
    text = str(info.value)
    assert "\n" not in text and "tp=4 cannot split the attention" in text, text
    assert "4 query heads and 2 kv heads" in text and "[1, 2]" in text, text


def test_a_linear_subclass_with_its_own_forward_stays_as_traced() -> None:
    """Only ``x @ w.T (+ b)`` is folded into a linear: a subclass that scales its output is
    not a linear, and the planner leaves it whole."""
    import torch
    from autopar.ir import trace
    from torch import nn

    class Scaled(nn.Linear):
        def forward(self, x):
            return (x @ self.weight.T + self.bias) * 2.0

    class Plain(nn.Linear):
        def forward(self, x):
            return x @ self.weight.T + self.bias

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = Plain(8, 16), Scaled(16, 8)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    with torch.device("meta"):
        net = Net()
    graph = trace(net, (torch.empty(2, 4, 8, device="meta"),), fold=False)
    assert graph.modules["a"].type == "torch.nn.modules.linear.Linear"
    assert graph.modules["b"].type.endswith("Scaled")
    calls = {n.module_fqn: n.op for n in graph.nodes if n.module_fqn in ("a", "b")}
    assert calls["a"] == "aten.linear.default" and calls["b"] != "aten.linear.default", calls
    flops = sum(n.fwd_flops for n in graph.nodes if n.module_fqn == "a")
    assert flops >= 2 * 2 * 4 * 8 * 16, flops  # the folded matmul's FLOPs are kept


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("name", list(CONFIGS))
def test_falcon_attention_shards_and_verifies_at_tp2(name: str, tmp_path: Path) -> None:
    """The emitted program with --verify (2 SGD steps against one process, loss and parameters
    within 1e-5), then every rank's shards: query_key_value Shard(0) with half its rows, dense
    Shard(1) with half its columns."""
    from test_families import _verified_params

    plan = _plan(_spec(name, tmp_path), "tp=2")
    params = _verified_params(plan, tmp_path)
    for i in range(2):
        attn = ATTN.format(i=i)
        assert plan.tensor_parallel[attn + "query_key_value"] == STYLES[name], plan.tensor_parallel
        for proj, dim in (("query_key_value", 0), ("dense", 1)):
            row = params[f"{attn}{proj}.weight"]
            assert row is not None and row["placements"] == [["Shard", dim]], (proj, row)
            assert row["local"][dim] * 2 == row["global"][dim], (proj, row)


@pytest.mark.slow
@pytest.mark.dist
def test_multi_query_falcon_verifies_under_tp2_fsdp2(tmp_path: Path) -> None:
    """FSDP2 shards the fused weight's TP shard again: the gathered output and its partial
    gradient compose with it (--verify against one process, 4 ranks)."""
    from _plans import run_bounded
    from test_codegen_dist import TIMEOUT_S, VERIFY_OK

    plan = _plan(_spec("multi_query", tmp_path), "tp=2,fsdp=2", "cpu:4")
    assert plan.tensor_parallel[ATTN.format(i=0) + "query_key_value"] == "colwise_fused_heads"
    out = plan.emit(tmp_path / "out")
    rc, text = run_bounded(
        ["bash", "launch.sh", "--steps", "2", "--optimizer", "sgd", "--verify"],
        out,
        2 * TIMEOUT_S,
        DIST_TIMEOUT_S="200",
    )
    assert rc == 0, text[-4000:]
    m = VERIFY_OK.search(text)
    assert m and float(m.group(1)) <= 1e-5 and float(m.group(2)) <= 1e-5, text[-3000:]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("mesh", ["dp=2", "fsdp=2", "pp=2"])
def test_multi_query_falcon_verifies_without_tp(mesh: str, tmp_path: Path) -> None:
    """Issue 28's meshes beside tp: the same Falcon (FalconLinear, the fused one-kv-head
    projection, the in-place residual add) under data parallelism, FSDP2 and a pipeline of two
    stages trains like one process (--verify, 2 SGD steps, 2 ranks)."""
    from _plans import run_bounded
    from test_codegen_dist import TIMEOUT_S, VERIFY_OK

    plan = _plan(_spec("multi_query", tmp_path), mesh)
    assert plan.mesh.short() == mesh
    out = plan.emit(tmp_path / "out")
    rc, text = run_bounded(
        ["bash", "launch.sh", "--steps", "2", "--optimizer", "sgd", "--verify"], out, TIMEOUT_S
    )
    assert rc == 0, text[-4000:]
    m = VERIFY_OK.search(text)
    assert m and float(m.group(1)) <= 1e-5 and float(m.group(2)) <= 1e-5, text[-3000:]
