"""Grouped-query attention with several kv heads fewer than tp (issue 28, item 6): Megatron's
split, the query heads over tp and each rank computing the kv head its query heads read.

8 query heads, 2 kv heads at tp=4 (``tests/models/gqa.py``, written for these tests): ranks 0
and 1 read kv head 0, ranks 2 and 3 kv head 1. The kv projections keep their weight ``Shard(0)``
and are all-gathered, each rank keeping its kv head (``colwise_kv_heads2``); the block's counts
are the rank's (``n_kv_heads`` 1, ``n_rep`` its query heads). A rep-major layout (query head j
reading kv head j mod 2) has no such split: a pinned tp=4 is refused in one line.

The default tier plans on meta and checks the runtime style's columns in process; the runs
(``--verify`` on 4 ranks, the shards per rank, HF Llama) are the slow tier.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from _plans import run_bounded
from autopar.codegen.apply import runtime
from autopar.ir.trace import trace
from autopar.planner.search import PlanningError
from test_codegen_dist import TIMEOUT_S, VERIFY_OK

from autopar.api import plan_model_file
from autopar.model_file import load_model_file

FIXTURE = Path(__file__).resolve().parent / "models" / "gqa.py"
sys.path.insert(0, str(FIXTURE.parent))
import gqa as models  # noqa: E402

KINDS = ("repeat_kv", "interleave", "sdpa_gqa")
STYLES = {"wq": "colwise", "wk": "colwise_kv_heads2", "wv": "colwise_kv_heads2", "wo": "rowwise"}
ATTRS = {"n_heads": 2, "n_kv_heads": 1, "n_rep": 2}
LLAMA = {
    "model_type": "llama", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
    "tie_word_embeddings": False, "intermediate_size": 128, "num_attention_heads": 8,
    "num_key_value_heads": 2,
}  # fmt: skip


def _plan(spec: str, mesh: str | None = "tp=4", cluster: str = "cpu:4"):
    return plan_model_file(
        load_model_file(spec), cluster, global_batch=8, seq_len=16, mesh=mesh, optimizer="sgd"
    )


def test_kv_projections_are_proven_grouped_where_tp_is_a_multiple_of_the_kv_heads():
    """The block runs at tp=4 and 8 with its kv linears computing one head and its counts the
    rank's; repeat_kv's expand and merge get the rank's sizes (one kv head, 2 copies, 2 query
    heads); at tp=2 the kv heads split as plain Megatron pairs."""
    with torch.device("meta"):
        model = models.GPT("repeat_kv", layers=1)
    graph = trace(model.train(), (torch.zeros(2, 16, dtype=torch.long, device="meta"),))
    assert graph.grouped_kv == {f"blocks.0.attn.w{x}": {4: 2, 8: 2} for x in "kv"}
    assert graph.gqa_blocks == {"blocks.0.attn": (8, 2, "blocks.0.attn.wo")}
    sizes = {n.args[1]: graph.local_literals.get(n.name) for n in graph.nodes
             if n.module_fqn == "blocks.0.attn" and n.op == "aten.expand.default"}  # fmt: skip
    assert sizes == {
        (2, 16, 2, 4, 8): {2: (2, 16, 1, 4, 8), 4: (2, 16, 1, 2, 8), 8: (2, 16, 1, 1, 8)}
    }


@pytest.mark.parametrize("kind", KINDS)
def test_pinned_tp4_splits_query_heads_and_keeps_each_ranks_kv_head(kind: str) -> None:
    """repeat_kv (expand + reshape), repeat_interleave and SDPA's enable_gqa: q colwise, o
    rowwise, k/v colwise_kv_heads2 (weights sharded, none whole), the counts the rank's."""
    plan = _plan(f"{FIXTURE}:build_{kind}")
    for i in range(2):
        p = f"blocks.{i}.attn."
        assert {n: plan.tensor_parallel.get(p + n) for n in STYLES} == STYLES, plan.tensor_parallel
    assert plan.module_attrs == {f"blocks.{i}.attn": ATTRS for i in range(2)}


def test_a_rep_major_layout_is_refused_at_a_pinned_tp_and_free_plans_stay_as_they_were():
    """Query head j reading kv head j mod 2: rank 0's heads 0, 1 read both kv heads, so no rank
    computes one kv head of its own; its attention would run whole at tp=4: refused in one
    line naming the block and its heads. A free plan (no pin) plans as before, as does tp=2
    (which divides the kv heads: there the rule does not reach; its heads stay gathered)."""
    with pytest.raises(PlanningError) as info:
        _plan(f"{FIXTURE}:build_rep_major")
    text = str(info.value)
    assert "\n" not in text and text.startswith("--mesh tp=4: the attention of blocks.0.attn")
    assert "8 query heads, 2 kv heads" in text and "[1, 2]" in text, text
    plan = _plan(f"{FIXTURE}:build_rep_major", "tp=2", "cpu:2")
    assert plan.tensor_parallel["blocks.0.attn.wk"] == "colwise_gather"
    assert _plan(f"{FIXTURE}:build_rep_major", None).mesh.tp in (1, 2, 4)


def test_h100_costs_split_grouped_attention_only_where_it_pays(monkeypatch) -> None:
    """Free choice (no pin) at GPT scale on H100 costs, traced in bf16 (16 query heads, 2 kv
    heads, tp=4): at half the traced batch q, k and v stay whole (they read one input and are
    column-parallel all or none: one collective serves them); at 16 times the traced batch the
    query heads split, each rank computes its kv head and the output pairs (with sequence
    parallelism). Without the all-or-none rule the half batch would take q alone gathered, which
    the program runs with the whole all-reduce the cost model charged a third of."""
    from autopar.cost_model import parse_cluster
    from autopar.planner import ilp

    with torch.device("meta"):
        model = models.GPT("repeat_kv", layers=1, dim=2048, heads=16)
    idx = torch.zeros(2, 1024, dtype=torch.long, device="meta")
    graph = trace(model.train(), (idx,), dtype=torch.bfloat16)
    assert graph.grouped_kv["blocks.0.attn.wk"] == {4: 2, 8: 2, 16: 2}
    c = parse_cluster("8xH100")
    picked = {}
    for scale in (0.5, 16.0):
        k = ilp.CostInputs(tp=4, batch_scale=scale, device=c.device, dtype="bf16",
                           tp_link=c.intra_node, grad_sync_s_per_byte=1e-11)  # fmt: skip
        styles = ilp.solve(graph, k).styles
        picked[scale] = [styles.get(f"blocks.0.attn.{n}") for n in ("wq", "wk", "wv", "wo")]
    assert picked[0.5][:3] == [None, None, None], picked
    monkeypatch.setattr(ilp, "_add_sibling_constraint", lambda *a: None)
    k = ilp.CostInputs(tp=4, batch_scale=0.5, device=c.device, dtype="bf16",
                       tp_link=c.intra_node, grad_sync_s_per_byte=1e-11)  # fmt: skip
    loose = ilp.solve(graph, k).styles
    assert [loose.get(f"blocks.0.attn.{n}") for n in ("wq", "wk", "wv")] == [
        "colwise_gather", None, None,
    ], loose  # fmt: skip
    assert picked[16.0][:3] == ["colwise", "colwise_kv_heads", "colwise_kv_heads"], picked
    assert picked[16.0][3].startswith("rowwise"), picked


class _Mesh:
    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.n = rank, size

    def get_local_rank(self) -> int:
        return self.rank

    def size(self) -> int:
        return self.n


class _Gathered:
    """What the style's redistribute returns: the whole output on every rank."""

    def __init__(self, full: torch.Tensor) -> None:
        self.full = full

    def redistribute(self, placements, async_op):
        return self

    def to_local(self, grad_placements):
        return self.full


def test_each_rank_keeps_the_kv_head_its_query_heads_read() -> None:
    """The runtime style on an all-gathered (2 heads x 8) output: ranks 0, 1 keep head 0's
    columns, ranks 2, 3 head 1's; one kv head (colwise_gather_heads) is kept whole."""
    full = torch.arange(16.0).expand(3, 16)
    style = runtime().TP_STYLES["colwise_kv_heads2"]
    kept = [
        style._prepare_output_fn(None, True, None, _Gathered(full), _Mesh(r, 4))[0].tolist()
        for r in range(4)
    ]
    assert kept == [list(range(8))] * 2 + [list(range(8, 16))] * 2
    one = runtime().TP_STYLES["colwise_gather_heads"]
    assert one._prepare_output_fn(None, True, None, _Gathered(full), _Mesh(3, 4)) is full


# -- the runs (slow) ---------------------------------------------------------------------------

# The plan applied in one plain process on a fake 4-rank process group at a given rank: each
# attention weight's placements and local shape, and the block's counts as the program sets them.
SHOW_SHARDS = """
import json, sys
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from autopar import Plan
from autopar.model_file import load_model_file

dist.init_process_group("fake", store=FakeStore(), rank=int(sys.argv[3]), world_size=4)
plan = Plan.load(sys.argv[1])
model = plan.apply(load_model_file(sys.argv[2]).build())
rows = {}
for fqn, style in plan.tensor_parallel.items():
    w = model.get_submodule(fqn).weight
    rows[fqn] = [[type(p).__name__, getattr(p, "dim", None)] for p in w.placements], list(
        w.to_local().shape)
attrs = {f: {k: getattr(model.get_submodule(f), k) for k in a} for f, a in plan.module_attrs.items()}
print("SHARDS " + json.dumps({"weights": rows, "attrs": attrs}), flush=True)
dist.destroy_process_group()
"""


def _verify(plan, tmp_path: Path) -> Path:
    out = plan.emit(tmp_path / "out")
    args = ["--steps", "2", "--optimizer", "sgd", "--lr", "0.5", "--verify"]
    rc, text = run_bounded(["bash", "launch.sh", *args], out, 2 * TIMEOUT_S, DIST_TIMEOUT_S="200")
    assert rc == 0, text[-4000:]
    m = VERIFY_OK.search(text)
    assert m and float(m.group(1)) <= 1e-5 and float(m.group(2)) <= 1e-5, text[-3000:]
    return out


def _shards(out: Path, spec: str, rank: int, tmp_path: Path) -> dict:
    script = tmp_path / "show_shards.py"
    script.write_text(SHOW_SHARDS)
    cmd = [sys.executable, str(script), str(out / "plan.json"), spec, str(rank)]
    rc, text = run_bounded(cmd, tmp_path, TIMEOUT_S)
    assert rc == 0, text[-4000:]
    return json.loads(next(x for x in text.splitlines() if x.startswith("SHARDS "))[7:])


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("kind", KINDS)
def test_grouped_kv_verifies_at_tp4_with_every_projection_sharded(kind: str, tmp_path: Path):
    """The emitted program on 4 ranks with --verify (2 SGD steps at lr 0.5 against one process;
    keeping the other kv head on each rank instead fails with ``verify: FAILED
    blocks.0.attn.wv.weight diff=1.395e-02``), then ranks 0 and 3: wq a quarter of its rows,
    wk/wv a quarter of theirs (the output gathered), wo a quarter of its columns, the counts
    the rank's."""
    spec = f"{FIXTURE}:build_{kind}"
    out = _verify(_plan(spec), tmp_path)
    for rank in (0, 3):
        shown = _shards(out, spec, rank, tmp_path)
        assert shown["attrs"] == {f"blocks.{i}.attn": ATTRS for i in range(2)}
        for i in range(2):
            for name, dim, shape in (("wq", 0, [16, 64]), ("wk", 0, [4, 64]),
                                     ("wv", 0, [4, 64]), ("wo", 1, [64, 16])):  # fmt: skip
                placements, local = shown["weights"][f"blocks.{i}.attn.{name}"]
                assert placements == [["Shard", dim]] and local == shape, (name, placements, local)


@pytest.mark.slow
@pytest.mark.dist
def test_hf_llama_two_kv_heads_verifies_at_tp4(tmp_path: Path) -> None:
    """HF Llama (8 query heads, num_key_value_heads=2, SDPA with enable_gqa, rotary on each
    rank's kv head): q_proj colwise, k/v_proj colwise_kv_heads2, o_proj rowwise,
    num_key_value_groups the rank's 2; --verify passes and every rank holds its quarter."""
    pytest.importorskip("transformers", reason="hf: models need the optional extra 'hf'")
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(LLAMA))
    plan = _plan(f"hf:{path}")
    for i in range(2):
        p = f"model.layers.{i}.self_attn."
        got = {n: plan.tensor_parallel.get(p + n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
        assert got == dict(zip(got, STYLES.values())), plan.tensor_parallel
        assert plan.module_attrs[p.rstrip(".")] == {"num_key_value_groups": 2}
    out = _verify(plan, tmp_path)
    shown = _shards(out, f"hf:{path}", 2, tmp_path)
    placements, local = shown["weights"]["model.layers.0.self_attn.k_proj"]
    assert placements == [["Shard", 0]] and local == [4, 64], (placements, local)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("mesh", ["dp=2", "fsdp=2", "pp=2"])
def test_grouped_kv_verifies_without_tp(mesh: str, tmp_path: Path) -> None:
    """Issue 28's meshes beside tp: the repeat_kv model under data parallelism, FSDP2 and a
    pipeline of two stages trains like one process (--verify, 2 ranks)."""
    plan = _plan(f"{FIXTURE}:build_repeat_kv", mesh, "cpu:2")
    assert plan.mesh.short() == mesh
    _verify(plan, tmp_path)
