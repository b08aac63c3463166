"""Weights read outside their module (issue 28, item 2): ``F.linear(x, self.wte.weight)`` as the
head, a tie without a shared module, and weights and biases read by hand (a block's
``h @ self.down.weight.t() + self.down.bias``, the root's ``F.layer_norm(x, ..., self.ln_f.weight,
self.ln_f.bias)``); the fixtures are ``tests/models/gpt_read_tie.py``.

Before, FSDP2 and cp crashed on every rank (``aten.mm.default got mixed torch.Tensor and
DTensor``): ``wte`` was an FSDP2 unit of its own, sharded again when the root read its weight.
The planner finds such reads in the traced graph (``request.outside_reads``) and plans them as
a tie: the layer joins the root FSDP2 unit (``Plan.fsdp_root`` -> ``FSDP_ROOT``), TP leaves a
module whose weight is read elsewhere replicated, and a pipeline is refused at plan time in one
line naming the parameter, its module, the line that reads it and the fix (pp=1).

The default tier runs the head tie under fsdp=2 (the crash); dp=2, tp=2 (shards asserted) and
cp=2 of it, and every mesh of the by-hand reads, are slow.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _plans import run_bounded, show_params, tiered
from autopar.codegen import write_outputs
from autopar.ir import trace
from autopar.planner.request import outside_reads, root_unit_layers, tied_layers
from torch import nn

from autopar.api import plan_model_file
from autopar.cli import main
from autopar.model_file import build_on_meta, load_model_file

MODELS = Path(__file__).resolve().parent / "models"
MODEL = str(MODELS / "gpt_read_tie.py")
BY_HAND = f"{MODEL}:build_bias_read"
TIMEOUT_S = 300
VERIFY_OK = re.compile(r"^verify: ok max_loss_diff=(\S+) max_param_diff=(\S+)$", re.MULTILINE)


def _plan(spec: str, mesh: dict, **kw):
    return plan_model_file(
        load_model_file(spec), "cpu:2", global_batch=8, seq_len=16, mesh=mesh, **kw
    )


# -- at plan time ------------------------------------------------------------------------------


def test_pipeline_refusal_names_the_parameter_module_line_and_fix(capsys) -> None:
    argv = [MODEL, "--cluster", "cpu:2", "--global-batch", "8", "--seq-len", "16"]
    try:
        code = main([*argv, "--mesh", "pp=2"])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: --mesh pp=2: "), err
    for part in (
        "wte.weight, a parameter of module wte, is read outside its layer wte",
        "in the root's forward at gpt_read_tie.py:",
        "(`return F.linear(self.ln_f(x), self.wte.weight)`)",
        "pipeline stages cannot split them",
        "plan without a pipeline (pp=1)",
    ):
        assert part in lines[0], (part, err)


def _graph(spec: str):
    model = build_on_meta(load_model_file(spec))
    return trace(model, (torch.zeros(2, 16, dtype=torch.long, device="meta"),))


def test_reads_are_found_where_they_are() -> None:
    """The head tie is a read outside ``wte``'s layer, by the root, and puts ``wte`` in the root
    FSDP2 unit; the by-hand reads are not outside a layer (``down`` is read inside its block;
    ``ln_f``, never called, is no layer: the root unit holds it anyway)."""
    graph = _graph(MODEL)
    (param, (layer, node)), *more = outside_reads(graph).items()
    assert not more and (param, layer) == ("wte.weight", "wte"), outside_reads(graph)
    assert node.op == "aten.linear.default" and node.module_stack == (), node
    assert root_unit_layers(graph) == ["wte"]
    assert "read outside its layer wte" in tied_layers(graph)
    graph = _graph(BY_HAND)
    assert outside_reads(graph) == {} and root_unit_layers(graph) == [] and not tied_layers(graph)
    assert "ln_f" not in [x.fqn for x in graph.layers]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x)


class _Reader(_Block):
    """Reads another layer's weight through a reference nn.Module does not register."""

    def __init__(self, other: nn.Linear) -> None:
        super().__init__()
        object.__setattr__(self, "other", other)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + F.linear(x, self.other.weight)


class _Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = _Block()
        self.second = _Reader(self.first.fc)
        self.third = _Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.third(self.second(self.first(x)))


def test_a_weight_read_by_another_layer_is_a_tie_too() -> None:
    """A layer reading another layer's weight: the holder joins the root FSDP2 unit, and the
    two layers are one tie for the pipeline rule, the line naming the reader."""
    with torch.device("meta"):
        model = _Chain()
    graph = trace(model, (torch.zeros(2, 8, device="meta"),))
    (param, (layer, node)), *more = outside_reads(graph).items()
    assert not more and (param, layer, node.module_stack) == (
        "first.fc.weight",
        "first",
        ("second",),
    )
    assert root_unit_layers(graph) == ["first"]
    why = tied_layers(graph)
    assert why.startswith(
        "first.fc.weight, a parameter of module first.fc, is read outside its layer first, in second at test_read_outside.py:"
    ), why
    assert why.endswith("so layers first and second read the same (tied) parameter"), why


# -- the emitted program -----------------------------------------------------------------------

# name -> model, mesh; the default tier runs the head tie under fsdp=2 (the crash before)
CASES = {
    "tie-fsdp2": (MODEL, {"fsdp": 2}),
    "tie-dp2": (MODEL, {"dp": 2}),
    "tie-tp2": (MODEL, {"tp": 2}),
    "tie-cp2": (MODEL, {"cp": 2}),
    "by-hand-fsdp2": (BY_HAND, {"fsdp": 2}),
    "by-hand-dp2": (BY_HAND, {"dp": 2}),
    "by-hand-tp2": (BY_HAND, {"tp": 2}),
    "by-hand-pp2": (BY_HAND, {"pp": 2}),
    "by-hand-cp2": (BY_HAND, {"cp": 2}),
}


@pytest.mark.dist
@pytest.mark.parametrize("name", tiered(CASES, slow=set(CASES) - {"tie-fsdp2"}))
def test_reads_outside_train_like_one_process(name: str, tmp_path: Path) -> None:
    """3 SGD steps with --verify: loss and parameters match the single process within 1e-5
    (before: fsdp=2 and cp=2 crashed on every rank). Under data parallelism over FSDP2 the tied
    layer is in the root unit; under tp=2 the blocks' Megatron pairs are sharded and the modules
    whose weights are read elsewhere are whole."""
    spec, mesh = CASES[name]
    plan = _plan(spec, mesh, optimizer="sgd")
    assert all(getattr(plan.mesh, k) == v for k, v in mesh.items()), plan.mesh
    assert plan.fsdp_root == (["wte"] if spec == MODEL else []), plan.fsdp_root
    out = write_outputs(plan, tmp_path / "out")
    rc, text = run_bounded(
        ["bash", "launch.sh", "--steps", "3", "--verify", "--optimizer", "sgd"],
        out,
        TIMEOUT_S,
        DIST_TIMEOUT_S="120",
    )
    assert rc == 0, text[-4000:]
    m = VERIFY_OK.search(text)
    assert m and float(m.group(1)) <= 1e-5 and float(m.group(2)) <= 1e-5, text[-4000:]
    root = "tied parameters: wte stay in the root FSDP unit"
    assert (root in text) == (spec == MODEL and plan.mesh.fsdp * plan.mesh.cp > 1), text[-4000:]
    if "tp" in mesh:
        _assert_sharded(plan, out, tmp_path, spec)


def _assert_sharded(plan, out: Path, tmp_path: Path, spec: str) -> None:
    """The blocks' attention output and MLP up projection are sharded; the modules whose
    weights are read outside them (wte, each block's down, ln_f) are whole on every rank."""
    styles = plan.tensor_parallel
    assert styles["blocks.0.attn.proj"] == "rowwise", styles
    params = show_params(out, tmp_path)
    placement, local, whole = params["blocks.0.attn.proj.weight"]
    assert placement == ["Shard", 1] and local[1] * 2 == whole[1], params
    placement, local, whole = params["blocks.1.up.weight"]
    assert placement == ["Shard", 0] and local[0] * 2 == whole[0], params
    if spec == MODEL:  # the embedding whose weight the head reads
        read, whole_names = ["wte"], ["wte.weight"]
    else:  # the projections and the norm read by hand (the embedding itself is sharded)
        read = ["blocks.0.down", "blocks.1.down", "ln_f"]
        whole_names = ["blocks.0.down.weight", "blocks.1.down.bias", "ln_f.weight", "ln_f.bias"]
        assert params["wte.weight"] is not None, params
    assert not any(fqn in styles for fqn in read), styles
    assert all(params[n] is None for n in whole_names), params
