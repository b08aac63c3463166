"""Predicted vs published per-GPU throughput of large training runs (datasheet cost model).

    python benchmarks/published_runs.py [--json] [--no-free] [--runs tt-8b-8,megatron-175b]

Each run is planned with the built-in datasheet catalog (no profile), its published mesh pinned
(tp, pp, dp, fsdp) and its global batch, sequence length and precision, for the program that ran
it (``Options.system``): torchtitan's FSDP2 with ``MixedPrecisionPolicy(bf16, reduce fp32)`` is
the regime autopar emits, and its tensor parallelism redistributes each block input once for the
projections that read it (``torchtitan``); Megatron-LM and Llama 3 keep bf16 parameters, fp32
main gradients reduced in fp32 and fp32 master weights, and fuse Q, K and V (``megatron``; see
``cost_model.precision``). The Megatron GPTs are benchmarks/megatron_gpt.py: Megatron-LM's 2021
layout (fused QKV, explicit softmax attention with dropout, hidden dropout).
The planner chooses the schedule, microbatches and, where the run does not say, checkpointing.
Beside each pinned prediction the planner's own free plan for the same job (same cluster, batch,
sequence, program; nothing pinned) is printed.

Figures compare as tokens/s per GPU. torchtitan publishes that; for the papers that publish
TFLOP/s per GPU the step time is recovered with the publication's own FLOP count:

  megatron  96 B s l h^2 (1 + s / 6h + V / 16 l h) per step (Narayanan et al. 2021, eq. 3:
            forward, backward and the forward recomputed by full activation checkpointing)
  model     (6 N + 12 l h s) per token (PaLM's MFU count; N without the input embedding, which
            does no matmul), the count behind Llama 3's "BF16 MFU" and torchtitan's MFU

Development rows (torchtitan's own benchmark tables, bf16 rows only, the numbers read at the
commit each names):

  tt-8b-8      Llama 3.1 8B, FSDP 8 on 8 H100, local batch 2 (global 16), seq 8192, selective
               (per-op) activation checkpointing, eager: 5,762 tokens/s per GPU
               (benchmarks/llama3_h100_202412_torchtitan.md, Table 1, row "FSDP").
  tt-8b-128    the same on 128 H100 (FSDP 128, global 256): 5,605 (ibid., Table 3, "FSDP").
  tt-70b-256   Llama 3.1 70B, FSDP 32 x TP 8 on 256 H100, local batch 16 (global 512), seq
               8192, full activation checkpointing, torch.compile, vanilla TP: 597.3
               (benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md, "Llama3 70b on 256 H100s",
               row "None (bfloat16)", column "Vanilla TP"; the 2024-12 table has Float8 only).
  tt-405b-128  Llama 3.1 405B, FSDP 16 x TP 8 on 128 H100, local batch 2 (global 32), seq 8192,
               full activation checkpointing, torch.compile, no Float8, no async TP: 109 tokens/s
               per GPU, 29.0% MFU (docs/performance.md as of commit 3faaa1a, "Llama 3.1
               performance numbers", optimizations "None"; seq 8192 from that commit's
               train_configs/llama3_405b.toml, and the MFU checks it).

  tt-13b-64    Llama 2 13B in torchtitan's layout (benchmarks/torchtitan_llama.py at the sizes of
               examples/hf/llama2-13b.json: torchtitan's 13B flavour, 5120 x 40, SwiGLU 13824,
               vocab 32000; fused RMSNorm) on 64 A100-80GB, FSDP 64, local batch 2 (global 128),
               seq 4096, no activation checkpointing, eager: 2,162 tokens/s per GPU, 61.1% MFU
               (docs/performance.md since 395a52627, 2024-04-18, read at the commit in
               ``TT_405B``, "Llama 2 performance numbers"). It ran in 80 GB without
               checkpointing: the memory case of issue 27, looked at while measuring
               ``F.rms_norm`` as CUDA's fused kernel saves it.

  torchtitan's machines are Meta Grand Teton hosts: H100 SXM with 96 GB HBM2e at 2.4 TB/s, run
  at a 500 W power limit, 400 Gb/s RDMA per GPU (gpus.json "H100-SXM-96GB-HBM2e (Meta Grand
  Teton variant)", source torchtitan_gt). The planner gets that memory and bandwidth
  (:func:`grand_teton`); the source says the true bf16 peak lies between H100 NVL's 835 and
  SXM's 989 TFLOP/s and is not known, so the catalog's 989 stays: at 500 W these rows may run up
  to 16% below what the datasheet peak predicts.

Held-out rows (used to check the model after changes made while looking at the rows above):

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
async collectives, torchtitan's selective (per-op) checkpointing (the planner checkpoints whole
layers) and torch.compile's fusions; what they suffered that it does not: stragglers, data
loading, logging, the 500 W power limit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TORCHTITAN = "github.com/pytorch/torchtitan"
"""The repository the development rows come from; each row names the file and commit."""
TT_BENCH = f"{TORCHTITAN} @ b5bcd76c6 (files unchanged since 820504e)"
TT_405B = f"{TORCHTITAN} @ 3faaa1a0dee68ce028400e3dafd1735d152cb4f8 (2024-08-23)"


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    """publication, table and row; for torchtitan: the file path and commit."""
    model: str
    """``gpt:<layers>,<hidden>,<heads>,<vocab>`` (benchmarks/megatron_gpt.py, Megatron-LM's
    layout, at that shape), ``tt:<name>`` (benchmarks/torchtitan_llama.py, torchtitan's Llama
    layout, at the sizes of examples/hf/<name>.json) or ``hf:<name>``."""
    cluster: str
    mesh: dict[str, int]
    global_batch: int
    seq_len: int
    published: float
    unit: str
    """what ``published`` counts: "tflops" (TFLOP/s per GPU) or "tokens" (tokens/s per GPU)."""
    flops: str = "model"
    """the publication's FLOP count: "megatron" or "model"."""
    checkpoint: str = "auto"
    system: str = "megatron"
    """whose program ran (``Options.system``): "megatron" or "torchtitan" (FSDP2, autopar's
    precision regimes, block inputs redistributed once for tensor parallelism)."""
    grand_teton: bool = False
    """ran on torchtitan's 96 GB HBM2e H100s (:func:`grand_teton`)."""
    held_out: bool = True
    """kept aside to check the model, not looked at while changing it."""
    microbatches: int | None = None
    """gradient accumulation steps (pp = 1) or pipeline microbatches where the run says; None:
    the planner's choice. torchtitan's rows ran each local batch as one microbatch."""


RUNS = {
    "tt-8b-8": Run(
        "Llama 3.1 8B, torchtitan FSDP, 8 H100",
        f"{TT_BENCH} benchmarks/llama3_h100_202412_torchtitan.md Table 1 row FSDP "
        "(local batch 2, selective op AC, eager, bf16)",
        "hf:llama3-8b",
        "1x8xH100",
        {"fsdp": 8},
        16,
        8192,
        5762.0,
        "tokens",
        system="torchtitan",
        grand_teton=True,
        held_out=False,
        microbatches=1,
    ),  # fmt: skip
    "tt-8b-128": Run(
        "Llama 3.1 8B, torchtitan FSDP, 128 H100",
        f"{TT_BENCH} benchmarks/llama3_h100_202412_torchtitan.md Table 3 row FSDP "
        "(local batch 2, selective op AC, eager, bf16)",
        "hf:llama3-8b",
        "16x8xH100",
        {"fsdp": 128},
        256,
        8192,
        5605.0,
        "tokens",
        system="torchtitan",
        grand_teton=True,
        held_out=False,
        microbatches=1,
    ),  # fmt: skip
    "tt-70b-256": Run(
        "Llama 3.1 70B, torchtitan FSDP 32 x TP 8, 256 H100",
        f"{TT_BENCH} benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md '70b on 256 H100s' "
        "row None (bfloat16), Vanilla TP (local batch 16, full AC, compile)",
        "hf:llama3-70b",
        "32x8xH100",
        {"fsdp": 32, "tp": 8},
        512,
        8192,
        597.3,
        "tokens",
        checkpoint="full",
        system="torchtitan",
        grand_teton=True,
        held_out=False,
        microbatches=1,
    ),  # fmt: skip
    "tt-405b-128": Run(
        "Llama 3.1 405B, torchtitan FSDP 16 x TP 8, 128 H100",
        f"{TT_405B} docs/performance.md 'Llama 3.1 performance numbers' row 405B/None "
        "(local batch 2, full AC, compile, bf16; 29.0% MFU)",
        "hf:llama3-405b",
        "16x8xH100",
        {"fsdp": 16, "tp": 8},
        32,
        8192,
        109.0,
        "tokens",
        checkpoint="full",
        system="torchtitan",
        grand_teton=True,
        held_out=False,
        microbatches=1,
    ),  # fmt: skip
    "tt-13b-64": Run(
        "Llama 2 13B, torchtitan FSDP, 64 A100-80GB",
        f"{TT_405B} docs/performance.md 'Llama 2 performance numbers' row 13B/2/no (local "
        "batch 2, no AC, eager; train_configs/llama_13b.toml @ 395a52627: seq 4096, compile "
        "false; 61.1% MFU)",
        "tt:llama2-13b",
        "8x8xA100-80GB",
        {"fsdp": 64},
        128,
        4096,
        2162.0,
        "tokens",
        checkpoint="none",
        system="torchtitan",
        held_out=False,
        microbatches=1,
    ),  # fmt: skip
    "megatron-175b": Run(
        "GPT-3 175B, Megatron-LM, 1024 A100",
        "Narayanan et al. SC'21 (arXiv 2104.04473) Sec. 5.1",
        "gpt:96,12288,96,51200",
        "128x8xA100-80GB",
        {"tp": 8, "pp": 8, "dp": 16},
        1536,
        2048,
        140.0,
        "tflops",
        flops="megatron",
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
        "tflops",
        flops="megatron",
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
        "tflops",
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
        "tflops",
    ),  # fmt: skip
}


TT_MODEL = ROOT / "benchmarks" / "torchtitan_llama.py"


def tt_env(run: Run) -> dict[str, str]:
    """The environment that sizes ``TT_MODEL`` (torchtitan's layout) as a ``tt:`` row's config."""
    c = _config(run)
    return dict(TT_LAYERS=str(c["num_hidden_layers"]), TT_DIM=str(c["hidden_size"]),
                TT_HEADS=str(c["num_attention_heads"]), TT_KV_HEADS=str(c["num_key_value_heads"]),
                TT_FFN=str(c["intermediate_size"]), TT_VOCAB=str(c["vocab_size"]),
                TT_MAX_SEQ=str(run.seq_len))  # fmt: skip


def _config(run: Run) -> dict:
    return json.loads((ROOT / "examples" / "hf" / f"{run.model[3:]}.json").read_text())


def _shape(run: Run) -> dict[str, int]:
    """layers, hidden, heads, vocab of the run's model."""
    if run.model.startswith("gpt:"):
        layers, hidden, heads, vocab = (int(x) for x in run.model[4:].split(","))
        return {"layers": layers, "hidden": hidden, "heads": heads, "vocab": vocab}
    config = _config(run)
    return {
        "layers": config["num_hidden_layers"],
        "hidden": config["hidden_size"],
        "heads": config["num_attention_heads"],
        "vocab": config["vocab_size"],
    }


def _llama_params(run: Run) -> int:
    """Parameters of a Llama config (q, k, v, o, gate/up/down, two norms per layer; embedding,
    final norm, untied head)."""
    c = _config(run)
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


def published_tokens_per_gpu(run: Run, gpus: int) -> float:
    """The published figure as tokens/s per GPU (TFLOP/s through the publication's count)."""
    if run.unit == "tokens":
        return run.published
    step_s = step_flops(run) / gpus / (run.published * 1e12)
    return run.global_batch * run.seq_len / step_s / gpus


def low_peak(cluster):
    """``cluster`` with the bf16 peak of H100 NVL (gpus.json), the low end of the range
    torchtitan gives for its power-limited H100s."""
    from autopar.cost_model.catalog import gpu_facts

    peak = gpu_facts()["H100-NVL"]["bf16_tensor_dense_tflops"] * 1e12
    flops = {**cluster.device.peak_flops, "bf16": peak}
    device = cluster.device.model_copy(update={"peak_flops": flops})
    return cluster.model_copy(update={"device": device})


def grand_teton(cluster):
    """``cluster`` with torchtitan's Grand Teton H100: 96 GB of HBM2e at 2.4 TB/s (gpus.json);
    the compute peak and links of the catalog's H100 (the module docstring says why)."""
    from autopar.cost_model.catalog import gpu_facts

    facts = gpu_facts()["H100-SXM-96GB-HBM2e (Meta Grand Teton variant)"]
    device = cluster.device.model_copy(
        update={
            "name": "H100-96GB-GT",
            "memory_bytes": int(facts["memory_gb"] * 1e9),
            "memory_bandwidth_bytes_per_s": facts["hbm_bandwidth_GBps"] * 1e9,
            "source": "gpus.json 'H100-SXM-96GB-HBM2e (Meta Grand Teton variant)' memory and "
            "bandwidth (torchtitan_gt), H100 SXM compute: " + cluster.device.source,
        }
    )
    return cluster.model_copy(update={"device": device})


def trace_run(run: Run):
    """(graph, model ref, cluster, training) of one run: the model traced on meta in bf16 as
    ``plan`` traces it (``autopar.api.trace``: an HF model's attention without the (b, 1, s, s)
    mask its eager forward never builds)."""
    import torch
    from autopar.cost_model import parse_cluster
    from autopar.planner.plan import ModelRef, Training

    from autopar.api import TRACE_BATCH, trace
    from autopar.model_file import build_on_meta, call_args, example_inputs, load_model_file

    if run.model.startswith("gpt:"):
        d = _shape(run)
        os.environ.update(GPT_LAYERS=str(d["layers"]), GPT_DIM=str(d["hidden"]),
                          GPT_HEADS=str(d["heads"]), GPT_VOCAB=str(d["vocab"]),
                          GPT_MAX_SEQ=str(run.seq_len))  # fmt: skip
        mf = load_model_file(str(ROOT / "benchmarks" / "megatron_gpt.py"))
    elif run.model.startswith("tt:"):
        os.environ.update(tt_env(run))
        mf = load_model_file(str(TT_MODEL))
    else:
        mf = load_model_file(run.model)
    model = build_on_meta(mf)
    batch = TRACE_BATCH + 1 if run.seq_len == TRACE_BATCH else TRACE_BATCH
    args, _ = example_inputs(mf, model, batch, run.seq_len)
    graph = trace(model, *call_args(args), seq_len=run.seq_len, dtype=torch.bfloat16,
                  saved_for="cuda")  # fmt: skip
    cluster = parse_cluster(run.cluster)
    if run.grand_teton:
        cluster = grand_teton(cluster)
    training = Training(global_batch=run.global_batch, seq_len=run.seq_len, dtype="bf16")
    return graph, ModelRef(file=mf.path, factory=mf.factory), cluster, training


def plan_run(run: Run, traced=None, *, free: bool = False):
    """The plan of one run for the program that ran it (``Run.system``, see
    :mod:`cost_model.precision`), its published mesh pinned, or (``free``) nothing pinned and
    checkpointing left to the planner. What ``plan_model_file`` does, with that one option."""
    from autopar.planner.search import Options, search

    graph, ref, cluster, training = traced or trace_run(run)
    options = Options(
        checkpoint="auto" if free else run.checkpoint,  # type: ignore[arg-type]
        system=run.system,  # type: ignore[arg-type]
        microbatches=None if free else run.microbatches,
    )
    pins = {} if free else run.mesh
    return search(graph, cluster, training, model=ref, pins=pins, options=options)


def _per_layer(plan) -> dict:
    """Per-microbatch figures of the slowest stage: its forward and backward time, and the
    matmul roofline behind them (what would bound the time at the catalog's efficiency)."""
    stages = plan.predicted.stages
    if not stages:
        return {}
    slow = max(stages, key=lambda s: s.fwd_s + s.bwd_s + s.recompute_s)
    return {
        "stage_fwd_s": slow.fwd_s,
        "stage_bwd_s": slow.bwd_s,
        "stage_recompute_s": slow.recompute_s,
        "stage_in_flight": slow.in_flight,
    }


def evaluate(name: str, free: bool = True, band: bool = True) -> dict:
    """Predicted vs published tokens/s per GPU of one run (and, with ``free``, the planner's
    own plan for the same job; with ``band``, for torchtitan's power-limited H100s, the same at
    the low end of their peak: :func:`low_peak`)."""
    from autopar.planner.request import NothingFitsError

    run = RUNS[name]
    start = time.perf_counter()
    traced = trace_run(run)
    note = ""
    try:
        plan = plan_run(run, traced)
    except NothingFitsError as e:
        if run.microbatches is None:
            raise
        # the memory model does not fit the run as it ran: say so, and let the planner
        # accumulate gradients over more microbatches instead
        note = f"m={run.microbatches} as run does not fit: {e}"
        plan = plan_run(dataclasses.replace(run, microbatches=None), traced)
    planning_s = time.perf_counter() - start
    if plan.offload:
        note += (" and " if note else "") + (
            "the plan offloads parameters, gradients and AdamW to the host (optimizer time: "
            "PCIe copies and the host's AdamW)"
        )
    gpus = plan.cluster.world_size
    tokens = run.global_batch * run.seq_len
    predicted = tokens / plan.predicted.step_time_s / gpus
    published = published_tokens_per_gpu(run, gpus)
    peak = plan.cluster.device.peak_flops["bf16"]
    mfu_flops = step_flops(run)
    row = {
        "run": name,
        "title": run.name,
        "source": run.source,
        "held_out": run.held_out,
        "cluster": run.cluster,
        "device": plan.cluster.device.name,
        "mesh": plan.mesh.short(),
        "schedule": plan.schedule.name,
        "microbatches": plan.schedule.num_microbatches,
        "stages_per_rank": plan.schedule.stages_per_rank,
        "checkpointed_layers": sum(v == "full" for v in plan.checkpointing.values()),
        "layers": len(plan.checkpointing),
        "offload": plan.offload,
        "memory_gib": plan.predicted.peak_memory_bytes / 2**30,
        "memory_breakdown_gib": {
            k: v / 2**30 for k, v in plan.predicted.memory_breakdown_bytes.model_dump().items()
        },
        "predicted_step_s": plan.predicted.step_time_s,
        "published_step_s": tokens / published / gpus,
        "predicted_tokens_per_gpu": predicted,
        "published_tokens_per_gpu": published,
        "predicted_mfu": mfu_flops / gpus / plan.predicted.step_time_s / peak,
        "published_mfu": mfu_flops / gpus / (tokens / published / gpus) / peak,
        "error": predicted / published - 1,
        "breakdown_s": plan.predicted.time_breakdown_s.parts(),
        **_per_layer(plan),
        "planning_s": planning_s,
        "note": note,
    }
    if run.unit == "tflops":
        row["published_tflops"] = run.published
        row["predicted_tflops"] = mfu_flops / gpus / plan.predicted.step_time_s / 1e12
    if run.grand_teton and band:
        graph, ref, cluster, training = traced
        low = plan_run(dataclasses.replace(run, microbatches=row["microbatches"]),
                       (graph, ref, low_peak(cluster), training))  # fmt: skip
        row["predicted_tokens_per_gpu_low_peak"] = tokens / low.predicted.step_time_s / gpus
        row["error_low_peak"] = row["predicted_tokens_per_gpu_low_peak"] / published - 1
    if free:
        own = plan_run(run, traced, free=True)
        row["free"] = {
            "mesh": own.mesh.short(),
            "schedule": own.schedule.name,
            "microbatches": own.schedule.num_microbatches,
            "checkpointed_layers": sum(v == "full" for v in own.checkpointing.values()),
            "memory_gib": own.predicted.peak_memory_bytes / 2**30,
            "predicted_tokens_per_gpu": tokens / own.predicted.step_time_s / gpus,
            "breakdown_s": own.predicted.time_breakdown_s.parts(),
        }
    return row


def _breakdown(parts: dict[str, float], step: float) -> str:
    return " ".join(f"{k} {v:.2f}s ({v / step:.0%})" for k, v in parts.items() if v > 0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-free", action="store_true", help="skip the planner's own free plans")
    args = p.parse_args(argv)
    names = args.runs.split(",")
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        print(f"error: unknown run(s) {', '.join(unknown)}: choose from {', '.join(RUNS)}",
              file=sys.stderr)  # fmt: skip
        return 2
    rows = [evaluate(name, free=not args.no_free) for name in names]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'run':<16}{'pinned mesh':<22}{'schedule':<20}{'ckpt':>8}{'pred tok/s':>11}"
          f"{'published':>10}{'error':>8}   {'free plan':<24}{'tok/s':>8}")  # fmt: skip
    for r in rows:
        sched = f"{r['schedule']} m={r['microbatches']}"
        ckpt = f"{r['checkpointed_layers']}/{r['layers']}"
        free = r.get("free")
        own = f"   {free['mesh']:<24}{free['predicted_tokens_per_gpu']:>8.0f}" if free else ""
        print(f"{r['run']:<16}{r['mesh']:<22}{sched:<20}{ckpt:>8}"
              f"{r['predicted_tokens_per_gpu']:>11.0f}{r['published_tokens_per_gpu']:>10.0f}"
              f"{r['error']:>+8.1%}{own}")  # fmt: skip
    print()
    for r in rows:
        step = r["predicted_step_s"]
        held = "held out" if r["held_out"] else "development"
        print(f"{r['run']} ({held}; {r['source']})")
        print(f"  predicted step {step:.2f}s vs published {r['published_step_s']:.2f}s; MFU "
              f"{r['predicted_mfu']:.1%} vs {r['published_mfu']:.1%} of {r['device']}'s peak; "
              f"memory {r['memory_gib']:.1f} GiB")  # fmt: skip
        print(f"  {_breakdown(r['breakdown_s'], step)}")
        if "error_low_peak" in r:
            print(f"  at H100 NVL's 835 TFLOP/s peak (the low end torchtitan gives for its 500 W "
                  f"H100s): {r['predicted_tokens_per_gpu_low_peak']:.0f} tokens/s per GPU, "
                  f"{r['error_low_peak']:+.1%}")  # fmt: skip
        if r["note"]:
            print(f"  note: {r['note']}")
        if "stage_fwd_s" in r:
            print(f"  slowest stage per microbatch: fwd {r['stage_fwd_s'] * 1e3:.1f} ms, bwd "
                  f"{r['stage_bwd_s'] * 1e3:.1f} ms, recompute {r['stage_recompute_s'] * 1e3:.1f}"
                  f" ms, {r['stage_in_flight']} in flight")  # fmt: skip
    errors = sorted(abs(r["error"]) for r in rows)
    print(f"median |error| {errors[len(errors) // 2]:.1%} over {len(rows)} published runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
