"""The search over meshes: every (dp, fsdp, tp) of the world size, each scored with the intra-layer
ILP (:mod:`planner.ilp`) and the cost model, the fastest plan that fits memory chosen.

Per candidate mesh (pp = 1 until pipeline stages land):

  local batch   b = global_batch / (dp * fsdp)                       (must divide exactly)
  compute, tp   from the ILP at degree tp with b (compute and TP collectives, fwd + bwd)
  dp traffic    DDP (dp > 1, fsdp = 1): all-reduce of the local gradients over dp;
                FSDP: all-gather of parameters in forward and again in backward, reduce-scatter
                of gradients, over fsdp; HSDP adds an all-reduce of the sharded gradients over dp
  exposed dp    GPU: the traffic hides behind backward (and forward, for FSDP's gathers) except
                what exceeds it, and never less than one bucket/unit that cannot overlap;
                CPU (gloo): nothing overlaps, the same cores compute and communicate
  optimizer     AdamW step on the local parameters (memory-bound)
  step time     compute + tp comm + exposed dp + optimizer
  memory        params + grads + optimizer states (sharded by fsdp, and by tp for the parameters
                the styles shard) + activations of the local batch (sharded where the layout is)
                + buffers (DDP gradient buckets, FSDP gathered units, allocator reserve)

The candidate with the lowest step time among those that fit the device memory wins; every other
candidate is kept with its prediction and the reason it lost.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from cost_model import (
    Cluster,
    MemoryBreakdown,
    adamw_step_time_s,
    axis_link,
    collective_time_s,
    memory_per_rank,
)
from ir import Graph
from planner import ilp
from planner.plan import (
    Alternative,
    Mesh,
    ModelRef,
    Plan,
    Predicted,
    Schedule,
    TimeBreakdown,
    Training,
)

_AXES = ("pp", "dp", "fsdp", "tp")
_HEAD_ATTRS = (
    "n_head",
    "n_heads",
    "num_heads",
    "num_attention_heads",
    "num_key_value_heads",
    "n_kv_heads",
    "n_kv_head",
    "num_kv_heads",
)
# DDP's default bucket: the last one is reduced after backward ends and cannot overlap.
_DDP_BUCKET_BYTES = 25 * 2**20
# GPU memory kept by the CUDA context, NCCL buffers and cuBLAS workspaces (assumption).
_GPU_RESERVE_BYTES = int(1.5 * 2**30)
_NUM_ALTERNATIVES = 8


class PlanningError(ValueError):
    """The constraints admit no plan; the message says which constraint bound and what to relax."""


@dataclass(frozen=True)
class Candidate:
    mesh: Mesh
    step_time_s: float
    memory: MemoryBreakdown
    fits: bool
    why_not: str | None
    """a constraint that rules the mesh out (memory is judged separately through ``fits``)."""
    time: TimeBreakdown | None = None
    solution: ilp.TPSolution | None = None

    @property
    def idle_tp(self) -> bool:
        """tp > 1 with no module sharded: the TP group only repeats work. Such a mesh is chosen
        only when nothing else fits, however the costs compare."""
        return self.mesh.tp > 1 and self.solution is not None and not self.solution.styles


def parse_mesh(text: str) -> dict[str, int]:
    """``"tp=2,fsdp=2"`` -> ``{"tp": 2, "fsdp": 2}``; raises PlanningError with one line."""
    pins: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in _AXES or not value.strip().isdigit() or int(value) < 1:
            raise PlanningError(
                f"--mesh {text!r}: {part!r} is not AXIS=N with AXIS one of {', '.join(_AXES)} "
                "and N >= 1: write e.g. --mesh tp=2,fsdp=2"
            )
        if key in pins:
            raise PlanningError(f"--mesh {text!r} sets {key} twice: give each axis once")
        pins[key] = int(value)
    return pins


def enumerate_meshes(world: int, devices_per_node: int, pins: dict[str, int]) -> list[Mesh]:
    """Every (pp=1, dp, fsdp, tp) with product ``world`` matching ``pins``, tp within a node."""
    out = []
    for tp in _divisors(world):
        if tp > devices_per_node and "tp" not in pins:
            continue
        for fsdp in _divisors(world // tp):
            mesh = Mesh(pp=1, dp=world // tp // fsdp, fsdp=fsdp, tp=tp)
            if all(getattr(mesh, k) == v for k, v in pins.items()):
                out.append(mesh)
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_pins(pins: dict[str, int], cluster: Cluster, graph: Graph) -> None:
    world = cluster.world_size
    if pins.get("pp", 1) > 1:
        raise PlanningError(
            f"--mesh pp={pins['pp']}: pipeline parallelism is not supported by this version of "
            "autopar yet: drop pp from --mesh"
        )
    product = math.prod(pins.values())
    if world % product or (len(pins) == len(_AXES) and product != world):
        raise PlanningError(
            f"--mesh {','.join(f'{k}={v}' for k, v in pins.items())} multiplies to {product}, "
            f"which does not divide the world size {world} of --cluster {cluster.spec}: choose "
            f"degrees whose product divides {world}"
        )
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


def attention_heads(graph: Graph) -> set[int]:
    """Head counts seen by attention ops (dim 1 of q and k of each SDPA call)."""
    heads = set()
    for n in graph.nodes:
        if n.op == "aten.scaled_dot_product_attention.default":
            for ref in n.inputs[:2]:
                heads.add(graph.node(ref).out.shape[1])
    return heads


def search(
    graph: Graph,
    cluster: Cluster,
    training: Training,
    *,
    model: ModelRef,
    pins: dict[str, int] | None = None,
) -> Plan:
    """The fastest plan that fits, with the others kept as alternatives."""
    start = time.perf_counter()
    pins = dict(pins or {})
    check_pins(pins, cluster, graph)
    heads = attention_heads(graph)
    cache: dict[tuple, ilp.TPSolution] = {}
    candidates = []
    for mesh in enumerate_meshes(cluster.world_size, cluster.devices_per_node, pins):
        candidates.append(_evaluate(graph, cluster, training, mesh, heads, cache))
    legal = [c for c in candidates if c.why_not is None]
    fitting = sorted((c for c in legal if c.fits), key=lambda c: (c.idle_tp, c.step_time_s))
    if not fitting:
        raise PlanningError(_nothing_fits(candidates, legal, cluster, training))
    best = fitting[0]
    return _plan(graph, cluster, training, model, best, candidates, time.perf_counter() - start)


def _nothing_fits(
    candidates: list[Candidate], legal: list[Candidate], cluster: Cluster, training: Training
) -> str:
    if not legal:
        reasons = list(dict.fromkeys(f"{c.why_not} ({c.mesh.short()})" for c in candidates))
        return f"no mesh is possible on {cluster.spec}: " + "; ".join(reasons[:3])
    least = min(legal, key=lambda c: c.memory.total)
    cap = cluster.device.memory_bytes
    return (
        f"no plan fits in {cap / 1e9:.1f} GB per device: the smallest needs "
        f"{least.memory.total / 1e9:.1f} GB ({least.mesh.short()}); use more devices or a "
        f"smaller global batch{' or --dtype bf16' if training.dtype == 'fp32' else ''}"
    )


def _evaluate(
    graph: Graph,
    cluster: Cluster,
    training: Training,
    mesh: Mesh,
    heads: set[int],
    cache: dict[tuple, ilp.TPSolution],
) -> Candidate:
    dp_size = mesh.data_parallel
    empty = MemoryBreakdown(params=0, grads=0, optimizer=0, activations=0, buffers=0)
    if training.global_batch % dp_size:
        why = (
            f"global batch {training.global_batch} is not divisible by the data-parallel size "
            f"{dp_size}"
        )
        return Candidate(mesh, math.inf, empty, False, why)
    bad_heads = [h for h in heads if h % mesh.tp]
    if mesh.tp > 1 and bad_heads:
        why = f"tp={mesh.tp} does not divide the {bad_heads[0]} attention heads"
        return Candidate(mesh, math.inf, empty, False, why)
    local_batch = training.global_batch // dp_size
    axes = [(a, getattr(mesh, a)) for a in _AXES]
    sync_rate = _sync_s_per_byte(cluster, mesh, axes)
    key = (mesh.tp, local_batch, round(sync_rate * 1e15))
    if key not in cache:
        inputs = ilp.CostInputs(
            tp=mesh.tp,
            batch_scale=local_batch / graph.batch_size,
            device=cluster.device,
            dtype=training.dtype,
            tp_link=axis_link(cluster, axes, "tp"),
            grad_sync_s_per_byte=sync_rate,
        )
        cache[key] = ilp.solve(graph, inputs)
    sol = cache[key]
    return _score(graph, cluster, training, mesh, axes, sol)


def _sync_s_per_byte(cluster: Cluster, mesh: Mesh, axes: list[tuple[str, int]]) -> float:
    """Time per byte of local (TP-sharded) parameters spent on data-parallel traffic."""
    big = 2**30

    def rate(kind: str, axis: str, group: int, fraction: float = 1.0) -> float:
        if group == 1:
            return 0.0
        link = axis_link(cluster, axes, axis)
        return (
            collective_time_s(kind, big * fraction, group, link)
            - collective_time_s(kind, 0, group, link)
        ) / big

    if mesh.fsdp == 1:
        return rate("all_reduce", "dp", mesh.dp)
    per_fsdp = 2 * rate("all_gather", "fsdp", mesh.fsdp) + rate("reduce_scatter", "fsdp", mesh.fsdp)
    return per_fsdp + rate("all_reduce", "dp", mesh.dp, 1 / mesh.fsdp)


def _score(
    graph: Graph,
    cluster: Cluster,
    training: Training,
    mesh: Mesh,
    axes: list[tuple[str, int]],
    sol: ilp.TPSolution,
) -> Candidate:
    # the graph was traced at the compute dtype: its byte counts are already in that dtype
    device = cluster.device
    param_bytes = graph.param_bytes
    sharded = sol.sharded_param_bytes
    tp_local_bytes = sharded / mesh.tp + (param_bytes - sharded)
    local_numel = tp_local_bytes * graph.num_params / max(1, param_bytes) / mesh.fsdp
    dp_traffic = _dp_traffic_s(graph, cluster, mesh, axes, tp_local_bytes)
    bwd_share = graph.bwd_flops / max(1, graph.fwd_flops + graph.bwd_flops)
    exposed_dp = _exposed(device.kind, dp_traffic, sol.compute_s, bwd_share, mesh, cluster, axes)
    num_tensors = sum(len(m.params) for m in graph.modules.values())
    optimizer = (
        adamw_step_time_s(local_numel, device, num_tensors)
        if training.optimizer == "adamw"
        else local_numel * 12 / (device.memory_bandwidth_bytes_per_s * device.memory_efficiency)
    )
    time_parts = TimeBreakdown(
        compute=sol.compute_s,
        exposed_comm=sol.comm_s + exposed_dp,
        bubble=0.0,
        optimizer=optimizer,
        tp_comm=sol.comm_s,
        dp_comm=exposed_dp,
    )
    activations = sum(sol.activation_bytes.values())
    memory = memory_per_rank(
        param_numel=local_numel,
        param_dtype=training.dtype,
        shard_factor=1,
        activation_bytes=activations,
        buffer_bytes=_buffers(graph, cluster, mesh, tp_local_bytes),
        optimizer=training.optimizer,
    )
    fits = memory.total <= device.memory_bytes
    return Candidate(mesh, time_parts.total, memory, fits, None, time_parts, sol)


def _dp_traffic_s(
    graph: Graph, cluster: Cluster, mesh: Mesh, axes: list[tuple[str, int]], local_bytes: float
) -> float:
    """Data-parallel traffic per step, one collective per DDP bucket or per FSDP unit (each
    collective pays the link latency, which dominates for small models on gloo)."""
    if mesh.data_parallel == 1:
        return 0.0
    dp_link = axis_link(cluster, axes, "dp")
    if mesh.fsdp == 1:
        buckets = max(1, math.ceil(local_bytes / _DDP_BUCKET_BYTES))
        return buckets * collective_time_s("all_reduce", local_bytes / buckets, mesh.dp, dp_link)
    # FSDP2 units: every module layer, plus the root for what they leave out
    units = sum(1 for layer in graph.layers if layer.is_module) + 1
    unit_bytes = local_bytes / units
    fsdp_link = axis_link(cluster, axes, "fsdp")
    per_unit = 2 * collective_time_s("all_gather", unit_bytes, mesh.fsdp, fsdp_link)
    per_unit += collective_time_s("reduce_scatter", unit_bytes, mesh.fsdp, fsdp_link)
    per_unit += collective_time_s("all_reduce", unit_bytes / mesh.fsdp, mesh.dp, dp_link)
    return units * per_unit


def _exposed(
    kind: str,
    traffic: float,
    compute: float,
    bwd_share: float,
    mesh: Mesh,
    cluster: Cluster,
    axes: list[tuple[str, int]],
) -> float:
    """Data-parallel traffic left on the critical path (see the module docstring)."""
    if traffic == 0.0 or kind == "cpu":
        return traffic
    window = compute if mesh.fsdp > 1 else compute * bwd_share
    axis = "fsdp" if mesh.fsdp > 1 else "dp"
    group = mesh.fsdp if mesh.fsdp > 1 else mesh.dp
    tail = collective_time_s("all_reduce", _DDP_BUCKET_BYTES, group, axis_link(cluster, axes, axis))
    return max(traffic - window, min(traffic, tail))


def _buffers(graph: Graph, cluster: Cluster, mesh: Mesh, tp_local_bytes: float) -> float:
    reserve = _GPU_RESERVE_BYTES if cluster.device.kind == "gpu" else 0
    if mesh.fsdp > 1:
        # the current unit and the prefetched next one are held unsharded
        biggest = max(layer.param_bytes for layer in graph.layers) / mesh.tp
        return reserve + 2 * biggest
    if mesh.dp > 1:
        return reserve + tp_local_bytes  # DDP's gradient buckets: a second copy of the grads
    return reserve


def _plan(
    graph: Graph,
    cluster: Cluster,
    training: Training,
    model: ModelRef,
    best: Candidate,
    candidates: list[Candidate],
    elapsed_s: float,
) -> Plan:
    sol = best.solution
    assert sol is not None and best.time is not None
    step = best.step_time_s
    samples = training.global_batch / step
    model_flops = (graph.fwd_flops + graph.bwd_flops) * training.global_batch / graph.batch_size
    peak = cluster.device.peak_flops[training.dtype] * cluster.world_size
    predicted = Predicted(
        step_time_s=step,
        peak_memory_bytes=best.memory.total,
        memory_breakdown_bytes=best.memory,
        tokens_per_s=samples * training.seq_len if training.seq_len else None,
        samples_per_s=samples,
        mfu=model_flops / (step * peak),
        time_breakdown_s=best.time,
    )
    layers = [layer.fqn for layer in graph.layers]
    return Plan(
        model=model,
        cluster=cluster,
        training=training,
        mesh=best.mesh,
        layers=layers,
        stages=[[fqn for fqn in layers if graph.layer(fqn).is_module]],
        schedule=Schedule(),
        tensor_parallel=sol.styles,
        module_attrs=_module_attrs(graph, sol.styles, best.mesh.tp),
        checkpointing={fqn: "none" for fqn in layers if graph.layer(fqn).is_module},
        predicted=predicted,
        planning_time_s=elapsed_s,
        alternatives=_alternatives(best, candidates),
        notes=_notes(best),
    )


def _notes(best: Candidate) -> list[str]:
    if best.idle_tp:
        return [
            f"tp={best.mesh.tp} shards no module: at this size the cost model finds every "
            "module cheaper replicated (collectives and DTensor dispatch outweigh the compute "
            "saved), so the TP group repeats work; pin a smaller tp or use a larger model"
        ]
    return []


def _module_attrs(graph: Graph, styles: dict[str, str], tp: int) -> dict[str, dict[str, int]]:
    """Head-count attributes of modules that own tensor-parallel linears, divided by tp, so a
    model that sizes its views from them sees its local heads."""
    if tp == 1:
        return {}
    out: dict[str, dict[str, int]] = {}
    parents = {fqn.rpartition(".")[0] for fqn, s in styles.items() if s.startswith("colwise")}
    for fqn in sorted(parents):
        info = graph.modules.get(fqn)
        attrs = {
            k: v // tp
            for k, v in (info.int_attrs.items() if info else ())
            if k in _HEAD_ATTRS and v % tp == 0
        }
        if attrs:
            out[fqn] = attrs
    return out


def _alternatives(best: Candidate, candidates: list[Candidate]) -> list[Alternative]:
    others = sorted(
        (c for c in candidates if c is not best),
        key=lambda c: (c.why_not is not None, not c.fits, c.step_time_s),
    )
    return [
        Alternative(
            mesh=c.mesh,
            step_time_s=c.step_time_s if math.isfinite(c.step_time_s) else 0.0,
            peak_memory_bytes=c.memory.total,
            fits=c.fits and c.why_not is None,
            why=_why_lost(c, best),
        )
        for c in others[:_NUM_ALTERNATIVES]
    ]


def _why_lost(c: Candidate, best: Candidate) -> str:
    if c.why_not is not None:
        return c.why_not
    if c.idle_tp and not best.idle_tp:
        return f"at tp={c.mesh.tp} no module pays to shard: the TP group would only repeat work"
    if not c.fits:
        return f"needs {c.memory.total / 1e9:.2f} GB per device, more than the device has"
    assert c.time is not None and best.time is not None
    parts = ("compute", "tp_comm", "dp_comm", "optimizer")
    diffs = {p: getattr(c.time, p) - getattr(best.time, p) for p in parts}
    worst = max(diffs, key=lambda p: diffs[p])
    return (
        f"{(c.step_time_s - best.step_time_s) * 1e3:+.3g} ms per step, mostly {worst} "
        f"({diffs[worst] * 1e3:+.3g} ms)"
    )
