"""The search over meshes: every (dp, fsdp, tp) of the world size, each scored with the intra-layer
ILP (:mod:`planner.ilp`) and the cost model, the fastest plan that fits memory chosen.

Per candidate mesh (pp = 1 until pipeline stages land):

  local batch   b = global_batch / (dp * fsdp)                       (must divide exactly)
  compute, tp   from the ILP at degree tp with b (compute and TP collectives, fwd + bwd)
  dp traffic    DDP (dp > 1, fsdp = 1): all-reduce of the local gradients over dp;
                FSDP: all-gather of parameters in forward and again in backward, reduce-scatter
                of gradients, over fsdp; HSDP adds an all-reduce of the sharded gradients over dp
  exposed dp    GPU: the traffic hides behind backward (and forward, for FSDP's gathers) except
                what exceeds it, and never less than one bucket/unit that cannot overlap;
                CPU (gloo): nothing overlaps, the same cores compute and communicate
  optimizer     AdamW step on the local parameters (memory-bound)
  step time     compute + tp comm + exposed dp + optimizer
  memory        params + grads + optimizer states (sharded by fsdp, and by tp for the parameters
                the styles shard) + activations of the local batch (sharded where the layout is)
                + buffers (DDP gradient buckets, FSDP gathered units, allocator reserve)

The candidate with the lowest step time among those that fit the device memory wins; every other
candidate is kept with its prediction and the reason it lost.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from autopar.cost_model import (
    Cluster,
    MemoryBreakdown,
    adamw_step_time_s,
    axis_link,
    collective_time_s,
    memory_per_rank,
)
from autopar.ir import Graph, Layer
from autopar.planner import ilp, stages
from autopar.planner.plan import (
    Alternative,
    Mesh,
    ModelRef,
    Plan,
    Predicted,
    Schedule,
    StagePrediction,
    TimeBreakdown,
    Training,
)

_AXES = ("pp", "dp", "fsdp", "tp")
_HEAD_ATTRS = (
    "n_head",
    "n_heads",
    "num_heads",
    "num_attention_heads",
    "num_key_value_heads",
    "n_kv_heads",
    "n_kv_head",
    "num_kv_heads",
)
# DDP's default bucket: the last one is reduced after backward ends and cannot overlap.
_DDP_BUCKET_BYTES = 25 * 2**20
# GPU memory kept by the CUDA context, NCCL buffers and cuBLAS workspaces (assumption).
_GPU_RESERVE_BYTES = int(1.5 * 2**30)
_NUM_ALTERNATIVES = 8
# per action of the pipeline runtime (see _runtime_overhead_s)
_CPU_PP_ACTION_S = 0.7e-3
_GPU_PP_ACTION_S = 50e-6
# fixed cost of one checkpointed layer beyond its recomputed forward (checkpoint_wrapper's
# saved-tensor hooks and RNG state handling): ~0.6 ms per layer on this CPU (benchmarks/
# calibrate.py on an idle machine: gpt ddp with 8 checkpointed layers +6.8 ms, recompute ~2 ms),
# assumed 20 us on a GPU host
_CKPT_WRAPPER_S = {"cpu": 0.6e-3, "gpu": 20e-6}
# CPU offload (GPU clusters only): host <-> device copies at ~25 GB/s per GPU (PCIe Gen4 x16's
# 32 GB/s per direction, gpus.json, at ~80%), and the host's AdamW at ~20 GB/s of memory traffic
# per GPU's share of the host (assumptions)
_PCIE_BYTES_PER_S = 25e9
_HOST_BYTES_PER_S = 20e9
# host memory a GPU's offloaded state may use: a DGX A100 node's 1 TB over 8 GPUs (assumption)
_HOST_BYTES_PER_GPU = 128e9
# GPipe has 1F1B's step time with more microbatches in flight: searched only when asked for.
_SEARCHED_SCHEDULES = tuple(s for s in stages.SCHEDULES if s != "gpipe")


class PlanningError(ValueError):
    """The constraints admit no plan; the message says which constraint bound and what to relax."""


class NothingFitsError(PlanningError):
    """Legal meshes exist but none fits the device memory."""

    def __init__(self, message: str, overflow_bytes: float) -> None:
        super().__init__(message)
        self.overflow_bytes = overflow_bytes


@dataclass(frozen=True)
class Candidate:
    mesh: Mesh
    step_time_s: float
    memory: MemoryBreakdown
    fits: bool
    why_not: str | None
    """a constraint that rules the mesh out (memory is judged separately through ``fits``)."""
    time: TimeBreakdown | None = None
    solution: ilp.TPSolution | None = None
    stage_plan: stages.StagePlan | None = None
    stage_error: str | None = None
    """why no stage partition fits the memory (the candidate then does not fit)."""
    pruned: bool = False
    """not fully scored: its lower bound (``step_time_s``) already loses to a scored plan."""
    offload: bool = False
    """parameters, gradients and optimizer state offloaded to the host (FSDP2)."""
    stage_details: tuple[StagePrediction, ...] = ()
    """per virtual stage: per-microbatch times, memory, rank (for explanations and the report)."""
    rank_memory: tuple[MemoryBreakdown, ...] = ()
    """memory by kind on each pipeline rank."""

    @property
    def idle_tp(self) -> bool:
        """tp > 1 with no module sharded: the TP group only repeats work. Such a mesh is chosen
        only when nothing else fits, however the costs compare."""
        return self.mesh.tp > 1 and self.solution is not None and not self.solution.styles


def parse_mesh(text: str) -> dict[str, int]:
    """``"tp=2,fsdp=2"`` -> ``{"tp": 2, "fsdp": 2}``; raises PlanningError with one line."""
    pins: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in _AXES or not value.strip().isdigit() or int(value) < 1:
            raise PlanningError(
                f"--mesh {text!r}: {part!r} is not AXIS=N with AXIS one of {', '.join(_AXES)} "
                "and N >= 1: write e.g. --mesh tp=2,fsdp=2"
            )
        if key in pins:
            raise PlanningError(f"--mesh {text!r} sets {key} twice: give each axis once")
        pins[key] = int(value)
    return pins


def enumerate_meshes(
    world: int, devices_per_node: int, pins: dict[str, int], num_layers: int | None = None
) -> list[Mesh]:
    """Every (pp, dp, fsdp, tp) with product ``world`` matching ``pins``: tp within a node, pp at
    most the number of layers (a stage holds at least one)."""
    out = []
    for pp in _divisors(world):
        if num_layers is not None and pp > num_layers:
            continue
        for tp in _divisors(world // pp):
            if tp > devices_per_node and "tp" not in pins:
                continue
            for fsdp in _divisors(world // pp // tp):
                mesh = Mesh(pp=pp, dp=world // pp // tp // fsdp, fsdp=fsdp, tp=tp)
                if all(getattr(mesh, k) == v for k, v in pins.items()):
                    out.append(mesh)
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_pins(pins: dict[str, int], cluster: Cluster, graph: Graph) -> None:
    world = cluster.world_size
    if pins.get("pp", 1) > len(graph.layers):
        raise PlanningError(
            f"--mesh pp={pins['pp']} exceeds the model's {len(graph.layers)} layers (a stage "
            f"holds at least one): choose pp <= {len(graph.layers)}"
        )
    product = math.prod(pins.values())
    text = ",".join(f"{k}={v}" for k, v in pins.items())
    if world % product:
        raise PlanningError(
            f"--mesh {text} multiplies to {product}, which does not divide the world size "
            f"{world} of --cluster {cluster.spec}: choose degrees whose product divides {world}"
        )
    if len(pins) == len(_AXES) and product != world:
        raise PlanningError(
            f"--mesh {text} multiplies to {product}, but --cluster {cluster.spec} has {world} "
            f"devices: pin degrees whose product is {world}, or leave an axis out"
        )
    tp = pins.get("tp")
    if tp and tp > 1:
        for heads in sorted(attention_heads(graph)):
            if heads % tp:
                raise PlanningError(
                    f"--mesh tp={tp} does not divide the model's {heads} attention heads: "
                    f"choose tp among {[d for d in _divisors(heads) if d <= world]}"
                )
        if tp > cluster.devices_per_node:
            raise PlanningError(
                f"--mesh tp={tp} spans nodes ({cluster.devices_per_node} devices per node): "
                "tensor parallelism must stay within a node; lower tp"
            )


def attention_heads(graph: Graph) -> set[int]:
    """Head counts seen by attention ops (dim 1 of q and k of each SDPA call)."""
    heads = set()
    for n in graph.nodes:
        if n.op == "aten.scaled_dot_product_attention.default":
            for ref in n.inputs[:2]:
                heads.add(graph.node(ref).out.shape[1])
    return heads


@dataclass(frozen=True)
class Options:
    """User constraints beyond the mesh pins (the CLI's --schedule, --microbatches, --checkpoint)."""

    schedule: str | None = None
    """pipeline schedule to use when pp > 1; None searches all."""
    microbatches: int | None = None
    checkpoint: Literal["auto", "none", "full"] = "auto"


def search(
    graph: Graph,
    cluster: Cluster,
    training: Training,
    *,
    model: ModelRef,
    pins: dict[str, int] | None = None,
    options: Options | None = None,
    progress: Callable[[str], None] | None = None,
    stats: dict[str, int] | None = None,
) -> Plan:
    """The fastest plan that fits, with the others kept as alternatives. ``progress`` (if
    given) is called with a short status line before each mesh is scored; ``stats`` (if given)
    receives counts: meshes, pruned (by the lower bound), ruled_out, ilp_solves (CP-SAT solves:
    tp = 1 needs none, and rates between two equal optima reuse them)."""
    start = time.perf_counter()
    pins = dict(pins or {})
    options = options or Options()
    check_pins(pins, cluster, graph)
    _check_options(options, pins)
    space = _Space(
        graph=graph,
        cluster=cluster,
        training=training,
        options=options,
        heads=attention_heads(graph),
        cache={},
        memo={},
        out_bytes=_layer_out_bytes(graph),
        tensors={x.fqn: len(_layer_tensors(graph, x)) for x in graph.layers},
        tied=_tied_layers(graph),
        param_tensors=sum(len(m.params) for m in graph.modules.values()),
    )
    meshes = enumerate_meshes(cluster.world_size, cluster.devices_per_node, pins, len(graph.layers))
    candidates = _scored(meshes, lambda mesh, bound: _evaluate(space, mesh, bound), progress)
    legal = [c for c in candidates if c.why_not is None]
    if stats is not None:
        stats.update(
            meshes=len(meshes),
            pruned=sum(c.pruned for c in candidates),
            ruled_out=len(candidates) - len(legal),
            ilp_solves=sum(len(v) for (tp, _), v in space.memo.items() if tp > 1),
        )
    fitting = sorted((c for c in legal if c.fits), key=lambda c: (c.idle_tp, c.step_time_s))
    if not fitting:
        if not legal:
            raise PlanningError(_nothing_fits(candidates, legal, cluster, training))
        least = min(legal, key=lambda c: c.memory.total)
        overflow = least.memory.total - cluster.device.memory_bytes
        raise NothingFitsError(_nothing_fits(candidates, legal, cluster, training), overflow)
    best = fitting[0]
    return _plan(graph, cluster, training, model, best, candidates, time.perf_counter() - start)


def _scored(meshes: list[Mesh], evaluate, progress=None) -> list[Candidate]:
    """Branch and bound: a cheap pass ranks the meshes by their lower bound (and rules out the
    illegal ones), then meshes are scored in that order, each pruned once its bound loses to
    the best fitting plan so far. Meshes with idle TP groups never set the bound."""
    first = [evaluate(mesh, -math.inf) for mesh in meshes]
    done = [c for c in first if not c.pruned]
    best = math.inf
    todo = sorted((c for c in first if c.pruned), key=lambda c: c.step_time_s)
    for i, c in enumerate(todo):
        if progress is not None:
            progress(f"scoring mesh {i + 1}/{len(todo)}: {c.mesh.short()}")
        full = evaluate(c.mesh, best)
        done.append(full)
        if full.fits and full.why_not is None and not full.idle_tp:
            best = min(best, full.step_time_s)
    return done


def _check_options(options: Options, pins: dict[str, int]) -> None:
    if options.schedule is not None and options.schedule not in stages.SCHEDULES:
        raise PlanningError(
            f"--schedule {options.schedule!r} is not one of {', '.join(stages.SCHEDULES)}"
        )
    if options.microbatches is not None and options.microbatches < 1:
        raise PlanningError(f"--microbatches {options.microbatches} must be >= 1")
    if options.checkpoint not in ("auto", "none", "full"):
        raise PlanningError(f"--checkpoint {options.checkpoint!r} is not one of auto, none, full")


def _nothing_fits(
    candidates: list[Candidate], legal: list[Candidate], cluster: Cluster, training: Training
) -> str:
    if not legal:
        reasons = list(dict.fromkeys(f"{c.why_not} ({c.mesh.short()})" for c in candidates))
        return f"no mesh is possible on {cluster.spec}: " + "; ".join(reasons[:3])
    least = min(legal, key=lambda c: c.memory.total)
    cap = cluster.device.memory_bytes
    return (
        f"no plan fits in {cap / 1e9:.1f} GB per device on {cluster.spec}: the leanest "
        f"({least.mesh.short()}) needs {least.memory.total / 1e9:.1f} GB, "
        f"{(least.memory.total - cap) / 1e9:.1f} GB too many"
    )


def static_floor_bytes(graph: Graph, training: Training, world: int) -> float:
    """Parameters, gradients and optimizer state per device if every one were sharded over
    every device: no plan on ``world`` devices needs less."""
    return graph.param_bytes * _state_bytes_per_param_byte(training) / world


@dataclass(frozen=True)
class _Ctx:
    """What every layer cost of one mesh shares."""

    space: _Space
    mesh: Mesh
    axes: list[tuple[str, int]]
    sync_rate: float
    offload: bool = False
    """FSDP2 CPU offload: parameters, gradients and optimizer state in host memory."""

    @property
    def graph(self) -> Graph:
        return self.space.graph

    @property
    def cluster(self) -> Cluster:
        return self.space.cluster

    @property
    def training(self) -> Training:
        return self.space.training

    def solution(self, batch: int) -> ilp.TPSolution:
        key = (self.mesh.tp, batch, round(self.sync_rate * 1e15))
        cache = self.space.cache
        if key not in cache:
            inputs = ilp.CostInputs(
                tp=self.mesh.tp,
                batch_scale=batch / self.graph.batch_size,
                device=self.cluster.device,
                dtype=self.training.dtype,
                tp_link=axis_link(self.cluster, self.axes, "tp"),
                grad_sync_s_per_byte=self.sync_rate,
            )
            cache[key] = ilp.solve(self.graph, inputs, memo=self.space.memo)
        return cache[key]


@dataclass(frozen=True)
class _Space:
    """What every mesh of one search shares."""

    graph: Graph
    cluster: Cluster
    training: Training
    options: Options
    heads: set[int]
    cache: dict[tuple, ilp.TPSolution]
    """ILP solutions by (tp, batch, data-parallel traffic rate)."""
    memo: dict
    """ILP assignments along the sync rate (``ilp.solve``'s memo)."""
    out_bytes: dict[str, int]
    """layer -> bytes later layers read from it (traced batch)."""
    tensors: dict[str, int]
    """layer -> number of parameter tensors."""
    tied: tuple[str, str] | tuple[()]
    """two layers that read one parameter, or ()."""
    param_tensors: int
    """parameter tensors of the whole model (every module's direct parameters)."""


def _evaluate(space: _Space, mesh: Mesh, bound: float = math.inf) -> Candidate:
    """Score one mesh; stop early (``pruned``) when it cannot beat ``bound`` seconds. CPU offload
    of parameters, gradients and optimizer state (FSDP2, GPU clusters) is the last resort: tried
    only when the mesh does not fit otherwise."""
    plain = _evaluate_once(space, mesh, bound)
    if plain.fits or plain.pruned or plain.why_not or space.cluster.device.kind != "gpu":
        return plain
    if mesh.fsdp == 1:
        return plain
    offloaded = _evaluate_once(space, mesh, bound, offload=True)
    return offloaded if offloaded.fits or offloaded.pruned else plain


def _evaluate_once(
    space: _Space, mesh: Mesh, bound: float = math.inf, offload: bool = False
) -> Candidate:
    """Score one mesh; stop early (``pruned``) when it cannot beat ``bound`` seconds."""
    graph, cluster, training, options = space.graph, space.cluster, space.training, space.options
    dp_size = mesh.data_parallel
    empty = MemoryBreakdown(params=0, grads=0, optimizer=0, activations=0, buffers=0)
    if training.global_batch % dp_size:
        why = (
            f"global batch {training.global_batch} is not divisible by the data-parallel size "
            f"{dp_size}"
        )
        return Candidate(mesh, math.inf, empty, False, why)
    if mesh.pp > 1 and space.tied:
        a, b = space.tied
        why = (
            f"layers {a} and {b} read the same (tied) parameter: pipeline stages cannot split "
            "them, and the emitted script refuses such a cut"
        )
        return Candidate(mesh, math.inf, empty, False, why)
    bad_heads = [h for h in space.heads if h % mesh.tp]
    if mesh.tp > 1 and bad_heads:
        why = f"tp={mesh.tp} does not divide the {bad_heads[0]} attention heads"
        return Candidate(mesh, math.inf, empty, False, why)
    # lower bound: every parameter sharded by every axis that can shard it
    static_floor = graph.param_bytes * _state_bytes_per_param_byte(training)
    static_floor /= mesh.pp * mesh.fsdp * mesh.tp
    if offload and static_floor > _HOST_BYTES_PER_GPU:
        why = (
            f"offloading needs {static_floor / 1e9:.0f} GB of host memory per GPU, more than "
            f"the {_HOST_BYTES_PER_GPU / 1e9:.0f} GB assumed"
        )
        return Candidate(mesh, math.inf, empty, False, None, stage_error=why)
    if static_floor > cluster.device.memory_bytes and not offload:
        why = (
            f"parameters, gradients and optimizer state alone need at least "
            f"{static_floor / 1e9:.1f} GB per device, more than its "
            f"{cluster.device.memory_bytes / 1e9:.1f} GB"
        )
        memory = MemoryBreakdown(params=0, grads=0, optimizer=math.ceil(static_floor),
                                 activations=0, buffers=0)  # fmt: skip
        return Candidate(mesh, math.inf, memory, False, None, stage_error=why)
    axes = [(a, getattr(mesh, a)) for a in _AXES]
    sync_rate = _sync_s_per_byte(cluster, mesh, axes)
    ctx = _Ctx(space, mesh, axes, sync_rate, offload=offload)
    per_replica = training.global_batch // dp_size
    whole = ctx.solution(per_replica)
    local = _tp_local_bytes(graph, whole, mesh.tp)
    traffic = _dp_traffic_s(graph, cluster, mesh, axes, local, space.param_tensors)
    bwd_share = graph.bwd_flops / max(1, graph.fwd_flops + graph.bwd_flops)
    exposed_dp = _exposed(
        cluster.device.kind, traffic, whole.compute_s, bwd_share, mesh, cluster, axes
    )
    buffers = _buffers(graph, cluster, mesh, local)
    limit = cluster.device.memory_bytes - buffers

    @functools.cache  # the stage search and the plan's stage details ask for the same sizes
    def costs_for(micro: int) -> list[stages.LayerCost]:
        return _layer_costs(ctx, ctx.solution(micro), micro, exposed_dp)

    # every layer's fwd + bwd for the whole per-replica batch, spread evenly over the pipeline
    # ranks, is a lower bound of the step (microbatching, bubbles, recompute only add)
    floor_s = (whole.compute_s + whole.comm_s) / mesh.pp
    if floor_s >= bound:
        memory = _memory(ctx, whole, None, buffers)
        return Candidate(mesh, floor_s, memory, False, None, pruned=True)
    if limit <= 0:
        memory = _memory(ctx, whole, None, buffers)
        why = (
            f"buffers alone ({buffers / 1e9:.1f} GB: gradient buckets, gathered FSDP units, "
            f"reserve) exceed the device's {cluster.device.memory_bytes / 1e9:.1f} GB"
        )
        return Candidate(mesh, math.inf, memory, False, None, stage_error=why)
    try:
        plan, runtime_s = _stage_plan(ctx, costs_for, per_replica, limit, options)
    except (stages.StageError, stages.ScheduleError) as e:
        memory = _memory(ctx, whole, None, buffers)
        why = None if isinstance(e, stages.StageError) else str(e)
        return Candidate(mesh, math.inf, memory, False, why, stage_error=str(e))
    micro = per_replica // plan.num_microbatches
    sol = ctx.solution(micro)
    details = _stage_details(plan, costs_for(micro), mesh.pp)
    time_parts = _time_parts(ctx, sol, plan, runtime_s, details)
    memory = _memory(ctx, sol, plan, buffers)
    fits = memory.total <= cluster.device.memory_bytes
    rank_memory = tuple(_memory(ctx, sol, plan, buffers, r) for r in range(mesh.pp))
    return Candidate(
        mesh, time_parts.total, memory, fits, None, time_parts, sol, plan,
        stage_details=details, rank_memory=rank_memory, offload=offload,
    )  # fmt: skip


def _stage_details(
    plan: stages.StagePlan, costs: list[stages.LayerCost], pp: int
) -> tuple[StagePrediction, ...]:
    """Per virtual stage: the per-microbatch times the step time was built from."""
    out = []
    for j, (a, b) in enumerate(plan.boundaries):
        layers = costs[a:b]
        out.append(
            StagePrediction(
                rank=stages.stage_rank(plan.schedule, pp, j),
                fwd_s=sum(c.fwd_s for c in layers),
                bwd_s=sum(c.bwd_s for c in layers),
                bwd_weight_s=sum(c.bwd_weight_s for c in layers),
                recompute_s=sum(costs[i].fwd_s for i in plan.checkpointed if a <= i < b),
                memory_bytes=math.ceil(plan.stage_memory_bytes[j]),
                in_flight=plan.stage_in_flight[j],
            )
        )
    return tuple(out)


def _stage_plan(ctx: _Ctx, costs_for, per_replica: int, limit: float, options: Options):
    """pp = 1: one stage, one microbatch (only checkpointing to choose); else the best schedule
    and microbatch count (:func:`planner.stages.best_schedule`)."""
    pp = ctx.mesh.pp
    if pp == 1:
        if options.microbatches not in (None, 1):
            raise stages.ScheduleError(
                f"--microbatches {options.microbatches} needs pipeline parallelism (pp > 1)"
            )
        plan = stages.partition(
            costs_for(per_replica),
            num_stages=1,
            num_microbatches=1,
            mem_limit_bytes=limit,
            schedule="gpipe",
            checkpoint=options.checkpoint,
        )
        return plan, 0.0
    link = axis_link(ctx.cluster, ctx.axes, "pp")
    choices = (
        [options.microbatches] if options.microbatches else _microbatch_choices(per_replica, pp)
    )
    if options.microbatches and per_replica % options.microbatches:
        raise stages.ScheduleError(
            f"--microbatches {options.microbatches} does not divide the per-replica batch "
            f"{per_replica}"
        )
    _, tried = stages.best_schedule(
        costs_for,
        num_stages=pp,
        global_batch_per_dp=per_replica,
        mem_limit_bytes=limit,
        schedules=_schedules(options, ctx.mesh),
        microbatch_choices=choices,
        checkpoint=options.checkpoint,
        p2p_s_per_byte=1 / link.bandwidth_bytes_per_s,
        p2p_latency_s=link.latency_s,
    )
    scored = [
        (c.step_time_s + _runtime_overhead_s(ctx, c.plan), c.plan)
        for c in tried
        if c.plan is not None
    ]
    total, best = min(scored, key=lambda x: x[0])
    return best, total - best.step_time_s


def _runtime_overhead_s(ctx: _Ctx, plan: stages.StagePlan) -> float:
    """Host time of the pipeline runtime on the busiest rank's critical path: each forward,
    backward (and, for zero-bubble schedules, weight-gradient) action of
    torch.distributed.pipelining costs a fixed overhead (Python scheduling, p2p set-up, shape
    checks). Actions on the critical path: 2 (m v + p - 1), or 3 m v + 2 (p - 1) when W runs
    apart. Per action: ~0.7 ms on this machine's CPU with 2 gloo ranks (benchmarks/calibrate.py,
    idle machine: mlp pp=2 1f1b with 4 microbatches, 10 actions, measured 7.2 ms a step), scaled
    by cores oversubscribed; ~50 us assumed on a GPU host, where it overlaps kernels."""
    m, v, p = plan.num_microbatches, plan.stages_per_rank, ctx.mesh.pp
    zero_bubble = plan.schedule in ("zbv", "dualpipev")
    actions = 3 * m * v + 2 * (p - 1) if zero_bubble else 2 * (m * v + p - 1)
    if ctx.cluster.device.kind == "cpu":
        crowd = max(1.0, ctx.cluster.devices_per_node / max(1, os.cpu_count() or 1))
        return actions * _CPU_PP_ACTION_S * crowd
    return actions * _GPU_PP_ACTION_S


def _schedules(options: Options, mesh: Mesh) -> tuple[str, ...]:
    """The schedules to search. V-shaped ones (zbv, dualpipev) composed with data parallelism
    trained wrong weights on torch 2.13 (head.weight off by ~5e-5 after one SGD step with
    fsdp=2, while gpipe/1f1b/interleaved matched), so they run only without it."""
    v_shaped = ("zbv", "dualpipev")
    if options.schedule is not None:
        if options.schedule in v_shaped and mesh.data_parallel > 1:
            raise stages.ScheduleError(
                f"--schedule {options.schedule} with data parallelism (dp x fsdp = "
                f"{mesh.data_parallel}) is not supported: emitted programs did not match the "
                "single-process model; pin dp=1,fsdp=1 or choose 1f1b/interleaved-1f1b"
            )
        return (options.schedule,)
    if mesh.data_parallel > 1:
        return tuple(s for s in _SEARCHED_SCHEDULES if s not in v_shaped)
    return _SEARCHED_SCHEDULES


def _microbatch_choices(per_replica: int, pp: int) -> list[int]:
    """Divisors of the per-replica batch from pp to 8 pp (fewer microbatches than stages leave
    ranks idle; past ~8 pp the bubble gain no longer pays for smaller, less efficient ops)."""
    out = [d for d in range(pp, min(per_replica, 8 * pp) + 1) if per_replica % d == 0]
    return out or [d for d in range(1, per_replica + 1) if per_replica % d == 0][-1:]


def _tp_local_bytes(graph: Graph, sol: ilp.TPSolution, tp: int) -> float:
    sharded = sol.sharded_param_bytes
    return sharded / tp + (graph.param_bytes - sharded)


def _state_bytes_per_param_byte(training: Training) -> float:
    """params + grads (param dtype) + optimizer state, per byte of parameters."""
    per_param = 2 if training.dtype == "bf16" else 4
    optimizer = (8 + (4 if training.dtype == "bf16" else 0)) if training.optimizer == "adamw" else 0
    return 2 + optimizer / per_param


def _layer_costs(
    ctx: _Ctx, sol: ilp.TPSolution, micro: int, exposed_dp: float
) -> list[stages.LayerCost]:
    """One LayerCost per layer for one microbatch of ``micro`` samples on one rank."""
    graph, mesh = ctx.graph, ctx.mesh
    scale = micro / graph.batch_size
    per_byte = _state_bytes_per_param_byte(ctx.training)
    total_local = max(1.0, _tp_local_bytes(graph, sol, mesh.tp))
    costs = []
    for layer in graph.layers:
        part = sol.layer_parts[layer.fqn]
        busy = part.compute_s + part.comm_s
        flops = layer.fwd_flops + layer.bwd_flops
        fwd = busy * (layer.fwd_flops / flops if flops else 1 / 3)
        sharded = sol.layer_sharded_param_bytes[layer.fqn]
        local = sharded / mesh.tp + (layer.param_bytes - sharded)
        share = local / total_local
        numel = local * layer.param_numel / max(1, layer.param_bytes) / mesh.fsdp
        costs.append(
            stages.LayerCost(
                fwd_s=fwd,
                bwd_s=busy - fwd,
                # assumption: the weight-gradient half of a matmul layer's backward
                bwd_weight_s=(busy - fwd) / 2,
                act_bytes=sol.activation_bytes[layer.fqn],
                recompute_s=fwd + _CKPT_WRAPPER_S[ctx.cluster.device.kind],
                act_ckpt_bytes=layer.saved_bytes_checkpointed * scale,
                static_bytes=0.0 if ctx.offload else local / mesh.fsdp * per_byte,
                out_bytes=ctx.space.out_bytes[layer.fqn] * scale,
                grad_sync_s=exposed_dp * share,
                optimizer_s=(
                    _offloaded_optimizer_s(ctx, numel, local / mesh.fsdp)
                    if ctx.offload
                    else _optimizer_s(ctx, numel, ctx.space.tensors[layer.fqn])
                ),
            )
        )
    return costs


def _offloaded_optimizer_s(ctx: _Ctx, numel: float, param_bytes: float) -> float:
    """With CPU offload, per step: the sharded parameters go host -> device for the forward and
    backward all-gathers and the gradients come back (2 x bytes over PCIe), and AdamW runs on
    the host (28 bytes per parameter at the host's memory bandwidth; assumptions below)."""
    return 2 * param_bytes / _PCIE_BYTES_PER_S + numel * 28 / _HOST_BYTES_PER_S


def _optimizer_s(ctx: _Ctx, numel: float, num_tensors: int) -> float:
    device = ctx.cluster.device
    if ctx.training.optimizer == "adamw":
        # FSDP2 parameters are DTensors: every optimizer op pays DTensor dispatch
        return adamw_step_time_s(numel, device, max(1, num_tensors), dtensor=ctx.mesh.fsdp > 1)
    # SGD without momentum: read param and grad, write param (fp32)
    return numel * 12 / (device.memory_bandwidth_bytes_per_s * device.memory_efficiency)


def _layer_tensors(graph: Graph, layer: Layer) -> list[str]:
    if not layer.is_module:
        return []
    prefix = layer.fqn + "." if layer.fqn else ""
    return [
        f"{fqn}.{name}"
        for fqn, info in graph.modules.items()
        if fqn == layer.fqn or fqn.startswith(prefix)
        for name in info.params
    ]


def _tied_layers(graph: Graph) -> tuple[str, str] | tuple[()]:
    """Two layers that read one parameter (tied weights), or () when none do."""
    readers: dict[str, set[str]] = {}
    for n in graph.nodes:
        if n.kind == "compute":
            for p in n.params:
                readers.setdefault(p, set()).add(n.layer)
    for layers in readers.values():
        if len(layers) > 1:
            first, second = sorted(layers, key=[x.fqn for x in graph.layers].index)[:2]
            return (first, second)
    return ()


def _layer_out_bytes(graph: Graph) -> dict[str, int]:
    """Bytes per layer (at the traced batch) that later layers read: the p2p payload when a
    stage boundary follows the layer."""
    order = {layer.fqn: i for i, layer in enumerate(graph.layers)}
    out = dict.fromkeys(order, 0)
    for n in graph.nodes:
        if n.kind != "compute" or n.out is None:
            continue
        later = {
            graph.node(u).layer for u in graph.users[n.name] if graph.node(u).kind == "compute"
        }
        if any(order[x] > order[n.layer] for x in later):
            out[n.layer] += n.out.num_bytes
    return out


def _time_parts(
    ctx: _Ctx,
    sol: ilp.TPSolution,
    plan: stages.StagePlan,
    runtime_s: float,
    details: tuple[StagePrediction, ...] = (),
) -> TimeBreakdown:
    """Split the stage plan's step time (plus the pipeline runtime's overhead, counted with the
    pipeline's communication) into parts that sum to it. Recompute (part of compute) is the share
    the slowest stage spends re-running checkpointed forwards."""
    graph = ctx.graph
    per_step = plan.per_step_s
    optimizer = _optimizer_s(
        ctx,
        _tp_local_bytes(graph, sol, ctx.mesh.tp)
        * graph.num_params
        / max(1, graph.param_bytes)
        / ctx.mesh.fsdp
        / ctx.mesh.pp,
        sum(len(m.params) for m in graph.modules.values()) // ctx.mesh.pp,
    )
    optimizer = min(optimizer, per_step)
    dp = per_step - optimizer
    busy = max(0.0, plan.step_time_s - plan.bubble_s - plan.p2p_s - per_step)
    comm_share = sol.comm_s / max(1e-30, sol.compute_s + sol.comm_s)
    tp = busy * comm_share
    slowest = max(details, key=lambda d: d.fwd_s + d.bwd_s + d.recompute_s, default=None)
    recompute = 0.0
    if slowest is not None and slowest.recompute_s > 0:
        share = slowest.recompute_s / (slowest.fwd_s + slowest.bwd_s + slowest.recompute_s)
        recompute = (busy - tp) * share
    return TimeBreakdown(
        compute=busy - tp,
        recompute=recompute,
        exposed_comm=tp + dp + plan.p2p_s + runtime_s,
        bubble=plan.bubble_s,
        optimizer=optimizer,
        tp_comm=tp,
        dp_comm=dp,
        pp_comm=plan.p2p_s + runtime_s,
    )


def _memory(
    ctx: _Ctx,
    sol: ilp.TPSolution,
    plan: stages.StagePlan | None,
    buffers: float,
    rank: int | None = None,
) -> MemoryBreakdown:
    """Memory of pipeline rank ``rank`` (default: the fullest; all layers on one rank without a
    stage plan)."""
    graph, mesh = ctx.graph, ctx.mesh
    if plan is None:
        held = list(range(len(graph.layers)))
        activations = sum(sol.activation_bytes.values())
    else:
        if rank is None:
            rank = max(range(len(plan.rank_memory_bytes)), key=lambda r: plan.rank_memory_bytes[r])
        held = [
            i
            for j, (a, b) in enumerate(plan.boundaries)
            if stages.stage_rank(plan.schedule, mesh.pp, j) == rank
            for i in range(a, b)
        ]
        activations = 0.0
    local = sum(
        sol.layer_sharded_param_bytes[graph.layers[i].fqn] / mesh.tp
        + graph.layers[i].param_bytes
        - sol.layer_sharded_param_bytes[graph.layers[i].fqn]
        for i in held
    )
    numel = local * graph.num_params / max(1, graph.param_bytes)
    memory = memory_per_rank(
        param_numel=numel / mesh.fsdp,
        param_dtype=ctx.training.dtype,
        shard_factor=1,
        activation_bytes=activations,
        buffer_bytes=buffers,
        optimizer=ctx.training.optimizer,
    )
    if ctx.offload:  # parameters, gradients and optimizer state live on the host
        memory = memory.model_copy(update={"params": 0, "grads": 0, "optimizer": 0})
    if plan is not None:
        static = memory.params + memory.grads + memory.optimizer
        act = max(0.0, plan.rank_memory_bytes[rank] - static)
        memory = memory.model_copy(update={"activations": math.ceil(act)})
    return memory


def _sync_s_per_byte(cluster: Cluster, mesh: Mesh, axes: list[tuple[str, int]]) -> float:
    """Time per byte of local (TP-sharded) parameters spent on data-parallel traffic."""
    big = 2**30

    def rate(kind: str, axis: str, group: int, fraction: float = 1.0) -> float:
        if group == 1:
            return 0.0
        link = axis_link(cluster, axes, axis)
        return (
            collective_time_s(kind, big * fraction, group, link)
            - collective_time_s(kind, 0, group, link)
        ) / big

    if mesh.fsdp == 1:
        return rate("all_reduce", "dp", mesh.dp)
    per_fsdp = 2 * rate("all_gather", "fsdp", mesh.fsdp) + rate("reduce_scatter", "fsdp", mesh.fsdp)
    return per_fsdp + rate("all_reduce", "dp", mesh.dp, 1 / mesh.fsdp)


def _dp_traffic_s(
    graph: Graph,
    cluster: Cluster,
    mesh: Mesh,
    axes: list[tuple[str, int]],
    local_bytes: float,
    tensors: int,
) -> float:
    """Data-parallel traffic per step, one collective per DDP bucket or per FSDP unit (each
    collective pays the link latency, which dominates for small models on gloo), and FSDP2's own
    work per parameter tensor (``tensors`` of them; profiled, 0 for datasheet devices)."""
    if mesh.data_parallel == 1:
        return 0.0
    dp_link = axis_link(cluster, axes, "dp")
    if mesh.fsdp == 1:
        buckets = max(1, math.ceil(local_bytes / _DDP_BUCKET_BYTES))
        one = collective_time_s("all_reduce", local_bytes / buckets, mesh.dp, dp_link)
        return cluster.device.ddp_comm_scale * buckets * one
    # FSDP2 units: every module layer, plus the root for what they leave out
    units = sum(1 for layer in graph.layers if layer.is_module) + 1
    unit_bytes = local_bytes / units
    fsdp_link = axis_link(cluster, axes, "fsdp")
    per_unit = 2 * collective_time_s("all_gather", unit_bytes, mesh.fsdp, fsdp_link)
    per_unit += collective_time_s("reduce_scatter", unit_bytes, mesh.fsdp, fsdp_link)
    per_unit += collective_time_s("all_reduce", unit_bytes / mesh.fsdp, mesh.dp, dp_link)
    return units * per_unit + tensors * cluster.device.fsdp_tensor_overhead_s


def _exposed(
    kind: str,
    traffic: float,
    compute: float,
    bwd_share: float,
    mesh: Mesh,
    cluster: Cluster,
    axes: list[tuple[str, int]],
) -> float:
    """Data-parallel traffic left on the critical path (see the module docstring)."""
    if traffic == 0.0 or kind == "cpu":
        return traffic
    window = compute if mesh.fsdp > 1 else compute * bwd_share
    axis = "fsdp" if mesh.fsdp > 1 else "dp"
    group = mesh.fsdp if mesh.fsdp > 1 else mesh.dp
    tail = collective_time_s("all_reduce", _DDP_BUCKET_BYTES, group, axis_link(cluster, axes, axis))
    return max(traffic - window, min(traffic, tail))


def _buffers(graph: Graph, cluster: Cluster, mesh: Mesh, tp_local_bytes: float) -> float:
    reserve = _GPU_RESERVE_BYTES if cluster.device.kind == "gpu" else 0
    if mesh.fsdp > 1:
        # the current unit and the prefetched next one are held unsharded
        biggest = max(layer.param_bytes for layer in graph.layers) / mesh.tp
        return reserve + 2 * biggest
    if mesh.dp > 1:
        # DDP's gradient buckets: a second copy of the grads of the rank's own stage (an even
        # share of the model: the stages are not cut yet)
        return reserve + tp_local_bytes / mesh.pp
    return reserve


def _plan(
    graph: Graph,
    cluster: Cluster,
    training: Training,
    model: ModelRef,
    best: Candidate,
    candidates: list[Candidate],
    elapsed_s: float,
) -> Plan:
    sol = best.solution
    assert sol is not None and best.time is not None
    step = best.step_time_s
    samples = training.global_batch / step
    model_flops = (graph.fwd_flops + graph.bwd_flops) * training.global_batch / graph.batch_size
    peak = cluster.device.peak_flops[training.dtype] * cluster.world_size
    predicted = Predicted(
        step_time_s=step,
        peak_memory_bytes=best.memory.total,
        memory_breakdown_bytes=best.memory,
        tokens_per_s=samples * training.seq_len if training.seq_len else None,
        samples_per_s=samples,
        mfu=model_flops / (step * peak),
        time_breakdown_s=best.time,
        stages=list(best.stage_details),
        rank_memory_bytes=list(best.rank_memory),
    )
    layers = [layer.fqn for layer in graph.layers]
    sp = best.stage_plan
    assert sp is not None
    pipelined = best.mesh.pp > 1
    return Plan(
        model=model,
        cluster=cluster,
        training=training,
        mesh=best.mesh,
        layers=layers,
        stages=[layers[a:b] for a, b in sp.boundaries],
        schedule=Schedule(
            name=sp.schedule if pipelined else "none",
            num_microbatches=sp.num_microbatches,
            stages_per_rank=sp.stages_per_rank,
        ),
        tensor_parallel=sol.styles,
        module_attrs=_module_attrs(graph, sol.styles, best.mesh.tp),
        checkpointing={
            fqn: "full" if i in sp.checkpointed else "none"
            for i, fqn in enumerate(layers)
            if graph.layer(fqn).is_module
        },
        offload=best.offload,
        predicted=predicted,
        planning_time_s=elapsed_s,
        alternatives=_alternatives(best, candidates),
        notes=_notes(best),
    )


def _notes(best: Candidate) -> list[str]:
    if best.offload:
        return [
            "nothing fits on the devices with parameters, gradients and optimizer state there: "
            "they are offloaded to host memory (FSDP2 CPUOffloadPolicy; the optimizer runs on "
            "the CPU and its transfers are counted in the optimizer time)"
        ]
    if best.idle_tp:
        return [
            f"tp={best.mesh.tp} shards no module: at this size the cost model finds every "
            "module cheaper replicated (collectives and DTensor dispatch outweigh the compute "
            "saved), so the TP group repeats work; pin a smaller tp or use a larger model"
        ]
    return []


def _module_attrs(graph: Graph, styles: dict[str, str], tp: int) -> dict[str, dict[str, int]]:
    """Head-count attributes of modules that own tensor-parallel linears, divided by tp, so a
    model that sizes its views from them sees its local heads."""
    if tp == 1:
        return {}
    out: dict[str, dict[str, int]] = {}
    parents = {fqn.rpartition(".")[0] for fqn, s in styles.items() if s.startswith("colwise")}
    for fqn in sorted(parents):
        info = graph.modules.get(fqn)
        attrs = {
            k: v // tp
            for k, v in (info.int_attrs.items() if info else ())
            if k in _HEAD_ATTRS and v % tp == 0
        }
        if attrs:
            out[fqn] = attrs
    return out


def _alternatives(best: Candidate, candidates: list[Candidate]) -> list[Alternative]:
    others = sorted(
        (c for c in candidates if c is not best),
        key=lambda c: (c.why_not is not None, not c.fits, c.step_time_s),
    )
    return [
        Alternative(
            mesh=c.mesh,
            step_time_s=c.step_time_s if math.isfinite(c.step_time_s) else 0.0,
            peak_memory_bytes=c.memory.total,
            fits=c.fits and c.why_not is None,
            why=_why_lost(c, best),
            lost_by=_lost_by(c, best),
            time_breakdown_s=c.time,
            memory_breakdown_bytes=c.memory if c.memory.total else None,
            schedule=_schedule_of(c),
        )
        for c in others[:_NUM_ALTERNATIVES]
    ]


def _schedule_of(c: Candidate) -> Schedule | None:
    sp = c.stage_plan
    if sp is None:
        return None
    return Schedule(
        name=sp.schedule if c.mesh.pp > 1 else "none",
        num_microbatches=sp.num_microbatches,
        stages_per_rank=sp.stages_per_rank,
    )


def _lost_by(c: Candidate, best: Candidate) -> str:
    """The kind of reason :func:`_why_lost` gives (its tests, in its order)."""
    if c.why_not is not None:
        return "constraint"
    if c.idle_tp and not best.idle_tp:
        return "idle_tp"
    if c.pruned:
        return "pruned"
    if c.stage_error is not None or not c.fits:
        return "memory"
    return "slower"


def _why_lost(c: Candidate, best: Candidate) -> str:
    if c.why_not is not None:
        return c.why_not
    if c.idle_tp and not best.idle_tp:
        return f"at tp={c.mesh.tp} no module pays to shard: the TP group would only repeat work"
    if c.pruned:
        return (
            f"at least {c.step_time_s * 1e3:.4g} ms per step even with a perfect pipeline, "
            f"slower than the chosen {best.step_time_s * 1e3:.4g} ms (pruned)"
        )
    if c.stage_error is not None:
        return c.stage_error
    if not c.fits:
        return f"needs {c.memory.total / 1e9:.2f} GB per device, more than the device has"
    assert c.time is not None and best.time is not None
    parts = ("compute", "tp_comm", "dp_comm", "pp_comm", "bubble", "optimizer")
    diffs = {p: getattr(c.time, p) - getattr(best.time, p) for p in parts}
    worst = max(diffs, key=lambda p: diffs[p])
    return (
        f"{(c.step_time_s - best.step_time_s) * 1e3:+.3g} ms per step, mostly {worst} "
        f"({diffs[worst] * 1e3:+.3g} ms)"
    )
