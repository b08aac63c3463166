"""What a user asks the search for, validated once before anything is scored: the training
arguments (:func:`check_training`, shared by the API and the CLI), mesh pins and options, and
the facts of the model the mesh rules read (:func:`mesh_facts`). The mesh rules themselves live
in :mod:`planner.rules`, one function that validation, enumeration, ``--plan`` loading and
``emit`` call. Every refusal is one line: the value, the rule, the fix.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from autopar.cost_model import Cluster
from autopar.cost_model.precision import System
from autopar.ir import Graph, Node, PositionTable
from autopar.ir._moe import ep_why
from autopar.ir.coupling import Coupling
from autopar.planner import schedules
from autopar.planner.layouts import MODULE_OPS
from autopar.planner.norms import norm_modules, scatter_layers
from autopar.planner.plan import BatchCoupling, Coupled, Mesh, Schedule, Training
from autopar.planner.rules import AXES, CARVED, MeshFacts, Refusal, divisors, mesh_rule
from pydantic import ValidationError

from autopar.errors import UserError

__all__ = [
    "AXES",
    "CARVED",
    "MAX_GLOBAL_BATCH",
    "NothingFitsError",
    "Options",
    "PlanningError",
    "batch_coupling_rule",
    "check_pins",
    "check_training",
    "enumerate_meshes",
    "mesh_facts",
    "parse_mesh",
    "validate",
]

# The search enumerates divisors of the per-replica batch (microbatch counts), linear in it: past
# ~2^20 samples a step it stops answering at once, and no published run comes near (Llama 3
# 405B: 16M tokens = 2048 sequences of 8192).
MAX_GLOBAL_BATCH = 2**20
DTYPES = ("fp32", "bf16")
OPTIMIZERS = ("adamw", "sgd")


class PlanningError(UserError):
    """The constraints admit no plan; the message says which constraint bound and what to relax."""


class NothingFitsError(PlanningError):
    """Legal meshes exist but none fits the device memory."""

    def __init__(self, message: str, overflow_bytes: float) -> None:
        super().__init__(message)
        self.overflow_bytes = overflow_bytes


@dataclass(frozen=True)
class Options:
    """User constraints beyond the mesh pins (the CLI's --schedule, --microbatches, --checkpoint)."""

    schedule: str | None = None
    """pipeline schedule to use when pp > 1; None searches all."""
    microbatches: int | None = None
    checkpoint: Literal["auto", "none", "full"] = "auto"
    system: System = "autopar"
    """whose training program the prediction models, for its precision regime
    (:mod:`cost_model.precision`): ``autopar`` (the emitted script: fp32 parameters, gradients
    and AdamW state, bf16 compute through FSDP2's MixedPrecisionPolicy or autocast) or
    ``megatron`` (bf16 parameters, fp32 main gradients, fp32 master and AdamW state: the
    published runs of ``benchmarks/published_runs.py``, never emitted)."""


def parse_mesh(text: str) -> dict[str, int]:
    """``"tp=2,fsdp=2"`` -> ``{"tp": 2, "fsdp": 2}``; raises PlanningError with one line."""
    pins: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in AXES or not value.strip().isdigit() or int(value) < 1:
            raise PlanningError(
                f"--mesh {text!r}: {part!r} is not AXIS=N with AXIS one of {', '.join(AXES)} "
                "and N >= 1: write e.g. --mesh tp=2,fsdp=2"
            )
        if key in pins:
            raise PlanningError(f"--mesh {text!r} sets {key} twice: give each axis once")
        pins[key] = int(value)
    return pins


def check_training(
    global_batch: int, seq_len: int | None, dtype: str = "fp32", optimizer: str = "adamw"
) -> Training:
    """The training arguments, checked once for the API and the CLI (before any model is
    imported): one line naming the flag, the value, the rule and the fix."""
    if global_batch < 1:
        raise PlanningError(
            f"--global-batch {global_batch}: the global batch must be >= 1 sample; pass e.g. "
            "--global-batch 8"
        )
    if global_batch > MAX_GLOBAL_BATCH:
        raise PlanningError(
            f"--global-batch {global_batch}: autopar plans up to {MAX_GLOBAL_BATCH} samples per "
            "step; pass a smaller global batch (samples, not tokens: tokens per step are global "
            "batch x --seq-len)"
        )
    if seq_len is not None and seq_len < 1:
        raise PlanningError(
            f"--seq-len {seq_len}: the sequence length must be >= 1 token; pass e.g. --seq-len "
            "128, or leave it out for models that are not sequence models"
        )
    if dtype not in DTYPES:
        raise PlanningError(
            f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}: pass --dtype fp32 or bf16"
        )
    if optimizer not in OPTIMIZERS:
        raise PlanningError(
            f"--optimizer {optimizer!r} is not one of {', '.join(OPTIMIZERS)}: pass --optimizer "
            "adamw or sgd"
        )
    try:
        return Training(
            global_batch=global_batch, seq_len=seq_len, dtype=dtype, optimizer=optimizer
        )
    except ValidationError as e:  # a type pydantic refuses (e.g. a float batch from Python)
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        raise PlanningError(
            f"{field} {err.get('input')!r} is invalid: {err['msg']}; pass a valid {field}"
        ) from None


def validate(
    pins: dict[str, int],
    options: Options,
    facts: MeshFacts,
    positions: Sequence[PositionTable] = (),
) -> None:
    """Refuse pins and options no mesh can satisfy: the model's position tables, the mesh rules
    on the pins (:func:`planner.rules.mesh_rule`, absent axes free) and the options."""
    why = position_rule(positions, facts.seq_len)
    if why is not None:
        raise PlanningError(why)
    refusal = mesh_rule(pins, facts)
    if refusal is not None:
        raise pins_error(pins, refusal)
    if options.schedule is not None and options.schedule not in schedules.SCHEDULES:
        raise PlanningError(
            f"--schedule {options.schedule!r} is not one of {', '.join(schedules.SCHEDULES)}"
        )
    if options.microbatches is not None and options.microbatches < 1:
        raise PlanningError(f"--microbatches {options.microbatches} must be >= 1")
    if options.checkpoint not in ("auto", "none", "full"):
        raise PlanningError(f"--checkpoint {options.checkpoint!r} is not one of auto, none, full")


def pins_error(pins: dict[str, int], refusal: Refusal) -> PlanningError:
    """The one line for pins that break a mesh rule: ``--mesh`` and the refusal, which names
    the pinned value itself where it starts with it."""
    text = ",".join(f"{k}={v}" for k, v in pins.items())
    line = refusal.line()
    own = [text, *(f"{k}={v}" for k, v in pins.items())]
    if any(line.startswith(f"{o} ") or line.startswith(f"{o}:") for o in own):
        return PlanningError(f"--mesh {line}")
    return PlanningError(f"--mesh {text}: {line}")


def check_pins(pins: dict[str, int], cluster: Cluster, global_batch: int | None = None) -> None:
    """The mesh rules that need no model, on the pins (the CLI checks them before tracing)."""
    facts = MeshFacts(
        world_size=cluster.world_size,
        cluster=cluster.spec,
        devices_per_node=cluster.devices_per_node,
        global_batch=global_batch,
    )
    refusal = mesh_rule(pins, facts)
    if refusal is not None:
        raise pins_error(pins, refusal)


def mesh_facts(graph: Graph, cluster: Cluster, training: Training) -> MeshFacts:
    """What the mesh rules read about this cluster, training setup and model."""
    whys = ((m.fqn, ep_why(graph, m)) for m in graph.moes)
    listed = next((f"{fqn}: {why}" for fqn, why in whys if why is not None), None)
    return MeshFacts(
        world_size=cluster.world_size,
        cluster=cluster.spec,
        devices_per_node=cluster.devices_per_node,
        global_batch=training.global_batch,
        seq_len=training.seq_len if training.seq_len is not None else graph.seq_len,
        num_layers=len(graph.layers),
        heads=tuple(sorted(attention_heads(graph))),
        fused_blocks=fused_blocks(graph),
        tied=tied_layers(graph),
        cp_model_why=cp_model_rule(graph, training.seq_len),
        expert_counts=tuple(sorted({m.num_experts for m in graph.moes})),
        listed_experts=listed,
    )


def position_rule(tables: Sequence[PositionTable], seq_len: int | None) -> str | None:
    """Why no plan can train sequences of ``seq_len`` tokens: the first position table (a
    learned absolute position embedding, found in the traced graph by ``ir._positions`` or
    stated by an HF config, ``autopar.hf.position_tables``) that such a sequence reads past;
    None where every table holds it. A table's last row bounds the sequence on real tensors,
    while planning on meta tensors would never notice."""
    for table in tables:
        if seq_len is not None and seq_len > table.max_seq_len:
            larger = "give the model a larger table"
            if table.setting is not None and table.setting_value is not None:
                needed = table.setting_value + seq_len - table.max_seq_len
                larger = f"set {table.setting} >= {needed} in the config"
            rows = f"rows {table.first}..{table.rows - 1} for tokens 0..{table.max_seq_len - 1}"
            return (
                f"--seq-len {seq_len}: the model's position table {table.fqn!r} (an embedding of "
                f"{table.rows} rows) has {rows}, and a longer sequence reads past its last row "
                f"(the lookup fails on real tensors): plan a --seq-len <= {table.max_seq_len}, "
                f"or {larger}"
            )
    return None


def enumerate_meshes(
    world: int,
    devices_per_node: int,
    pins: dict[str, int],
    num_layers: int | None = None,
    cp_ok: bool = False,
    experts: int = 0,
) -> list[Mesh]:
    """:func:`candidate_meshes` for a world of ``world`` devices, ``devices_per_node`` a node,
    ``num_layers`` layers, a model that can (``cp_ok``) split its sequence, and MoE blocks of
    ``experts`` experts (their gcd; 0 without)."""
    facts = MeshFacts(
        world_size=world,
        devices_per_node=devices_per_node,
        num_layers=num_layers,
        cp_model_why=None if cp_ok or "cp" in pins else "the model cannot split its sequence",
        expert_counts=(experts,) if experts else (),
    )
    return candidate_meshes(facts, pins)


def candidate_meshes(facts: MeshFacts, pins: dict[str, int]) -> list[Mesh]:
    """Every (pp, dp, fsdp, cp, ep, tp) matching ``pins`` that :func:`planner.rules.mesh_rule`
    does not rule out by structure (the product of the degrees is the world size, tp within a
    node, pp at most the number of layers, cp only without a pipeline on a model that can split
    its sequence, ep dividing the experts and dp x fsdp, without tp or cp); meshes the training
    setup rules out are kept, to be listed with their reason."""
    world = facts.world_size
    assert world is not None
    out = []
    for pp in divisors(world):
        for tp in divisors(world // pp):
            for cp in divisors(world // pp // tp):
                for fsdp in divisors(world // pp // tp // cp):
                    dp = world // pp // tp // cp // fsdp
                    for ep in divisors(dp * fsdp):
                        axes = {"pp": pp, "dp": dp, "fsdp": fsdp, "cp": cp, "ep": ep, "tp": tp}
                        if any(axes[k] != v for k, v in pins.items()):
                            continue
                        refusal = mesh_rule(axes, facts)
                        if refusal is None or refusal.listed:
                            out.append(Mesh(**axes))
    return out


SOFTMAX_OPS = ("aten._softmax.default", "aten.softmax.int", "aten._safe_softmax.default")
SDPA_OP = "aten.scaled_dot_product_attention.default"


def cp_model_rule(graph: Graph, seq_len: int | None) -> str | None:
    """Why the model cannot split its sequence for context parallelism (None: it can). The
    emitted form (all-gathered keys/values, head-tail load balancing:
    planner.plan.ContextParallel) handles ``F.scaled_dot_product_attention`` without dropout,
    causal or not, without a mask (a HuggingFace model's traced causal mask, built from
    positions alone, is absent when it runs: :func:`_hf_causal_mask_skipped`); the degree's own
    rule (the sequence cut into 2 cp equal chunks) is :mod:`planner.rules`'."""
    if seq_len is None:
        return "context parallelism splits the sequence: pass --seq-len"
    softmax = next((n for n in graph.nodes if n.op in SOFTMAX_OPS), None)
    if softmax is not None:
        where = softmax.source or softmax.layer
        return (
            f"the model computes attention with an explicit softmax ({where}), which context "
            "parallelism cannot split: use F.scaled_dot_product_attention"
        )
    calls = [n for n in graph.nodes if n.op == SDPA_OP]
    if not calls:
        return "the model has no F.scaled_dot_product_attention call for context parallelism"
    hf_causal = _hf_causal_mask_skipped(graph)
    for n in calls:
        args = dict(zip(("query", "key", "value", "attn_mask", "dropout_p"), n.args))
        args.update(n.kwargs)
        where = n.source or n.layer
        if args.get("dropout_p") not in (None, 0, 0.0):
            return f"attention with dropout ({where}): context parallelism needs dropout_p=0"
        mask = args.get("attn_mask")
        if mask is not None and not (hf_causal and not _reads_inputs(graph, mask.name)):
            return (
                f"attention with an explicit mask ({where}): context parallelism handles "
                "is_causal or unmasked attention only"
            )
    local = local_positions(graph, seq_len)
    if local is not None:
        where = local.source or local.layer
        return (
            f"layer {local.layer} computes positions from the sequence length it sees ({where}): "
            "a context-parallel rank sees only its chunks of the sequence, so its positions "
            "would be wrong; compute positions (or slice rotary tables) before the first "
            "attention layer and pass them in, as HF Llama does, or plan without cp"
        )
    return None


_ARANGE_OPS = ("aten.arange.default", "aten.arange.start", "aten.arange.start_step")


def local_positions(graph: Graph, seq_len: int):
    """The first node, from the first attention layer on (where the emitted program splits the
    sequence: :func:`cp_shard_at`), that makes positions out of the length its layer sees and
    reaches an attention call: an ``arange`` of the sequence length, or a buffer or parameter
    sliced to it (rotary tables ``self.cos[:t]``). On a cp rank, that length is its own chunks'
    length; None where there is none."""
    start = cp_shard_at(graph)
    nodes = list(graph.nodes)
    first = next(
        (i for i, n in enumerate(nodes) if n.kind == "compute" and n.layer == start), len(nodes)
    )
    users: dict[str, list[str]] = {}
    for n in nodes:
        for ref in n.inputs:
            users.setdefault(ref, []).append(n.name)

    def positional(n) -> bool:
        out = n.out
        if n.op in _ARANGE_OPS:
            step = n.args[2] if len(n.args) > 2 else dict(n.kwargs).get("step", 1)
            return step == 1 and out is not None and tuple(out.shape) == (seq_len,)
        if n.op == "aten.slice.Tensor" and n.inputs:
            src = graph.node(n.inputs[0])
            args = (*n.args, *(None, 0, None, None, 1)[len(n.args) :])  # self dim start end step
            return (
                src.kind in ("param", "buffer")
                and args[2] in (0, None)
                and args[3] == seq_len
                and args[4] in (1, None)
                and src.out is not None
                and src.out.shape[args[1] or 0] > seq_len
            )
        return False

    def reaches_attention(name: str) -> bool:
        todo, seen = [name], {name}
        while todo:
            for u in users.get(todo.pop(), ()):
                if graph.node(u).op == SDPA_OP:
                    return True
                if u not in seen:
                    seen.add(u)
                    todo.append(u)
        return False

    return next((n for n in nodes[first:] if positional(n) and reaches_attention(n.name)), None)


def _hf_causal_mask_skipped(graph: Graph) -> bool:
    """Whether the model is a HuggingFace transformers model: its causal mask (a mask built
    from positions alone) is materialized under torch.export only; eager HF, which the emitted
    program runs, passes ``is_causal=True`` and no mask (transformers' masking_utils
    ``_ignore_causal_mask_sdpa``)."""
    root = graph.modules.get("")
    return root is not None and root.type.startswith("transformers.")


def cp_shard_at(graph: Graph) -> str | None:
    """The first layer with an attention call: where the emitted program splits the sequence."""
    return next((n.layer for n in graph.nodes if n.op == SDPA_OP), None)


def _reads_inputs(graph: Graph, name: str) -> bool:
    """Whether node ``name`` depends on a model input (else on positions and constants only)."""
    todo, seen = [name], set()
    while todo:
        node = graph.node(todo.pop())
        if node.kind == "input":
            return True
        for ref in node.inputs:
            if ref not in seen:
                seen.add(ref)
                todo.append(ref)
    return False


def param_readers(graph: Graph) -> dict[str, set[str]]:
    """Parameter FQN -> the layers whose ops read it (two or more: a tied weight)."""
    readers: dict[str, set[str]] = {}
    for n in graph.nodes:
        if n.kind == "compute":
            for p in n.params:
                readers.setdefault(p, set()).add(n.layer)
    return readers


def _holders(graph: Graph) -> dict[str, set[str]]:
    """Parameter FQN (the graph's name) -> the modules holding it: its own, and those of its
    other names (a tie through one tensor, ``head.weight = tok_emb.weight``)."""
    holders = {
        f"{fqn}.{name}" if fqn else name: {fqn}
        for fqn, m in graph.modules.items()
        for name in m.params
    }
    for alias, name in (graph.calls.shared_state if graph.calls else {}).items():
        if name in holders:
            holders[name].add(alias.rpartition(".")[0])
    return holders


def _inside(fqn: str, layer: str) -> bool:
    return fqn == layer or fqn.startswith(layer + ".")


def outside_reads(graph: Graph) -> dict[str, tuple[str, Node]]:
    """Parameter FQN -> (the layer holding it, the first op reading it outside that layer): a
    module's weight read by code outside its layer (``F.linear(x, self.wte.weight)`` at the
    root: a tie without a shared module). Ops inside the layer (a block reading its own
    ``self.down.weight`` by hand) are not outside it."""
    within = _layers_within(graph)
    holders = _holders(graph)
    found: dict[str, tuple[str, Node]] = {}
    for n in graph.nodes:
        for p in n.params if n.kind == "compute" else ():
            owner = p.rpartition(".")[0]
            layer = next(iter(within(owner)), None)
            if p in found or layer is None or layer in n.module_stack:
                continue
            if not any(_inside(h, x) for h in holders.get(p, ()) for x in n.module_stack):
                found[p] = (layer, n)  # not inside any module holding it either
    return found


def root_unit_layers(graph: Graph) -> list[str]:
    """The layers FSDP2's root unit holds instead of a unit of their own (FSDP2 manages a tensor
    in one unit, gathered only while that unit runs), in layer order: those holding a parameter
    that a module outside them holds too (a tie through one tensor) or that an op outside them
    reads (:func:`outside_reads`). The emitted program finds the first kind itself
    (``autopar_runtime.fsdp_units``) and reads both from ``Plan.fsdp_root``."""
    holders, read, within = _holders(graph), outside_reads(graph), _layers_within(graph)
    rooted: set[str] = set()
    for p, hs in holders.items():
        inside = [set(within(h)) for h in hs]  # per holder, the layers it lies in
        for layer in set().union(*inside):  # the layers holding p
            if p in read or any(layer not in x for x in inside):
                rooted.add(layer)
    return [x.fqn for x in graph.layers if x.fqn in rooted]


def _layers_within(graph: Graph):
    """A function of a module FQN: the module layers it lies in (itself or an ancestor), in
    layer order (what :func:`_inside` tells one layer at a time, found up its dotted path)."""
    order = {x.fqn: i for i, x in enumerate(graph.layers) if x.is_module and x.fqn}

    @functools.cache
    def within(fqn: str) -> tuple[str, ...]:
        parts = fqn.split(".")
        found = [q for q in (".".join(parts[:k]) for k in range(1, len(parts) + 1)) if q in order]
        return tuple(sorted(found, key=order.__getitem__))

    return within


def tied_layers(graph: Graph) -> str:
    """Why a pipeline cannot cut between two layers that read one parameter (a tied weight), in
    words naming the parameter, its module and where it is read outside it; "" where no two
    layers read one parameter."""
    read = outside_reads(graph)
    for p, layers in param_readers(graph).items():
        layers = layers | {read[p][0]} if p in read else layers  # its layer holds it
        if len(layers) > 1:
            first, second = sorted(layers, key=[x.fqn for x in graph.layers].index)[:2]
            pair = f"layers {first} and {second} read the same (tied) parameter"
            if p not in read:
                return pair
            owner, node = read[p]
            where = f"by op {node.name}"
            if node.source:  # ``file:line: code``, the code without its comment
                line, _, code = node.source.partition(": ")
                where = f"at {line} (`{code.split('  #')[0].strip()}`)"
            stack = f"in {node.module_stack[-1]}" if node.module_stack else "in the root's forward"
            return (
                f"{p}, a parameter of module {p.rpartition('.')[0]}, is read outside its layer "
                f"{owner}, {stack} {where}, so {pair}"
            )
    return ""


def fused_blocks(graph: Graph) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    """(FQN, degrees, its heads in words) of each attention block with a fused q/k/v projection
    (``Graph.fused_blocks``), for :func:`planner.rules._fused_rule`."""
    out = []
    for fqn, degrees in sorted(graph.fused_blocks.items()):
        sdpa = [n for n in graph.nodes if n.op == SDPA_OP and n.module_fqn == fqn]
        shapes = [tuple(graph.node(r).out.shape[1] for r in n.inputs[:2]) for n in sdpa[:1]]
        words = f"{shapes[0][0]} query heads and {shapes[0][1]} kv heads" if shapes else "heads"
        out.append((fqn, degrees, words))
    return tuple(out)


def attention_heads(graph: Graph) -> set[int]:
    """Query head counts of attention ops (dim 1 of q of each SDPA call). Key/value heads do not
    bound tp: where fewer than tp (multi-query, Falcon's one kv head), they stay whole on every
    rank while the query heads are split, as Megatron does (:mod:`planner.layouts`)."""
    return {graph.node(n.inputs[0]).out.shape[1] for n in graph.nodes if n.op == SDPA_OP}


def module_kinds(
    graph: Graph, norms: Iterable[str] | None = None, layers: Iterable[str] | None = None
) -> dict[str, str]:
    """FQN -> kind (``linear``, ``embedding``, ``norm``, ``layer``) of every module tensor
    parallelism can style (norms and layers as :mod:`planner.layouts` recognises them): what a
    plan records so that its styles are checked without the model (``Plan.module_kinds``).
    ``norms``, ``layers``: the norms and the sequence-parallel entry layers where the caller
    has them (the search's collapsed graph holds both), else found here."""
    kinds = {
        fqn: MODULE_OPS[info.type][0]
        for fqn, info in graph.modules.items()
        if fqn and info.type in MODULE_OPS
    }
    if norms is None or layers is None:
        found = norm_modules(graph)
        norms, layers = found, scatter_layers(graph, found).values()
    kinds.update(dict.fromkeys(norms, "norm"))
    kinds.update(dict.fromkeys(layers, "layer"))
    order = {fqn: i for i, fqn in enumerate(graph.modules)}
    return dict(sorted(kinds.items(), key=lambda kv: order[kv[0]]))


def batch_coupling_rule(
    couplings: Sequence[Coupling],
    mesh: Mesh,
    schedule: Schedule,
    training: Training,
    sync_batchnorm: bool = False,
    loss_gathers: bool = False,
) -> BatchCoupling | None:
    """The plan's answer to the model's batch couplings (:mod:`ir.coupling`), or None where
    there are none. A coupling the plan leaves in place (the coupled op sees fewer samples than
    the global batch: a data-parallel rank's slice, or a microbatch of it) gets one warning
    line: what couples, over how many samples, and the fix. ``sync_batchnorm`` (--sync-batchnorm)
    syncs batch norms over the data-parallel ranks; ``loss_gathers`` (loss_fn takes ``gather``)
    gives the loss the data-parallel ranks' outputs. A MoE router's statistics stay per slice
    (by design, as Megatron and HF take them): --verify's reference then trains on the same
    slices. Raises PlanningError for --sync-batchnorm on a model without a batch norm."""
    norms = [c for c in couplings if c.kind == "batch_norm"]
    if sync_batchnorm and not norms:
        raise PlanningError(
            "--sync-batchnorm: the model has no batch norm in training mode (nn.BatchNorm1d/2d/"
            "3d) to sync: drop --sync-batchnorm"
        )
    ranks, total = mesh.data_parallel, training.global_batch
    share = total // ranks  # a data-parallel rank's samples per step
    micro = share // schedule.num_microbatches  # per forward
    gather = loss_gathers and ranks > 1
    if not couplings and not gather:
        return None
    split = f"{schedule.num_microbatches} microbatches" + (
        f" of each of dp x fsdp = {ranks} ranks' {share}" if ranks > 1 else ""
    )
    one_micro = "plan with --microbatches 1 (and --schedule gpipe with a pipeline)"
    warnings = []
    if norms and micro < total:
        first = norms[0]
        what = f"{first.module_type} {first.where!r}" + (
            f" (and {len(norms) - 1} more batch norms)" if len(norms) > 1 else ""
        )
        if ranks > 1 and not sync_batchnorm:
            fix = "pass --sync-batchnorm to take them over the data-parallel ranks' samples"
            more = f" ({split} samples)" if micro < share else ""
            warnings.append(
                f"{what} takes its batch statistics over each rank's {micro} samples{more}, not "
                f"the global batch of {total} (dp x fsdp = {ranks}): {fix}"
            )
        elif micro < share or ranks == 1:
            seen = micro * ranks if sync_batchnorm else micro
            warnings.append(
                f"{what} takes its batch statistics over {seen} samples per forward ({split}), "
                f"not the global batch of {total}: {one_micro}"
            )
    products = {c.where: c for c in reversed(couplings) if c.kind == "batch_product"}
    for c in reversed(products.values()):  # the first product of each module, or of loss_fn
        at = f"{c.op}{f' at {c.source}' if c.source else ''}"
        if c.where != "loss_fn":  # in the forward: the gather hook is loss_fn's
            if micro < total:
                warnings.append(
                    f"{f'module {c.where!r}' if c.where else 'the root module'} multiplies two "
                    f"batch-major tensors into a batch x batch matrix ({at}), which sees {micro} of the global batch's {total} samples: "
                    "compute it in loss_fn(output, target, *, gather=None), which the program "
                    "gives the data-parallel ranks' outputs (see README, The model file)"
                )
        elif gather and micro < share:
            warnings.append(
                f"loss_fn's batch x batch product ({at}) gathers the data-parallel ranks' "
                f"microbatches: {micro * ranks} of the global batch's {total} samples ({split}):"
                f" {one_micro}"
            )
        elif not gather and micro < total:
            fix = (
                "give loss_fn a gather keyword, loss_fn(output, target, *, gather=None), to "
                "score them against every data-parallel rank's samples (see README, The model "
                "file)"
                if ranks > 1
                else one_micro
            )
            warnings.append(
                f"loss_fn's batch x batch product ({at}) scores each sample against the "
                f"{micro} samples of its forward only, not the global batch of {total}: {fix}"
            )
    routing = any(c.kind == "routing" for c in couplings)
    return BatchCoupling(
        couplings=[Coupled(**vars(c)) for c in couplings],
        sync_batchnorm=sync_batchnorm,
        gather_loss=gather,
        verify_reference="rank slices" if routing else "global batch",
        warnings=list(dict.fromkeys(warnings)),
    )
