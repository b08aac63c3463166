"""HF mixtures of experts as transformers trains them: the load-balancing loss in the training
loss where the config outputs router logits (planner and emitted script alike), pipelines refused
in one line for them, and HF's grouped experts cut into pipeline stages on meta.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
from autopar.codegen.apply import runtime  # noqa: E402
from autopar.planner.request import PlanningError  # noqa: E402
from test_codegen_dist import VERIFY_OK, _launch  # noqa: E402
from test_moe import TINY_MIXTRAL  # noqa: E402

from autopar.api import plan_model_file  # noqa: E402
from autopar.model_file import load_model_file  # noqa: E402

SEQ = 16


def _spec(tmp: Path, **changes) -> str:
    path = tmp / "mixtral.json"
    path.write_text(json.dumps({**TINY_MIXTRAL, **changes}))
    return f"hf:{path}"


def _plan(spec: str, mesh: str):
    mf = load_model_file(spec)
    return plan_model_file(mf, "cpu:2", global_batch=4, seq_len=SEQ, mesh=mesh)


def test_aux_loss_is_trained_where_the_config_outputs_router_logits(tmp_path: Path) -> None:
    """loss = cross-entropy + router_aux_loss_coef * aux_loss, in the planner's model file and
    in the emitted script's (the same number); without output_router_logits, cross-entropy."""
    config = {**TINY_MIXTRAL, "output_router_logits": True, "router_aux_loss_coef": 0.5}
    mf = load_model_file(_spec(tmp_path, **config))
    torch.manual_seed(0)
    model = mf.build()
    inputs, target = mf.make_batch(2, SEQ)
    out = model(*inputs)
    ce = torch.nn.functional.cross_entropy(out["logits"].flatten(0, -2), target.flatten())
    assert out["aux_loss"] is not None and out["aux_loss"].item() > 0.5
    want = float(ce) + 0.5 * float(out["aux_loss"])
    assert float(mf.loss_fn(out, target)) == pytest.approx(want, rel=1e-6)

    c = types.SimpleNamespace(
        HF_CONFIG=config, HF_TASK="causal-lm", FACTORY="causal_lm", MASK_FRACTION=0.15
    )
    script = runtime().hf_model_file(c)
    assert float(script.loss_fn(out, target)) == pytest.approx(want, rel=1e-6)

    plain = {**config, "output_router_logits": False}
    c = types.SimpleNamespace(
        HF_CONFIG=plain, HF_TASK="causal-lm", FACTORY="causal_lm", MASK_FRACTION=0.15
    )
    assert float(runtime().hf_model_file(c).loss_fn(out, target)) == pytest.approx(float(ce))
    assert float(load_model_file(_spec(tmp_path, **plain)).loss_fn(out, target)) == (
        pytest.approx(float(ce))
    )


def test_router_logits_refuse_a_pinned_pipeline_in_one_line(tmp_path: Path) -> None:
    spec = _spec(tmp_path, output_router_logits=True)
    with pytest.raises(PlanningError, match=r"^pp=2: the config sets output_router_logits") as e:
        _plan(spec, "pp=2")
    assert "\n" not in str(e.value) and "--mesh pp=1" in str(e.value)
    assert _plan(spec, "").mesh.pp == 1  # free search: no pipeline


def test_grouped_experts_cut_into_pipeline_stages_on_meta(tmp_path: Path) -> None:
    """HF Mixtral's experts call aten._grouped_mm, whose meta kernel takes bf16 only: the
    plan-time cut check (and the script, which cuts on meta too) ran it in fp32 and exited 1
    (an internal error) for any fp32 pipeline plan of an HF MoE."""
    plan = _plan(_spec(tmp_path), "pp=2")
    assert plan.mesh.pp == 2 and len(plan.stages) == 2


@pytest.mark.slow
@pytest.mark.dist
def test_mixtral_pipeline_verifies(tmp_path: Path) -> None:
    plan = _plan(_spec(tmp_path), "pp=2")
    rc, out = _launch(plan, tmp_path, "--steps", "2", "--verify", "--optimizer", "sgd")
    assert rc == 0 and VERIFY_OK.search(out), out[-3000:]


@pytest.mark.slow
@pytest.mark.dist
def test_mixtral_aux_loss_verifies_under_fsdp(tmp_path: Path) -> None:
    plan = _plan(_spec(tmp_path, output_router_logits=True), "fsdp=2")
    rc, out = _launch(plan, tmp_path, "--steps", "2", "--verify")
    assert rc == 0 and VERIFY_OK.search(out), out[-3000:]
