"""A rank's memory in a candidate plan: its parameters, gradients and optimizer state after
TP, FSDP and EP (:func:`_local_numel`), and its peak, the larger of the backward's and the
optimizer step's moments plus the allocator's headroom (:mod:`cost_model.peak`), per pipeline
rank (:func:`_memory`). Split from :mod:`planner.score`, which prices the candidate's time and
calls these.
"""

from __future__ import annotations

import math

from autopar.cost_model import MemoryBreakdown, axis_link, memory_per_rank, peak
from autopar.cost_model.estimate import blocking_collective_s
from autopar.ir import Graph
from autopar.planner import ilp, schedules, stages
from autopar.planner.experts import _ep_dp
from autopar.planner.space import _Ctx


def _held_share(ctx: _Ctx, sol: ilp.TPSolution, fqn: str) -> float:
    """The share of a checkpointed layer's held inputs (``Layer.saved_bytes_checkpointed``) one
    TP rank keeps: an input the solution shards (the residual stream between sequence-parallel
    blocks) is 1/tp on each rank, a replicated one whole."""
    held = ctx.space.held_inputs.get(fqn, ())
    total = sum(b for _, b in held)
    if sol.tp == 1 or not total:
        return 1.0
    replicated = ("R", "DR", "RP")
    local = sum(b if sol.layouts.get(x, "R") in replicated else b / sol.tp for x, b in held)
    return local / total


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


def _cp_layer(ctx: _Ctx, fqn: str, micro: int) -> tuple[float, float, float]:
    """Context parallel's cost in layer ``fqn`` for a microbatch of ``micro`` samples: (forward
    all-gather of keys/values, backward reduction of their gradients, bytes of gathered keys and
    values saved for backward beyond the rank's own). Nothing overlaps: the all-gather precedes
    the attention that reads it, so both are blocking collectives
    (:func:`cost_model.estimate.blocking_collective_s`)."""
    kv = ctx.space.kv_bytes.get(fqn, 0)
    if ctx.cp == 1 or not kv:
        return 0.0, 0.0, 0.0
    full = kv * micro / ctx.graph.batch_size / ctx.mesh.tp  # the whole sequence's K/V
    link, device = axis_link(ctx.cluster, ctx.cp_axes, "cp"), ctx.cluster.device
    fwd = blocking_collective_s("all_gather", full, ctx.cp, link, device)
    bwd = blocking_collective_s("reduce_scatter", full, ctx.cp, link, device)
    return fwd, bwd, full * (ctx.cp - 1) / ctx.cp


def _memory(
    ctx: _Ctx,
    sol: ilp.TPSolution,
    plan: stages.StagePlan | None,
    buffers: float,
    rank: int | None = None,
) -> MemoryBreakdown:
    """Memory of pipeline rank ``rank`` of the stage plan ``plan``; without one, of a rank that
    holds every layer (``rank`` unused)."""
    graph, mesh = ctx.graph, ctx.mesh
    if plan is None:
        held = list(range(len(graph.layers)))
        activations = sum(sol.activations(ctx.precision.autocast).values())
    else:
        assert rank is not None, "a stage plan's memory is one pipeline rank's"
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
    if plan is not None:  # the stage plan's activations of the microbatches in flight
        static = memory.params + memory.grads + memory.optimizer
        activations = max(0.0, plan.rank_memory_bytes[rank] - static)
    moment = _step_moment(ctx, sol, plan, held, memory.grads, activations)
    headroom = peak.headroom_bytes(ctx.cluster.device, moment)
    return memory.model_copy(
        update={
            "activations": math.ceil(moment - memory.grads),
            "buffers": memory.buffers + math.ceil(headroom),
        }
    )


def _step_moment(
    ctx: _Ctx,
    sol: ilp.TPSolution,
    plan: stages.StagePlan | None,
    held: list[int],
    grads: float,
    activations: float,
) -> float:
    """The bytes a rank holds at its peak beyond parameters, optimizer state and buffers: the
    larger of the backward's and the optimizer step's moments (:mod:`cost_model.peak`), with
    ``activations`` those of the microbatches in flight on the rank's layers ``held``."""
    graph, mesh = ctx.graph, ctx.mesh
    m = plan.num_microbatches if plan is not None else 1
    micro = ctx.training.global_batch * ctx.cp // max(1, mesh.data_parallel) // m
    last = len(graph.layers) - 1 in held
    # the model's output for one microbatch, on the rank that computes the loss
    output = _output_bytes(graph) * micro / (graph.batch_size * ctx.cp * _loss_tp(ctx))
    output = output if last else 0.0
    pipelined = mesh.pp > 1
    autocast = ctx.precision.autocast
    if m == 1 and not pipelined:
        checkpointed = set(plan.checkpointed) if plan is not None else set()
        local, acts, recompute = [], [], []
        done: dict[tuple, tuple[float, float, float]] = {}  # a run of identical blocks: once
        for i in held:
            x = graph.layers[i]
            # a group's layers cost alike in every solution (space.layer_groups)
            key = (ctx.space.layer_groups[i] if ctx.space.layer_groups else i, i in checkpointed)
            if key not in done:
                full = sol.activations(autocast)[x.fqn]
                full += _cp_layer(ctx, x.fqn, micro)[2] if ctx.cp > 1 else 0.0
                act = full
                if i in checkpointed:  # it holds its inputs; its backward re-runs its forward
                    kept = x.saved_checkpointed(autocast) * micro / (graph.batch_size * ctx.cp)
                    act = min(full, kept * _held_share(ctx, sol, x.fqn))
                trainable = _local_numel(graph, sol, mesh.tp, [i], _ep_dp(mesh))[1]
                done[key] = (trainable, act, full if i in checkpointed else 0.0)
            trainable, act, redo = done[key]
            local.append(trainable)
            acts.append(act)
            recompute.append(redo)
        everything = sum(local)
        share = [grads * n / everything if everything else 0.0 for n in local]
        backward = peak.single_pass_backward_bytes(acts, share, output, recompute)
    else:  # the first microbatch's gradients stay while the next ones' activations are saved
        # (the stage plan's activations hold each in-flight microbatch's loss, LayerCost of the
        # last layer); with return_outputs=False, as the emitted program steps it, a schedule
        # frees a microbatch's output and loss tensors with its backward (1F1B: one at a time;
        # GPipe: the in-flight ones; tests/test_peak.py follows them)
        backward = grads + activations
    largest, trainable = _largest_local_tensor(ctx, sol, held)
    temps = peak.optimizer_temp_bytes(  # AdamW's moments and arithmetic are fp32
        ctx.cluster.device, ctx.training.optimizer, largest * 4, trainable * 4,
        fused=ctx.space.options.system != "autopar",  # the published systems' fused AdamW
    )  # fmt: skip
    # the loop holds its last output through the step; a pipeline's schedule does not
    optimizer = grads + (0.0 if pipelined else output) + temps
    return max(backward, optimizer)


def _loss_tp(ctx: _Ctx) -> int:
    """How many ways TP splits the output the loss reads: autopar's script gathers the head's
    output whole on every TP rank; Megatron-LM's vocab-parallel cross-entropy and torchtitan's
    ``loss_parallel`` keep it sharded over the vocabulary."""
    return 1 if ctx.space.options.system == "autopar" else ctx.mesh.tp


def _output_bytes(graph: Graph) -> float:
    """Bytes of the model's output at the traced batch (what the loss reads)."""
    node = next(n for n in reversed(graph.nodes) if n.kind == "output")
    return float(sum(graph.node(x).out.num_bytes for x in node.inputs if graph.node(x).out))


def _largest_local_tensor(ctx: _Ctx, sol: ilp.TPSolution, held: list[int]) -> tuple[float, float]:
    """(the largest trainable parameter tensor, all trainable parameters) of the rank's layers
    ``held`` in elements, as the rank holds them: TP-sharded modules 1/tp, FSDP shards 1/fsdp,
    experts 1/ep."""
    mesh, space = ctx.mesh, ctx.space
    done: dict[int, tuple[float, float]] = {}  # a group of layers (space.layer_groups): once
    largest = total = 0.0
    for i in held:
        key = space.layer_groups[i] if space.layer_groups else i
        if key not in done:
            sizes = [0.0]
            for module, numel, expert in space.trainable_tensors[i]:
                style = sol.styles.get(module, "")
                local = numel / (mesh.fsdp * (mesh.tp if style and "sequence" not in style else 1))
                sizes.append(local / (_ep_dp(mesh) if expert else 1))
            done[key] = (max(sizes), sum(sizes))
        largest, total = max(largest, done[key][0]), total + done[key][1]
    return largest, total


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
