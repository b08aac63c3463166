"""A pinned tp means sharding: ``--mesh tp=N`` shards every module that can be sharded at N
(the cheapest such choice), even where the cost model finds replication cheaper, and the plan
says what that costs against the cost model's own choice on the same mesh (``pinned_tp`` and a
note). A free search is unchanged. The emitted script of such a plan passes ``--verify`` under
torchrun, and ``plan.apply`` shows the weights really are DTensors split on the tp mesh dim.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _plans import APPLY_EPILOGUE, APPLY_PRELUDE, GPT, run_bounded
from autopar.codegen import write_outputs
from autopar.planner import ilp
from autopar.planner.search import replay
from test_codegen_dist import VERIFY_OK
from test_planner import Attention, MLPStack, _graph, _inputs, _meta

from autopar import Plan
from autopar.api import _trace_plan_model, plan_model_file
from autopar.model_file import load_model_file

TIMEOUT_S = 240
FIXTURE = str(Path(__file__).resolve().parent / "models" / "nanogpt_literal.py")
BIN = Path(sys.executable).parent

# (model, input dims, tp, cluster, batch scale): at these sizes on CPU the free optimum
# replicates every module, so forcing changes the answer
SMALL = [
    ("attention", (2, 16, 64), 2, "cpu:2", 1.0),
    ("mlp_stack", (2, 8, 32), 4, "cpu:4", 1.0),
    ("mlp_stack", (2, 8, 32), 2, "cpu:2", 1.0),
]


def _small_graph(name: str, dims: tuple[int, int, int]):
    model = _meta(Attention, dims[2], 8) if name == "attention" else _meta(MLPStack, dims[2], 3, 16)
    return _graph(model, *dims)


def _gpt_plan(mesh: dict[str, int] | None, cluster: str = "cpu:4", spec: str = GPT, **kw) -> Plan:
    return plan_model_file(
        load_model_file(spec), cluster, global_batch=8, seq_len=16, mesh=mesh, **kw
    )


# -- the ILP -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "dims", "tp", "spec", "scale"), SMALL)
def test_forced_ilp_equals_brute_force_and_shards_every_unit(name, dims, tp, spec, scale):
    graph = _small_graph(name, dims)
    free_k = _inputs(spec, tp, scale)
    forced_k = ilp.CostInputs(**{**free_k.__dict__, "shard_all": True})
    solver = ilp.Solver(graph, tp)
    free, forced = solver.solve(free_k), solver.solve(forced_k)
    assert free.styles == {}, free.styles  # the free optimum replicates: forcing is not moot
    best_ns, best_styles = ilp.brute_force(graph, forced_k)
    assert forced.objective_ns == best_ns, (forced.styles, best_styles)
    shardable = [u.fqn for u in solver.c.units if ilp.even_styles(graph, u, tp)]
    assert shardable and all(ilp.shards_weights(forced.styles.get(f, "")) for f in shardable)
    assert forced.objective_ns > free.objective_ns  # the price of the pin, as the model sees it
    # the free answer is still there after the forced one (separate caches)
    assert solver.solve(free_k).styles == {}


def test_even_styles_follow_the_weight_dims():
    """A Linear(64, 6) at tp=4: no colwise style (6 rows), rowwise only (64 columns)."""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(64, 6)

        def forward(self, x):
            return self.a(x)

    with torch.device("meta"):
        model = Net()
    graph = _graph(model, 2, 8, 64)
    (unit,) = ilp.Solver(graph, 4).c.units
    even = ilp.even_styles(graph, unit, 4)
    assert even and all(s.startswith("rowwise") for s in even), even


# -- the search --------------------------------------------------------------------------------


def test_pinned_tp_plans_megatron_pairs_on_the_gpt_example():
    plan = _gpt_plan({"tp": 2})
    styles = plan.tensor_parallel
    for i in range(4):
        p = f"blocks.{i}."
        for name in ("attn.q", "attn.k", "attn.v", "mlp.up"):
            assert styles.get(p + name, "").startswith("colwise"), (name, styles)
        for name in ("attn.o", "mlp.down"):
            assert styles.get(p + name, "").startswith("rowwise"), (name, styles)
    assert {"tok_emb", "pos_emb", "head"} <= set(styles)
    pin = plan.pinned_tp
    assert pin is not None and pin.sharded_modules == len(styles) == 27
    # the cost model's own choice on this mesh shards nothing, and is faster on 2 CPU cores
    assert pin.free_sharded_modules == 0
    assert pin.free_step_time_s is not None
    assert pin.free_step_time_s < plan.predicted.step_time_s
    assert pin.free_peak_memory_bytes > plan.predicted.peak_memory_bytes  # sharded weights
    note = next(n for n in plan.notes if n.startswith("tp=2 is pinned"))
    assert "which shards nothing" in note and "per step" in note, note
    assert not any("shards no module" in n for n in plan.notes)
    assert all(a.lost_by != "idle_tp" for a in plan.alternatives)
    text = plan.explain()  # --explain: the pinned sharding beside the free choice
    assert "tp=2 is pinned" in text and "modules sharded" in text, text
    row = next(x for x in text.splitlines() if x.strip().startswith("modules sharded"))
    assert row.split()[-2:] == ["27", "0"], row
    # the JSON carries the figures; replaying the saved plan gives them again
    again = Plan.from_json(plan.to_json())
    assert again == plan and json.loads(plan.to_json())["pinned_tp"]["sharded_modules"] == 27
    replayed = replay(_trace_plan_model(again, None), again)
    assert replayed.predicted == plan.predicted
    assert replayed.tensor_parallel == plan.tensor_parallel
    assert replayed.pinned_tp == plan.pinned_tp


def test_free_search_is_unchanged_and_says_nothing_of_a_pin():
    plan = _gpt_plan(None)
    assert plan.pinned_tp is None and "pinned_tp" not in json.loads(plan.to_json())
    assert not any("is pinned" in n for n in plan.notes)
    pinned_other = _gpt_plan({"fsdp": 2})  # pinning another axis does not force TP
    assert pinned_other.pinned_tp is None


def test_why_not_tp_shows_the_sharded_plan():
    """Asking why not tp=2 compares against a plan that really shards."""
    from autopar.api import why_not

    chosen = _gpt_plan(None, cluster="cpu:2")
    w = why_not(chosen, "tp=2")
    assert w.forced is not None and w.forced.mesh.tp == 2
    assert len(w.forced.tensor_parallel) == 27 and w.forced.pinned_tp is not None
    assert "slower" in w.verdict, w.verdict


# -- attention as people write it (tests/models/nanogpt_literal.py) --------------------------


def _megatron_pairs(styles: dict[str, str], blocks: int, qkv, out, up, down) -> None:
    for i in range(blocks):
        p = f"blocks.{i}."
        for name in (*qkv, *up):
            assert styles.get(p + name) == "colwise", (name, styles)
        for name in (out, *down):
            assert styles.get(p + name) == "rowwise", (name, styles)


def test_explicit_softmax_attention_gets_megatron_pairs_when_pinned():
    """q @ k.transpose, a (1, 1, t, t) causal mask buffer sliced and broadcast, masked_fill,
    softmax, dropout, att @ v: all run on local heads, so q/k/v go colwise and out rowwise."""
    plan = _gpt_plan({"tp": 2}, spec=f"{FIXTURE}:build_explicit")
    qkv = ("attn.q_proj", "attn.k_proj", "attn.v_proj")
    _megatron_pairs(plan.tensor_parallel, 2, qkv, "attn.out_proj", ("mlp.up",), ("mlp.down",))
    assert plan.module_attrs == {f"blocks.{i}.attn": {"n_head": 2} for i in range(2)}


@pytest.mark.parametrize(
    ("factory", "attrs", "mlp_up"),
    [
        ("build_model", {"n_head": 2}, ("mlp.up",)),
        ("build_gqa", {"n_head": 2, "n_kv_heads": 1}, ("mlp.up", "mlp.gate")),
    ],
)
def test_literal_head_views_get_megatron_pairs_and_local_head_counts(factory, attrs, mlp_up):
    """view(b, t, self.n_head, self.head_dim) (and GQA's self.n_kv_heads with repeat_kv's
    expand/reshape) names the full head count in the trace; the block, run at a Megatron pair's
    local shapes with its head counts halved, names the local one (ir._heads): q/k/v colwise,
    the output projection rowwise, and module_attrs carries the local head counts."""
    plan = _gpt_plan({"tp": 2}, spec=f"{FIXTURE}:{factory}")
    out = "attn.o_proj" if factory == "build_gqa" else "attn.out_proj"
    qkv = ("attn.q_proj", "attn.k_proj", "attn.v_proj")
    _megatron_pairs(plan.tensor_parallel, 2, qkv, out, mlp_up, ("mlp.down",))
    assert plan.module_attrs == {f"blocks.{i}.attn": attrs for i in range(2)}


def test_a_mask_spanning_the_heads_keeps_them_whole():
    """masked_fill broadcasts its mask: a (1, heads, t, t) mask cannot meet local heads (it
    ran as an elementwise op on its first input before, allowing colwise q/k/v)."""
    import torch
    from torch import nn

    class Attn(nn.Module):
        def __init__(self, dim=64, heads=4, seq=16):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
            self.head_dim = dim // heads
            self.register_buffer("mask", torch.ones(1, heads, seq, seq))

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = (
                f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v)
            )
            att = (q @ k.transpose(-2, -1)).masked_fill(self.mask == 0, float("-inf"))
            y = att.softmax(-1) @ v
            return self.o(y.transpose(1, 2).reshape(b, t, -1))

    with torch.device("meta"):
        graph = _graph(Attn(), 2, 16, 64)
    k = ilp.CostInputs(**{**_inputs("cpu:2", 2, 1.0).__dict__, "shard_all": True})
    styles = ilp.solve(graph, k).styles
    assert all(styles.get(f) == "colwise_gather" for f in ("q", "k", "v")), styles


# -- the emitted program -----------------------------------------------------------------------

SHOW_SHARDS = (
    APPLY_PRELUDE
    + """
rows = {}
for fqn in plan.tensor_parallel:
    w = inner.get_submodule(fqn).weight
    rows[fqn] = {
        # (placement class, its dim or None) per mesh dim; Shard and _StridedShard both split
        "placements": [[type(pl).__name__, getattr(pl, "dim", None)] for pl in w.placements],
        "mesh": list(w.device_mesh.mesh_dim_names),
        "sizes": list(w.device_mesh.shape),
        "global": list(w.shape),
        "local": list(w.to_local().shape),
    }
if dist.get_rank() == 0:
    print("SHARDS " + json.dumps(rows), flush=True)
"""
    + APPLY_EPILOGUE
)

EXPECTED_DIM = {"colwise": 0, "colwise_gather": 0, "rowwise": 1, "rowwise_from_replicate": 0}


DIST_CASES = {
    "gpt-tp2-fsdp2": (GPT, {"tp": 2, "fsdp": 2}, 27),
    "gpt-tp2-dp2": (GPT, {"tp": 2, "dp": 2}, 27),
    "explicit-softmax-tp2-dp2": (f"{FIXTURE}:build_explicit", {"tp": 2, "dp": 2}, 14),
    "literal-heads-tp2-dp2": (FIXTURE, {"tp": 2, "dp": 2}, 14),
}
# The default tier runs the first; the others (~25 s each) are in the slow tier.
DIST_PARAMS = [
    pytest.param(case, marks=() if i == 0 else pytest.mark.slow)
    for i, case in enumerate(DIST_CASES)
]


@pytest.mark.dist
@pytest.mark.parametrize("case", DIST_PARAMS)
def test_pinned_tp_script_verifies_and_really_shards(case, tmp_path: Path) -> None:
    spec, mesh, modules = DIST_CASES[case]
    plan = _gpt_plan(mesh, spec=spec, optimizer="sgd")
    assert plan.mesh.tp == 2 and plan.mesh.world_size == 4
    assert len(plan.tensor_parallel) == modules
    out = write_outputs(plan, tmp_path / "out")
    rc, text = run_bounded(
        ["bash", "launch.sh", "--steps", "2", "--optimizer", "sgd", "--verify"],
        out,
        TIMEOUT_S,
        DIST_TIMEOUT_S="120",
    )
    assert rc == 0, text[-4000:]
    m = VERIFY_OK.search(text)
    assert m, text[-4000:]
    assert float(m.group(1)) <= 1e-5 and float(m.group(2)) <= 1e-5, m.group(0)
    # the same plan applied in process: each styled weight is a DTensor split on the tp dim
    script = tmp_path / "show_shards.py"
    script.write_text(SHOW_SHARDS)
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "4"]
    rc, text = run_bounded(
        [*torchrun, str(script), str(out / "plan.json")], tmp_path, TIMEOUT_S, DIST_TIMEOUT_S="120"
    )
    assert rc == 0, text[-4000:]
    line = next(x for x in text.splitlines() if x.startswith("SHARDS "))
    rows = json.loads(line[len("SHARDS ") :])
    assert set(rows) == set(plan.tensor_parallel)
    for fqn, style in plan.tensor_parallel.items():
        row, dim = rows[fqn], EXPECTED_DIM[style]
        kind, tp_dim = row["placements"][row["mesh"].index("tp")]
        assert (kind, tp_dim) == ("Shard", dim), (fqn, row)
        splits = 1  # every mesh dim that splits this weight dim (tp, and fsdp where it does)
        for (k, d), size in zip(row["placements"], row["sizes"]):
            splits *= size if k in ("Shard", "_StridedShard") and d == dim else 1
        assert splits >= 2 and row["local"][dim] * splits == row["global"][dim], (fqn, row)
