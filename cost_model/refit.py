"""Refit: the cost model's coefficients fitted to what runs measured (``train.py
--profile-steps N`` -> ``profile.json``, :mod:`cost_model.measured`), stored as a cluster profile
(:class:`cost_model.profile_data.Profile`, ``source: "refit"``) that ``plan --profile`` names
next time (issue 27, item 2). Pure: the caller traces the model and passes the graph and the
plan's facts; nothing here imports the planner.

What is fitted, and from what (every row of every run; least squares with parameters >= 0):

  compute        per layer, the measured forward + backward (per step, all microbatches)
                 against the planner's own terms for that layer (:func:`estimate.node_time_s`
                 summed over the layer's nodes at the run's local batch):
                   t_layer = compute_scale * roofline_layer + op_overhead_s * ops_layer
                             + op_row_s * rows_layer
                 (op_row_s the profile's, kept: a run's layers at one batch do not tell it
                 from the per-op cost)
                 (least squares of the absolute residuals: the big layers set the step)
                 (roofline: FLOPs and bytes at the device's rates, the per-op-class shape
                 regime the roofline already tells apart: matmul FLOP-bound, the rest
                 bytes-bound). Layers
                 that a TP style touches are left out here (their time holds DTensor dispatch
                 and TP collectives). A checkpointed layer's backward re-runs its forward: its
                 row counts that share again, less the wrapper's fixed cost. In a
                 data-parallel run (dp, fsdp or cp > 1) the gradient hooks and reductions
                 run in backward: its layers give forward rows only (the planner's forward
                 share of the features: fwd_flops / (fwd + bwd flops)); an FSDP run's
                 forward (FSDP2 over fsdp x cp) holds its all-gathers, and a layer with MoE
                 blocks under ep its all-to-alls: they give no compute row.
  DDP            ddp_comm_scale from DDP runs: their layers' backward beyond the fitted
                 compute plus the end of backward, less DDP's per-tensor work (the profile's
                 ddp_tensor_overhead_s, kept), over the bucket all-reduces at the fitted
                 all-reduce cost (on CPU the planner charges that product, nothing hidden).
  tensor par.    tp_op_overhead_s from the TP'd layers of tp > 1 runs, their TP collective
                 time taken out, compute and per-op terms held at the fit above.
  optimizer      optimizer_op_s from the optimizer step of runs whose parameters are plain
                 tensors: t_opt - bytes / bandwidth = optimizer_op_s * ops_opt;
                 dtensor_optimizer_op_s from the steps of runs with DTensor parameters (FSDP2's,
                 TP-styled modules'), beyond the plain per-op cost, over their DTensor ops.
  collectives    per (kind, group size): ``t = alpha + bytes / beta`` over the message sizes
                 the run's collectives had (time_s / num_calls against message_bytes) where
                 they differ enough (x2) and the line has both terms (a size term 100x
                 faster than the base's is the load's noise), else the base curve scaled to
                 the measured points (median ratio): stored in the link's ``measured`` costs,
                 which replace the ring model for that kind
                 (:func:`estimate.collective_time_s`). A scalar's all-reduce (the gradient
                 norm's) is no point of the curve: it follows each rank's own work, and its
                 record holds the ranks' skew. Point-to-point (pipeline send/recv) is not
                 fitted: a receive's record holds its wait for the sender.

A coefficient that no row informs keeps the base value, so a data-parallel profile changes no
tensor-parallel, pipeline or DTensor coefficient (:func:`changed` lists what moved).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import statistics
from collections.abc import Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np
from autopar.cost_model.estimate import (
    ADAMW_OPS_PER_TENSOR,
    OPS_PER_NODE,
    TP_OPS_PER_STYLED_CALL,
    adamw_step_time_s,
    collective_time_s,
    node_time_s,
    op_rows,
)
from autopar.cost_model.fit import fit_linear, nonneg_lstsq
from autopar.cost_model.measured import MeasuredProfile
from autopar.cost_model.precision import uses_fsdp2
from autopar.cost_model.profile_data import Profile
from autopar.cost_model.spec import (
    MAX_SCALE,
    MIN_SCALE,
    Cluster,
    CollectiveCost,
    DeviceSpec,
    Link,
)
from autopar.cost_model.step import checkpoint_overhead_s, holds_dtensor

if TYPE_CHECKING:  # the IR's types only: importing ir would import torch
    from autopar.ir import Graph

__all__ = [
    "CollectiveRow",
    "LayerRow",
    "OptimizerRow",
    "RunFacts",
    "RunRows",
    "RefitResult",
    "changed",
    "fit_runs",
    "rows_of",
]

# kinds as the runtime's records name them -> the cost model's CollectiveKind
_KINDS = {
    "all_reduce": "all_reduce", "allreduce": "all_reduce",
    "all_gather": "all_gather", "allgather": "all_gather", "_allgather_base": "all_gather",
    "all_gather_into_tensor": "all_gather", "allgather_into_tensor_coalesced": "all_gather",
    "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all": "all_to_all", "alltoall": "all_to_all", "alltoall_base": "all_to_all",
}  # fmt: skip
# an all-reduce of at most this many bytes is a scalar (the gradient norm), not a DDP bucket
# nor a TP activation; it times the ranks' skew, not the link
_SCALAR_BYTES = 64
# a size regime the line t = alpha + bytes / beta can be fitted over
_SPREAD = 2.0


@dataclasses.dataclass(frozen=True)
class RunFacts:
    """What a refit needs of the plan that ran (plan.json's fields, as numbers)."""

    name: str
    mesh: dict[str, int]
    global_batch: int
    num_microbatches: int
    dtype: str
    optimizer: str
    tensor_parallel: dict[str, str]
    checkpointed: frozenset[str]
    adamw_step_bytes: float = 28.0
    """bytes per parameter of one AdamW step (``Precision.adamw_step_bytes``)."""


@dataclasses.dataclass(frozen=True)
class LayerRow:
    """One layer of one run: measured seconds per step against the model's features."""

    run: str
    fqn: str
    measured_s: float
    roofline_s: float
    """the roofline at compute_scale 1 (seconds)."""
    ops: float
    """launched ops (the planner's count: OPS_PER_NODE per node, per microbatch)."""
    tp_ops: float
    """DTensor ops (styled calls x TP_OPS_PER_STYLED_CALL); 0 for a layer no style touches."""
    fixed_s: float = 0.0
    """what its ops' rows cost at the base's ``op_row_s`` (kept: not fitted); the fits take it
    out of ``measured_s``."""

    @property
    def fitted_s(self) -> float:
        """The measured seconds the fitted coefficients explain."""
        return self.measured_s - self.fixed_s


@dataclasses.dataclass(frozen=True)
class OptimizerRow:
    run: str
    measured_s: float
    traffic_s: float
    """the step's bytes at the device's bandwidth."""
    ops: float
    dtensor_ops: float
    """of ``ops``, those on DTensor parameters (FSDP2's shards, TP-styled modules')."""


@dataclasses.dataclass(frozen=True)
class CollectiveRow:
    run: str
    kind: str
    """the cost model's kind (``all_reduce``...)."""
    group: str | None
    group_size: int
    num_bytes: float
    time_s: float
    """per call."""
    num_calls: float


@dataclasses.dataclass(frozen=True)
class RunRows:
    name: str
    layers: tuple[LayerRow, ...]
    optimizer: OptimizerRow | None
    collectives: tuple[CollectiveRow, ...]
    tp_comm_s: float
    """the TP group's collective time per step (inside the layers)."""
    ddp: bool = False
    """DDP ran (dp > 1, no FSDP2: :func:`~cost_model.precision.uses_fsdp2`): its gradient
    all-reduces run inside backward."""
    backward: tuple[LayerRow, ...] = ()
    """a DDP run's layers' backward (their forward rows are in ``layers``)."""
    backward_other_s: float = 0.0
    """the end of backward outside the layers (DDP waits for its last bucket there)."""
    param_tensors: int = 0
    """the model's parameter tensors, as the planner counts DDP's per-tensor work."""


@dataclasses.dataclass(frozen=True)
class RefitResult:
    profile: Profile
    changes: dict[str, tuple[float, float]]
    """coefficient -> (before, after), only those that moved."""
    residuals: dict[str, float]
    """per fit: root mean square of the relative residuals."""


def _styled_scopes(styles: dict[str, str]) -> list[str]:
    """The module scopes whose ops run sharded under TP: each styled module's parent (a
    colwise q/k/v and a rowwise o put the whole attention on local heads)."""
    return sorted({fqn.rsplit(".", 1)[0] if "." in fqn else fqn for fqn in styles})


def _inside(scope: str, stack: Sequence[str]) -> bool:
    return any(m == scope or m.startswith(scope + ".") for m in stack)


def rows_of(profile: MeasuredProfile, graph: Graph, facts: RunFacts, device: DeviceSpec) -> RunRows:
    """The rows a run's profile gives, with the features of ``device`` (its rates; its
    coefficients are set aside: the fit finds them). ``graph`` is the run's model traced as the
    planner traces it (per-layer nodes, FLOPs, bytes at ``graph.batch_size``)."""
    mesh = {a: facts.mesh.get(a, 1) for a in ("pp", "dp", "fsdp", "cp", "ep", "tp")}
    unit = device.model_copy(update={"compute_scale": 1.0, "op_overhead_s": 0.0,
                                     "op_row_s": 0.0, "tp_op_overhead_s": 0.0})  # fmt: skip
    m = max(1, facts.num_microbatches)
    micro = facts.global_batch / (mesh["dp"] * mesh["fsdp"] * m)
    scale = micro / (graph.batch_size * mesh["cp"])
    tp = mesh["tp"]
    scopes = _styled_scopes(facts.tensor_parallel) if tp > 1 else []
    # gradient hooks and reductions run inside a data-parallel run's backward (gradients are
    # averaged over dp x fsdp x cp): its layers' forward rows fit compute, their backward what
    # DDP adds (ddp_comm_scale)
    sync = mesh["dp"] * mesh["fsdp"] * mesh["cp"] > 1
    # FSDP2 shards over fsdp x cp: its all-gathers wait inside every layer's forward
    gathers = mesh["fsdp"] * mesh["cp"] > 1
    means = [r.mean for r in profile.ranks]  # layers from the ranks that ran them
    layers, backward = [], []
    for layer in graph.layers:
        held = [mn.layers[layer.fqn] for mn in means if layer.fqn in mn.layers]
        if not held:
            continue
        roof = ops = tp_ops = rows_s = 0.0
        for name in layer.nodes:
            node = graph.node(name)
            if node.kind != "compute" or node.out is None:
                continue
            sharded = any(_inside(s, node.module_stack) for s in scopes)
            roof += node_time_s(graph, node, unit, facts.dtype, batch_scale=scale,  # type: ignore[arg-type]
                                shards=tp if sharded else 1)  # fmt: skip
            ops += OPS_PER_NODE
            rows_s += OPS_PER_NODE * device.op_row_s * op_rows(graph, node, scale)
        styled = [f for f in facts.tensor_parallel if tp > 1 and _inside(layer.fqn, (f,))]
        tp_ops = float(TP_OPS_PER_STYLED_CALL * len(styled))
        flops = layer.fwd_flops + layer.bwd_flops
        share = layer.fwd_flops / flops if flops else 1 / 3  # the planner's forward share
        fwd = statistics.fmean(t.forward_s for t in held)
        bwd = statistics.fmean(t.backward_s for t in held)
        redo = 0.0
        if layer.fqn in facts.checkpointed:  # backward re-runs the forward
            redo = share
            bwd -= m * checkpoint_overhead_s(device)
        features = (m * roof, m * ops, m * tp_ops)
        parts = [(fwd, share), (bwd, 1 - share + redo)]
        rows = parts[:1] if sync else [(fwd + bwd, 1 + redo)]
        if gathers:  # FSDP's all-gathers wait inside the forward too: no compute row
            rows = []
        if mesh["ep"] > 1 and graph.moes_in(layer.fqn):  # its all-to-alls wait inside it
            rows = []
        for measured, k in rows:
            if measured > 0:
                layers.append(LayerRow(facts.name, layer.fqn, measured, *(k * x for x in features),
                                       fixed_s=k * m * rows_s))  # fmt: skip
        if sync and bwd > 0:
            k = parts[1][1]
            backward.append(LayerRow(facts.name, layer.fqn, bwd, *(k * x for x in features),
                                     fixed_s=k * m * rows_s))  # fmt: skip
    collectives, tp_comm = _collective_rows(profile, facts.name)
    ddp = mesh["dp"] > 1 and not uses_fsdp2(SimpleNamespace(**mesh))
    return RunRows(
        facts.name, tuple(layers), _optimizer_row(profile, graph, facts, mesh, unit),
        tuple(collectives), tp_comm, ddp=ddp, backward=tuple(backward) if ddp else (),
        backward_other_s=statistics.fmean(mn.backward_other_s for mn in means),
        param_tensors=sum(len(mod.params) for mod in graph.modules.values()),
    )  # fmt: skip


def _optimizer_row(
    profile: MeasuredProfile, graph: Graph, facts: RunFacts, mesh: dict, unit: DeviceSpec
) -> OptimizerRow | None:
    if facts.optimizer != "adamw":
        return None
    measured = max(r.mean.optimizer_s for r in profile.ranks)
    if measured <= 0:
        return None
    numel = graph.trainable_numel / (mesh["fsdp"] * mesh["pp"])
    if mesh["tp"] > 1:  # the styled modules' parameters are 1/tp on each rank
        styled = sum(math.prod(meta.shape) for fqn, info in graph.modules.items()
                     if fqn in facts.tensor_parallel for name, meta in info.params.items()
                     if name not in info.frozen)  # fmt: skip
        numel -= styled * (1 - 1 / mesh["tp"]) / (mesh["fsdp"] * mesh["pp"])
    tensors = max(1, graph.trainable_param_tensors // mesh["pp"])
    if uses_fsdp2(SimpleNamespace(**mesh)):  # FSDP2 holds every one (the run is autopar's)
        dtensors = tensors
    else:  # the styled modules' parameters under TP, the experts' under EP (holds_dtensor)
        experts = {p for m in graph.moes for p in m.expert_params}
        axes = {"fsdp2": False, "tp": mesh["tp"], "ep": mesh["ep"],
                "styles": facts.tensor_parallel}  # fmt: skip
        dtensors = (
            sum(
                1
                for fqn, info in graph.modules.items()
                for name in info.params
                if name not in info.frozen
                and holds_dtensor(fqn, (f"{fqn}.{name}" if fqn else name) in experts, **axes)
            )
            // mesh["pp"]
        )
    traffic = adamw_step_time_s(numel, unit, 0, bytes_per_param=facts.adamw_step_bytes)
    per_tensor = ADAMW_OPS_PER_TENSOR[unit.kind]
    return OptimizerRow(facts.name, measured, traffic, tensors * per_tensor, dtensors * per_tensor)


def _collective_rows(profile: MeasuredProfile, run: str) -> tuple[list[CollectiveRow], float]:
    """Per (kind, group, bytes) the time per call of the rank that took least: a collective's
    record on a rank that arrived early holds its wait for the others (skew, which the step
    shows elsewhere), the last to arrive times the collective itself; and the TP group's time
    per step (the largest over ranks)."""
    merged: dict[tuple, list] = {}
    tp_comm = 0.0
    for rank in profile.ranks:
        tp_comm = max(tp_comm, sum(c.time_s for c in rank.collectives or [] if c.group == "tp"))
        for c in rank.collectives or []:
            kind = _KINDS.get(c.kind)
            if kind is None or not c.group_size or c.group_size < 2 or c.num_calls <= 0:
                continue
            if c.time_s <= 0:
                continue
            key = (kind, c.group, c.group_size, c.message_bytes)
            merged.setdefault(key, []).append((c.time_s / c.num_calls, c.num_calls))
    rows = [
        CollectiveRow(run, kind, group, size, float(nbytes),
                      min(t for t, _ in pts), statistics.fmean(n for _, n in pts))
        for (kind, group, size, nbytes), pts in sorted(merged.items(), key=str)
    ]  # fmt: skip
    return rows, tp_comm


# -- the fit -------------------------------------------------------------------------------------


def _clamp_seconds(x: float) -> float:
    return min(max(0.0, x), 3600.0)


def _nonneg_absolute(columns: list[list[float]], t: list[float]) -> tuple[float, float]:
    """(a, b) >= 0 minimising sum((a x1 + b x2 - t)^2): absolute, not relative, residuals, so
    that the layers that take the time set the fit (a step's time is their sum), not the tiny
    ones (a norm, a position embedding) whose times the load's noise dominates."""
    X, y = np.asarray(columns, dtype=float).T, np.asarray(t, dtype=float)
    best: tuple[float, np.ndarray] | None = None
    for free in ([0, 1], [0], [1]):
        sol, *_ = np.linalg.lstsq(X[:, free], y, rcond=None)
        if np.any(sol < 0):
            continue
        theta = np.zeros(2)
        theta[free] = sol
        if len(free) == 2:
            return float(theta[0]), float(theta[1])
        err = float(np.sum((X @ theta - y) ** 2))
        if best is None or err < best[0]:
            best = (err, theta)
    return (0.0, 0.0) if best is None else (float(best[1][0]), float(best[1][1]))


def _fit_compute(layers: list[LayerRow], base: DeviceSpec) -> tuple[dict, float | None]:
    """compute_scale and op_overhead_s from the layers no TP style touches (and that took some
    time: a layer measured at 0 s informs nothing)."""
    plain = [r for r in layers if r.tp_ops == 0 and r.measured_s > 0]
    if not plain:
        return {}, None
    roof = [r.roofline_s for r in plain]
    ops = [r.ops for r in plain]
    t = [r.fitted_s for r in plain]
    scale, per_op = _nonneg_absolute([roof, ops], t)
    if scale <= 0 or per_op <= 0:  # not both identified: one factor on the base's two terms
        base_t = [base.compute_scale * a + base.op_overhead_s * b for a, b in zip(roof, ops)]
        (k,), _ = nonneg_lstsq([base_t], t)
        k = float(k) if k > 0 else 1.0
        scale, per_op = base.compute_scale * k, base.op_overhead_s * k
    scale = min(max(scale, MIN_SCALE), MAX_SCALE)
    rel = [(scale * a + per_op * b - y) / y for a, b, y in zip(roof, ops, t)]
    rms = math.sqrt(sum(x * x for x in rel) / len(rel))
    return {"compute_scale": scale, "op_overhead_s": _clamp_seconds(per_op)}, rms


def _fit_optimizer(optimizers: list[OptimizerRow]) -> dict:
    """optimizer_op_s: the optimizer steps on plain tensors, their traffic taken out, over
    their ops (AdamW's element-wise ops cost less than a forward op with autograd)."""
    rows = [r for r in optimizers if r.dtensor_ops == 0 and r.measured_s > r.traffic_s]
    if not rows:
        return {}
    spent = sum(r.measured_s - r.traffic_s for r in rows)
    return {"optimizer_op_s": _clamp_seconds(spent / sum(r.ops for r in rows))}


def _fit_tp(layers: list[LayerRow], runs: list[RunRows], dev: DeviceSpec) -> dict:
    """tp_op_overhead_s: the TP'd layers' time, less their TP collectives (measured, and the
    profile's ``tp_collective_overhead_s`` per call, kept) and the compute and per-op terms,
    over their DTensor ops (least squares over the runs)."""
    per_run = []
    for run in runs:
        styled = [r for r in layers if r.run == run.name and r.tp_ops > 0]
        if not styled:
            continue
        dtensor_ops = sum(r.tp_ops for r in styled)
        # the planner charges the overhead on the styles' collectives, not on the loop's
        # totals (a scalar all-reduce over a world that is the tp group)
        calls = sum(c.num_calls for c in run.collectives
                    if c.group == "tp" and c.num_bytes > _SCALAR_BYTES)  # fmt: skip
        rest = sum(r.fitted_s - dev.compute_scale * r.roofline_s - dev.op_overhead_s * r.ops
                   for r in styled) - run.tp_comm_s - calls * dev.tp_collective_overhead_s  # fmt: skip
        per_run.append((dtensor_ops, rest))
    if not per_run:
        return {}
    total_ops = sum(o for o, _ in per_run)
    return {"tp_op_overhead_s": _clamp_seconds(sum(r for _, r in per_run) / total_ops)}


def _fit_dtensor_optimizer(optimizers: list[OptimizerRow], dev: DeviceSpec) -> dict:
    """dtensor_optimizer_op_s: the optimizer steps with DTensor parameters beyond the plain
    per-op cost, over their DTensor ops."""
    rows = [r for r in optimizers if r.dtensor_ops > 0]
    if not rows:
        return {}
    plain = dev.op_overhead_s if dev.optimizer_op_s is None else dev.optimizer_op_s
    extra = sum(r.measured_s - r.traffic_s - r.ops * plain for r in rows)
    return {"dtensor_optimizer_op_s": _clamp_seconds(extra / sum(r.dtensor_ops for r in rows))}


def _fit_ddp(runs: list[RunRows], dev: DeviceSpec, link: Link) -> dict:
    """ddp_comm_scale: what DDP added to backward (the layers' backward beyond the fitted
    compute, plus the end of backward), less DDP's own work per tensor (the profile's
    ``ddp_tensor_overhead_s``), over its all-reduces at the fitted cost (the planner's dp term
    on CPU is ``ddp_comm_scale x`` that cost plus the per-tensor work, nothing overlapped).
    Where what DDP added is less than the per-tensor work alone, the run says the all-reduce
    cost nothing beyond it and the per-tensor figure was high: ``ddp_comm_scale`` goes to its
    floor and ``ddp_tensor_overhead_s`` to what was added, per tensor (one run cannot split
    the two further). The dp group's all-reduces of a few bytes are the gradient norm's, not
    DDP's."""
    added = traffic = 0.0
    tensors = 0
    for run in runs:
        if not run.ddp:
            continue
        tensors += run.param_tensors
        added += run.backward_other_s + sum(
            r.fitted_s - dev.compute_scale * r.roofline_s - dev.op_overhead_s * r.ops
            for r in run.backward
        )
        traffic += sum(
            c.num_calls * collective_time_s(c.kind, c.num_bytes, c.group_size, link)  # type: ignore[arg-type]
            for c in run.collectives
            if c.group == "dp" and c.kind == "all_reduce" and c.num_bytes > _SCALAR_BYTES
        )
    if traffic <= 0 or added <= 0:
        return {}
    own = tensors * dev.ddp_tensor_overhead_s
    if added <= own:
        return {"ddp_comm_scale": MIN_SCALE, "ddp_tensor_overhead_s": added / tensors}
    return {"ddp_comm_scale": min(max((added - own) / traffic, MIN_SCALE), MAX_SCALE)}


def _base_curve(kind: str, n: int, link: Link) -> tuple[float, float]:
    """(alpha_s, seconds per byte) of the base link's cost of ``kind`` over ``n`` ranks."""
    big = 2.0**30
    alpha = collective_time_s(kind, 0.0, n, link)  # type: ignore[arg-type]
    return alpha, (collective_time_s(kind, big, n, link) - alpha) / big  # type: ignore[arg-type]


def _fit_collectives(rows: list[CollectiveRow], link: Link) -> tuple[Link, dict, dict]:
    """Per (kind, group size), the link's measured cost (see the module docstring), from the
    calls that took some time (a profile may record a call at 0 s: it informs nothing)."""
    changes, rms = {}, {}
    costs = {(c.kind, c.group_size): c for c in link.measured}
    # a scalar's all-reduce (the gradient norm's, the loss's) comes after the step's own work
    # on each rank: its record holds the ranks' skew (ms where the link's latency is tenths)
    timed = [r for r in rows if r.time_s > 0 and r.num_bytes > _SCALAR_BYTES]
    for key in sorted({(r.kind, r.group_size) for r in timed}):
        kind, n = key
        pts = [r for r in timed if (r.kind, r.group_size) == key]
        sizes = [r.num_bytes for r in pts]
        alpha0, per_byte0 = _base_curve(kind, n, link)
        f = None
        if min(sizes) > 0 and max(sizes) / min(sizes) >= _SPREAD and len(pts) >= 2:
            f = fit_linear(sizes, [r.time_s for r in pts])
            # both terms or neither: a line with no size term (the bigger message no slower,
            # the load's noise) or no latency would extrapolate to other sizes absurdly
            if f.intercept <= 0 or not math.isfinite(f.rate) or f.rate * per_byte0 > 100:
                f = None
        if f is not None:
            alpha, rate = f.intercept, f.rate
            rms[f"{kind}/{n}"] = f.rel_rms
        else:
            ratio = statistics.median(r.time_s / (alpha0 + per_byte0 * r.num_bytes) for r in pts)
            alpha, rate = alpha0 * ratio, 1.0 / (per_byte0 * ratio)
            rms[f"{kind}/{n}"] = 0.0
        rate = min(max(rate, 1.0), 1e30)
        new = CollectiveCost(kind=kind, group_size=n, alpha_s=_clamp_seconds(alpha),
                             bytes_per_s=rate)  # fmt: skip
        changes[f"link.{kind}[{n}].alpha_s"] = (alpha0, new.alpha_s)
        changes[f"link.{kind}[{n}].bytes_per_s"] = (1 / per_byte0 if per_byte0 else 1e30, rate)
        costs[key] = new
    measured = tuple(costs[k] for k in sorted(costs))
    return link.model_copy(update={"measured": measured}), changes, rms


def fit_runs(
    base: Profile, cluster: Cluster, runs: Sequence[RunRows], sources: Sequence[str] = ()
) -> RefitResult:
    """The refitted profile: ``base``'s device and links (applied to ``cluster``) with every
    coefficient the runs' rows inform fitted (module docstring), the rest kept."""
    dev, link = base.device, base.intra_node
    layers = [r for run in runs for r in run.layers]
    optimizers = [run.optimizer for run in runs if run.optimizer is not None]
    update, rms = {}, {}
    compute, compute_rms = _fit_compute(layers, dev)
    update |= compute
    update |= _fit_optimizer(optimizers)
    if compute_rms is not None:
        rms["compute"] = compute_rms
    fitted = dev.model_copy(update=update)
    update |= _fit_tp(layers, list(runs), fitted)
    update |= _fit_dtensor_optimizer(optimizers, fitted)
    new_link, link_changes, link_rms = _fit_collectives(
        [c for run in runs for c in run.collectives], link
    )
    update |= _fit_ddp(list(runs), dev.model_copy(update=update), new_link)
    device = dev.model_copy(update=update)
    rms |= link_rms
    unset = {"optimizer_op_s": dev.op_overhead_s}  # a None coefficient's stand-in
    changes = {
        f"device.{k}": (
            getattr(dev, k) if getattr(dev, k) is not None else unset.get(k, dev.tp_op_overhead_s),
            v,
        )
        for k, v in update.items()
    }
    changes |= link_changes
    changes = {k: v for k, v in changes.items() if not math.isclose(v[0], v[1], rel_tol=1e-12)}
    DeviceSpec.model_validate(device.model_dump())
    inter = (
        new_link
        if base.inter_node == base.intra_node or cluster.num_nodes == 1
        else base.inter_node
    )
    detail = ", ".join(f"{k} {a:.4g} -> {b:.4g}" for k, (a, b) in sorted(changes.items()))
    profile = base.model_copy(update={
        "source": "refit",
        "name": f"{cluster.spec} refit from {len(runs)} run(s)",
        "device": device.model_copy(update={"source": f"refit of {dev.name}: {detail}"}),
        "intra_node": new_link,
        "inter_node": inter,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "assumptions": [
            *base.assumptions,
            *(f"refit from run profile {s}" for s in sources),
            f"refit changed: {detail or 'nothing'}",
        ],
    })  # fmt: skip
    return RefitResult(profile, changes, rms)


def changed(before: Profile, after: Profile) -> set[str]:
    """The device and link fields (and measured collective costs) that differ."""
    out = set()
    for k in DeviceSpec.model_fields:
        if k != "source" and getattr(before.device, k) != getattr(after.device, k):
            out.add(f"device.{k}")
    old = {(c.kind, c.group_size): c for c in before.intra_node.measured}
    for c in after.intra_node.measured:
        if old.get((c.kind, c.group_size)) != c:
            out.add(f"link.{c.kind}[{c.group_size}]")
    return out
