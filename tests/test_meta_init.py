"""Build on meta, materialize only the shard: a GPT of ~500M parameters (2 GB of fp32 weights)
trains a step with fsdp=4 on 4 gloo ranks, and no rank's peak RSS reaches the model's weight
bytes (the step line's ``peak_memory_bytes`` is the largest peak RSS, VmHWM, over the ranks)."""

from __future__ import annotations

import json
import math

import pytest
from _plans import GPT, forced_plan, run_bounded
from autopar.codegen import write_outputs

# 40 blocks of 12 * 1024^2 weights (+ biases, norms), token and position embeddings (vocab and
# max_seq 256) and the head: 504M parameters. Blocks of 50 MB keep FSDP's unsharded unit small.
DIM, LAYERS = 1024, 40
SIZES = {"GPT_VOCAB": "256", "GPT_DIM": str(DIM), "GPT_HEADS": "16", "GPT_LAYERS": str(LAYERS)}
NUM_PARAMS = LAYERS * (12 * DIM**2 + 13 * DIM) + 3 * 256 * DIM + 2 * DIM


@pytest.mark.slow
@pytest.mark.dist
def test_500m_gpt_trains_a_step_under_fsdp4_below_the_whole_models_bytes(tmp_path) -> None:
    layers = ["tok_emb", "pos_emb", *(f"blocks.{i}" for i in range(LAYERS)), "ln_f", "head"]
    plan = forced_plan(GPT, 4, {"fsdp": 4}, {}, layers=layers, global_batch=4, seq_len=8,
                       optimizer="sgd")  # fmt: skip
    out = write_outputs(plan, tmp_path / "out")
    rc, log = run_bounded(
        ["bash", "launch.sh", "--steps", "1"], out, 600, DIST_TIMEOUT_S="500", **SIZES
    )
    assert rc == 0, log[-4000:]
    (record,) = [json.loads(line) for line in log.splitlines() if line.startswith('{"step"')]
    assert math.isfinite(record["loss"])
    weight_bytes = 4 * NUM_PARAMS
    assert weight_bytes > 2.0e9
    # Each rank holds a quarter of the weights and of their gradients, a few FSDP units (blocks
    # of 50 MB) unsharded at a time with their communication buffers, and torch itself (0.3 GB):
    # measured 1.6 GB (2.9-3.2 GB with glibc's adaptive mmap threshold: release_freed_host_memory).
    peak = record["peak_memory_bytes"]
    print(f"peak RSS per rank {peak:.4g} B, whole model's weights {weight_bytes:.4g} B")
    assert 0 < peak < weight_bytes, f"peak RSS {peak:.3e} B of {weight_bytes:.3e} B"


def test_cpu_peak_memory_is_the_programs_own_not_its_parents():
    """A rank started by a large process (a test runner, an agent) reports its own peak RSS:
    ru_maxrss would carry the parent's over across fork and exec (Linux), VmHWM does not."""
    import subprocess
    import sys
    from pathlib import Path

    runtime = Path(__file__).resolve().parents[1] / "codegen" / "runtime"
    code = (
        "import resource, sys, torch\n"
        f"sys.path.insert(0, {str(runtime)!r})\n"
        "import autopar_runtime as rt\n"
        "print(rt.peak_memory_bytes(torch.device('cpu')),\n"
        "      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)\n"
    )
    # the 1 GiB parent is a process of its own (pytest's own high-water mark stays as it was)
    parent = (
        "import subprocess, sys\n"
        "ballast = bytearray(1 << 30)\n"
        "ballast[:: 4096] = b'\\x01' * len(ballast[:: 4096])\n"
        f"sys.exit(subprocess.run([sys.executable, '-c', {code!r}]).returncode)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", parent], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    own, inherited = map(int, proc.stdout.split())
    assert inherited >= 1 << 30  # the carried-over figure this guards against
    assert own < 768 * 2**20, own  # importing torch and the runtime: ~300 MB
