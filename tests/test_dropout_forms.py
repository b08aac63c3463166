"""Dropout in every form a model writes it is off under ``--verify`` (issue 28, item 1).

The model (``tests/models/encoder_lm.py``): torch's own nn.TransformerEncoder (dropout 0.1:
nn.MultiheadAttention's attention dropout inside F.multi_head_attention_forward, the layers'
nn.Dropout), a block of our own with SDPA's ``dropout_p``, ``F.dropout(training=...)`` and a
direct ``F.multi_head_attention_forward(dropout_p=...)`` call, and an nn.Dropout at the root.
Before the fix the emitted program's ``--verify`` failed on it (loss at step 1 off by 9e-3 at
fsdp=2): a TorchFunctionMode runs a function it handles with itself popped, so the SDPA that
F.multi_head_attention_forward calls escaped ``DropoutOff``.

- in process: DropoutOff against the same modules and functions with dropout 0;
- at plan time: the causal model under cp=2 (attention with dropout) and pp=2 (torch.export
  drops its shape-built mask from the layers' signatures) refused in one line, exit 2;
- the emitted program: fsdp=2 with every layer checkpointed in the default tier; dp=2, tp=2
  (the shards asserted) and pp=2 (the unmasked factory) in the slow tier.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _plans import show_params, verify_dropout_off
from autopar.codegen.apply import runtime
from torch import nn

from autopar.api import plan_model_file
from autopar.cli import main
from autopar.model_file import load_model_file

pytestmark = pytest.mark.bad_input

MODEL = str(Path(__file__).resolve().parent / "models" / "encoder_lm.py")
TIMEOUT_S = 300


def _plan(spec: str, mesh: dict, **kw):
    world = 1
    for degree in mesh.values():
        world *= degree
    return plan_model_file(
        load_model_file(spec), f"cpu:{world}", global_batch=8, seq_len=16, mesh=mesh,
        optimizer="sgd", **kw,
    )  # fmt: skip


def _verify(plan, tmp_path: Path) -> Path:
    """The emitted program, 3 SGD steps with --verify (_plans.verify_dropout_off)."""
    return verify_dropout_off(plan, tmp_path / "out", TIMEOUT_S)


# -- in process --------------------------------------------------------------------------------


def _twin(module: nn.Module, **no_dropout) -> nn.Module:
    """A module built like ``module`` with dropout 0 (``no_dropout``: the constructor's
    arguments), holding the same weights, in training mode."""
    twin = type(module)(**no_dropout)
    twin.load_state_dict(module.state_dict())
    return twin.train()


def test_dropout_off_reaches_attention_inside_functions() -> None:
    """nn.TransformerEncoderLayer and nn.MultiheadAttention (both its output paths), a direct
    F.multi_head_attention_forward, and the aten forms a pipeline stage's exported graph calls:
    under DropoutOff each computes what dropout 0 computes, values and gradients, and every
    dropout turned off is counted once; outside it, dropout is on."""
    rt = runtime()
    torch.manual_seed(0)
    x = torch.randn(2, 6, 16, requires_grad=True)
    kw = {"d_model": 16, "nhead": 2, "dim_feedforward": 32, "batch_first": True}
    layer = nn.TransformerEncoderLayer(**kw, dropout=0.5).train()
    mha = nn.MultiheadAttention(16, 2, dropout=0.5, batch_first=True).train()
    layer0, mha0 = _twin(layer, **kw, dropout=0.0), _twin(mha, embed_dim=16, num_heads=2,
                                                          batch_first=True)  # fmt: skip
    off = rt.DropoutOff()
    with off:
        y = layer(x)
        (y.sum()).backward()
        a, w = mha(x, x, x)  # need_weights: explicit softmax, then F.dropout inside
        b, _ = mha(x, x, x, need_weights=False)  # SDPA(dropout_p) inside
    assert off.seen == 4 + 2  # the layer: attention and its 3 nn.Dropout; the two mha calls
    grad = x.grad.clone()
    x.grad = None
    y0 = layer0(x)
    y0.sum().backward()
    assert torch.equal(y, y0) and torch.allclose(grad, x.grad, atol=1e-6)
    a0, w0 = mha0(x, x, x)
    assert torch.equal(a, a0) and torch.equal(w, w0)
    assert torch.equal(b, mha0(x, x, x, need_weights=False)[0])
    assert not torch.allclose(mha(x, x, x)[0], a0)  # outside the mode: dropout on

    t = x.detach().transpose(0, 1)  # (T, B, E), the functional form's layout
    args = (t, t, t, 16, 2, mha.in_proj_weight, mha.in_proj_bias, None, None, False)
    rest = (mha.out_proj.weight, mha.out_proj.bias)
    off = rt.DropoutOff()
    with off:
        f1 = F.multi_head_attention_forward(*args, 0.5, *rest, need_weights=False)[0]
        f2 = F.multi_head_attention_forward(*args, 0.5, *rest, False, need_weights=False)[0]  # eval
        q = k = v = torch.randn(1, 2, 4, 8)
        s = torch.ops.aten.scaled_dot_product_attention.default(q, k, v, None, 0.5)
        d = torch.ops.aten.dropout.default(t, 0.5, True)
        n, keep = torch.native_dropout(t, 0.5, True)
        i = F.dropout(t.clone(), 0.5, training=True, inplace=True)
    assert off.seen == 5  # training=False is no dropout
    reference = F.multi_head_attention_forward(*args, 0.0, *rest, need_weights=False)[0]
    assert torch.equal(f1, reference) and torch.equal(f2, reference)
    assert torch.equal(s, F.scaled_dot_product_attention(q, k, v))
    assert torch.equal(d, t) and torch.equal(n, t) and bool(keep.all()) and torch.equal(i, t)


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("mesh", "words"),
    [
        ("cp=2", ["attention with dropout", "encoder_lm.py:", "context parallelism needs"]),
        ("pp=2", ["cannot be cut into pipeline stages", "encoder.layers.0", "no op reads"]),
    ],
)
def test_causal_encoder_refusals_are_one_line_at_plan_time(mesh, words, capsys) -> None:
    """cp splits no attention with dropout; the causal mask, built from shapes alone, is a
    tensor no op reads (the layers run is_causal), which torch.export drops from the encoder
    layers' calls, so the plan is refused (the unmasked model is cut: the slow pp test)."""
    argv = [MODEL, "--cluster", "cpu:2", "--global-batch", "8", "--seq-len", "16"]
    code, err = _cli([*argv, "--mesh", mesh], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err and all(w in lines[0] for w in words), lines[0]


# -- the emitted program -----------------------------------------------------------------------


@pytest.mark.dist
def test_transformer_encoder_verifies_under_fsdp_with_checkpointing(tmp_path: Path) -> None:
    """The one default-tier launch: fsdp=2, every layer checkpointed (the recomputation of
    nn.MultiheadAttention in backward runs with dropout off too)."""
    plan = _plan(MODEL, {"fsdp": 2}, checkpoint="full")
    assert {plan.checkpointing[f"encoder.layers.{i}"] for i in range(2)} == {"full"}
    assert plan.checkpointing["mix"] == "full", plan.checkpointing
    _verify(plan, tmp_path)


@pytest.mark.slow
@pytest.mark.dist
def test_transformer_encoder_verifies_under_dp(tmp_path: Path) -> None:
    _verify(_plan(MODEL, {"dp": 2}), tmp_path)


@pytest.mark.slow
@pytest.mark.dist
def test_transformer_encoder_verifies_under_tp_with_its_ffn_and_block_sharded(
    tmp_path: Path,
) -> None:
    """tp=2: each encoder layer's feed-forward a Megatron pair (linear1 Shard(0), linear2
    Shard(1)), the own block's q/k/v colwise and o rowwise; nn.MultiheadAttention, whose
    weights F.multi_head_attention_forward reads directly, and the functional attention stay
    whole."""
    plan = _plan(MODEL, {"tp": 2})
    styles = plan.tensor_parallel
    for i in range(2):
        assert styles[f"encoder.layers.{i}.linear1"] == "colwise", styles
        assert styles[f"encoder.layers.{i}.linear2"] == "rowwise", styles
    assert [styles[f"mix.{p}"] for p in "qkvo"] == ["colwise"] * 3 + ["rowwise"], styles
    assert not any("self_attn" in fqn or fqn == "mix.out" for fqn in styles), styles
    params = show_params(_verify(plan, tmp_path), tmp_path)
    for name, dim in [
        *((f"encoder.layers.{i}.linear{j}.weight", j - 1) for i in range(2) for j in (1, 2)),
        *((f"mix.{p}.weight", 0) for p in "qkv"),
        ("mix.o.weight", 1),
    ]:
        placement, local, whole = params[name]
        assert placement == ["Shard", dim] and local[dim] * 2 == whole[dim], (name, params[name])
    for name in ("encoder.layers.0.self_attn.in_proj_weight", "mix.in_proj", "mix.out.weight"):
        assert params[name] is None or params[name][0] == ["Replicate", None], params[name]


@pytest.mark.slow
@pytest.mark.dist
def test_unmasked_transformer_encoder_verifies_under_pp(tmp_path: Path) -> None:
    """pp=2 of the model without its causal mask: the root's nn.Dropout, the encoder layers and
    the own block on two stages."""
    plan = _plan(f"{MODEL}:build_bidirectional", {"pp": 2})
    assert len(plan.stages) == 2 and "encoder.layers.0" in plan.stages[0], plan.stages
    _verify(plan, tmp_path)
