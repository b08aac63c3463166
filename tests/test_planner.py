"""Planner tests, pure and on meta: the TP ILP against brute force, the Megatron pairs it must
rediscover, shardings it must never choose, the mesh search, and the plan JSON contract."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from autopar.cost_model import parse_cluster
from autopar.ir.trace import trace
from autopar.planner import ilp
from autopar.planner.plan import PlanError
from autopar.planner.search import PlanningError, enumerate_meshes, parse_mesh
from torch import nn

from autopar import Plan

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT = Path(__file__).parent / "snapshots" / "plan_schema.json"


# -- small models --------------------------------------------------------------------------------


class Attention(nn.Module):
    """Pre-norm attention with a residual; ``literal_heads`` views with the head count."""

    def __init__(self, dim: int, heads: int, literal_heads: bool = False) -> None:
        super().__init__()
        self.heads, self.literal = heads, literal_heads
        self.ln = nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.ln(x)
        n = self.heads if self.literal else -1
        q, k, v = (
            m(h).view(b, t, n, c // self.heads).transpose(1, 2) for m in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, t, -1))


class FusedQKV(nn.Module):
    """GPT-2 style: one linear makes q, k and v, split along the feature dim."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, -1, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLPBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.ln(x))))


class MLPStack(nn.Module):
    def __init__(self, dim: int, depth: int, out: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(dim) for _ in range(depth))
        self.head = nn.Linear(dim, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _graph(model: nn.Module, batch: int, seq: int, dim: int):
    with torch.device("meta"):
        x = torch.empty(batch, seq, dim)
    return trace(model.train(), (x,))


def _meta(cls, *args) -> nn.Module:
    with torch.device("meta"):
        return cls(*args)


def _inputs(spec: str, tp: int, batch_scale: float, dtype: str = "bf16") -> ilp.CostInputs:
    cluster = parse_cluster(spec)
    return ilp.CostInputs(
        tp=tp,
        batch_scale=batch_scale,
        device=cluster.device,
        dtype=dtype if cluster.device.kind == "gpu" else "fp32",
        tp_link=cluster.intra_node,
        grad_sync_s_per_byte=1e-11,
    )


def _gpt(dim: int, heads: int, layers: int, vocab: int = 1024, max_seq: int = 4096):
    import importlib.util

    spec = importlib.util.spec_from_file_location("autopar_example_gpt", ROOT / "examples/gpt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with torch.device("meta"):
        return mod.GPT(vocab, dim, heads, layers, max_seq)


# -- ILP against brute force ---------------------------------------------------------------------

CASES = [
    # (model factory, input dims, cluster, tp, batch scale): big scales make sharding pay off,
    # cpu:2 makes replication win; both ends must agree with enumeration.
    ("attention", (2, 512, 4096), "8xH100", 2, 8.0),
    ("attention", (2, 512, 4096), "8xH100", 4, 8.0),
    ("attention", (2, 16, 64), "cpu:2", 2, 1.0),
    ("mlp_stack", (2, 256, 4096), "8xH100", 2, 16.0),
    ("mlp_stack", (2, 256, 4096), "8xH100", 8, 16.0),
    ("mlp_stack", (2, 8, 32), "cpu:4", 4, 1.0),
]


def _case_model(name: str, dim: int) -> nn.Module:
    if name == "attention":
        return _meta(Attention, dim, 32 if dim >= 1024 else 8)
    return _meta(MLPStack, dim, 3, 16)


@pytest.mark.parametrize(("name", "dims", "spec", "tp", "scale"), CASES)
def test_ilp_objective_equals_brute_force(name, dims, spec, tp, scale):
    graph = _graph(_case_model(name, dims[2]), *dims)
    inputs = _inputs(spec, tp, scale)
    solution = ilp.solve(graph, inputs)
    best_ns, best_styles = ilp.brute_force(graph, inputs)
    assert solution.objective_ns == best_ns, (solution.styles, best_styles)


def test_a_solution_reused_across_sync_rates_equals_a_fresh_solve():
    """The solver builds an assignment's solution once per cost key and prices it at each
    sync rate (ilp._Picked): at every rate it must equal a fresh solver's answer there, field
    by field, and a wrong sync term (rate ignored) would differ."""
    from dataclasses import replace

    graph = _graph(_case_model("mlp_stack", 4096), 2, 256, 4096)
    base = _inputs("8xH100", 2, 16.0)
    shared = ilp.Solver(graph, 2)
    rates = (0.0, 3e-12, 1e-11, 4e-10, 1e-6)
    answers = {r: shared.solve(replace(base, grad_sync_s_per_byte=r)) for r in rates}
    for r in rates:
        fresh = ilp.Solver(graph, 2).solve(replace(base, grad_sync_s_per_byte=r))
        assert answers[r] == fresh, r
    assert answers[4e-10].sync_s > answers[3e-12].sync_s > 0


def test_brute_force_covers_sharded_optimum():
    """On the big attention case the optimum shards: the comparison above is not trivial."""
    graph = _graph(_meta(Attention, 4096, 32), 2, 512, 4096)
    _, styles = ilp.brute_force(graph, _inputs("8xH100", 2, 8.0))
    assert styles["q"].startswith("colwise") and styles["o"].startswith("rowwise"), styles


@pytest.mark.parametrize(
    ("dims", "heads", "spec", "sharded"),
    [((2, 16, 64), 8, "cpu:2", False), ((2, 512, 4096), 32, "8xH100", True)],
)
def test_projections_reading_one_input_are_column_parallel_all_or_none(dims, heads, spec, sharded):
    """q, k and v read one input: they form one sibling group whose input collective is
    shared by three calls (the emitted program all-reduces its gradient once for the three:
    ``autopar_runtime.tensor_parallel.shared_input``), and the ILP keeps them column-parallel
    together or not at all. Equal projections never gain by mixing; the GQA test
    (``test_gqa_tp.py -k only_where_it_pays``) shows the rule deciding a choice."""
    graph = _graph(_meta(Attention, dims[2], heads), *dims)
    solver = ilp.Solver(graph, 2)
    (group,) = set(solver.siblings.values())  # k is folded onto q (identical layers)
    assert [solver.readers[n] for n in group] == [3, 3]
    styles = solver.solve(_inputs(spec, 2, 1.0)).styles
    colwise = [styles.get(p, "replicate").startswith("colwise") for p in "qkv"]
    assert colwise == [sharded] * 3, styles


# -- Megatron pairs ------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [2, 4])
def test_rediscovers_megatron_pairs_on_gpt(tp):
    model = _gpt(dim=8192, heads=64, layers=2, vocab=32000)
    with torch.device("meta"):
        idx = torch.zeros(2, 2048, dtype=torch.long)
    graph = trace(model.train(), (idx,))
    sol = ilp.solve(graph, _inputs("8xH100", tp, 1.0))
    for i in range(2):
        p = f"blocks.{i}."
        for name in ("attn.q", "attn.k", "attn.v", "mlp.up"):
            assert sol.styles[p + name].startswith("colwise"), (name, sol.styles)
        for name in ("attn.o", "mlp.down"):
            assert sol.styles[p + name].startswith("rowwise"), (name, sol.styles)
    assert graph.layer("blocks.0").signature == graph.layer("blocks.1").signature


def test_literal_head_count_blocks_colwise_attention():
    """A view that names the full head count cannot run on a rank's local heads."""
    graph = _graph(_meta(Attention, 4096, 32, True), 2, 512, 4096)
    sol = ilp.solve(graph, _inputs("8xH100", 2, 8.0))
    for name in ("q", "k", "v"):  # gathering the output back (colwise_gather) stays legal
        assert sol.styles.get(name) not in ("colwise", "colwise_from_seq"), sol.styles
    free = ilp.solve(_graph(_meta(Attention, 4096, 32), 2, 512, 4096), _inputs("8xH100", 2, 8.0))
    assert free.styles["q"].startswith("colwise")  # same costs, legal views: it does shard


def test_fused_qkv_split_is_never_sharded_along_the_split_dim():
    """Colwise on GPT-2's fused c_attn would hand rank 0 the q columns only: illegal."""
    graph = _graph(_meta(FusedQKV, 4096, 32), 2, 512, 4096)
    for tp in (2, 4):
        sol = ilp.solve(graph, _inputs("8xH100", tp, 8.0))
        assert sol.styles.get("c_attn") not in ("colwise", "colwise_from_seq"), sol.styles
        # with c_attn replicated, c_proj may only be rowwise if its input arrives sharded: never
        assert not sol.styles.get("c_proj", "replicate").startswith("rowwise"), sol.styles


# -- search --------------------------------------------------------------------------------------


def test_enumerate_meshes_multiply_to_world_and_respect_pins():
    meshes = enumerate_meshes(16, 8, {}, num_layers=4)
    assert {m.world_size for m in meshes} == {16}
    assert all(m.tp <= 8 and m.pp <= 4 for m in meshes)
    expected = sum(
        1
        for pp in (1, 2, 4)
        for tp in (1, 2, 4, 8)
        if (16 // pp) % tp == 0
        for f in range(1, 17)
        if (16 // pp // tp) % f == 0
    )
    assert len(meshes) == expected == len({m for m in meshes})
    pinned = enumerate_meshes(16, 8, {"tp": 2, "fsdp": 4, "pp": 1})
    assert [(m.dp, m.fsdp, m.tp) for m in pinned] == [(2, 4, 2)]


@pytest.mark.parametrize("text", ["tp2", "tp=0", "xx=2", "tp=2,tp=4", "tp=a"])
def test_parse_mesh_rejects_malformed(text):
    with pytest.raises(PlanningError, match="--mesh"):
        parse_mesh(text)


def _plan_gpt(**kw) -> Plan:
    from autopar.api import plan_model_file
    from autopar.model_file import load_model_file

    mf = load_model_file(str(ROOT / "examples/gpt.py"))
    return plan_model_file(mf, kw.pop("cluster", "cpu:4"), **kw)


def test_search_on_cpu_picks_a_valid_plan_and_explains_the_rest():
    plan = _plan_gpt(global_batch=8, seq_len=64)
    assert plan.mesh.world_size == 4
    assert plan.predicted.step_time_s > 0
    assert plan.predicted.time_breakdown_s.total == pytest.approx(plan.predicted.step_time_s)
    assert plan.predicted.memory_breakdown_bytes.total == plan.predicted.peak_memory_bytes
    assert [f for stage in plan.stages for f in stage] == plan.layers
    assert len(plan.stages) == plan.mesh.pp * plan.schedule.stages_per_rank
    # a TP group that shards nothing only repeats work: it is ranked last, whatever its cost
    fitting = [a for a in plan.alternatives if a.fits and "repeat work" not in a.why]
    assert fitting and all(a.step_time_s >= plan.predicted.step_time_s for a in fitting)
    assert all(a.why for a in plan.alternatives)


def test_indivisible_batch_is_named_as_the_reason():
    # cp=1: context-parallel meshes (cp takes no share of the batch) are legal here and would
    # fill the shown alternatives ahead of the ruled-out dp=4 ones
    plan = _plan_gpt(global_batch=6, seq_len=16, mesh="cp=1")
    reasons = [a.why for a in plan.alternatives if a.mesh.data_parallel == 4]
    assert reasons and all("not divisible by the data-parallel size 4" in r for r in reasons)
    assert plan.mesh.data_parallel in (1, 2)


def test_pinned_tp_that_does_not_divide_heads_is_refused():
    with pytest.raises(PlanningError, match="tp=3 does not divide the 4 attention heads"):
        _plan_gpt(global_batch=8, seq_len=16, mesh={"tp": 3}, cluster="cpu:3")


def test_pinned_mesh_is_honoured():
    plan = _plan_gpt(global_batch=8, seq_len=16, mesh={"fsdp": 2, "tp": 2})
    assert (plan.mesh.dp, plan.mesh.fsdp, plan.mesh.tp) == (1, 2, 2)


# -- the plan JSON -------------------------------------------------------------------------------


def test_plan_json_round_trip_is_exact():
    plan = _plan_gpt(global_batch=8, seq_len=16, mesh={"tp": 2}, cluster="cpu:2")
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.to_json() == plan.to_json()


def test_plan_json_has_the_contract_keys():
    raw = json.loads(_plan_gpt(global_batch=8, seq_len=16).to_json())
    for key in ("version", "mesh", "stages", "schedule", "tensor_parallel", "checkpointing",
                "predicted", "planning_time_s", "alternatives"):  # fmt: skip
        assert key in raw
    assert set(raw["mesh"]) == {"pp", "dp", "fsdp", "cp", "ep", "tp"}
    assert set(raw["predicted"]["memory_breakdown_bytes"]) == {
        "params", "grads", "optimizer", "activations", "buffers"
    }  # fmt: skip
    assert {"compute", "exposed_comm", "bubble", "optimizer"} <= set(
        raw["predicted"]["time_breakdown_s"]
    )


def test_plan_schema_snapshot():
    schema = json.dumps(Plan.model_json_schema(), indent=1, sort_keys=True) + "\n"
    if os.environ.get("UPDATE_SNAPSHOTS"):
        SNAPSHOT.parent.mkdir(exist_ok=True)
        SNAPSHOT.write_text(schema)
    assert SNAPSHOT.read_text() == schema, (
        "the plan JSON schema changed: if on purpose, bump PLAN_VERSION when old plans can no "
        "longer load, update ARCHITECTURE.md, and run UPDATE_SNAPSHOTS=1 pytest "
        "tests/test_planner.py::test_plan_schema_snapshot"
    )


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{", "not valid JSON"),
        ("[]", "'version'"),
        ('{"version": 2}', "version 2 is not supported"),
        ('{"version": 1, "mesh": {}}', "is invalid"),
    ],
)
def test_bad_plan_json_is_refused_in_one_line(text, match):
    with pytest.raises(PlanError, match=match) as info:
        Plan.from_json(text)
    assert "\n" not in str(info.value)


class TiedLM(nn.Module):
    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        return self.head(x + self.down(F.relu(self.up(x))))


def test_tied_weights_stay_replicated():
    """A styled embedding would turn the weight the head also reads into a DTensor."""
    with torch.device("meta"):
        model = TiedLM(32000, 4096)
        idx = torch.zeros(2, 1024, dtype=torch.long)
    sol = ilp.solve(trace(model.train(), (idx,)), _inputs("8xH100", 2, 8.0))
    assert "emb" not in sol.styles and "head" not in sol.styles, sol.styles
    assert sol.styles["up"].startswith("colwise") and sol.styles["down"].startswith("rowwise")


def test_tied_weights_keep_layers_in_one_pipeline_stage():
    """A head tied to the embedding cannot be cut from it: meshes with pp > 1 are ruled out, and
    say why."""
    from autopar.planner.plan import ModelRef, Training
    from autopar.planner.search import search

    with torch.device("meta"):
        model = TiedLM(256, 64)
        idx = torch.zeros(2, 16, dtype=torch.long)
    graph = trace(model.train(), (idx,))
    plan = search(graph, parse_cluster("cpu:2"), Training(global_batch=4, seq_len=16),
                  model=ModelRef(file=str(ROOT / "examples" / "gpt.py")))  # fmt: skip
    assert plan.mesh.pp == 1
    pp = [a for a in plan.alternatives if a.mesh.pp > 1]
    assert pp and all("tied" in a.why for a in pp)


# -- gradient accumulation (pp = 1) ---------------------------------------------------------------


def _gpt1b(monkeypatch, cluster: str, **kw):
    from autopar.api import plan_model_file
    from autopar.model_file import load_model_file

    for k, v in dict(GPT_LAYERS=24, GPT_DIM=2048, GPT_HEADS=16, GPT_VOCAB=50257).items():
        monkeypatch.setenv(k, str(v))
    monkeypatch.setenv("GPT_MAX_SEQ", "2048")
    mf = load_model_file(str(ROOT / "examples" / "gpt.py"))
    return plan_model_file(mf, cluster, global_batch=32, seq_len=2048, **kw)


def test_pp1_plans_accumulate_gradients_when_the_batch_does_not_fit_at_once(monkeypatch):
    """A 1B GPT on 4 A100-40GB with FSDP over all four: 8 sequences of 2048 per rank need
    checkpointing at once (with the loss's logits, cost_model.peak); accumulation steps fit
    without it, and are faster."""
    acc = _gpt1b(monkeypatch, "4xA100-40GB", mesh="fsdp=4")
    once = _gpt1b(monkeypatch, "4xA100-40GB", mesh="fsdp=4", microbatches=1)
    assert acc.schedule.name == "none" and acc.schedule.num_microbatches > 1
    assert acc.predicted.peak_memory_bytes <= acc.cluster.device.memory_bytes
    assert once.schedule.num_microbatches == 1 and "full" in once.checkpointing.values()
    assert "full" not in acc.checkpointing.values()
    assert acc.predicted.step_time_s < once.predicted.step_time_s
    assert once.predicted.time_breakdown_s.recompute > 0 == acc.predicted.time_breakdown_s.recompute
    assert Plan.from_json(acc.to_json()) == acc


def test_microbatches_pins_accumulation_steps_without_a_pipeline():
    from autopar.api import plan_model_file
    from autopar.model_file import load_model_file

    mf = load_model_file(str(ROOT / "examples" / "gpt.py"))
    plans = {
        m: plan_model_file(mf, "cpu:2", global_batch=8, seq_len=64, mesh="dp=2", microbatches=m)
        for m in (1, 2, 4)
    }
    for m, p in plans.items():
        assert (p.mesh.pp, p.schedule.name, p.schedule.num_microbatches) == (1, "none", m)
    # the same work in more, smaller steps: more per-op overhead, less activation memory
    steps = [plans[m].predicted.step_time_s for m in (1, 2, 4)]
    acts = [plans[m].predicted.memory_breakdown_bytes.activations for m in (1, 2, 4)]
    assert steps == sorted(steps) and acts == sorted(acts, reverse=True)
    with pytest.raises(PlanningError, match="does not divide the per-replica batch 4"):
        plan_model_file(mf, "cpu:2", global_batch=8, seq_len=64, mesh="dp=2", microbatches=3)


def test_every_tp_collective_pays_the_profiled_overhead():
    """``DeviceSpec.tp_collective_overhead_s`` (DTensor's redistribution and the functional
    collective's wrappers, which ``plan profile`` measures as TP over every rank against a
    one-rank mesh) is charged once per TP collective the styles imply, forward and backward."""
    graph = _graph(_meta(MLPStack, 64, 3, 10), 4, 16, 64)
    base = ilp.CostInputs(**{**_inputs("cpu:2", 2, 1.0).__dict__, "shard_all": True})
    extra = 2e-3
    dev = base.device.model_copy(update={"tp_collective_overhead_s": extra})
    without = ilp.solve(graph, base)
    with_it = ilp.solve(graph, ilp.CostInputs(**{**base.__dict__, "device": dev}))
    assert with_it.styles == without.styles
    per_style = {"colwise": 1, "rowwise": 1, "colwise_gather": 2}  # collectives per call
    assert set(with_it.styles.values()) <= set(per_style), with_it.styles
    calls = sum(per_style[s] for s in with_it.styles.values())
    assert calls >= 6  # up colwise, down rowwise in each of the 3 blocks
    assert with_it.comm_s - without.comm_s == pytest.approx(calls * extra)
    assert with_it.compute_s == pytest.approx(without.compute_s)


def test_context_and_expert_parallel_collectives_pay_the_profiled_overhead():
    """A step waits on context parallel's key/value collectives and expert parallel's
    all-to-alls as on TP's: each pays ``DeviceSpec.tp_collective_overhead_s`` once
    (``cost_model.estimate.blocking_collective_s``). The GPT's 4 attention layers make 8 under
    cp=2 (an all-gather forward, a reduce-scatter backward); the MoE's 2 blocks 12 under ep=2
    (routing counts and expert ids, dispatch and combine forward, both again backward)."""
    from autopar.api import plan_model_file
    from autopar.model_file import load_model_file

    extra = 3e-3
    base = parse_cluster("cpu:2")
    slow = base.model_copy(
        update={"device": base.device.model_copy(update={"tp_collective_overhead_s": extra})}
    )
    cases = [("examples/gpt.py", {"cp": 2}, "cp_comm", 8), ("tests/models/moe.py", {"ep": 2},
             "ep_comm", 12)]  # fmt: skip
    for path, mesh, term, calls in cases:
        mf = load_model_file(str(ROOT / path))
        plans = [
            plan_model_file(mf, c, global_batch=8, seq_len=64, mesh=dict(mesh), checkpoint="none")
            for c in (base, slow)
        ]
        before, after = (getattr(p.predicted.time_breakdown_s, term) for p in plans)
        assert before > 0
        assert after - before == pytest.approx(calls * extra, rel=1e-6), (path, before, after)
