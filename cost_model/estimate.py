"""Pure estimators of time and memory per rank. Every assumption is stated where it is made.

Time: a roofline per op plus a fixed overhead per launched op; collectives: the alpha-beta ring
model with nccl-tests' bus-bandwidth convention. Memory: bytes per rank by kind.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from autopar.cost_model.precision import FP32, Precision
from autopar.cost_model.spec import Cluster, DeviceSpec, Dtype, Link, MemoryBreakdown

if TYPE_CHECKING:  # the IR's types only: importing ir would import torch
    from autopar.ir import Graph, Node

CollectiveKind = Literal[
    "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast"
]

# Launched ops per parameter tensor: torch's for-loop AdamW (the CPU default) runs 10.2 aten ops
# per tensor (counted with a TorchDispatchMode on torch 2.13); on GPU the foreach (multi-tensor)
# kernels cover many tensors per launch, so we count 1 per tensor as an upper bound.
ADAMW_OPS_PER_TENSOR = {"cpu": 10, "gpu": 1}
# Launched ops per traced forward node: forward + backward (node_time_s).
OPS_PER_NODE = 3
# DTensor ops a styled module call dispatches, forward and backward (from_local, redistribute,
# the op, bias, to_local, and their backward): on CPU a TP step of an 8-block MLP took 5.6 ms more
# than DDP for 16 styled calls, 350 us each = ~15 ops at the measured 23 us per DTensor op.
TP_OPS_PER_STYLED_CALL = 15


def compute_time_s(
    flops: float,
    bytes_moved: float,
    device: DeviceSpec,
    dtype: Dtype,
    *,
    matmul: bool,
    num_ops: int = 1,
    tp_ops: int = 0,
) -> float:
    """Roofline time of ``num_ops`` ops doing ``flops`` and moving ``bytes_moved`` in total:
    max(flops / (peak * matmul_efficiency), bytes / (bandwidth * memory_efficiency))
    + num_ops * op_overhead_s + tp_ops * tp_op_overhead_s.

    Matmuls use ``peak_flops[dtype]`` (tensor cores); other ops use ``vector_flops[dtype]`` (CUDA
    cores or CPU vector units; the matmul peak where absent) at the same efficiency. The roofline
    term is multiplied by ``device.compute_scale`` (1 unless a profile measured otherwise).
    """
    if dtype not in device.peak_flops:
        raise ValueError(
            f"dtype {dtype!r} is not one of {sorted(device.peak_flops)} for {device.name}"
        )
    peak = (
        device.peak_flops[dtype]
        if matmul
        else device.vector_flops.get(dtype, device.peak_flops[dtype])
    )
    compute = flops / (peak * device.matmul_efficiency)
    memory = bytes_moved / (device.memory_bandwidth_bytes_per_s * device.memory_efficiency)
    roofline = max(compute, memory) * device.compute_scale
    return roofline + num_ops * device.op_overhead_s + tp_ops * device.tp_op_overhead_s


_MATMUL_OPS = frozenset({
    "aten.linear.default", "aten.mm.default", "aten.addmm.default", "aten.bmm.default",
    "aten.matmul.default", "aten.baddbmm.default", "aten.scaled_dot_product_attention.default",
    "aten.convolution.default", "aten.conv2d.default", "aten.conv1d.default",
})  # fmt: skip
# ops charged no bytes: views, and the reshapes / getitems that are views on contiguous inputs
# (ir._flops.VIEW_OPS is the stricter list of ops whose output always aliases an input)
_FREE_OPS = frozenset({
    "view", "reshape", "_unsafe_view", "transpose", "t", "permute", "unsqueeze", "squeeze",
    "expand", "getitem", "alias", "detach", "slice", "select", "split", "split_with_sizes",
    "chunk", "unbind", "narrow",
})  # fmt: skip


def _launches_nothing(node: Node) -> bool:
    """Whether ``node``'s op is a view (``_FREE_OPS``): no bytes moved, no rows computed."""
    op = node.op.split(".")[1] if node.op.startswith("aten.") else node.op
    return op in _FREE_OPS


def scaled(graph: Graph, node: Node, value: float, scale: float) -> float:
    """Values of tensors that carry the batch dim scale with the local batch: a first dim of
    the batch size, or any node of a mixture-of-experts block (its rows are the batch's tokens,
    flattened and routed)."""
    out = node.out
    carries_batch = out is not None and out.shape and out.shape[0] == graph.batch_size
    return value * scale if carries_batch or node.name in graph.routed_nodes else value


def output_bytes(graph: Graph, name: str) -> int:
    """Bytes of node ``name``'s (first) output at the traced batch; 0 if it is no tensor."""
    meta = graph.node(name).out
    return meta.num_bytes if meta is not None else 0


def node_time_s(
    graph: Graph,
    node: Node,
    device: DeviceSpec,
    dtype: Dtype,
    *,
    batch_scale: float = 1.0,
    shards: int = 1,
    tp_ops: int = 0,
) -> float:
    """Forward + backward time of one traced node at ``batch_scale`` x the traced batch, its
    work split ``shards`` ways (tensor parallelism): the roofline of its FLOPs (forward and
    backward) and of the bytes it moves (forward reads inputs and writes the output, backward
    about twice that: an assumption; views move nothing), plus 3 launched ops (forward and
    backward) and ``tp_ops`` DTensor ops."""
    flops = node.fwd_flops + node.bwd_flops
    roofline = _node_roofline_s(graph, node, device, dtype, flops, 3, batch_scale, shards)
    per_op = device.op_overhead_s
    if device.op_row_s:  # 0 for datasheet devices: no rows to count
        per_op += device.op_row_s * op_rows(graph, node, batch_scale)
    return roofline + OPS_PER_NODE * per_op + tp_ops * device.tp_op_overhead_s


def node_forward_time_s(
    graph: Graph, node: Node, device: DeviceSpec, dtype: Dtype, *, batch_scale: float = 1.0
) -> float:
    """Forward time alone of one traced node at ``batch_scale`` x the traced batch (a forward
    re-run with autograd recording: its FLOPs, its inputs read and output written once, one
    launched op): what a pass that runs a block's forward again pays per node."""
    roofline = _node_roofline_s(graph, node, device, dtype, node.fwd_flops, 1, batch_scale, 1)
    rows = op_rows(graph, node, batch_scale) if device.op_row_s else 0.0
    return roofline + device.op_overhead_s + device.op_row_s * rows


def op_rows(graph: Graph, node: Node, batch_scale: float = 1.0) -> float:
    """Rows of one traced node's output at ``batch_scale`` x the traced batch: its elements
    over its last dim (``DeviceSpec.op_row_s`` is per row and launched op); 0 for a node that
    launches no kernel (a view) or has no tensor output. Not divided under tensor parallelism:
    a style splits a row (a linear's features), seldom the rows."""
    out = node.out
    if out is None or _launches_nothing(node):
        return 0.0
    rows = math.prod(out.shape[:-1]) if out.shape else 1
    return scaled(graph, node, float(rows), batch_scale)


def _node_roofline_s(
    graph: Graph,
    node: Node,
    device: DeviceSpec,
    dtype: Dtype,
    flops: float,
    passes: int,
    batch_scale: float,
    shards: int,
) -> float:
    """The roofline part of a node's time (:func:`compute_time_s` without launched ops):
    ``flops`` and ``passes`` times its inputs' and output's bytes, at ``batch_scale``, split
    ``shards`` ways."""
    moved = 0.0
    if not _launches_nothing(node):
        io = sum(output_bytes(graph, i) for i in node.inputs) + output_bytes(graph, node.name)
        moved = passes * scaled(graph, node, io, batch_scale) / shards
    return compute_time_s(
        scaled(graph, node, flops, batch_scale) / shards,
        moved,
        device,
        dtype,
        matmul=node.op in _MATMUL_OPS or "grouped_mm" in node.op,
        num_ops=0,
    )


def graph_time_s(graph: Graph, device: DeviceSpec, dtype: Dtype) -> float:
    """Forward + backward time of a whole traced graph on one device (no parallelism)."""
    return sum(
        node_time_s(graph, n, device, dtype)
        for n in graph.nodes
        if n.kind == "compute" and n.out is not None
    )


def _ring(kind: CollectiveKind, n: int) -> tuple[float, int]:
    """(bandwidth factor, latency steps) of a ring collective over n ranks.

    all_reduce = reduce_scatter then all_gather: 2(n-1)/n of the bytes, 2(n-1) steps;
    all_gather / reduce_scatter: (n-1)/n, n-1 steps; all_to_all (pairwise exchange): (n-1)/n,
    n-1 steps; send_recv: the whole tensor, 1 step; broadcast (pipelined chain): the whole tensor,
    n-1 steps.
    """
    factors = {
        "all_reduce": (2 * (n - 1) / n, 2 * (n - 1)),
        "all_gather": ((n - 1) / n, n - 1),
        "reduce_scatter": ((n - 1) / n, n - 1),
        "all_to_all": ((n - 1) / n, n - 1),
        "send_recv": (1.0, 1),
        "broadcast": (1.0, n - 1),
    }
    if kind not in factors:
        raise ValueError(f"collective {kind!r} is not one of {sorted(factors)}")
    return factors[kind]


def collective_time_s(kind: CollectiveKind, num_bytes: float, group_size: int, link: Link) -> float:
    """Time of one collective on the full (unsharded) tensor of ``num_bytes`` over ``group_size``
    ranks: latency_s * steps + factor * num_bytes / bus bandwidth (see ``_ring``), or the link's
    profiled cost of this kind (``Link.measured``) where it has one. A group of one rank costs
    nothing."""
    if group_size < 1 or num_bytes < 0:
        raise ValueError(f"group_size {group_size} must be >= 1 and num_bytes {num_bytes} >= 0")
    if group_size == 1:
        return 0.0
    factor, steps = _ring(kind, group_size)
    same_kind = [m for m in link.measured if m.kind == kind]
    if same_kind:
        # a profiled cost of this kind: exact at its group size, else scaled from the nearest
        # measured size by the ring's latency steps and bandwidth factor
        m = min(same_kind, key=lambda m: (abs(m.group_size - group_size), -m.group_size))
        f0, s0 = _ring(kind, m.group_size)
        return m.alpha_s * steps / s0 + num_bytes * factor / f0 / m.bytes_per_s
    return link.latency_s * steps + factor * num_bytes / link.bandwidth_bytes_per_s


def blocking_collective_s(
    kind: CollectiveKind, num_bytes: float, group_size: int, link: Link, device: DeviceSpec
) -> float:
    """One collective a step waits on between its own ops: a tensor-parallel style's,
    context parallel's keys and values, expert parallel's all-to-alls, the loop's totals after
    the gradient norm. Its time on the link (:func:`collective_time_s`) plus what such a call costs
    around it in a real step (``DeviceSpec.tp_collective_overhead_s``: the wait for the other
    ranks, which a back-to-back benchmark never sees, and the Python wrappers; profiled on TP's,
    0 for datasheet devices). A group of one rank costs nothing."""
    if group_size == 1:
        return 0.0
    return collective_time_s(kind, num_bytes, group_size, link) + device.tp_collective_overhead_s


def axis_link(cluster: Cluster, axes: Sequence[tuple[str, int]], axis: str) -> Link:
    """The link a collective over mesh ``axis`` crosses.

    ``axes`` lists the mesh axes outermost first with their sizes; ranks are laid out row-major
    (innermost axis contiguous, as ``init_device_mesh`` does), so a group of ``axis`` spans
    size(axis) * prod(sizes of inner axes) consecutive ranks. Every group lies within one node
    iff that span divides devices_per_node (for spans <= devices_per_node that do not divide it,
    some groups straddle two nodes and the slowest group sets the time); a size-1 axis never
    leaves its rank.
    """
    names = [name for name, _ in axes]
    if axis not in names:
        raise ValueError(f"axis {axis!r} is not in the mesh axes {names}")
    index = names.index(axis)
    size = axes[index][1]
    span = size * math.prod(s for _, s in axes[index + 1 :])
    if size == 1 or cluster.devices_per_node % span == 0:
        return cluster.intra_node
    return cluster.inter_node


def memory_per_rank(
    *,
    param_numel: float,
    precision: Precision,
    shard_factor: float,
    activation_bytes: float,
    buffer_bytes: float,
    optimizer: Literal["adamw", "sgd"] = "adamw",
    trainable_numel: float | None = None,
) -> MemoryBreakdown:
    """Bytes per rank. Parameters take ``precision.param`` bytes each; gradients
    (``precision.grad``) and optimizer state (``precision.state``: an fp32 master copy where
    parameters are low precision, plus AdamW's two fp32 moments; SGD without momentum keeps
    none) only the ``trainable_numel`` of them that require grad (default: all). Everything is
    divided by ``shard_factor`` (the product of the FSDP/TP/PP divisions that apply, as the
    caller computes it). Each part is rounded up to whole bytes.
    """
    trainable = param_numel if trainable_numel is None else trainable_numel
    if shard_factor <= 0 or min(param_numel, activation_bytes, buffer_bytes, trainable) < 0:
        raise ValueError(
            f"shard_factor {shard_factor} must be > 0 and sizes >= 0 "
            f"(param_numel {param_numel}, activations {activation_bytes}, buffers {buffer_bytes})"
        )
    if trainable > param_numel:
        raise ValueError(f"trainable_numel {trainable} exceeds param_numel {param_numel}")
    local, local_trainable = param_numel / shard_factor, trainable / shard_factor
    return MemoryBreakdown(
        params=math.ceil(local * precision.param),
        grads=math.ceil(local_trainable * precision.grad),
        optimizer=math.ceil(local_trainable * precision.state(optimizer)),
        activations=math.ceil(activation_bytes),
        buffers=math.ceil(buffer_bytes),
    )


def adamw_step_time_s(
    param_numel_local: float,
    device: DeviceSpec,
    num_tensors: int = 1,
    *,
    dtensor_tensors: int = 0,
    bytes_per_param: float = FP32.adamw_step_bytes,
) -> float:
    """Memory-bound AdamW step on this rank's trainable parameters (frozen ones are skipped:
    they have no gradient): ``bytes_per_param`` (28 in fp32; ``Precision.adamw_step_bytes``) at
    the device's effective bandwidth, plus the per-op overhead of the ops launched per parameter
    tensor (``optimizer_op_s``, else ``op_overhead_s``).

    ``dtensor_tensors`` of the ``num_tensors`` are DTensors (FSDP2 shards, TP-styled weights),
    so each of their optimizer ops also pays the DTensor dispatch (``dtensor_optimizer_op_s``,
    else ``tp_op_overhead_s``). Measured on CPU (gloo, 2 processes, calibrate.py): FSDP2 steps
    of the GPT and MLP examples took ~1.25 ms more per parameter tensor than predicted without
    it, i.e. ~10 ops at ~125 us; a tp=2 GPT's step as much as an fsdp=2 one's.
    """
    traffic = param_numel_local * bytes_per_param
    bandwidth = device.memory_bandwidth_bytes_per_s * device.memory_efficiency
    per_tensor = ADAMW_OPS_PER_TENSOR[device.kind]
    extra = device.dtensor_optimizer_op_s
    extra = device.tp_op_overhead_s if extra is None else extra
    plain = device.op_overhead_s if device.optimizer_op_s is None else device.optimizer_op_s
    dispatch = (
        num_tensors * per_tensor * plain + min(dtensor_tensors, num_tensors) * per_tensor * extra
    )
    return traffic / bandwidth + dispatch
