"""Clusters of several kinds of nodes (``2x8xH100+2x8xA100-80GB``): where a group's own speed
changes the plan.

The cost model prices every choice on the cluster's uniform device (the slowest group's, the
smallest memory: :func:`cost_model.cluster.grouped`). Two choices then use each group's speed:

- **pipeline stages**: ranks are numbered group after group and pp is the outermost mesh axis, so
  when each pipeline rank's devices lie in one group, that rank runs its stages at its group's
  speed: the stage DP sizes stages by ``time_scales`` (a faster group gets more layers);
- **batch shares**: without a pipeline, when each data-parallel rank's devices lie in one group,
  a faster rank takes a larger share of the global batch (``batch_shares``), each a multiple of
  the accumulation steps; the losses are weighted by share so that the gradients are exactly the
  global batch's mean (the emitted runtime's ``BATCH_SHARES``).

A group's speed is the cost model's own: the model's forward on that group's device over its
forward on the uniform device (:func:`cost_model.estimate.graph_time_s`). Memory stays the
uniform treatment's (the smallest group's), which is safe and, where the groups' memories
differ, conservative.
"""

from __future__ import annotations

import math

from autopar.cost_model.estimate import graph_time_s
from autopar.cost_model.spec import Cluster, Dtype
from autopar.ir.graph import Graph
from autopar.planner.plan import Mesh
from autopar.planner.rules import AXES

__all__ = ["group_time_scales", "rank_groups", "time_scales", "batch_shares", "share_step_factor"]


def group_time_scales(graph: Graph, cluster: Cluster, dtype: Dtype) -> tuple[float, ...]:
    """Per group, its time for the model's work over the uniform device's (<= 1: the uniform
    device is the slowest); () for a cluster of one kind."""
    if not cluster.heterogeneous:
        return ()
    uniform = graph_time_s(graph, cluster.device, dtype)
    if uniform <= 0:
        return tuple(1.0 for _ in cluster.groups)
    return tuple(min(1.0, graph_time_s(graph, g.device, dtype) / uniform) for g in cluster.groups)


def rank_groups(cluster: Cluster, mesh: Mesh, axis: str) -> tuple[int, ...] | None:
    """Per index along ``axis`` ("pp" or the data-parallel ranks "dp"), the group that holds
    all of its devices; None when one index spans groups (or the cluster is of one kind).

    The mesh lays ranks out in AXES order (pp outermost, tp innermost)."""
    if not cluster.heterogeneous:
        return None
    if axis != "pp" and mesh.pp > 1:  # data-parallel ranks then span the pipeline's groups
        return None
    world = math.prod(getattr(mesh, a) for a in AXES)
    count = mesh.pp if axis == "pp" else mesh.dp * mesh.fsdp  # (dp, fsdp): cp x ep x tp inside
    block = world // count  # each index holds a contiguous block of ranks
    out = []
    for i in range(count):
        first, last = cluster.group_of_rank(i * block), cluster.group_of_rank((i + 1) * block - 1)
        if first != last:  # groups are contiguous in rank order: the ends decide
            return None
        out.append(first)
    return tuple(out)


def time_scales(
    scales: tuple[float, ...], groups: tuple[int, ...] | None
) -> tuple[float, ...] | None:
    """Per index, its group's time scale; None where no index runs faster than the uniform."""
    if groups is None or not scales:
        return None
    out = tuple(scales[g] for g in groups)
    return out if min(out) < 1.0 else None


def batch_shares(
    global_batch: int, scales: tuple[float, ...] | None, unit: int = 1
) -> tuple[int, ...] | None:
    """Samples per step for each data-parallel rank, proportional to its speed (1 / scale), in
    multiples of ``unit`` (the accumulation steps), each at least one unit, summing to
    ``global_batch``; None where that gives every rank the same share (the uniform split)."""
    if scales is None:
        return None
    n = len(scales)
    units = global_batch // unit
    if units < n or global_batch % unit:
        return None
    speed = [1.0 / s for s in scales]
    ideal = [units * v / sum(speed) for v in speed]
    counts = [max(1, math.floor(x)) for x in ideal]
    while sum(counts) > units:  # the floor of 1 took units from elsewhere
        i = max(range(n), key=lambda k: counts[k] - ideal[k])
        counts[i] -= 1
    order = sorted(range(n), key=lambda k: ideal[k] - counts[k], reverse=True)
    for i in order[: units - sum(counts)]:  # largest remainders first
        counts[i] += 1
    if len(set(counts)) == 1:
        return None
    return tuple(c * unit for c in counts)


def share_step_factor(
    shares: tuple[int, ...], scales: tuple[float, ...], global_batch: int
) -> float:
    """The slowest data-parallel rank's compute time with ``shares`` over the uniform split's
    on the uniform device (every rank at scale 1 with global_batch / n samples)."""
    even = global_batch / len(shares)
    return max(s * b / even for s, b in zip(scales, shares, strict=True))
