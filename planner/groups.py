"""Clusters of several kinds of nodes (``2x8xH100+2x8xA100-80GB``): where a group's own speed
and memory change the plan.

The cost model prices every choice on the cluster's uniform device (the slowest group's, the
smallest memory: :func:`cost_model.cluster.grouped`). Two choices then use each group's own:

- **pipeline stages**: ranks are numbered group after group and pp is the outermost mesh axis, so
  when each pipeline rank's devices lie in one group, that rank runs its stages at its group's
  speed and within its group's memory: the stage DP sizes stages by ``time_scales`` (a faster
  group gets more layers) and by ``rank_capacity_bytes`` (a group with more memory may hold
  more); which group runs which stages is searched (``pipeline_orders``: each group's pipeline
  ranks kept together, every order of the groups up to interchangeable ones) and emitted as
  the block of ranks each pipeline rank runs on (``pipeline_blocks``);
- **batch shares**: without a pipeline, when each data-parallel rank's devices lie in one group,
  a faster rank takes a larger share of the global batch (``batch_shares``), each a multiple of
  the accumulation steps; the losses are weighted by share so that the gradients are exactly the
  global batch's mean (the emitted runtime's ``BATCH_SHARES``).

A group's speed is the cost model's own: the model's forward on that group's device over its
forward on the uniform device (:func:`cost_model.estimate.graph_time_s`); its memory its
device's. A pipeline rank that spans groups, and every rank without a pipeline, gets the
uniform treatment's memory (the smallest group's).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from autopar.cost_model.estimate import graph_time_s
from autopar.cost_model.spec import Cluster, Dtype
from autopar.ir.graph import Graph
from autopar.planner.rules import AXES

if TYPE_CHECKING:  # plan.py checks a plan's pipeline placement here: no import cycle
    from autopar.planner.plan import Mesh

__all__ = [
    "MAX_ORDERS",
    "group_time_scales",
    "rank_groups",
    "time_scales",
    "rank_capacity_bytes",
    "pipeline_orders",
    "pipeline_blocks",
    "batch_shares",
    "share_step_factor",
]

MAX_ORDERS = 24
"""Distinct group orders on a pipeline tried exhaustively (every order of up to 4 distinct
groups); beyond, a few (:func:`pipeline_orders`)."""


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


def rank_capacity_bytes(
    cluster: Cluster, pipeline_groups: Sequence[int] | None, pp: int
) -> tuple[int, ...]:
    """Per pipeline rank, the device memory it may fill: its group's where each pipeline rank
    lies in one group (``pipeline_groups``: per pipeline rank, its group), else the uniform
    treatment's (the smallest group's) on every rank. The one rule behind a mixed cluster's
    memory: the stage DP sizes stages to it, the plan's ``fits``, its memory report and the
    explanation check each rank against it."""
    if pipeline_groups is None or not cluster.groups:
        return (cluster.device.memory_bytes,) * pp
    assert len(pipeline_groups) == pp, (pipeline_groups, pp)
    return tuple(cluster.groups[g].device.memory_bytes for g in pipeline_groups)


def pipeline_orders(
    cluster: Cluster, blocks: Sequence[int], scales: Sequence[float] = ()
) -> list[tuple[int, ...]]:
    """The placements of the groups on the pipeline to try, each as per pipeline rank the group
    that runs it; rank order first. ``blocks``: per pipeline block of ranks (in rank order), its
    group (:func:`rank_groups`). A placement keeps each group's blocks together (p2p inside a
    group) and orders the groups: every order, where interchangeable groups (equal
    ``NodeGroup``: device, memory, links, size) count once, so identical groups add no orders;
    where that gives more than :data:`MAX_ORDERS`, rank order, its reverse, and the groups by
    speed (``scales``, per group its time scale) and by memory, each way."""
    seq = list(dict.fromkeys(blocks))  # the groups in rank order
    count = Counter(blocks)
    kind = [next(k for k in seq if cluster.groups[k] == cluster.groups[g]) for g in seq]
    kinds = Counter(kind)
    distinct = math.factorial(len(seq)) // math.prod(math.factorial(n) for n in kinds.values())
    if distinct <= MAX_ORDERS:
        orders = []
        for shape in _multiset_orders(list(dict.fromkeys(kind)), dict(kinds)):
            left = {k: [g for g, kg in zip(seq, kind) if kg == k] for k in kinds}
            orders.append([left[k].pop(0) for k in shape])  # like groups in rank order
    else:
        speed = lambda g: scales[g] if scales else 1.0  # noqa: E731
        memory = lambda g: -cluster.groups[g].device.memory_bytes  # noqa: E731
        by_speed, by_memory = sorted(seq, key=speed), sorted(seq, key=memory)
        orders = [seq, seq[::-1], by_speed, by_speed[::-1], by_memory, by_memory[::-1]]
    placed = [tuple(g for g in order for _ in range(count[g])) for order in orders]
    return list(dict.fromkeys(placed))


def _multiset_orders(kinds: list[int], left: dict[int, int]) -> Iterator[list[int]]:
    """Every distinct order of the multiset ``left`` (kind -> count), ``kinds`` first first."""
    if not any(left.values()):
        yield []
        return
    for k in kinds:
        if left[k]:
            left[k] -= 1
            for rest in _multiset_orders(kinds, left):
                yield [k, *rest]
            left[k] += 1


def pipeline_blocks(cluster: Cluster, mesh: Mesh, pipeline_groups: Sequence[int]) -> list[int]:
    """Per pipeline rank, the block of ranks it runs on (the world cut into ``mesh.pp`` equal
    contiguous blocks in rank order): each rank takes its group's next block in rank order.
    What the emitted program's mesh is built from (PIPELINE_BLOCKS). Raises ValueError (one
    line) where ``pipeline_groups`` is not such a placement of this mesh on this cluster: a
    pipeline rank spans groups, a group's count differs, or a group's ranks are not together."""
    blocks = rank_groups(cluster, mesh, "pp")
    where = f"mixed_cluster.pipeline_groups {list(pipeline_groups)}"
    if blocks is None:
        raise ValueError(
            f"{where}: the pipeline ranks of mesh {mesh.short()} do not each lie in one group of "
            f"{cluster.spec}: remove pipeline_groups (or change the mesh)"
        )
    if sorted(pipeline_groups) != sorted(blocks):
        raise ValueError(
            f"{where}: must place the groups of the pipeline blocks {list(blocks)} (each as "
            "often as it holds blocks) in some order: fix the list"
        )
    order = list(dict.fromkeys(pipeline_groups))
    if [g for g in order for _ in range(blocks.count(g))] != list(pipeline_groups):
        raise ValueError(f"{where}: each group's pipeline ranks must be consecutive: fix the list")
    free = {g: [i for i, b in enumerate(blocks) if b == g] for g in order}
    return [free[g].pop(0) for g in pipeline_groups]


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
