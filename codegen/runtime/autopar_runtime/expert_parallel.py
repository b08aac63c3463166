"""Expert parallel: each MoE block's stacked experts split over the ep ranks, tokens sent to them
by all-to-all.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard

from .common import Constants, fail, has_submodule, say
from .data_parallel import mixed_precision_policy

__all__ = [
    "ExpertParallel",
    "check_experts",
    "apply_expert_parallel",
    "ScaleGrad",
    "local_experts",
    "ep_forward",
    "expert_report",
]


# EXPERT_PARALLEL (ep > 1): each MoE block's experts module (one module holding the experts'
# weights stacked, first dim = experts, called as experts(hidden [N, h], top_k_index [N, k],
# top_k_weights [N, k]) -> [N, h]: HF transformers' Mixtral/Qwen3-MoE/DeepSeek-V3 experts) keeps
# only its ep rank's E/ep experts on each rank. The ep ranks are carved out of the data-parallel
# ranks (dp x fsdp, each training on its own samples): data-parallel rank d is ep rank d % ep of
# ep group d // ep. Its forward (ep_forward) sends each (token, slot) route to the rank owning
# its expert (expert // (E/ep)), tokens sorted by owner, with autograd-aware all-to-alls on the
# ep group; the owner runs its local experts on the rows it received (weight 1), the outputs go
# back by the reverse all-to-all and are combined on the sending rank with the routing weights
# (so the router's gradients stay local). Gradients: the other parameters sync over all dp x fsdp
# ranks as before; an expert's gradient at its owner already sums the contributions of its ep
# group's samples, so each experts module is its own FSDP2 unit over the ranks holding the same
# experts (dp x fsdp / ep of them: "ep_replicas"), which divides by their count, and ep_forward
# scales the experts' parameter gradients by 1/ep more (ScaleGrad; FSDP2's own divide factor
# needs PREMUL_SUM, which gloo lacks): the mean over every data-parallel rank's loss, as the
# single process computes it.
# Each stacked expert weight is a DTensor of the whole model's shape (all E experts), Shard(0)
# over the ep dim (FSDP2 then shards its local part over ep_replicas: a 2-D DTensor, as FSDP
# over TP makes), so everything that handles TP-sharded weights handles experts too: DCP
# checkpoints store every expert once and reshard them into another plan (ep=2 -> ep=1 and
# back), --save-hf gathers whole expert tensors, --init-from reads each rank's experts, and
# --verify compares whole tensors. ep_forward runs the module's own forward on the local
# experts (the DTensors' local parts, to_local: gradients flow back to the DTensors).
class ExpertParallel:
    """The ep groups and this rank's place in them (one per run; see above)."""

    def __init__(self, c: Constants, device_type: str) -> None:
        self.ep = c.EXPERT_PARALLEL["ep"]
        self.num_experts = c.EXPERT_PARALLEL["num_experts"]
        ranks = torch.arange(dist.get_world_size())
        shape = (c.MESH["pp"], c.data_parallel // self.ep, self.ep)  # tp = cp = 1 (ep_rule)
        self.mesh = DeviceMesh(
            device_type, ranks.reshape(shape), mesh_dim_names=("pp", "ep_replicas", "ep")
        )
        self.group = self.mesh["ep"].get_group()
        self.rank = self.mesh["ep"].get_local_rank()
        self.local = self.num_experts // self.ep
        self.rows_sent = [0, 0]  # routes sent to other ep ranks, all routes (this rank)
        self.shapes: dict[str, tuple] = {}  # local shapes of the split expert weights


_EP: ExpertParallel | None = None


def check_experts(c: Constants, model: nn.Module) -> None:
    """Each experts module the plan splits exists, stacks its weights (first dim = experts) and
    is called with (hidden, top_k_index, top_k_weights): one line, exit 2, before any collective."""
    e = c.EXPERT_PARALLEL["num_experts"]
    for fqn in c.EXPERT_PARALLEL["experts"]:
        if not has_submodule(model, fqn):
            continue  # held by another pipeline stage, or missing (check_fqns)
        module = model.get_submodule(fqn)
        params = list(module.named_parameters())
        odd = [n for n, p in params if p.dim() < 1 or p.shape[0] != e]
        call = inspect.signature(type(module).forward).parameters
        if not params or odd or len(call) < 4:
            fail(
                f"expert parallel: {fqn} ({type(module).__name__}) is not an experts module "
                f"with its {e} experts' weights stacked (first dim {e}; "
                f"{odd[0] if odd else 'forward'} is not) and called as experts(hidden, "
                "top_k_index, top_k_weights): plan with --mesh ep=1"
            )


def apply_expert_parallel(c: Constants, model: nn.Module, mesh: DeviceMesh) -> None:
    """Keep this rank's experts of each planned experts module (on meta: each stacked weight
    becomes a DTensor of all E experts, Shard(0) over ep, holding E/ep here), route its
    forward through ep_forward, and make it an FSDP2 unit over the ranks holding the same
    experts (before apply_data_parallel, which leaves it alone)."""
    global _EP
    if _EP is None:
        _EP = ExpertParallel(c, mesh.device_type)
    ep = _EP
    options = {}
    if mixed_precision_policy(c):
        options["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for fqn in c.EXPERT_PARALLEL["experts"]:
        if not has_submodule(model, fqn):
            continue
        module = model.get_submodule(fqn)
        for name, p in list(module.named_parameters(recurse=False)):
            local = torch.empty((ep.local, *p.shape[1:]), dtype=p.dtype, device="meta")
            whole = DTensor.from_local(
                local, ep.mesh["ep"], [Shard(0)], run_check=False, shape=p.shape,
                stride=p.stride(),
            )  # fmt: skip
            setattr(module, name, nn.Parameter(whole, requires_grad=p.requires_grad))
            ep.shapes[f"{fqn}.{name}"] = tuple(local.shape)
        if hasattr(module, "num_experts"):
            module.num_experts = ep.local
        module.forward = functools.partial(ep_forward, ep, local_experts(module))
        fully_shard(module, mesh=ep.mesh["ep_replicas"], **options)


class ScaleGrad(torch.autograd.Function):
    """The identity forward, the gradient times ``scale`` backward."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def local_experts(module: nn.Module) -> Callable[..., torch.Tensor]:
    """``module``'s own forward, run with its parameters' local experts: each DTensor (all E
    experts, this rank's E/ep held; FSDP2 has gathered them over ep_replicas by then) is
    replaced by its local part for the call, differentiably (to_local), then put back."""
    forward = module.forward

    def run(*args):
        held = dict(module._parameters)
        for name, p in held.items():
            if isinstance(p, DTensor):
                module._parameters[name] = p.to_local()
        try:
            return forward(*args)
        finally:
            module._parameters.update(held)

    return run


def ep_forward(
    ep: ExpertParallel,
    local_forward: Callable[..., torch.Tensor],
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The experts module's forward under expert parallelism (see above): the same output as
    the whole module's for this rank's tokens."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    def exchange(x, out_sizes, in_sizes):  # rows, with gradients sent back in backward
        return wait_tensor(all_to_all_single_autograd(x, out_sizes, in_sizes, ep.group))

    n, k = top_k_index.shape
    routes = top_k_index.reshape(-1)
    owner = routes // ep.local
    order = torch.argsort(owner, stable=True)
    send = torch.bincount(owner, minlength=ep.ep)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=ep.group)
    send_sizes, recv_sizes = send.tolist(), recv.tolist()
    ep.rows_sent[0] += len(routes) - send_sizes[ep.rank]
    ep.rows_sent[1] += len(routes)
    ids = routes.new_empty(sum(recv_sizes))
    dist.all_to_all_single(ids, (routes % ep.local)[order], recv_sizes, send_sizes, ep.group)
    rows = exchange(hidden[order // k], recv_sizes, send_sizes)
    # The experts' parameter gradients scaled by 1/ep (FSDP2 divides by the ep_replicas count;
    # see above), their input gradients not: the experts are linear in the output gradient.
    rows = ScaleGrad.apply(rows, float(ep.ep))
    out = local_forward(rows, ids[:, None], top_k_weights.new_ones((len(ids), 1)))
    out = ScaleGrad.apply(out, 1.0 / ep.ep)
    back = exchange(out, send_sizes, recv_sizes)
    back = back[torch.argsort(order)].view(n, k, -1)
    return (back * top_k_weights[..., None].to(back.dtype)).sum(1).to(hidden.dtype)


def expert_report() -> None:
    """Rank 0 prints which experts each rank held and how many routes crossed ranks (the
    all-to-all's work); every rank takes part."""
    if _EP is None:
        return
    held = [None] * dist.get_world_size()
    dist.all_gather_object(held, (_EP.rank, _EP.rows_sent, _EP.shapes))
    sent = sum(h[1][0] for h in held)
    total = sum(h[1][1] for h in held)
    for rank, (ep_rank, _, shapes) in enumerate(held):
        first = ep_rank * _EP.local
        text = ", ".join(f"{n} {tuple(s)}" for n, s in list(shapes.items())[:2])
        say(f"expert parallel: rank {rank} holds experts {first}-{first + _EP.local - 1} of "
            f"{_EP.num_experts}: {text}")  # fmt: skip
    say(f"expert parallel: {sent} of {total} routes sent to another ep rank by all-to-all")
