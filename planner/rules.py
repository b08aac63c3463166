"""The rules a parallel mesh obeys, one home for each (torchtitan's ``ParallelDims._validate``):
:func:`mesh_rule` is the one function that the request validation (pinned axes), the mesh
enumeration, ``--plan`` loading and ``emit`` all call.

A rule reads the mesh's degrees and the :class:`MeshFacts` its caller knows (the cluster, the
training setup, the model, the schedule); a fact left unknown (None) leaves its rules
unchecked, and an axis absent from a partial mesh (the user's pins) is free: its rules wait
for it. Every refusal is a :class:`Refusal`: the value and the rule (``why``, also what the
search shows for a mesh it ruled out) and the fix.

Two kinds of rules. Those of the cluster's and the model's structure (the product of the
degrees, tp within a node, a stage per layer at least, context parallelism without a pipeline
and only where the model can split its sequence, expert parallelism over stacked experts
carved out of the data-parallel ranks) shape the enumeration: a mesh that breaks one is never
a candidate. Those of the training setup (the batch split, the sequence split, tied layers,
attention heads, a schedule that composes with data parallelism) rule out a candidate the
search still lists among the alternatives, with the reason (``Refusal.listed``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from autopar.cost_model.precision import MeshShape, uses_fsdp2
from autopar.planner import schedules

AXES = ("pp", "dp", "fsdp", "cp", "ep", "tp")
CARVED = ("ep",)
"""axes carved out of the others' ranks (ep out of dp x fsdp): pinned like the others, but
not factors of the world size nor of the rank layout."""


@dataclass(frozen=True)
class MeshFacts:
    """What the rules read besides the degrees; None (or empty) where the caller does not
    know it, and that fact's rules are then not checked."""

    world_size: int | None = None
    cluster: str | None = None
    """the cluster's spec, as the user wrote it (``cpu:4``), for the messages."""
    devices_per_node: int | None = None
    global_batch: int | None = None
    seq_len: int | None = None
    num_layers: int | None = None
    heads: tuple[int, ...] = ()
    """head counts of the model's attention calls (tp divides each)."""
    fused_blocks: tuple[tuple[str, tuple[int, ...], str], ...] = ()
    """attention blocks with a fused q/k/v projection: (FQN, the tp degrees that split it, its
    heads in words), ``request.fused_blocks``."""
    tied: str = ""
    """two layers that read one (tied) parameter, in words (``request.tied_layers``): a pipeline
    cannot cut between them ("": no two layers do)."""
    cp_model_why: str | None = None
    """why the model cannot split its sequence at all (``request.cp_model_rule``), or None."""
    expert_counts: tuple[int, ...] | None = None
    """the MoE blocks' expert counts (() without MoE blocks; None: not known)."""
    listed_experts: str | None = None
    """a MoE block whose experts the emitted program cannot split, and why (``block: why``,
    ``ir._moe.ep_why``: stacked experts sharing their module with other weights, a module
    list's experts called in a way record and replay cannot reproduce)."""
    schedule: str | None = None
    """the pipeline schedule (``schedules.RULES``), where one is fixed."""


@dataclass(frozen=True)
class Refusal:
    """Why a mesh (or a partial one: the pins) is ruled out."""

    why: str
    """the value and the rule broken."""
    fix: str = ""
    """what to change ("" where ``why`` says it)."""
    listed: bool = False
    """a candidate the search still scores as ruled out and lists among the alternatives
    (the training setup's rules); else never enumerated (the structure's rules)."""

    def line(self) -> str:
        """The one line a user error states: value, rule, fix."""
        return f"{self.why}: {self.fix}" if self.fix else self.why

    def __str__(self) -> str:
        return self.line()


def mesh_rule(mesh: Mapping[str, int] | object, facts: MeshFacts) -> Refusal | None:
    """The first rule ``mesh`` breaks under ``facts`` (None: it breaks none). ``mesh``: a
    :class:`~planner.plan.Mesh`, or a mapping axis -> degree where absent axes are free (the
    pins). The structure's rules come first, so that a mesh the enumeration drops is dropped
    whatever else it breaks."""
    axes = dict(mesh) if isinstance(mesh, Mapping) else {a: getattr(mesh, a) for a in AXES}
    return _structure_rule(axes, facts) or _setup_rule(axes, facts)


def _text(axes: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in axes.items())


@functools.lru_cache(maxsize=1024)
def divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def _structure_rule(axes: dict[str, int], facts: MeshFacts) -> Refusal | None:
    """The cluster's and the model's rules: a mesh that breaks one is never a candidate."""
    return (
        _product_rule(axes, facts)
        or _tp_node_rule(axes, facts)
        or _pp_layers_rule(axes, facts)
        or _cp_structure_rule(axes, facts)
        or _ep_rule(axes, facts)
    )


def _setup_rule(axes: dict[str, int], facts: MeshFacts) -> Refusal | None:
    """The training setup's rules, in the order the search reports them."""
    return (
        _batch_rule(axes, facts)
        or _cp_sequence_rule(axes, facts)
        or _tied_rule(axes, facts)
        or _heads_rule(axes, facts)
        or _fused_rule(axes, facts)
        or _schedule_rule(axes, facts)
    )


def _product_rule(axes: dict[str, int], facts: MeshFacts) -> Refusal | None:
    """The degrees (ep aside: carved out of dp x fsdp) multiply to the world size; those given
    of a partial mesh to a divisor of it."""
    world = facts.world_size
    if world is None:
        return None
    product = math.prod(v for k, v in axes.items() if k not in CARVED)
    cluster = f"cluster {facts.cluster}" if facts.cluster else "the cluster"
    complete = set(AXES) - set(CARVED) <= set(axes)
    if complete and product != world:
        return Refusal(
            f"{_text(axes)} multiplies to {product}, but {cluster} has {world} devices",
            f"give degrees whose product is {world}",
        )
    if world % product:
        return Refusal(
            f"{_text(axes)} multiplies to {product}, which does not divide the world size "
            f"{world} of {cluster}",
            f"pin degrees whose product divides {world}",
        )
    return None


def _tp_node_rule(axes: dict[str, int], facts: MeshFacts) -> Refusal | None:
    tp, per_node = axes.get("tp", 1), facts.devices_per_node
    if per_node is not None and tp > per_node:
        return Refusal(
            f"tp={tp} spans nodes ({per_node} devices per node)",
            "tensor parallelism stays within a node; lower tp",
        )
    return None


def _pp_layers_rule(axes: dict[str, int], facts: MeshFacts) -> Refusal | None:
    pp, layers = axes.get("pp", 1), facts.num_layers
    if layers is not None and pp > 1 and pp > layers:  # pp=1 runs any model whole
        return Refusal(
            f"pp={pp} exceeds the model's {layers} layers (a stage holds at least one)",
            f"choose pp <= {layers}",
        )
    return None


def _cp_structure_rule(axes: dict[str, int], facts: MeshFacts) -> Refusal | None:
    """Context parallelism runs without a pipeline (the emitted runtime splits the sequence of
    a whole model), on a model that can split its sequence, and not with ep yet."""
    cp = axes.get("cp", 1)
    if cp == 1:
        return None
    if facts.cp_model_why is not None:
        return Refusal(f"cp={cp}: {facts.cp_model_why}")
    if axes.get("pp", 1) > 1:
        return Refusal(
            f"cp={cp} with pp={axes['pp']}: context parallelism runs without a pipeline",
            "use pp=1 or cp=1",
        )
    if axes.get("ep", 1) > 1:
        return Refusal(f"ep={axes['ep']} with cp={cp}: not planned together yet", "use cp=1")
    return None


def _ep_rule(axes: dict[str, int], facts: MeshFacts) -> Refusal | None:
    """The experts split ``ep`` ways: the model has MoE blocks, ep divides every block's expert
    count, the world and the data-parallel ranks, tp is 1 (experts are not tensor-parallel
    sharded under ep yet), and every block's experts are ones the emitted program can split:
    stacked in one module (its all-to-all dispatch wraps that module), or an ``nn.ModuleList``
    of experts called as ``expert(rows)`` from the block's own loop (the block recorded, the
    rows dispatched, the block replayed; ``ir._moe.ep_why`` says which it cannot).
    Pipeline stages keep each layer a module, so the wrapper splits the experts of a stage's
    layers alike."""
    ep = axes.get("ep", 1)
    if ep == 1:
        return None
    carved = "expert parallelism is carved out of the data-parallel ranks"
    if facts.world_size is not None and facts.world_size % ep:
        return Refusal(
            f"ep={ep} does not divide the world size {facts.world_size}: {carved}",
            "pin an ep that divides it",
        )
    counts = facts.expert_counts
    if counts is not None and not counts:
        return Refusal(
            f"ep={ep}: the model has no mixture-of-experts blocks (a top-k router over experts)",
            "plan it without ep",
        )
    bad = [c for c in counts or () if c % ep]
    if bad:
        choices = [d for d in divisors(math.gcd(*counts)) if d > 1]
        return Refusal(
            f"ep={ep} does not divide the {bad[0]} experts of a MoE block",
            f"choose ep among {choices}",
        )
    if "dp" in axes and "fsdp" in axes and (axes["dp"] * axes["fsdp"]) % ep:
        return Refusal(
            f"ep={ep} does not divide dp x fsdp = {axes['dp'] * axes['fsdp']}: {carved}",
            "pin an ep that does",
        )
    if axes.get("tp", 1) > 1:
        return Refusal(
            f"ep={ep} with tp={axes['tp']}: experts are not tensor-parallel under ep yet",
            "use tp=1",
        )
    if facts.listed_experts is not None:
        return Refusal(
            f"ep={ep}: MoE block {facts.listed_experts}",
            "plan with --mesh ep=1",
        )
    return None


def _batch_rule(axes: dict[str, int], facts: MeshFacts) -> Refusal | None:
    """Every data-parallel rank gets the same number of samples (a partial mesh: the pinned
    part of dp x fsdp divides the batch already)."""
    batch, data = facts.global_batch, axes.get("dp", 1) * axes.get("fsdp", 1)
    if batch is None or batch % data == 0:
        return None
    return Refusal(
        f"global batch {batch} is not divisible by the data-parallel size {data}",
        f"every data-parallel rank gets the same number of samples; pass a multiple of {data} "
        f"(e.g. --global-batch {(batch // data + 1) * data}) or a smaller dp x fsdp",
        listed=True,
    )


def _cp_sequence_rule(axes: dict[str, int], facts: MeshFacts) -> Refusal | None:
    """The sequence is cut into 2 cp equal chunks (head-tail load balancing)."""
    cp, seq = axes.get("cp", 1), facts.seq_len
    if cp == 1 or facts.cp_model_why is not None or seq is None or seq % (2 * cp) == 0:
        return None
    return Refusal(
        f"sequence length {seq} is not divisible by 2 x cp = {2 * cp} (the sequence is cut "
        "into 2 cp equal chunks for causal load balancing): pass a --seq-len that is, or a "
        "smaller cp",
        listed=True,
    )


def _tied_rule(axes: dict[str, int], facts: MeshFacts) -> Refusal | None:
    if axes.get("pp", 1) == 1 or not facts.tied:
        return None
    return Refusal(
        f"{facts.tied}: pipeline stages cannot split them, and the emitted script refuses such "
        "a cut",
        "plan without a pipeline (pp=1), as for any weight two layers read (tied through a "
        "shared module too)",
        listed=True,
    )


def _heads_rule(axes: dict[str, int], facts: MeshFacts) -> Refusal | None:
    tp = axes.get("tp", 1)
    bad = [h for h in facts.heads if h % tp]
    if tp == 1 or not bad:
        return None
    world = facts.world_size or tp
    return Refusal(
        f"tp={tp} does not divide the {bad[0]} attention heads",
        f"choose tp among {[d for d in divisors(bad[0]) if d <= world]}",
        listed=True,
    )


def _fused_rule(axes: dict[str, int], facts: MeshFacts) -> Refusal | None:
    """A fused q/k/v projection is split only at the degrees its block is proven at (tp
    dividing its kv heads, or one kv head: ``ir._heads``); at another tp its attention would
    run whole on every rank, which a tp the user asks for never does silently."""
    tp = axes.get("tp", 1)
    bad = next(((f, d, h) for f, d, h in facts.fused_blocks if tp > 1 and tp not in d), None)
    if bad is None:
        return None
    fqn, degrees, heads = bad
    return Refusal(
        f"tp={tp} cannot split the attention of {fqn}: its fused q/k/v projection packs "
        f"{heads}, and tp must divide the kv heads (or they must be one)",
        f"choose tp among {[1, *degrees]}",
        listed=True,
    )


def whole_attention_rule(
    blocks: Mapping[str, tuple[int, int, str]], styles: Mapping[str, str], tp: int
) -> Refusal | None:
    """An attention block with fewer kv heads than ``tp`` (``Graph.gqa_blocks``: query heads, kv
    heads, output linear) whose output projection ``styles`` leave unpaired (not rowwise):
    its heads would run whole on every rank. A tp the user pins never does that silently
    (the search refuses it); a free search may, as the cost model's own choice."""
    for fqn, (heads, kv, out) in sorted(blocks.items()):
        if tp > 1 and kv < tp and heads % tp == 0 and not styles.get(out, "").startswith("rowwise"):
            choices = [d for d in divisors(math.gcd(heads, kv))]
            return Refusal(
                f"the attention of {fqn} ({heads} query heads, {kv} kv heads) cannot be split "
                f"at tp={tp}: each rank's query heads would not read one kv head of their own "
                "(kv heads laid out kv-major, tp a multiple of them), so it would run whole on "
                "every rank",
                f"choose tp among {choices} (dividing the kv heads) or leave tp free",
            )
    return None


def _schedule_rule(axes: dict[str, int], facts: MeshFacts) -> Refusal | None:
    """The schedule table's rule (:func:`schedules.data_parallel_rule`), for a pipeline."""
    if facts.schedule is None or axes.get("pp", 1) == 1:
        return None
    why = schedules.data_parallel_rule(facts.schedule, axes.get("dp", 1) * axes.get("fsdp", 1))
    return Refusal(why, listed=True) if why is not None else None


DataParallel = Literal["fsdp2", "ddp", "none"]


def data_parallel(mesh: MeshShape) -> DataParallel:
    """How a plan's data-parallel ranks hold the model (the emitted ``DATA_PARALLEL``, which the
    runtime executes): "fsdp2" where the cost model charges FSDP2
    (:func:`~cost_model.precision.uses_fsdp2`: to shard, and to replicate a TP model, pipeline
    stages, cp or ep ranks, where DDP cannot run), else "ddp" over dp > 1 replicas, else "none"."""
    if uses_fsdp2(mesh):
        return "fsdp2"
    return "ddp" if mesh.dp > 1 else "none"
