"""The search: validate -> meshes -> score -> rank -> assemble.

1. validate  the pins and options, once (:func:`planner.request.validate`);
2. meshes    every (pp, dp, fsdp, cp, ep, tp) of the world size matching the pins that the
             mesh rules (:func:`planner.rules.mesh_rule`) leave a candidate
             (:func:`planner.request.candidate_meshes`);
3. score     each mesh (:func:`planner.score.evaluate`: the intra-layer ILP per tp degree, the
             stage DP, the step-level cost model), branch and bound: meshes whose lower bound
             already loses are pruned;
4. rank      by one rule (:func:`rank_key`): legal before ruled out, fitting before not, then
             step time;
5. assemble  the first fitting candidate whose TP group shards something (idle TP only when
             nothing else fits) into a :class:`Plan`, the others kept in rank order as
             alternatives with the reason each lost.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace

from autopar.cost_model import Cluster
from autopar.cost_model import experts as ep_cost
from autopar.cost_model import step as cost
from autopar.ir import Graph
from autopar.ir._heads import local_attrs
from autopar.planner import ilp, stages
from autopar.planner.collapse import Collapsed
from autopar.planner.experts import all_to_all_step_s, expert_ctx, expert_state_bytes
from autopar.planner.layouts import dtensor_style, fused_style
from autopar.planner.plan import (
    Alternative,
    ContextParallel,
    ExpertParallel,
    GroupOrder,
    LostBy,
    Mesh,
    MixedCluster,
    ModelRef,
    PinnedTP,
    Plan,
    Predicted,
    Schedule,
    Training,
)
from autopar.planner.request import (
    AXES,
    NothingFitsError,
    Options,
    PlanningError,
    attention_heads,
    candidate_meshes,
    cp_shard_at,
    enumerate_meshes,
    mesh_facts,
    module_kinds,
    parse_mesh,
    validate,
)
from autopar.planner.rules import whole_attention_rule
from autopar.planner.score import Candidate, evaluate
from autopar.planner.space import make_space

__all__ = [
    "Candidate",
    "NothingFitsError",
    "Options",
    "PlanningError",
    "attention_heads",
    "enumerate_meshes",
    "parse_mesh",
    "replay",
    "search",
    "static_floor_bytes",
    "why_lost",
]

_NUM_ALTERNATIVES = 8


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
    shard_tp: bool | None = None,
    cuts: stages.Cuts | None = None,
    optima: dict[int, dict] | None = None,
    prune: bool = True,
) -> Plan:
    """The fastest plan that fits, with the others kept as alternatives. ``progress`` (if
    given) is called with a short status line before each mesh is scored; ``stats`` (if given)
    receives counts: meshes, pruned (by the lower bound), ruled_out, ilp_solves (CP-SAT solves:
    tp = 1 needs none, and rates between two equal optima reuse them).

    ``shard_tp`` (default: tp pinned above 1): a pinned tp means sharding. The ILP then shards
    every module that can be sharded at that degree (the cheapest such choice, see
    :mod:`planner.ilp`), and the plan's ``pinned_tp`` says what that costs against the cost
    model's own choice on the same mesh.

    ``cuts`` (default: anywhere): the layer boundaries where the emitted script can cut the
    model into pipeline stages (the caller checks them on the model; see autopar._cuts).

    ``optima`` (default: this search's own): a dict the caller holds, tp -> the intra-layer
    ILP's proven optima on ``graph`` (:class:`planner.ilp.Solver`), read and added to, so that
    the next search of the same graph skips the solves this one ran (a planning session keeps
    it, and its plan cache stores it).

    ``prune`` (default): branch and bound, exact (the same plan as without it; only the
    alternatives' figures may read "pruned"); False scores every mesh in full (slower: for the
    tests that check exactly that)."""
    start = time.perf_counter()
    pins = dict(pins or {})
    options = options or Options()
    facts = mesh_facts(graph, cluster, training)
    validate(pins, options, facts, graph.positions)
    if shard_tp is None:
        shard_tp = pins.get("tp", 1) > 1
    space = make_space(
        graph, cluster, training, options, facts, shard_tp=shard_tp, cuts=cuts, optima=optima
    )
    meshes = candidate_meshes(facts, pins)
    candidates = _scored(
        meshes,
        lambda mesh, bound: evaluate(space, mesh, bound if prune else math.inf),
        progress,
        training.global_batch,
    )
    ranked = sorted(candidates, key=rank_key)
    legal = [c for c in candidates if c.why_not is None]
    if stats is not None:
        stats.update(
            meshes=len(meshes),
            pruned=sum(c.pruned for c in candidates),
            ruled_out=len(candidates) - len(legal),
            ilp_solves=space.ilp_solves,
        )
    if not ranked or not ranked[0].fits or ranked[0].why_not is not None:
        message = _nothing_fits(candidates, legal, cluster)
        if not legal:
            raise PlanningError(message)
        least = min(legal, key=lambda c: c.memory.total)
        raise NothingFitsError(message, least.memory.total - cluster.device.memory_bytes)
    best = next((c for c in ranked if c.fits and not c.idle_tp), ranked[0])
    styles = best.solution.styles if best.solution else {}
    whole = whole_attention_rule(graph.gqa_blocks, styles, best.mesh.tp)
    if shard_tp and whole is not None:
        raise PlanningError(f"--mesh tp={best.mesh.tp}: {whole.line()}")
    free = None
    if shard_tp and best.mesh.tp > 1:  # the same mesh with the ILP free to replicate
        free = evaluate(replace(space, shard_tp=False), best.mesh)
    experts = _expert_parallel(space, best) if best.mesh.ep > 1 else None
    plan = _plan(
        graph, cluster, training, model, best, ranked, time.perf_counter() - start, experts,
        space.fsdp_root, collapsed=space.collapsed,
    )  # fmt: skip
    if cluster.heterogeneous:
        plan = plan.model_copy(update={"mixed_cluster": _mixed(space, meshes, best)})
    if free is None:
        return plan
    pinned = _pinned_tp(best, free)
    notes = [*plan.notes, _pinned_note(graph, plan, pinned, free)]
    return plan.model_copy(update={"pinned_tp": pinned, "notes": notes})


def replay(graph: Graph, plan: Plan) -> Plan:
    """``plan`` recomputed from its own data: its cluster (machine facts included) and
    training, its mesh, schedule and microbatches (or accumulation steps) pinned, its
    checkpointing where it is all or nothing, on ``graph`` (its model traced again). The
    predicted figures equal the plan's when nothing but the plan's JSON went into them."""
    pipelined = plan.mesh.pp > 1
    modes = set(plan.checkpointing.values())
    options = Options(
        schedule=plan.schedule.name if pipelined else None,
        microbatches=plan.schedule.num_microbatches,
        checkpoint=modes.pop() if len(modes) == 1 else "auto",  # type: ignore[arg-type]
    )
    pins = {axis: getattr(plan.mesh, axis) for axis in AXES}
    return search(
        graph, plan.cluster, plan.training, model=plan.model, pins=pins, options=options,
        shard_tp=plan.pinned_tp is not None,
    )  # fmt: skip


def rank_key(c: Candidate) -> tuple:
    """The one ranking: legal before ruled out, fitting before not, then step time. The plan is
    the first fitting candidate whose TP group shards something (an idle TP group only repeats
    work: chosen only when nothing else fits); the others follow in this order."""
    return (c.why_not is not None, not c.fits, c.step_time_s)


def static_floor_bytes(graph: Graph, training: Training, world: int) -> float:
    """Parameters, gradients and optimizer state per device if every one were sharded over
    every device: no plan on ``world`` devices needs less."""
    return cost.static_floor_bytes(graph, training.dtype, training.optimizer, world)


def _scored(meshes: list[Mesh], evaluate, progress=None, global_batch: int = 0) -> list[Candidate]:
    """Branch and bound: a cheap pass finds each mesh's lower bound (and rules out the illegal
    ones), then meshes are scored from the likeliest to win (:func:`_likely_step`), each
    pruned once its bound loses to the best fitting plan so far. Meshes with idle TP groups
    never set the bound. The order changes which meshes are pruned, never the winner."""
    first = [evaluate(mesh, -math.inf) for mesh in meshes]
    done = [c for c in first if not c.pruned]
    best = math.inf
    todo = sorted((c for c in first if c.pruned), key=lambda c: _likely_step(c, global_batch))
    for i, c in enumerate(todo):
        if progress is not None:
            progress(f"scoring mesh {i + 1}/{len(todo)}: {c.mesh.short()}")
        full = evaluate(c.mesh, best)
        done.append(full)
        if full.fits and full.why_not is None and not full.idle_tp:
            best = min(best, full.step_time_s)
    return done


def _likely_step(c: Candidate, global_batch: int) -> float:
    """An estimate of a mesh's step time to order the scoring by (not a bound): its lower bound
    (``c.step_time_s``, every layer's work spread evenly over the pipeline ranks) with the
    bubble of a 1F1B pipeline at the most microbatches the search tries (8 pp, at most the
    per-replica batch), (pp - 1) / m of the work. A deep pipeline's bound hides the most."""
    pp = c.mesh.pp
    if pp == 1 or not global_batch:
        return c.step_time_s
    micro = max(1, min(global_batch // c.mesh.data_parallel, 8 * pp))
    return c.step_time_s * (1 + (pp - 1) / micro)


def _mixed(space, meshes: list[Mesh], best: Candidate) -> MixedCluster:
    """Where the plan uses each group's speed and memory, and the best step time of the same
    search on the cluster treated as uniform (every group at the slowest one's speed, with the
    smallest one's memory)."""
    uniform = replace(space, group_scales=())
    scored = _scored(
        meshes, lambda mesh, bound: evaluate(uniform, mesh, bound), None,
        space.training.global_batch,
    )  # fmt: skip
    fitting = [c for c in scored if c.fits and c.why_not is None and not c.pruned]
    pipeline = best.pipeline_groups
    return MixedCluster(
        group_time_scales=list(space.group_scales),
        pipeline_groups=list(pipeline) if pipeline else None,
        pipeline_orders=[
            GroupOrder(groups=list(dict.fromkeys(placed)), step_time_s=step, why=str(why))
            for placed, step, why in best.pipeline_orders
        ],
        batch_shares=list(best.batch_shares) if best.batch_shares else None,
        uniform_step_time_s=min((c.step_time_s for c in fitting), default=None),
    )


def _nothing_fits(candidates: list[Candidate], legal: list[Candidate], cluster: Cluster) -> str:
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


def _plan(
    graph: Graph,
    cluster: Cluster,
    training: Training,
    model: ModelRef,
    best: Candidate,
    ranked: list[Candidate],
    elapsed_s: float,
    expert_parallel: ExpertParallel | None = None,
    fsdp_root: tuple[str, ...] = (),
    *,
    collapsed: Collapsed,
) -> Plan:
    sol = best.solution
    assert sol is not None and best.time is not None
    step = best.step_time_s
    samples = training.global_batch / step
    model_flops = (graph.fwd_flops + graph.bwd_flops) * training.global_batch / graph.batch_size
    peak = cluster.total_peak_flops(training.dtype)
    predicted = Predicted(
        step_time_s=step,
        peak_memory_bytes=best.memory.total,
        memory_breakdown_bytes=best.memory,
        tokens_per_s=samples * training.seq_len if training.seq_len else None,
        samples_per_s=samples,
        mfu=model_flops / (step * peak) if peak else 0.0,
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
        tensor_parallel=_program_styles(graph, sol.styles, best.mesh.tp),
        module_attrs=_module_attrs(graph, sol.styles, best.mesh.tp),
        module_kinds=module_kinds(graph, collapsed.norm_modules, collapsed.scatter_modules),
        checkpointing={
            fqn: "full" if i in sp.checkpointed else "none"
            for i, fqn in enumerate(layers)
            if graph.layer(fqn).is_module
        },
        offload=best.offload,
        fsdp_root=list(fsdp_root),
        context_parallel=_context_parallel(graph, best.mesh),
        expert_parallel=expert_parallel,
        predicted=predicted,
        planning_time_s=elapsed_s,
        alternatives=_alternatives(best, ranked),
        notes=_notes(best),
    )


def _context_parallel(graph: Graph, mesh: Mesh) -> ContextParallel | None:
    """How the emitted program splits the sequence (cp > 1): at the first attention layer."""
    if mesh.cp == 1:
        return None
    shard_at = cp_shard_at(graph)
    assert shard_at is not None  # cp_rule admits only models with attention
    return ContextParallel(shard_at=shard_at)


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


def _weight_sharded(styles: dict[str, str]) -> int:
    return sum(ilp.shards_weights(s) for s in styles.values())


def _pinned_tp(best: Candidate, free: Candidate) -> PinnedTP:
    assert best.solution is not None
    scored = free.solution is not None and free.why_not is None
    fits = scored and free.fits and math.isfinite(free.step_time_s)
    return PinnedTP(
        sharded_modules=_weight_sharded(best.solution.styles),
        free_sharded_modules=_weight_sharded(free.solution.styles) if free.solution else 0,
        free_step_time_s=free.step_time_s if fits else None,
        free_peak_memory_bytes=free.memory.total if scored and free.memory.total else None,
    )


def _pinned_note(graph: Graph, plan: Plan, pinned: PinnedTP, free: Candidate) -> str:
    """One line: what pinning tp costs against the cost model's own choice on the mesh."""
    tp, mesh = plan.mesh.tp, plan.mesh.short()
    head = (
        f"tp={tp} is pinned, so every module that can be sharded at tp={tp} is "
        f"({pinned.sharded_modules} modules)"
    )
    free_styles = free.solution and _program_styles(graph, free.solution.styles, free.mesh.tp)
    if free_styles == plan.tensor_parallel:
        return f"{head}: the cost model's own choice on {mesh} shards the same"
    which = (
        "which shards nothing"
        if pinned.free_sharded_modules == 0
        else f"which shards {pinned.free_sharded_modules}"
    )
    p = plan.predicted
    if pinned.free_step_time_s is None:
        return f"{head}; the cost model's own choice on {mesh} ({which}) does not fit"
    gap = p.step_time_s - pinned.free_step_time_s
    mem = p.peak_memory_bytes - (pinned.free_peak_memory_bytes or 0)
    return (
        f"{head}: predicted {p.step_time_s * 1e3:.4g} ms per step and "
        f"{_mib(p.peak_memory_bytes)} per device, against {pinned.free_step_time_s * 1e3:.4g} ms "
        f"and {_mib(pinned.free_peak_memory_bytes or 0)} for the cost model's own choice on "
        f"{mesh} ({which}): {gap * 1e3:+.3g} ms ({gap / pinned.free_step_time_s:+.1%}) per "
        f"step, {'+' if mem >= 0 else '-'}{_mib(abs(mem))} per device"
    )


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.2f} MiB"


def _program_styles(graph: Graph, styles: dict[str, str], tp: int) -> dict[str, str]:
    """The solution's styles as the emitted program spells them: in a block that runs on
    DTensors, a colwise linear hands on its output as a DTensor (``layouts.dtensor_style``); a
    fused q/k/v projection the ILP runs colwise at ``tp`` keeps its kv heads whole
    (``layouts.fused_style``: ``colwise_fused_heads``)."""
    return fused_style(
        graph,
        {
            fqn: dtensor_style(s, graph.fused_linears.get(fqn))
            if fqn.rpartition(".")[0] in graph.dtensor_blocks
            else s
            for fqn, s in styles.items()
        },
        tp,
    )


def _module_attrs(graph: Graph, styles: dict[str, str], tp: int) -> dict[str, dict[str, int]]:
    """Head-count attributes of modules whose linears hand them sharded outputs (colwise,
    colwise_from_seq), divided by tp, so a model that sizes its views from them sees its local
    heads. A module whose linears gather their outputs back (colwise_gather) sees every head:
    its counts stay whole; so does a block that runs on DTensors (full shapes)."""
    if tp == 1:
        return {}
    out: dict[str, dict[str, int]] = {}
    local = ("colwise", "colwise_from_seq")
    parents = {fqn.rpartition(".")[0] for fqn, s in styles.items() if s in local}
    parents -= graph.dtensor_blocks
    # kv projections each rank computes the kv head of (ir._heads.local_attrs: kv heads 1)
    grouped = {
        fqn.rpartition(".")[0]: graph.grouped_kv[fqn][tp]
        for fqn, s in styles.items()
        if s in ("colwise_gather_heads", "colwise_kv_heads") and tp in graph.grouped_kv.get(fqn, {})
    }
    for fqn in sorted(parents):
        info = graph.modules.get(fqn)
        attrs = local_attrs(info.int_attrs if info else {}, tp, grouped.get(fqn))
        if attrs:
            out[fqn] = attrs
    return out


def _alternatives(best: Candidate, ranked: list[Candidate]) -> list[Alternative]:
    others = [c for c in ranked if c is not best]
    return [
        Alternative(
            mesh=c.mesh,
            step_time_s=c.step_time_s if math.isfinite(c.step_time_s) else 0.0,
            peak_memory_bytes=c.memory.total,
            fits=c.fits and c.why_not is None,
            lost_by=lost[0],
            why=lost[1],
            time_breakdown_s=c.time,
            memory_breakdown_bytes=c.memory if c.memory.total else None,
            schedule=_schedule_of(c),
        )
        for c in others[:_NUM_ALTERNATIVES]
        for lost in [why_lost(c, best)]
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


def why_lost(c: Candidate, best: Candidate) -> tuple[LostBy, str]:
    """Why candidate ``c`` lost to ``best``: the kind (:data:`planner.plan.LostBy`) and the
    words, decided once, in this order: a rule ruled it out, its TP group idles where the
    chosen one's does not, its lower bound already lost (pruned), it does not fit, it is slower
    (by the cost part that differs most)."""
    if c.why_not is not None:
        return "constraint", c.why_not
    if c.idle_tp and not best.idle_tp:
        return "idle_tp", (
            f"at tp={c.mesh.tp} no module pays to shard: the TP group would only repeat work"
        )
    if c.pruned:
        return "pruned", (
            f"at least {c.step_time_s * 1e3:.4g} ms per step even with a perfect pipeline, "
            f"slower than the chosen {best.step_time_s * 1e3:.4g} ms (pruned)"
        )
    if c.stage_error is not None:
        return "memory", str(c.stage_error)
    if not c.fits:
        over = [
            (r, m.total, cap)
            for r, (m, cap) in enumerate(zip(c.rank_memory, c.rank_capacity_bytes))
            if m.total > cap
        ]
        if len(set(c.rank_capacity_bytes)) > 1 and over:  # a mixed cluster's own memories
            r, need, cap = over[0]
            return "memory", (
                f"pipeline rank {r} needs {need / 1e9:.2f} GB, more than its group's "
                f"{cap / 1e9:.2f} GB"
            )
        return "memory", f"needs {c.memory.total / 1e9:.2f} GB per device, more than the device has"
    assert c.time is not None and best.time is not None
    parts = (
        "compute", "tp_comm", "cp_comm", "dp_comm", "pp_comm", "ep_comm", "bubble", "optimizer"
    )  # fmt: skip
    diffs = {p: getattr(c.time, p) - getattr(best.time, p) for p in parts}
    worst = max(diffs, key=lambda p: diffs[p])
    return "slower", (
        f"{(c.step_time_s - best.step_time_s) * 1e3:+.3g} ms per step, mostly {worst} "
        f"({diffs[worst] * 1e3:+.3g} ms)"
    )


def _expert_parallel(space, best: Candidate) -> ExpertParallel:
    """What an ep > 1 plan records about its MoE blocks (the plan's ExpertParallel)."""
    graph, mesh = space.graph, best.mesh
    moes = graph.moes
    assert moes and best.stage_plan is not None
    per_rank, at_ep1 = expert_state_bytes(space, mesh)
    return ExpertParallel(
        blocks={m.fqn: list(m.experts) for m in moes},
        routers={m.fqn: m.router for m in moes},
        num_experts=math.gcd(*(m.num_experts for m in moes)),
        top_k=max(m.top_k for m in moes),
        grouped=all(m.grouped for m in moes),
        imbalance=max(ep_cost.imbalance(m.dense) for m in moes),
        all_to_all_s=all_to_all_step_s(expert_ctx(space, mesh), best.stage_plan),
        expert_bytes_per_rank=math.ceil(per_rank),
        expert_bytes_at_ep1=math.ceil(at_ep1),
    )
