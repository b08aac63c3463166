"""Expert parallelism for the MoE layouts people write: experts in an ``nn.ModuleList`` (one
module each, called from the block's own loop) and a shared expert beside stacked experts.

ModuleList experts run under ep by record and replay (autopar_runtime/expert_parallel.py): each
rank keeps the modules of its E/ep experts, the block's forward records its calls to the
experts, the rows go to their owners by one all-to-all, and the block's forward runs again
answered with the outputs. Each case plans through the real planner and runs the emitted
script under ``torchrun --standalone`` with ``--verify``; the report names the expert modules
each rank holds. A list whose experts read one another's outputs (chained) is refused at plan
time with one line.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _plans import run_bounded
from autopar.codegen import write_outputs

from autopar.model_file import load_model_file

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests" / "models"
MOE_TOP2 = str(MODELS / "moe_top2.py")  # ModuleList experts, top-2, torch.where dispatch
MOE_DENSE = str(MODELS / "moe.py")  # ModuleList experts, every expert on every token
MOE_CHAINED = str(MODELS / "moe_chained.py")
MOE_SHARED = str(MODELS / "moe_shared.py")  # shared MLP beside stacked experts
MOE_INLINE = str(MODELS / "moe_shared_inline.py")  # experts stacked on the block, shared MLP
SEQ = 16
TIMEOUT_S = 300
VERIFY_OK = re.compile(r"^verify: ok max_loss_diff=(\S+) max_param_diff=(\S+)$", re.MULTILINE)
HELD = re.compile(r"^expert parallel: rank (\d+) holds experts (\d+)-(\d+) of (\d+): (.*)$", re.M)
SENT = re.compile(r"^expert parallel: (\d+) of (\d+) routes sent to another ep rank", re.M)
CHAINED = (
    "--mesh ep=2: MoE block blocks.0.moe: its expert blocks.0.moe.experts.1 reads another "
    "expert's output (experts chained; expert parallelism records the block's calls to its "
    "experts, then runs them at once): plan with --mesh ep=1"
)
INLINE = (
    "--mesh ep=2: MoE block blocks.0.moe: its stacked experts' module blocks.0.moe also holds "
    "blocks.0.moe.gate.weight, not an expert weight (expert parallelism splits a module holding "
    "only the experts' weights, first dim = experts, called as experts(hidden, top_k_index, "
    "top_k_weights)): plan with --mesh ep=1"
)


def _plan(spec: str, world: int, mesh: str, batch: int = 8):
    from autopar.api import plan_model_file

    return plan_model_file(
        load_model_file(spec), f"cpu:{world}", global_batch=batch, seq_len=SEQ, mesh=mesh,
        optimizer="sgd",
    )  # fmt: skip


def _run(plan, tmp_path: Path, *args: str) -> tuple[int, str]:
    out = write_outputs(plan, tmp_path / "out")
    cmd = ["torchrun", "--standalone", f"--nproc-per-node={plan.world_size}", "train.py", *args]
    return run_bounded(cmd, out, TIMEOUT_S, DIST_TIMEOUT_S="120")


def _check(plan, rc: int, out: str, ep: int, listed: bool = True) -> None:
    """--verify holds; each rank held E/ep experts (ep ranks of a group different ones, every
    expert held): with a module list, the modules named are its own experts' (their parameter
    names unchanged); routes crossed ranks."""
    assert rc == 0, out[-4000:]
    m = VERIFY_OK.search(out)
    assert m, out[-4000:]
    assert float(m.group(1)) <= 1e-4 and float(m.group(2)) <= 1e-5, m.group(0)
    held = HELD.findall(out)
    assert len(held) == plan.world_size, out[-3000:]
    num = plan.expert_parallel.num_experts
    firsts = set()
    for _, first, last, total, shapes in held:
        first, last = int(first), int(last)
        assert int(total) == num and last - first + 1 == num // ep
        firsts.add(first)
        if listed:  # "blocks.0.moe.experts.2.w1.weight (64, 32), ..."
            indices = [int(i) for i in re.findall(r"\.experts\.(\d+)\.", shapes)]
            assert indices == list(range(first, last + 1)), shapes
        else:
            dims = [int(d) for d in re.findall(r"\((\d+),", shapes)]
            assert dims and all(d == num // ep for d in dims), shapes
    assert firsts == {i * num // ep for i in range(ep)}
    sent = SENT.search(out)
    assert sent and 0 < int(sent.group(1)) < int(sent.group(2)), out[-2000:]


# -- plan-level (no torchrun) --------------------------------------------------------------------
def test_module_list_experts_plan_at_ep2(tmp_path: Path) -> None:
    """ModuleList experts plan at ep=2: the plan names each expert module, the emitted script
    splits them, and the plan keeps the mesh rules when emitted."""
    plan = _plan(MOE_TOP2, 2, "ep=2")
    ep = plan.expert_parallel
    assert plan.mesh.ep == 2 and ep is not None and not ep.grouped
    assert ep.blocks["blocks.1.moe"] == [f"blocks.1.moe.experts.{i}" for i in range(4)]
    assert plan.mesh_refusal() is None
    script = write_outputs(plan, tmp_path / "out").joinpath("train.py").read_text()
    assert '"blocks.0.moe.experts.3",' in script
    assert "rt.apply_expert_parallel(PLAN, model, mesh)" in script


def test_chained_module_list_experts_are_refused_at_plan_time() -> None:
    """Experts that read the running output (each after the one before) cannot be recorded
    and dispatched at once: one line, naming the block and the expert."""
    from autopar.planner.search import PlanningError

    with pytest.raises(PlanningError) as e:
        _plan(MOE_CHAINED, 2, "ep=2")
    assert str(e.value) == CHAINED


def test_experts_stacked_beside_other_weights_are_refused_at_plan_time() -> None:
    """Stacked expert weights held by the MoE block itself beside its router and a shared
    expert (no module of the experts' own to wrap): refused in one line before any run (they
    were accepted, then refused by every rank at run time)."""
    from autopar.planner.search import PlanningError

    with pytest.raises(PlanningError) as e:
        _plan(MOE_INLINE, 2, "ep=2")
    assert str(e.value) == INLINE


# -- emitted and run -----------------------------------------------------------------------------
@pytest.mark.dist
def test_ep2_module_list_top2_verifies(tmp_path: Path) -> None:
    """ep=2 at world 2 on the hand-written top-2 MoE with ModuleList experts (torch.where
    dispatch, load-balancing loss): --verify holds, rank r holds experts 2r and 2r+1."""
    plan = _plan(MOE_TOP2, 2, "ep=2")
    rc, out = _run(plan, tmp_path, "--steps", "3", "--verify")
    _check(plan, rc, out, 2)


@pytest.mark.slow
@pytest.mark.dist
def test_ep2_fsdp2_module_list_world4_verifies(tmp_path: Path) -> None:
    """ep=2 x fsdp=2 x dp=2 at world 4: each expert module an FSDP2 unit over the 2 ranks
    holding it (the gradient norm counts each expert once)."""
    plan = _plan(MOE_TOP2, 4, "ep=2,fsdp=2,dp=2")
    assert (plan.mesh.ep, plan.mesh.fsdp, plan.mesh.dp) == (2, 2, 2)
    rc, out = _run(plan, tmp_path, "--steps", "3", "--verify")
    _check(plan, rc, out, 2)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("mesh", ["pp=2,dp=2,ep=2", "ep=2"], ids=["pp2", "checkpointed"])
def test_ep2_module_list_with_pp_or_checkpointing_verifies(tmp_path: Path, mesh: str) -> None:
    """pp=2 x dp=2 x ep=2 at world 4 (each stage's blocks record and replay; the stage's shape
    inference runs them too), and ep=2 with every layer checkpointed (the recomputation in
    backward records, dispatches and replays again)."""
    from autopar.api import plan_model_file

    world = 4 if "pp" in mesh else 2
    plan = plan_model_file(
        load_model_file(MOE_TOP2), f"cpu:{world}", global_batch=8, seq_len=SEQ, mesh=mesh,
        optimizer="sgd", checkpoint="full" if world == 2 else "auto",
    )  # fmt: skip
    rc, out = _run(plan, tmp_path, "--steps", "3", "--verify")
    _check(plan, rc, out, 2)


@pytest.mark.slow
@pytest.mark.dist
def test_ep2_dense_module_list_verifies(tmp_path: Path) -> None:
    """Every expert on every token (dense dispatch, tests/models/moe.py): ep=2 verifies."""
    plan = _plan(MOE_DENSE, 2, "ep=2")
    rc, out = _run(plan, tmp_path, "--steps", "2", "--verify")
    _check(plan, rc, out, 2)


@pytest.mark.slow
@pytest.mark.dist
def test_ep2_shared_expert_beside_stacked_verifies(tmp_path: Path) -> None:
    """A DeepSeek-style block (a shared MLP on every token beside routed stacked experts): the
    shared expert is an ordinary module (FSDP2 with the rest), the stacked experts split."""
    plan = _plan(MOE_SHARED, 2, "ep=2")
    assert plan.expert_parallel.blocks == {
        f"blocks.{i}.moe": [f"blocks.{i}.moe.experts"] for i in range(2)
    }
    rc, out = _run(plan, tmp_path, "--steps", "3", "--verify")
    _check(plan, rc, out, 2, listed=False)


def _hf_tensors(directory: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def _same(a: dict, b: dict) -> None:
    import torch

    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].shape == b[name].shape and torch.equal(a[name], b[name]), name


def _loss(out: str, step: int) -> float:
    import json

    lines = [json.loads(x) for x in out.splitlines() if x.startswith('{"step"')]
    return next(r["loss"] for r in lines if r["step"] == step)


@pytest.mark.slow
@pytest.mark.dist
def test_module_list_ep_checkpoints_cross_plans(tmp_path: Path) -> None:
    """The experts keep the single-process model's names, each saved once by its owner: an
    ep=2 checkpoint (AdamW) loads under dp=2 x ep=1 exactly (their --save-hf equal bit for bit,
    every expert there), both resume it to the same step-3 loss (1e-5), and ep=2 loads the
    dp=2 run's step-3 checkpoint exactly."""
    import shutil

    adamw = ("--optimizer", "adamw", "--lr", "0.01")
    ep2, dp2 = _plan(MOE_TOP2, 2, "ep=2"), _plan(MOE_TOP2, 2, "dp=2,ep=1")
    ckpt = tmp_path / "ep2"
    args = ("--steps", "2", "--checkpoint-every", "2", "--checkpoint-dir", str(ckpt))
    rc, out = _run(ep2, tmp_path / "a", *args, "--save-hf", str(tmp_path / "hf_a"), *adamw)
    assert rc == 0 and "saved step 2" in out, out[-3000:]
    saved = _hf_tensors(tmp_path / "hf_a")
    assert sum(".experts." in k for k in saved) == 2 * 4 * 4  # 2 blocks, 4 experts, 4 tensors
    losses = {}
    for name, plan in (("ep2", ep2), ("dp2", dp2)):
        work = tmp_path / name
        (work / "ckpt").mkdir(parents=True)
        shutil.copytree(ckpt / "step_2", work / "ckpt" / "step_2")
        args = ("--checkpoint-dir", str(work / "ckpt"), "--save-hf", str(work / "hf"), *adamw)
        rc, out = _run(plan, work / "load", "--steps", "2", *args)
        assert rc == 0 and "resumed from step 2" in out, out[-3000:]
        _same(_hf_tensors(work / "hf"), saved)
        rc, out = _run(plan, work / "train", "--steps", "3", "--checkpoint-every", "3", *args)
        assert rc == 0 and "saved step 3" in out, out[-3000:]
        losses[name] = _loss(out, 3)
    assert abs(losses["ep2"] - losses["dp2"]) <= 1e-5 * (1 + abs(losses["dp2"])), losses
    back = tmp_path / "back"
    (back / "ckpt").mkdir(parents=True)
    shutil.copytree(tmp_path / "dp2" / "ckpt" / "step_3", back / "ckpt" / "step_3")
    args = ("--checkpoint-dir", str(back / "ckpt"), "--save-hf", str(back / "hf"), *adamw)
    rc, out = _run(ep2, back / "load", "--steps", "3", *args)
    assert rc == 0 and "resumed from step 3" in out, out[-3000:]
    _same(_hf_tensors(back / "hf"), _hf_tensors(tmp_path / "dp2" / "hf"))
