"""Expert parallel: each MoE block's experts (stacked in one module, or a module list's, one
module each) split over the ep ranks, tokens sent to them by all-to-all.
"""

from __future__ import annotations

import copy
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
    "active_expert_parallel",
    "check_experts",
    "apply_expert_parallel",
    "ScaleGrad",
    "local_experts",
    "ep_forward",
    "expert_report",
    "ListedExperts",
    "listed_containers",
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


def active_expert_parallel() -> ExpertParallel | None:
    """This run's ep groups, where the plan has ep > 1 (set by apply_expert_parallel)."""
    return _EP


def check_experts(c: Constants, model: nn.Module) -> None:
    """Each experts module the plan splits exists, stacks its weights (first dim = experts) and
    is called with (hidden, top_k_index, top_k_weights): one line, exit 2, before any collective."""
    e = c.EXPERT_PARALLEL["num_experts"]
    listed = listed_containers(c, model)
    for fqn in c.EXPERT_PARALLEL["experts"]:
        if not has_submodule(model, fqn) or fqn.rpartition(".")[0] in listed:
            continue  # held by another pipeline stage, or missing (check_fqns); or listed
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
    listed = listed_containers(c, model)
    for fqn in listed:
        _apply_listed(ep, model, fqn, options)
    for fqn in c.EXPERT_PARALLEL["experts"]:
        if not has_submodule(model, fqn) or fqn.rpartition(".")[0] in listed:
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
    n, k = top_k_index.shape
    routes = top_k_index.reshape(-1)
    send_sizes, recv_sizes, ids, rows, order = _send(ep, routes, hidden.repeat_interleave(k, 0))
    # The experts' parameter gradients scaled by 1/ep (FSDP2 divides by the ep_replicas count;
    # see above), their input gradients not: the experts are linear in the output gradient.
    rows = ScaleGrad.apply(rows, float(ep.ep))
    out = local_forward(rows, ids[:, None], top_k_weights.new_ones((len(ids), 1)))
    out = ScaleGrad.apply(out, 1.0 / ep.ep)
    back = _exchange(ep, out, send_sizes, recv_sizes)
    back = back[torch.argsort(order)].view(n, k, -1)
    return (back * top_k_weights[..., None].to(back.dtype)).sum(1).to(hidden.dtype)


# Experts in a module list (nn.ModuleList of E expert modules, one each, called from the MoE
# block's own loop: ``for i, expert in enumerate(self.experts): ... expert(x[rows])``): each
# rank keeps the modules of its E/ep experts (an FSDP2 unit each, over ep_replicas, as above;
# their parameter names stay the single-process model's, so DCP and --save-hf see every expert
# once, held by its owners), the others' places hold a parameter-less stand-in (_Elsewhere).
# The block's forward runs twice, the user's code unchanged (record and replay):
# 1. record: the list's entries answer each call expert(x) by noting (expert, the rows of x)
#    and returning zeros (the output's shape from a meta copy of an expert); the block's output
#    is dropped, and the random state is restored after it (a noisy router draws alike twice);
# 2. dispatch: every noted row goes to its expert's owner in one all-to-all (autograd-aware,
#    as ep_forward), each owner runs each of its experts once on the rows it got (an expert
#    computes each row from that row alone: an MLP), and the outputs come back;
# 3. replay: the block's forward again, each call expert(x) answered by its rows' outputs, in
#    the order of the record; so the router's weights, the combine and any aux loss are the
#    user's own code, and their gradients too. The experts' inputs keep their gradients through
#    the record pass (the same function of the block's input). Gradient scaling: as ep_forward.
# The planner refuses at plan time the blocks this cannot reproduce (ir._moe.ep_why).
class _Elsewhere(nn.Module):
    """The place of an expert another ep rank holds (no parameters)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def extra_repr(self) -> str:
        return f"expert {self.index}, held by another ep rank"


class _Answer(nn.Module):
    """Stands for expert ``index`` while the block records or replays its calls."""

    def __init__(self, experts: ListedExperts, index: int) -> None:
        super().__init__()
        self.experts, self.index = experts, index

    def forward(self, x: torch.Tensor, *more, **kwargs) -> torch.Tensor:
        return self.experts.answer(self.index, x, bool(more or kwargs))


class ListedExperts:
    """One module list of experts under ep: this rank's expert modules and the record of one
    forward's calls (see above)."""

    def __init__(self, ep: ExpertParallel, fqn: str, container: nn.Module, probe: nn.Module):
        self.ep, self.fqn, self.container, self.probe = ep, fqn, container, probe
        first = ep.rank * ep.local
        self.owned = list(container._modules.values())[first : first + ep.local]
        self.calls: list[tuple[int, torch.Tensor, torch.Size, torch.Size]] = []
        self.outs: list[torch.Tensor] = []
        self.back: tuple[torch.Tensor, ...] = ()  # the dispatched calls' outputs, in order
        self.replaying = False
        self.tails: dict[int, torch.Size] = {}  # input size -> an expert's output dims

    def answer(self, index: int, x: torch.Tensor, more: bool) -> torch.Tensor:
        if more or not isinstance(x, torch.Tensor) or x.dim() < 1:
            raise TypeError(
                f"expert parallel: {self.fqn}.{index} is called with more than one tensor; "
                "experts in a module list run under ep when called as expert(x): plan with "
                "--mesh ep=1"
            )
        if self.replaying:
            n = len(self.outs)
            i, _, lead, tail = self.calls[n] if n < len(self.calls) else (-1, None, None, None)
            if i != index or lead != x.shape[:-1]:
                raise RuntimeError(
                    f"expert parallel: {self.fqn}'s block called its experts differently in "
                    f"its second pass (expert {index}, expected {i}): its forward must call "
                    "them alike for the same input"
                )
            self.outs.append(self.back[len(self.outs)])
            return self.outs[-1].view(*lead, *tail)
        rows = x.reshape(-1, x.shape[-1])
        if x.shape[-1] not in self.tails:  # the output's size, from an expert on meta
            dtype = next(self.probe.parameters()).dtype
            empty = torch.empty((0, x.shape[-1]), dtype=dtype, device="meta")
            with torch.no_grad():  # nothing saved: a checkpointed recomputation saves alike
                self.tails[x.shape[-1]] = self.probe(empty).shape[1:]
        tail = self.tails[x.shape[-1]]
        self.calls.append((index, rows, x.shape[:-1], tail))
        return x.new_zeros((*x.shape[:-1], *tail))

    def dispatch(self) -> None:
        """Every recorded row to its expert's owner and its output back (``self.back``)."""
        ep, calls = self.ep, self.calls
        assert calls, f"{self.fqn}: the block called no expert"
        idx = torch.cat([torch.full((len(r),), i, dtype=torch.long) for i, r, *_ in calls])
        idx = idx.to(calls[0][1].device)
        rows = torch.cat([r for _, r, *_ in calls])
        send_sizes, recv_sizes, ids, got, order = _send(ep, idx, rows)
        got = ScaleGrad.apply(got, float(ep.ep))
        by = torch.argsort(ids, stable=True)
        counts = torch.bincount(ids, minlength=ep.local).tolist()
        # every local expert runs, on no rows too: its FSDP2 unit gathers on every replica
        outs = [expert(part) for expert, part in zip(self.owned, got[by].split(counts))]
        out = ScaleGrad.apply(torch.cat(outs)[torch.argsort(by)], 1.0 / ep.ep)
        back = _exchange(ep, out, send_sizes, recv_sizes)[torch.argsort(order)]
        self.back = back.split([len(r) for _, r, *_ in calls])


def _exchange(ep: ExpertParallel, x: torch.Tensor, out_sizes: list, in_sizes: list):
    """Rows to the ep ranks, with gradients sent back in backward."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(x, out_sizes, in_sizes, ep.group))


def _send(ep: ExpertParallel, routes: torch.Tensor, rows: torch.Tensor):
    """Each row of ``rows`` to the owner of its expert ``routes``: (send sizes, receive sizes,
    the received rows' local expert ids, the received rows, the order the rows left in)."""
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
    got = _exchange(ep, rows[order], recv_sizes, send_sizes)
    return send_sizes, recv_sizes, ids, got, order


def listed_containers(c: Constants, model: nn.Module) -> list[str]:
    """The module lists of experts among the plan's experts (this rank's stages): a list whose
    num_experts children are all named there, one expert each."""
    named = set(c.EXPERT_PARALLEL["experts"])
    parents = dict.fromkeys(f.rpartition(".")[0] for f in c.EXPERT_PARALLEL["experts"])
    out = []
    for fqn in parents:
        if not fqn or not has_submodule(model, fqn):
            continue
        children = [f"{fqn}.{n}" for n, _ in model.get_submodule(fqn).named_children()]
        if len(children) == c.EXPERT_PARALLEL["num_experts"] and set(children) <= named:
            out.append(fqn)
    return out


def _apply_listed(ep: ExpertParallel, model: nn.Module, fqn: str, options: dict) -> None:
    """Keep this rank's experts of the module list ``fqn`` (FSDP2 units over ep_replicas), put
    stand-ins in the others' places, and run the block holding the list by record and replay."""
    container = model.get_submodule(fqn)
    parent = fqn.rpartition(".")[0]
    block = model.get_submodule(parent) if parent else model
    first = ep.rank * ep.local
    names = list(container._modules)  # a ModuleList's or a ModuleDict's, in order
    probe = copy.deepcopy(container._modules[names[first]]).to("meta")
    for i, name in enumerate(names):
        if first <= i < first + ep.local:
            expert = container._modules[name]
            for pname, p in list(expert.named_parameters())[:1]:
                ep.shapes[f"{fqn}.{name}.{pname}"] = tuple(p.shape)
            fully_shard(expert, mesh=ep.mesh["ep_replicas"], **options)
        else:
            container._modules[name] = _Elsewhere(i)
    experts = ListedExperts(ep, fqn, container, probe)
    answers = {name: _Answer(experts, i) for i, name in enumerate(names)}
    block.forward = functools.partial(_listed_forward, experts, answers, block.forward)


def _listed_forward(experts: ListedExperts, answers: dict, forward: Callable, *args, **kwargs):
    """The block's forward under ep with its experts in a module list (record, dispatch,
    replay: see above)."""
    container = experts.container
    held = dict(container._modules)
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    try:
        container._modules.update(answers)
        experts.calls, experts.outs, experts.replaying = [], [], False
        with torch.random.fork_rng(devices=devices):
            forward(*args, **kwargs)
        container._modules.update(held)
        experts.dispatch()
        container._modules.update(answers)
        experts.replaying = True
        out = forward(*args, **kwargs)
        if len(experts.outs) != len(experts.calls):
            raise RuntimeError(
                f"expert parallel: {experts.fqn}'s block called {len(experts.outs)} experts in "
                f"its second pass, {len(experts.calls)} in its first: its forward must call "
                "them alike for the same input"
            )
        return out
    finally:
        container._modules.update(held)
        experts.calls, experts.outs, experts.back = [], [], ()


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
