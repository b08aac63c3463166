"""Tensor parallelism through attention as reference code writes it (issue 15 item 1).

Views that spell the head count from a module attribute (``view(B, T, self.n_head,
self.head_dim)``, a ``repeat_kv`` that expands with ``self.n_kv_heads``) hold the full count in the
trace. ``ir._heads`` runs each such block on meta at a Megatron pair's local shapes with its head
counts divided as the plan's ``module_attrs`` divides them; where that run is consistent, the
layout rules accept the views on local heads and the attention gets Megatron pairs (q/k/v
colwise, output rowwise). A size that does not follow the rewrite (nanoGPT's ``C // self.n_head``
with ``C`` the input's width, a number written in the code) is right at full shapes: such a block
(``Graph.dtensor_blocks``) gets Megatron pairs whose colwise outputs are DTensors of full shape
(``colwise_dtensor``), so its own ops run on DTensors up to the rowwise linear.

Models: ``tests/models/heads.py`` (written for these tests).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from _plans import run_bounded
from autopar.cost_model import parse_cluster
from autopar.ir.trace import trace
from autopar.planner import ilp
from autopar.planner.search import _module_attrs, _program_styles
from test_codegen_dist import VERIFY_OK

from autopar.api import plan_model_file
from autopar.model_file import load_model_file

FIXTURE = Path(__file__).resolve().parent / "models" / "heads.py"
sys.path.insert(0, str(FIXTURE.parent))
import heads as models  # noqa: E402

TIMEOUT_S = 300
QKV = {
    "megatron": ("q", "k", "v"),
    "llama": ("wq", "wk", "wv"),
    "mingpt": ("key", "query", "value"),
}
QKV["interleave"] = QKV["llama"]
QKV["nanogpt"] = QKV["constant"] = QKV["megatron"]
QKV["fused"] = ("c_attn",)
OUT = {"megatron": "proj", "llama": "wo", "nanogpt": "proj", "constant": "proj", "mingpt": "proj"}
OUT["fused"] = "c_proj"
OUT["interleave"] = "wo"
ATTRS = {"megatron": {"n_head": 2}, "llama": {"n_heads": 2, "n_kv_heads": 1}}
ATTRS["interleave"] = ATTRS["llama"]
# views of full sizes: the block runs on DTensors (fused: nanoGPT's c_attn split into q, k, v)
DTENSOR = ("nanogpt", "constant", "mingpt", "fused")


def _trace(kind: str, dim: int = 64, heads: int = 4, seq: int = 16, dtype=None):
    with torch.device("meta"):
        model = models.GPT(kind, dim, heads, max_seq=max(seq, models.MAX_SEQ))
    idx = torch.zeros(2, seq, dtype=torch.long, device="meta")
    return trace(model.train(), (idx,), dtype=dtype)


def _attention_views(graph, block: str = "blocks.0.attn"):
    ops = ("aten.view.default", "aten.reshape.default", "aten.expand.default")
    return [n for n in graph.nodes if n.module_fqn == block and n.op in ops]


def _h100(tp: int, scale: float) -> ilp.CostInputs:
    c = parse_cluster("8xH100")
    return ilp.CostInputs(
        tp=tp,
        batch_scale=scale,
        device=c.device,
        dtype="bf16",
        tp_link=c.intra_node,
        grad_sync_s_per_byte=1e-11,
    )


def _assert_pairs(styles: dict[str, str], kind: str, layers: int = 2) -> None:
    colwise = ("colwise_dtensor",) if kind in DTENSOR else ("colwise", "colwise_from_seq")
    colwise = ("colwise_fused3_dtensor",) if kind == "fused" else colwise
    for i in range(layers):
        p = f"blocks.{i}.attn."
        for name in QKV[kind]:
            assert styles.get(p + name) in colwise, (name, styles)
        assert styles.get(p + OUT[kind]) in ("rowwise", "rowwise_to_seq"), styles


# -- the proof: local sizes recorded per traced view -------------------------------------------


def test_views_sized_from_head_attributes_get_their_local_sizes():
    graph = _trace("megatron")
    views = _attention_views(graph)
    assert [n.args[1] for n in views] == [(2, 16, 4, 16)] * 3 + [(2, 16, 64)]
    assert [graph.local_literals[n.name][2] for n in views] == [(2, 16, 2, 16)] * 3 + [(2, 16, 32)]
    assert [graph.local_literals[n.name][4] for n in views] == [(2, 16, 1, 16)] * 3 + [(2, 16, 16)]
    # every block of the kind shares the proof (the trace folds or not: the same answer)
    assert all(n.name in graph.local_literals for n in _attention_views(graph, "blocks.1.attn"))


def test_repeat_kv_with_the_modules_kv_heads_is_local_where_kv_heads_divide_or_group():
    """tp=2 divides the 2 kv heads (Megatron pairs); at tp=4 each rank computes the one kv head
    its query heads read (test_gqa_tp), n_rep the rank's one query head."""
    graph = _trace("llama")
    views = {
        tuple(n.args[1]): graph.local_literals.get(n.name, {}) for n in _attention_views(graph)
    }
    assert views[(2, 16, 2, 2, 16)] == {2: (2, 16, 1, 2, 16), 4: (2, 16, 1, 1, 16)}  # expand
    assert views[(2, 16, 4, 16)][2] == (2, 16, 2, 16)  # q's view, and repeat_kv's reshape
    assert views[(2, 16, 2, 16)] == {2: (2, 16, 1, 16), 4: (2, 16, 1, 16)}  # k/v: one kv head
    assert views[(2, 16, 64)] == {2: (2, 16, 32), 4: (2, 16, 16)}  # the merge


@pytest.mark.parametrize("kind", DTENSOR)
def test_sizes_that_do_not_follow_the_head_count_are_not_local(kind):
    """nanoGPT's C // self.n_head (C: the input's full width) gives twice the head dim on half
    the heads; view(b, t, 4, 16) is a number: neither runs at local shapes, nothing is recorded.
    Each block runs only ops DTensor carries, on its input and its own buffers: it can run on
    DTensors of full shape instead."""
    graph = _trace(kind)
    assert graph.local_literals == {}
    assert graph.dtensor_blocks == {"blocks.0.attn", "blocks.1.attn"}
    fused = {f"blocks.{i}.attn.c_attn": 3 for i in range(2)} if kind == "fused" else {}
    assert graph.fused_linears == fused


class _UnequalSplit(torch.nn.Module):
    """A fused q/k/v of grouped-query attention: 4 query heads, 2 kv heads, split unequally."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(64, 128)
        self.o = torch.nn.Linear(64, 64)

    def forward(self, x):
        B, T, C = x.size()  # noqa: N806
        q, k, v = self.qkv(x).split([64, 32, 32], dim=2)
        q = q.view(B, T, 4, 16).transpose(1, 2)
        k, v = (t.view(B, T, 2, 16).transpose(1, 2) for t in (k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(B, T, C))


def test_a_fused_linear_split_unequally_stays_whole():
    """Only a split into equal pieces hands each rank its slice of every piece; an unequal split
    (grouped-query q, k, v) keeps the fused linear unsharded, and the block with it."""
    with torch.device("meta"):
        model = torch.nn.Sequential(_UnequalSplit())
    graph = trace(model.train(), (torch.zeros(2, 16, 64, device="meta"),))
    assert graph.fused_linears == {}
    k = ilp.CostInputs(**{**_h100(2, 4096.0).__dict__, "shard_all": True})
    styles = ilp.solve(graph, k).styles
    assert styles.get("0.qkv", "replicate") in ("replicate", "colwise_gather"), styles


@pytest.mark.parametrize("kind", ["megatron", "llama"])
def test_blocks_proven_local_do_not_run_on_dtensors(kind):
    assert _trace(kind).dtensor_blocks == frozenset()


class _MaskArgAttention(torch.nn.Module):
    """nanoGPT's sizes, but the mask comes in as an argument (a plain tensor from the caller)."""

    def __init__(self, dim: int = 64, n_head: int = 4) -> None:
        super().__init__()
        self.n_head = n_head
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x, mask):
        B, T, C = x.size()  # noqa: N806
        q, k, v = (f(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for f in (self.q, self.k, self.v))  # fmt: skip
        att = (q @ k.transpose(-2, -1)).masked_fill(mask == 0, float("-inf")).softmax(-1)
        return self.o((att @ v).transpose(1, 2).contiguous().view(B, T, C))


class _MakesMask(_MaskArgAttention):
    """The same, its mask made inside the forward (a plain tensor meeting DTensors)."""

    def forward(self, x, mask=None):
        t = x.shape[1]
        return super().forward(x, torch.ones(t, t, device=x.device).tril())


class _Wrap(torch.nn.Module):
    def __init__(self, attn: torch.nn.Module) -> None:
        super().__init__()
        self.attn = attn
        self.register_buffer("mask", torch.ones(16, 16).tril())

    def forward(self, x):
        return self.attn(x, self.mask)


@pytest.mark.parametrize("attn", [_MaskArgAttention, _MakesMask])
def test_blocks_that_would_mix_plain_tensors_with_dtensors_keep_whole_heads(attn):
    """A block reading a tensor its caller passes, or one it makes, would meet DTensors with a
    plain tensor: it does not run on DTensors, and a pinned tp=2 gathers its heads."""
    with torch.device("meta"):
        model = _Wrap(attn())
    graph = trace(model.train(), (torch.zeros(2, 16, 64, device="meta"),))
    assert graph.dtensor_blocks == frozenset()
    k = ilp.CostInputs(**{**_h100(2, 1.0).__dict__, "shard_all": True})
    styles = ilp.solve(graph, k).styles
    assert all(styles.get(f"attn.{f}") == "colwise_gather" for f in "qkv"), styles


# -- plans ----------------------------------------------------------------------------------------


def _plan(factory: str, mesh: dict[str, int] | None, cluster: str = "cpu:2", **kw):
    return plan_model_file(
        load_model_file(f"{FIXTURE}:{factory}"),
        cluster,
        global_batch=8,
        seq_len=16,
        mesh=mesh,
        **kw,
    )


@pytest.mark.parametrize("kind", ["megatron", "llama", "interleave"])
def test_pinned_tp2_gives_megatron_pairs_and_local_head_counts(kind):
    plan = _plan(f"build_{kind}", {"tp": 2})
    _assert_pairs(plan.tensor_parallel, kind)
    assert plan.module_attrs == {f"blocks.{i}.attn": ATTRS[kind] for i in range(2)}


@pytest.mark.parametrize("kind", DTENSOR)
def test_pinned_tp2_pairs_full_size_views_on_dtensors(kind):
    """Views of full sizes: Megatron pairs whose colwise outputs stay DTensors of full shape,
    the head counts left whole (the views are right at full shapes)."""
    plan = _plan(f"build_{kind}", {"tp": 2})
    _assert_pairs(plan.tensor_parallel, kind)
    for i in range(2):
        assert plan.tensor_parallel[f"blocks.{i}.mlp.up"] == "colwise"  # the MLP: local
    assert plan.module_attrs == {}


def test_dtensor_blocks_shard_all_their_colwise_linears_or_none():
    """Free choice on H100 costs: at a small batch the block stays whole, at a large one it
    pairs (with sequence parallelism); never some of its colwise linears alone (a colwise
    output meeting a plain one would not run on DTensors): the ILP's block constraint, binding
    where the layout rules alone would allow it (a gate that cannot shard)."""
    from autopar.planner import sat

    graph = _trace("nanogpt")
    for scale, pairs in ((1.0, False), (4096.0, True)):
        styles = ilp.solve(graph, _h100(2, scale)).styles
        for i in range(2):
            p = f"blocks.{i}.attn."
            sharded = {styles.get(p + n, "replicate") == "colwise" for n in QKV["nanogpt"]}
            assert sharded == {pairs}, styles
            assert styles.get(p + "proj", "replicate").startswith("rowwise") == pairs, styles
    # where only the constraint says so: a gate linear too narrow to shard (one output) scales
    # q; on local pieces that broadcast is legal, but a plain gate would meet a DTensor q
    with torch.device("meta"):
        model = torch.nn.Sequential(_GatedHeads())
    graph = trace(model.train(), (torch.zeros(2, 16, 64, device="meta"),))
    assert graph.dtensor_blocks == {"0"}
    solver = ilp.Solver(graph, 2)
    base, _ = solver._cp()
    forced = base.clone()
    forced.equal([(solver._x["0.q", "colwise"], 1)], 1)
    assert sat.solve(forced, 10.0).status == "INFEASIBLE"
    styles = ilp.solve(graph, ilp.CostInputs(**{**_h100(2, 4096.0).__dict__, "shard_all": True}))
    assert styles.styles.get("0.q", "replicate") != "colwise", styles.styles


class _GatedHeads(torch.nn.Module):
    """Heads sized by a number, scaled by a one-output gate linear (replicated: it cannot
    shard)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.g, self.o = (torch.nn.Linear(64, n) for n in (64, 1, 64))

    def forward(self, x):
        B, T, C = x.size()  # noqa: N806
        y = self.q(x).view(B, T, 4, 16) * self.g(x).view(B, T, 1, 1)
        return self.o(y.view(B, T, C))


@pytest.mark.parametrize("kind", ["megatron", "llama", "fused"])
def test_h100_costs_shard_attention_where_tp_pays(kind):
    """At GPT scale on H100 costs (free choice, no pin), the attention of a Megatron-style GPT
    is sharded with the MLP, not the MLP alone; nanoGPT's too (on DTensors, heads whole)."""
    graph = _trace(kind, dim=2048, heads=16, seq=1024, dtype=torch.bfloat16)
    styles = _program_styles(graph, ilp.solve(graph, _h100(2, 16.0)).styles, 2)
    _assert_pairs(styles, kind)
    attrs = {"megatron": {"n_head": 8}, "llama": {"n_heads": 8, "n_kv_heads": 4}}.get(kind)
    expected = {f"blocks.{i}.attn": attrs for i in range(2)} if attrs else {}
    assert _module_attrs(graph, styles, 2) == expected


# -- the emitted program ---------------------------------------------------------------------------


# The plan applied in one plain process on a fake 2-rank process group (no torchrun launch): the
# same runtime apply_tp the emitted script ran, each styled weight's placements and local shape,
# and the attention modules' head counts as the program sets them.
SHOW_SHARDS = """
import json, sys
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from autopar import Plan

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
plan = Plan.load(sys.argv[1])
sys.path.insert(0, sys.argv[2])
import heads

model = plan.apply(getattr(heads, sys.argv[3])())
rows = {}
for fqn in plan.tensor_parallel:
    w = model.get_submodule(fqn).weight
    rows[fqn] = {
        "placements": [[type(p).__name__, getattr(p, "dim", None)] for p in w.placements],
        "global": list(w.shape),
        "local": list(w.to_local().shape),
    }
attrs = {f: {k: getattr(model.get_submodule(f), k) for k in a} for f, a in plan.module_attrs.items()}
print("SHARDS " + json.dumps({"weights": rows, "attrs": attrs}), flush=True)
dist.destroy_process_group()
"""


def _emit_and_verify(plan, tmp_path: Path) -> Path:
    """The emitted program (its folder returned), 2 SGD steps with --verify: losses and
    parameters within 1e-5."""
    out = plan.emit(tmp_path / "out")
    args = ["--steps", "2", "--optimizer", "sgd", "--verify"]
    rc, text = run_bounded(["bash", "launch.sh", *args], out, TIMEOUT_S, DIST_TIMEOUT_S="120")
    assert rc == 0, text[-4000:]
    m = VERIFY_OK.search(text)
    assert m and float(m.group(1)) <= 1e-5 and float(m.group(2)) <= 1e-5, text[-3000:]
    return out


def _shards(out: Path, factory: str, tmp_path: Path) -> dict:
    """The emitted plan applied on a fake 2-rank group (SHOW_SHARDS): weights and head counts."""
    script = tmp_path / "show_shards.py"
    script.write_text(SHOW_SHARDS)
    cmd = [sys.executable, str(script), str(out / "plan.json"), str(FIXTURE.parent), factory]
    rc, text = run_bounded(cmd, tmp_path, TIMEOUT_S)
    assert rc == 0, text[-4000:]
    return json.loads(next(x for x in text.splitlines() if x.startswith("SHARDS "))[7:])


def _verify_and_shards(kind: str, tmp_path: Path, mesh: dict | None = None) -> None:
    mesh = mesh or {"tp": 2}
    cluster = f"cpu:{math.prod(mesh.values())}"
    plan = _plan(f"build_{kind}", mesh, cluster, optimizer="sgd")
    _assert_pairs(plan.tensor_parallel, kind)
    out = _emit_and_verify(plan, tmp_path)
    if mesh != {"tp": 2}:
        return  # the shards below: on a 2-rank fake process group
    shown = _shards(out, f"build_{kind}", tmp_path)
    if kind in ATTRS:
        assert shown["attrs"] == {f"blocks.{i}.attn": ATTRS[kind] for i in range(2)}
    for i in range(2):
        p = f"blocks.{i}.attn."
        for name, dim in [*((n, 0) for n in QKV[kind]), (OUT[kind], 1)]:
            row = shown["weights"][p + name]
            # a fused linear: rank r holds rows r of each of q, k, v
            shard = "_StridedShard" if kind == "fused" and dim == 0 else "Shard"
            assert row["placements"] == [[shard, dim]], (name, row)
            assert row["local"][dim] * 2 == row["global"][dim], (name, row)


@pytest.mark.dist
def test_gqa_attribute_heads_verify_under_tp2_with_sharded_projections(tmp_path: Path) -> None:
    """The from-scratch Llama (GQA, repeat_kv sized from self.n_kv_heads) at tp=2 under
    torchrun: --verify matches the single-process run; the plan applied on 2 ranks holds each
    attention projection as a DTensor in two halves, and the module's head counts halved."""
    _verify_and_shards("llama", tmp_path)


@pytest.mark.slow
@pytest.mark.dist
def test_repeat_interleave_gqa_verifies_under_tp2_with_sharded_projections(tmp_path: Path):
    """Grouped-query attention expanding its kv heads with repeat_interleave (issue 28, item
    6): Megatron pairs as repeat_kv gets them, --verify matches one process, the projections
    are held in two halves and the head counts halved."""
    _verify_and_shards("interleave", tmp_path)


# -- one kv head, fewer than tp (issue 28, item 6) -----------------------------------------------

# Falcon's multi-query attention (k/v expanded to the query heads) and grouped-query attention
# with one kv head handed to SDPA as it is (enable_gqa): Megatron's way, query heads colwise,
# output rowwise, the one kv head whole on every rank
ONE_KV = ("mqa", "gqa_one_kv")
ONE_KV_STYLES = {"wq": "colwise", "wk": "colwise_gather_heads", "wv": "colwise_gather_heads"}
ONE_KV_STYLES["wo"] = "rowwise"


@pytest.mark.parametrize("kind", ONE_KV)
def test_one_kv_head_is_proven_on_local_query_heads(kind):
    """The block runs at tp=2 with its query linear colwise, its output linear rowwise and its
    one-head k/v linears whole: q's view, MQA's expand of the kv head and the merge get local
    sizes, k/v's views keep theirs; a pinned tp=2 pairs q and o and hands k/v whole to every
    rank (their gradient summed over the group), the MLP sharded as usual."""
    graph = _trace(kind)
    views = {tuple(n.args[1]): graph.local_literals.get(n.name) for n in _attention_views(graph)}
    assert views[(2, 16, 4, 16)] == {2: (2, 16, 2, 16), 4: (2, 16, 1, 16)}  # q
    assert views[(2, 16, 1, 16)] is None  # k and v: one head, whole
    assert views[(2, 16, 64)] == {2: (2, 16, 32), 4: (2, 16, 16)}  # the merge
    if kind == "mqa":
        assert views[(2, 4, 16, 16)] == {2: (2, 2, 16, 16), 4: (2, 1, 16, 16)}  # the expand
    assert graph.dtensor_blocks == frozenset()
    k = ilp.CostInputs(**{**_h100(2, 1.0).__dict__, "shard_all": True})
    styles = ilp.solve(graph, k).styles
    for i in range(2):
        p = f"blocks.{i}."
        assert {n: styles.get(p + "attn." + n) for n in ONE_KV_STYLES} == ONE_KV_STYLES, styles
        assert styles[p + "mlp.down"] == "rowwise", styles
    # n_rep (unused by these blocks): the rank's query heads per kv head
    attrs = {"n_heads": 2, "n_rep": 2}
    assert _module_attrs(graph, styles, 2) == {f"blocks.{i}.attn": attrs for i in (0, 1)}


@pytest.mark.slow
def test_h100_costs_pair_one_kv_head_attention_where_tp_pays():
    """Free choice at GPT scale on H100 costs (16 query heads, one kv head): at a large batch
    the query heads pair with the output and the kv head goes whole to every rank; at a small
    one only the MLP pairs."""
    graph = _trace("mqa", dim=2048, heads=16, seq=1024, dtype=torch.bfloat16)
    small = ilp.solve(graph, _h100(2, 1.0)).styles
    assert "blocks.0.attn.wq" not in small and small["blocks.0.mlp.down"] == "rowwise", small
    styles = ilp.solve(graph, _h100(2, 16.0)).styles
    for i in range(2):
        p = f"blocks.{i}.attn."
        assert styles[p + "wq"] == "colwise", styles
        assert styles[p + "wo"] in ("rowwise", "rowwise_to_seq"), styles
        assert styles[p + "wk"] == styles[p + "wv"] == "colwise_gather_heads", styles


@pytest.mark.slow
@pytest.mark.dist
def test_one_kv_head_gathered_without_its_gradient_summed_fails_verify(tmp_path: Path) -> None:
    """The check above can fail: the same plan with k/v ``colwise_gather`` (output gathered, its
    gradient taken as the same on every rank) leaves each rank its query heads' share of the kv
    gradient: --verify exits 1 naming a kv weight."""
    plan = _plan("build_mqa", {"tp": 2}, optimizer="sgd")
    styles = {f: s.replace("_heads", "") for f, s in plan.tensor_parallel.items()}
    out = plan.model_copy(update={"tensor_parallel": styles}).emit(tmp_path / "out")
    args = ["--steps", "3", "--optimizer", "sgd", "--lr", "0.5", "--verify"]
    rc, text = run_bounded(["bash", "launch.sh", *args], out, TIMEOUT_S, DIST_TIMEOUT_S="120")
    assert rc == 1 and re.search(r"verify: FAILED blocks\.\d\.attn\.w[kv]\.weight", text), text[
        -3000:
    ]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("kind", ONE_KV)
def test_one_kv_head_verifies_under_tp2_with_query_heads_sharded(kind: str, tmp_path: Path):
    """The plan at tp=2 emitted and run under torchrun: --verify (SGD at a learning rate that
    makes an unsummed kv gradient show: k/v ``colwise_gather`` instead fail with
    ``blocks.1.attn.wv.weight diff=8.792e-03``) matches one process; applied on 2 ranks, wq holds half its rows, wo half its columns, wk/wv half their
    rows (their output gathered whole), the head count halved."""
    plan = _plan(f"build_{kind}", {"tp": 2}, optimizer="sgd")
    for i in range(2):
        p = f"blocks.{i}.attn."
        assert {n: plan.tensor_parallel.get(p + n) for n in ONE_KV_STYLES} == ONE_KV_STYLES
    out = plan.emit(tmp_path / "out")
    args = ["--steps", "3", "--optimizer", "sgd", "--lr", "0.5", "--verify"]
    rc, text = run_bounded(["bash", "launch.sh", *args], out, TIMEOUT_S, DIST_TIMEOUT_S="120")
    assert rc == 0, text[-4000:]
    m = VERIFY_OK.search(text)
    assert m and float(m.group(1)) <= 1e-5 and float(m.group(2)) <= 1e-5, text[-3000:]
    shown = _shards(out, f"build_{kind}", tmp_path)
    assert shown["attrs"] == {f"blocks.{i}.attn": {"n_heads": 2, "n_rep": 2} for i in range(2)}
    for i in range(2):
        for name, dim in (("wq", 0), ("wk", 0), ("wv", 0), ("wo", 1)):
            row = shown["weights"][f"blocks.{i}.attn.{name}"]
            assert row["placements"] == [["Shard", dim]], (name, row)
            assert row["local"][dim] * 2 == row["global"][dim], (name, row)


@pytest.mark.slow
@pytest.mark.dist
def test_explicit_softmax_attribute_heads_verify_under_tp2(tmp_path: Path) -> None:
    _verify_and_shards("megatron", tmp_path)


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["fused", pytest.param("mingpt", marks=pytest.mark.slow)])
def test_full_size_views_verify_under_tp2_on_dtensors(kind: str, tmp_path: Path) -> None:
    """nanoGPT's attention verbatim (c_attn split into q, k, v; SDPA, the CPU kernel's DTensor
    rule), and minGPT's explicit softmax over its registered mask (lent as a replicated
    DTensor): --verify matches one process, and each attention projection is held in two
    halves (c_attn: rows of each of q, k, v)."""
    _verify_and_shards(kind, tmp_path)


@pytest.mark.dist
def test_compile_of_blocks_on_dtensors_is_one_line(tmp_path: Path) -> None:
    """torch 2.13 fails to compile them (a RecursionError in backward, measured): the program
    says so in one line and exits 2 before any step."""
    out = _plan("build_fused", {"tp": 2}).emit(tmp_path / "out")
    rc, text = run_bounded(["bash", "launch.sh", "--steps", "1", "--compile"], out, TIMEOUT_S)
    errors = [x for x in text.splitlines() if x.startswith("error:")]
    assert rc == 2 and errors and "--compile" in errors[0] and "blocks.0.attn" in errors[0], text
    assert '"step"' not in text


@pytest.mark.slow
@pytest.mark.dist
def test_nanogpt_sizes_verify_under_tp2_on_dtensors(tmp_path: Path) -> None:
    _verify_and_shards("nanogpt", tmp_path)


@pytest.mark.slow
@pytest.mark.dist
def test_full_size_views_verify_under_tp2_fsdp2(tmp_path: Path) -> None:
    _verify_and_shards("mingpt", tmp_path, {"tp": 2, "fsdp": 2})


@pytest.mark.slow
@pytest.mark.dist
def test_fused_attention_verifies_under_pp2_tp2(tmp_path: Path) -> None:
    """nanoGPT's attention verbatim in pipeline stages (the stages traced and split, then
    tensor-parallel): --verify matches one process."""
    _verify_and_shards("fused", tmp_path, {"pp": 2, "tp": 2})


def _losses(text: str) -> dict[int, float]:
    rows = [json.loads(x) for x in text.splitlines() if x.startswith('{"step"')]
    return {r["step"]: r["loss"] for r in rows}


@pytest.mark.slow
@pytest.mark.dist
def test_fused_checkpoints_resume_and_publish_under_tp2_fsdp2(tmp_path: Path) -> None:
    """nanoGPT's fused c_attn at tp=2 x fsdp=2 (its rows _StridedShard over tp, its columns
    over fsdp), a linear lr decay: --verify passes; a checkpoint resumes to the uninterrupted
    run's loss exactly (weights, optimizer and schedule restored);
    --save-hf writes weights that --init-from loads back with --verify passing (the sharded
    load and the single-process reference read the same tensors)."""
    plan = _plan("build_fused", {"tp": 2, "fsdp": 2}, "cpu:4", optimizer="sgd")
    _assert_pairs(plan.tensor_parallel, "fused")
    out = plan.emit(tmp_path / "out")

    def launch(*args: str) -> str:  # a decaying lr: the resume must restore its schedule too
        cmd = ["bash", "launch.sh", "--optimizer", "sgd", "--lr-schedule", "linear", *args]
        rc, text = run_bounded(cmd, out, TIMEOUT_S, DIST_TIMEOUT_S="120")
        assert rc == 0, text[-4000:]
        return text

    ck, hf = str(tmp_path / "ck"), str(tmp_path / "hf")
    first = launch("--steps", "4", "--checkpoint-dir", ck, "--checkpoint-every", "2",
                   "--save-hf", hf)  # fmt: skip
    shutil.rmtree(Path(ck) / "step_4")  # as if the run had died after step 2's checkpoint
    resumed = launch("--steps", "4", "--checkpoint-dir", ck)
    assert "resumed from step 2" in resumed, resumed[-3000:]
    assert _losses(resumed)[4] == _losses(first)[4]
    whole = launch("--steps", "4", "--verify")
    m = VERIFY_OK.search(whole)
    assert m and float(m.group(1)) <= 1e-5 and float(m.group(2)) <= 1e-5, whole[-3000:]
    assert _losses(whole)[4] == _losses(first)[4]
    loaded = launch("--steps", "1", "--init-from", hf, "--verify")
    m = VERIFY_OK.search(loaded)
    assert m and float(m.group(1)) <= 1e-5 and float(m.group(2)) <= 1e-5, loaded[-3000:]


@pytest.mark.slow
@pytest.mark.dist
def test_full_size_views_verify_with_sequence_parallel(tmp_path: Path) -> None:
    """minGPT with the styles the ILP picks on H100 costs at a large batch: sequence parallel
    norms, the block's colwise linears reading the gathered (replicated DTensor) sequence, its
    output reduce-scattered back (rowwise_to_seq): --verify matches one process."""
    from autopar import Plan
    from autopar.api import _trace_plan_model

    plan = _plan("build_mingpt", {"tp": 2}, optimizer="sgd")
    graph = _trace_plan_model(plan, None)
    styles = _program_styles(graph, ilp.solve(graph, _h100(2, 4096.0)).styles, 2)
    assert styles["blocks.0.ln1"] == "sequence_parallel_gather", styles
    assert styles["blocks.0.attn.proj"] == "rowwise_to_seq", styles
    _assert_pairs(styles, "mingpt")
    _emit_and_verify(
        Plan.from_json(plan.model_copy(update={"tensor_parallel": styles}).to_json()), tmp_path
    )


# -- per-head norms (Qwen3's q_norm / k_norm) ------------------------------------------------------


def _qwen3_moe_plan(tmp_path: Path):
    """Qwen3-MoE's tiny config at tp=2 on cpu:2, with the TP styles the ILP picks for its graph
    on H100 costs at a large batch (on CPU costs gathering whole heads is cheaper)."""
    pytest.importorskip("transformers")
    from test_families import CONFIGS

    from autopar import Plan
    from autopar.api import _trace_plan_model

    path = tmp_path / "qwen3_moe.json"
    path.write_text(json.dumps(CONFIGS["qwen3_moe"]))
    plan = plan_model_file(
        load_model_file(f"hf:{path}"), "cpu:2", global_batch=4, seq_len=16, mesh="tp=2",
        optimizer="sgd",
    )  # fmt: skip
    graph = _trace_plan_model(plan, None)
    k = ilp.CostInputs(**{**_h100(2, 4096.0).__dict__, "shard_all": True})
    styles = ilp.solve(graph, k).styles
    return graph, Plan.from_json(plan.model_copy(update={"tensor_parallel": styles}).to_json())


def _assert_qwen3_pairs(styles: dict[str, str]) -> None:
    for i in range(2):
        p = f"model.layers.{i}.self_attn."
        for name in ("q_proj", "k_proj", "v_proj"):
            assert styles[p + name] == "colwise", (name, styles)
        assert styles[p + "o_proj"] == "rowwise", styles
        for name in ("q_norm", "k_norm"):
            assert styles[p + name] == "heads_parallel_local", (name, styles)


def test_per_head_norms_run_on_local_heads_so_qwen3_attention_pairs(tmp_path: Path):
    """q_norm/k_norm normalise head_dim of a (batch, seq, heads, head_dim) view: on local heads
    they are right, their weight gradient a partial sum per rank (the heads_parallel_local style
    all-reduces it). A norm of a (batch, seq, hidden) activation never gets that style."""
    graph, plan = _qwen3_moe_plan(tmp_path)
    _assert_qwen3_pairs(plan.tensor_parallel)
    units = {u.fqn: u.styles for u in ilp.collapse(graph).units if u.kind == "norm"}
    assert "heads_parallel_local" in units["model.layers.0.self_attn.q_norm"]
    assert "heads_parallel_local" not in units["model.layers.0.input_layernorm"]


@pytest.mark.slow
@pytest.mark.dist
def test_qwen3_moe_attention_pairs_verify_under_tp2(tmp_path: Path) -> None:
    _, plan = _qwen3_moe_plan(tmp_path)
    out = plan.emit(tmp_path / "out")
    args = ["--steps", "2", "--optimizer", "sgd", "--verify"]
    rc, text = run_bounded(["bash", "launch.sh", *args], out, TIMEOUT_S, DIST_TIMEOUT_S="120")
    assert rc == 0, text[-4000:]
    m = VERIFY_OK.search(text)
    assert m and float(m.group(1)) <= 1e-5 and float(m.group(2)) <= 1e-5, text[-3000:]
