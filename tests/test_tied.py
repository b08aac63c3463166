"""Tied weights (``head.weight = tok_emb.weight``) under FSDP2: FSDP2 manages a tensor in one
unit only, so the layers holding a tied parameter are not units of their own; the root unit
holds them (``autopar_runtime.fsdp_units``). The planner counts the tied parameter once and
charges the root's parameters as gathered for the whole step; pipeline meshes stay refused with
one line. The emitted script passes ``--verify`` under torchrun, and ``plan.apply`` leaves the
tied parameters one tensor, through a training step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _plans import APPLY_EPILOGUE, APPLY_PRELUDE, allocator_buffers, run_bounded, tiered
from autopar.codegen import write_outputs
from autopar.cost_model.precision import FP32
from autopar.planner.request import PlanningError
from test_codegen_dist import VERIFY_OK

from autopar import Plan
from autopar.api import plan_model_file
from autopar.model_file import load_model_file

MODELS = Path(__file__).resolve().parent / "models"
FIXTURE = str(MODELS / "gpt_tied.py")
UNTIED = f"{FIXTURE}:build_untied"
HF_TINY = Path(__file__).resolve().parent.parent / "examples" / "hf" / "tiny-gpt2.json"
BIN = Path(sys.executable).parent
TIMEOUT_S = 240
TIED_NUMEL = 96 * 32  # gpt_tied's VOCAB x DIM: tok_emb.weight, which head.weight is


def _plan(mesh, spec: str = FIXTURE, cluster: str = "cpu:4", **kw) -> Plan:
    return plan_model_file(
        load_model_file(spec), cluster, global_batch=8, seq_len=16, mesh=mesh, **kw
    )


# -- the planner -------------------------------------------------------------------------------


def test_memory_model_counts_the_tied_weight_once_and_keeps_it_gathered() -> None:
    tied, untied = _plan({"fsdp": 4}, optimizer="sgd"), _plan({"fsdp": 4}, UNTIED, optimizer="sgd")
    a, b = tied.predicted.memory_breakdown_bytes, untied.predicted.memory_breakdown_bytes
    # fp32 SGD, sharded 4 ways: the untied model holds one more VOCAB x DIM weight
    assert b.params - a.params == TIED_NUMEL * 4 / 4
    assert b.grads - a.grads == TIED_NUMEL * 4 / 4
    # the root unit (tok_emb and head) stays gathered for the whole step: its weight, whole, on
    # top of the largest block's transients, which both plans share
    assert allocator_buffers(a) - allocator_buffers(b) == TIED_NUMEL * FP32.gather
    assert (
        allocator_buffers(a)
        > FP32.fsdp_unit_bytes(TIED_NUMEL, TIED_NUMEL) - TIED_NUMEL * FP32.gather
    )


def test_pipeline_meshes_of_a_tied_model_are_refused_at_plan_time() -> None:
    with pytest.raises(PlanningError) as e:
        _plan({"pp": 2}, cluster="cpu:2")
    line = str(e.value)
    assert "\n" not in line and "tied" in line and "tok_emb" in line and "head" in line, line
    free = _plan(None)  # the free search never picks a pipeline for it
    assert free.mesh.pp == 1


# -- the emitted program -----------------------------------------------------------------------

APPLY_AND_STEP = (
    APPLY_PRELUDE
    + """
from torch.distributed.fsdp import FSDPModule

facts = {"tied_after_apply": inner.head.weight is inner.tok_emb.weight}
facts["units"] = sorted(f for f, m in inner.named_modules() if f and isinstance(m, FSDPModule))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
(inputs,), target = user_model.make_batch(2, 16)
for _ in range(2):
    logits = model(inputs)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()
facts["tied_after_steps"] = inner.head.weight is inner.tok_emb.weight
facts["params"] = len(list(model.parameters()))
facts["names"] = len(list(model.named_parameters(remove_duplicate=False)))
facts["built"] = len(list(user_model.build_model().parameters()))
if dist.get_rank() == 0:
    print("FACTS " + json.dumps(facts), flush=True)
"""
    + APPLY_EPILOGUE
)

DIST_CASES = {
    "fsdp4-sgd": ({"fsdp": 4}, "sgd", 1e-5),
    "fsdp4-adamw": ({"fsdp": 4}, "adamw", 1e-4),
    "dp2-fsdp2-adamw": ({"dp": 2, "fsdp": 2}, "adamw", 1e-4),
    "tp2-fsdp2-sgd": ({"tp": 2, "fsdp": 2}, "sgd", 1e-5),
}


def _launch(plan: Plan, out: Path, optimizer: str) -> str:
    rc, text = run_bounded(
        ["bash", "launch.sh", "--steps", "3", "--optimizer", optimizer, "--verify"],
        out,
        TIMEOUT_S,
        DIST_TIMEOUT_S="120",
    )
    assert rc == 0, text[-4000:]
    return text


@pytest.mark.dist
# fsdp4-adamw: test_hf_tiny_gpt2_tied_fsdp2_verifies (a tied pair in the root FSDP unit, verified)
@pytest.mark.parametrize(
    "case", tiered(DIST_CASES, {"fsdp4-sgd", "dp2-fsdp2-adamw", "fsdp4-adamw"})
)
def test_tied_script_verifies(case: str, tmp_path: Path) -> None:
    mesh, optimizer, loss_tol = DIST_CASES[case]
    plan = _plan(mesh, optimizer=optimizer)
    assert plan.mesh.world_size == 4 and all(getattr(plan.mesh, k) == v for k, v in mesh.items())
    assert "tok_emb" not in plan.tensor_parallel and "head" not in plan.tensor_parallel
    out = write_outputs(plan, tmp_path / "out")
    text = _launch(plan, out, optimizer)
    assert "tied parameters: tok_emb, head stay in the root FSDP unit" in text, text[-4000:]
    m = VERIFY_OK.search(text)
    assert m, text[-4000:]
    # SGD differs from one process only by reduction order; AdamW within the emitted bound
    param_tol = 1e-5 if optimizer == "sgd" else 1e-5 + 2 * plan.training.lr * 3
    assert float(m.group(1)) <= loss_tol and float(m.group(2)) <= param_tol, m.group(0)
    if case != "fsdp4-sgd":
        return
    # the same plan applied in process: one tensor under both names, through training steps
    script = tmp_path / "apply_and_step.py"
    script.write_text(APPLY_AND_STEP)
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "4"]
    rc, text = run_bounded(
        [*torchrun, str(script), str(out / "plan.json")], tmp_path, TIMEOUT_S, DIST_TIMEOUT_S="120"
    )
    assert rc == 0, text[-4000:]
    facts = json.loads(next(x for x in text.splitlines() if x.startswith("FACTS "))[6:])
    assert facts["tied_after_apply"] and facts["tied_after_steps"], facts
    # the blocks, pos_emb and ln_f are units; tok_emb and head belong to the root
    assert facts["units"] == sorted(["pos_emb", "blocks.0", "blocks.1", "ln_f"]), facts
    assert facts["params"] == facts["built"] == facts["names"] - 1, facts  # one shared tensor


@pytest.mark.dist
def test_hf_tiny_gpt2_tied_fsdp2_verifies(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    # examples/hf/tiny-gpt2.json unties its head; GPT-2's own default ties it to wte
    config = json.loads(Path(HF_TINY).read_text()) | {"tie_word_embeddings": True}
    (tmp_path / "tied-gpt2.json").write_text(json.dumps(config))
    plan = _plan({"fsdp": 2}, f"hf:{tmp_path / 'tied-gpt2.json'}", cluster="cpu:2", optimizer="sgd")
    out = write_outputs(plan, tmp_path / "out")
    text = _launch(plan, out, "sgd")
    line = "tied parameters: transformer.wte, lm_head stay in the root FSDP unit"
    assert line in text, text[-4000:]
    m = VERIFY_OK.search(text)
    assert m and float(m.group(1)) <= 1e-5 and float(m.group(2)) <= 1e-5, text[-4000:]
