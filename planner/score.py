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
from dataclasses import dataclass, field

from autopar.cost_model import Cluster, MemoryBreakdown, axis_link, memory_per_rank
from autopar.cost_model import experts as ep_cost
from autopar.cost_model import step as cost
from autopar.cost_model.estimate import collective_time_s
from autopar.cost_model.precision import Precision, precision, shares_tp_block_input
from autopar.ir import Graph, Layer
from autopar.planner import ilp, schedules, stages
from autopar.planner.plan import Mesh, StagePrediction, TimeBreakdown, Training
from autopar.planner.request import (
    AXES,
    CARVED,
    SDPA_OP,
    Options,
    attention_heads,
    cp_rule,
    mesh_rule,
)


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


@dataclass(frozen=True)
class _Space:
    """What every mesh of one search shares."""

    graph: Graph
    cluster: Cluster
    training: Training
    options: Options
    heads: set[int]
    out_bytes: dict[str, int]
    """layer -> bytes later layers read from it (traced batch)."""
    tensors: dict[str, int]
    """layer -> number of trainable parameter tensors (the optimizer's)."""
    tied: tuple[str, str] | tuple[()]
    """two layers that read one parameter, or ()."""
    root_layers: frozenset[int]
    """indices of the layers whose parameters the root FSDP unit holds (``_root_layers``)."""
    param_tensors: int
    """parameter tensors of the whole model (every module's direct parameters)."""
    collapsed: ilp.Collapsed
    shard_tp: bool = False
    """tp was pinned: the ILP shards every module that can be sharded at that degree."""
    kv_bytes: dict[str, int] = field(default_factory=dict)
    """layer -> bytes of the keys and values its attention calls read (traced batch): what
    context parallelism exchanges."""
    cuts: stages.Cuts | None = None
    """where the layers can be cut into pipeline stages (None: at every layer)."""
    held_inputs: dict[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)
    """layer -> what a checkpoint of it holds (:func:`_held_inputs`)."""
    solvers: dict[int, ilp.Solver] = field(default_factory=dict)
    """the intra-layer ILP per tp degree, built on first use: this search's, and only its."""

    cp_whys: dict[int, str | None] = field(default_factory=dict)
    """cp degree -> :func:`cp_rule` of this graph and sequence length (a walk of the graph)."""

    def cp_why(self, cp: int) -> str | None:
        if cp not in self.cp_whys:
            self.cp_whys[cp] = cp_rule(self.graph, self.training.seq_len, cp)
        return self.cp_whys[cp]

    def solver(self, tp: int) -> ilp.Solver:
        if tp not in self.solvers:
            self.solvers[tp] = ilp.Solver(self.graph, tp, self.collapsed)
        return self.solvers[tp]

    @property
    def ilp_solves(self) -> int:
        return sum(s.solves for s in self.solvers.values())


def make_space(
    graph: Graph,
    cluster: Cluster,
    training: Training,
    options: Options,
    shard_tp: bool = False,
    cuts: stages.Cuts | None = None,
) -> _Space:
    """What every mesh of one search shares (``shard_tp``: the user pinned tp; ``cuts``: where
    the model can be cut into pipeline stages)."""
    collapsed = ilp.collapse(graph)
    return _Space(
        graph=graph,
        cluster=cluster,
        training=training,
        options=options,
        heads=attention_heads(graph),
        out_bytes=_layer_out_bytes(graph),
        tensors={x.fqn: len(_layer_tensors(graph, x, trainable=True)) for x in graph.layers},
        tied=_tied_layers(graph),
        root_layers=_root_layers(graph),
        param_tensors=sum(len(m.params) for m in graph.modules.values()),
        collapsed=collapsed,
        shard_tp=shard_tp,
        kv_bytes=_kv_bytes(graph),
        cuts=cuts,
        held_inputs=_held_inputs(graph, collapsed),
    )


def _held_inputs(graph: Graph, collapsed: ilp.Collapsed) -> dict[str, tuple[tuple[str, int], ...]]:
    """Layer -> the tensors it reads from outside itself (what a checkpoint of it keeps for the
    recompute; parameters and buffers aside): each as its producer's name in the ILP's collapsed
    graph (a layer of a run of identical layers reads its predecessor's output, whose layout
    the TP solution gives under the first layer's node names) and its bytes at the traced
    batch."""
    rename: dict[str, str] = {}
    for rep, fqns in collapsed.members.items():
        for fqn in fqns:
            rename.update(zip(graph.layer(fqn).nodes, graph.layer(rep).nodes))
    out = {}
    for layer in graph.layers:
        own, held = set(layer.nodes), {}
        for name in layer.nodes:
            for x in graph.node(name).inputs:
                node = graph.node(x)
                if x in own or x in held or node.kind in ("param", "buffer") or node.out is None:
                    continue
                held[x] = (rename.get(x, x), node.out.num_bytes)
        out[layer.fqn] = tuple(held.values())
    return out


def _held_share(ctx: _Ctx, sol: ilp.TPSolution, fqn: str) -> float:
    """The share of a checkpointed layer's held inputs (``Layer.saved_bytes_checkpointed``) one
    TP rank keeps: an input the solution shards (the residual stream between sequence-parallel
    blocks) is 1/tp on each rank, a replicated one whole."""
    held = ctx.space.held_inputs.get(fqn, ())
    total = sum(b for _, b in held)
    if sol.tp == 1 or not total:
        return 1.0
    replicated = ("R", "DR")
    local = sum(b if sol.layouts.get(x, "R") in replicated else b / sol.tp for x, b in held)
    return local / total


def _kv_bytes(graph: Graph) -> dict[str, int]:
    """Layer -> bytes of keys + values read by its SDPA calls at the traced batch."""
    out: dict[str, int] = {}
    for n in graph.nodes:
        if n.op == SDPA_OP:
            k, v = (graph.node(ref).out for ref in n.inputs[1:3])
            out[n.layer] = out.get(n.layer, 0) + k.num_bytes + v.num_bytes
    return out


def fold_cp(mesh: Mesh) -> Mesh:
    """``mesh`` with its cp ranks counted as FSDP shards, for the parameter, gradient and
    optimizer terms: the emitted program shards parameters over fsdp x cp (torchtitan's
    dp_shard_cp), replicated over dp (HSDP)."""
    if mesh.cp == 1:
        return mesh
    return mesh.model_copy(update={"fsdp": mesh.fsdp * mesh.cp, "cp": 1})


@dataclass(frozen=True)
class _Ctx:
    """What every layer cost of one mesh shares."""

    space: _Space
    mesh: Mesh
    axes: list[tuple[str, int]]
    sync_rate: float
    offload: bool = False
    """FSDP2 CPU offload: parameters, gradients and optimizer state in host memory."""
    cp: int = 1
    """context-parallel degree (``mesh`` is then :func:`fold_cp`'s: cp counted as data ranks)."""
    cp_axes: tuple[tuple[str, int], ...] = ()
    """the unfolded mesh's axes (where the cp group's link is read)."""

    @property
    def graph(self) -> Graph:
        return self.space.graph

    @property
    def cluster(self) -> Cluster:
        return self.space.cluster

    @property
    def training(self) -> Training:
        return self.space.training

    @property
    def precision(self) -> Precision:
        """The precision regime of this mesh (cost_model.precision: what the trained program
        holds and moves in which dtype)."""
        return precision(self.training.dtype, self.mesh, self.space.options.system)

    def solution(self, batch: int) -> ilp.TPSolution:
        """The ILP's answer for a local batch of ``batch`` samples (its solver caches it)."""
        inputs = ilp.CostInputs(
            tp=self.mesh.tp,
            batch_scale=batch / (self.graph.batch_size * self.cp),
            device=self.cluster.device,
            dtype=self.training.dtype,
            tp_link=axis_link(self.cluster, self.axes, "tp"),
            grad_sync_s_per_byte=self.sync_rate,
            shard_all=self.space.shard_tp and self.mesh.tp > 1,
            shared_input=shares_tp_block_input(self.space.options.system),
        )
        return self.space.solver(self.mesh.tp).solve(inputs)


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
    why = mesh_rule(mesh, training.global_batch, space.heads, space.tied, space.cp_why, graph)
    if why is not None:
        return Candidate(mesh, math.inf, empty, False, why)
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
    if static_floor > cluster.device.memory_bytes and not offload:
        why = (
            f"parameters, gradients and optimizer state alone need at least "
            f"{static_floor / 1e9:.1f} GB per device, more than its "
            f"{cluster.device.memory_bytes / 1e9:.1f} GB"
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
    big = max(
        (_gathered(graph, x, mesh.ep) for i, x in enumerate(graph.layers) if i not in root),
        key=lambda n: regime.fsdp_unit_bytes(*n),
        default=(0, 0),
    )
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

    # every layer's fwd + bwd for the whole per-replica batch, spread evenly over the pipeline
    # ranks, is a lower bound of the step (microbatching, bubbles, recompute only add); so is
    # cp's K/V traffic for that batch (exposed, and per-microbatch latencies only add)
    floor_s = (whole.compute_s + whole.comm_s + _cp_comm_s(ctx, per_replica)) / mesh.pp
    if floor_s >= bound:
        memory = _memory(ctx, whole, None, buffers)
        return Candidate(real, floor_s, memory, False, None, pruned=True)
    if limit <= 0:
        memory = _memory(ctx, whole, None, buffers)
        why = (
            f"buffers alone ({buffers / 1e9:.1f} GB: gradient buckets, gathered FSDP units, "
            f"reserve) exceed the device's {cluster.device.memory_bytes / 1e9:.1f} GB"
        )
        return Candidate(real, math.inf, memory, False, None, stage_error=why)
    try:
        plan, runtime_s = _stage_plan(ctx, costs_for, per_replica, limit, options, bound)
    except stages.BoundExceeded as e:  # a step >= the stage search's floor: cannot win
        memory = _memory(ctx, whole, None, buffers)
        return Candidate(real, max(floor_s, e.floor), memory, False, None, pruned=True)
    except (stages.StageError, stages.ScheduleError) as e:
        memory = _memory(ctx, whole, None, buffers)
        why = None if isinstance(e, stages.StageError) else str(e)
        return Candidate(real, math.inf, memory, False, why, stage_error=str(e))
    micro = per_replica // plan.num_microbatches
    sol = ctx.solution(micro)
    details = _stage_details(plan, costs_for(micro), mesh.pp)
    time_parts = _time_parts(ctx, sol, plan, runtime_s, details, _cp_comm_s(ctx, micro))
    memory = _memory(ctx, sol, plan, buffers)
    fits = memory.total <= cluster.device.memory_bytes
    rank_memory = tuple(_memory(ctx, sol, plan, buffers, r) for r in range(mesh.pp))
    return Candidate(
        real, time_parts.total, memory, fits, None, time_parts, sol, plan,
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
                rank=schedules.stage_rank(plan.schedule, pp, j),
                fwd_s=sum(c.fwd_s for c in layers),
                bwd_s=sum(c.bwd_s for c in layers),
                bwd_weight_s=sum(c.bwd_weight_s for c in layers),
                recompute_s=sum(costs[i].fwd_s for i in plan.checkpointed if a <= i < b),
                memory_bytes=math.ceil(plan.stage_memory_bytes[j]),
                in_flight=plan.stage_in_flight[j],
            )
        )
    return tuple(out)


def _stage_plan(
    ctx: _Ctx, costs_for, per_replica: int, limit: float, options: Options, bound: float = math.inf
):
    """pp = 1: one stage (:func:`_accumulation_plan`); else the best schedule and microbatch
    count (:func:`planner.stages.best_schedule`; stages.BoundExceeded where no candidate can
    beat ``bound``)."""
    pp = ctx.mesh.pp
    if pp == 1:
        return _accumulation_plan(costs_for, per_replica, limit, options), 0.0
    link = axis_link(ctx.cluster, ctx.axes, "pp")
    choices = (
        [options.microbatches] if options.microbatches else _microbatch_choices(per_replica, pp)
    )
    if options.microbatches and per_replica % options.microbatches:
        raise stages.ScheduleError(
            f"--microbatches {options.microbatches} does not divide the per-replica batch "
            f"{per_replica}"
        )
    best, tried = stages.best_schedule(
        costs_for,
        num_stages=pp,
        global_batch_per_dp=per_replica,
        mem_limit_bytes=limit,
        schedules=schedules.searched(ctx.mesh.data_parallel, options.schedule),
        microbatch_choices=choices,
        checkpoint=options.checkpoint,
        p2p_s_per_byte=1 / link.bandwidth_bytes_per_s,
        p2p_latency_s=link.latency_s,
        overhead_s=lambda plan: _runtime_overhead_s(ctx, plan),
        cuts=ctx.space.cuts,
        bound=bound,
    )
    ranked = next(c for c in tried if c.plan is best)  # its step time counts the overhead
    return best, ranked.step_time_s - best.step_time_s


def _accumulation_plan(costs_for, per_replica: int, limit: float, options: Options):
    """pp = 1: checkpointing and the gradient accumulation steps (microbatches run one after
    another, one in flight). The whole per-replica batch at once unless it does not fit or
    needs checkpointing; then more accumulation steps (divisors of the batch, up to 8, up to the
    first count that needs no checkpointing) are tried and the fastest kept. ``--microbatches N`` pins the count."""

    def one(m: int) -> stages.StagePlan:
        return stages.partition(
            costs_for(per_replica // m),
            num_stages=1,
            num_microbatches=m,
            mem_limit_bytes=limit,
            schedule="gpipe" if m == 1 else "1f1b",  # one stage: both hold one microbatch
            checkpoint=options.checkpoint,
        )

    if options.microbatches is not None:
        if per_replica % options.microbatches:
            raise stages.ScheduleError(
                f"--microbatches {options.microbatches} does not divide the per-replica batch "
                f"{per_replica}"
            )
        return one(options.microbatches)
    try:
        whole = one(1)
    except stages.StageError as e:
        whole, error = None, e
    if whole is not None and not whole.checkpointed:
        return whole
    tried = [whole] if whole is not None else []
    for m in range(2, min(per_replica, 8) + 1):
        if per_replica % m == 0:
            try:
                tried.append(one(m))
            except stages.StageError:
                continue
            if not tried[-1].checkpointed:  # more steps would only add per-step overhead
                break
    if not tried:
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


def _local_numel(
    graph: Graph, sol: ilp.TPSolution, tp: int, held, ep_dp: int = 1
) -> tuple[float, float]:
    """(parameters, of which trainable) per rank of the layers at indices ``held``, after
    tensor parallelism (the styles shard their modules' parameters tp ways), before FSDP. A
    layer's frozen parameters are taken to shard like its trainable ones. Under expert
    parallelism, the experts' share carved from dp (``ep_dp``, :func:`cost_model.experts.
    ep_split`) divides their parameters further (ep runs with tp = 1)."""
    numel = trainable = 0.0
    for i in held:
        layer = graph.layers[i]
        if not layer.param_numel:
            continue
        sharded = sol.layer_sharded_param_bytes[layer.fqn]
        local = (sharded / tp + layer.param_bytes - sharded) / layer.param_bytes
        numel += local * layer.param_numel
        trainable += local * layer.trainable_numel
        if ep_dp > 1:
            experts = sum(m.expert_param_numel for m in graph.moes_in(layer.fqn))
            numel -= experts * (1 - 1 / ep_dp)
            trainable -= min(experts, layer.trainable_numel) * (1 - 1 / ep_dp)
    return numel, trainable


def _layer_costs(
    ctx: _Ctx, sol: ilp.TPSolution, micro: int, exposed_dp: float
) -> list[stages.LayerCost]:
    """One LayerCost per layer for one microbatch of ``micro`` samples on one rank."""
    graph, mesh = ctx.graph, ctx.mesh
    scale = micro / (graph.batch_size * ctx.cp)  # a rank's share of the tokens
    regime, optimizer = ctx.precision, ctx.training.optimizer
    total_local = max(1.0, _tp_local_bytes(graph, sol, mesh.tp))
    costs = []
    for i, layer in enumerate(graph.layers):
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
        fwd += cp_fwd
        busy += cp_fwd + cp_bwd
        fwd, busy = _with_experts(ctx, layer, part.compute_s, fwd, busy, scale)
        costs.append(
            stages.LayerCost(
                fwd_s=fwd,
                bwd_s=busy - fwd,
                # assumption: the weight-gradient half of a matmul layer's backward
                bwd_weight_s=(busy - fwd - cp_bwd) / 2,
                act_bytes=sol.activation_bytes[layer.fqn] + kv_saved,
                recompute_s=fwd + cost.checkpoint_overhead_s(ctx.cluster.device),
                act_ckpt_bytes=layer.saved_bytes_checkpointed
                * scale
                * _held_share(ctx, sol, layer.fqn),
                static_bytes=0.0
                if ctx.offload
                else regime.static_bytes(numel, trainable, optimizer),
                out_bytes=ctx.space.out_bytes[layer.fqn] * scale,
                grad_sync_s=exposed_dp * share,
                optimizer_s=(
                    cost.offloaded_optimizer_s(numel, trainable, regime)
                    if ctx.offload
                    else _optimizer_s(ctx, trainable, ctx.space.tensors[layer.fqn])
                ),
            )
        )
    return costs


def _cp_layer(ctx: _Ctx, fqn: str, micro: int) -> tuple[float, float, float]:
    """Context parallel's cost in layer ``fqn`` for a microbatch of ``micro`` samples: (forward
    all-gather of keys/values, backward reduction of their gradients, bytes of gathered keys and
    values saved for backward beyond the rank's own). Nothing overlaps: the all-gather precedes
    the attention that reads it."""
    kv = ctx.space.kv_bytes.get(fqn, 0)
    if ctx.cp == 1 or not kv:
        return 0.0, 0.0, 0.0
    full = kv * micro / ctx.graph.batch_size / ctx.mesh.tp  # the whole sequence's K/V
    link = axis_link(ctx.cluster, ctx.cp_axes, "cp")
    fwd = collective_time_s("all_gather", full, ctx.cp, link)
    bwd = collective_time_s("reduce_scatter", full, ctx.cp, link)
    return fwd, bwd, full * (ctx.cp - 1) / ctx.cp


def _cp_comm_s(ctx: _Ctx, micro: int) -> float:
    """Context parallel's exposed traffic per microbatch of ``micro`` samples, all layers."""
    return sum(sum(_cp_layer(ctx, x.fqn, micro)[:2]) for x in ctx.graph.layers)


def _optimizer_s(ctx: _Ctx, numel: float, num_tensors: int) -> float:
    """The optimizer step on ``numel`` trainable parameters in ``num_tensors`` tensors."""
    return cost.optimizer_s(
        ctx.cluster.device, ctx.training.optimizer, numel, num_tensors, ctx.mesh.fsdp,
        ctx.precision,
    )  # fmt: skip


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
    return TimeBreakdown(
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
            if schedules.stage_rank(plan.schedule, mesh.pp, j) == rank
            for i in range(a, b)
        ]
        activations = 0.0
    numel, trainable = _local_numel(graph, sol, mesh.tp, held, _ep_dp(mesh))
    memory = memory_per_rank(
        param_numel=numel / mesh.fsdp,
        trainable_numel=trainable / mesh.fsdp,
        precision=ctx.precision,
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


def _layer_tensors(graph: Graph, layer: Layer, trainable: bool = False) -> list[str]:
    """FQNs of the layer's parameter tensors (``trainable``: those that require grad)."""
    if not layer.is_module:
        return []
    prefix = layer.fqn + "." if layer.fqn else ""
    return [
        f"{fqn}.{name}"
        for fqn, info in graph.modules.items()
        if fqn == layer.fqn or fqn.startswith(prefix)
        for name in info.params
        if not (trainable and name in info.frozen)
    ]


def _root_unit_bytes(ctx: _Ctx, sol: ilp.TPSolution, big: tuple[float, float]) -> float:
    """What the root FSDP unit adds to the buffers: the parameters of the layers it holds
    (``_root_layers``), which FSDP2 gathers at the root's forward and frees only after its
    backward (the root does not reshard after forward), so they stay whole for the whole step;
    and, where the root's own end-of-backward transient (its unsharded gradients and their
    reduce-scatter input) beats the largest other unit's (``big``, counted already), the
    difference."""
    mesh, regime = ctx.mesh, ctx.precision
    if not ctx.space.root_layers or not regime.wraps_in_fsdp(mesh):
        return 0.0
    numel, trainable = _local_numel(ctx.graph, sol, mesh.tp, sorted(ctx.space.root_layers))
    resident = numel * regime.gather
    own = regime.fsdp_unit_bytes(numel, trainable) - resident
    return resident + max(0.0, own - regime.fsdp_unit_bytes(*big) / mesh.tp)


def _root_layers(graph: Graph) -> frozenset[int]:
    """Indices of the layers whose parameters FSDP2's root unit holds, as the emitted program
    wraps them (autopar_runtime.fsdp_units): layers that are not modules, and layers that read
    a parameter another layer reads too (a tied weight; FSDP2 manages a tensor in one unit
    only). Each parameter counts once (``Layer.param_numel``: in its first layer)."""
    shared = {x for layers in _param_readers(graph).values() if len(layers) > 1 for x in layers}
    return frozenset(
        i for i, x in enumerate(graph.layers) if not x.is_module or not x.fqn or x.fqn in shared
    )


def _param_readers(graph: Graph) -> dict[str, set[str]]:
    """Parameter FQN -> the layers whose ops read it (two or more: a tied weight)."""
    readers: dict[str, set[str]] = {}
    for n in graph.nodes:
        if n.kind == "compute":
            for p in n.params:
                readers.setdefault(p, set()).add(n.layer)
    return readers


def _tied_layers(graph: Graph) -> tuple[str, str] | tuple[()]:
    """Two layers that read one parameter (tied weights), or () when none do."""
    for layers in _param_readers(graph).values():
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


# --- expert parallelism (cost_model.experts has the terms and their assumptions) ---


def _gathered(graph: Graph, layer: Layer, ep: int) -> tuple[float, float]:
    """(parameters, of which trainable) of the layer's FSDP unit as one rank gathers it: its
    experts 1/ep of them under expert parallelism."""
    experts = sum(m.expert_param_numel for m in graph.moes_in(layer.fqn)) * (1 - 1 / ep)
    trainable = layer.trainable_numel - min(experts, layer.trainable_numel)
    return layer.param_numel - experts, trainable


def _ep_dp(mesh: Mesh) -> int:
    """The ep ranks carved from the replicate axis: what divides the experts' parameters
    beyond FSDP (1 without ep)."""
    return ep_cost.ep_split(mesh.ep, mesh.dp, mesh.fsdp)[0] if mesh.ep > 1 else 1


def _expert_floor_share(graph: Graph, mesh: Mesh) -> float:
    """The static floor's factor under ep: expert parameters also divided by ep_dp."""
    ep_dp = _ep_dp(mesh)
    if ep_dp == 1 or not graph.num_params:
        return 1.0
    return 1 - graph.expert_param_numel / graph.num_params * (1 - 1 / ep_dp)


def _act_bytes(ctx: _Ctx) -> int:
    return 2 if ctx.training.dtype == "bf16" else 4


def _ep_link(ctx: _Ctx):
    m = ctx.mesh
    return ep_cost.ep_link(ctx.cluster, m.ep, m.dp, m.fsdp, m.tp)


def layer_all_to_all_s(ctx: _Ctx, layer: str, scale: float) -> float:
    """All-to-all seconds of one microbatch (``scale`` x the traced batch) through the MoE
    blocks of ``layer``, forward and backward (0 without ep)."""
    if ctx.mesh.ep == 1:
        return 0.0
    blocks = [(m.tokens * scale, m.top_k, m.hidden) for m in ctx.graph.moes_in(layer)]
    return ep_cost.block_all_to_all_s(_ep_link(ctx), ctx.mesh.ep, blocks, _act_bytes(ctx))


def _with_experts(
    ctx: _Ctx, layer: Layer, compute_s: float, fwd: float, busy: float, scale: float
) -> tuple[float, float]:
    """(fwd, fwd + bwd) of a layer with its MoE blocks under ep: the busiest rank's extra
    expert rows (``IMBALANCE``) and the all-to-alls, half in forward, half in backward."""
    if ctx.mesh.ep == 1 or not ctx.graph.moes_in(layer.fqn):
        return fwd, busy
    moes = ctx.graph.moes_in(layer.fqn)
    flops = max(1, layer.fwd_flops + layer.bwd_flops)
    expert_share = sum(m.expert_fwd_flops + m.expert_bwd_flops for m in moes) / flops
    extra = compute_s * expert_share * (ep_cost.IMBALANCE - 1)
    a2a = layer_all_to_all_s(ctx, layer.fqn, scale)
    fwd_share = fwd / busy if busy else 1 / 3
    return fwd + extra * fwd_share + a2a / 2, busy + extra + a2a


def all_to_all_step_s(ctx: _Ctx, plan: stages.StagePlan) -> float:
    """All-to-all seconds per step on the busiest pipeline rank: every microbatch through its
    stage's MoE blocks (an even share of them across pipeline ranks)."""
    if ctx.mesh.ep == 1:
        return 0.0
    per_replica = ctx.training.global_batch // ctx.mesh.data_parallel
    scale = per_replica / plan.num_microbatches / ctx.graph.batch_size
    per_micro = sum(layer_all_to_all_s(ctx, x.fqn, scale) for x in ctx.graph.layers)
    return per_micro * plan.num_microbatches / ctx.mesh.pp


def expert_ctx(space: _Space, mesh: Mesh) -> _Ctx:
    """A layer-cost context of ``mesh`` for the expert figures a plan records."""
    return _Ctx(space, mesh, [(a, getattr(mesh, a)) for a in AXES if a not in CARVED], 0.0)


def expert_state_bytes(space: _Space, mesh: Mesh) -> tuple[float, float]:
    """(expert parameters + gradients + optimizer state per rank at this mesh, the same at
    ep = 1): an even share of the experts per pipeline rank, FSDP over fsdp, ep_dp beyond."""
    ctx = expert_ctx(space, mesh)
    numel = space.graph.expert_param_numel / mesh.pp / mesh.fsdp
    at_ep1 = ctx.precision.static_bytes(numel, numel, space.training.optimizer)
    ep_dp = _ep_dp(mesh)
    return at_ep1 / ep_dp, at_ep1
