"""The training loop's pieces: each step's batch, the optimizer, the LR
schedule, the gradient norm and clipping, the step, the logged line, evaluation.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import resource
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils import _pytree as pytree

from .batch import DataStream, batch_split, call, device_of, local_slice, tensor_map
from .common import Constants, write_line
from .context_parallel import cp_active, cp_shard
from .data_parallel import autocast, forward
from .dropout import dropout_off, seed_rng, step_seed
from .profiling import phase

__all__ = [
    "dp_rank_of",
    "batches",
    "build_optimizer",
    "lr_factor",
    "LRSchedule",
    "collective_device",
    "grad_norm_share",
    "StepTotals",
    "finish_step",
    "train_step",
    "pieces_per",
    "reference_pieces",
    "gradient_sync",
    "mean_loss",
    "peak_memory_bytes",
    "log_step",
    "evaluate",
    "eval_loss_fn",
]


def dp_rank_of(c: Constants, mesh: DeviceMesh) -> int:
    """This rank's index among the data-parallel ranks (dp major, fsdp minor)."""
    return mesh["dp"].get_local_rank() * c.MESH["fsdp"] + mesh["fsdp"].get_local_rank()


def batches(
    c: Constants,
    make_batch: Callable[[int, int | None], tuple],
    seed: int,
    first_step: int,
    steps: int,
    device: torch.device,
    dp_rank: int,
    data: DataStream | None = None,
    full: bool = True,
) -> Iterator[tuple[int, tuple, tuple | None]]:
    """(step, this rank's batch, the global batch) for each step: synthetic batches, the same
    global batch on every rank (drawn from a seed that depends only on the step, so a resumed
    run sees what an uninterrupted one would), each data-parallel rank training on its slice;
    with --data (``data``), the DataStream's batches (the global one only if ``full``)."""
    for step, batch, whole in _batches(c, make_batch, seed, first_step, steps, device, dp_rank,
                                       data, full):  # fmt: skip
        seed_rng(step_seed(seed, step, dp_rank))  # this step's dropout (see above)
        yield step, batch, whole


def _batches(
    c: Constants,
    make_batch: Callable[[int, int | None], tuple],
    seed: int,
    first_step: int,
    steps: int,
    device: torch.device,
    dp_rank: int,
    data: DataStream | None,
    full: bool,
) -> Iterator[tuple[int, tuple, tuple | None]]:
    if data is not None:
        yield from data.batches(first_step, steps, device, dp_rank, full)
        return
    for step in range(first_step, steps + 1):
        seed_rng(seed + 1000 + step)
        inputs, target = make_batch(c.GLOBAL_BATCH, c.SEQ_LEN)
        batch = tensor_map(lambda x: x.to(device), (inputs, target))
        yield step, local_slice(c, batch, dp_rank), batch


def build_optimizer(
    params: Iterable[nn.Parameter], args: argparse.Namespace
) -> torch.optim.Optimizer:
    """AdamW (decoupled weight decay) or SGD (weight decay as an L2 term in the gradient), on
    every parameter (norms and biases too); --weight-decay unset keeps torch's defaults."""
    params = list(params)
    decay = {} if args.weight_decay is None else {"weight_decay": args.weight_decay}
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=args.lr, **decay)
    return torch.optim.AdamW(params, lr=args.lr, **decay)


def lr_factor(kind: str, warmup: int, steps: int, step: int) -> float:
    """The lr of step ``step`` (1, 2, ..., ``steps``) over --lr. Warmup: step / warmup for the
    first ``warmup`` steps (from lr / warmup up to lr). Then, with d = steps - warmup decay steps
    and p = (step - warmup - 1) / d, constant 1, linear 1 - p, cosine (1 + cos(pi p)) / 2: the
    first step after warmup runs at lr and the decay reaches 0 one step past the last (every
    step trains with an lr above 0, the last at lr / d for linear)."""
    if step <= warmup:
        return step / warmup
    if kind == "constant":
        return 1.0
    progress = (step - warmup - 1) / max(1, steps - warmup)
    if kind == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


class LRSchedule:
    """--lr-schedule and --warmup-steps on the optimizers (one per pipeline stage): sets each
    param group's lr before every step. Its state (steps done, base lr) is saved in every
    checkpoint; a resumed run continues the schedule where it stopped, at the saved base lr."""

    def __init__(self, args: argparse.Namespace, optimizers: list[torch.optim.Optimizer]) -> None:
        self.kind, self.warmup, self.steps = args.lr_schedule, args.warmup_steps, args.steps
        self.optimizers, self.base, self.done = list(optimizers), args.lr, 0
        self.apply()

    def lr(self) -> float:
        """The lr of the next step."""
        return self.base * lr_factor(self.kind, self.warmup, self.steps, self.done + 1)

    def apply(self) -> None:
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = self.lr()

    def step(self) -> None:
        self.done += 1
        self.apply()

    def state_dict(self) -> dict:
        return {
            "done": torch.tensor(self.done),
            "base": torch.tensor(self.base, dtype=torch.float64),
        }

    def load_state_dict(self, state: dict) -> None:
        self.done, self.base = int(state["done"]), float(state["base"])
        self.apply()


def collective_device() -> torch.device:
    """Where a tensor for a collective lives: this rank's GPU with nccl, else the CPU."""
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def grad_norm_share(
    c: Constants, params: Iterable[nn.Parameter], distributed: bool = True
) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """(this rank's share of the squared total gradient norm of the whole model, a float64
    scalar on collective_device(); this rank's gradients as local tensors, for clipping).

    Each rank holds some shards of its stages' parameters: plain tensors (DDP, TP-replicated
    layers), DTensors sharded over TP and/or FSDP mesh dims, replicated over others. The squares
    of the rank's local gradients are summed, each divided by the number of ranks that hold that
    very shard (world / pp / the product of its Shard dims), so that the sum of the shares over
    the whole world (StepTotals) counts every element once, the stages of every pipeline rank
    included; a gradient every rank holds (DDP's, a TP-replicated layer's without a pipeline)
    is read by one rank only (_part_of), its share not divided: each rank reads 1/world of
    them. (torch.nn.utils.clip_grad_norm_ handles DTensors of one mesh only. Measured on torch
    2.13: with fsdp x tp it raises, "All operands in aten.stack.default must have the same
    mesh" (the un-TP'd parameters are on the 1-D fsdp mesh, the others on fsdp x tp); on pp=2
    each rank gets its own stage's norm, 0.797 and 0.378 of a total 0.882.) ``distributed``
    False: one process's plain model (--verify's reference), the share is the whole."""
    holders = dist.get_world_size() // c.MESH["pp"] if distributed else 1
    groups: dict = {}  # (copies, device, dtype) -> local gradients
    kinds: dict = {}  # (mesh, placements) -> _grad_layout's answer: one per layout, not per grad
    for p in params:
        g = p.grad
        if g is None:
            continue
        copies = holders
        if isinstance(g, DTensor):
            layout = (g._spec.mesh, g._spec.placements)
            kind = kinds.get(layout)
            if kind is None:
                kind = kinds[layout] = _grad_layout(g, holders)
            partial, copies = kind
            if partial:  # a pending sum: make it whole
                whole = [Replicate() if pl.is_partial() else pl for pl in g.placements]
                p.grad = g = g.redistribute(placements=whole)
            g = g._local_tensor  # the same tensor as to_local(), without its autograd node
        groups.setdefault((copies, g.device, g.dtype), []).append(g)
    share = torch.zeros((), dtype=torch.float64, device=collective_device())
    world = dist.get_world_size() if distributed else 1
    with torch.no_grad():
        for (copies, _, _), grads in groups.items():
            if copies == world > 1:  # every rank holds these very gradients (DDP's): each
                grads, copies = _part_of(grads, world, dist.get_rank()), 1  # takes its part
            if grads:
                norms = torch.stack(torch._foreach_norm(grads)).to(share.device, torch.float64)
                share += norms.square().sum() / copies
    return share, list(groups.values())


def _grad_layout(g: DTensor, holders: int) -> tuple[bool, int]:
    """(whether the DTensor gradient ``g`` holds a pending sum (Partial), the number of ranks
    that hold each of its shards once it is whole) from its mesh and placements."""
    # Shard and FSDP2's _StridedShard (a TP-sharded dim sharded again) split a tensor.
    placements, mesh = g.placements, g.device_mesh
    shards = math.prod(
        mesh.size(i)
        for i, pl in enumerate(placements)
        if not (pl.is_replicate() or pl.is_partial())
    )
    if mesh.mesh_dim_names == ("ep_replicas",):  # a module list's expert
        shards *= holders // mesh.size()  # held by its ep_replicas only
    return any(pl.is_partial() for pl in placements), holders // shards


def _part_of(tensors: list[torch.Tensor], ranks: int, rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s part of ``tensors``, which all ``ranks`` ranks hold alike (in the same
    order): each tensor goes to the rank with the fewest elements so far, so that each rank
    reads about 1/ranks of them and together they read each once."""
    loads, mine = [0] * ranks, []
    for t in tensors:
        least = loads.index(min(loads))
        loads[least] += t.numel()
        if least == rank:
            mine.append(t)
    return mine


class StepTotals:
    """The step's figures over all ranks, in flight; wait() gives (mean loss, total gradient
    norm or None, largest peak memory or None) from this rank's squared-norm share
    (grad_norm_share; None: no norm), loss (as in mean_loss) and peak memory (or None): one
    all-reduce (a sum) of one float64 row, issued here and waited for by wait(), so that it runs
    while the rank steps its optimizer. The peak rides in it one-hot, this rank's value at its
    rank's place and 0 elsewhere: the sum holds every rank's (exact in float64 below 2^53)."""

    def __init__(
        self,
        c: Constants,
        norm_share: torch.Tensor | None,
        loss: torch.Tensor,
        peak: int | None = None,
        distributed: bool = True,
    ) -> None:
        device, ranks = collective_device(), dist.get_world_size() if distributed else 1
        self.last_stage_ranks = ranks // c.MESH["pp"] if distributed else 1
        self.has_norm, self.has_peak = norm_share is not None, peak is not None
        parts = [x.detach().reshape(1) for x in (loss, norm_share) if x is not None]
        if peak is not None:
            parts.append(torch.zeros(ranks, dtype=torch.float64))
            parts[-1][dist.get_rank() if distributed else 0] = peak
        self.row = torch.cat([x.to(device, torch.float64) for x in parts])
        self.work = dist.all_reduce(self.row, async_op=True) if distributed else None

    def wait(self) -> tuple[float, float | None, int | None]:
        if self.work is not None:
            self.work.wait()
        loss_sum, *values = self.row.tolist()
        norm = math.sqrt(values.pop(0)) if self.has_norm else None
        peak = int(max(values)) if self.has_peak else None
        return loss_sum / self.last_stage_ranks, norm, peak


def finish_step(
    c: Constants,
    params: Iterable[nn.Parameter] | None,
    loss: torch.Tensor,
    optimizers: list[torch.optim.Optimizer],
    args: argparse.Namespace,
    logged: bool = False,
    distributed: bool = True,
) -> tuple[float, float | None, int | None]:
    """What follows the backward of a step: the total gradient norm, the gradients scaled by
    min(1, --max-grad-norm / norm) (torch's clip_grad_norm_ rule), the optimizers' step, and
    the step's figures over all ranks: (mean loss, norm before clipping, the largest peak memory
    where the step is ``logged``, else None). ``params``: the norm's (None: the optimizers').
    The norm is computed where read (logged, --max-grad-norm, --verify, --profile-steps), else
    None. One collective (StepTotals), issued before the optimizer step and waited for after
    it (with --max-grad-norm at once); a logged step's peak memory rides in it, read before the
    optimizer step, which the previous step's (of the same size) is below. A run's first step
    allocates the optimizer state: its peak is read after the step, by a MAX of its own."""
    if params is None:
        params = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
    clip = args.max_grad_norm is not None
    needs_norm = logged or clip or args.verify or bool(getattr(args, "profile_steps", 0))
    peak_at = None  # where a logged step's peak is read: "before" or "after" the optimizer step
    if distributed:  # the same on every rank (its collectives must match): this run's steps
        done = args.__dict__.get("autopar_steps_done", 0)
        args.autopar_steps_done = done + 1
        peak_at = ("before" if done else "after") if logged else None
    with phase(args, "grad_norm"):  # --profile-steps
        share, grads = grad_norm_share(c, params, distributed) if needs_norm else (None, [])
        peak = peak_memory_bytes(loss.device) if peak_at == "before" else None
        totals = StepTotals(c, share, loss, peak, distributed)
        if clip:
            mean, norm, peak = totals.wait()
            if norm > args.max_grad_norm:
                scale = args.max_grad_norm / (norm + 1e-6)
                with torch.no_grad():
                    for group in grads:
                        torch._foreach_mul_(group, scale)
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    with phase(args, "grad_norm"):  # the step's figures over all ranks: the norm's collective
        if not clip:
            mean, norm, peak = totals.wait()
        if peak_at == "after":
            peak_max = torch.tensor(peak_memory_bytes(loss.device), device=collective_device())
            dist.all_reduce(peak_max, op=dist.ReduceOp.MAX)
            peak = int(peak_max)
    return mean, norm, peak


def train_step(
    c: Constants,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    batch: tuple,
    args: argparse.Namespace,
    logged: bool = False,
    reference: bool = False,
) -> tuple[float, float, int | None]:
    """One optimizer step on ``batch``: (the loss, mean over data-parallel ranks; the total
    gradient norm before clipping; where the step is ``logged``, the largest peak memory over
    ranks, else None). It runs in the plan's ACCUMULATION_STEPS equal microbatches: gradients
    accumulate without data-parallel sync until the last microbatch, each loss scaled by 1/N so
    the gradients are the whole batch's; then finish_step clips them to --max-grad-norm, steps
    the optimizer and sums the figures over ranks. ``reference`` (--verify's unsharded model,
    the global batch) runs the same pieces as the sharded run, each data-parallel rank's slice
    in its microbatches (:func:`reference_pieces`)."""
    pieces = reference_pieces(c, batch) if reference else batch_split(batch, c.ACCUMULATION_STEPS)
    steps = len(pieces)
    device = device_of(batch)
    total = None  # the pieces' losses summed (a piece's own where it is the only one)
    cp = None if reference else getattr(model, "autopar_cp", None)
    for i, (micro_inputs, micro_target) in enumerate(pieces):
        with gradient_sync(model, i == steps - 1), dropout_off(args, [model]), cp_active(cp):
            output = forward(c, model, micro_inputs, reference)
            with autocast(c, device.type):
                share = pieces_per(c, micro_target, steps, reference)
                loss = loss_fn(output, cp_shard(cp, micro_target))
                if share != 1:  # x / 1 is x to the bit: one op and its backward fewer
                    loss = loss / share
            loss.backward()
        piece = loss.detach().float()  # summed in fp32 (a bf16 loss_fn's too)
        total = piece if total is None else total + piece
    return finish_step(c, None, total, [optimizer], args, logged, not reference)


def pieces_per(c: Constants, target: Any, steps: int, reference: bool) -> float:
    """What one piece's loss is divided by: the pieces of the step (``steps``), or where the
    data-parallel ranks' shares are uneven (BATCH_SHARES), the global batch over the piece's
    samples, over the data-parallel ranks unless ``reference`` (which has no DDP average):
    each piece then weighs as its samples do, so the averaged gradients are the global
    batch's mean (even shares: the same divisor, to the bit)."""
    if c.BATCH_SHARES is None:
        return steps
    rows = next(x for x in pytree.tree_leaves(target) if isinstance(x, torch.Tensor)).shape[0]
    return c.GLOBAL_BATCH / (rows * (1 if reference else c.data_parallel))


def reference_pieces(c: Constants, batch: tuple) -> list:
    """What --verify's single-process reference trains on in a step: the global batch whole
    (VERIFY_REFERENCE "global batch"): a model that couples the samples of a batch (a batch
    norm, a contrastive loss) and runs each on a slice differs from it, and --verify says so.
    "rank slices" (a mixture of experts' load-balancing loss, a statistic of the routing over
    each slice by design): the global batch as the sharded run splits it, each data-parallel
    rank's slice in its microbatches (accumulation steps, or the pipeline's), the loss of every
    piece averaged, so the reference differs from the sharded run by reduction order only."""
    if c.VERIFY_REFERENCE == "global batch":
        return [batch]
    per_rank = c.MICROBATCHES if c.MESH["pp"] > 1 else c.ACCUMULATION_STEPS
    slices = [local_slice(c, batch, r) for r in range(c.data_parallel)]
    return [piece for one in slices for piece in batch_split(one, per_rank)]


@contextlib.contextmanager
def gradient_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """Data-parallel gradient sync on (the last microbatch of a step) or off (the others):
    DDP's no_sync, FSDP2's set_requires_gradient_sync; nothing to do without data parallel."""
    if sync:
        yield
    elif isinstance(model, DDP):
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def mean_loss(c: Constants, loss: torch.Tensor) -> float:
    """A loss's mean over data-parallel ranks (an evaluation's; a training step's comes with its
    gradient norm from StepTotals): the ranks of the last pipeline stage (all ranks without a
    pipeline) hold their slice's loss, TP peers the same one, the other stages 0, so the sum
    over all ranks divided by the last stage's rank count."""
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    return loss.item() / (dist.get_world_size() // c.MESH["pp"])


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: the caching allocator's peak. CPU: this process's peak RSS, read from Linux's
    VmHWM (the high-water mark of this program's own memory). Not ru_maxrss: Linux carries a
    process's ru_maxrss over from its parent across fork and exec, so a rank started by a large
    process (a test runner at 1 GB, say) reports the parent's RSS as its own peak (measured)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def log_step(
    c: Constants, step: int, loss: float, step_time_s: float, peak: int, **more: float
) -> None:
    """Rank 0's JSON line for a step (``peak``: the largest peak memory over all ranks, from
    train_step). ``more``: lr, grad_norm (and --verify's ref_grad_norm). mfu is MODEL_FLOPS /
    (step time x world size x PEAK_FLOPS), null where the plan has no FLOPs figure."""
    if dist.get_rank() != 0:
        return
    tokens = c.GLOBAL_BATCH * c.SEQ_LEN if c.SEQ_LEN else None
    mfu = None
    if c.MODEL_FLOPS and c.PEAK_FLOPS:
        mfu = round(c.MODEL_FLOPS / (step_time_s * c.WORLD_SIZE * c.PEAK_FLOPS), 6)
    finite = lambda x: x if x is not None and math.isfinite(x) else None  # noqa: E731 (JSON)
    record = {
        "step": step,
        "loss": finite(loss),
        "lr": more.pop("lr", None),
        "grad_norm": finite(more.pop("grad_norm", None)),
        "step_time_s": round(step_time_s, 6),
        "tokens_per_s": round(tokens / step_time_s, 1) if tokens else None,
        "mfu": mfu,
        "peak_memory_bytes": int(peak),
        **{k: finite(v) for k, v in more.items()},
    }
    write_line(json.dumps(record))


def evaluate(
    c: Constants,
    step: int,
    data: DataStream | None,
    device: torch.device,
    dp_rank: int,
    forward_loss: Callable[[tuple], torch.Tensor],
) -> None:
    """Rank 0 logs {"step", "eval_loss"}: the mean loss over the eval batches, where
    ``forward_loss(batch)`` is this rank's loss of a batch (0 off the last pipeline stage)."""
    losses = [mean_loss(c, forward_loss(b)) for b in data.eval_batches(device, dp_rank)]
    if dist.get_rank() == 0:
        write_line(json.dumps({"step": step, "eval_loss": sum(losses) / len(losses)}))


def eval_loss_fn(
    c: Constants, model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor]
) -> Callable[[tuple], torch.Tensor]:
    """This rank's forward-only loss of a batch (--eval-data), the model in eval mode."""

    def run(batch):
        inputs, target = batch
        model.eval()
        cp = getattr(model, "autopar_cp", None)
        with torch.no_grad(), autocast(c, device_of(batch).type), cp_active(cp):
            loss = loss_fn(call(model, inputs), cp_shard(cp, target))
        model.train()
        return loss.detach().float()

    return run
