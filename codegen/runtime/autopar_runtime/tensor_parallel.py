"""Tensor parallel: the plan's style names as torch ParallelStyles (``TP_STYLES``; sequence
parallel, HF Conv1D, fused projections), attention blocks that run on DTensors, and ``apply_tp``.
"""

from __future__ import annotations

import contextlib
import functools
import types
import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _StridedShard,
)

from .common import Constants, has_submodule

__all__ = [
    "SequenceParallelGather",
    "SequenceScatter",
    "dtensor_blocks",
    "ColwiseFused",
    "ColwiseGatherHeads",
    "ColwiseFusedHeads",
    "FusedSplits",
    "fused_pieces",
    "run_on_dtensors",
    "storage_form",
    "from_storage",
    "register_cpu_sdpa_sharding",
    "is_conv1d",
    "Colwise",
    "Rowwise",
    "shared_input",
    "TP_STYLES",
    "apply_tp",
]


class SequenceParallelGather(SequenceParallel):
    """SequenceParallel on a norm, its output then all-gathered along the sequence into a
    replicated DTensor: Megatron-LM's sequence-parallel "g", once for all the colwise linears
    that read it (each takes the replicated DTensor as it is); in backward their partial input
    gradients add up and one reduce-scatter returns the norm's sequence shard."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            self._replicate_module_fn,
            functools.partial(self._prepare_input_fn, self.sequence_sharding),
            lambda mod, out, mesh: out.redistribute(mesh, [Replicate()]),
        )


class SequenceScatter(ParallelStyle):
    """A layer's first positional input, replicated, enters the sequence-parallel region: each
    rank keeps its slice of dim 1 (no communication); backward all-gathers the gradient."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def split(mod, args, kwargs):
            if not args or not isinstance(args[0], torch.Tensor):
                raise RuntimeError(
                    f"sequence_scatter: {type(mod).__name__} got no tensor as its first "
                    "positional argument to split along the sequence"
                )
            x = DTensor.from_local(args[0], device_mesh, [Replicate()], run_check=False)
            return (x.redistribute(device_mesh, [Shard(1)]).to_local(), *args[1:]), kwargs

        module.register_forward_pre_hook(split, with_kwargs=True)
        return module


# An attention block whose views name full sizes (nanoGPT's ``C // self.n_head``, a head count
# written as a number) gets colwise styles that hand on DTensors of full shape (``*_dtensor``):
# its own ops run on DTensors, which keep the global shapes its code names, up to its rowwise
# linear. The planner proved it runs only ops DTensor carries and reads only its own buffers
# besides its input (ir._heads.dtensor_blocks). A fused linear whose output the block splits
# into k equal pieces (nanoGPT's c_attn into q, k, v: ``*_fused{k}_dtensor``) holds rows
# ``_StridedShard(0, split_factor=k)``: each rank its slice of every piece.
def dtensor_blocks(c: Constants) -> dict[str, bool]:
    """The blocks that run on DTensors (parents of ``*_dtensor`` styles) -> whether one of their
    linears is fused (``*_fused{k}_dtensor``: their splits go through :class:`FusedSplits`)."""
    blocks: dict[str, bool] = {}
    for fqn, style in c.TP_PLAN.items():
        if style.endswith("_dtensor"):
            parent = fqn.rpartition(".")[0]
            blocks[parent] = blocks.get(parent, False) or "_fused" in style
    return blocks


class ColwiseFused(ColwiseParallel):
    """ColwiseParallel for a linear whose output is split into ``parts`` equal pieces along its
    last dim: weight rows ``_StridedShard(0, split_factor=parts)`` (rank r holds rows r of each
    piece), so the output is ``_StridedShard(-1, parts)`` and :class:`FusedSplits`
    hands out the pieces as ``Shard(-1)`` DTensors with no communication."""

    def __init__(self, parts: int, **kwargs) -> None:
        super().__init__(use_local_output=False, **kwargs)
        self.parts = parts

    def _partition_linear_fn(self, name, module, device_mesh):
        for pname, param in module.named_parameters():
            # the bias replicated: added to the strided output, each rank takes its rows (no
            # communication); FSDP2 can then shard it as any other (fsdp_shard_dim)
            placement = [
                _StridedShard(0, split_factor=self.parts) if param.ndim == 2 else Replicate()
            ]
            dist_param = distribute_tensor(param, device_mesh, placement, src_data_rank=None)
            module.register_parameter(
                pname, nn.Parameter(dist_param, requires_grad=param.requires_grad)
            )


class FusedSplits(torch.overrides.TorchFunctionMode):
    """``split(size, dim)`` / ``chunk(k, dim)`` of a DTensor that is ``_StridedShard(dim, k)``
    into its k pieces: each rank splits its local rows into its slice of every piece, each a
    ``Shard(dim)`` DTensor (DTensor itself would all-gather first: a split along a sharded dim).
    Differentiable (to_local / from_local); anything else runs as called."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        pieces = fused_pieces(func, args, kwargs)
        return pieces if pieces is not None else func(*args, **kwargs)


def fused_pieces(func: Callable, args: tuple, kwargs: dict | None) -> tuple | None:
    """:class:`FusedSplits`' split, or None where ``func`` is not one it takes (a module
    function: torch.compile guards a staticmethod of a mode by ``__func__`` and fails)."""
    if func not in (torch.Tensor.split, torch.split, torch.Tensor.chunk, torch.chunk):
        return None
    x = args[0] if args else None
    if not isinstance(x, DTensor):
        return None
    arg = args[1] if len(args) > 1 else kwargs.get("split_size_or_sections", kwargs.get("chunks"))
    dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % x.ndim
    strided = [
        i for i, p in enumerate(x.placements)
        if isinstance(p, _StridedShard) and p.dim == dim
    ]  # fmt: skip
    if not isinstance(arg, int) or len(strided) != 1:
        return None
    (i,) = strided
    k = x.placements[i].split_factor
    chunk = func in (torch.Tensor.chunk, torch.chunk)
    if (arg if chunk else x.shape[dim] // arg) != k or x.shape[dim] % k:
        return None
    placements = [Shard(dim) if j == i else p for j, p in enumerate(x.placements)]
    shape = list(x.shape)
    shape[dim] //= k
    stride = torch.empty(shape, device="meta").stride()
    local = x.to_local()
    return tuple(
        DTensor.from_local(t, x.device_mesh, placements, run_check=False,
                           shape=torch.Size(shape), stride=stride)
        for t in local.chunk(k, dim)
    )  # fmt: skip


def run_on_dtensors(block: nn.Module, mesh: DeviceMesh, fused: bool) -> None:
    """Each call of ``block`` with its own buffers (a causal mask) lent as replicated DTensors,
    so they meet its DTensors as DTensors (the plain buffers back after the call: state dicts
    and checkpoints never see them), and, where a linear is ``fused``, its output split by
    :class:`FusedSplits` (a mode that sees every op of the call: only where needed)."""
    names = [n for n, b in block.named_buffers(recurse=False) if b is not None]
    forward = block.forward

    def on_dtensors(self, *args, **kwargs):
        plain = {n: self._buffers[n] for n in names}
        try:
            for n, b in plain.items():
                self._buffers[n] = DTensor.from_local(b, mesh, [Replicate()], run_check=False)
            with FusedSplits() if fused else contextlib.nullcontext():
                return forward(*args, **kwargs)
        finally:
            self._buffers.update(plain)

    block.forward = types.MethodType(on_dtensors, block)  # a bound method, as torch.compile expects


def storage_form(state: dict) -> list:
    """DCP cannot write or read a ``_StridedShard`` on a TP dim (a fused linear's rows: each
    rank's rows are not one block; measured, torch 2.13: "overlapping chunks"). Puts each such
    tensor of the nested ``state`` in place as a copy redistributed to ``Shard`` there (the
    layout every other TP weight has): the containers stay the caller's, so what DCP loads by
    replacing a value (an int, the data position) lands in them. Returns (container, key, live,
    stored) for :func:`from_storage` after a load."""
    pairs = []
    items = list(state.items()) if isinstance(state, dict) else list(enumerate(state))
    for key, t in items:
        if isinstance(t, (dict, list)):
            pairs += storage_form(t)
            continue
        if not isinstance(t, DTensor):
            continue
        names = t.device_mesh.mesh_dim_names or ()
        placements = [
            Shard(p.dim) if isinstance(p, _StridedShard) and i < len(names) and names[i] == "tp"
            else p
            for i, p in enumerate(t.placements)
        ]  # fmt: skip
        if placements != list(t.placements):
            state[key] = t.detach().redistribute(placements=placements)
            pairs.append((state, key, t, state[key]))
    return pairs


def from_storage(pairs: list) -> None:
    """Copy what a load put into :func:`storage_form`'s copies back into the live tensors, and
    put the live ones back in their containers."""
    with torch.no_grad():
        for container, key, live, stored in pairs:
            live.to_local().copy_(stored.redistribute(placements=live.placements).to_local())
            container[key] = live


@functools.cache
def register_cpu_sdpa_sharding() -> None:
    """CPU's fused attention kernel has no DTensor sharding rule (torch 2.13: "does not have a
    sharding strategy registered"; CUDA's kernels have theirs). Attention is independent per
    batch row and per head: register that q, k, v, the output, its logsumexp and their
    gradients shard alike on dim 0 or 1 (a mask replicated), or all replicate."""
    from torch.distributed.tensor.experimental import register_sharding

    aten = torch.ops.aten

    def strategies(n_out: int, n_in: int, attn_mask: object) -> list:
        mask = [] if attn_mask is None else [Replicate()]
        out = [([Replicate()] * n_out, [Replicate()] * n_in + mask)]
        out += [([Shard(d)] * n_out, [Shard(d)] * n_in + mask) for d in (0, 1)]
        return out

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)
    def forward(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
        return strategies(2, 3, attn_mask)

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    def backward(grad_out, query, key, value, out, lse, dropout_p, is_causal, *, attn_mask=None,
                 scale=None):  # fmt: skip
        return strategies(3, 6, attn_mask)


# A linear whose weight is stored (in, out) and computed as addmm(bias, x.view(-1, in), weight)
# .view(..., nf). torch's styles take nn.Linear and nn.Embedding only; these shard a Conv1D the
# same way (colwise: weight Shard(1), bias Shard(0); rowwise: weight Shard(0), bias replicated).
# Its forward then runs on DTensors of full shape, its views included.
def is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _conv1d_partition(placements: dict):
    """A partition function putting a Conv1D's weight (2-D) and bias (1-D) on ``placements``
    (ndim -> placement)."""

    def partition(name, module, mesh):
        for pname, p in list(module.named_parameters()):
            dp = distribute_tensor(p, mesh, [placements[p.ndim]], src_data_rank=None)
            module.register_parameter(pname, nn.Parameter(dp, requires_grad=p.requires_grad))

    return partition


def _apply_to_conv1d(
    style: ParallelStyle, module: nn.Module, mesh: DeviceMesh, placements: dict
) -> nn.Module:
    """``style`` (a Colwise or Rowwise) on a Conv1D: its partition, torch's input and output
    hooks (the same as on a linear)."""
    return distribute_module(
        module,
        mesh,
        _conv1d_partition(placements),
        functools.partial(
            style._prepare_input_fn, style.input_layouts, style.desired_input_layouts
        ),
        functools.partial(style._prepare_output_fn, style.output_layouts, style.use_local_output),
    )


class Colwise(ColwiseParallel):
    """ColwiseParallel that also takes an HF Conv1D, and whose prepared input (replicated, or
    all-gathered from sequence shards) is one DTensor per tensor (:func:`shared_input`): the
    column-parallel projections that read the same activation (attention's q, k and v; a gated
    MLP's gate and up) have its gradient reduced once, where ColwiseParallel reduces it once
    per projection (and all-gathers a sequence-sharded input once per projection)."""

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        return shared_input(input_layouts, desired_input_layouts, mod, inputs, device_mesh)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        return _apply_to_conv1d(self, module, device_mesh, {2: Shard(1), 1: Shard(0)})


def shared_input(
    input_layouts: tuple[Placement, ...],
    desired_input_layouts: tuple[Placement, ...],
    mod: nn.Module,
    inputs: tuple,
    device_mesh: DeviceMesh,
) -> DTensor:
    """ColwiseParallel's input (``inputs[0]`` as a DTensor of ``input_layouts`` redistributed to
    ``desired_input_layouts``), the same DTensor for every column-parallel call that reads that
    tensor with those layouts while the DTensor lives (held weakly on the tensor: no cycle keeps
    an activation alive). Their partial input gradients add up as DTensors and one collective
    reduces the sum (``from_local``'s or the redistribution's backward): one per activation, as
    Megatron-LM (fused QKV) and torchtitan (``PrepareModuleInput``) move it, and as the cost model
    charges it (``planner.transitions``: sibling projections share their input's collectives).
    A tensor changed in place since (its version counter moved) gets a new one: the held one
    may be a copy of its old values (an all-gather's)."""
    x = inputs[0]
    key = (device_mesh, tuple(input_layouts), tuple(desired_input_layouts), _version(x))
    held = getattr(x, "_autopar_tp_input", None)
    if held is not None and held[0] == key and key[3] is not None:
        shared = held[1]()
        if shared is not None:
            return shared
    shared = ColwiseParallel._prepare_input_fn(
        input_layouts, desired_input_layouts, mod, inputs, device_mesh
    )
    if shared is not x:  # a DTensor already as wanted is shared as it is
        x._autopar_tp_input = (key, weakref.ref(shared))
    return shared


def _version(x: torch.Tensor) -> int | None:
    """``x``'s version counter (bumped by every in-place change); None for an inference tensor,
    which keeps none."""
    try:
        return x._version
    except RuntimeError:
        return None


class Rowwise(RowwiseParallel):
    """RowwiseParallel that also takes an HF Conv1D. Its local output is a copy: the model may
    add to it in place (HF Falcon's ``mlp_output += attention_output``), which autograd
    forbids on the view ``to_local`` returns."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        out = RowwiseParallel._prepare_output_fn(
            output_layouts, use_local_output, mod, outputs, device_mesh
        )
        return out.clone() if use_local_output else out

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)  # as RowwiseParallel sets it for a linear
        return _apply_to_conv1d(self, module, device_mesh, {2: Shard(0), 1: Replicate()})


class ColwiseGatherHeads(Colwise):
    """A kv projection of ``kv_heads`` heads, fewer than tp, read on local query heads (one:
    multi-query attention; several: grouped-query, Megatron's way): its weight ``Shard(0)``
    as any colwise weight, its output all-gathered and rank r keeping kv head ``r // (tp /
    kv_heads)``, the one its query heads read (one kv head: all of it). Each rank reads only
    its query heads' share, so the output's gradient is a partial sum per rank: summed over
    the TP group (reduce-scattered onto the weight shards)."""

    def __init__(self, kv_heads: int = 1) -> None:
        super().__init__(output_layouts=Replicate())
        self.kv_heads = kv_heads

    def _prepare_output_fn(self, output_layouts, use_local_output, mod, outputs, device_mesh):
        outputs = outputs.redistribute(placements=output_layouts, async_op=False)
        full = outputs.to_local(grad_placements=(Partial(),))
        if self.kv_heads == 1:
            return full
        width = full.shape[-1] // self.kv_heads
        head = device_mesh.get_local_rank() // (device_mesh.size() // self.kv_heads)
        return full[..., head * width : (head + 1) * width].contiguous()


class ColwiseFusedHeads(Colwise):
    """A fused q/k/v projection with fewer kv heads than tp (HF Falcon's ``query_key_value``):
    its first ``in_features`` output columns are the query heads, the rest the kv heads.
    Megatron splits the query heads and has every rank hold the kv heads whole: the weight is
    ``Shard(0)`` as any colwise weight (checkpoints, FSDP2 and ``--verify`` see the usual
    layout), the output all-gathered, and each rank keeps its query heads' columns and every kv
    column. Each rank reads the kv heads for its query heads only, so the output's gradient is
    a partial sum per rank: reduce-scattered onto the weight shards."""

    def __init__(self) -> None:
        super().__init__(output_layouts=Replicate())

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        full = outputs.redistribute(placements=output_layouts, async_op=False)
        full = full.to_local(grad_placements=(Partial(),))
        q = mod.in_features // device_mesh.size()
        rank = device_mesh.get_local_rank()
        return torch.cat([full[..., rank * q : (rank + 1) * q], full[..., mod.in_features :]], -1)


# The plan's style names as torch ParallelStyles. Between a colwise and a rowwise layer the
# activation stays sharded on its last dim; Shard(1) is the sequence dim (sequence parallel).
TP_STYLES = {
    "colwise": Colwise(),
    "colwise_from_seq": Colwise(input_layouts=Shard(1)),
    "colwise_dtensor": Colwise(use_local_output=False),
    "colwise_from_seq_dtensor": Colwise(input_layouts=Shard(1), use_local_output=False),
    **{
        f"colwise{seq}_fused{k}_dtensor": ColwiseFused(
            k, **({"input_layouts": Shard(1)} if seq else {})
        )
        for seq in ("", "_from_seq")
        for k in (2, 3)
    },
    "colwise_gather": Colwise(output_layouts=Replicate()),
    "colwise_gather_heads": ColwiseGatherHeads(),
    **{f"colwise_kv_heads{n}": ColwiseGatherHeads(n) for n in range(2, 17)},
    "colwise_fused_heads": ColwiseFusedHeads(),
    "colwise_from_seq_gather": Colwise(input_layouts=Shard(1), output_layouts=Replicate()),
    "rowwise": Rowwise(),
    "rowwise_to_seq": Rowwise(output_layouts=Shard(1)),
    "rowwise_from_replicate": RowwiseParallel(input_layouts=Replicate()),
    "rowwise_from_replicate_to_seq": RowwiseParallel(
        input_layouts=Replicate(), output_layouts=Shard(1)
    ),
    "sequence_parallel": SequenceParallel(),
    "sequence_parallel_local": SequenceParallel(use_local_output=True),
    "heads_parallel_local": SequenceParallel(sequence_dim=2, use_local_output=True),
    "sequence_parallel_gather": SequenceParallelGather(),
    "sequence_scatter": SequenceScatter(),
}


def apply_tp(c: Constants, model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split the planned layers across the TP group (Megatron style); a pipeline stage holds
    some of the model's modules (under their own FQNs): style those."""
    for fqn, attrs in c.MODULE_ATTRS.items():
        if has_submodule(model, fqn):
            for name, value in attrs.items():
                setattr(model.get_submodule(fqn), name, value)
    styles = {f: TP_STYLES[s] for f, s in c.TP_PLAN.items() if has_submodule(model, f)}
    parallelize_module(model, tp_mesh, styles)
    for fqn, fused in dtensor_blocks(c).items():
        if has_submodule(model, fqn):
            register_cpu_sdpa_sharding()
            run_on_dtensors(model.get_submodule(fqn), tp_mesh, fused)
