"""HuggingFace transformers models: ``plan hf:<config>``, the emitted programs, 70B at scale.

Tiny Llama, GPT-2 and BERT configs (examples/hf/tiny-*.json: 2 layers, hidden 64) are planned
for cpu:2 with the mesh pinned to tp=2, fsdp=2 or pp=2, emitted, and run under torchrun with
``--verify --optimizer sgd`` (2 steps, seq 16). At this size the CPU cost model shards nothing
with TP (collectives cost more than the compute saved), so the TP case takes the styles the ILP
finds on the traced graph when compute dominates (H100 costs, a large batch): TP styles still
come from the ILP, not from a per-family table. The real-size Llama-3-70B config plans in a
subprocess whose peak RSS is read back.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="hf: models need the optional extra 'hf'")

from _plans import ROOT, tiered  # noqa: E402
from autopar.codegen import write_outputs  # noqa: E402
from autopar.cost_model import parse_cluster  # noqa: E402
from autopar.ir.trace import trace  # noqa: E402
from autopar.planner import ilp  # noqa: E402
from autopar.planner.search import _module_attrs  # noqa: E402
from test_codegen_dist import VERIFY_OK, _launch  # noqa: E402

from autopar.api import plan_model_file  # noqa: E402
from autopar.hf import BUILTINS, EXAMPLES, task_of  # noqa: E402
from autopar.model_file import ModelFileError, build_on_meta, example_inputs, load_model_file  # noqa: E402

TINY = ("tiny-llama", "tiny-gpt2", "tiny-bert")
SEQ = 16


def _plan(name: str, mesh: str):
    return plan_model_file(
        load_model_file(f"hf:{name}"),
        "cpu:2",
        global_batch=4,
        seq_len=SEQ,
        mesh=mesh,
        optimizer="sgd",
    )


def _ilp_styles(name: str, tp: int = 2, shard_all: bool = False) -> tuple[dict[str, str], dict]:
    """The ILP's TP styles for the traced model where compute dominates (H100, big batch);
    ``shard_all``: as for a pinned tp (every module that can be sharded is)."""
    mf = load_model_file(f"hf:{name}")
    model = build_on_meta(mf)
    args, _ = example_inputs(mf, model, 2, SEQ)
    graph = trace(model, args, seq_len=SEQ)
    cluster = parse_cluster("2xH100")
    inputs = ilp.CostInputs(
        tp=tp,
        batch_scale=1e4,
        device=cluster.device,
        dtype="fp32",
        tp_link=cluster.intra_node,
        shard_all=shard_all,
    )
    styles = ilp.solve(graph, inputs).styles
    return styles, _module_attrs(graph, styles, tp)


def test_builtin_configs_exist_and_pick_their_head() -> None:
    for name in BUILTINS:
        config = json.loads((EXAMPLES / f"{name}.json").read_text())
        expected = "masked-lm" if "bert" in name else "causal-lm"
        assert task_of(config) == expected, name
    assert task_of({"model_type": "bert"}) == "masked-lm"
    assert task_of({"model_type": "llama"}) == "causal-lm"


def test_bad_hf_spec_is_one_line() -> None:
    with pytest.raises(ModelFileError, match="neither a built-in HF config"):
        load_model_file("hf:no-such-model")


def test_gpt2_conv1d_shards_as_a_linear() -> None:
    """GPT-2's c_attn/c_proj/c_fc are HF Conv1D (weight stored (in, out)): TP units of the
    linear kind. Its MLP pairs where compute dominates; its fused c_attn is split into q, k, v
    inside an attention block that reads the caller's mask: whole heads gathered when pinned."""
    styles, _ = _ilp_styles("tiny-gpt2")
    for i in range(2):
        p = f"transformer.h.{i}."
        assert styles[p + "mlp.c_fc"] == "colwise" and styles[p + "mlp.c_proj"] == "rowwise"
    styles, _ = _ilp_styles("tiny-gpt2", shard_all=True)
    assert styles["transformer.h.0.attn.c_attn"] == "colwise_gather", styles


# tp and fsdp once each in the default tier; the other seven pairs in the slow tier. pp=2 of
# tiny-gpt2 is covered by test_weights.py::test_init_from_and_save_hf_round_trip[pp] (an hf:
# Llama at pp=2, --verify) and test_tied.py::test_hf_tiny_gpt2_tied_fsdp2_verifies (tiny GPT-2).
_TINY_CASES = tiered(
    [(mesh, name) for mesh in ("tp=2", "fsdp=2", "pp=2") for name in TINY],
    {(m, n) for m in ("tp=2", "fsdp=2", "pp=2") for n in TINY}
    - {("tp=2", "tiny-llama"), ("fsdp=2", "tiny-bert")},
)
_ATTENTION = ("query", "key", "value", "dense", "q_proj", "k_proj", "v_proj", "o_proj")


def test_bert_attention_reads_no_local_sequence_shard() -> None:
    """BERT's self-attention views q/k/v with its input's shape (``hidden_states.shape[:-1]``):
    fed a plain local sequence shard (``sequence_parallel_local``), it views the all-gathered
    q/k/v with the local length and fails at run time. Those projections may read a sequence
    shard only as a DTensor, whose shape is global; Llama's norms gather instead."""
    from autopar.planner.ilp import collapse

    mf = load_model_file("hf:tiny-bert")
    model = build_on_meta(mf)
    args, _ = example_inputs(mf, model, 2, SEQ)
    sized = collapse(trace(model, args, seq_len=SEQ)).sequence_sized
    assert {f.rsplit(".", 1)[-1] for f in sized} == {"query", "key", "value"}, sized
    for shard_all in (False, True):
        styles, _ = _ilp_styles("tiny-bert", shard_all=shard_all)
        local = [f for f, s in styles.items() if s == "sequence_parallel_local"]
        from_seq = [f for f, s in styles.items() if s.startswith("colwise_from_seq")]
        assert not any(f.endswith(("query", "key", "value")) for f in from_seq) or not local, styles


@pytest.mark.dist
@pytest.mark.parametrize(("mesh", "name"), _TINY_CASES)
def test_tiny_hf_models_verify(name: str, mesh: str, tmp_path: Path) -> None:
    plan = _plan(name, mesh)
    assert plan.model.file == f"hf:{EXAMPLES / name}.json"
    if mesh == "tp=2":
        styles, attrs = _ilp_styles(name, shard_all=True)
        assert styles, f"the ILP shards nothing in {name}"
        # attention projections are sharded (GPT-2's, fused c_attn, are gathered)
        attention = [
            f
            for f in styles
            if ("attn" in f or "attention" in f) and f.rsplit(".", 1)[-1] in _ATTENTION
        ]
        assert len(attention) == (0 if "gpt2" in name else 4 * 2), styles
        plan = plan.model_copy(update={"tensor_parallel": styles, "module_attrs": attrs})
    if mesh == "pp=2":
        assert plan.mesh.pp == 2 and len(plan.stages) == 2
    out = write_outputs(plan, tmp_path / "out")
    script = (out / "train.py").read_text()
    assert "HF_CONFIG = {" in script
    runtime_text = "".join(p.read_text() for p in (out / "autopar_runtime").glob("*.py"))
    assert "import transformers" in runtime_text
    rc, text = _launch(plan, tmp_path / "out", "--steps", "2", "--verify", "--optimizer", "sgd")
    assert rc == 0, text[-3000:]
    assert VERIFY_OK.search(text), text[-3000:]


@pytest.mark.slow
def test_llama3_70b_plans_megatron_under_2gb(tmp_path: Path) -> None:
    """Real size on meta: 80 layers, 8x8 H100, bf16, seq 2048, tp pinned to 8."""
    code = (
        "import json, resource, sys\n"
        "from autopar.cli import main\n"
        "rc = main(['hf:llama3-70b', '--cluster', '8x8xH100', '--global-batch', '64',\n"
        "           '--seq-len', '2048', '--dtype', 'bf16', '--mesh', 'tp=8', '--json', '-q'])\n"
        "rss = max(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM:'))\n"  # own peak (VmHWM)
        "print(json.dumps({'rc': rc, 'rss': rss}), file=sys.stderr)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    status = json.loads(proc.stderr.strip().splitlines()[-1])
    assert status["rc"] == 0 and status["rss"] < 2 * 2**30, status
    plan = json.loads(proc.stdout)
    assert plan["mesh"]["tp"] == 8
    tp = plan["tensor_parallel"]
    layer = "model.layers.0"
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj"):
        assert tp[f"{layer}.{name}"].startswith("colwise"), (name, tp.get(f"{layer}.{name}"))
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        assert tp[f"{layer}.{name}"].startswith("rowwise"), (name, tp.get(f"{layer}.{name}"))
    assert tp[f"{layer}.mlp.up_proj"].startswith("colwise")


# -- encoder-decoder models (T5, BART): keyword inputs, shifted decoder targets -----------------
SEQ2SEQ = {
    "t5": {
        "vocab_size": 128, "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2,
        "num_decoder_layers": 2, "num_heads": 4,
    },
    "bart": {
        "vocab_size": 128, "d_model": 32, "encoder_layers": 2, "decoder_layers": 2,
        "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 64,
        "decoder_ffn_dim": 64, "max_position_embeddings": 64,
    },
}  # fmt: skip


def _seq2seq_config(model_type: str, folder: Path) -> str:
    """A tiny config written by transformers' own save_pretrained (default dropout: 0.1)."""
    import transformers

    config = transformers.AutoConfig.for_model(model_type, **SEQ2SEQ[model_type])
    config.save_pretrained(folder / model_type)
    return f"hf:{folder / model_type / 'config.json'}"


def test_seq2seq_configs_plan_with_shifted_decoder_targets(tmp_path: Path) -> None:
    import torch
    from autopar.planner.request import PlanningError

    for model_type in SEQ2SEQ:
        spec = _seq2seq_config(model_type, tmp_path)
        mf = load_model_file(spec)
        assert mf.factory == "seq2seq_lm", mf.factory
        assert task_of({"model_type": model_type}) == "seq2seq-lm"
        inputs, target = mf.make_batch(3, SEQ)
        assert set(inputs) == {"input_ids", "decoder_input_ids"}
        decoder = inputs["decoder_input_ids"]
        start = 0 if model_type == "t5" else 2  # T5: the pad token; BART: </s>
        assert inputs["input_ids"].shape == decoder.shape == target.shape == (3, SEQ)
        assert (decoder[:, 0] == start).all() and torch.equal(decoder[:, 1:], target[:, :-1])
        plan = plan_model_file(mf, "cpu:2", global_batch=4, seq_len=SEQ, mesh="fsdp=2")
        assert plan.model.factory == "seq2seq_lm" and plan.mesh.fsdp == 2
        with pytest.raises(
            PlanningError, match="keyword inputs \\(input_ids, decoder_input_ids\\)"
        ):
            plan_model_file(mf, "cpu:2", global_batch=4, seq_len=SEQ, mesh="pp=2")
    assert task_of({"model_type": "bart", "is_decoder": True}) == "causal-lm"  # BartForCausalLM


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize(
    ("model_type", "mesh"),
    [
        ("t5", "fsdp=2"),
        ("t5", "dp=2"),
        ("t5", "tp=2"),
        ("bart", "fsdp=2"),
        ("bart", "dp=2"),
        ("bart", "tp=2"),
    ],
)
def test_seq2seq_models_verify(model_type: str, mesh: str, tmp_path: Path) -> None:
    """Planned for cpu:2 and run with --verify: default dropout (0.1) off in both runs; BART's
    embedding shared by encoder, decoder and head stays one tensor (DDP and TP too)."""
    import re

    spec = _seq2seq_config(model_type, tmp_path)
    plan = plan_model_file(
        load_model_file(spec), "cpu:2", global_batch=4, seq_len=SEQ, mesh=mesh, optimizer="sgd"
    )
    if mesh == "tp=2" and model_type == "t5":  # T5 views spell n_heads: whole heads gathered
        styles = plan.tensor_parallel
        for proj in ("q", "k", "v", "o"):
            key = f"encoder.block.0.layer.0.SelfAttention.{proj}"
            assert styles.get(key) == "colwise_gather", styles
        assert styles.get("encoder.block.0.layer.1.DenseReluDense.wi") == "colwise", styles
        assert styles.get("encoder.block.0.layer.1.DenseReluDense.wo") == "rowwise", styles
    elif mesh == "tp=2":  # attention really sharded
        styles = plan.tensor_parallel
        for proj in ("q_proj", "k_proj", "v_proj"):
            assert styles.get(f"model.encoder.layers.0.self_attn.{proj}") == "colwise", styles
        assert styles.get("model.encoder.layers.0.self_attn.out_proj") == "rowwise", styles
    rc, text = _launch(plan, tmp_path, "--steps", "3", "--verify", "--optimizer", "sgd")
    assert rc == 0, text[-3000:]
    m = re.search(
        r"^verify: ok max_loss_diff=(\S+) max_param_diff=(\S+) \(dropout off in both runs\)$",
        text,
        re.MULTILINE,
    )
    assert m and float(m.group(1)) <= 1e-5 and float(m.group(2)) <= 1e-5, text[-3000:]


def test_traced_llama_attends_without_a_materialized_mask() -> None:
    """Fed only input_ids, HF's eager forward runs SDPA with is_causal and no mask; the planner's
    trace must see the same, or it charges a (b, 1, s, s) mask per layer (96 GiB per two samples
    at 131072 tokens) and a long-sequence plan no longer fits."""
    from autopar.api import trace as api_trace
    from autopar.model_file import call_args

    mf = load_model_file("hf:tiny-llama")
    model = build_on_meta(mf)
    saved = {}
    for s in (256, 1024):
        inputs, _ = example_inputs(mf, model, 2, s)
        args, kwargs = call_args(inputs)
        graph = api_trace(model, args, kwargs, seq_len=s, saved_for="cuda")
        layer = next(lay for lay in graph.layers if lay.fqn == "model.layers.0")
        saved[s] = layer.saved_bytes
        sdpa = [n for n in graph.nodes if "scaled_dot_product" in n.op]
        # aten.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, ...)
        assert sdpa and all(n.args[3:6] == (None, 0.0, True) for n in sdpa), [n.args for n in sdpa]
    # O(s): 4x the tokens save 4x the bytes (a materialized fp32 mask alone would give ~10x here).
    assert 3.9 < saved[1024] / saved[256] < 4.3, saved
