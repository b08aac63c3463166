"""The profile's fit: the microbenchmarks' samples turned into the device's and links' parameters
by relative least squares (:mod:`cost_model.fit`), as :mod:`cost_model.profile`'s docstring
states per benchmark, and the :class:`Profile` that keeps samples, fits and residuals.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import platform
import statistics

from autopar.cost_model.estimate import (
    ADAMW_OPS_PER_TENSOR,
    TP_OPS_PER_STYLED_CALL,
)
from autopar.cost_model.fit import fit_linear, fit_slope, nonneg_lstsq
from autopar.cost_model.precision import FP32
from autopar.cost_model.profile_bench import (
    MLP_BATCH,
    MLP_WIDTH,
    OPT_TENSOR_SHAPE,
    mlp_input,
    reference_block,
    tiny_mlp,
)
from autopar.cost_model.profile_data import (
    ADAMW_OPS_PER_TENSOR_CPU,
    COLLECTIVES,
    PLANNER_OPS_PER_NODE,
    CollectiveFit,
    Fit,
    Fits,
    OverheadFit,
    Profile,
    Sample,
)
from autopar.cost_model.spec import Cluster, CollectiveCost, DeviceSpec, Link


@dataclasses.dataclass(frozen=True)
class BlockFit:
    """What the reference block's timings fit (:func:`_fit_compute_scale`); None: kept."""

    compute_scale: float
    op_overhead_s: float | None
    op_row_s: float | None
    detail: str


def _ring(kind: str, n: int) -> tuple[float, int]:
    from autopar.cost_model.estimate import _ring as ring

    return ring(kind, n)


def _planner_op_counts(depth: int) -> tuple[int, int, int]:
    """(compute nodes, parameter tensors, styled linear calls) of ``tiny_mlp(depth)`` as the
    planner's graph counts them (traced on meta)."""
    import torch
    from autopar.ir.trace import trace

    with torch.device("meta"):
        model = tiny_mlp(depth, MLP_WIDTH)
        x = mlp_input("meta")  # the benchmarks' own input
    graph = trace(model, (x,), saved_for="cpu")
    nodes = sum(1 for n in graph.nodes if n.kind == "compute")
    tensors = sum(1 for _ in model.parameters())
    return nodes, tensors, 2 * depth


def fit_samples(
    samples: list[Sample], base: DeviceSpec, base_link: Link, world: int = 1
) -> tuple[Fits, DeviceSpec, Link]:
    """Fit the samples; returns (fits, the fitted DeviceSpec, the fitted intra-node Link).
    Figures with no samples keep ``base``'s / ``base_link``'s. ``world``: the processes that
    ran the profile on this host."""
    by = lambda bench, **kw: [  # noqa: E731
        s for s in samples if s.bench == bench and all(getattr(s, k) == v for k, v in kw.items())
    ]
    matmul = {}
    for dtype in ("fp32", "bf16"):
        pts = by("matmul", dtype=dtype)
        if len(pts) >= 2:
            matmul[dtype] = Fit.of(fit_linear([s.flops for s in pts], [s.time_s for s in pts]))
    sdpa = {}
    for dtype in ("fp32", "bf16"):
        pts = by("sdpa", dtype=dtype)
        if len(pts) >= 2:
            sdpa[dtype] = Fit.of(fit_linear([s.flops for s in pts], [s.time_s for s in pts]))
    pts = by("elementwise")
    memory = Fit.of(fit_linear([s.bytes for s in pts], [s.time_s for s in pts])) if pts else None
    bandwidth = (
        memory.rate if memory else base.memory_bandwidth_bytes_per_s * base.memory_efficiency
    )
    overhead = _fit_overhead(samples, bandwidth, ADAMW_OPS_PER_TENSOR[base.kind])

    update: dict = {"matmul_efficiency": 1.0, "memory_efficiency": 1.0}
    peak = dict(base.peak_flops)
    for dtype, f in matmul.items():
        peak[dtype] = f.rate
    update["peak_flops"] = peak
    if memory is not None:
        update["memory_bandwidth_bytes_per_s"] = memory.rate
    if overhead is not None:
        update["op_overhead_s"] = overhead.op_overhead_s
        update["tp_op_overhead_s"] = overhead.tp_op_overhead_s
        update["dtensor_optimizer_op_s"] = overhead.dtensor_optimizer_op_s
        update["optimizer_op_s"] = overhead.optimizer_op_s
    if base.kind == "cpu":
        # CPU vector units: elementwise FLOP/s are memory-bound; keep the fp32 matmul figure
        update["vector_flops"] = {d: peak["fp32"] for d in peak}
    else:  # GPU: keep the matmul efficiency relative to the datasheet peak
        update["peak_flops"] = base.peak_flops
        update["matmul_efficiency"] = min(
            1.0, *(matmul[d].rate / base.peak_flops[d] for d in matmul if d in base.peak_flops)
        ) if matmul else base.matmul_efficiency  # fmt: skip
        if memory is not None:
            update["memory_bandwidth_bytes_per_s"] = base.memory_bandwidth_bytes_per_s
            update["memory_efficiency"] = min(1.0, memory.rate / base.memory_bandwidth_bytes_per_s)
    update["source"] = (
        "fitted by cost_model.profile: "
        + ", ".join(
            f"matmul {d} {f.rate:.3g} FLOP/s (rms {f.rel_rms:.0%})" for d, f in matmul.items()
        )
        + (f", memory {memory.rate:.3g} B/s" if memory else "")
        + (
            f", MLP op {overhead.op_overhead_s * 1e6:.3g} us"
            + (
                f", optimizer op {overhead.optimizer_op_s * 1e6:.3g} us"
                if overhead.optimizer_op_s is not None
                else ""
            )
            + ", DTensor op "
            f"{overhead.tp_op_overhead_s * 1e6:.3g} us"
            if overhead
            else ""
        )
    )
    device = base.model_copy(update=update)
    block = _fit_compute_scale(samples, device)
    if block is not None:
        per_op = {"op_overhead_s": block.op_overhead_s, "op_row_s": block.op_row_s}
        device = device.model_copy(update={
            "compute_scale": block.compute_scale,
            **{k: v for k, v in per_op.items() if v is not None},
            "source": device.source + f", compute x{block.compute_scale:.2f} ({block.detail})",
        })  # fmt: skip
    collectives, link = _fit_collectives(samples, base_link)
    wrap = _fit_wrapper_overheads(samples, link)
    if wrap:
        device = device.model_copy(update={
            **wrap,
            "source": device.source
            + (f", DDP all-reduce x{wrap['ddp_comm_scale']:.2f} in a step"
               if "ddp_comm_scale" in wrap else "")
            + (f", DDP {wrap['ddp_tensor_overhead_s'] * 1e6:.3g} us per tensor"
               if "ddp_tensor_overhead_s" in wrap else "")
            + (f", TP collective +{wrap['tp_collective_overhead_s'] * 1e6:.3g} us"
               if "tp_collective_overhead_s" in wrap else "")
            + (f", FSDP2 {wrap['fsdp_tensor_overhead_s'] * 1e6:.3g} us per tensor"
               if "fsdp_tensor_overhead_s" in wrap else ""),
        })  # fmt: skip
    runtime = _fit_runtime_overheads(samples, device, link, world)
    if runtime:
        device = device.model_copy(update={
            **runtime,
            "source": device.source
            + "".join(f", {k.removesuffix('_s').replace('_', ' ')} {v * 1e6:.3g} us"
                      for k, v in runtime.items()),
        })  # fmt: skip
    DeviceSpec.model_validate(device.model_dump())  # the update passed every check

    fits = Fits(
        matmul=matmul,
        sdpa=sdpa,
        memory=memory,
        overhead=overhead,
        collectives=collectives,
        links={"intra_node": link} if collectives else {},
    )
    return fits, device, link


def _fit_compute_scale(samples: list[Sample], device: DeviceSpec) -> BlockFit | None:
    """``compute_scale`` (and, where the block was timed at two widths and two batches,
    ``op_overhead_s`` and ``op_row_s``) from the reference block's plain forward + backward
    against the planner's terms for its traced graph: ``t = compute_scale * roofline +
    op_overhead_s * ops + op_row_s * rows + c`` (``cost_model.estimate.graph_time_s`` at scale
    1 and no per-op cost; 3 ops per compute node; ``estimate.op_rows`` per op; ``c`` the
    step's own fixed cost, the loss and the backward's start, which no layer pays). Least
    squares on relative residuals, every term >= 0. A narrow block has the same ops and a
    fraction of the roofline, a one-sample block the same ops and a fraction of the rows: the
    tiny MLP's Linear and ReLU (``_fit_overhead``) price a transformer's ops at half of what
    they cost on CPU, and a width-only fit puts the narrow rows' cost per op, which then
    does not shrink with the batch. Where the samples do not vary both ways (an older
    profile), the MLP's per-op cost is kept and the scale alone fitted."""
    pts = [s for s in samples if s.bench == "train_step" and s.op == "block"]
    if not pts:
        return None
    import torch
    from autopar.cost_model.estimate import graph_time_s, op_rows
    from autopar.ir.trace import trace

    plain = device.model_copy(update={"compute_scale": 1.0, "op_overhead_s": 0.0,
                                      "op_row_s": 0.0})  # fmt: skip
    rooflines, ops, rows = [], [], []
    for s in pts:
        depth, dim, heads, batch, seq = s.shape
        with torch.device("meta"):
            model = reference_block(depth, dim, heads)
            x = torch.zeros(batch, seq, dim)
        dt = torch.bfloat16 if s.dtype == "bf16" else None
        graph = trace(model, (x,), dtype=dt, saved_for="cuda" if device.kind == "gpu" else "cpu")
        nodes = [n for n in graph.nodes if n.kind == "compute" and n.out is not None]
        rooflines.append(graph_time_s(graph, plain, s.dtype or "fp32"))
        ops.append(PLANNER_OPS_PER_NODE * len(nodes))
        rows.append(PLANNER_OPS_PER_NODE * sum(op_rows(graph, n) for n in nodes))
    times = [s.time_s for s in pts]
    detail = (
        f"reference block fwd+bwd {[round(t * 1e3, 3) for t in times]} ms vs roofline "
        f"{[round(r * 1e3, 3) for r in rooflines]} ms"
    )
    if len({s.shape[1] for s in pts}) >= 2 and len({s.shape[3] for s in pts}) >= 2:
        (scale, per_op, per_row, fixed), _ = nonneg_lstsq(
            [rooflines, ops, rows, [1.0] * len(pts)], times
        )
        if scale > 0 and per_op > 0:
            return BlockFit(float(scale), float(per_op), float(per_row), detail + (
                f", {per_op * 1e6:.3g} us per op, {per_row * 1e9:.3g} ns per op and row, "
                f"{fixed * 1e3:.3g} ms per step"))  # fmt: skip
    rest = [t - n * device.op_overhead_s for t, n in zip(times, ops, strict=True)]
    if min(rest) <= 0:
        return None
    theta, _ = nonneg_lstsq([rooflines], rest)
    if theta[0] <= 0:
        return None
    return BlockFit(float(theta[0]), None, None, detail)


def _fit_wrapper_overheads(samples: list[Sample], link: Link) -> dict[str, float]:
    """What DDP and FSDP2 cost inside the reference block's data-parallel step beyond its plain
    step: DDP's own work per parameter tensor (its hooks and buckets: the block under DDP with a
    comm hook that reduces nothing, over the plain block: ``ddp_tensor_overhead_s``), DDP's
    all-reduce as a multiple of the one the planner charges (the block under DDP over the same
    with nothing reduced, or over the plain block in a profile without that sample:
    ``ddp_comm_scale``), FSDP2 as time per parameter tensor beyond its collectives (two
    all-gathers and a reduce-scatter per unit: ``fsdp_tensor_overhead_s``); least squares
    through the origin over the depths. (On 2 CPU processes the DDP excess followed the gradient
    bytes, 2-4x the isolated all-reduce, alike at both depths, while FSDP2's followed its
    per-tensor work; examples/gpt.py's DDP step spent 1.7 ms of its 6.2 ms excess in DDP's own
    work, benchmarks/ddp_in_step.py.)"""
    from autopar.cost_model.estimate import collective_time_s

    def timed(op: str) -> dict[tuple, Sample]:
        return {tuple(s.shape): s for s in samples if s.bench == "train_step" and s.op == op}

    plain, nothing_reduced = timed("block"), timed("block_ddp_noop")
    keys = {"ddp_noop": "ddp_tensor_overhead_s", "ddp": "ddp_comm_scale",
            "fsdp": "fsdp_tensor_overhead_s"}  # fmt: skip
    out = {}
    for wrap, key in keys.items():
        base = nothing_reduced if wrap == "ddp" and nothing_reduced else plain
        xs, extra = [], []
        for shape, s in timed(f"block_{wrap}").items():
            if shape not in base:
                continue
            depth, dim, heads = s.shape[:3]
            numel, per_block = _block_params(dim, heads)
            unit = numel * (2 if s.dtype == "bf16" else 4)  # one block's parameter bytes
            n, excess = s.group_size, s.time_s - base[shape].time_s
            if wrap == "ddp":
                xs.append(collective_time_s("all_reduce", depth * unit, n, link))
                extra.append(excess)
            elif wrap == "ddp_noop":
                xs.append(per_block * depth)
                extra.append(excess)
            else:
                comm = depth * (2 * collective_time_s("all_gather", unit, n, link)
                                + collective_time_s("reduce_scatter", unit, n, link))  # fmt: skip
                xs.append(per_block * depth)
                extra.append(excess - comm)
        if xs and min(extra) > 0:
            theta, _ = nonneg_lstsq([xs], extra)
            out[key] = max(1.0, float(theta[0])) if wrap == "ddp" else float(theta[0])
    tp = _fit_tp_collective_overhead(samples, link)
    if tp is not None:
        out["tp_collective_overhead_s"] = tp
    return out


def _fit_tp_collective_overhead(samples: list[Sample], link: Link) -> float | None:
    """``tp_collective_overhead_s``: the tiny MLP's forward + backward tensor-parallel over
    every rank (``mlp_fb_tp_world``) less the same on a one-rank mesh (``mlp_fb_tp``: DTensor's
    dispatch without communication), less its collectives at their fitted time (two
    all-reduces of a block's activations per block: the rowwise output in forward, the
    colwise input's gradient in backward), per collective: the slope over the depths. None
    without both samples at two depths, or where the slope is not positive."""
    from autopar.cost_model.estimate import collective_time_s

    def timed(op: str) -> dict[int, Sample]:
        return {s.shape[0]: s for s in samples if s.bench == "train_step" and s.op == op}

    one_rank, world = timed("mlp_fb_tp"), timed("mlp_fb_tp_world")
    depths = sorted(set(one_rank) & set(world))
    if len(depths) < 2:
        return None
    calls, extra = [], []
    for d in depths:
        s = world[d]
        n = 2 * d
        one = collective_time_s("all_reduce", MLP_BATCH * MLP_WIDTH * 4, s.group_size, link)
        calls.append(n)
        extra.append(s.time_s - one_rank[d].time_s - n * one)
    _, per_call, _ = fit_slope(calls, extra)
    return per_call if per_call > 0 else None


def _fit_runtime_overheads(
    samples: list[Sample], device: DeviceSpec, link: Link, world: int
) -> dict:
    """The fixed costs the planner charges per checkpointed layer and per pipeline action.

    ``checkpoint_layer_s``: the tiny MLP's forward + backward with every block checkpointed,
    less the same without checkpointing and less its forward alone (the recompute), per block:
    the slope over the depths (the loss and the step's fixed work cancel).

    ``pipeline_action_s``: a two-stage 1F1B step of tiny stages less what the stage search
    charges it (``m + p - 1`` times the slowest stage's forward + backward, the tiny MLP's at
    depth 1, and one activation and one gradient over the link per boundary), per runtime
    action (:func:`cost_model.step.pipeline_actions`), least squares through the origin over
    the microbatch counts (on the seconds themselves: a noisy step can come out below what the
    search charges, a residual below 0, which is data, not an error), at least 0; divided by
    the profile's processes per core, which :func:`cost_model.step.pipeline_runtime_s`
    multiplies back for the planned cluster."""
    from autopar.cost_model.step import boundary_p2p_s, host_crowd, pipeline_actions

    def timed(op: str) -> dict[int, float]:
        return {s.shape[0]: s.time_s for s in samples if s.bench == "train_step" and s.op == op}

    out: dict[str, float] = {}
    plain, fwd, ckpt = timed("mlp_fb"), timed("mlp_fwd"), timed("mlp_fb_ckpt")
    depths = sorted(set(plain) & set(fwd) & set(ckpt))
    if len(depths) >= 2:
        extra = [ckpt[d] - plain[d] - fwd[d] for d in depths]
        _, per_layer, _ = fit_slope(depths, extra)
        out["checkpoint_layer_s"] = max(0.0, per_layer)
    steps = [s for s in samples if s.bench == "pipeline" and s.op == "1f1b"]
    if steps and 1 in plain:
        tau, p = plain[1], 2
        actions, rest = [], []
        for s in steps:
            m, width, batch = s.shape
            p2p = boundary_p2p_s(width * batch * 4, link.latency_s, 1 / link.bandwidth_bytes_per_s)
            actions.append(pipeline_actions(m, 1, p, zero_bubble=False))
            rest.append(s.time_s - (m + p - 1) * tau - (p - 1) * p2p)
        per_action = sum(a * r for a, r in zip(actions, rest, strict=True)) / sum(
            a * a for a in actions
        )
        out["pipeline_action_s"] = max(0.0, per_action) / host_crowd(device, world)
    return out


def _block_params(dim: int, heads: int) -> tuple[int, int]:
    """(parameters, parameter tensors) of one reference block, counted on meta."""
    import torch

    with torch.device("meta"):
        params = list(reference_block(1, dim, heads).parameters())
    return sum(p.numel() for p in params), len(params)


def _fit_overhead(
    samples: list[Sample], bandwidth: float, adamw_ops: int = ADAMW_OPS_PER_TENSOR_CPU
) -> OverheadFit | None:
    """Per-op costs from the tiny MLP (``profile_bench.tiny_mlp``) at two depths and the AdamW
    steps. Where the profile timed the forward + backward alone (``mlp_fb``), the slope of it
    over the planner's ops (3 per node) is ``op_overhead_s``, and AdamW's step on plain tensors,
    its traffic taken out, over its ops (10 per tensor) is ``optimizer_op_s``: ops with
    autograd recording cost ~4x AdamW's element-wise ones on this CPU, which one slope over both
    kinds (an older profile's whole step) averaged. The TP'd step's excess over the plain one,
    forward + backward alone where timed, over the styled calls' DTensor ops gives
    ``tp_op_overhead_s``; AdamW on DTensors beyond plain tensors ``dtensor_optimizer_op_s``.
    ``adamw_ops``: AdamW's ops per tensor as the cost model counts them on this kind of device
    (``estimate.ADAMW_OPS_PER_TENSOR``), so that the fitted per-op costs price them back."""
    eager = [s.time_s for s in samples if s.bench == "eager_op"]

    def timed(op: str) -> dict[int, float]:
        return {s.shape[0]: s.time_s for s in samples if s.bench == "train_step" and s.op == op}

    forward_backward = len(timed("mlp_fb")) >= 2
    plain = timed("mlp_fb") if forward_backward else timed("mlp")
    tp = timed("mlp_fb_tp") if forward_backward else timed("mlp_tp")
    if len(plain) < 2:
        return None
    depths = sorted(plain)
    counts = {d: _planner_op_counts(d) for d in depths}
    ops = [
        PLANNER_OPS_PER_NODE * counts[d][0]
        + (0 if forward_backward else ADAMW_OPS_PER_TENSOR_CPU * counts[d][1])
        for d in depths
    ]
    _, per_op, rms = fit_slope(ops, [plain[d] for d in depths])
    per_tp = 0.0
    if len(tp) == len(plain):
        calls = [TP_OPS_PER_STYLED_CALL * counts[d][2] for d in depths]
        _, per_tp, _ = fit_slope(calls, [tp[d] - plain[d] for d in depths])
    adamw = {s.op: s for s in samples if s.bench == "train_step" and s.op.startswith("adamw")}
    opt_op = plain_opt_op = None
    if "adamw" in adamw and forward_backward:
        a = adamw["adamw"]
        ops_opt = adamw_ops * a.shape[0]
        traffic = a.shape[0] * math.prod(OPT_TENSOR_SHAPE) * FP32.adamw_step_bytes / bandwidth
        plain_opt_op = max(0.0, (a.time_s - traffic) / ops_opt)
    if {"adamw", "adamw_dtensor"} <= set(adamw):
        extra = adamw["adamw_dtensor"].time_s - adamw["adamw"].time_s
        opt_op = max(0.0, extra / (adamw_ops * adamw["adamw"].shape[0]))
    timed_what = "forward + backward" if forward_backward else "step"
    return OverheadFit(
        dtensor_optimizer_op_s=opt_op,
        eager_op_s=min(eager) if eager else 0.0,
        op_overhead_s=max(0.0, per_op),
        optimizer_op_s=plain_opt_op,
        tp_op_overhead_s=max(0.0, per_tp),
        rel_rms=rms,
        detail=(
            f"MLP depths {depths}: planner ops {ops}, {timed_what} "
            f"{[round(plain[d], 6) for d in depths]} s"
            + (f", TP'd {[round(tp[d], 6) for d in depths]} s" if tp else "")
        ),
    )


def _fit_collectives(samples: list[Sample], base: Link) -> tuple[list[CollectiveFit], Link]:
    """Per kind and group size, ``t = alpha + bytes / beta``; the link's own latency and
    bandwidth are the point-to-point (send/recv) fit where measured, else the ring model fitted
    over every kind: ``t = latency * steps(kind, n) + factor(kind, n) * bytes / busbw``."""
    coll = [s for s in samples if s.bench == "collective"]
    if not coll:
        return [], base
    rows = [_ring(s.op, s.group_size) for s in coll]
    theta, rel = nonneg_lstsq(
        [[steps for _, steps in rows], [f * s.bytes for s, (f, _) in zip(coll, rows)]],
        [s.time_s for s in coll],
    )
    latency = float(theta[0])
    busbw = 1.0 / float(theta[1]) if theta[1] > 0 else base.bandwidth_bytes_per_s
    ring_rms = math.sqrt(sum(r * r for r in rel) / len(rel))
    fits = []
    for kind in COLLECTIVES:
        for g in sorted({s.group_size for s in coll if s.op == kind}):
            pts = [s for s in coll if s.op == kind and s.group_size == g]
            if len(pts) < 2:
                continue
            f = Fit.of(fit_linear([s.bytes for s in pts], [s.time_s for s in pts]))
            factor, steps = _ring(kind, g)
            ratios = [s.time_s / (latency * steps + factor * s.bytes / busbw) for s in pts]
            fits.append(
                CollectiveFit(
                    kind=kind,
                    group_size=g,
                    link="intra_node",
                    fit=f,
                    ring_ratio=statistics.median(ratios),
                )  # fmt: skip
            )
    p2p = next((c.fit for c in fits if c.kind == "send_recv"), None)
    measured = tuple(
        CollectiveCost(
            kind=c.kind,
            group_size=c.group_size,
            alpha_s=c.fit.intercept_s,
            bytes_per_s=c.fit.rate,
        )  # fmt: skip
        for c in fits
        if c.kind != "send_recv"
    )
    name = base.name.removesuffix("-fitted") + "-fitted"
    link = Link(
        name=name,
        bandwidth_bytes_per_s=p2p.rate if p2p else busbw,
        latency_s=p2p.intercept_s if p2p else latency,
        measured=measured,
        source=(
            f"fitted by cost_model.profile from {len(coll)} collective samples: latency and "
            f"bandwidth {'of send/recv' if p2p else 'of the ring model over every kind'}; "
            f"per-kind costs in 'measured' (the ring model alone: latency {latency * 1e6:.3g} us"
            f"/step, busbw {busbw:.3g} B/s, relative rms {ring_rms:.0%})"
        ),
    )
    return fits, link


def build_profile(raw: dict, cluster: Cluster, *, quick: bool, elapsed_s: float) -> Profile:
    samples = [Sample.model_validate(s) for s in raw["samples"]]
    meta = raw["meta"]
    fits, device, link = fit_samples(
        samples, cluster.device, cluster.intra_node, world=meta["world_size"]
    )
    inter = link if cluster.device.kind == "cpu" else cluster.inter_node
    return Profile(
        source="measured",
        name=f"{cluster.spec} measured on {platform.node()}",
        device=device,
        intra_node=link,
        inter_node=inter,
        backend=meta["backend"],
        world_size=meta["world_size"],
        quick=quick,
        created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        host=platform.node(),
        torch_version=meta["torch_version"],
        elapsed_s=elapsed_s,
        assumptions=[
            f"{meta['threads']} torch thread(s) per process, as torchrun sets OMP_NUM_THREADS",
            "collective times are the trimmed mean over repeats (a barrier before each), "
            "averaged over ranks",
            "a measured profile is exact for this process count only",
        ],
        fits=fits,
        samples=samples,
    )
