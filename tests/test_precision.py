"""Frozen parameters and precision regimes in the memory and communication model: the IR records
what is frozen, the planner charges it no gradients, optimizer state or gradient traffic, and a
bf16 plan is charged what the emitted script holds (cost_model.precision)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from _plans import allocator_buffers
from autopar.cost_model.precision import AUTOCAST_BF16, FSDP2_BF16
from autopar.ir import trace

from autopar.api import plan_model_file
from autopar.model_file import build_on_meta, example_inputs, load_model_file

MODEL = textwrap.dedent(
    """
    import os

    import torch
    from torch import nn

    WIDTH = int(os.environ.get("FROZEN_TEST_WIDTH", 64))
    BLOCKS = 6


    class Net(nn.Module):
        def __init__(self, frozen: int) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(BLOCKS))
            self.head = nn.Linear(WIDTH, 10)
            for block in list(self.blocks)[:frozen]:
                block.requires_grad_(False)

        def forward(self, x):
            for block in self.blocks:
                x = torch.relu(block(x))
            return self.head(x)


    def build_model():
        return Net(frozen=0)


    def build_frozen():
        # a frozen backbone half: the first 3 of the 6 blocks
        return Net(frozen=3)


    def make_batch(batch_size, seq_len=None):
        return (torch.randn(batch_size, WIDTH),), torch.randint(0, 10, (batch_size,))
    """
)


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "frozen_model.py"
    path.write_text(MODEL)
    return path


def _frozen_numel(width: int = 64) -> int:
    return 3 * (width * width + width)


def _plan(path, factory, cluster="cpu:1", **kw):
    return plan_model_file(load_model_file(f"{path}:{factory}"), cluster, global_batch=8, **kw)


def _static(plan) -> int:
    m = plan.predicted.memory_breakdown_bytes
    return m.params + m.grads + m.optimizer


def test_ir_records_frozen_parameters_per_layer(model_file):
    """Each layer says how many of its parameters are frozen; folding the repeated blocks (a
    frozen block is not a copy of a trainable one) gives the same layers as tracing whole."""
    mf = load_model_file(f"{model_file}:build_frozen")
    model = build_on_meta(mf)
    args, _ = example_inputs(mf, model, 2, None)
    graph = trace(model, tuple(args))
    whole = trace(model, tuple(args), fold=False)
    frozen = {layer.fqn: layer.frozen_numel for layer in graph.layers}
    assert frozen == {layer.fqn: layer.frozen_numel for layer in whole.layers}
    assert frozen == {**{f"blocks.{i}": 64 * 64 + 64 for i in range(3)},
                      **{f"blocks.{i}": 0 for i in range(3, 6)}, "head": 0}  # fmt: skip
    assert graph.trainable_numel == graph.num_params - _frozen_numel()
    assert graph.layer("blocks.0").frozen_bytes == 4 * (64 * 64 + 64)
    assert graph.modules["blocks.0"].frozen == ("weight", "bias")
    assert graph.trainable_param_tensors == 2 * 3 + 2
    # autograd saves nothing for the frozen prefix: its input needs no grad
    assert graph.layer("blocks.0").saved_bytes == 0
    assert graph.layer("blocks.5").saved_bytes > 0


@pytest.mark.parametrize(
    ("cluster", "mesh", "shards"),
    [("cpu:1", None, 1), ("cpu:2", {"fsdp": 2}, 2), ("cpu:2", {"dp": 2}, 1)],
)
def test_frozen_half_saves_exactly_its_grads_and_optimizer_state(model_file, cluster, mesh,
                                                                 shards):  # fmt: skip
    """The same model, half of it frozen, is predicted lighter by exactly the fp32 gradients
    (4 B) and AdamW moments (8 B) of the frozen parameters, sharded as the plan shards them;
    its parameters stay. DDP's gradient buckets shrink by the frozen gradients too, and the
    optimizer step and the data-parallel traffic get faster."""
    kw = {"mesh": mesh} if mesh else {}
    full = _plan(model_file, "build_model", cluster, **kw)
    half = _plan(model_file, "build_frozen", cluster, **kw)
    assert full.mesh == half.mesh
    f, h = full.predicted.memory_breakdown_bytes, half.predicted.memory_breakdown_bytes
    frozen = _frozen_numel()
    assert f.params == h.params
    assert f.grads - h.grads == frozen * 4 // shards
    assert f.optimizer - h.optimizer == frozen * 8 // shards
    assert _static(full) - _static(half) == frozen * 12 // shards
    if mesh == {"dp": 2}:  # DDP buckets: a 4-byte copy of the trainable gradients
        assert allocator_buffers(f) - allocator_buffers(h) == frozen * 4
    ft, ht = full.predicted.time_breakdown_s, half.predicted.time_breakdown_s
    assert ht.optimizer < ft.optimizer
    if mesh:
        assert ht.dp_comm < ft.dp_comm


def test_bf16_plans_are_charged_what_the_script_holds(model_file):
    """bf16 with FSDP2 (MixedPrecisionPolicy): fp32 sharded parameters, gradients and AdamW
    state (4 + 4 + 8 B, halved over fsdp=2), the largest unit gathered in bf16 with its bf16
    unsharded gradients and fp32 reduce-scatter input; bf16 with DDP (autocast): fp32 everything,
    fp32 buckets and the bf16 weight copies autocast makes."""
    numel = 6 * (64 * 64 + 64) + 64 * 10 + 10
    frozen = _frozen_numel()
    fsdp = _plan(model_file, "build_frozen", "cpu:2", dtype="bf16", mesh={"fsdp": 2})
    m = fsdp.predicted.memory_breakdown_bytes
    assert (m.params, m.grads, m.optimizer) == (
        numel * 4 // 2, (numel - frozen) * 4 // 2, (numel - frozen) * 8 // 2)  # fmt: skip
    block = 64 * 64 + 64  # the largest unit: a trainable block
    assert allocator_buffers(m) == FSDP2_BF16.fsdp_unit_bytes(block, block) == block * 8
    ddp = _plan(model_file, "build_frozen", "cpu:2", dtype="bf16", mesh={"dp": 2})
    m = ddp.predicted.memory_breakdown_bytes
    assert (m.params, m.grads, m.optimizer) == (
        numel * 4, (numel - frozen) * 4, (numel - frozen) * 8)  # fmt: skip
    assert allocator_buffers(m) == (numel - frozen) * AUTOCAST_BF16.bucket + numel * 2


@pytest.mark.slow
def test_frozen_half_measured_peak_agrees(model_file, tmp_path):
    """Emitted and run (one process, 3 AdamW steps): the frozen-half model's peak RSS is lower
    than the all-trainable one's by about the predicted 12 bytes per frozen parameter (within
    25%: RSS moves by tens of MiB between runs; the frozen part here is ~200 MB)."""
    width = 2048
    env = {"FROZEN_TEST_WIDTH": str(width), "OMP_NUM_THREADS": "1"}
    measured, predicted = {}, {}
    for factory in ("build_model", "build_frozen"):
        out = tmp_path / factory
        subprocess.run(
            [sys.executable, "-m", "autopar", f"{model_file}:{factory}", "--cluster", "cpu:1",
             "--global-batch", "8", "--out", str(out), "-q"],
            env={**_environ(), **env}, check=True, timeout=300,
        )  # fmt: skip
        plan = json.loads((out / "plan.json").read_text())
        predicted[factory] = plan["predicted"]["peak_memory_bytes"]
        proc = subprocess.run(
            [sys.executable, str(out / "train.py"), "--steps", "3"],
            env={**_environ(), **env}, cwd=tmp_path, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        steps = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
        measured[factory] = max(s["peak_memory_bytes"] for s in steps)
    expected = _frozen_numel(width) * 12
    assert predicted["build_model"] - predicted["build_frozen"] >= expected
    saved = measured["build_model"] - measured["build_frozen"]
    print(f"frozen half: predicted static saving {expected / 2**20:.1f} MiB, measured peak RSS "
          f"saving {saved / 2**20:.1f} MiB")  # fmt: skip
    assert 0.75 * expected <= saved <= 1.25 * expected, (saved, expected, measured)


def _environ() -> dict[str, str]:
    import os

    return dict(os.environ)
