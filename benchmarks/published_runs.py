"""Predicted vs published per-GPU throughput of large training runs (datasheet cost model).

    python benchmarks/published_runs.py [--json] [--runs megatron-175b,llama3-405b-8k]

Each run is planned with the built-in datasheet catalog (no profile), its published mesh pinned
(tp, pp, dp) and its global batch, sequence length and precision: bf16 as Megatron-LM trains it
(bf16 parameters, fp32 main gradients reduced in fp32, fp32 master weights and AdamW state: the
``megatron`` system of ``cost_model.precision``, not autopar's script); the planner chooses the
schedule, microbatches and, where the run does not say, checkpointing. The predicted step time
becomes per-GPU throughput with the FLOP count the publication uses, so predicted and published
TFLOP/s per GPU compare like for like:

  megatron  96 B s l h^2 (1 + s / 6h + V / 16 l h) per step (Narayanan et al. 2021, eq. 3:
            forward, backward and the forward recomputed by full activation checkpointing)
  model     (6 N + 12 l h s) per token (PaLM's MFU count; N without the input embedding, which
            does no matmul), the count behind Llama 3's "BF16 MFU"

Runs (the published figure, what it measured, where):
  megatron-175b  GPT-3 175B (96 x 12288, 96 heads, V 51200, s 2048) on 1024 A100-80GB,
                 tp 8 pp 8 dp 16, batch 1536: 140 TFLOP/s per GPU (Narayanan et al., "Efficient
                 Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC'21,
                 arXiv 2104.04473, Sec. 5.1: the GPT-3 training-time estimate).
  megatron-1t    1T GPT (128 x 25600, 160 heads) on 3072 A100-80GB, tp 8 pp 64 dp 6, batch
                 3072: 163 TFLOP/s per GPU, 502 PFLOP/s aggregate (ibid., Table 1 / abstract).
  llama3-405b-8k   Llama 3 405B (examples/hf/llama3-405b.json) on 8192 H100, tp 8 pp 16 and
                 FSDP over 64 (the paper shards parameters, gradients and optimizer state),
                 s 8192, 16M tokens per batch: 430 TFLOP/s per GPU, 43% BF16 MFU ("The Llama 3 Herd
                 of Models", arXiv 2407.21783, Table 4).
  llama3-405b-16k  the same on 16384 H100 with dp 128: 400 TFLOP/s per GPU, 41% (ibid.).

What the runs did that the model does not: Megatron's fused kernels and its p2p/compute
overlap, Llama 3's tuned schedule (its own interleaving with an uneven first/last stage) and
async collectives; what they suffered that it does not: stragglers, data loading, logging.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    model: str
    """``gpt:<layers>,<hidden>,<heads>,<vocab>`` (examples/gpt.py at that shape) or ``hf:<name>``."""
    cluster: str
    mesh: dict[str, int]
    global_batch: int
    seq_len: int
    published_tflops: float
    flops: str
    """the publication's FLOP count: "megatron" or "model"."""
    checkpoint: str = "auto"


RUNS = {
    "megatron-175b": Run(
        "GPT-3 175B, Megatron-LM, 1024 A100",
        "Narayanan et al. SC'21 (arXiv 2104.04473) Sec. 5.1",
        "gpt:96,12288,96,51200",
        "128x8xA100-80GB",
        {"tp": 8, "pp": 8, "dp": 16},
        1536,
        2048,
        140.0,
        "megatron",
        checkpoint="full",
    ),  # fmt: skip
    "megatron-1t": Run(
        "GPT 1T, Megatron-LM, 3072 A100",
        "Narayanan et al. SC'21 (arXiv 2104.04473) Table 1",
        "gpt:128,25600,160,51200",
        "384x8xA100-80GB",
        {"tp": 8, "pp": 64, "dp": 6},
        3072,
        2048,
        163.0,
        "megatron",
        checkpoint="full",
    ),  # fmt: skip
    "llama3-405b-8k": Run(
        "Llama 3 405B, 8192 H100",
        "Llama 3 Herd of Models (arXiv 2407.21783) Table 4",
        "hf:llama3-405b",
        "1024x8xH100",
        {"tp": 8, "pp": 16, "fsdp": 64},
        2048,
        8192,
        430.0,
        "model",
    ),  # fmt: skip
    "llama3-405b-16k": Run(
        "Llama 3 405B, 16384 H100",
        "Llama 3 Herd of Models (arXiv 2407.21783) Table 4",
        "hf:llama3-405b",
        "2048x8xH100",
        {"tp": 8, "pp": 16, "fsdp": 128},
        2048,
        8192,
        400.0,
        "model",
    ),  # fmt: skip
}


def _shape(run: Run) -> dict[str, int]:
    """layers, hidden, heads, vocab of the run's model."""
    if run.model.startswith("gpt:"):
        layers, hidden, heads, vocab = (int(x) for x in run.model[4:].split(","))
        return {"layers": layers, "hidden": hidden, "heads": heads, "vocab": vocab}
    config = json.loads((ROOT / "examples" / "hf" / f"{run.model[3:]}.json").read_text())
    return {
        "layers": config["num_hidden_layers"],
        "hidden": config["hidden_size"],
        "heads": config["num_attention_heads"],
        "vocab": config["vocab_size"],
    }


def _llama_params(run: Run) -> int:
    """Parameters of a Llama config (q, k, v, o, gate/up/down, two norms per layer; embedding,
    final norm, untied head)."""
    c = json.loads((ROOT / "examples" / "hf" / f"{run.model[3:]}.json").read_text())
    h, f, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    return c["num_hidden_layers"] * layer + 2 * V * h + h


def step_flops(run: Run) -> float:
    """FLOPs of one step as the publication counts them (see the module docstring)."""
    d = _shape(run)
    B, s, L, h, V = run.global_batch, run.seq_len, d["layers"], d["hidden"], d["vocab"]
    if run.flops == "megatron":
        return 96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))
    n = _llama_params(run) - V * h  # the input embedding does no matmul
    return B * s * (6 * n + 12 * L * h * s)


def plan_run(run: Run):
    """The plan of one run, its published mesh pinned, predicted for the system that ran it:
    Megatron-LM's bf16 mixed precision (``Options.system = "megatron"``: bf16 parameters, fp32
    main gradients reduced in fp32, fp32 master weights and AdamW state; see
    :mod:`cost_model.precision`), not autopar's emitted script. What ``plan_model_file`` does,
    with that one option."""
    import torch
    from autopar.cost_model import parse_cluster
    from autopar.ir import trace
    from autopar.planner.plan import ModelRef, Training
    from autopar.planner.search import Options, search

    from autopar.api import TRACE_BATCH
    from autopar.model_file import build_on_meta, example_inputs, load_model_file

    if run.model.startswith("gpt:"):
        d = _shape(run)
        os.environ.update(GPT_LAYERS=str(d["layers"]), GPT_DIM=str(d["hidden"]),
                          GPT_HEADS=str(d["heads"]), GPT_VOCAB=str(d["vocab"]),
                          GPT_MAX_SEQ=str(run.seq_len))  # fmt: skip
        mf = load_model_file(str(ROOT / "examples" / "gpt.py"))
    else:
        mf = load_model_file(run.model)
    model = build_on_meta(mf)
    batch = TRACE_BATCH + 1 if run.seq_len == TRACE_BATCH else TRACE_BATCH
    args, _ = example_inputs(mf, model, batch, run.seq_len)
    graph = trace(model, tuple(args), seq_len=run.seq_len, dtype=torch.bfloat16, saved_for="cuda")
    training = Training(global_batch=run.global_batch, seq_len=run.seq_len, dtype="bf16")
    options = Options(checkpoint=run.checkpoint, system="megatron")  # type: ignore[arg-type]
    return search(
        graph, parse_cluster(run.cluster), training, model=ModelRef(file=mf.path,
        factory=mf.factory), pins=run.mesh, options=options,
    )  # fmt: skip


def evaluate(name: str) -> dict:
    """Predicted vs published TFLOP/s per GPU of one run."""
    run = RUNS[name]
    start = time.perf_counter()
    plan = plan_run(run)
    gpus = plan.cluster.world_size
    flops = step_flops(run)
    predicted = flops / gpus / plan.predicted.step_time_s / 1e12
    published_step_s = flops / gpus / (run.published_tflops * 1e12)
    return {
        "run": name,
        "title": run.name,
        "source": run.source,
        "cluster": run.cluster,
        "mesh": plan.mesh.short(),
        "schedule": plan.schedule.name,
        "microbatches": plan.schedule.num_microbatches,
        "checkpointed_layers": sum(v == "full" for v in plan.checkpointing.values()),
        "memory_gib": plan.predicted.peak_memory_bytes / 2**30,
        "predicted_step_s": plan.predicted.step_time_s,
        "published_step_s": published_step_s,
        "predicted_tflops": predicted,
        "published_tflops": run.published_tflops,
        "error": predicted / run.published_tflops - 1,
        "breakdown_s": plan.predicted.time_breakdown_s.model_dump(),
        "planning_s": time.perf_counter() - start,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rows = [evaluate(name) for name in args.runs.split(",")]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(
        f"{'run':<18}{'mesh':<26}{'schedule':<24}{'pred TF/GPU':>12}{'published':>10}{'error':>8}"
    )
    for r in rows:
        sched = f"{r['schedule']} m={r['microbatches']}"
        print(f"{r['run']:<18}{r['mesh']:<26}{sched:<24}{r['predicted_tflops']:>12.0f}"
              f"{r['published_tflops']:>10.0f}{r['error']:>+8.1%}")  # fmt: skip
    errors = sorted(abs(r["error"]) for r in rows)
    print(f"median |error| {errors[len(errors) // 2]:.1%} over {len(rows)} published runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
