"""A rank's peak memory (cost_model/peak.py): the backward's and the optimizer step's moments
against brute force and against the allocations of a real single-process step."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from _plans import ROOT, run_bounded
from autopar.cost_model import peak
from autopar.cost_model.catalog import cpu_device, device

from autopar.api import plan_model_file
from autopar.model_file import load_model_file


def _brute_backward(acts, grads, out, recompute):
    """Every moment of a backward, step by step: the loss's copies on top of all activations,
    then per layer (last first) its gradients appear (and its recompute runs) before its saved
    activations go; the output is held throughout."""
    held, g = list(acts), 0.0
    moments = [sum(held) + peak.LOSS_COPIES * out]
    for i in reversed(range(len(acts))):
        g += grads[i]
        moments.append(sum(held) + g + recompute[i])
        held[i] = 0.0
        moments.append(sum(held) + g)
    return out + max(moments)


@pytest.mark.parametrize("seed", range(20))
def test_single_pass_backward_matches_brute_force(seed):
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 7, (1,), generator=gen))
    acts, grads, rec = (torch.rand(n, generator=gen).tolist() for _ in range(3))
    rec = [r if r > 0.5 else 0.0 for r in rec]
    out = float(torch.rand(1, generator=gen))
    got = peak.single_pass_backward_bytes(acts, grads, out, rec)
    assert got == pytest.approx(_brute_backward(acts, grads, out, rec))


def test_optimizer_temporaries_and_headroom_by_device():
    cpu, gpu = cpu_device(2), device("H100")
    # for-loop AdamW on CPU: two copies of the largest tensor; foreach on CUDA: one of all
    assert peak.optimizer_temp_bytes(cpu, "adamw", 10.0, 100.0) == 20.0
    assert peak.optimizer_temp_bytes(gpu, "adamw", 10.0, 100.0) == 100.0
    assert peak.optimizer_temp_bytes(cpu, "sgd", 10.0, 100.0) == 0.0
    # fused AdamW (torchtitan's and Megatron-LM's, benchmarks/published_runs.py): none
    assert peak.optimizer_temp_bytes(gpu, "adamw", 10.0, 100.0, fused=True) == 0.0
    # the headroom is the device's figure, never more than the step frees; none on a datasheet GPU
    cap = cpu.allocator_headroom_bytes
    assert cap > 0 and gpu.allocator_headroom_bytes == 0
    assert peak.headroom_bytes(cpu, 1e12) == cap and peak.headroom_bytes(cpu, 5.0) == 5.0
    assert peak.loss_bytes(8.0) == 32.0  # the output and the loss's three copies


def _measured_step_peak(model, batch, target, opt) -> int:
    """Bytes alive at the step's peak above parameters and optimizer state, from the
    profiler's allocation records of one step (after two warm-up steps)."""

    def step():
        out = model(batch)
        loss = F.cross_entropy(out.flatten(0, 1), target.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out  # the loop holds its output through the optimizer step

    for _ in range(2):
        step()
    acts = torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[acts], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = itertools.accumulate(e.nbytes() for e in sorted(events, key=lambda e: e.start_ns()))
    return max(live)


def test_predicted_peak_equals_a_real_steps_allocations(monkeypatch):
    """GPT (2 layers, 128 wide, vocab 2048; 2 x 64 tokens; fp32 AdamW) on one CPU rank: the
    predicted moment (activations + gradients, the headroom aside) within 1% of the most bytes
    a real step holds at once above its parameters and AdamW state; here the optimizer step's
    moment (gradients, the held logits, two copies of the 1 MiB embedding) is the larger."""
    sizes = {"GPT_DIM": "128", "GPT_HEADS": "4", "GPT_LAYERS": "2", "GPT_VOCAB": "2048",
             "GPT_MAX_SEQ": "64"}  # fmt: skip
    for k, v in sizes.items():
        monkeypatch.setenv(k, v)
    mf = load_model_file(str(ROOT / "examples" / "gpt.py"))
    plan = plan_model_file(mf, "cpu:1", global_batch=2, seq_len=64)
    m = plan.predicted.memory_breakdown_bytes
    predicted = m.activations + m.grads
    torch.manual_seed(0)
    model = mf.build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    (idx,), target = mf.make_batch(2, 64)
    measured = _measured_step_peak(model, idx, target, opt)
    assert predicted == pytest.approx(measured, rel=0.01), (predicted, measured)
    # the headroom the buffers hold: the device's figure, at most the moment
    assert m.buffers == min(cpu_device(1).allocator_headroom_bytes, predicted)


@pytest.mark.parametrize(("schedule", "in_flight"), [("Schedule1F1B", 1), ("ScheduleGPipe", 4)])
def test_a_pipeline_holds_the_loss_of_the_microbatches_in_flight_only(
    tmp_path, schedule, in_flight
):
    """rank_memory charges a pipeline's last stage the loss's tensors of each microbatch in
    flight (the stage plan's activations), not of every microbatch of the step: stepped with
    return_outputs=False, as the emitted program steps it, torch's schedules free a
    microbatch's output and what its loss saved with its backward (1F1B: one at a time; GPipe:
    all four forwards before the first backward)."""
    script = ROOT / "tests" / "harness" / "pipeline_holds.py"
    cmd = ["torchrun", "--standalone", "--nproc-per-node", "2", str(script), schedule]
    rc, out = run_bounded(cmd, tmp_path, 120)
    assert rc == 0, out[-3000:]
    held = [
        tuple(map(int, line.split()[1:])) for line in out.splitlines() if line.startswith("held")
    ]
    assert len(held) >= 4, out[-3000:]
    # before each microbatch's loss: earlier outputs and cross-entropy's saved tensors alive
    assert max(h[0] for h in held) == in_flight - 1, held
    assert max(h[1] for h in held) == 2 * (in_flight - 1), held  # log-softmax's result, nll's
