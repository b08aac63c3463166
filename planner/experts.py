"""Expert parallelism's part of scoring a mesh (ep > 1): the all-to-alls, the busiest rank's
extra expert rows, the experts' share of the parameters and state per rank. The terms and
their assumptions are :mod:`cost_model.experts`'.
"""

from __future__ import annotations

from autopar.cost_model import experts as ep_cost
from autopar.cost_model.estimate import node_forward_time_s
from autopar.ir import Graph, Layer, MoE
from autopar.planner import stages
from autopar.planner.plan import Mesh
from autopar.planner.rules import AXES, CARVED
from autopar.planner.space import _Ctx, _Space

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
    blocks = [
        (m.tokens * scale, m.fanout, m.hidden, ep_cost.imbalance(m.dense))
        for m in ctx.graph.moes_in(layer)
    ]
    return ep_cost.block_all_to_all_s(
        _ep_link(ctx), ctx.mesh.ep, blocks, _act_bytes(ctx), ctx.cluster.device
    )


def _with_experts(
    ctx: _Ctx, layer: Layer, compute_s: float, fwd: float, busy: float, scale: float
) -> tuple[float, float]:
    """(fwd, fwd + bwd) of a layer with its MoE blocks under ep: the busiest rank's extra
    expert rows (``IMBALANCE``) and the all-to-alls, half in forward, half in backward; and,
    for experts in a module list, the runtime's recording pass (:func:`record_pass_s`)."""
    if ctx.mesh.ep == 1 or not ctx.graph.moes_in(layer.fqn):
        return fwd, busy
    moes = ctx.graph.moes_in(layer.fqn)
    flops = max(1, layer.fwd_flops + layer.bwd_flops)
    busiest = sum(
        (m.expert_fwd_flops + m.expert_bwd_flops) * (ep_cost.imbalance(m.dense) - 1) for m in moes
    )
    extra = compute_s * busiest / flops
    a2a = layer_all_to_all_s(ctx, layer.fqn, scale)
    record = sum(record_pass_s(ctx, layer, m, scale) for m in moes if not m.grouped)
    fwd_share = fwd / busy if busy else 1 / 3
    return fwd + extra * fwd_share + a2a / 2 + record, busy + extra + a2a + record


def record_pass_s(ctx: _Ctx, layer: Layer, moe: MoE, scale: float) -> float:
    """The emitted runtime's recording pass of a MoE block whose experts are a module list
    (``autopar_runtime/expert_parallel.py``: the block's forward runs once to note which rows
    each expert gets, the experts answering zeros, then again after the dispatch): the forward
    of the block's own nodes outside the experts (router, top-k, the per-expert row selection,
    the combine) once more, at ``scale`` x the traced batch. ``layer``: the one it runs in."""
    graph, experts = ctx.graph, set(moe.experts)
    nodes = (graph.node(name) for name in layer.nodes)
    return sum(
        node_forward_time_s(graph, n, ctx.cluster.device, ctx.training.dtype, batch_scale=scale)
        for n in nodes
        if n.out is not None and moe.fqn in n.module_stack and not experts & set(n.module_stack)
    )


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
