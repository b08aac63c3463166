"""Scoring one mesh: its per-layer costs (the intra-layer ILP at its tp degree, the step-level
terms of :mod:`cost_model.step`), its stages, schedule, microbatches and checkpointing
(:mod:`planner.stages`), and its predicted step time and memory, as a :class:`Candidate`.

Per candidate mesh:

  local batch   b = global_batch / (dp * fsdp)                       (must divide exactly)
  compute, tp   from the ILP at degree tp with b (compute and TP collectives, fwd + bwd)
  dp traffic    cost_model.step: DDP buckets or FSDP units over the dp/fsdp links, the part
                not hidden behind compute exposed
  optimizer     AdamW or SGD on the local parameters (host AdamW with offload)
  step time     the stage plan's pipeline clock (one stage when pp = 1) + exposed dp
                + optimizer + the pipeline runtime's overhead
  context par.  cp > 1 (planner.plan.ContextParallel): every rank runs its 1/cp of each sample's
                tokens, so compute, TP traffic and activations are those of a batch b / cp
                (causal attention too: head-tail load balancing gives each rank 1/cp of it);
                per attention layer the keys/values are all-gathered over cp in forward and
                their gradients reduce-scattered in backward, exposed
                (the all-gather precedes the attention it feeds), and the gathered keys/values
                stay saved for backward ((cp - 1)/cp of the layer's full K/V); parameters,
                gradients and their traffic as FSDP over fsdp x cp (HSDP with dp > 1)
  memory        params + grads + optimizer states (sharded by fsdp, and by tp for the parameters
                the styles shard) + activations of the microbatches in flight (sharded where the
                layout is) + buffers (DDP gradient buckets, FSDP gathered units, reserve);
                bytes per parameter from the mesh's precision regime (cost_model.precision:
                what the emitted script keeps in which dtype), frozen parameters
                (requires_grad=False) charged their parameter bytes only
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from autopar.cost_model import MemoryBreakdown, axis_link, peak
from autopar.cost_model import step as cost
from autopar.cost_model.precision import precision
from autopar.ir import Graph
from autopar.planner import groups, ilp, schedule_search, schedules, stages
from autopar.planner.experts import (
    _ep_dp,
    _expert_floor_share,
    _gathered,
    _with_experts,
    all_to_all_step_s,
)
from autopar.planner.plan import Mesh, StagePrediction, TimeBreakdown
from autopar.planner.rank_memory import (
    _cp_layer,
    _held_share,
    _local_numel,
    _loss_tp,
    _memory,
    _output_bytes,
    _root_unit_bytes,
)
from autopar.planner.request import Options
from autopar.planner.rules import AXES, CARVED, mesh_rule
from autopar.planner.space import (
    _Ctx,
    _Space,
    fold_cp,
)


@dataclass(frozen=True)
class Candidate:
    mesh: Mesh
    step_time_s: float
    memory_or_rule: MemoryBreakdown | Callable[[], MemoryBreakdown]
    """its memory (:attr:`memory`), or how to compute it: a mesh that loses before it is
    scored in full has its memory computed only if read (an alternative shown, a nothing-fits
    message)."""
    fits: bool
    why_not: str | None
    """a constraint that rules the mesh out (memory is judged separately through ``fits``)."""
    time: TimeBreakdown | None = None
    solution: ilp.TPSolution | None = None
    stage_plan: stages.StagePlan | None = None
    stage_error: str | Exception | None = None
    """why no stage partition fits the memory (the candidate then does not fit)."""
    pruned: bool = False
    """not fully scored: its lower bound (``step_time_s``) already loses to a scored plan."""
    offload: bool = False
    """parameters, gradients and optimizer state offloaded to the host (FSDP2)."""
    stage_details: tuple[StagePrediction, ...] = ()
    """per virtual stage: per-microbatch times, memory, rank (for explanations and the report)."""
    rank_memory: tuple[MemoryBreakdown, ...] = ()
    """memory by kind on each pipeline rank."""
    batch_shares: tuple[int, ...] | None = None
    """a mixed cluster: samples per step of each data-parallel rank (None: an even split)."""
    pipeline_scale: tuple[float, ...] | None = None
    """a mixed cluster: per pipeline rank, its group's time scale (None: the uniform one's)."""
    pipeline_groups: tuple[int, ...] | None = None
    """a mixed cluster whose pipeline ranks each lie in one group: per pipeline rank, the group
    that runs it, in the order the search found fastest (:func:`groups.pipeline_orders`)."""
    pipeline_orders: tuple[tuple[tuple[int, ...], float | None, str | Exception], ...] = ()
    """a mixed cluster's pipeline: per order of the groups tried (per pipeline rank its
    group), its step time or None and why (:func:`_placed_stage_plan`)."""
    rank_capacity_bytes: tuple[int, ...] = ()
    """per pipeline rank, the device memory it may fill (:func:`groups.rank_capacity_bytes`);
    ``fits`` is every rank's memory within its own."""

    @property
    def memory(self) -> MemoryBreakdown:
        """Memory by kind on the fullest rank (computed once, where first read)."""
        if callable(self.memory_or_rule):
            object.__setattr__(self, "memory_or_rule", self.memory_or_rule())
        return self.memory_or_rule  # type: ignore[return-value]

    @property
    def idle_tp(self) -> bool:
        """tp > 1 with no module sharded: the TP group only repeats work. Such a mesh is chosen
        only when nothing else fits, however the costs compare."""
        return self.mesh.tp > 1 and self.solution is not None and not self.solution.styles


def evaluate(space: _Space, mesh: Mesh, bound: float = math.inf) -> Candidate:
    """Score one mesh; stop early (``pruned``) when it cannot beat ``bound`` seconds. CPU offload
    of parameters, gradients and optimizer state (FSDP2, GPU clusters) is the last resort: tried
    only when the mesh does not fit otherwise."""
    plain = _evaluate_once(space, mesh, bound)
    if plain.fits or plain.pruned or plain.why_not or space.cluster.device.kind != "gpu":
        return plain
    if fold_cp(mesh).fsdp == 1:
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
    refusal = mesh_rule(mesh, space.facts)
    if refusal is not None:
        return Candidate(mesh, math.inf, empty, False, refusal.why)
    real, mesh = mesh, fold_cp(mesh)  # cp as data ranks for the per-parameter terms
    # lower bound: every parameter sharded by every axis that can shard it
    static_floor = cost.static_floor_bytes(
        graph, training.dtype, training.optimizer, mesh.pp * mesh.fsdp * mesh.tp, options.system
    ) * _expert_floor_share(graph, mesh)
    if offload and static_floor > cost.HOST_BYTES_PER_GPU:
        why = (
            f"offloading needs {static_floor / 1e9:.0f} GB of host memory per GPU, more than "
            f"the {cost.HOST_BYTES_PER_GPU / 1e9:.0f} GB assumed"
        )
        return Candidate(real, math.inf, empty, False, None, stage_error=why)
    if static_floor > _most_memory(space, real) and not offload:
        why = (
            f"parameters, gradients and optimizer state alone need at least "
            f"{static_floor / 1e9:.1f} GB per device, more than its "
            f"{_most_memory(space, real) / 1e9:.1f} GB"
        )
        memory = MemoryBreakdown(params=0, grads=0, optimizer=math.ceil(static_floor),
                                 activations=0, buffers=0)  # fmt: skip
        return Candidate(real, math.inf, memory, False, None, stage_error=why)
    axes = [(a, getattr(mesh, a)) for a in AXES if a not in CARVED]
    regime = precision(training.dtype, mesh, options.system)
    traced = graph.param_bytes / max(1, graph.num_params)  # bytes per parameter as traced
    sync_rate = cost.sync_s_per_byte(cluster, mesh, axes, regime, traced or 4.0)
    real_axes = tuple((a, getattr(real, a)) for a in AXES)
    ctx = _Ctx(space, mesh, axes, sync_rate, offload=offload, cp=real.cp, cp_axes=real_axes)
    per_replica = training.global_batch // dp_size
    whole = ctx.solution(per_replica)
    # every layer's fwd + bwd for the whole per-replica batch, spread evenly over the pipeline
    # ranks, is a lower bound of the step (microbatching, bubbles, recompute only add); so is
    # cp's K/V traffic for that batch (exposed, and per-microbatch latencies only add)
    floor_s = (whole.compute_s + whole.comm_s + _cp_comm_s(ctx, per_replica)) / mesh.pp
    floor_s *= min(space.group_scales, default=1.0)  # a mixed cluster's fastest group
    if bound == -math.inf:  # the search's first pass: the floor alone
        return Candidate(real, floor_s, empty, False, None, pruned=True)
    # per rank before FSDP's shard, as gathered and reduced: a rank's experts are 1/ep of them
    local, trainable = _local_numel(graph, whole, mesh.tp, range(len(graph.layers)), mesh.ep)
    # FSDP2 units: every module layer but those the root holds (tied weights), plus the root
    root = space.root_layers
    units = sum(1 for i, x in enumerate(graph.layers) if x.is_module and i not in root) + 1

    def traffic_s(microbatches: int = 1) -> float:
        return cost.dp_traffic_s(cluster, mesh, axes, regime, local, trainable, units,
                                 space.param_tensors, microbatches)  # fmt: skip

    traffic = traffic_s()
    bwd_share = graph.bwd_flops / max(1, graph.fwd_flops + graph.bwd_flops)
    # --checkpoint full: every layer re-runs its forward in backward, inside the overlap window
    # (auto: which layers is not known yet; none are counted)
    fwd_share = 1 - bwd_share if options.checkpoint == "full" else 0.0
    exposed_dp = cost.exposed_dp_s(traffic, whole.compute_s, bwd_share, cluster, mesh, axes,
                                   whole.compute_s * fwd_share)  # fmt: skip
    # the unit whose FSDP transients are largest (its gathered parameters and gradients)
    units_at = space.unit_numels.get(mesh.ep)
    if units_at is None:  # distinct sizes, in layer order: the first largest is the same
        units_at = space.unit_numels[mesh.ep] = tuple(
            dict.fromkeys(
                _gathered(graph, x, mesh.ep) for i, x in enumerate(graph.layers) if i not in root
            )
        )
    big = max(units_at, key=lambda n: regime.fsdp_unit_bytes(*n), default=(0, 0))
    buffers = cost.buffer_bytes(cluster, mesh, regime, local, trainable, *big)
    buffers += _root_unit_bytes(ctx, whole, big)
    limit = cluster.device.memory_bytes - buffers

    @functools.cache  # the stage search and the plan's stage details ask for the same sizes
    def costs_for(micro: int) -> list[stages.LayerCost]:
        return _layer_costs(ctx, ctx.solution(micro), micro, exposed_for(micro))

    def exposed_for(micro: int) -> float:
        """Exposed dp traffic of a step of microbatches of ``micro`` samples. Gradient
        accumulation (pp = 1, several microbatches): DDP syncs during the last microbatch's
        backward only; FSDP gathers parameters again for every microbatch, over all of them.
        A pipeline (pp > 1) reduces each stage's gradients after its last microbatch's
        backward, so only that one microbatch's compute (its backward for DDP) can hide the
        reduction; FSDP's all-gathers hide behind the compute of the microbatch they serve.
        Window and traffic are every layer's, split over the stages by the layers' shares."""
        if mesh.pp > 1:
            if cluster.device.kind == "cpu":
                return traffic
            # FSDP's gathers run with every microbatch, each behind that microbatch's compute;
            # the gradient reduction once, behind the last microbatch's backward
            one = ctx.solution(micro).compute_s
            gathers = cost.dp_traffic_s(cluster, mesh, axes, regime, local, 0.0, units, 0)
            exposed = cost.exposed_dp_s(
                traffic - gathers, one, bwd_share, cluster, mesh, axes, one * fwd_share
            )
            return exposed + max(0.0, gathers - one)
        if micro == per_replica:
            return exposed_dp
        m = per_replica // micro
        t = traffic_s(m)
        window = whole.compute_s if mesh.fsdp > 1 else ctx.solution(micro).compute_s
        return cost.exposed_dp_s(t, window, bwd_share, cluster, mesh, axes, window * fwd_share)

    if floor_s >= bound:
        memory = functools.partial(_memory, ctx, whole, None, buffers)
        return Candidate(real, floor_s, memory, False, None, pruned=True)
    # a mixed cluster: pipeline ranks (or data-parallel ranks) that each lie in one group run
    # at its speed, pipeline ranks within its memory (planner.groups); no group_scales: the
    # uniform treatment
    pipe_blocks = groups.rank_groups(cluster, real, "pp") if space.group_scales else None
    dp_scale = groups.time_scales(space.group_scales, groups.rank_groups(cluster, real, "dp"))
    if limit <= 0:
        memory = functools.partial(_memory, ctx, whole, None, buffers)
        why = (
            f"buffers alone ({buffers / 1e9:.1f} GB: gradient buckets, gathered FSDP units, "
            f"reserve) exceed the device's {cluster.device.memory_bytes / 1e9:.1f} GB"
        )
        return Candidate(real, math.inf, memory, False, None, stage_error=why)
    try:
        plan, runtime_s, pipe_groups, tried = _placed_stage_plan(
            ctx, costs_for, per_replica, buffers, options, bound, pipe_blocks
        )
    except stages.BoundExceeded as e:  # a step >= the stage search's floor: cannot win
        memory = functools.partial(_memory, ctx, whole, None, buffers)
        return Candidate(real, max(floor_s, e.floor), memory, False, None, pruned=True)
    except (stages.StageError, stages.ScheduleError) as e:
        memory = functools.partial(_memory, ctx, whole, None, buffers)
        why = None if isinstance(e, stages.StageError) else str(e)
        return Candidate(real, math.inf, memory, False, why, stage_error=e)
    micro = per_replica // plan.num_microbatches
    sol = ctx.solution(micro)
    pipe_scale = groups.time_scales(space.group_scales, pipe_groups)
    details = _stage_details(plan, costs_for(micro), mesh.pp, pipe_scale)
    time_parts = _time_parts(ctx, sol, plan, runtime_s, details, _cp_comm_s(ctx, micro))
    # each placement's step, as the plan's: with the gradient norm (the same for every one)
    tried = tuple((p, t if t is None else t + time_parts.grad_norm, why) for p, t, why in tried)
    # every pipeline rank's memory, once; the candidate's is the fullest rank's
    per_rank = tuple(_memory(ctx, sol, plan, buffers, r) for r in range(mesh.pp))
    memory = max(per_rank, key=lambda m: m.total)
    shares = groups.batch_shares(training.global_batch, dp_scale, plan.num_microbatches)
    if shares is not None:  # the slowest rank's share sets the compute; the largest its memory
        assert dp_scale is not None
        k = groups.share_step_factor(shares, dp_scale, training.global_batch)
        time_parts = time_parts.model_copy(
            update={"compute": time_parts.compute * k, "recompute": time_parts.recompute * k}
        )
        grown = math.ceil(memory.activations * max(shares) / per_replica)
        memory = memory.model_copy(update={"activations": grown})
    # pp = 1: the one rank, with the largest batch share's activations
    rank_memory = (memory,) if mesh.pp == 1 else per_rank
    capacity = groups.rank_capacity_bytes(cluster, pipe_groups, mesh.pp)
    fits = all(m.total <= cap for m, cap in zip(rank_memory, capacity, strict=True))
    return Candidate(
        real, time_parts.total, memory, fits, None, time_parts, sol, plan,
        stage_details=details, rank_memory=rank_memory, offload=offload,
        batch_shares=shares, pipeline_scale=pipe_scale, pipeline_groups=pipe_groups,
        pipeline_orders=tried, rank_capacity_bytes=capacity,
    )  # fmt: skip


def _most_memory(space: _Space, mesh: Mesh) -> float:
    """The most memory a device of ``mesh`` can average (what the static floor, an even share
    of every parameter, is held against): on a mixed cluster whose pipeline ranks each lie in
    one group, the mean of their groups' memories (stages are sized to each group's), else the
    uniform device's."""
    cluster = space.cluster
    blocks = groups.rank_groups(cluster, mesh, "pp") if space.group_scales else None
    capacity = groups.rank_capacity_bytes(cluster, blocks, mesh.pp)
    return sum(capacity) / len(capacity)


def _stage_details(
    plan: stages.StagePlan,
    costs: list[stages.LayerCost],
    pp: int,
    rank_scale: tuple[float, ...] | None = None,
) -> tuple[StagePrediction, ...]:
    """Per virtual stage: the per-microbatch times the step time was built from (at its
    rank's ``rank_scale``, a mixed cluster's group speed)."""
    out = []
    for j, (a, b) in enumerate(plan.boundaries):
        layers = costs[a:b]
        rank = schedules.stage_rank(plan.schedule, pp, j)
        k = rank_scale[rank] if rank_scale else 1.0
        out.append(
            StagePrediction(
                rank=rank,
                fwd_s=sum(c.fwd_s for c in layers) * k,
                bwd_s=sum(c.bwd_s for c in layers) * k,
                bwd_weight_s=sum(c.bwd_weight_s for c in layers) * k,
                recompute_s=sum(costs[i].fwd_s for i in plan.checkpointed if a <= i < b) * k,
                memory_bytes=math.ceil(plan.stage_memory_bytes[j]),
                in_flight=plan.stage_in_flight[j],
            )
        )
    return tuple(out)


def _placed_stage_plan(
    ctx: _Ctx,
    costs_for,
    per_replica: int,
    buffers: float,
    options: Options,
    bound: float,
    blocks: tuple[int, ...] | None,
):
    """:func:`_stage_plan` within each rank's memory less ``buffers``; on a mixed cluster whose
    pipeline ranks each lie in one group (``blocks``: per pipeline block in rank order, its
    group), for each placement of the groups on the pipeline (:func:`groups.pipeline_orders`),
    every rank at its group's speed and within its group's memory: the fastest, as (plan,
    runtime_s, per pipeline rank its group or None, per placement tried (placement, step time
    or None, why none)). Each placement is held to ``bound`` alone, not to the best placement
    so far, so that every one that can win the search has its step time recorded (the summary
    ranks them); one that cannot is not partitioned (``stages.BoundExceeded``). Where none
    fits, a bound exceeded (the mesh cannot win) comes before a memory refusal."""
    cluster, space, pp = ctx.cluster, ctx.space, ctx.mesh.pp
    orders = (
        [None] if blocks is None else groups.pipeline_orders(cluster, blocks, space.group_scales)
    )
    best, error, tried = None, None, []
    for placed in orders:
        scale = groups.time_scales(space.group_scales, placed)
        limits = tuple(m - buffers for m in groups.rank_capacity_bytes(cluster, placed, pp))
        try:  # each order against the caller's bound only: its step is recorded and shown
            plan, runtime_s = _stage_plan(
                ctx, costs_for, per_replica, limits, options, bound, scale
            )
        except (stages.BoundExceeded, stages.StageError, stages.ScheduleError) as e:
            why = "its lower bound loses" if isinstance(e, stages.BoundExceeded) else e
            tried.append((placed, None, why))
            # every placement that fits at all is slower than the bound: the mesh loses
            bound_e = isinstance(e, stages.BoundExceeded)
            if error is None or (bound_e and not isinstance(error, stages.BoundExceeded)):
                error = e
            elif bound_e and isinstance(error, stages.BoundExceeded):
                error = min(error, e, key=lambda x: x.floor)
            continue
        tried.append((placed, plan.step_time_s + runtime_s, ""))
        if best is None or plan.step_time_s + runtime_s < best[0].step_time_s + best[1]:
            best = (plan, runtime_s, placed)
    if best is None:
        assert error is not None
        raise error
    return (*best, tuple(tried) if blocks is not None else ())


def _stage_plan(
    ctx: _Ctx,
    costs_for,
    per_replica: int,
    limits: tuple[float, ...],
    options: Options,
    bound: float = math.inf,
    rank_scale: tuple[float, ...] | None = None,
):
    """pp = 1: one stage (:func:`_accumulation_plan`); else the best schedule and microbatch
    count (:func:`planner.schedule_search.best_schedule`; stages.BoundExceeded where no candidate can
    beat ``bound``); per pipeline rank, ``limits``: its memory for stages, ``rank_scale``: a
    mixed cluster's group speed."""
    pp = ctx.mesh.pp
    if pp == 1:
        return _accumulation_plan(costs_for, per_replica, limits[0], options, bound), 0.0
    link = axis_link(ctx.cluster, ctx.axes, "pp")
    choices = (
        [options.microbatches] if options.microbatches else _microbatch_choices(per_replica, pp)
    )
    if options.microbatches and per_replica % options.microbatches:
        raise stages.ScheduleError(
            f"--microbatches {options.microbatches} does not divide the per-replica batch "
            f"{per_replica}"
        )
    best, tried = schedule_search.best_schedule(
        costs_for,
        num_stages=pp,
        global_batch_per_dp=per_replica,
        mem_limit_bytes=min(limits),
        rank_mem_limit_bytes=limits if len(set(limits)) > 1 else None,
        schedules=schedules.searched(ctx.mesh.data_parallel, options.schedule),
        microbatch_choices=choices,
        checkpoint=options.checkpoint,
        p2p_s_per_byte=1 / link.bandwidth_bytes_per_s,
        p2p_latency_s=link.latency_s,
        overhead_s=lambda plan: _runtime_overhead_s(ctx, plan),
        cuts=ctx.space.cuts,
        bound=bound,
        rank_time_scale=rank_scale,
    )
    ranked = next(c for c in tried if c.plan is best)  # its step time counts the overhead
    return best, ranked.step_time_s - best.step_time_s


def _accumulation_plan(
    costs_for, per_replica: int, limit: float, options: Options, bound: float = math.inf
):
    """pp = 1: checkpointing and the gradient accumulation steps (microbatches run one after
    another, one in flight). The whole per-replica batch at once unless it does not fit or
    needs checkpointing; then more accumulation steps (divisors of the batch, up to 8, up to the
    first count that needs no checkpointing) are tried and the fastest kept. ``--microbatches
    N`` pins the count. A count whose step cannot beat ``bound`` (the search's best) or the
    fastest count so far is not partitioned; stages.BoundExceeded where none can beat
    ``bound``."""

    def schedule(m: int) -> schedules.Schedule:  # one stage: both hold one microbatch
        return "gpipe" if m == 1 else "1f1b"

    def one(m: int, beat: float = math.inf) -> stages.StagePlan:
        return stages.partition(
            costs_for(per_replica // m),
            num_stages=1,
            num_microbatches=m,
            mem_limit_bytes=limit,
            schedule=schedule(m),
            checkpoint=options.checkpoint,
            bound=beat,
        )

    def unchecked(m: int) -> bool:  # its partition would checkpoint nothing
        return options.checkpoint != "full" and stages.fits_unchecked(
            costs_for(per_replica // m), num_microbatches=m, mem_limit_bytes=limit,
            schedule=schedule(m),
        )  # fmt: skip

    if options.microbatches is not None:
        if per_replica % options.microbatches:
            raise stages.ScheduleError(
                f"--microbatches {options.microbatches} does not divide the per-replica batch "
                f"{per_replica}"
            )
        return one(options.microbatches, bound)
    error: Exception | None = None
    floor = math.inf  # the least floor of the counts left out for ``bound``
    try:
        whole = one(1, bound)
    except stages.BoundExceeded as e:
        whole, floor = None, e.floor
        if unchecked(1):  # the whole batch at once, unchecked, would have been the plan
            raise
    except stages.StageError as e:
        whole, error = None, e
    if whole is not None and not whole.checkpointed:
        return whole
    tried = [whole] if whole is not None else []
    for m in range(2, min(per_replica, 8) + 1):
        if per_replica % m == 0:
            # a count whose step cannot beat the fastest tried needs no partition; the loop
            # still stops where that partition would have checkpointed nothing
            fastest = min((plan.step_time_s for plan in tried), default=math.inf)
            try:
                tried.append(one(m, min(fastest, bound)))
            except stages.BoundExceeded as e:
                if e.floor <= fastest:  # it might beat every count tried, not the bound
                    floor = min(floor, e.floor)
                if unchecked(m):
                    break
                continue
            except stages.StageError:
                continue
            if not tried[-1].checkpointed:  # more steps would only add per-step overhead
                break
    fastest = min((plan.step_time_s for plan in tried), default=math.inf)
    if floor < fastest:  # a count left out for the bound might have won: the mesh cannot
        raise stages.BoundExceeded(min(floor, fastest))
    if not tried:
        assert error is not None
        raise error
    return min(tried, key=lambda plan: plan.step_time_s)


def _runtime_overhead_s(ctx: _Ctx, plan: stages.StagePlan) -> float:
    """The pipeline runtime's host time on the busiest rank's critical path."""
    actions = schedules.critical_actions(
        plan.schedule, plan.num_microbatches, plan.stages_per_rank, ctx.mesh.pp
    )
    return cost.pipeline_runtime_s(ctx.cluster, actions)


def _microbatch_choices(per_replica: int, pp: int) -> list[int]:
    """Divisors of the per-replica batch from pp to 8 pp (fewer microbatches than stages leave
    ranks idle; past ~8 pp the bubble gain no longer pays for smaller, less efficient ops)."""
    out = [d for d in range(pp, min(per_replica, 8 * pp) + 1) if per_replica % d == 0]
    return out or [d for d in range(1, per_replica + 1) if per_replica % d == 0][-1:]


def _tp_local_bytes(graph: Graph, sol: ilp.TPSolution, tp: int) -> float:
    sharded = sol.sharded_param_bytes
    return sharded / tp + (graph.param_bytes - sharded)


def _layer_costs(
    ctx: _Ctx, sol: ilp.TPSolution, micro: int, exposed_dp: float
) -> list[stages.LayerCost]:
    """One LayerCost per layer for one microbatch of ``micro`` samples on one rank."""
    graph, mesh = ctx.graph, ctx.mesh
    scale = micro / (graph.batch_size * ctx.cp)  # a rank's share of the tokens
    regime, optimizer = ctx.precision, ctx.training.optimizer
    total_local = max(1.0, _tp_local_bytes(graph, sol, mesh.tp))
    groups = ctx.space.layer_groups or tuple(range(len(graph.layers)))
    made: list[stages.LayerCost] = []  # one per group (a run of identical blocks: once)
    for i in _group_firsts(groups):
        layer = graph.layers[i]
        part = sol.layer_parts[layer.fqn]
        busy = part.compute_s + part.comm_s
        flops = layer.fwd_flops + layer.bwd_flops
        fwd = busy * (layer.fwd_flops / flops if flops else 1 / 3)
        sharded = sol.layer_sharded_param_bytes[layer.fqn]
        local = sharded / mesh.tp + (layer.param_bytes - sharded)
        share = local / total_local
        numel, trainable = (
            x / mesh.fsdp for x in _local_numel(graph, sol, mesh.tp, [i], _ep_dp(mesh))
        )
        cp_fwd, cp_bwd, kv_saved = _cp_layer(ctx, layer.fqn, micro)
        # the last layer's microbatch carries the loss (cost_model.peak), checkpointed or not
        last = i == len(graph.layers) - 1
        loss = peak.loss_bytes(_output_bytes(graph) * scale / _loss_tp(ctx)) if last else 0.0
        fwd += cp_fwd
        busy += cp_fwd + cp_bwd
        fwd, busy = _with_experts(ctx, layer, part.compute_s, fwd, busy, scale)
        made.append(
            stages.LayerCost(
                fwd_s=fwd,
                bwd_s=busy - fwd,
                # assumption: the weight-gradient half of a matmul layer's backward
                bwd_weight_s=(busy - fwd - cp_bwd) / 2,
                act_bytes=sol.activations(regime.autocast)[layer.fqn] + kv_saved + loss,
                recompute_s=fwd + cost.checkpoint_overhead_s(ctx.cluster.device),
                act_ckpt_bytes=layer.saved_checkpointed(regime.autocast)
                * scale
                * _held_share(ctx, sol, layer.fqn)
                + loss,
                static_bytes=0.0
                if ctx.offload
                else regime.static_bytes(numel, trainable, optimizer),
                out_bytes=ctx.space.out_bytes[layer.fqn] * scale,
                grad_sync_s=exposed_dp * share,
                optimizer_s=(
                    cost.offloaded_optimizer_s(numel, trainable, regime)
                    if ctx.offload
                    else _optimizer_s(
                        ctx,
                        trainable,
                        ctx.space.tensors[layer.fqn],
                        _dtensor_tensors(ctx, sol, [i]),
                    )
                ),
            )
        )
    return [made[g] for g in groups]


@functools.lru_cache(maxsize=8)
def _group_firsts(groups: tuple[int, ...]) -> tuple[int, ...]:
    """Per group (numbered in order of first appearance), its first layer."""
    firsts: dict[int, int] = {}
    for i, g in enumerate(groups):
        firsts.setdefault(g, i)
    return tuple(firsts[g] for g in range(len(firsts)))


def _cp_comm_s(ctx: _Ctx, micro: int) -> float:
    """Context parallel's exposed traffic per microbatch of ``micro`` samples, all layers
    (layers with the same K/V bytes cost the same: each size is priced once)."""
    if ctx.cp == 1:
        return 0.0
    priced: dict[int, float] = {}
    total = 0
    for x in ctx.graph.layers:
        kv = ctx.space.kv_bytes.get(x.fqn, 0)
        if kv not in priced:
            priced[kv] = sum(_cp_layer(ctx, x.fqn, micro)[:2])
        total += priced[kv]
    return total


def _optimizer_s(ctx: _Ctx, numel: float, num_tensors: int, dtensor_tensors: int) -> float:
    """The optimizer step on ``numel`` trainable parameters in ``num_tensors`` tensors, of
    which ``dtensor_tensors`` are DTensors (:func:`_dtensor_tensors`)."""
    return cost.optimizer_s(
        ctx.cluster.device, ctx.training.optimizer, numel, num_tensors, dtensor_tensors,
        ctx.precision,
    )  # fmt: skip


def _dtensor_tensors(ctx: _Ctx, sol: ilp.TPSolution, layers: Iterable[int]) -> int:
    """How many of the trainable parameter tensors of ``layers`` the emitted program holds as
    DTensors (:func:`cost_model.step.holds_dtensor`)."""
    space, mesh = ctx.space, ctx.mesh
    if ctx.precision.wraps_in_fsdp(mesh):  # every one (FSDP2's DTensors): the layers' counts
        return sum(space.tensors[ctx.graph.layers[i].fqn] for i in layers)
    if mesh.tp == 1 and mesh.ep == 1:  # none
        return 0
    axes = {"fsdp2": False, "tp": mesh.tp, "ep": mesh.ep, "styles": sol.styles}
    return sum(
        1
        for i in layers
        for module, _, expert in space.trainable_tensors[i]
        if cost.holds_dtensor(module, expert, **axes)
    )


def _time_parts(
    ctx: _Ctx,
    sol: ilp.TPSolution,
    plan: stages.StagePlan,
    runtime_s: float,
    details: tuple[StagePrediction, ...] = (),
    cp_s: float = 0.0,
) -> TimeBreakdown:
    """Split the stage plan's step time (plus the pipeline runtime's overhead, counted with the
    pipeline's communication) into parts that sum to it. Recompute (part of compute) is the share
    the slowest stage spends re-running checkpointed forwards."""
    graph = ctx.graph
    per_step = plan.per_step_s
    _, trainable = _local_numel(graph, sol, ctx.mesh.tp, range(len(graph.layers)), _ep_dp(ctx.mesh))
    optimizer = _optimizer_s(
        ctx,
        trainable / ctx.mesh.fsdp / ctx.mesh.pp,
        graph.trainable_param_tensors // ctx.mesh.pp,
        _dtensor_tensors(ctx, sol, range(len(graph.layers))) // ctx.mesh.pp,
    )
    optimizer = min(optimizer, per_step)
    dp = per_step - optimizer
    busy = max(0.0, plan.step_time_s - plan.bubble_s - plan.p2p_s - per_step)
    ep = min(busy, all_to_all_step_s(ctx, plan))
    busy -= ep
    work = max(1e-30, sol.compute_s + sol.comm_s + cp_s)  # per microbatch; cp_s: the cp traffic
    tp = busy * sol.comm_s / work
    cp = busy * cp_s / work
    slowest = max(details, key=lambda d: d.fwd_s + d.bwd_s + d.recompute_s, default=None)
    recompute = 0.0
    if slowest is not None and slowest.recompute_s > 0:
        share = slowest.recompute_s / (slowest.fwd_s + slowest.bwd_s + slowest.recompute_s)
        recompute = (busy - tp - cp) * share
    tensors = graph.trainable_param_tensors // ctx.mesh.pp
    grad_bytes = trainable / ctx.mesh.fsdp / ctx.mesh.pp * ctx.precision.grad
    return TimeBreakdown(
        grad_norm=cost.grad_norm_s(ctx.cluster, grad_bytes, tensors),
        compute=busy - tp - cp,
        recompute=recompute,
        exposed_comm=tp + cp + dp + plan.p2p_s + runtime_s + ep,
        cp_comm=cp,
        bubble=plan.bubble_s,
        optimizer=optimizer,
        tp_comm=tp,
        dp_comm=dp,
        pp_comm=plan.p2p_s + runtime_s,
        ep_comm=ep,
    )
