"""Batch-coupled models (issue 28, item 8): a batch norm in training mode and a contrastive
loss over the batch mean something else on a data-parallel rank's slice than on the global batch.

- at plan time: ``ir.coupling`` finds them (batch norms, batch x batch products in the forward
  or in ``loss_fn``, a MoE's routing), and ``planner.request.batch_coupling_rule`` warns in one
  line naming the module or the loss op and the fix (``--sync-batchnorm``; a ``gather`` keyword
  on ``loss_fn``), recorded in plan.json's ``batch_coupling``;
- ``--verify`` compares with the single-process model on the GLOBAL batch: the default tier runs
  the BatchNorm CNN under dp=2 without the fix, whose gradients differ from the global batch's,
  and --verify says FAILED; the slow tier shows the old per-slice comparison (VERIFY_REFERENCE
  "rank slices") says ok on that very run, and that the fixes verify: synced batch norms and the
  gathered contrastive loss under dp=2 and fsdp=2, a pipeline with one microbatch, tp=2.

Models: ``tests/models/batchnorm_cnn.py`` (Conv2d + BatchNorm2d blocks, a BatchNorm1d MLP head)
and ``tests/models/clip_contrastive.py`` (a dual tower, CLIP's symmetric InfoNCE in loss_fn).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from _plans import run_bounded, show_params
from autopar.codegen import write_outputs
from autopar.ir import trace
from autopar.ir.coupling import Coupling, graph_coupling, loss_coupling, takes_gather
from autopar.planner.explain import explain
from autopar.planner.plan import Mesh, Schedule, Training
from autopar.planner.request import batch_coupling_rule
from torch import nn

from autopar import Plan
from autopar.api import plan_model_file
from autopar.cli import main
from autopar.model_file import load_model_file

MODELS = Path(__file__).resolve().parent / "models"
BN = str(MODELS / "batchnorm_cnn.py")
CLIP = str(MODELS / "clip_contrastive.py")
PER_PAIR = str(MODELS / "clip_scalar.py")  # a per-pair loss: no coupling
TIMEOUT_S = 300
VERIFY_OK = re.compile(r"^verify: ok max_loss_diff=(\S+) max_param_diff=(\S+)$", re.MULTILINE)
VERIFY_FAILED = re.compile(r"^verify: FAILED (.*)$", re.MULTILINE)


def _plan(model: str, mesh: dict, **kw):
    world = 1
    for degree in mesh.values():
        world *= degree
    mf = load_model_file(model)
    return plan_model_file(mf, f"cpu:{world}", global_batch=8, mesh=mesh, optimizer="sgd", **kw)


def _run(plan, out: Path, edit=None) -> tuple[int, str, list[dict]]:
    """Emit ``plan`` into ``out`` (``edit``: a change to train.py's text), run 3 SGD steps with
    --verify; (exit code, output, the logged steps)."""
    write_outputs(plan, out)
    if edit is not None:
        script = out / "train.py"
        script.write_text(edit(script.read_text()))
    args = ["--steps", "3", "--verify", "--optimizer", "sgd", "--lr", "0.1"]
    rc, text = run_bounded(["bash", "launch.sh", *args], out, TIMEOUT_S, DIST_TIMEOUT_S="120")
    steps = [json.loads(line) for line in text.splitlines() if line.startswith('{"step"')]
    return rc, text, steps


def _meta_graph(model: nn.Module, *args: torch.Tensor):
    with torch.device("meta"):
        return trace(model.to("meta"), tuple(a.to("meta") for a in args), {})


# -- plan time: the analysis and the rule (pure) ---------------------------------------------------


def test_ir_finds_batch_norms_and_contrastive_products() -> None:
    mf = load_model_file(BN)
    with torch.device("meta"):
        cnn = mf.build()
    found = graph_coupling(_meta_graph(cnn, torch.zeros(2, 3, 8, 8)))
    assert [(c.kind, c.where, c.module_type) for c in found] == [
        ("batch_norm", "block1.bn", "BatchNorm2d"),
        ("batch_norm", "block2.bn", "BatchNorm2d"),
        ("batch_norm", "bn", "BatchNorm1d"),
    ]

    class Similarity(nn.Module):  # CLIP's logits in the forward, as HF's CLIPModel has them
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 3), nn.Linear(5, 3)

        def forward(self, x, y):
            return self.a(x) @ self.b(y).T

    found = graph_coupling(_meta_graph(Similarity(), torch.zeros(2, 4), torch.zeros(2, 5)))
    assert [(c.kind, c.where, c.op) for c in found] == [
        ("batch_product", "", "aten.matmul.default")
    ]

    clip = load_model_file(CLIP)
    with torch.device("meta"):
        tower = clip.build()
        (pixels, ids), target = clip.make_batch(7)
    assert graph_coupling(_meta_graph(tower, pixels[:2], ids[:2])) == ()  # the towers are not
    found = loss_coupling(clip.loss_fn, tower(pixels, ids), target, 7)
    assert {(c.kind, c.where, c.op) for c in found} == {
        ("batch_product", "loss_fn", "aten.mm.default")
    }
    assert found[0].source == "clip_contrastive.py:78"
    assert takes_gather(clip.loss_fn) and not takes_gather(load_model_file(PER_PAIR).loss_fn)


def test_rule_names_the_coupling_and_the_fix() -> None:
    norm = Coupling("batch_norm", "block1.bn", "aten.batch_norm.default", "BatchNorm2d")
    product = Coupling("batch_product", "loss_fn", "aten.mm.default", "", "clip.py:9")
    training = Training(global_batch=8)
    one = Schedule()

    def rule(couplings, mesh, schedule=one, **kw):
        return batch_coupling_rule(couplings, Mesh(**mesh), schedule, training, **kw)

    assert rule([], {"dp": 2}) is None
    assert rule([norm], {"tp": 2}).warnings == []  # the batch is whole on every rank
    (line,) = rule([norm], {"dp": 2}).warnings
    assert line == (
        "BatchNorm2d 'block1.bn' takes its batch statistics over each rank's 4 samples, not the "
        "global batch of 8 (dp x fsdp = 2): pass --sync-batchnorm to take them over the "
        "data-parallel ranks' samples"
    )
    synced = rule([norm], {"fsdp": 2}, sync_batchnorm=True)
    assert synced.sync_batchnorm and synced.warnings == []
    (line,) = rule([norm], {"fsdp": 2}, Schedule(num_microbatches=2), sync_batchnorm=True).warnings
    assert "over 4 samples per forward" in line and "--microbatches 1" in line
    (line,) = rule([product], {"dp": 2}).warnings
    assert line.startswith("loss_fn's batch x batch product (aten.mm.default at clip.py:9)")
    assert "give loss_fn a gather keyword" in line
    gathered = rule([product], {"dp": 2}, loss_gathers=True)
    assert gathered.gather_loss and gathered.warnings == []
    forward = Coupling("batch_product", "", "aten.matmul.default", "Similarity", "m.py:3")
    assert rule([forward], {"tp": 2}).warnings == []
    (line,) = rule([forward], {"dp": 2}).warnings
    assert line.startswith("the root module multiplies two batch-major tensors into a batch x")
    assert "(aten.matmul.default at m.py:3), which sees 4 of the global batch's 8" in line
    routing = Coupling("routing", "blocks.0.moe", "blocks.0.moe", "MoE")
    assert rule([routing], {"dp": 2}).verify_reference == "rank slices"
    with pytest.raises(ValueError, match="^--sync-batchnorm: the model has no batch norm"):
        rule([product], {"dp": 2}, sync_batchnorm=True)


def test_cli_warns_in_one_line_and_refuses_sync_without_batch_norm(capsys) -> None:
    argv = ["--cluster", "cpu:2", "--global-batch", "8", "--json", "--quiet"]
    assert main([BN, *argv[:-1], "--mesh", "dp=2"]) == 0
    out, err = capsys.readouterr()
    plan = json.loads(out)
    warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert warnings == [f"warning: {plan['batch_coupling']['warnings'][0]}"], err
    assert "BatchNorm2d 'block1.bn'" in warnings[0] and "--sync-batchnorm" in warnings[0]
    wheres = [c["where"] for c in plan["batch_coupling"]["couplings"]]
    assert wheres == ["block1.bn", "block2.bn", "bn"]
    text = explain(Plan.from_json(out)).text  # --explain lists each coupling
    assert re.search(r"'block2.bn' +batch_norm +BatchNorm2d +per rank", text), text
    try:
        code = main([CLIP, *argv, "--mesh", "dp=2", "--sync-batchnorm"])
    except SystemExit as e:
        code = e.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: --sync-batchnorm"), lines


# -- --verify against the global batch (gloo, 2 ranks) --------------------------------------------


def _rank_slices(script: str) -> str:
    """The old comparison: the reference trains on each rank's slice (as before this change)."""
    marker = "PLAN = rt.Constants.from_namespace(globals())"
    return script.replace(marker, f'VERIFY_REFERENCE = "rank slices"\n{marker}')


@pytest.mark.dist
def test_verify_catches_per_slice_batch_norm(tmp_path: Path) -> None:
    """dp=2 without --sync-batchnorm: each rank normalizes its 4 samples, the single-process
    model all 8: the gradients differ from the first step and --verify says FAILED."""
    plan = _plan(BN, {"dp": 2})
    assert plan.batch_coupling.warnings and not plan.batch_coupling.sync_batchnorm
    rc, text, steps = _run(plan, tmp_path / "global")
    assert rc == 1, text[-3000:]
    (verdict,) = VERIFY_FAILED.findall(text)
    assert "the reference trained on the global batch of 8, this run on 2 pieces" in verdict
    first = steps[0]
    assert abs(first["grad_norm"] - first["ref_grad_norm"]) > 1e-3 * first["ref_grad_norm"]


@pytest.mark.slow
@pytest.mark.dist
def test_per_slice_reference_would_say_ok_on_that_run(tmp_path: Path) -> None:
    """The same plan, the reference trained on the rank slices (the comparison --verify made
    before): ok, on a run whose gradients differ from the global-batch model's."""
    plan = _plan(BN, {"dp": 2})
    rc, text, steps = _run(plan, tmp_path / "slices", edit=_rank_slices)
    assert rc == 0 and VERIFY_OK.search(text), text[-3000:]
    _, _, global_steps = _run(plan, tmp_path / "global")
    assert abs(steps[0]["grad_norm"] - global_steps[0]["ref_grad_norm"]) > 1e-3


# name -> model, mesh, plan options; each verifies against the global batch
FIXED = {
    "bn_sync_dp2": (BN, {"dp": 2}, {"sync_batchnorm": True}),
    "bn_sync_fsdp2": (BN, {"fsdp": 2}, {"sync_batchnorm": True}),
    "bn_pp2_one_microbatch": (BN, {"pp": 2}, {"microbatches": 1, "schedule": "gpipe"}),
    "clip_gather_dp2": (CLIP, {"dp": 2}, {}),
    "clip_gather_fsdp2": (CLIP, {"fsdp": 2}, {}),
    "clip_tp2": (CLIP, {"tp": 2}, {}),
}


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("case", list(FIXED))
def test_fixed_models_verify_on_the_global_batch(tmp_path: Path, case: str) -> None:
    model, mesh, options = FIXED[case]
    plan = _plan(model, mesh, **options)
    coupling = plan.batch_coupling
    assert coupling is not None and coupling.warnings == [], coupling
    if "gather" in case:
        assert coupling.gather_loss
    if mesh.get("tp"):  # the towers' Linears really are sharded
        assert plan.mesh.tp == 2 and len(plan.tensor_parallel) >= 4, plan.tensor_parallel
    rc, text, _ = _run(plan, tmp_path / case)
    assert rc == 0 and VERIFY_OK.search(text), text[-3000:]
    if mesh.get("tp"):  # the image tower's Megatron pair is split on its ranks
        params = show_params(tmp_path / case, tmp_path)
        for fqn, dim in (("image.fc1.weight", 0), ("image.fc2.weight", 1)):
            placement, local, whole = params[fqn]
            assert placement == ["Shard", dim] and local[dim] * 2 == whole[dim], params[fqn]


@pytest.mark.slow
@pytest.mark.dist
def test_contrastive_loss_without_gather_is_warned_and_caught(tmp_path: Path) -> None:
    """A loss_fn without ``gather`` under dp=2: the plan warns naming the loss op and the fix,
    and --verify against the global batch says FAILED."""
    source = Path(CLIP).read_text()
    signature = "def loss_fn(output, target, *, gather=None):\n"
    model = tmp_path / "clip_local.py"
    model.write_text(source.replace(signature, "def loss_fn(output, target):\n    gather = None\n"))
    plan = _plan(str(model), {"dp": 2})
    (line,) = plan.batch_coupling.warnings
    assert line.startswith("loss_fn's batch x batch product (aten.mm.default at clip_local.py:")
    assert "give loss_fn a gather keyword" in line and not plan.batch_coupling.gather_loss
    rc, text, _ = _run(plan, tmp_path / "out")
    assert rc == 1 and VERIFY_FAILED.search(text), text[-3000:]


def test_torch_sync_batchnorm_refuses_cpu_tensors() -> None:
    """Why the runtime syncs batch norms itself (autopar_runtime/global_batch.py): torch 2.13's
    nn.SyncBatchNorm raises on a CPU tensor in training mode under a process group (gloo)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        norm = nn.SyncBatchNorm(4)
        with pytest.raises(ValueError, match="SyncBatchNorm expected input tensor to be on GPU"):
            norm(torch.randn(2, 4))
    finally:
        dist.destroy_process_group()
