"""Pipeline cuts that run where the planner said they would (issue 15, item 5).

Models written the way people write them (tests/models/): a Llama from scratch that slices its
rope buffers to the sequence at the root (``self.rope_cos[:t]``: no torch.fx trace of it
works), a UNet whose skip connections cross the stage boundary and whose stage inputs get
strided gradients (torch.cat), an LSTM language model (``batch_first`` outputs are not
contiguous), HF Gemma 3 (sliding-window attention; its rotary embedding is called with a
string). Each plans with ``--mesh pp=2 --schedule 1f1b`` (the planner decides where the model
cuts from its traced graph, autopar._cuts) and runs under torchrun with ``--verify
--optimizer sgd``. A decoder whose blocks take their attention type as a string cannot be cut:
that is one line at plan time, never a crash at run time. The Llama is the default tier's one
torchrun launch; the others are the slow tier.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _plans import ROOT
from autopar.planner.schedule_search import best_schedule
from autopar.planner.schedules import ScheduleError
from autopar.planner.search import PlanningError
from autopar.planner.stages import Cuts, LayerCost, partition
from test_codegen_dist import _check_verified, _launch

from autopar.api import plan_model_file
from autopar.model_file import load_model_file

MODELS = ROOT / "tests" / "models"
SEQ = 16


def _pp_plan(spec: str, seq_len: int | None = SEQ, mesh: str = "pp=2"):
    return plan_model_file(
        load_model_file(spec),
        "cpu:2",
        global_batch=4,
        seq_len=seq_len,
        mesh=mesh,
        schedule="1f1b",
        optimizer="sgd",
    )


def _costs(n: int) -> list[LayerCost]:
    return [LayerCost(fwd_s=1.0, bwd_s=2.0, act_bytes=1, act_ckpt_bytes=1, static_bytes=1)] * n


def test_stages_start_and_end_only_where_the_model_cuts() -> None:
    """Six equal layers in two stages: the balanced cut is 3, but only 1 and 5 cut."""
    free = partition(_costs(6), num_stages=2, num_microbatches=2, mem_limit_bytes=1e9)
    assert free.boundaries == ((0, 3), (3, 6))
    cuts = Cuts(allowed=frozenset({1, 5}), why=((3, "a tuple would cross"),))
    plan = partition(_costs(6), num_stages=2, num_microbatches=2, mem_limit_bytes=1e9, cuts=cuts)
    assert plan.boundaries in (((0, 1), (1, 6)), ((0, 5), (5, 6)))
    assert plan.step_time_s > free.step_time_s
    three = partition(_costs(6), num_stages=3, num_microbatches=3, mem_limit_bytes=1e9, cuts=cuts)
    assert three.boundaries == ((0, 1), (1, 5), (5, 6))
    with pytest.raises(ScheduleError, match="only 2 of the 5 layer boundaries can be cut: a tuple"):
        partition(_costs(6), num_stages=4, num_microbatches=4, mem_limit_bytes=1e9, cuts=cuts)
    refused = Cuts(allowed=frozenset(), refused="cannot export M")
    with pytest.raises(ScheduleError, match="cannot be cut into pipeline stages: cannot export M"):
        best_schedule(
            lambda size: _costs(6), num_stages=2, global_batch_per_dp=4, mem_limit_bytes=1e9,
            cuts=refused,
        )  # fmt: skip


def test_a_block_called_with_a_string_is_refused_at_plan_time() -> None:
    spec = str(MODELS / "layer_types.py")
    with pytest.raises(PlanningError) as info:
        _pp_plan(spec)
    message = str(info.value)
    assert "\n" not in message
    assert "layer blocks.0 is called with a str 'sliding' argument and holds parameters" in message
    assert "--mesh pp=1" in message


def test_a_model_that_does_not_cut_plans_without_a_pipeline_and_says_why() -> None:
    """Unpinned: the cut is decided before the one search (autopar._cuts), so pipeline meshes
    are ruled out there, each with why."""
    mf = load_model_file(str(MODELS / "layer_types.py"))
    plan = plan_model_file(mf, "cpu:2", global_batch=4, seq_len=SEQ, optimizer="sgd")
    assert plan.mesh.pp == 1
    ruled_out = [a.why for a in plan.alternatives if a.mesh.pp > 1]
    assert ruled_out and all("cannot be cut into pipeline stages" in w for w in ruled_out)
    assert any("blocks.0 is called with a str 'sliding'" in w for w in ruled_out), ruled_out


def _run_verified(plan, tmp_path: Path) -> None:
    rc, out = _launch(plan, tmp_path, "--steps", "3", "--optimizer", "sgd", "--verify")
    _check_verified(out, rc, steps=3, loss_tol=1e-5, param_tol=1e-5)


@pytest.mark.dist
def test_llama_from_scratch_pipeline_verifies(tmp_path: Path) -> None:
    """The rope buffers live in stage 0 (read at the root): their values must come from the
    model (a stage's own copy left uninitialized trains on garbage: loss nan)."""
    plan = _pp_plan(str(MODELS / "llama_rope.py"))
    _run_verified(plan, tmp_path)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize(("name", "seq_len"), [("unet", None), ("lstm", SEQ)])
def test_strided_stage_tensors_pipeline_verifies(name: str, seq_len, tmp_path: Path) -> None:
    plan = _pp_plan(str(MODELS / f"{name}.py"), seq_len)
    _run_verified(plan, tmp_path)


GEMMA3 = {
    "model_type": "gemma3_text",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "sliding_window": 8,
    "tie_word_embeddings": False,
}


@pytest.mark.slow
@pytest.mark.dist
def test_gemma3_sliding_window_pipeline_verifies(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    config = tmp_path / "gemma3.json"
    config.write_text(json.dumps(GEMMA3))
    plan = _pp_plan(f"hf:{config}")
    assert plan.mesh.pp == 2 and "model.rotary_emb" in plan.stages[0]
    _run_verified(plan, tmp_path)
