"""Step-level terms of the cost model: what one training step costs beyond each layer's forward
and backward (those come from :mod:`cost_model.estimate` through the planner's ILP).

  dp traffic    DDP (dp > 1, fsdp = 1, no tp, pp, cp or ep): all-reduce of the local gradients
                over dp, one per 25 MB bucket; FSDP: all-gather of parameters in forward and
                again in backward, reduce-scatter of gradients, over fsdp, one per unit; HSDP
                adds an all-reduce of the sharded gradients over dp, per unit; replicas FSDP2
                holds (``Precision.wraps_in_fsdp``: dp > 1 with tp, pp, cp or ep, a shard group
                of one) are HSDP: an all-reduce over dp per unit, and FSDP2's work per tensor
  exposed dp    GPU: the traffic hides behind backward (and forward, for FSDP's gathers) except
                what exceeds it, and never less than one bucket/unit that cannot overlap;
                CPU (gloo): nothing overlaps, the same cores compute and communicate
  optimizer     AdamW (memory-bound) or SGD on the local parameters; with CPU offload, PCIe
                copies and the host's AdamW
  grad norm     the loop's total gradient norm (one norm op per local gradient) and the step's
                totals (loss, norm) all-reduced over the world, every step the default run logs
  buffers       DDP gradient buckets, FSDP gathered units and unsharded gradients, autocast's
                weight copies, the GPU allocator reserve
  precision     every byte count per parameter comes from the plan's precision regime
                (:mod:`cost_model.precision`): what the trained program holds and moves in which
                dtype; frozen parameters get no gradients, optimizer state or gradient traffic
  pipeline      a fixed host cost per action of torch.distributed.pipelining's runtime
  checkpoint    a fixed cost per checkpointed layer beyond its recomputed forward

Every figure is a function of its arguments: machine facts come from the cluster spec (never
from ``os``), so a plan's cluster and choices reproduce its prediction.
"""

from __future__ import annotations

import math
from collections.abc import Container, Sequence
from typing import TYPE_CHECKING

from autopar.cost_model.estimate import (
    adamw_step_time_s,
    axis_link,
    blocking_collective_s,
    collective_time_s,
)
from autopar.cost_model.precision import MeshShape, Precision, System, floor_precision
from autopar.cost_model.spec import Cluster, DeviceSpec

if TYPE_CHECKING:  # the IR's types only: importing ir would import torch
    from autopar.ir import Graph


# DDP's default bucket: the last one is reduced after backward ends and cannot overlap.
DDP_BUCKET_BYTES = 25 * 2**20
# GPU memory kept by the CUDA context, NCCL buffers and cuBLAS workspaces (assumption).
GPU_RESERVE_BYTES = int(1.5 * 2**30)
# per action of the pipeline runtime where the device has no measured figure
# (``DeviceSpec.pipeline_action_s``; see pipeline_runtime_s): ~0.7 ms on a 2-core CPU with 2 gloo
# ranks (benchmarks/calibrate.py, an earlier session: mlp pp=2 1f1b with 4 microbatches, 10
# actions, 7.2 ms a step), ~50 us assumed on a GPU host
PP_ACTION_S = {"cpu": 0.7e-3, "gpu": 50e-6}
# fixed cost of one checkpointed layer beyond its recomputed forward where the device has no
# measured figure (``DeviceSpec.checkpoint_layer_s``): checkpoint_wrapper's saved-tensor hooks
# and RNG state handling, ~0.6 ms per layer on a 2-core CPU (benchmarks/calibrate.py on an idle
# machine, an earlier session: gpt ddp with 8 checkpointed layers +6.8 ms, recompute ~2 ms),
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


def static_floor_bytes(
    graph: Graph, dtype: str, optimizer: str, shards: int, system: System = "autopar"
) -> float:
    """Parameters, gradients and optimizer state per device if every one were sharded over
    ``shards`` devices, in the leanest regime ``dtype`` trains in: no plan with that many shards
    needs less. Frozen parameters count their parameter bytes only."""
    regime = floor_precision(dtype, system)
    return regime.static_bytes(graph.num_params, graph.trainable_numel, optimizer) / shards


def sync_s_per_byte(
    cluster: Cluster,
    mesh: MeshShape,
    axes: Axes,
    precision: Precision,
    traced_bytes_per_param: float = 4.0,
) -> float:
    """Time per byte of local (TP-sharded) parameters, as traced (``traced_bytes_per_param``
    bytes each), spent on data-parallel traffic: FSDP's two all-gathers of ``precision.gather``
    bytes and its reduce-scatter of ``precision.reduce`` bytes per parameter, DDP's (and HSDP's)
    all-reduce of ``precision.reduce`` bytes."""
    big = 2**30

    def rate(kind: str, axis: str, group: int, fraction: float = 1.0) -> float:
        if group == 1:
            return 0.0
        link = axis_link(cluster, axes, axis)
        return (
            collective_time_s(kind, big * fraction, group, link)  # type: ignore[arg-type]
            - collective_time_s(kind, 0, group, link)  # type: ignore[arg-type]
        ) / big

    p = precision
    if mesh.fsdp == 1:
        per_param = p.reduce * rate("all_reduce", "dp", mesh.dp)
    else:
        per_param = 2 * p.gather * rate("all_gather", "fsdp", mesh.fsdp)
        per_param += p.reduce * rate("reduce_scatter", "fsdp", mesh.fsdp)
        per_param += p.reduce * rate("all_reduce", "dp", mesh.dp, 1 / mesh.fsdp)
    return per_param / traced_bytes_per_param


def dp_traffic_s(
    cluster: Cluster,
    mesh: MeshShape,
    axes: Axes,
    precision: Precision,
    local_numel: float,
    trainable_numel: float,
    units: int,
    tensors: int,
    microbatches: int = 1,
) -> float:
    """Data-parallel traffic per step for ``local_numel`` parameters per rank (after TP), of
    which ``trainable_numel`` get gradients, one collective per DDP bucket or, where the
    program wraps the model in FSDP2 (``Precision.wraps_in_fsdp``: to shard, and to replicate a
    TP model, pipeline stages, cp or ep ranks), per FSDP unit (``units``: every module layer plus the root;
    each collective pays the link latency, which dominates for small models on gloo), and
    FSDP2's or DDP's own work per parameter tensor (``tensors`` of them; profiled, 0 for
    datasheet devices). Bytes per parameter from ``precision``: FSDP
    all-gathers ``gather`` bytes of every parameter (frozen ones too), and gradients are reduced
    at ``reduce`` bytes (trainable ones only). With gradient accumulation over
    ``microbatches``, gradients are reduced once, but FSDP gathers the parameters for every
    microbatch."""
    if mesh.dp * mesh.fsdp == 1:
        return 0.0
    dp_link = axis_link(cluster, axes, "dp")
    grad_bytes = trainable_numel * precision.reduce
    if not precision.wraps_in_fsdp(mesh):
        if grad_bytes == 0:
            return 0.0
        buckets = max(1, math.ceil(grad_bytes / DDP_BUCKET_BYTES))
        one = collective_time_s("all_reduce", grad_bytes / buckets, mesh.dp, dp_link)
        device = cluster.device
        return device.ddp_comm_scale * buckets * one + tensors * device.ddp_tensor_overhead_s
    gathered = local_numel * precision.gather / units
    reduced = grad_bytes / units
    fsdp_link = axis_link(cluster, axes, "fsdp")
    per_unit = 2 * microbatches * collective_time_s("all_gather", gathered, mesh.fsdp, fsdp_link)
    if reduced:
        per_unit += collective_time_s("reduce_scatter", reduced, mesh.fsdp, fsdp_link)
        per_unit += collective_time_s("all_reduce", reduced / mesh.fsdp, mesh.dp, dp_link)
    return units * per_unit + tensors * cluster.device.fsdp_tensor_overhead_s


def exposed_dp_s(
    traffic: float,
    compute: float,
    bwd_share: float,
    cluster: Cluster,
    mesh: MeshShape,
    axes: Axes,
    recompute: float = 0.0,
) -> float:
    """Data-parallel traffic left on the critical path (see the module docstring). The
    ``recompute`` of checkpointed layers runs inside the backward, so it hides traffic like the
    backward does (FSDP prefetches the next unit's gather, and reduces the last unit's gradients,
    while a unit re-runs its forward)."""
    if traffic == 0.0 or cluster.device.kind == "cpu":
        return traffic
    window = (compute if mesh.fsdp > 1 else compute * bwd_share) + recompute
    axis = "fsdp" if mesh.fsdp > 1 else "dp"
    group = mesh.fsdp if mesh.fsdp > 1 else mesh.dp
    tail = collective_time_s("all_reduce", DDP_BUCKET_BYTES, group, axis_link(cluster, axes, axis))
    return max(traffic - window, min(traffic, tail))


def buffer_bytes(
    cluster: Cluster,
    mesh: MeshShape,
    precision: Precision,
    local_numel: float,
    local_trainable_numel: float,
    largest_numel: float,
    largest_trainable_numel: float,
) -> float:
    """Transient memory: the GPU reserve, plus, where the program uses FSDP
    (``Precision.wraps_in_fsdp``: autopar's script, :func:`uses_fsdp2`), the transients of the
    largest unit (``largest_numel`` parameters before tp, of which
    ``largest_trainable_numel`` trainable: ``Precision.fsdp_unit_bytes``), or, with DDP, its
    gradient buckets (a copy of the trainable gradients of the rank's own stage at
    ``precision.bucket`` bytes: an even share of the model, the stages not cut yet); and, where
    the regime keeps low-precision weight copies (autocast), those of the rank's stage."""
    reserve = GPU_RESERVE_BYTES if cluster.device.kind == "gpu" else 0
    copies = precision.compute_copy * local_numel / mesh.pp
    if precision.wraps_in_fsdp(mesh):
        unit = precision.fsdp_unit_bytes(largest_numel, largest_trainable_numel) / mesh.tp
        return reserve + unit + copies
    if mesh.dp > 1:
        return reserve + precision.bucket * local_trainable_numel / mesh.pp + copies
    return reserve + copies


def optimizer_s(
    device: DeviceSpec,
    optimizer: str,
    numel: float,
    tensors: int,
    dtensor_tensors: int,
    precision: Precision,
) -> float:
    """The optimizer step on ``numel`` local trainable parameters in ``tensors`` tensors, of
    which ``dtensor_tensors`` are DTensors (FSDP2's shards, TP-styled modules' weights: their
    ops pay DTensor dispatch); none: a frozen layer's step costs nothing."""
    if numel <= 0:
        return 0.0
    if optimizer == "adamw":
        return adamw_step_time_s(
            numel,
            device,
            max(1, tensors),
            dtensor_tensors=dtensor_tensors,
            bytes_per_param=precision.adamw_step_bytes,
        )
    # SGD without momentum: read param and grad, write param (fp32)
    return numel * 12 / (device.memory_bandwidth_bytes_per_s * device.memory_efficiency)


def holds_dtensor(
    module: str, expert: bool, *, fsdp2: bool, tp: int, ep: int, styles: Container[str]
) -> bool:
    """Whether the emitted program holds a trainable parameter of ``module`` as a DTensor (its
    optimizer ops then pay DTensor dispatch): every one where it wraps the model in FSDP2
    (``fsdp2``: ``Precision.wraps_in_fsdp``, replicas included), a TP-styled module's under
    tp > 1 (``styles``: the plan's ``tensor_parallel``; parallelize_module distributes their
    parameters), an expert's (``expert``) under ep > 1."""
    return fsdp2 or (tp > 1 and module in styles) or (ep > 1 and expert)


def offloaded_optimizer_s(numel: float, trainable_numel: float, precision: Precision) -> float:
    """With CPU offload, per step: the sharded parameters (``numel`` of them) go host -> device
    for the forward and backward all-gathers and the gradients of the ``trainable_numel``
    trainable ones come back over PCIe, and AdamW runs on the host (its traffic at the host's
    memory bandwidth; assumptions above)."""
    pcie = numel * precision.param + trainable_numel * precision.grad
    host = trainable_numel * precision.adamw_step_bytes
    return pcie / PCIE_BYTES_PER_S + host / HOST_BYTES_PER_S


def checkpoint_overhead_s(device: DeviceSpec) -> float:
    """Fixed cost of one checkpointed layer beyond its recomputed forward: the device's
    measured figure, else the kind's assumption."""
    if device.checkpoint_layer_s is not None:
        return device.checkpoint_layer_s
    return CKPT_WRAPPER_S[device.kind]


def pipeline_actions(microbatches: int, stages_per_rank: int, pp: int, zero_bubble: bool) -> int:
    """Runtime actions on the busiest rank's critical path: a forward and a backward per
    microbatch and virtual stage plus the fill and drain, 2 (m v + p - 1), or 3 m v + 2 (p - 1)
    when the weight gradients run apart (zero-bubble schedules)."""
    m, v, p = microbatches, stages_per_rank, pp
    if zero_bubble:
        return 3 * m * v + 2 * (p - 1)
    return 2 * (m * v + p - 1)


def boundary_p2p_s(payload_bytes, latency_s: float, s_per_byte: float):
    """A pipeline stage boundary's p2p per microbatch: the activation one way and its gradient
    back, ``payload_bytes`` each (a number, or a numpy array of them)."""
    return 2 * (latency_s + payload_bytes * s_per_byte)


def host_crowd(device: DeviceSpec, processes: int) -> float:
    """``processes`` per core of a CPU host (``DeviceSpec.host_cpus``; unknown: one core each),
    at least 1; 1 on GPUs."""
    if device.kind != "cpu":
        return 1.0
    return max(1.0, processes / max(1, device.host_cpus or processes))


def pipeline_runtime_s(cluster: Cluster, actions: int) -> float:
    """Host time of the pipeline runtime on the busiest rank's critical path: each of its
    ``actions`` (:func:`pipeline_actions`) in torch.distributed.pipelining costs a fixed
    overhead (Python scheduling, p2p set-up and waits, shape checks): the device's measured
    ``pipeline_action_s`` (``plan profile``), else the kind's assumption, scaled on CPU by the
    cores oversubscribed (:func:`host_crowd`); on a GPU host it overlaps kernels."""
    device = cluster.device
    per = PP_ACTION_S[device.kind] if device.pipeline_action_s is None else device.pipeline_action_s
    return actions * per * host_crowd(device, cluster.devices_per_node)


def grad_norm_s(cluster: Cluster, grad_bytes: float, tensors: int) -> float:
    """The emitted loop's gradient norm per step (``--log-every 1``, the default, computes it
    every step, as clipping does): one norm op per local gradient tensor (``tensors`` of them,
    ``optimizer_op_s`` each: element-wise ops without autograd) reading its ``grad_bytes``,
    and the step's totals (loss and squared norm, float64) all-reduced over every rank, on the
    slowest link the world spans. On CPU (gloo) nothing hides the all-reduce; a GPU's few bytes
    cost its latency. The loop waits on the totals at the step's end, where the ranks meet: a
    blocking collective (:func:`cost_model.estimate.blocking_collective_s`: a profiled device
    pays its per-call cost in a step, the wait for the slower rank)."""
    device = cluster.device
    plain = device.op_overhead_s if device.optimizer_op_s is None else device.optimizer_op_s
    read = grad_bytes / (device.memory_bandwidth_bytes_per_s * device.memory_efficiency)
    world = cluster.world_size
    if world == 1:
        return read + tensors * plain
    link = cluster.inter_node if cluster.num_nodes > 1 else cluster.intra_node
    totals = blocking_collective_s("all_reduce", 8.0 * 2, world, link, device)
    return read + tensors * plain + totals
