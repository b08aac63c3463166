"""The plan: frozen, validated, versioned data in torch's own vocabulary.

A plan names modules by their FQNs and TP styles by the names below, never by solver indices, so
that a person can read it and codegen can turn it into ``parallelize_module`` / ``fully_shard``
calls. ``Plan.from_json(p.to_json()) == p`` holds exactly.
"""

from __future__ import annotations

import bisect
import functools
import re
import unicodedata
from pathlib import Path
from typing import Annotated, Literal

from autopar.cost_model import Cluster, MemoryBreakdown
from autopar.cost_model.versioned import parse_versioned
from autopar.planner import schedules
from autopar.planner.rules import MeshFacts, Refusal, mesh_rule
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveInt,
    model_validator,
)

from autopar.errors import UserError

PLAN_VERSION = 1

TPStyle = Literal[
    "colwise",
    "colwise_from_seq",
    "colwise_dtensor",
    "colwise_from_seq_dtensor",
    "colwise_fused2_dtensor",
    "colwise_fused3_dtensor",
    "colwise_from_seq_fused2_dtensor",
    "colwise_from_seq_fused3_dtensor",
    "colwise_gather",
    "colwise_from_seq_gather",
    "rowwise",
    "rowwise_to_seq",
    "rowwise_from_replicate",
    "rowwise_from_replicate_to_seq",
    "sequence_parallel",
    "sequence_parallel_local",
    "sequence_parallel_gather",
    "heads_parallel_local",
    "sequence_scatter",
]
"""Tensor-parallel styles, as codegen spells them:

- ``colwise``: ``ColwiseParallel()``; input replicated, output sharded on the last dim (local).
- ``colwise_from_seq``: ``ColwiseParallel(input_layouts=Shard(1))``: all-gathers a
  sequence-sharded input first.
- ``colwise_dtensor``, ``colwise_from_seq_dtensor``: the same with ``use_local_output=False``,
  in an attention block whose views name full sizes (``Graph.dtensor_blocks``): its output a
  DTensor of full shape, so the block's own ops run on DTensors (its buffers lent as replicated
  DTensors for the call) up to its rowwise linear.
- ``colwise_fused{k}_dtensor``, ``colwise_from_seq_fused{k}_dtensor`` (k = 2, 3): the same for a
  fused linear whose output the block splits into k equal pieces (nanoGPT's ``c_attn`` into q,
  k, v): its weight rows ``_StridedShard(0, split_factor=k)``, so each rank holds its slice of
  every piece and the split hands out pieces sharded alike.
- ``colwise_gather``: ``ColwiseParallel(output_layouts=Replicate())``: output all-gathered.
- ``colwise_from_seq_gather``: ``ColwiseParallel(input_layouts=Shard(1),
  output_layouts=Replicate())``: a head after sequence parallelism, logits gathered.
- ``rowwise``: ``RowwiseParallel()``; input sharded on the last dim, output all-reduced.
- ``rowwise_to_seq``: ``RowwiseParallel(output_layouts=Shard(1))``: output reduce-scattered on
  the sequence dim.
- ``rowwise_from_replicate`` (Embedding: vocab-sharded table):
  ``RowwiseParallel(input_layouts=Replicate())``, output all-reduced.
- ``rowwise_from_replicate_to_seq``: same, output reduce-scattered on the sequence dim.
- ``sequence_parallel``: ``SequenceParallel()`` on a norm: input and output sharded on dim 1.
- ``sequence_parallel_local``: ``SequenceParallel(use_local_output=True)``: the output a local
  sequence shard (for plain ops after the norm).
- ``sequence_parallel_gather``: ``SequenceParallel`` with its output all-gathered along the
  sequence into a replicated DTensor, once for every colwise linear reading it (Megatron's g).
- ``heads_parallel_local``: ``SequenceParallel(sequence_dim=2, use_local_output=True)`` on a
  per-head norm (Qwen3's q_norm/k_norm) reading local heads of a ``(batch, seq, heads,
  head_dim)`` view: its weight replicated, its gradient all-reduced over the TP group.
- ``sequence_scatter`` (a layer): its first positional input, replicated, split along dim 1 on
  entry (no communication; the gradient all-gathered): where the sequence-parallel region
  starts.
"""

ModuleKind = Literal["linear", "embedding", "norm", "layer"]
"""The module kinds tensor parallelism styles (``torch.nn`` Linear and Embedding; norms, any
module the planner recognises as one from its traced ops; layers where the sequence-parallel
region can start), each taking the styles :data:`planner.layouts.MODULE_STYLES` lists for it."""

ScheduleName = Literal[("none", *schedules.SCHEDULES)]  # type: ignore[valid-type]
"""``none`` without a pipeline, else a schedule of the table (:data:`planner.schedules.RULES`)."""
CheckpointMode = Literal["none", "full"]

_FQN_PART = re.compile(r"[\w-]+")


def is_fqn(value: str) -> bool:
    """``""`` (the root) or dot-joined module names of letters, digits, ``_`` and ``-``
    (``blocks.0.attn``, a ModuleDict's ``layer-1``)."""
    return not value or all(_FQN_PART.fullmatch(part) for part in value.split("."))


def _check_fqn(value: str) -> str:
    """Plans may be edited by hand and are turned into code: a module FQN that is anything else
    (``__import__('os')``, quotes, spaces, parentheses) is refused on load, not merely quoted."""
    if not is_fqn(value):
        raise ValueError(
            f"{value!r} is not a module FQN (dot-joined names of letters, digits, '_' and '-', "
            "e.g. 'blocks.0.attn')"
        )
    return value


def _check_identifier(value: str) -> str:
    if not value.isidentifier():
        raise ValueError(f"{value!r} is not a Python identifier")
    return value


FQN = Annotated[str, AfterValidator(_check_fqn)]
Identifier = Annotated[str, AfterValidator(_check_identifier)]


def _check_attr_name(value: str) -> str:
    """``module_attrs`` become ``setattr(module, name, int)`` in the emitted script: a private or
    dunder name, or one of nn.Module's own attributes (methods, ``training``), would replace
    machinery rather than set a count."""
    _check_identifier(value)
    if value.startswith("_") or value in _module_attribute_names():
        raise ValueError(
            f"{value!r} is a private, dunder or nn.Module attribute, not a count codegen may set "
            "(module_attrs hold int attributes such as n_head)"
        )
    return value


@functools.cache
def _module_attribute_names() -> frozenset[str]:
    from torch import nn

    return frozenset(dir(nn.Module)) | {"training"}


AttrName = Annotated[str, AfterValidator(_check_attr_name)]


def _control_character(value: object, where: str = "") -> str | None:
    """The first string (key or value) in raw plan data holding a control character (NUL,
    newline, escape, ...), as ``"where: the character"``; None when there is none."""
    if isinstance(value, str):
        for ch in value:
            if unicodedata.category(ch) == "Cc":
                return f"{where or 'a string'} holds the control character {ch!r}"
        return None
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list | tuple)
        else ()
    )
    for key, item in items:
        here = f"{where}.{key}" if where else str(key)
        found = _control_character(key, f"a key in {where or 'the plan'}") or _control_character(
            item, here
        )
        if found:
            return found
    return None


class _Frozen(BaseModel):
    # No inf/NaN: JSON has no spelling for them (they would save as null and not load back).
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class PlanError(UserError):
    """A plan file that cannot be loaded (bad JSON, wrong version, invalid fields)."""


class Mesh(_Frozen):
    """Parallel degrees. Their product is the world size; axes nest as (pp, dp, fsdp, tp)."""

    pp: PositiveInt = 1
    """pipeline stages."""
    dp: PositiveInt = 1
    """replicate axis: DDP, or the replicate dim of HSDP."""
    fsdp: PositiveInt = 1
    """shard axis: FSDP2 ``fully_shard``."""
    cp: PositiveInt = 1
    """context parallel: the sequence split over cp ranks, attention exchanging keys/values
    (see :class:`ContextParallel`); parameters FSDP-sharded over fsdp x cp (replicated over
    dp), gradients reduced over dp x fsdp x cp."""
    ep: PositiveInt = 1
    """expert parallel: each MoE block's experts split over ep ranks, tokens exchanged with
    all-to-all. Carved out of the data-parallel ranks (ep divides dp x fsdp, from fsdp first), so
    not a factor of the world size (see :mod:`cost_model.experts`)."""
    tp: PositiveInt = 1
    """tensor parallel (innermost: ranks of one TP group are adjacent, inside a node)."""

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.fsdp * self.cp * self.tp

    @property
    def data_parallel(self) -> int:
        """ranks that see different data."""
        return self.dp * self.fsdp

    def short(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.model_dump().items() if v > 1) or "single"


class Schedule(_Frozen):
    name: ScheduleName = "none"
    """pipeline schedule; ``none`` without pipeline parallelism."""
    num_microbatches: PositiveInt = 1
    stages_per_rank: PositiveInt = 1


class TimeBreakdown(_Frozen):
    """Predicted seconds per step, by part; ``step_time_s`` is their sum."""

    compute: NonNegativeFloat
    """forward + backward compute, TP-sharded where the plan shards (recompute included)."""
    exposed_comm: NonNegativeFloat
    """communication on the critical path: TP collectives, and DP/FSDP traffic not hidden."""
    bubble: NonNegativeFloat
    optimizer: NonNegativeFloat
    tp_comm: NonNegativeFloat = 0.0
    """of which: tensor-parallel collectives."""
    dp_comm: NonNegativeFloat = 0.0
    """of which: data-parallel gradient reduction and FSDP gathers left exposed."""
    pp_comm: NonNegativeFloat = 0.0
    """of which: pipeline send/recv on the critical path and the pipeline runtime's overhead."""
    cp_comm: NonNegativeFloat = 0.0
    """of which: context parallel's key/value exchange in attention (cp > 1)."""
    ep_comm: NonNegativeFloat = 0.0
    """of which: expert parallel's token all-to-alls (dispatch and combine, fwd and bwd)."""
    recompute: NonNegativeFloat = 0.0
    """of compute: the forward re-run of activation-checkpointed layers."""

    @property
    def total(self) -> float:
        return self.compute + self.exposed_comm + self.bubble + self.optimizer

    def parts(self) -> dict[str, float]:
        """Disjoint parts that sum to :attr:`total`: compute less recompute, recompute, the
        exposed communication per mesh axis, the bubble and the optimizer."""
        comm = self.tp_comm + self.dp_comm + self.pp_comm + self.cp_comm + self.ep_comm
        out = {
            "compute": self.compute - self.recompute,
            "recompute": self.recompute,
            "tp_comm": self.tp_comm,
            **({"cp_comm": self.cp_comm} if self.cp_comm else {}),
            "dp_comm": self.dp_comm,
            "pp_comm": self.pp_comm,
            **({"ep_comm": self.ep_comm} if self.ep_comm else {}),
            "bubble": self.bubble,
            "optimizer": self.optimizer,
        }
        if self.exposed_comm - comm > 1e-12 * max(1.0, self.exposed_comm):
            out["other_comm"] = self.exposed_comm - comm  # plans written by hand
        return out


class StagePrediction(_Frozen):
    """One (virtual) pipeline stage, per microbatch; one stage of all layers without a pipeline."""

    rank: NonNegativeInt
    """the pipeline rank that runs it."""
    fwd_s: NonNegativeFloat
    bwd_s: NonNegativeFloat
    """input + weight gradients."""
    bwd_weight_s: NonNegativeFloat = 0.0
    """of which: weight gradients (zero-bubble schedules run them apart)."""
    recompute_s: NonNegativeFloat = 0.0
    """forward re-run of its checkpointed layers, in backward."""
    memory_bytes: NonNegativeInt
    """static state + activations of the microbatches in flight."""
    in_flight: NonNegativeFloat
    """microbatches whose activations it holds at its rank's peak."""


class Predicted(_Frozen):
    step_time_s: NonNegativeFloat
    peak_memory_bytes: NonNegativeInt
    memory_breakdown_bytes: MemoryBreakdown
    tokens_per_s: NonNegativeFloat | None = None
    samples_per_s: NonNegativeFloat
    mfu: NonNegativeFloat
    """model FLOPs utilisation: model fwd+bwd FLOPs per step / (step time x world x peak)."""
    time_breakdown_s: TimeBreakdown
    stages: list[StagePrediction] = []
    """per (virtual) stage, in pipeline order: what the step time was built from."""
    rank_memory_bytes: list[MemoryBreakdown] = []
    """memory by kind on each pipeline rank (rank 0 first)."""


LostBy = Literal["slower", "idle_tp", "pruned", "memory", "constraint"]
"""Why an alternative lost: ``slower`` (a cost part), ``idle_tp`` (its TP group shards nothing),
``pruned`` (its lower bound already loses), ``memory`` (does not fit), ``constraint`` (ruled
out: divisibility, heads, schedule rules)."""


class Alternative(_Frozen):
    """Another candidate the search evaluated, and why it lost."""

    mesh: Mesh
    step_time_s: NonNegativeFloat
    """0 when ruled out before scoring; a lower bound when pruned."""
    peak_memory_bytes: NonNegativeInt
    fits: bool
    why: str
    """the cost part that differs from the chosen plan, or the constraint that ruled it out."""
    lost_by: LostBy | None = None
    time_breakdown_s: TimeBreakdown | None = None
    """where it was fully scored."""
    memory_breakdown_bytes: MemoryBreakdown | None = None
    schedule: Schedule | None = None


class ContextParallel(_Frozen):
    """How the emitted program runs context parallelism (mesh.cp > 1)."""

    form: Literal["allgather-kv"] = "allgather-kv"
    """``allgather-kv``: each rank keeps its share of the sequence; every attention call
    all-gathers keys and values over the cp group (reduce-scatters their gradients in backward)
    and attends its local queries to them (torch's context_parallel with rotate method
    "allgather", implemented in the emitted runtime: torch 2.13's own has no CPU SDPA rule)."""
    load_balance: Literal["head-tail"] = "head-tail"
    """the sequence cut into 2 cp chunks, rank r holding chunks r and 2 cp - 1 - r, so that
    causal attention gives every rank the same work."""
    shard_at: FQN
    """the first layer with attention: the sequence is split at its input (the layers before
    it, the embeddings, run on the whole sequence), and stays split to the loss."""


class PinnedTP(_Frozen):
    """The user pinned tp (``--mesh tp=N``): every module that can be sharded at that degree is
    (the cheapest such choice, not the cheapest overall), so the TP group never just repeats
    work. What that costs, against the cost model's own choice on the same mesh."""

    sharded_modules: NonNegativeInt
    """modules whose weights the plan shards across the TP group."""
    free_sharded_modules: NonNegativeInt
    """modules the cost model's own choice on the same mesh shards (0: it would shard none)."""
    free_step_time_s: NonNegativeFloat | None
    """predicted step time of that choice (None: it does not fit)."""
    free_peak_memory_bytes: NonNegativeInt | None
    """its predicted peak memory per device (None: not scored)."""


class ExpertParallel(_Frozen):
    """How the plan runs its mixture-of-experts blocks (mesh.ep > 1): what the emitted program
    and the explanation need, recorded at plan time."""

    blocks: dict[FQN, list[FQN]]
    """MoE block FQN -> its expert modules: one per expert (a ModuleList's children), or the one
    module holding stacked expert weights (first dim = experts)."""
    routers: dict[FQN, FQN]
    """MoE block FQN -> the gate module whose scores are routed."""
    num_experts: PositiveInt
    top_k: PositiveInt
    grouped: bool
    """expert weights stacked (HF Mixtral/Qwen3-MoE, torchtitan) rather than a module each."""
    imbalance: float = Field(gt=0)
    """the busiest ep rank's tokens over the mean, assumed (cost_model.experts.IMBALANCE)."""
    all_to_all_s: NonNegativeFloat
    """predicted all-to-all seconds per step on one rank (every block, microbatch, fwd + bwd)."""
    expert_bytes_per_rank: NonNegativeInt
    """parameters + gradients + optimizer state of the experts one rank holds."""
    expert_bytes_at_ep1: NonNegativeInt
    """the same without expert parallelism (ep = 1, the rest of the mesh alike)."""


NO_FILE = "<no file>"
"""``ModelRef.file``'s prefix for a model planned from a class no file defines (a notebook's,
``python -c``'s): it plans and explains; emitting needs a file (``NO_FILE: module.Class``)."""


class ModelRef(_Frozen):
    file: str
    """absolute path of the model file (``hf:...`` for HuggingFace configs), or ``NO_FILE``
    followed by the class for a model whose class no file defines."""
    factory: Identifier = "build_model"

    @property
    def has_file(self) -> bool:
        """Whether a program can import the model (a file, or an HF config), not NO_FILE."""
        return not self.file.startswith(NO_FILE)


class Training(_Frozen):
    global_batch: PositiveInt
    seq_len: PositiveInt | None = None
    dtype: Literal["fp32", "bf16"] = "fp32"
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(default=1e-3, gt=0)


def _size(num_bytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes:.0f} B"


def _dp_words(mesh: Mesh) -> str:
    if mesh.cp > 1:  # parameters sharded over fsdp x cp (torchtitan's dp_shard_cp)
        shards = f"FSDP2 over fsdp {mesh.fsdp} x cp {mesh.cp} = {mesh.fsdp * mesh.cp} shards"
        return shards if mesh.dp == 1 else f"HSDP: {mesh.dp} replicas x {shards}"
    if mesh.data_parallel == 1:
        return "none"
    if mesh.fsdp == 1:
        plain = mesh.tp == 1 and mesh.pp == 1  # DDP; with TP or PP the script uses FSDP2 HSDP
        return f"DDP over {mesh.dp} replicas" if plain else f"replicated over {mesh.dp}"
    if mesh.dp == 1:
        return f"FSDP2 over {mesh.fsdp} shards"
    return f"HSDP: {mesh.dp} replicas x {mesh.fsdp} shards"


def _cp_axis(mesh: Mesh) -> str:
    return f" cp={mesh.cp}" if mesh.cp > 1 else ""


def _cp_rows(plan: Plan) -> list[tuple[str, str]]:
    """The summary's context-parallel row (cp > 1 only: other plans read as before)."""
    cp = plan.context_parallel
    if plan.mesh.cp == 1 or cp is None:
        return []
    seq = plan.training.seq_len or 0
    return [
        (
            "context parallel",
            f"sequence {seq} split {plan.mesh.cp} ways ({seq // plan.mesh.cp} tokens per rank, "
            f"{cp.load_balance} chunks) from {cp.shard_at}; attention: {cp.form}",
        )
    ]


def _ep_axis(mesh: Mesh) -> str:
    return f" ep={mesh.ep}" if mesh.ep > 1 else ""


def _ep_rows(plan: Plan) -> list[tuple[str, str]]:
    """The summary's expert-parallel row (ep > 1 only: other plans read as before)."""
    ep = plan.expert_parallel
    if ep is None:
        return []
    return [
        (
            "expert parallel",
            f"{len(ep.blocks)} MoE blocks, {ep.num_experts // plan.mesh.ep} of {ep.num_experts} "
            f"experts per rank (top-{ep.top_k}); all-to-all {ep.all_to_all_s * 1e3:.3f} ms/step "
            f"at {ep.imbalance:g}x imbalance; expert state {_size(ep.expert_bytes_per_rank)}"
            f"/rank (ep=1: {_size(ep.expert_bytes_at_ep1)})",
        )
    ]


def _pp_words(plan: Plan) -> str:
    if plan.mesh.pp == 1:
        ckpt = sum(1 for v in plan.checkpointing.values() if v == "full")
        return f"none; {ckpt} layers checkpointed" if ckpt else "none"
    s = plan.schedule
    sizes = "/".join(str(len(stage)) for stage in plan.stages)
    ckpt = sum(1 for v in plan.checkpointing.values() if v == "full")
    return (
        f"{s.name}, {s.num_microbatches} microbatches, {len(plan.stages)} stages "
        f"({s.stages_per_rank} per rank; layers {sizes}), {ckpt} layers checkpointed"
    )


def _check_style_kinds(styled: dict[str, str], kinds: dict[str, str]) -> None:
    """Each style on a module whose recorded kind takes it (one line: value, rule, fix)."""
    from autopar.planner.layouts import MODULE_STYLES, plain_style

    for fqn, style in styled.items():
        kind = kinds.get(fqn)
        if kind is None:
            raise ValueError(
                f"tensor_parallel puts {style!r} on {fqn!r}, which module_kinds does not list "
                "as a Linear, Embedding or norm of the model: styles go on those modules only; "
                "remove the entry or style a listed module"
            )
        takes = [s for s in MODULE_STYLES[kind] if s != "replicate"]
        if plain_style(style) not in takes:
            raise ValueError(
                f"tensor_parallel puts {style!r} on {fqn!r}, "
                f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} (module_kinds), which "
                f"takes only {', '.join(takes)}: change the style or remove the entry"
            )


class Plan(_Frozen):
    """A parallelization plan. JSON keys are the contract in ARCHITECTURE.md."""

    version: Literal[1] = PLAN_VERSION
    model: ModelRef
    cluster: Cluster
    training: Training
    mesh: Mesh
    layers: list[FQN]
    """ordered layer FQNs (the units FSDP and checkpointing wrap), from the trace."""
    stages: list[list[FQN]]
    """module FQNs per pipeline stage, in order; one stage without pipeline parallelism."""
    schedule: Schedule
    tensor_parallel: dict[FQN, TPStyle]
    """module FQN -> TP style; modules absent are replicated across the TP group."""
    module_attrs: dict[FQN, dict[AttrName, PositiveInt]] = {}
    """module FQN -> int attributes codegen sets under TP (e.g. local head counts)."""
    module_kinds: dict[FQN, ModuleKind] | None = None
    """module FQN -> kind, for every module of the model that tensor parallelism can style
    (``linear``, ``embedding``, ``norm``), recorded at plan time so that a hand-edited
    ``tensor_parallel`` is checked without importing the model: a style goes only on a module
    listed here, and only a style its kind takes. None (absent) in plans written before the
    field: their styles get the structural checks only."""
    checkpointing: dict[FQN, CheckpointMode]
    """layer FQN -> activation checkpointing."""
    offload: bool = False
    """FSDP2 CPU offload: parameters, gradients and optimizer state live in host memory."""
    predicted: Predicted
    planning_time_s: NonNegativeFloat
    alternatives: list[Alternative] = []
    notes: list[str] = []
    """what a reader of the plan should know: surprising choices and their reasons."""
    pinned_tp: PinnedTP | None = None
    """set when the user pinned tp > 1: the forced sharding against the free choice (absent
    from the JSON otherwise)."""
    context_parallel: ContextParallel | None = None
    """set when mesh.cp > 1 (absent from the JSON otherwise)."""
    expert_parallel: ExpertParallel | None = None
    """set when mesh.ep > 1 (absent from the JSON otherwise)."""

    @model_validator(mode="before")
    @classmethod
    def _one_line_strings(cls, data: object) -> object:
        """Plans are edited by hand and their strings land in code and shell scripts: no NUL,
        newline or other control character in any of them."""
        found = _control_character(data)
        if found:
            raise ValueError(f"{found}: plan strings are single lines of printable text")
        return data

    @model_validator(mode="after")
    def _tensor_parallel_fits(self) -> Plan:
        """What a hand edit can break in the TP styles, checked without the model: styles need
        a tp axis; a style goes on one leaf module (a Linear, Embedding or norm), never on the
        root nor on a module that holds another styled one (but ``sequence_scatter``, which
        splits a layer's input); module_attrs only on a module that
        owns a styled one (its local head counts)."""
        styled = self.tensor_parallel
        if (styled or self.module_attrs) and self.mesh.tp == 1:
            field = "tensor_parallel" if styled else "module_attrs"
            raise ValueError(
                f"{field} is set but mesh.tp is 1: tensor-parallel styles and counts need tp > 1"
            )
        ordered = sorted(styled)  # the FQNs under a prefix are one run of this order
        for fqn in styled:
            if not fqn:
                raise ValueError(
                    "tensor_parallel styles the root module '': styles go on leaf modules"
                )
            at = bisect.bisect_left(ordered, fqn + ".")
            inner = None
            if at < len(ordered) and ordered[at].startswith(fqn + "."):
                inner = next(f for f in styled if f.startswith(fqn + "."))
            if inner is not None and styled[fqn] != "sequence_scatter":  # a layer's entry
                raise ValueError(
                    f"tensor_parallel styles {fqn!r} and {inner!r}, a module inside it: a "
                    "style goes on a leaf module (Linear, Embedding, norm) only"
                )
        if self.module_kinds is not None:
            _check_style_kinds(styled, self.module_kinds)
        for fqn in self.module_attrs:
            at = bisect.bisect_left(ordered, f"{fqn}." if fqn else "")
            if at == len(ordered) or not ordered[at].startswith(f"{fqn}." if fqn else ""):
                raise ValueError(
                    f"module_attrs sets counts on {fqn!r}, which holds no tensor-parallel "
                    "module: module_attrs only go on modules whose children are sharded"
                )
        return self

    @model_validator(mode="after")
    def _sections_fit(self) -> Plan:
        """cp > 1 comes with its ContextParallel at a layer of the plan, ep > 1 with its
        ExpertParallel (and cp = 1, ep = 1 without); and the mesh keeps the mesh rules that
        the plan's own sections state (:func:`planner.rules.mesh_rule`: context parallelism
        without a pipeline, ep dividing the experts and dp x fsdp). The rules that read the
        cluster and training (:meth:`mesh_refusal`) are checked by ``--plan`` and ``emit``."""
        cp, ep = self.context_parallel, self.expert_parallel
        if (cp is None) != (self.mesh.cp == 1):
            have = "is missing" if cp is None else "is set"
            raise ValueError(f"context_parallel {have} but mesh.cp is {self.mesh.cp}")
        if cp is not None and cp.shard_at not in self.layers:
            raise ValueError(f"context_parallel.shard_at {cp.shard_at!r} is not a planned layer")
        if (ep is None) != (self.mesh.ep == 1):
            have = "is missing" if ep is None else "is set"
            raise ValueError(f"expert_parallel {have} but mesh.ep is {self.mesh.ep}")
        counts = (ep.num_experts,) if ep is not None else None
        refusal = mesh_rule(self.mesh, MeshFacts(expert_counts=counts))
        if refusal is not None:
            raise ValueError(f"mesh {self.mesh.short()}: {refusal.line()}")
        return self

    def mesh_refusal(self) -> Refusal | None:
        """The first mesh rule (:func:`planner.rules.mesh_rule`) the plan breaks with its own
        cluster, training, layers, experts and schedule (None: none): what ``--plan`` and
        ``emit`` refuse, where a hand edit broke a rule the search keeps."""
        ep, training = self.expert_parallel, self.training
        facts = MeshFacts(
            world_size=self.cluster.world_size,
            cluster=self.cluster.spec,
            devices_per_node=self.cluster.devices_per_node,
            global_batch=training.global_batch,
            seq_len=training.seq_len,
            num_layers=len(self.layers),
            expert_counts=(ep.num_experts,) if ep is not None else None,
            schedule=self.schedule.name if self.schedule.name != "none" else None,
        )
        return mesh_rule(self.mesh, facts)

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    def __str__(self) -> str:
        """``print(plan)`` shows :meth:`summary` (``repr`` keeps the fields)."""
        return self.summary()

    def summary(self) -> str:
        """A readable table: mesh, predicted step time, throughput, memory, planning time."""
        p = self.predicted
        mem = p.memory_breakdown_bytes
        cap = self.cluster.device.memory_bytes
        rate = (
            f"{p.tokens_per_s:,.0f} tokens/s"
            if p.tokens_per_s
            else f"{p.samples_per_s:,.1f} samples/s"
        )
        n_tp = len(self.tensor_parallel)
        rows = [
            ("model", f"{self.model.file}:{self.model.factory}"),
            ("cluster", f"{self.cluster.spec} ({self.world_size} x {self.cluster.device.name})"),
            (
                "mesh",
                f"{self.mesh.short()}  (pp={self.mesh.pp} dp={self.mesh.dp} "
                f"fsdp={self.mesh.fsdp}{_cp_axis(self.mesh)}{_ep_axis(self.mesh)} tp={self.mesh.tp})",
            ),
            ("data parallel", _dp_words(self.mesh)),
            *_cp_rows(self),
            *_ep_rows(self),
            ("tensor parallel", f"{n_tp} modules sharded" if n_tp else "none"),
            ("pipeline", _pp_words(self)),
            ("step time", f"{p.step_time_s * 1e3:.3f} ms (predicted)"),
            ("throughput", f"{rate}, MFU {p.mfu:.1%}"),
            (
                "memory / rank",
                f"{_size(mem.total)} of {_size(cap)} (params {_size(mem.params)}, grads "
                f"{_size(mem.grads)}, optimizer {_size(mem.optimizer)}, activations "
                f"{_size(mem.activations)}, buffers {_size(mem.buffers)})",
            ),
            ("planning time", f"{self.planning_time_s:.2f} s"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"{k:<{width}}  {v}" for k, v in rows]
        lines += [f"note: {note}" for note in self.notes]
        if self.alternatives:
            shown = self.alternatives[:5]
            meshes = [a.mesh.short() for a in shown]
            steps = [f"{a.step_time_s * 1e3:.3f} ms" if a.step_time_s else "-" for a in shown]
            w_mesh = max(len(x) for x in [*meshes, "alternative"])
            w_step = max(len(x) for x in [*steps, "step"])
            lines.append(f"{'alternative':<{w_mesh}}  {'step':>{w_step}}  why it lost")
            for a, mesh_text, step in zip(shown, meshes, steps):
                lines.append(f"{mesh_text:<{w_mesh}}  {step:>{w_step}}  {a.why}")
            if len(self.alternatives) > len(shown):
                lines.append(f"(+{len(self.alternatives) - len(shown)} more: plan ... --explain)")
        return "\n".join(lines)

    def to_json(self) -> str:
        # pinned_tp / context_parallel / expert_parallel only where set: other plans' JSON
        # reads as before those fields
        absent = {"pinned_tp"} if self.pinned_tp is None else set()
        if self.context_parallel is None:
            absent.add("context_parallel")
        if self.expert_parallel is None:
            absent.add("expert_parallel")
        return self.model_dump_json(indent=2, exclude=absent or None)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Parse and validate a plan; raises :class:`PlanError` with one line on any problem."""
        return parse_versioned(
            text,
            cls,
            PLAN_VERSION,
            error=PlanError,
            kind="plan",
            regenerate="regenerate it with `plan ... --out DIR`",
            field_fix="fix that field or regenerate the plan",
        )

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_json(Path(path).read_text())
