"""Mixture of experts: the router, the experts, dispatch/combine and the aux loss in the IR.

A hand-written top-2 MoE (tests/models/moe_top2.py: a ModuleList of expert MLPs, each run on
the tokens ``torch.where`` routes to it, a Switch-style load-balancing loss) and tiny HF Mixtral
and Qwen3-MoE configs (grouped expert weights, written here as config files, never downloaded)
are traced on meta; the same code finds the blocks in both.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
from autopar.ir.trace import TraceError, trace

from autopar.model_file import build_on_meta, example_inputs, load_model_file

ROOT = Path(__file__).resolve().parent.parent
MOE_TOP2 = str(ROOT / "tests" / "models" / "moe_top2.py")
MOE_STACKED = str(ROOT / "tests" / "models" / "moe_stacked.py")  # experts stacked in one module
SEQ = 16

TINY_MIXTRAL = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}
TINY_QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "norm_topk_prob": True,
}


def hf_config(tmp: Path, config: dict, **changes) -> str:
    """An ``hf:`` spec of ``config`` written to ``tmp`` (no download)."""
    path = tmp / f"{config['model_type']}.json"
    path.write_text(json.dumps({**config, **changes}))
    return f"hf:{path}"


def _trace(spec: str, batch: int = 2):
    mf = load_model_file(spec)
    model = build_on_meta(mf)
    args, _ = example_inputs(mf, model, batch, SEQ)
    with warnings.catch_warnings():  # saved bytes of data-dependent sizes: the estimate
        warnings.simplefilter("ignore")
        return trace(model, args, seq_len=SEQ)


@pytest.fixture(scope="module")
def top2_graph():
    return _trace(MOE_TOP2, batch=2)


def test_hand_written_top2_moe(top2_graph) -> None:
    """ModuleList experts, token-choice top-2 with torch.where: both blocks found, per-expert
    sizes at balanced routing (tokens * k / E rows per expert), the aux loss seen."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("moe_top2", MOE_TOP2)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    g = top2_graph
    assert [m.fqn for m in g.moes] == ["blocks.0.moe", "blocks.1.moe"]
    moe = g.moes[0]
    assert (moe.num_experts, moe.top_k, moe.grouped) == (mod.EXPERTS, mod.TOP_K, False)
    assert moe.router == "blocks.0.moe.gate" and moe.layer == "blocks.0"
    assert moe.experts == tuple(f"blocks.0.moe.experts.{i}" for i in range(mod.EXPERTS))
    tokens = 2 * SEQ
    assert moe.tokens == tokens and moe.hidden == mod.DIM
    per_expert = (mod.DIM + 1) * mod.HIDDEN + (mod.HIDDEN + 1) * mod.DIM
    assert moe.expert_param_numel == mod.EXPERTS * per_expert
    assert moe.expert_param_bytes == 4 * moe.expert_param_numel
    assert moe.aux_loss
    share = tokens * mod.TOP_K // mod.EXPERTS
    w1 = [g.node(n) for n in g.layer("blocks.0").nodes if g.node(n).module_fqn.endswith("w1")]
    assert len(w1) == mod.EXPERTS and all(n.out.shape == (share, mod.HIDDEN) for n in w1)
    matmuls = mod.EXPERTS * 2 * share * 2 * mod.DIM * mod.HIDDEN
    assert matmuls <= moe.expert_fwd_flops < 1.1 * matmuls
    assert g.moes_in("blocks.1") == (g.moes[1],) and g.moes_in("head") == ()


@pytest.mark.parametrize(
    ("config", "experts", "inter", "aux"),
    [
        (TINY_MIXTRAL, "num_local_experts", "intermediate_size", True),
        pytest.param(
            TINY_QWEN3_MOE, "num_experts", "moe_intermediate_size", False, marks=pytest.mark.slow
        ),
    ],
    ids=["mixtral", "qwen3-moe"],
)
def test_hf_grouped_experts(
    tmp_path: Path, config: dict, experts: str, inter: str, aux: bool
) -> None:
    """HF's stacked expert weights (gate_up_proj, down_proj: first dim = experts), grouped_mm
    counted as matmuls; the aux loss seen only when the config outputs router logits."""
    pytest.importorskip("transformers")
    g = _trace(hf_config(tmp_path, config, output_router_logits=aux))
    num, h, i = config[experts], config["hidden_size"], config[inter]
    assert [m.fqn for m in g.moes] == [f"model.layers.{n}.mlp" for n in range(2)]
    moe = g.moes[0]
    assert (moe.num_experts, moe.top_k, moe.grouped) == (num, config["num_experts_per_tok"], True)
    assert moe.router == "model.layers.0.mlp.gate"
    assert moe.experts == ("model.layers.0.mlp.experts",)
    assert sorted(moe.expert_params) == [
        "model.layers.0.mlp.experts.down_proj",
        "model.layers.0.mlp.experts.gate_up_proj",
    ]
    assert moe.expert_param_numel == num * 3 * h * i and moe.hidden == h
    assert moe.tokens == 2 * SEQ and all(m.aux_loss == aux for m in g.moes)
    matmuls = 2 * moe.tokens * moe.top_k * 3 * h * i
    assert matmuls <= moe.expert_fwd_flops < 1.1 * matmuls


def test_dense_model_has_no_experts() -> None:
    g = _trace(str(ROOT / "examples" / "gpt.py"))
    assert g.moes == () and g.expert_param_numel == 0


def test_data_dependent_size_without_routing_is_refused(tmp_path: Path) -> None:
    """Balanced routing is assumed only for sizes that follow a topk."""
    model = tmp_path / "nz.py"
    model.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.lin = torch.nn.Linear(8, 8)\n"
        "    def forward(self, x):\n"
        "        return self.lin(x[x[:, 0] > 0])\n"
        "def build_model(): return M()\n"
        "def make_batch(b, t=None): return (torch.randn(b, 8),), torch.randn(b, 8)\n"
    )
    with pytest.raises(TraceError, match="data-dependent"):
        _trace(str(model))


# -- the ep axis: planned with the rest (no process group) -------------------------------------


def _search(graph, cluster="cpu:2", pins: dict | None = None, batch: int = 4, model=MOE_TOP2):
    from autopar.cost_model import parse_cluster
    from autopar.planner.plan import ModelRef, Training
    from autopar.planner.search import search

    return search(
        graph,
        parse_cluster(cluster),
        Training(global_batch=batch, seq_len=SEQ, optimizer="sgd"),
        model=ModelRef(file=model),
        pins=pins,
    )


def test_ep_meshes_divide_experts_and_data_ranks() -> None:
    from autopar.planner.search import enumerate_meshes

    meshes = enumerate_meshes(8, 8, {}, 4, experts=4)
    eps = {(m.dp * m.fsdp, m.tp, m.ep) for m in meshes}
    assert all(m.data_parallel % m.ep == 0 and 4 % m.ep == 0 for m in meshes)
    assert all(m.ep == 1 for m in meshes if m.tp > 1)  # experts are not TP-sharded under ep
    assert {(8, 1, 1), (8, 1, 2), (8, 1, 4), (4, 1, 4), (2, 1, 2)} <= eps
    assert all(m.world_size == 8 for m in meshes)  # ep is carved out, not a factor
    assert {m.ep for m in enumerate_meshes(8, 8, {}, 4, experts=0)} == {1}
    assert {m.ep for m in enumerate_meshes(8, 8, {"ep": 2}, 4, experts=4)} == {2}


def test_cost_terms() -> None:
    from autopar.cost_model import experts as ec
    from autopar.cost_model import parse_cluster

    assert ec.ep_split(8, 2, 4) == (2, 4) and ec.ep_split(4, 4, 1) == (4, 1)
    assert ec.all_to_all_bytes(100, 2, 64, 2) == 100 * 2 * 64 * 2 * ec.IMBALANCE
    c = parse_cluster("4x8xH100")
    assert ec.ep_link(c, 8, 1, 8, 1) == c.intra_node  # one node's fsdp ranks
    assert ec.ep_link(c, 16, 1, 32, 1) == c.inter_node
    link = c.intra_node
    one = ec.all_to_all_s(link, 8, 1e9)
    assert one == pytest.approx(7 * link.latency_s + 7 / 8 * 1e9 / link.bandwidth_bytes_per_s)
    blocks = [(100.0, 2, 64, ec.IMBALANCE)] * 3
    routing = ec.all_to_all_s(link, 8, 8 * 8) + ec.all_to_all_s(link, 8, 100 * 2 * 8 * ec.IMBALANCE)
    assert ec.block_all_to_all_s(link, 8, blocks, 2) == pytest.approx(
        3 * (4 * ec.all_to_all_s(link, 8, ec.all_to_all_bytes(100, 2, 64, 2)) + routing)
    )
    # six calls per block, each paying what a blocking collective costs around it in a step
    waited = c.device.model_copy(update={"tp_collective_overhead_s": 1e-3})
    assert ec.block_all_to_all_s(link, 8, blocks, 2, waited) == pytest.approx(
        ec.block_all_to_all_s(link, 8, blocks, 2) + 3 * 6 * 1e-3
    )
    assert ec.block_all_to_all_s(link, 1, blocks, 2, waited) == 0.0


def test_dense_dispatch_sends_every_token_to_every_expert() -> None:
    """tests/models/moe.py runs each expert on every token: the IR reads E rows per token from
    the experts' inputs (the routed fixture reads top_k), so its all-to-alls move E / top_k = 2x
    the routed volume, and no rank gets more rows than another (no imbalance charged)."""
    from autopar.cost_model import experts as ec

    dense = _trace(str(ROOT / "tests" / "models" / "moe.py"))
    routed = _trace(str(ROOT / "tests" / "models" / "moe_chained.py"))
    for m in dense.moes:
        assert m.rows == m.tokens * m.num_experts and m.fanout == m.num_experts == 4
        assert m.dense and ec.imbalance(m.dense) == 1.0
    for m in routed.moes:
        assert m.rows == m.tokens * m.top_k and m.fanout == m.top_k == 2
        assert not m.dense and ec.imbalance(m.dense) == ec.IMBALANCE
    one = ec.all_to_all_bytes(100, dense.moes[0].fanout, 64, 2, ec.imbalance(True))
    assert one == 2 * 100 * 2 * 64 * 2  # twice the top-2 volume, at the mean load


def test_pinned_ep_plans_and_explains() -> None:
    """ep=2 on the hand-written MoE with stacked experts: experts split, all-to-all charged,
    expert memory halved (ep carved from dp), recorded in the plan JSON; --why-not ep=2 against
    the free plan."""
    from autopar.planner.explain import explain, why_not
    from autopar.planner.plan import Plan

    graph = _trace(MOE_STACKED, batch=2)
    free = _search(graph, model=MOE_STACKED)
    forced = _search(graph, pins={"ep": 2}, model=MOE_STACKED)
    assert forced.mesh.ep == 2 and forced.mesh.dp * forced.mesh.fsdp == 2
    ep = forced.expert_parallel
    assert ep is not None and ep.num_experts == 4 and ep.top_k == 2 and ep.grouped
    assert ep.blocks == {f"blocks.{i}.moe": [f"blocks.{i}.moe.experts"] for i in range(2)}
    assert ep.routers["blocks.0.moe"] == "blocks.0.moe.gate"
    assert ep.all_to_all_s > 0 and forced.predicted.time_breakdown_s.ep_comm > 0
    if forced.mesh.dp == 2:  # carved from the replicate axis: each rank holds half the experts
        assert ep.expert_bytes_per_rank * 2 == pytest.approx(ep.expert_bytes_at_ep1, abs=2)
    raw = json.loads(forced.to_json())
    assert raw["mesh"]["ep"] == 2 and raw["expert_parallel"]["num_experts"] == 4
    assert Plan.from_json(forced.to_json()) == forced
    assert "expert_parallel" not in json.loads(free.to_json()) or free.mesh.ep > 1
    text = explain(forced).text
    assert "expert parallel: ep=2 over 2 MoE blocks" in text and "all-to-all / step" in text
    assert "ep_comm" in text
    if free.mesh.ep == 1:
        w = why_not(free, "ep=2", forced)
        assert "time: ep_comm" in w.text and w.forced is not None
        assert any(a.mesh.ep == 2 for a in free.alternatives)
    assert "expert parallel" in forced.summary()


@pytest.mark.parametrize(
    ("pins", "match"),
    [({"ep": 3}, "ep=3 does not divide the 4 experts"), ({"ep": 2, "tp": 2}, "tp=2")],
)
def test_bad_ep_pins_are_one_line(top2_graph, pins, match) -> None:
    from autopar.planner.search import PlanningError

    with pytest.raises(PlanningError, match=match) as e:
        _search(top2_graph, cluster="cpu:4" if "tp" in pins else "cpu:6", pins=pins, batch=12)
    assert "\n" not in str(e.value)


def test_ep_on_a_dense_model_is_refused() -> None:
    from autopar.cost_model import parse_cluster
    from autopar.planner.plan import ModelRef, Training
    from autopar.planner.search import PlanningError, search

    g = _trace(str(ROOT / "examples" / "gpt.py"))
    with pytest.raises(PlanningError, match="no mixture-of-experts blocks"):
        search(g, parse_cluster("cpu:2"), Training(global_batch=4, seq_len=SEQ),
               model=ModelRef(file="gpt.py"), pins={"ep": 2})  # fmt: skip


def test_ep_on_module_list_experts_plans(top2_graph) -> None:
    """Experts in an nn.ModuleList (called from the user's own dispatch loop) plan at ep=2: the
    emitted program records the block's calls to them and dispatches the rows by all-to-all
    (tests/test_ep_listed.py runs it; a chained list is refused there)."""
    plan = _search(top2_graph, pins={"ep": 2})
    assert plan.mesh.ep == 2 and not plan.expert_parallel.grouped
    assert plan.expert_parallel.blocks["blocks.0.moe"] == [
        f"blocks.0.moe.experts.{i}" for i in range(4)
    ]


@pytest.mark.slow
def test_mixtral_8x22b_plans_ep_on_256_h100() -> None:
    """The README's target: Mixtral-8x22B-shaped (56 layers, 8 experts, top-2, examples/hf)
    on 32x8xH100 plans in seconds with an ep > 1 plan that fits. ep is pinned; the search may
    add pipeline stages (ep_rule: a stage's layers stay modules, so their experts split
    alike)."""
    import time

    pytest.importorskip("transformers")
    from autopar.api import plan_model_file

    start = time.perf_counter()
    plan = plan_model_file(
        load_model_file("hf:" + str(ROOT / "examples" / "hf" / "mixtral-8x22b.json")),
        "32x8xH100",
        global_batch=256,
        seq_len=4096,
        dtype="bf16",
        mesh="ep=8",
    )
    took = time.perf_counter() - start
    assert plan.mesh.ep == 8 and plan.expert_parallel is not None
    assert plan.predicted.peak_memory_bytes <= plan.cluster.device.memory_bytes
    assert plan.predicted.time_breakdown_s.ep_comm > 0
    assert took < 120, took


@pytest.mark.slow
def test_deepseek_v3_plans_ep_on_256_h100() -> None:
    """DeepSeek-V3-shaped (61 layers: 3 dense, 58 MoE with 256 routed experts, top-8 in 4 of 8
    groups, a shared expert, MLA attention; examples/hf) on 32x8xH100: an ep > 1 plan that
    fits, its 58 MoE blocks found, the MoE layers traced once (folded)."""
    pytest.importorskip("transformers")
    from autopar.api import plan_model_file

    plan = plan_model_file(
        load_model_file("hf:" + str(ROOT / "examples" / "hf" / "deepseek-v3.json")),
        "32x8xH100",
        global_batch=256,
        seq_len=4096,
        dtype="bf16",
    )
    ep = plan.expert_parallel
    assert plan.mesh.ep > 1 and ep is not None and len(ep.blocks) == 58
    assert (ep.num_experts, ep.top_k, ep.grouped) == (256, 8, True)
    assert plan.predicted.peak_memory_bytes <= plan.cluster.device.memory_bytes
    assert plan.planning_time_s < 300, plan.planning_time_s


TINY_DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 16,
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "qk_nope_head_dim": 16,
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 4,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 64,
}


def test_deepseek_layers_fold_after_the_dense_ones(tmp_path: Path) -> None:
    """DeepSeek-V3's dense first layers, then a run of MoE layers: the run folds (traced as
    two), the layers before it are traced as they are."""
    pytest.importorskip("transformers")
    from autopar.ir._fold import find_folds

    model = build_on_meta(load_model_file(hf_config(tmp_path, TINY_DEEPSEEK_V3)))
    assert [(f.fqn, f.start, f.count) for f in find_folds(model)] == [("model.layers", 1, 5)]


@pytest.mark.slow
def test_deepseek_folded_trace_equals_whole(tmp_path: Path) -> None:
    """The folded trace of a dense-then-MoE stack is the whole trace up to names (group-limited
    top-k routing, shared experts, MLA attention); its MoE blocks are the 4 MoE layers."""
    pytest.importorskip("transformers")
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    from test_fold import assert_same_graph

    mf = load_model_file(hf_config(tmp_path, TINY_DEEPSEEK_V3))
    model = build_on_meta(mf)
    args, _ = example_inputs(mf, model, 2, SEQ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        folded = trace(model, tuple(args), seq_len=SEQ)
        whole = trace(model, tuple(args), seq_len=SEQ, fold=False)
    assert sum("__" in n.name for n in folded.nodes) > 0  # the fold really ran
    assert_same_graph(folded, whole)
    assert [m.fqn for m in folded.moes] == [f"model.layers.{i}.mlp" for i in range(1, 5)]
    moe = folded.moes[0]
    assert (moe.num_experts, moe.top_k, moe.grouped, moe.hidden) == (16, 4, True, 64)


_A2A_PROBE = """
import datetime, sys, torch, torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
r, w = dist.get_rank(), dist.get_world_size()
send = [r + 1 + j for j in range(w)]  # uneven: rank r sends r + 1 + j rows to rank j
recv = [j + 1 + r for j in range(w)]
x = torch.arange(sum(send) * 3, dtype=torch.float32).view(-1, 3) + 100 * r
out = torch.empty(sum(recv), 3)
dist.all_to_all_single(out, x, recv, send)
starts = [sum(recv[:j]) for j in range(w)]  # rows from rank j start at starts[j]
first = [out[s, 0].item() for s in starts]
xg = x.clone().requires_grad_()
y = all_to_all_single(torch.empty(sum(recv), 3), xg, recv, send)  # autograd: grads come back
(y * (r + 1)).sum().backward()
grads = [xg.grad[sum(send[:j]), 0].item() for j in range(w)]
# one write per line (print writes the text and its newline apart: two ranks' lines interleave)
sys.stdout.write(f"rank {r} first={first} grads={grads}\\n")
sys.stdout.flush()
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.dist
def test_gloo_all_to_all_single_on_cpu(tmp_path: Path) -> None:
    """The fact expert parallelism's runtime builds on: gloo runs all_to_all_single on CPU with
    uneven splits, and torch.distributed.nn's all_to_all_single carries gradients back (rows
    sent to rank j get rank j's gradient)."""
    import subprocess
    import sys

    script = tmp_path / "a2a.py"
    script.write_text(_A2A_PROBE)
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    lines = sorted(re.findall(r"rank \d first=\[[^\]]*\] grads=\[[^\]]*\]", run.stdout))
    # rank r gets rank j's rows from row sum(send_j[:r]) on: value 3 * that + 100 j; the
    # gradient of the rows a rank sent to rank j is j + 1
    assert lines == [
        "rank 0 first=[0.0, 100.0] grads=[1.0, 2.0]",
        "rank 1 first=[3.0, 106.0] grads=[1.0, 2.0]",
    ], run.stdout


def test_pipeline_cut_check_runs_grouped_experts_at_the_compute_dtype(tmp_path: Path) -> None:
    """HF Mixtral's experts call grouped_mm, which exists in bf16 only: the plan-time pipeline
    cut check (autopar._cuts) must run the stages at the dtype the planner traced at (it ran
    them in fp32 and crashed planning Mixtral-8x22B on 32x8xH100)."""
    pytest.importorskip("transformers")
    from autopar.api import plan_model_file

    plan = plan_model_file(
        load_model_file(hf_config(tmp_path, TINY_MIXTRAL)),
        "8xH100",
        global_batch=8,
        seq_len=SEQ,
        dtype="bf16",
        mesh="pp=2",
    )
    assert plan.mesh.pp == 2 and len(plan.stages) >= 2


def test_listed_experts_pay_the_record_pass(monkeypatch) -> None:
    """Under ep the runtime runs a module-list MoE block's forward twice (record, then replay
    after the dispatch): the plan charges the block's own nodes outside the experts (router,
    top-k, the weights, the combine) one more forward each, per microbatch; experts stacked in
    one module (grouped) run once and pay nothing more."""
    from autopar.cost_model import parse_cluster
    from autopar.planner import experts as planner_experts

    from autopar.api import plan_model_file

    mf = load_model_file("tests/models/moe.py")
    cluster = parse_cluster("cpu:2")
    pins = dict(global_batch=8, seq_len=64, mesh={"ep": 2}, checkpoint="none")
    charged = []
    real = planner_experts.record_pass_s

    def spy(ctx, layer, moe, scale):
        charged.append((moe.fqn, moe.grouped, real(ctx, layer, moe, scale)))
        return charged[-1][2]

    monkeypatch.setattr(planner_experts, "record_pass_s", spy)
    plan = plan_model_file(mf, cluster, **pins)
    assert {f for f, _, _ in charged} == {"blocks.0.moe", "blocks.1.moe"}
    assert not any(grouped for _, grouped, _ in charged)
    # at least one launched op per node outside the experts: the router, top-k, softmax,
    # zeros, scatter, zeros, and per expert a slice, a multiply and an add (4 experts)
    assert all(t >= 18 * cluster.device.op_overhead_s for _, _, t in charged)
    monkeypatch.setattr(planner_experts, "record_pass_s", lambda ctx, layer, moe, scale: 0.0)
    without = plan_model_file(mf, cluster, **pins)
    assert plan.mesh == without.mesh and plan.schedule == without.schedule
    per_step = sum(t for _, _, t in charged[-2:]) * plan.schedule.num_microbatches
    got = plan.predicted.step_time_s - without.predicted.step_time_s
    assert got == pytest.approx(per_step, rel=1e-6)
