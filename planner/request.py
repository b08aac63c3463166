"""What a user asks the search for, validated once before anything is scored: mesh pins,
options, and the per-mesh rules (batch divisibility, attention heads, tied layers), in the
style of torchtitan's ``ParallelDims._validate``. Every refusal is one line: the value, the
rule, the fix.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from autopar.cost_model import Cluster
from autopar.cost_model.precision import System
from autopar.ir import Graph, PositionTable
from autopar.planner import schedules
from autopar.planner.layouts import MODULE_OPS, norm_modules, scatter_layers
from autopar.planner.plan import Mesh

from autopar.errors import UserError

AXES = ("pp", "dp", "fsdp", "cp", "ep", "tp")
CARVED = ("ep",)
"""axes carved out of the others' ranks (ep out of dp x fsdp): pinned like the others, but
not factors of the world size nor of the rank layout."""


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


def validate(
    pins: dict[str, int],
    options: Options,
    cluster: Cluster,
    graph: Graph,
    seq_len: int | None = None,
) -> None:
    """Refuse pins and options no mesh can satisfy (each rule checked here, once)."""
    why = position_rule(graph.positions, seq_len if seq_len is not None else graph.seq_len)
    if why is not None:
        raise PlanningError(why)
    world = cluster.world_size
    if pins.get("pp", 1) > len(graph.layers):
        raise PlanningError(
            f"--mesh pp={pins['pp']} exceeds the model's {len(graph.layers)} layers (a stage "
            f"holds at least one): choose pp <= {len(graph.layers)}"
        )
    check_pins(pins, cluster)
    ep = pins.get("ep", 1)
    if ep > 1:
        why = ep_rule(ep, graph, pins.get("tp", 1), None)
        if why is not None:
            raise PlanningError(f"--mesh ep={ep}: {why}")
    tp = pins.get("tp")
    if tp and tp > 1:
        for heads in sorted(attention_heads(graph)):
            if heads % tp:
                raise PlanningError(
                    f"--mesh tp={tp} does not divide the model's {heads} attention heads: "
                    f"choose tp among {[d for d in _divisors(heads) if d <= world]}"
                )
        if tp > cluster.devices_per_node:
            raise PlanningError(
                f"--mesh tp={tp} spans nodes ({cluster.devices_per_node} devices per node): "
                "tensor parallelism must stay within a node; lower tp"
            )
    cp = pins.get("cp", 1)
    if cp > 1:
        why = cp_rule(graph, seq_len, cp) or (
            "context parallelism runs without a pipeline" if pins.get("pp", 1) > 1 else None
        )
        if why is not None:
            raise PlanningError(f"--mesh cp={cp}: {why}")
    if options.schedule is not None and options.schedule not in schedules.SCHEDULES:
        raise PlanningError(
            f"--schedule {options.schedule!r} is not one of {', '.join(schedules.SCHEDULES)}"
        )
    if options.microbatches is not None and options.microbatches < 1:
        raise PlanningError(f"--microbatches {options.microbatches} must be >= 1")
    if options.checkpoint not in ("auto", "none", "full"):
        raise PlanningError(f"--checkpoint {options.checkpoint!r} is not one of auto, none, full")


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
    """Every (pp, dp, fsdp, cp, tp) with product ``world`` matching ``pins``: tp within a node,
    pp at most the number of layers (a stage holds at least one); cp > 1 only without a
    pipeline and where ``cp_ok`` (the model can split its sequence: :func:`cp_rule`) or pinned;
    and for each, every ep > 1 that divides ``experts`` (the gcd of the MoE blocks' expert
    counts, 0 without experts) and dp x fsdp, without tp or cp (:func:`ep_rule`)."""
    out = []
    for pp in _divisors(world):
        if num_layers is not None and pp > num_layers:
            continue
        for tp in _divisors(world // pp):
            if tp > devices_per_node and "tp" not in pins:
                continue
            for cp in _divisors(world // pp // tp):
                if cp > 1 and (pp > 1 or not (cp_ok or "cp" in pins)):
                    continue
                for fsdp in _divisors(world // pp // tp // cp):
                    dp = world // pp // tp // cp // fsdp
                    mesh = Mesh(pp=pp, dp=dp, fsdp=fsdp, cp=cp, tp=tp)
                    plain = experts == 0 or tp > 1 or cp > 1
                    for ep in [1] if plain else _divisors(math.gcd(experts, dp * fsdp)):
                        with_ep = mesh.model_copy(update={"ep": ep})
                        if all(getattr(with_ep, k) == v for k, v in pins.items()):
                            out.append(with_ep)
    return out


SOFTMAX_OPS = ("aten._softmax.default", "aten.softmax.int", "aten._safe_softmax.default")
SDPA_OP = "aten.scaled_dot_product_attention.default"


def cp_rule(graph: Graph, seq_len: int | None, cp: int) -> str | None:
    """Why the model cannot split its sequence ``cp`` ways (None: it can). The emitted form
    (all-gathered keys/values, head-tail load balancing: planner.plan.ContextParallel) handles
    ``F.scaled_dot_product_attention`` without dropout, causal or not, without a mask (a
    HuggingFace model's traced causal mask, built from positions alone, is absent when it runs:
    :func:`_hf_causal_mask_skipped`); the sequence is cut into 2 cp equal chunks."""
    if cp == 1:
        return None
    why = cp_model_rule(graph, seq_len)
    if why is not None:
        return why
    assert seq_len is not None
    if seq_len % (2 * cp):
        return (
            f"sequence length {seq_len} is not divisible by 2 x cp = {2 * cp} (the sequence is "
            f"cut into 2 cp equal chunks for causal load balancing): pass a --seq-len that "
            f"is, or a smaller cp"
        )
    return None


def cp_model_rule(graph: Graph, seq_len: int | None) -> str | None:
    """The part of :func:`cp_rule` that does not depend on the cp degree."""
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
    return None


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


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_pins(pins: dict[str, int], cluster: Cluster, global_batch: int | None = None) -> None:
    """The pins' rules that need no model (the CLI checks them before tracing): their product
    divides the world size (equals it when every axis is pinned), and a pinned data-parallel
    size divides the global batch."""
    if not pins:
        return
    world = cluster.world_size
    product = math.prod(v for k, v in pins.items() if k not in CARVED)
    text = ",".join(f"{k}={v}" for k, v in pins.items())
    if world % product:
        raise PlanningError(
            f"--mesh {text} multiplies to {product}, which does not divide the world size "
            f"{world} of --cluster {cluster.spec}: pin degrees whose product divides {world}"
        )
    if len(set(pins) - set(CARVED)) == len(AXES) - len(CARVED) and product != world:
        raise PlanningError(
            f"--mesh {text} multiplies to {product}, but --cluster {cluster.spec} has {world} "
            f"devices: pin degrees whose product is {world}, or leave an axis out"
        )
    data = pins.get("dp", 1) * pins.get("fsdp", 1)
    ep = pins.get("ep", 1)
    if ep > 1 and world % ep:
        raise PlanningError(
            f"--mesh ep={ep} does not divide the world size {world}: expert parallelism is "
            "carved out of the data-parallel ranks; pin an ep that divides them"
        )
    if ep > 1 and ("dp" in pins or "fsdp" in pins) and ("dp" in pins) == ("fsdp" in pins):
        if data % ep:
            raise PlanningError(
                f"--mesh {text}: ep={ep} does not divide dp x fsdp = {data} (expert "
                "parallelism is carved out of the data-parallel ranks): pin an ep that does"
            )
    if global_batch is not None and batch_rule(global_batch, data) is not None:
        pinned = ",".join(f"{k}={pins[k]}" for k in ("dp", "fsdp") if k in pins)
        raise PlanningError(
            f"--global-batch {global_batch} is not divisible by the data-parallel size {data} "
            f"pinned by --mesh {pinned}: every data-parallel rank gets the same number of "
            f"samples; pass a multiple of {data} (e.g. --global-batch "
            f"{(global_batch // data + 1) * data}) or pin a smaller dp/fsdp"
        )


def batch_rule(global_batch: int, data_parallel: int) -> str | None:
    """Why ``global_batch`` cannot be split over ``data_parallel`` replicas (None: it can)."""
    if global_batch % data_parallel:
        return (
            f"global batch {global_batch} is not divisible by the data-parallel size "
            f"{data_parallel}"
        )
    return None


def mesh_rule(
    mesh: Mesh,
    global_batch: int,
    heads: set[int],
    tied: tuple[str, str] | tuple[()],
    cp_why=None,
    graph: Graph | None = None,
) -> str | None:
    """Why ``mesh`` is ruled out whatever the costs (None: it is legal). ``cp_why(cp)``: why
    the model cannot split its sequence cp ways (:func:`cp_rule`); ``graph``: for the
    expert-parallel rules (:func:`ep_rule`)."""
    why = batch_rule(global_batch, mesh.data_parallel)
    if why is not None:
        return why
    if mesh.ep > 1:
        why = ep_rule(mesh.ep, graph, mesh.tp, mesh.data_parallel)
        if why is None and mesh.cp > 1:
            why = f"ep={mesh.ep} with cp={mesh.cp}: not planned together yet; use cp=1"
        if why is not None:
            return why
    if mesh.cp > 1:
        if mesh.pp > 1:
            return "context parallelism runs without a pipeline"
        why = cp_why(mesh.cp) if cp_why is not None else None
        if why is not None:
            return why
    if mesh.pp > 1 and tied:
        a, b = tied
        return (
            f"layers {a} and {b} read the same (tied) parameter: pipeline stages cannot split "
            "them, and the emitted script refuses such a cut"
        )
    bad_heads = [h for h in heads if h % mesh.tp]
    if mesh.tp > 1 and bad_heads:
        return f"tp={mesh.tp} does not divide the {bad_heads[0]} attention heads"
    return None


def ep_rule(ep: int, graph: Graph | None, tp: int, data_parallel: int | None) -> str | None:
    """Why the experts cannot be split ``ep`` ways (None: they can): the model has MoE blocks
    (``ir.Graph.moes``), ep divides every block's expert count and the data-parallel ranks
    (``data_parallel``; None: not known yet), tp is 1 (experts are not tensor-parallel
    sharded under ep yet), and every block's experts are stacked in one module (``grouped``:
    the emitted program's all-to-all dispatch wraps that module; an ``nn.ModuleList`` of
    experts, called from the user's own dispatch loop, has no such boundary). Pipeline stages
    keep each layer a module, so the wrapper splits the experts of a stage's layers alike."""
    moes = graph.moes if graph is not None else ()
    if not moes:
        return "the model has no mixture-of-experts blocks (a top-k router over experts)"
    counts = sorted({m.num_experts for m in moes})
    bad = [c for c in counts if c % ep]
    if bad:
        return (
            f"ep={ep} does not divide the {bad[0]} experts of a MoE block: choose ep among "
            f"{[d for d in _divisors(math.gcd(*counts)) if d > 1]}"
        )
    if data_parallel is not None and data_parallel % ep:
        return (
            f"ep={ep} does not divide dp x fsdp = {data_parallel}: expert parallelism is "
            "carved out of the data-parallel ranks"
        )
    if tp > 1:
        return f"ep={ep} with tp={tp}: experts are not tensor-parallel under ep yet; use tp=1"
    listed = [m for m in moes if not m.grouped]
    if listed:
        return (
            f"ep={ep}: MoE block {listed[0].fqn} keeps its experts in a module list, one module "
            "each, which the emitted program cannot split (it splits experts stacked in one "
            "module, first dim = experts, called as experts(hidden, top_k_index, "
            "top_k_weights)); stack them, or plan with --mesh ep=1"
        )
    return None


def experts_gcd(graph: Graph) -> int:
    """The gcd of the MoE blocks' expert counts (0 without MoE blocks, or with a block whose
    experts are a module list: ep_rule refuses ep > 1 there): ep must divide it."""
    if not graph.moes or not all(m.grouped for m in graph.moes):
        return 0
    return math.gcd(*(m.num_experts for m in graph.moes))


def attention_heads(graph: Graph) -> set[int]:
    """Head counts seen by attention ops (dim 1 of q and k of each SDPA call)."""
    heads = set()
    for n in graph.nodes:
        if n.op == "aten.scaled_dot_product_attention.default":
            for ref in n.inputs[:2]:
                heads.add(graph.node(ref).out.shape[1])
    return heads


def module_kinds(graph: Graph) -> dict[str, str]:
    """FQN -> kind (``linear``, ``embedding``, ``norm``, ``layer``) of every module tensor
    parallelism can style (norms and layers as :mod:`planner.layouts` recognises them): what a plan records so that its styles are checked without the model
    (``Plan.module_kinds``)."""
    kinds = {
        fqn: MODULE_OPS[info.type][0]
        for fqn, info in graph.modules.items()
        if fqn and info.type in MODULE_OPS
    }
    norms = norm_modules(graph)
    kinds.update(dict.fromkeys(norms, "norm"))
    kinds.update({fqn: "layer" for fqn in scatter_layers(graph, norms).values()})
    order = {fqn: i for i, fqn in enumerate(graph.modules)}
    return dict(sorted(kinds.items(), key=lambda kv: order[kv[0]]))
