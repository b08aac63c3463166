"""Precision regimes: the one home for the bytes per parameter that the memory and communication
model charge, by what the trained program keeps and moves in which dtype.

A :class:`Precision` says, per parameter, how many bytes each resident state takes (parameter,
gradient, fp32 master copy), how many bytes a data-parallel collective moves (FSDP's all-gather
of parameters, the gradient reduction), and what transient copies exist (a unit's gathered
parameters and unsharded gradients under FSDP, autocast's low-precision weight copies). AdamW's
two moments are always fp32 (:data:`ADAMW_STATE_BYTES`). Frozen parameters
(``requires_grad=False``) take the parameter bytes only: no gradient, master copy, optimizer state
or gradient traffic.

The regimes of autopar's emitted ``train.py``
(``codegen/runtime/autopar_runtime/data_parallel.py``):

  fp32            everything fp32: 4 (param) + 4 (grad) + 8 (AdamW) bytes per parameter;
                  collectives move 4 bytes per parameter.
  fsdp2-bf16      bf16 where FSDP2 applies (:func:`uses_fsdp2`): ``MixedPrecisionPolicy(
                  param_dtype=bf16, reduce_dtype=fp32)``. Sharded parameters, gradients and
                  AdamW state fp32 (4 + 4 + 8, divided by the shard count); a unit's parameters
                  are all-gathered in bf16 (2 bytes moved and held unsharded per parameter),
                  autograd makes its unsharded gradients in bf16 (2), which FSDP2 copies into a
                  fresh fp32 reduce-scatter input (4: ``foreach_reduce`` allocates it in
                  ``reduce_dtype``, then frees the bf16 gradients) and reduce-scatters in fp32 (4
                  moved); the fp32 output is the sharded gradient itself (no copy: orig_dtype is
                  fp32). HSDP's all-reduce over dp moves the fp32 shard.
  autocast-bf16   bf16 where FSDP2 does not apply (DDP, TP alone, a pipeline alone, one rank):
                  fp32 parameters, gradients and AdamW state (4 + 4 + 8), the forward under
                  ``torch.autocast(bf16)``: each matmul weight is cast to a bf16 copy (2 bytes per
                  parameter) that the op saves for backward, so the copies of all the rank's
                  weights are alive from the forward to their backward; DDP all-reduces the fp32
                  gradients (4 moved, and its buckets hold a 4-byte copy). Its activations are
                  what autocast saves (``Precision.autocast``): the residual stream, norms and
                  dropout masks in fp32, measured beside the cast model's by a bf16 trace.

And the regime of the published systems that ``benchmarks/published_runs.py`` predicts (never
what autopar emits):

  megatron-bf16   Megatron-LM's bf16 mixed precision: bf16 parameters (2), fp32 main gradients
                  (4: gradients are accumulated and all-reduced in fp32), fp32 master weights and
                  AdamW state (4 + 8); data-parallel gradient traffic in fp32 (4), parameters
                  gathered in bf16 (2). Llama 3 reports the same (FP32 gradient accumulation and
                  reduce-scatter). Megatron's data parallelism all-reduces the main-gradient
                  buffer in place (no bucket copy) and replicates TP/pipeline models without
                  FSDP; FSDP (Llama 3) only where the mesh shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

ADAMW_STATE_BYTES = 8
"""AdamW's exp_avg and exp_avg_sq, fp32, per trainable parameter."""

System = Literal["autopar", "megatron", "torchtitan"]
"""Whose training program a prediction models: autopar's emitted script, Megatron-LM's, or
torchtitan's (the published runs: benchmarks/published_runs.py). torchtitan trains in the regimes
of autopar's script (FSDP2's ``MixedPrecisionPolicy(bf16, reduce fp32)``). All three move one
tensor-parallel collective per activation for the column-parallel projections that read it
(``planner.transitions.CostInputs.shared_input``)."""


class MeshShape(Protocol):
    pp: int
    dp: int
    fsdp: int
    tp: int


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter, by state and by collective (see the module docstring)."""

    name: str
    param: int
    """a resident parameter (sharded as the plan shards), trainable or frozen."""
    grad: int
    """a resident gradient, per trainable parameter (sharded like the parameter under FSDP)."""
    master: int
    """an fp32 master copy of a low-precision parameter, per trainable parameter (0: none)."""
    gather: int
    """FSDP: an all-gathered parameter, moved and held unsharded while its unit runs."""
    unsharded_grad: int
    """FSDP: a unit's unsharded gradient as autograd makes it, before the reduction."""
    reduce: int
    """a gradient in a data-parallel reduction (all-reduce, reduce-scatter): bytes moved, and the
    bytes of the reduction's own buffer (DDP's buckets, FSDP2's reduce-scatter input)."""
    compute_copy: int = 0
    """a low-precision copy of each weight held from the forward to its backward (autocast)."""
    bucket: int = 4
    """DDP: the copy of each trainable gradient its buckets hold for the all-reduce (torch's DDP:
    the gradient dtype; Megatron-LM's DDP reduces its fp32 main-gradient buffer in place: 0)."""
    fsdp_replicas: bool = True
    """replicas of a TP model or of pipeline stages go through FSDP2 (HSDP with a shard group of
    one), as autopar's script wraps them (:func:`uses_fsdp2`); False: they are plain data
    parallel (Megatron-LM), FSDP only where the mesh shards (fsdp > 1)."""

    @property
    def autocast(self) -> bool:
        """The forward runs under ``torch.autocast`` over fp32 parameters (what makes the weight
        copies): its activations are what autocast saves (``ir.Layer.saved_bytes_autocast``: an
        fp32 residual stream, norms and dropout masks), not those of a model cast to bf16."""
        return self.compute_copy > 0

    def wraps_in_fsdp(self, mesh: MeshShape) -> bool:
        """Whether the program holds this mesh's parameters in FSDP units (the FSDP buffers)."""
        return uses_fsdp2(mesh) if self.fsdp_replicas else mesh.fsdp > 1

    def static_bytes(self, numel: float, trainable_numel: float, optimizer: str) -> float:
        """Resident parameters, gradients and optimizer state of ``numel`` parameters, of which
        ``trainable_numel`` are trainable (the frozen rest: parameter bytes only)."""
        return numel * self.param + trainable_numel * (self.grad + self.state(optimizer))

    def state(self, optimizer: str) -> int:
        """Optimizer bytes per trainable parameter: the master copy, plus AdamW's moments."""
        if optimizer == "adamw":
            return self.master + ADAMW_STATE_BYTES
        if optimizer == "sgd":  # no momentum: no state
            return self.master
        raise ValueError(f"optimizer {optimizer!r} is not one of adamw, sgd")

    @property
    def adamw_step_bytes(self) -> int:
        """Memory traffic of AdamW's step per trainable parameter: read the fp32 weight (the
        master where there is one), the gradient and both moments; write the weight and the
        moments, and the low-precision parameter where a master is kept."""
        weight = 4
        read = weight + self.grad + ADAMW_STATE_BYTES
        write = weight + ADAMW_STATE_BYTES + (self.param if self.master else 0)
        return read + write

    def fsdp_unit_bytes(self, numel: float, trainable_numel: float) -> float:
        """FSDP's transient bytes for a unit of ``numel`` parameters (``trainable_numel`` of
        them get gradients), the larger of its two moments: in a unit's backward, its gathered
        parameters, the next unit's (prefetched) and the unit's unsharded gradients; then, the
        unit resharded (FSDP2 reshards before it reduces), the prefetched unit, the unsharded
        gradients and the reduce-scatter input they are copied into."""
        grads = trainable_numel * self.unsharded_grad
        backward = 2 * numel * self.gather + grads
        reducing = numel * self.gather + grads + trainable_numel * self.reduce
        return max(backward, reducing)


FP32 = Precision("fp32", param=4, grad=4, master=0, gather=4, unsharded_grad=4, reduce=4)
FSDP2_BF16 = Precision("fsdp2-bf16", param=4, grad=4, master=0, gather=2, unsharded_grad=2,
                       reduce=4)  # fmt: skip
AUTOCAST_BF16 = Precision("autocast-bf16", param=4, grad=4, master=0, gather=4, unsharded_grad=4,
                          reduce=4, compute_copy=2)  # fmt: skip
MEGATRON_BF16 = Precision("megatron-bf16", param=2, grad=4, master=4, gather=2, unsharded_grad=2,
                          reduce=4, bucket=0, fsdp_replicas=False)  # fmt: skip
MEGATRON_FP32 = Precision("megatron-fp32", param=4, grad=4, master=0, gather=4, unsharded_grad=4,
                          reduce=4, bucket=0, fsdp_replicas=False)  # fmt: skip

REGIMES = {r.name: r for r in (FP32, FSDP2_BF16, AUTOCAST_BF16, MEGATRON_BF16, MEGATRON_FP32)}


def uses_fsdp2(mesh: MeshShape) -> bool:
    """Whether the emitted script wraps the model in FSDP2 ``fully_shard``: to shard (fsdp > 1),
    and to replicate a TP model or pipeline stages (dp > 1 with tp > 1 or pp > 1: HSDP with a
    shard group of one), where DDP would break, and under expert parallelism (ep > 1: the
    experts are FSDP2 units over their own ranks). The one home of the rule: the cost model
    charges by it, ``planner.rules.data_parallel`` names it, and emit writes that name as
    ``DATA_PARALLEL``, which the emitted runtime executes without re-deriving it."""
    if getattr(mesh, "cp", 1) > 1 or getattr(mesh, "ep", 1) > 1:  # fsdp x cp; experts' units
        return True
    return mesh.fsdp > 1 or (mesh.dp > 1 and (mesh.tp > 1 or mesh.pp > 1))


def precision(dtype: str, mesh: MeshShape, system: System = "autopar") -> Precision:
    """The regime a plan of compute ``dtype`` on ``mesh`` trains in (see the module docstring)."""
    if system == "megatron":
        return MEGATRON_BF16 if dtype == "bf16" else MEGATRON_FP32
    if system not in ("autopar", "torchtitan"):
        raise ValueError(f"system {system!r} is not one of autopar, megatron, torchtitan")
    if dtype == "fp32":
        return FP32
    if dtype == "bf16":
        return FSDP2_BF16 if uses_fsdp2(mesh) else AUTOCAST_BF16
    raise ValueError(f"dtype {dtype!r} is not one of fp32, bf16")


def floor_precision(dtype: str, system: System = "autopar") -> Precision:
    """The regime with the fewest static bytes per parameter among those ``dtype`` may train
    in on any mesh (for lower bounds before a mesh is chosen)."""
    candidates = [precision(dtype, _Mesh(fsdp=f), system) for f in (1, 2)]
    return min(candidates, key=lambda r: r.static_bytes(1, 1, "adamw"))


@dataclass(frozen=True)
class _Mesh:
    pp: int = 1
    dp: int = 1
    fsdp: int = 1
    tp: int = 1
