"""The built-in device catalog: GPUs from ``data/gpus.json`` (sources kept) and this machine's CPU.

GPU choices, the same for every entry (see ``_gpu_device``):
- ``peak_flops["bf16"]``: dense bf16 tensor-core peak; ``peak_flops["fp32"]``: dense TF32 tensor-core
  peak. torch runs fp32 matmuls on TF32 only where ``torch.backends.cuda.matmul.allow_tf32`` (or
  ``set_float32_matmul_precision("high")``) is set; we assume training sets it, as torchtitan does.
  Without it fp32 matmuls run at ``vector_flops`` (the fp32 CUDA-core figure), ~7x slower.
- ``vector_flops`` (non-matmul ops) for both dtypes: the fp32 CUDA-core figure, because torch's
  elementwise and reduction kernels compute bf16 in fp32 (opmath).
- ``memory_bytes``: memory in GB as marketed (decimal), nothing subtracted for the CUDA context or
  the allocator; the planner's ``buffers`` term is where a reserve belongs.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from importlib import resources
from typing import Any

from autopar.cost_model.spec import ClusterSpecError, DeviceSpec, Link

# Assumptions (not in gpus.json), one reason each:
_MEMORY_EFFICIENCY = 0.8  # memory-bound kernels reach ~80% of HBM bandwidth (STREAM-like copies)
_GPU_OP_OVERHEAD_S = 5e-6  # eager kernel launch + dispatch ~5-10 us; low end, as launches overlap
# DTensor dispatch is host work (~23 us/op measured on CPU below); on a busy GPU the host runs
# ahead of asynchronous kernels and most of it hides, so we count 3 us per op as exposed.
_GPU_TP_OP_OVERHEAD_S = 3e-6
_INTRA_LATENCY_S = 1e-6  # per ring step: 8-GPU NVLink small all_reduce ~15 us over 14 steps
_INTER_LATENCY_S = 5e-6  # per ring step: IB one-way ~2-3 us plus NCCL proxy hand-off


@dataclass(frozen=True)
class _Gpu:
    json_key: str
    fp32_json_key: str
    """entry whose tf32/fp32 figures apply (H200 has H100 SXM's compute: gpus.json compute_note)."""
    matmul_efficiency: float
    efficiency_reason: str
    intra_bus_bandwidth: float
    intra_reason: str
    inter_bus_bandwidth: float
    inter_reason: str


_H100_LINKS = dict(
    intra_bus_bandwidth=370e9,
    intra_reason="NVLink4 ring busbw ~370 GB/s effective of 450 GB/s line rate (nccl212; "
    "all_reduce with NVLS reaches ~480, we keep the ring figure for every collective)",
    inter_bus_bandwidth=46e9,
    inter_reason="one 400 Gb/s NDR NIC per GPU (torchtitan_gt, WhiteFiber H200), "
    "46-48 GB/s busbw per NIC (nccl290): low end",
)
_A100_LINKS = dict(
    intra_bus_bandwidth=230e9,
    intra_reason="NVLink3 8-GPU all_reduce busbw ~230 GB/s (nccl149 expected peak; 232.5 measured "
    "in nccl175)",
    inter_bus_bandwidth=24e9,
    inter_reason="one 200 Gb/s HDR NIC per GPU (DGX-A100, Narayanan et al.), 24 GB/s busbw per NIC "
    "(nccl412; nccl812: 192 GB/s over 8 NICs)",
)
_H100_EFF = dict(
    matmul_efficiency=0.75,
    efficiency_reason="large bf16 GEMMs reach ~70-80% of the 989 TF peak on H100 (cuBLAS)",
)
_A100_EFF = dict(
    matmul_efficiency=0.8,
    efficiency_reason="large bf16 GEMMs reach ~250 of 312 TF on A100 (cuBLAS)",
)

_GPUS: dict[str, _Gpu] = {
    "H100": _Gpu("H100-SXM5-80GB", "H100-SXM5-80GB", **_H100_EFF, **_H100_LINKS),
    "H200": _Gpu("H200-SXM-141GB", "H100-SXM5-80GB", **_H100_EFF, **_H100_LINKS),
    "A100-80GB": _Gpu("A100-SXM4-80GB", "A100-SXM4-80GB", **_A100_EFF, **_A100_LINKS),
    "A100-40GB": _Gpu("A100-SXM4-40GB", "A100-SXM4-40GB", **_A100_EFF, **_A100_LINKS),
}

DEVICE_NAMES: tuple[str, ...] = (*_GPUS, "cpu")

_ALIASES: dict[str, str] = {
    **{
        a: "H100" for a in ("h100-sxm", "h100-sxm5", "h100-80gb", "h100-sxm-80gb", "h100-sxm5-80gb")
    },
    **{a: "H200" for a in ("h200-sxm", "h200-141gb", "h200-sxm-141gb")},
    **{a: "A100-80GB" for a in ("a100-80g", "a100-sxm-80gb", "a100-sxm4-80gb")},
    **{a: "A100-40GB" for a in ("a100-40g", "a100-sxm-40gb", "a100-sxm4-40gb")},
}
_AMBIGUOUS: dict[str, str] = {
    "a100": "A100-40GB or A100-80GB",
    "a100-sxm": "A100-40GB or A100-80GB",
    "a100-sxm4": "A100-40GB or A100-80GB",
}

# This machine's CPU, measured once (torch 2.13.0 CPU build, Intel Xeon with AVX-512 and AMX,
# one process, torch.set_num_threads(1), best of 3 runs):
# - a 512x512 fp32 matmul loop: 158-194 GFLOP/s (2*512^3 flops per call) -> 1.8e11;
# - the same in bf16: 1.24 TFLOP/s, which needs AMX; without amx_bf16 we use the fp32 figure;
# - torch.add(x, 1, out=y) on 64 MB fp32: 22-23 GB/s read+write -> 2.2e10;
# - a+b on 4-element tensors: 0.86 us; with autograd one op costs ~2 us in a training step
#   (an 8-block MLP step: 500 us for 240 aten ops fwd+bwd) -> op_overhead_s = 2e-6;
# - the same MLP under ColwiseParallel/RowwiseParallel on a 1-rank gloo mesh: 6.1 ms vs 0.5 ms,
#   i.e. 23 us extra per aten op of the step (a lone DTensor add: 6.7 us) -> tp_op_overhead_s.
# matmul_efficiency 1.0: the peak above is already what matmuls attain.
_CPU_FP32_FLOPS = 1.8e11
_CPU_AMX_BF16_FLOPS = 1.2e12
_CPU_MEMORY_BANDWIDTH = 2.2e10
_CPU_OP_OVERHEAD_S = 2e-6
_CPU_TP_OP_OVERHEAD_S = 23e-6
# RSS above the live tensors at a rank's peak (cost_model.peak): benchmarks/memory.py's GPT
# runs (cpu:2, 2026-12-05) held 39-130 MiB (median ~60) above their tensor-level peaks; glibc
# keeps freed heap blocks up to its trim threshold (2x the dynamic mmap threshold, <= 64 MiB)
_CPU_ALLOCATOR_HEADROOM_BYTES = 60 * 2**20


@functools.cache
def gpu_facts() -> dict[str, Any]:
    """The packaged ``gpus.json``."""
    return json.loads(resources.files("autopar.cost_model.data").joinpath("gpus.json").read_text())


def canonical_name(name: str) -> str:
    """The catalog name for ``name`` (case-insensitive, aliases allowed)."""
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    by_lower = {n.lower(): n for n in DEVICE_NAMES}
    if key in by_lower:
        return by_lower[key]
    if key in _ALIASES:
        return _ALIASES[key]
    if key in _AMBIGUOUS:
        raise ClusterSpecError(
            f"device {name!r} is ambiguous: use {_AMBIGUOUS[key]} (memory size decides plans)"
        )
    raise ClusterSpecError(
        f"unknown device {name!r}: the catalog knows {', '.join(DEVICE_NAMES)} (case-insensitive); "
        "use one of them or give a full DeviceSpec in a .json/.toml cluster file"
    )


def device(name: str, *, processes_per_node: int = 1) -> DeviceSpec:
    """The catalog's DeviceSpec for ``name``; ``processes_per_node`` matters for ``cpu`` only."""
    canonical = canonical_name(name)
    if canonical == "cpu":
        return cpu_device(processes_per_node)
    return _gpu_device(canonical)


def gpu_links(name: str) -> tuple[Link, Link]:
    """(intra_node, inter_node) links of a catalog GPU's usual cluster."""
    gpu = _GPUS[canonical_name(name)]
    sources = gpu_facts()["_sources"]

    def cite(reason: str) -> str:
        keys = [k for k in sources if k in reason]
        return reason + "; " + "; ".join(f"{k}: {sources[k]}" for k in keys)

    intra = Link(
        name="nvlink",
        bandwidth_bytes_per_s=gpu.intra_bus_bandwidth,
        latency_s=_INTRA_LATENCY_S,
        source=cite(gpu.intra_reason) + "; latency: assumption, ~1 us per ring step",
    )
    inter = Link(
        name="infiniband",
        bandwidth_bytes_per_s=gpu.inter_bus_bandwidth,
        latency_s=_INTER_LATENCY_S,
        source=cite(gpu.inter_reason) + "; latency: assumption, ~5 us per ring step",
    )
    return intra, inter


def _gpu_device(canonical: str) -> DeviceSpec:
    gpu = _GPUS[canonical]
    facts = gpu_facts()
    entry, fp32_entry = facts[gpu.json_key], facts[gpu.fp32_json_key]
    fp32_vector = fp32_entry["fp32_nontensor_tflops"] * 1e12
    cited = "; ".join(f"{k}: {facts['_sources'][k]}" for k in entry["sources"])
    return DeviceSpec(
        name=canonical,
        kind="gpu",
        memory_bytes=int(entry["memory_gb"] * 1e9),
        peak_flops={
            "bf16": entry["bf16_tensor_dense_tflops"] * 1e12,
            "fp32": fp32_entry["tf32_tensor_dense_tflops"] * 1e12,
        },
        vector_flops={"fp32": fp32_vector, "bf16": fp32_vector},
        memory_bandwidth_bytes_per_s=entry["hbm_bandwidth_GBps"] * 1e9,
        matmul_efficiency=gpu.matmul_efficiency,
        memory_efficiency=_MEMORY_EFFICIENCY,
        op_overhead_s=_GPU_OP_OVERHEAD_S,
        tp_op_overhead_s=_GPU_TP_OP_OVERHEAD_S,
        source=(
            f"gpus.json[{gpu.json_key!r}] (confidence: {entry['confidence']}); fp32 = TF32 dense "
            f"tensor and vector = fp32 non-tensor of gpus.json[{gpu.fp32_json_key!r}]; memory as "
            f"marketed, decimal GB, nothing subtracted; matmul_efficiency: {gpu.efficiency_reason};"
            " memory_efficiency 0.8: memory-bound kernels reach ~80% of HBM bandwidth; "
            "op_overhead 5 us: kernel launch; tp_op_overhead 10 us: exposed DTensor dispatch; "
            f"sources: {cited}"
        ),
    )


def usable_cpu_count() -> int:
    """CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _has_amx_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_bf16" in f.read()
    except OSError:
        return False


def cpu_device(processes_per_node: int = 1) -> DeviceSpec:
    """One gloo process on this machine, sharing its RAM and cores with ``processes_per_node - 1``
    others. Each process is assumed to get one core (one torch thread) while cores suffice."""
    if processes_per_node < 1:
        raise ClusterSpecError(f"processes per node {processes_per_node} must be >= 1; e.g. cpu:2")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    share = min(1.0, usable_cpu_count() / processes_per_node)
    bf16 = _CPU_AMX_BF16_FLOPS if _has_amx_bf16() else _CPU_FP32_FLOPS
    return DeviceSpec(
        name="cpu",
        kind="cpu",
        memory_bytes=ram // processes_per_node,
        peak_flops={"fp32": _CPU_FP32_FLOPS * share, "bf16": bf16 * share},
        vector_flops={"fp32": _CPU_FP32_FLOPS * share, "bf16": _CPU_FP32_FLOPS * share},
        memory_bandwidth_bytes_per_s=_CPU_MEMORY_BANDWIDTH * share,
        matmul_efficiency=1.0,
        memory_efficiency=1.0,
        op_overhead_s=_CPU_OP_OVERHEAD_S,
        tp_op_overhead_s=_CPU_TP_OP_OVERHEAD_S,
        host_cpus=os.cpu_count() or 1,
        allocator_headroom_bytes=_CPU_ALLOCATOR_HEADROOM_BYTES,
        source=(
            f"measured on one core with torch 2.13 (cost_model/catalog.py): 512x512 fp32 matmul "
            f"1.8e11 FLOP/s, bf16 1.2e12 with AMX (else fp32), copy 22 GB/s, 2 us per eager op, "
            f"23 us extra per DTensor op; {_CPU_ALLOCATOR_HEADROOM_BYTES >> 20} MiB of glibc "
            f"headroom above the live tensors (benchmarks/memory.py); scaled by min(1, cores/processes) = {share:.3g}; "
            f"memory = physical RAM / {processes_per_node} processes"
        ),
    )


def faster_device(device: DeviceSpec, factor: float) -> DeviceSpec:
    """``device`` declared ``factor`` times as fast: peak and vector FLOP/s and memory bandwidth
    times ``factor``, per-op overhead over it (a group of a mixed cluster made of CPU processes,
    for tests and benchmarks: the numerics do not depend on the speed)."""
    return device.model_copy(
        update={
            "name": f"{device.name}-x{factor:g}",
            "peak_flops": {d: v * factor for d, v in device.peak_flops.items()},
            "vector_flops": {d: v * factor for d, v in device.vector_flops.items()},
            "memory_bandwidth_bytes_per_s": device.memory_bandwidth_bytes_per_s * factor,
            "op_overhead_s": device.op_overhead_s / factor,
            "source": f"{device.source}; declared {factor:g}x as fast",
        }
    )


def datasheet_assumptions(name: str) -> list[str]:
    """Each assumption behind a catalog GPU's figures, with its source (for datasheet profiles)."""
    canonical = canonical_name(name)
    gpu = _GPUS[canonical]
    facts = gpu_facts()
    entry = facts[gpu.json_key]
    intra, inter = gpu_links(canonical)
    return [
        f"peak bf16 {entry['bf16_tensor_dense_tflops']} TFLOP/s dense, HBM "
        f"{entry['hbm_bandwidth_GBps']} GB/s, {entry['memory_gb']} GB: gpus.json[{gpu.json_key!r}]"
        f" (sources {', '.join(entry['sources'])}; confidence: {entry['confidence']})",
        f"fp32 matmuls run on TF32 tensor cores at "
        f"{facts[gpu.fp32_json_key]['tf32_tensor_dense_tflops']} TFLOP/s (allow_tf32 set, as "
        "torchtitan does); non-matmul ops at the fp32 CUDA-core figure",
        f"matmul_efficiency {gpu.matmul_efficiency}: {gpu.efficiency_reason}",
        f"memory_efficiency {_MEMORY_EFFICIENCY}: memory-bound kernels reach ~80% of HBM "
        "bandwidth (STREAM-like copies)",
        f"op_overhead {_GPU_OP_OVERHEAD_S * 1e6:.0f} us per kernel: eager launch + dispatch "
        "~5-10 us, low end as launches overlap",
        f"tp_op_overhead {_GPU_TP_OP_OVERHEAD_S * 1e6:.0f} us per DTensor op: host dispatch "
        "(23 us measured on CPU) mostly hidden behind asynchronous kernels",
        f"intra-node: {intra.source}",
        f"inter-node: {inter.source}",
    ]
