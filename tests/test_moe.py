"""Mixture of experts: the router, the experts, dispatch/combine and the aux loss in the IR.

A hand-written top-2 MoE (tests/models/moe_top2.py: a ModuleList of expert MLPs, each run on
the tokens ``torch.where`` routes to it, a Switch-style load-balancing loss) and tiny HF Mixtral
and Qwen3-MoE configs (grouped expert weights, written here as config files, never downloaded)
are traced on meta; the same code finds the blocks in both.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from autopar.ir.trace import TraceError, trace

from autopar.model_file import build_on_meta, example_inputs, load_model_file

ROOT = Path(__file__).resolve().parent.parent
MOE_TOP2 = str(ROOT / "tests" / "models" / "moe_top2.py")
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


def test_hand_written_top2_moe() -> None:
    """ModuleList experts, token-choice top-2 with torch.where: both blocks found, per-expert
    sizes at balanced routing (tokens * k / E rows per expert), the aux loss seen."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("moe_top2", MOE_TOP2)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    g = _trace(MOE_TOP2, batch=2)
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
    ("config", "experts", "inter"),
    [
        (TINY_MIXTRAL, "num_local_experts", "intermediate_size"),
        (TINY_QWEN3_MOE, "num_experts", "moe_intermediate_size"),
    ],
    ids=["mixtral", "qwen3-moe"],
)
def test_hf_grouped_experts(tmp_path: Path, config: dict, experts: str, inter: str) -> None:
    """HF's stacked expert weights (gate_up_proj, down_proj: first dim = experts), grouped_mm
    counted as matmuls; the aux loss seen only when the config outputs router logits."""
    pytest.importorskip("transformers")
    g = _trace(hf_config(tmp_path, config, output_router_logits=False))
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
    assert moe.tokens == 2 * SEQ and not moe.aux_loss
    matmuls = 2 * moe.tokens * moe.top_k * 3 * h * i
    assert matmuls <= moe.expert_fwd_flops < 1.1 * matmuls
    with_aux = _trace(hf_config(tmp_path, config, output_router_logits=True))
    assert all(m.aux_loss for m in with_aux.moes)


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
