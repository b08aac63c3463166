"""Model families people bring (issue 15, item 6; encoder-decoders are tests/test_seq2seq).

- Gemma 2 and BLOOM have no SDPA attention in transformers (Gemma 2 soft-caps its logits, BLOOM
  adds ALiBi): they build with eager attention, in the planner and in the script alike, and
  plan; an error from transformers is cut at a word, never inside a URL.
- ``torch.min(a, b)`` / ``torch.max(a, b)`` of two tensors (T5's relative position buckets) are
  elementwise layout rules (tests/models/min_max.py): attention and MLP still get Megatron pairs.
- Mixture-of-experts models (tiny Mixtral and Qwen3-MoE configs, a hand-written top-2 MoE in
  tests/models/moe.py) under fsdp=2: --verify passes and every expert parameter is a DTensor
  sharded on its first dim; under tp=2: --verify passes and q/k/v/o are DTensors sharded on
  the tp dim. Those runs (torchrun) are the slow tier; planning is the default tier.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _plans import BIN, ROOT, run_bounded
from autopar.planner.search import PlanningError
from test_codegen_dist import TIMEOUT_S, VERIFY_OK

from autopar.api import plan_model_file
from autopar.model_file import load_model_file

pytest.importorskip("transformers", reason="hf: models need the optional extra 'hf'")

from autopar.hf import _reason  # noqa: E402

MODELS = ROOT / "tests" / "models"
SEQ = 16
TINY = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "tie_word_embeddings": False}
CONFIGS = {
    "gemma2": {
        **TINY, "model_type": "gemma2", "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 8,
    },
    "bloom": {"model_type": "bloom", "vocab_size": 256, "hidden_size": 64, "n_layer": 2, "n_head": 4},
    "mixtral": {
        **TINY, "model_type": "mixtral", "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
    },
    "qwen3_moe": {
        **TINY, "model_type": "qwen3_moe", "intermediate_size": 128, "moe_intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
        "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
    },
    # fused projections: gate_up_proj split into gate and up (chunk); qkv_proj sliced unequally
    # GPT-NeoX-style parallel block: one LayerNorm feeds attention and the MLP side by side
    "phi": {
        **TINY, "model_type": "phi", "intermediate_size": 128, "num_attention_heads": 4,
    },
    # multi-query attention: 4 query heads, one kv head
    "falcon": {
        **TINY, "model_type": "falcon", "num_attention_heads": 4, "multi_query": True,
        "new_decoder_architecture": False, "parallel_attn": True, "bias": False, "alibi": False,
    },
    "phi3": {
        **TINY, "model_type": "phi3", "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    },
}  # fmt: skip


def _spec(name: str, tmp_path: Path) -> str:
    if name.endswith(".py"):
        return str(MODELS / name)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(CONFIGS[name]))
    return f"hf:{path}"


def _plan(spec: str, mesh: str):
    return plan_model_file(
        load_model_file(spec), "cpu:2", global_batch=4, seq_len=SEQ, mesh=mesh, optimizer="sgd"
    )


def test_an_error_from_transformers_is_cut_at_a_word() -> None:
    url = "https://github.com/huggingface/transformers/issues/new"
    long = ValueError("Gemma2ForCausalLM does not support it yet. " * 5 + f"Ask: {url}\nmore")
    text = _reason(long)
    assert len(text) <= 204 and text.endswith(" ...") and "https://github.com/hugg" not in text
    assert _reason(ValueError(f"no sdpa: {url}\nmore")) == f"no sdpa: {url}"


@pytest.mark.parametrize(
    ("name", "projections"),
    [
        (
            "gemma2",
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
        ),
        ("bloom", ("self_attention.query_key_value", "self_attention.dense")),
    ],
)
def test_gemma2_and_bloom_plan_with_eager_attention(name, projections, tmp_path: Path) -> None:
    """Their refusal used to blame a missing Auto class: the cause was the forced SDPA."""
    plan = _plan(_spec(name, tmp_path), "tp=2")
    prefix = "model.layers.0." if name == "gemma2" else "transformer.h.0."
    assert all(plan.tensor_parallel.get(prefix + p) for p in projections), plan.tensor_parallel


def test_elementwise_min_and_max_of_two_tensors_shard() -> None:
    plan = _plan(str(MODELS / "min_max.py"), "tp=2")
    styles = plan.tensor_parallel
    for i in range(2):
        block = f"blocks.{i}."
        assert [styles[block + f"attn.{p}"] for p in "qkvo"] == ["colwise"] * 3 + ["rowwise"]
        assert [styles[block + p] for p in ("up", "gate", "down")] == [
            "colwise", "colwise", "rowwise",
        ], styles  # fmt: skip


def test_phi3_fused_gate_up_pairs_on_dtensors(tmp_path: Path) -> None:
    """Phi-3's MLP computes gate and up in one linear and chunks its output: the fused linear
    holds each rank's slice of gate and of up (colwise_fused2_dtensor), down_proj rowwise. Its
    attention slices a fused q/k/v unequally (grouped-query): whole heads gathered."""
    plan = _plan(_spec("phi3", tmp_path), "tp=2")
    styles = plan.tensor_parallel
    for i in range(2):
        p = f"model.layers.{i}."
        assert styles[p + "mlp.gate_up_proj"] == "colwise_fused2_dtensor", styles
        assert styles[p + "mlp.down_proj"] == "rowwise", styles
        assert styles[p + "self_attn.qkv_proj"] == "colwise_gather", styles


SEQUENCE_STYLES = ("sequence_scatter", "sequence_parallel_gather", "sequence_parallel_local")


def _phi_sp_plan(tmp_path: Path):
    """Phi at a pinned tp=2 on cpu:2, with the styles the same ILP picks for its graph on H100
    costs at a large batch: sequence parallelism around the shared norm."""
    from autopar.planner import ilp
    from test_sequence_parallel import _h100

    from autopar import Plan
    from autopar.api import _trace_plan_model

    plan = _plan(_spec("phi", tmp_path), "tp=2")
    styles = ilp.solve(_trace_plan_model(plan, None), _h100(2, 4096.0, shard_all=True)).styles
    return Plan.from_json(plan.model_copy(update={"tensor_parallel": styles}).to_json())


def test_phi_shared_norm_plans_one_collective_on_cpu_and_sequence_parallel_on_gpus(
    tmp_path: Path,
) -> None:
    """HF Phi's parallel block (one LayerNorm feeding attention and MLP) at a pinned tp=2: on
    cpu:2 Megatron pairs, the norm's output read by q, k, v and fc1 (colwise) through one
    replicated DTensor, its gradient one all-reduce for the four; on H100 costs at a large
    batch the ILP picks sequence parallelism around the shared norm (issue 28, item 10)."""
    plan = _plan(_spec("phi", tmp_path), "tp=2")
    styles = plan.tensor_parallel
    for i in range(2):
        p = f"model.layers.{i}."
        assert [styles[p + f"self_attn.{x}_proj"] for x in "qkv"] == ["colwise"] * 3, styles
        assert (styles[p + "mlp.fc1"], styles[p + "mlp.fc2"]) == ("colwise", "rowwise"), styles
        assert styles[p + "self_attn.dense"] == "rowwise", styles
    styles = _phi_sp_plan(tmp_path).tensor_parallel
    assert all(s in styles.values() for s in SEQUENCE_STYLES), styles
    for i in range(2):
        p = f"model.layers.{i}."
        assert styles[p + "input_layernorm"] == "sequence_parallel_gather", styles
        assert styles[p + "mlp.fc2"] == "rowwise_to_seq", styles


@pytest.mark.slow
@pytest.mark.dist
def test_phi_sequence_parallel_verifies(tmp_path: Path) -> None:
    """The sequence-parallel plan above emitted for cpu:2 and run: --verify matches one process,
    and the norms' weights are replicated DTensors while the projections are sharded."""
    plan = _phi_sp_plan(tmp_path)
    assert plan.tensor_parallel["model.layers.0.input_layernorm"] == "sequence_parallel_gather"
    params = _verified_params(plan, tmp_path)
    row = params["model.layers.0.self_attn.q_proj.weight"]
    assert row["placements"] == [["Shard", 0]] and row["local"][0] * 2 == row["global"][0], row


@pytest.mark.dist
def test_gpt2_conv1d_mlp_pairs_and_verifies_under_tp(tmp_path: Path) -> None:
    """HF GPT-2's MLP (Conv1D c_fc, c_proj) at a pinned tp=2: c_fc colwise (weight stored (in,
    out): Shard(1)), c_proj rowwise (Shard(0)); --verify matches one process."""
    plan = _plan("hf:tiny-gpt2", "tp=2")
    params = _verified_params(plan, tmp_path)
    for i in range(2):
        p = f"transformer.h.{i}.mlp."
        assert plan.tensor_parallel[p + "c_fc"] == "colwise", plan.tensor_parallel
        assert plan.tensor_parallel[p + "c_proj"] == "rowwise", plan.tensor_parallel
        for name, dim in (("c_fc", 1), ("c_proj", 0)):
            row = params[p + name + ".weight"]
            assert row["placements"] == [["Shard", dim]], (name, row)
            assert row["local"][dim] * 2 == row["global"][dim], (name, row)


def test_a_pinned_pipeline_of_a_tied_gemma2_is_one_line(tmp_path: Path) -> None:
    config = {**CONFIGS["gemma2"], "tie_word_embeddings": True}
    path = tmp_path / "tied.json"
    path.write_text(json.dumps(config))
    with pytest.raises(PlanningError) as info:
        _plan(f"hf:{path}", "pp=2")
    assert "\n" not in str(info.value) and "tied" in str(info.value)


# -- the emitted programs (slow tier) -----------------------------------------------------------

SHOW_PARAMS = """
import json, os, sys
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from autopar import Plan
from autopar.model_file import load_model_file

plan = Plan.load(sys.argv[1])
ref = plan.model
mf = load_model_file(ref.file if ref.file.startswith("hf:") else f"{ref.file}:{ref.factory}")
torch.manual_seed(0)
model = plan.apply(mf.build())
rows = {}
for name, p in getattr(model, "module", model).named_parameters():
    rows[name] = None if not isinstance(p, DTensor) else {
        "placements": [[type(pl).__name__, getattr(pl, "dim", None)] for pl in p.placements],
        "mesh": list(p.device_mesh.mesh_dim_names),
        "global": list(p.shape),
        "local": list(p.to_local().shape),
    }
if dist.get_rank() == 0:
    print("PARAMS " + json.dumps(rows), flush=True)
dist.barrier()
dist.destroy_process_group()
os._exit(0)  # as the runtime's finish(): gloo's threads can abort a clean interpreter exit
"""

EXPERTS = {
    "mixtral": ("mlp.experts.",),
    "qwen3_moe": ("mlp.experts.",),
    "moe.py": ("moe.experts.",),
}
ATTENTION = {
    "mixtral": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
    "qwen3_moe": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
    "moe.py": ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj"),
}


def _verified_params(plan, tmp_path: Path) -> dict:
    """Run the emitted script with --verify (SGD, 2 steps), then apply the plan in process and
    return every parameter's placements."""
    out = plan.emit(tmp_path / "out")
    rc, text = run_bounded(
        ["bash", "launch.sh", "--steps", "2", "--optimizer", "sgd", "--verify"],
        out,
        TIMEOUT_S,
        DIST_TIMEOUT_S="120",
    )
    assert rc == 0, text[-4000:]
    m = VERIFY_OK.search(text)
    assert m and float(m.group(1)) <= 1e-5 and float(m.group(2)) <= 1e-5, text[-3000:]
    script = tmp_path / "show_params.py"
    script.write_text(SHOW_PARAMS)
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"]
    rc, text = run_bounded(
        [*torchrun, str(script), str(tmp_path / "out" / "plan.json")],
        tmp_path,
        TIMEOUT_S,
        DIST_TIMEOUT_S="120",
    )
    assert rc == 0, text[-4000:]
    line = next(x for x in text.splitlines() if x.startswith("PARAMS "))
    return json.loads(line[len("PARAMS ") :])


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "moe.py"])
def test_moe_experts_shard_under_fsdp(name: str, tmp_path: Path) -> None:
    plan = _plan(_spec(name, tmp_path), "fsdp=2")
    params = _verified_params(plan, tmp_path)
    experts = {k: v for k, v in params.items() if any(e in k for e in EXPERTS[name])}
    assert experts
    for fqn, row in experts.items():
        assert row is not None and row["placements"][row["mesh"].index("fsdp")] == ["Shard", 0]
        assert row["local"][0] * 2 == row["global"][0], (fqn, row)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "moe.py"])
def test_moe_attention_shards_under_tp(name: str, tmp_path: Path) -> None:
    plan = _plan(_spec(name, tmp_path), "tp=2")
    params = _verified_params(plan, tmp_path)
    layer = "blocks.0." if name.endswith(".py") else "model.layers.0."
    for proj in ATTENTION[name]:
        row = params[f"{layer}{proj}.weight"]
        assert row is not None, (proj, params)
        kind, dim = row["placements"][row["mesh"].index("tp")]
        assert kind == "Shard" and row["local"][dim] * 2 == row["global"][dim], (proj, row)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("name", ["gemma2", "bloom", "min_max.py"])
def test_eager_attention_families_verify_under_tp(name: str, tmp_path: Path) -> None:
    plan = _plan(_spec(name, tmp_path), "tp=2")
    params = _verified_params(plan, tmp_path)
    sharded = [fqn for fqn in plan.tensor_parallel if params.get(f"{fqn}.weight") is not None]
    assert sharded and len(sharded) == len(plan.tensor_parallel), (plan.tensor_parallel, params)


@pytest.mark.slow
@pytest.mark.dist
def test_phi3_fused_gate_up_verifies_under_tp(tmp_path: Path) -> None:
    plan = _plan(_spec("phi3", tmp_path), "tp=2")
    params = _verified_params(plan, tmp_path)
    for i in range(2):
        row = params[f"model.layers.{i}.mlp.gate_up_proj.weight"]
        assert row["placements"] == [["_StridedShard", 0]], row  # rank r: rows r of gate and up
        assert row["local"][0] * 2 == row["global"][0], row
        row = params[f"model.layers.{i}.mlp.down_proj.weight"]
        assert row["placements"] == [["Shard", 1]] and row["local"][1] * 2 == row["global"][1]


@pytest.mark.slow
@pytest.mark.dist
def test_gpt2_conv1d_verifies_under_tp2_fsdp2(tmp_path: Path) -> None:
    """GPT-2's Conv1D MLP pairs under tp=2 x fsdp=2 (FSDP2 over the TP-sharded Conv1D weights):
    --verify matches one process."""
    plan = plan_model_file(
        load_model_file("hf:tiny-gpt2"), "cpu:4", global_batch=4, seq_len=SEQ,
        mesh="tp=2,fsdp=2", optimizer="sgd",
    )  # fmt: skip
    assert plan.tensor_parallel["transformer.h.0.mlp.c_fc"] == "colwise", plan.tensor_parallel
    out = plan.emit(tmp_path / "out")
    args = ["--steps", "2", "--optimizer", "sgd", "--verify"]
    rc, text = run_bounded(["bash", "launch.sh", *args], out, TIMEOUT_S, DIST_TIMEOUT_S="120")
    assert rc == 0, text[-4000:]
    m = VERIFY_OK.search(text)
    assert m and float(m.group(1)) <= 1e-5 and float(m.group(2)) <= 1e-5, text[-3000:]
