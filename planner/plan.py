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
from autopar.planner.groups import pipeline_blocks, rank_capacity_bytes
from autopar.planner.rules import MeshFacts, Refusal, mesh_rule
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    model_validator,
)

from autopar.errors import UserError

PLAN_VERSION = 1

KV_STYLE_HEADS = range(2, 17)
"""kv head counts a ``colwise_kv_heads<n>`` style names (the runtime's ``TP_STYLES`` has each)."""

TPStyle = Literal[  # type: ignore[valid-type]
    "colwise",
    "colwise_from_seq",
    "colwise_dtensor",
    "colwise_from_seq_dtensor",
    "colwise_fused2_dtensor",
    "colwise_fused3_dtensor",
    "colwise_from_seq_fused2_dtensor",
    "colwise_from_seq_fused3_dtensor",
    "colwise_gather",
    "colwise_gather_heads",
    "colwise_fused_heads",
    *(f"colwise_kv_heads{n}" for n in KV_STYLE_HEADS),
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
- ``colwise_gather_heads``: the same, for a one-head kv projection each rank reads only on its
  local query heads (multi-query attention): its output's gradient is summed over the TP group
  (``to_local(grad_placements=[Partial()])``, reduce-scattered in backward).
- ``colwise_fused_heads``: a fused q/k/v projection with fewer kv heads than tp (HF Falcon's
  ``query_key_value``: its first ``in_features`` rows the query heads, the other rows the kv
  heads), Megatron's way: its weight ``Shard(0)`` like any colwise weight, its output
  all-gathered and each rank keeping its query heads' columns and every kv head's (the kv heads
  whole on every rank); the output's gradient, a partial sum per rank, reduce-scattered.
- ``colwise_kv_heads<n>`` (n = 2..16): a kv projection of n heads, fewer than tp (grouped-query
  attention), Megatron's way: its weight ``Shard(0)``, its output all-gathered and rank r keeping
  kv head ``r // (tp / n)``, the one its query heads read; the output's gradient, a partial sum
  per rank, reduce-scattered. The module's head counts (``module_attrs``): kv heads 1, query
  heads per kv head the rank's query heads.
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
    grad_norm: NonNegativeFloat = 0.0
    """the loop's total gradient norm and the step's totals all-reduced over the world
    (cost_model.step.grad_norm_s)."""

    @property
    def total(self) -> float:
        return self.compute + self.exposed_comm + self.bubble + self.optimizer + self.grad_norm

    def parts(self) -> dict[str, float]:
        """Disjoint parts that sum to :attr:`total`: compute less recompute, recompute, the
        exposed communication per mesh axis, the bubble, the optimizer and the gradient norm."""
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
            **({"grad_norm": self.grad_norm} if self.grad_norm else {}),
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
    """the busiest ep rank's tokens over the mean, assumed (cost_model.experts.IMBALANCE; 1
    where every block runs each expert on every token)."""
    all_to_all_s: NonNegativeFloat
    """predicted all-to-all seconds per step on one rank (every block, microbatch, fwd + bwd)."""
    expert_bytes_per_rank: NonNegativeInt
    """parameters + gradients + optimizer state of the experts one rank holds."""
    expert_bytes_at_ep1: NonNegativeInt
    """the same without expert parallelism (ep = 1, the rest of the mesh alike)."""


NO_FILE = "<no file>"
"""``ModelRef.file``'s prefix for a model planned from a class no file defines (a notebook's,
``python -c``'s): it plans and explains; emitting needs a file (``NO_FILE: module.Class``)."""


class Coupled(_Frozen):
    """One place where the model or its loss mixes the samples of a batch (``ir.coupling``)."""

    kind: Literal["batch_norm", "batch_product", "routing"]
    """batch norm in training mode; a batch x batch product; a MoE router's batch statistics."""
    where: str
    """the module FQN, or ``loss_fn``."""
    op: str
    """the aten op (for ``routing``: the MoE block)."""
    module_type: str = ""
    source: str | None = None
    """``file:line`` where known."""


class BatchCoupling(_Frozen):
    """What couples the samples of a batch, and what the emitted program does about it."""

    couplings: list[Coupled] = []
    sync_batchnorm: bool = False
    """--sync-batchnorm: batch norms take their statistics over the data-parallel ranks."""
    gather_loss: bool = False
    """loss_fn takes ``gather`` and the plan is data parallel: the program passes it one."""
    verify_reference: Literal["global batch", "rank slices"] = "global batch"
    """what --verify's single-process reference trains on per step: the global batch whole, or
    (a MoE's load-balancing statistic, per slice by design) each data-parallel rank's slice."""
    warnings: list[str] = []
    """one line per coupling the plan leaves in place: what it mixes, over how many samples,
    and the fix (planner.request.batch_coupling_rule)."""


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


class GroupOrder(_Frozen):
    """One order of the groups on the pipeline that the search tried for the chosen mesh."""

    groups: list[NonNegativeInt]
    """the groups from the first pipeline rank to the last, each once."""
    step_time_s: NonNegativeFloat | None = None
    """its best step time at the chosen plan's other settings (mesh, offload, checkpointing
    bound); None where it lost before one was computed (``why``)."""
    why: str = ""
    """why it has no step time: no stage plan fits, or its lower bound already lost."""


class MixedCluster(_Frozen):
    """A cluster of several kinds of nodes (``cluster.groups``): where the plan uses each
    group's own speed, and what treating the cluster as uniform would predict."""

    group_time_scales: list[PositiveFloat]
    """per node group, its time for the model's work over the uniform device's."""
    pipeline_groups: list[NonNegativeInt] | None = None
    """per pipeline rank, the group that runs it (stages sized to its speed and memory), in the
    order of the groups the search found fastest (each group's ranks together; the program
    builds its mesh so: ``planner.groups.pipeline_blocks``); None: the pipeline ranks do not
    each lie in one group (or pp = 1)."""
    pipeline_orders: list[GroupOrder] = []
    """every order of the groups on the pipeline that the search tried for this mesh
    (``planner.groups.pipeline_orders``), in the order tried (rank order first)."""
    batch_shares: list[PositiveInt] | None = None
    """per data-parallel rank, its samples per step (proportional to its speed; summing to the
    global batch); None: an even split."""
    uniform_step_time_s: NonNegativeFloat | None = None
    """the best plan's step time on the same cluster treated as uniform (the slowest group's
    device everywhere); None where that search found no plan."""

    @model_validator(mode="before")
    @classmethod
    def _reversed_is_in_the_groups(cls, data: object) -> object:
        """Plans written before any order of the groups: their ``pipeline_reversed`` is already
        the order of ``pipeline_groups``, which now says it alone."""
        if isinstance(data, dict) and "pipeline_reversed" in data:
            data = {k: v for k, v in data.items() if k != "pipeline_reversed"}
        return data


class Plan(_Frozen):
    """A parallelization plan: the one plan type (``autopar.Plan``). JSON keys are the contract
    in ARCHITECTURE.md. Data, JSON, summary and explanation here; the actions that need codegen
    or a trace (``why_not``, ``report``, ``apply``, ``local_batch``, ``emit``) are functions of
    ``autopar._plan``, attached as methods when ``autopar`` loads them."""

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
    fsdp_root: list[FQN] = []
    """planned layers that FSDP2's root unit holds instead of a unit of their own, gathered for
    the whole step: each holds a parameter that a module or an op outside it reads too (a tied
    weight, ``head.weight = wte.weight``, or ``F.linear(x, self.wte.weight)`` at the root).
    Absent from the JSON where empty."""
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
    mixed_cluster: MixedCluster | None = None
    """set on a cluster of several kinds of nodes (``cluster.groups``)."""
    """set when mesh.ep > 1 (absent from the JSON otherwise)."""
    batch_coupling: BatchCoupling | None = None
    """set when the model or its loss couples the samples of a batch (absent from the JSON
    otherwise)."""

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
    def _batch_shares_fit(self) -> Plan:
        """A hand edit of uneven batch shares: one per data-parallel rank, each a multiple of
        the accumulation steps, summing to the global batch; only without a pipeline."""
        mixed = self.mixed_cluster
        shares = mixed.batch_shares if mixed is not None else None
        if shares is None:
            return self
        ranks = self.mesh.dp * self.mesh.fsdp
        steps = self.schedule.num_microbatches
        if len(shares) != ranks or sum(shares) != self.training.global_batch:
            raise ValueError(
                f"mixed_cluster.batch_shares {shares} must give each of the {ranks} data-parallel "
                f"ranks a share, summing to the global batch {self.training.global_batch}"
            )
        if self.mesh.pp > 1 or any(x % steps for x in shares):
            raise ValueError(
                f"mixed_cluster.batch_shares {shares}: uneven shares need pp = 1 and shares that "
                f"are multiples of the {steps} accumulation steps"
            )
        return self

    @model_validator(mode="after")
    def _pipeline_groups_fit(self) -> Plan:
        """A hand edit of the groups' order on the pipeline: a placement of this mesh's
        pipeline blocks on this cluster (:func:`planner.groups.pipeline_blocks`)."""
        mixed = self.mixed_cluster
        if mixed is not None and mixed.pipeline_groups is not None:
            pipeline_blocks(self.cluster, self.mesh, mixed.pipeline_groups)
        return self

    @property
    def rank_capacity_bytes(self) -> tuple[int, ...]:
        """Per pipeline rank, the device memory it may fill: its group's on a mixed cluster's
        pipeline, else the device's (:func:`planner.groups.rank_capacity_bytes`)."""
        mixed = self.mixed_cluster
        placed = mixed.pipeline_groups if mixed is not None else None
        return rank_capacity_bytes(self.cluster, placed, self.mesh.pp)

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
        """fsdp_root names planned layers; cp > 1 comes with its ContextParallel at a layer of
        the plan, ep > 1 with its ExpertParallel (and cp = 1, ep = 1 without); and the mesh keeps the mesh rules that
        the plan's own sections state (:func:`planner.rules.mesh_rule`: context parallelism
        without a pipeline, ep dividing the experts and dp x fsdp). The rules that read the
        cluster and training (:meth:`mesh_refusal`) are checked by ``--plan`` and ``emit``."""
        cp, ep = self.context_parallel, self.expert_parallel
        stray = next((fqn for fqn in self.fsdp_root if fqn not in self.layers), None)
        if stray is not None:
            raise ValueError(f"fsdp_root lists {stray!r}, which is not a planned layer")
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
        """A readable table: mesh, predicted step time, throughput, memory, planning time
        (:func:`planner.summary.summary`)."""
        from autopar.planner.summary import summary

        return summary(self)

    def to_json(self) -> str:
        # pinned_tp / context_parallel / expert_parallel / fsdp_root only where set: other plans' JSON
        # reads as before those fields
        absent = {"pinned_tp"} if self.pinned_tp is None else set()
        if self.context_parallel is None:
            absent.add("context_parallel")
        if self.expert_parallel is None:
            absent.add("expert_parallel")
        if not self.fsdp_root:
            absent.add("fsdp_root")
        if self.batch_coupling is None:
            absent.add("batch_coupling")
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

    def save(self, directory: str | Path) -> Path:
        """Write ``plan.json`` into ``directory`` (created if missing), atomically; returns its
        path."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        out = path / "plan.json"
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(self.to_json() + "\n")  # the bytes emit writes
        tmp.replace(out)
        return out

    def explain(self) -> str:
        """The step-time and memory breakdowns, and the alternatives with why each lost
        (:func:`autopar.planner.explain.explain` returns the same as data)."""
        from autopar.planner.explain import explain

        return explain(self).text

    # why_not, report, apply, local_batch and emit need the packages above the planner: they
    # are functions of autopar._plan (the home of autopar.Plan), which attaches them here.
