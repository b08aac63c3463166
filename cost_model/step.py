"""Step-level terms of the cost model: what one training step costs beyond each layer's forward
and backward (those come from :mod:`cost_model.estimate` through the planner's ILP).

  dp traffic    DDP (dp > 1, fsdp = 1): all-reduce of the local gradients over dp, one per
                25 MB bucket; FSDP: all-gather of parameters in forward and again in backward,
                reduce-scatter of gradients, over fsdp, one per unit; HSDP adds an all-reduce of
                the sharded gradients over dp
  exposed dp    GPU: the traffic hides behind backward (and forward, for FSDP's gathers) except
                what exceeds it, and never less than one bucket/unit that cannot overlap;
                CPU (gloo): nothing overlaps, the same cores compute and communicate
  optimizer     AdamW (memory-bound) or SGD on the local parameters; with CPU offload, PCIe
                copies and the host's AdamW
  buffers       DDP gradient buckets, FSDP gathered units, the GPU allocator reserve
  pipeline      a fixed host cost per action of torch.distributed.pipelining's runtime
  checkpoint    a fixed cost per checkpointed layer beyond its recomputed forward

Every figure is a function of its arguments: machine facts come from the cluster spec (never
from ``os``), so a plan's cluster and choices reproduce its prediction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from autopar.cost_model.estimate import adamw_step_time_s, axis_link, collective_time_s
from autopar.cost_model.spec import Cluster, DeviceSpec

# DDP's default bucket: the last one is reduced after backward ends and cannot overlap.
DDP_BUCKET_BYTES = 25 * 2**20
# GPU memory kept by the CUDA context, NCCL buffers and cuBLAS workspaces (assumption).
GPU_RESERVE_BYTES = int(1.5 * 2**30)
# per action of the pipeline runtime (see pipeline_runtime_s)
CPU_PP_ACTION_S = 0.7e-3
GPU_PP_ACTION_S = 50e-6
# fixed cost of one checkpointed layer beyond its recomputed forward (checkpoint_wrapper's
# saved-tensor hooks and RNG state handling): ~0.6 ms per layer on this CPU (benchmarks/
# calibrate.py on an idle machine: gpt ddp with 8 checkpointed layers +6.8 ms, recompute ~2 ms),
# assumed 20 us on a GPU host
CKPT_WRAPPER_S = {"cpu": 0.6e-3, "gpu": 20e-6}
# CPU offload (GPU clusters only): host <-> device copies at ~25 GB/s per GPU (PCIe Gen4 x16's
# 32 GB/s per direction, gpus.json, at ~80%), and the host's AdamW at ~20 GB/s of memory traffic
# per GPU's share of the host (assumptions)
PCIE_BYTES_PER_S = 25e9
HOST_BYTES_PER_S = 20e9
# host memory a GPU's offloaded state may use: a DGX A100 node's 1 TB over 8 GPUs (assumption)
HOST_BYTES_PER_GPU = 128e9

Axes = Sequence[tuple[str, int]]
"""mesh axes outermost first with their sizes (``cost_model.estimate.axis_link``)."""


class MeshShape(Protocol):
    """The degrees of a mesh (the planner's ``Mesh`` is one)."""

    pp: int
    dp: int
    fsdp: int
    tp: int


def state_bytes_per_param_byte(dtype: str, optimizer: str) -> float:
    """params + grads (param dtype) + optimizer state, per byte of parameters."""
    per_param = 2 if dtype == "bf16" else 4
    state = (8 + (4 if dtype == "bf16" else 0)) if optimizer == "adamw" else 0
    return 2 + state / per_param


def static_floor_bytes(param_bytes: float, dtype: str, optimizer: str, shards: int) -> float:
    """Parameters, gradients and optimizer state per device if every one were sharded over
    ``shards`` devices: no plan with that many shards needs less."""
    return param_bytes * state_bytes_per_param_byte(dtype, optimizer) / shards


def sync_s_per_byte(cluster: Cluster, mesh: MeshShape, axes: Axes) -> float:
    """Time per byte of local (TP-sharded) parameters spent on data-parallel traffic."""
    big = 2**30

    def rate(kind: str, axis: str, group: int, fraction: float = 1.0) -> float:
        if group == 1:
            return 0.0
        link = axis_link(cluster, axes, axis)
        return (
            collective_time_s(kind, big * fraction, group, link)  # type: ignore[arg-type]
            - collective_time_s(kind, 0, group, link)  # type: ignore[arg-type]
        ) / big

    if mesh.fsdp == 1:
        return rate("all_reduce", "dp", mesh.dp)
    per_fsdp = 2 * rate("all_gather", "fsdp", mesh.fsdp) + rate("reduce_scatter", "fsdp", mesh.fsdp)
    return per_fsdp + rate("all_reduce", "dp", mesh.dp, 1 / mesh.fsdp)


def dp_traffic_s(
    cluster: Cluster,
    mesh: MeshShape,
    axes: Axes,
    local_bytes: float,
    units: int,
    tensors: int,
    microbatches: int = 1,
) -> float:
    """Data-parallel traffic per step, one collective per DDP bucket or per FSDP unit (``units``:
    every module layer plus the root; each collective pays the link latency, which dominates
    for small models on gloo), and FSDP2's own work per parameter tensor (``tensors`` of them;
    profiled, 0 for datasheet devices). With gradient accumulation over ``microbatches``,
    gradients are reduced once, but FSDP gathers the parameters for every microbatch."""
    if mesh.dp * mesh.fsdp == 1:
        return 0.0
    dp_link = axis_link(cluster, axes, "dp")
    if mesh.fsdp == 1:
        buckets = max(1, math.ceil(local_bytes / DDP_BUCKET_BYTES))
        one = collective_time_s("all_reduce", local_bytes / buckets, mesh.dp, dp_link)
        return cluster.device.ddp_comm_scale * buckets * one
    unit_bytes = local_bytes / units
    fsdp_link = axis_link(cluster, axes, "fsdp")
    per_unit = 2 * microbatches * collective_time_s("all_gather", unit_bytes, mesh.fsdp, fsdp_link)
    per_unit += collective_time_s("reduce_scatter", unit_bytes, mesh.fsdp, fsdp_link)
    per_unit += collective_time_s("all_reduce", unit_bytes / mesh.fsdp, mesh.dp, dp_link)
    return units * per_unit + tensors * cluster.device.fsdp_tensor_overhead_s


def exposed_dp_s(
    traffic: float, compute: float, bwd_share: float, cluster: Cluster, mesh: MeshShape, axes: Axes
) -> float:
    """Data-parallel traffic left on the critical path (see the module docstring)."""
    if traffic == 0.0 or cluster.device.kind == "cpu":
        return traffic
    window = compute if mesh.fsdp > 1 else compute * bwd_share
    axis = "fsdp" if mesh.fsdp > 1 else "dp"
    group = mesh.fsdp if mesh.fsdp > 1 else mesh.dp
    tail = collective_time_s("all_reduce", DDP_BUCKET_BYTES, group, axis_link(cluster, axes, axis))
    return max(traffic - window, min(traffic, tail))


def buffer_bytes(
    cluster: Cluster, mesh: MeshShape, tp_local_bytes: float, largest_layer_bytes: float
) -> float:
    """Transient memory: the GPU reserve, plus FSDP's current and prefetched unit held
    unsharded (``largest_layer_bytes`` before tp), or DDP's gradient buckets (a second copy of
    the grads of the rank's own stage: an even share of the model, the stages not cut yet)."""
    reserve = GPU_RESERVE_BYTES if cluster.device.kind == "gpu" else 0
    if mesh.fsdp > 1:
        return reserve + 2 * largest_layer_bytes / mesh.tp
    if mesh.dp > 1:
        return reserve + tp_local_bytes / mesh.pp
    return reserve


def optimizer_s(device: DeviceSpec, optimizer: str, numel: float, tensors: int, fsdp: int) -> float:
    """The optimizer step on ``numel`` local parameters in ``tensors`` tensors."""
    if optimizer == "adamw":
        # FSDP2 parameters are DTensors: every optimizer op pays DTensor dispatch
        return adamw_step_time_s(numel, device, max(1, tensors), dtensor=fsdp > 1)
    # SGD without momentum: read param and grad, write param (fp32)
    return numel * 12 / (device.memory_bandwidth_bytes_per_s * device.memory_efficiency)


def offloaded_optimizer_s(numel: float, param_bytes: float) -> float:
    """With CPU offload, per step: the sharded parameters go host -> device for the forward and
    backward all-gathers and the gradients come back (2 x bytes over PCIe), and AdamW runs on
    the host (28 bytes per parameter at the host's memory bandwidth; assumptions above)."""
    return 2 * param_bytes / PCIE_BYTES_PER_S + numel * 28 / HOST_BYTES_PER_S


def checkpoint_overhead_s(device: DeviceSpec) -> float:
    """Fixed cost of one checkpointed layer beyond its recomputed forward."""
    return CKPT_WRAPPER_S[device.kind]


def pipeline_runtime_s(cluster: Cluster, actions: int) -> float:
    """Host time of the pipeline runtime on the busiest rank's critical path: each of its
    ``actions`` (forward, backward, weight-gradient) in torch.distributed.pipelining costs a
    fixed overhead (Python scheduling, p2p set-up, shape checks). Per action: ~0.7 ms on this
    machine's CPU with 2 gloo ranks (benchmarks/calibrate.py, idle machine: mlp pp=2 1f1b with
    4 microbatches, 10 actions, measured 7.2 ms a step), scaled by cores oversubscribed
    (processes per node over the host's cores, ``DeviceSpec.host_cpus``); ~50 us assumed on a
    GPU host, where it overlaps kernels."""
    if cluster.device.kind == "cpu":
        cores = cluster.device.host_cpus or cluster.devices_per_node
        crowd = max(1.0, cluster.devices_per_node / max(1, cores))
        return actions * CPU_PP_ACTION_S * crowd
    return actions * GPU_PP_ACTION_S
