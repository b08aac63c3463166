"""Why a plan wins: its step-time and memory breakdowns, the alternatives and why each lost, the
diff against a forced plan (``--why-not``), and an approximate pipeline timeline per rank.

Pure functions of :class:`~planner.plan.Plan` data: each returns a frozen dataclass that carries
both the numbers (for tests, the report, scripts) and ``text`` (what ``plan --explain`` prints).

The step-time parts are :meth:`TimeBreakdown.parts`, which sum to the predicted step time by
construction (the search builds the step time as their sum). The timeline is a list-scheduling
replay of each pipeline rank's op order (``planner.schedules.rank_ops``: torch 2.13's order)
with the plan's per-stage, per-microbatch times: an op starts when its rank is free and its input is ready (the
previous stage's forward, the next stage's backward). p2p transfers and the pipeline runtime's
overhead are not drawn, so its length approximates, not equals, the predicted step time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from autopar.cost_model import MemoryBreakdown
from autopar.planner import schedules
from autopar.planner.plan import Alternative, Plan
from autopar.planner.summary import mixed_rows

__all__ = [
    "AlternativeRow",
    "Block",
    "Explanation",
    "RankMemory",
    "WhyNot",
    "ElasticRow",
    "elastic_rows",
    "elastic_table",
    "explain",
    "timeline",
    "why_not",
]

PART_WORDS = {
    "compute": "forward + backward",
    "recompute": "forward re-run of checkpointed layers",
    "tp_comm": "tensor-parallel collectives",
    "cp_comm": "context-parallel key/value all-gathers (and their gradients)",
    "dp_comm": "data-parallel / FSDP traffic left exposed",
    "pp_comm": "pipeline send/recv and runtime overhead",
    "ep_comm": "expert-parallel token all-to-alls (dispatch, combine; fwd + bwd)",
    "bubble": "pipeline ranks idle (fill and drain)",
    "optimizer": "optimizer step",
    "other_comm": "other exposed communication",
}
MEMORY_KINDS = ("params", "grads", "optimizer", "activations", "buffers")


@dataclass(frozen=True)
class RankMemory:
    """Predicted memory of one pipeline rank."""

    rank: int
    stages: tuple[int, ...]
    """the (virtual) stages it runs."""
    memory: MemoryBreakdown
    capacity_bytes: int = 0
    """the device memory it may fill (its group's on a mixed cluster's pipeline:
    ``Plan.rank_capacity_bytes``)."""

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.capacity_bytes


@dataclass(frozen=True)
class AlternativeRow:
    label: str
    """mesh, and schedule x microbatches for pipelines."""
    step_time_s: float | None
    """None where ruled out before scoring; a lower bound where ``lost_by == "pruned"``."""
    memory_bytes: int | None
    fits: bool
    lost_by: str
    why: str


@dataclass(frozen=True)
class Block:
    """One bar of the timeline: an op of a pipeline rank (or, without a pipeline, a phase)."""

    rank: int
    start_s: float
    end_s: float
    kind: str
    """F (forward), B (backward: input + weight grads, + recompute), I (input grads), W (weight
    grads), or a step phase: tp_comm, dp_comm, optimizer."""
    stage: int | None = None
    microbatch: int | None = None


@dataclass(frozen=True)
class Explanation:
    step_time_s: float
    time_parts: dict[str, float]
    """disjoint parts (TimeBreakdown.parts) that sum to ``step_time_s``."""
    capacity_bytes: int
    rank_memory: list[RankMemory]
    alternatives: list[AlternativeRow]
    timeline: list[Block] = field(default_factory=list)
    timeline_s: float = 0.0
    """the timeline's length (approximates ``step_time_s``)."""
    text: str = ""

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class WhyNot:
    pins: str
    forced: Plan | None
    """the best plan with those pins, None where they admit none."""
    error: str | None
    rows: list[tuple[str, str, float, float]]
    """(section, part, chosen, forced): section "time" (seconds: the parts, then "step time")
    or "memory" (bytes of the fullest rank: the kinds, then "peak")."""
    verdict: str
    text: str = ""

    def __str__(self) -> str:
        return self.text


# -- the explanation ---------------------------------------------------------------------------


def explain(plan: Plan) -> Explanation:
    """The chosen plan's breakdowns and the alternatives, as data and as text."""
    p = plan.predicted
    parts = p.time_breakdown_s.parts()
    rank_memory = _rank_memory(plan)
    alternatives = [_row(a) for a in plan.alternatives]
    blocks = timeline(plan)
    expl = Explanation(
        step_time_s=p.step_time_s,
        time_parts=parts,
        capacity_bytes=plan.cluster.device.memory_bytes,
        rank_memory=rank_memory,
        alternatives=alternatives,
        timeline=blocks,
        timeline_s=max((b.end_s for b in blocks), default=0.0),
    )
    return _with_text(expl, plan)


def _rank_memory(plan: Plan) -> list[RankMemory]:
    p = plan.predicted
    pp = plan.mesh.pp
    held = {r: tuple(j for j, s in enumerate(p.stages) if s.rank == r) for r in range(pp)}
    cap = plan.rank_capacity_bytes
    if len(p.rank_memory_bytes) == pp:
        return [RankMemory(r, held[r], m, cap[r]) for r, m in enumerate(p.rank_memory_bytes)]
    return [
        RankMemory(0, held.get(0, ()), p.memory_breakdown_bytes, min(cap))
    ]  # a plan without per-rank data


def _label(mesh_text: str, alt: Alternative) -> str:
    s = alt.schedule
    if s is None or s.name == "none":
        return mesh_text
    return f"{mesh_text} {s.name} x{s.num_microbatches}"


def _row(a: Alternative) -> AlternativeRow:
    lost_by = a.lost_by or ("constraint" if a.step_time_s == 0 and not a.fits else "slower")
    scored = a.step_time_s > 0 or a.time_breakdown_s is not None
    return AlternativeRow(
        label=_label(a.mesh.short(), a),
        step_time_s=a.step_time_s if scored else None,
        memory_bytes=a.peak_memory_bytes if a.peak_memory_bytes else None,
        fits=a.fits,
        lost_by=lost_by,
        why=a.why,
    )


def _with_text(expl: Explanation, plan: Plan) -> Explanation:
    lines = [f"why {plan.mesh.short()}: {_plan_words(plan)}", ""]
    lines += [f"{k}: {v}" for k, v in mixed_rows(plan)] + ([""] if plan.mixed_cluster else [])
    lines += _pinned_tp_table(plan)
    lines += _time_table(expl)
    lines += _expert_table(plan)
    lines += _coupling_lines(plan)
    lines += [""] + _stage_table(plan)
    lines += [""] + _memory_table(expl)
    lines += [""] + _alternatives_table(expl, plan)
    return replace(expl, text="\n".join(lines).rstrip() + "\n")


def _coupling_lines(plan: Plan) -> list[str]:
    """What couples the samples of a batch (plan.batch_coupling): each coupling, what the
    program does about it, and the warnings the plan leaves."""
    bc = plan.batch_coupling
    if bc is None:
        return []
    done = {
        "batch_norm": "synced over the data-parallel ranks" if bc.sync_batchnorm else "per rank",
        "batch_product": "gathered over the data-parallel ranks" if bc.gather_loss else "per rank",
        "routing": "per rank (by design)",
    }
    lines = ["", "batch coupling (what mixes the samples of a batch):"]
    for c in bc.couplings:
        name = "loss_fn" if c.where == "loss_fn" else repr(c.where)
        kind = c.module_type or c.op
        lines.append(f"  {name:<24} {c.kind:<14} {kind:<20} {done[c.kind]}")
    lines.append(f"  --verify's reference trains on the {bc.verify_reference}")
    return lines + [f"  warning: {line}" for line in bc.warnings]


def _plan_words(plan: Plan) -> str:
    s, p = plan.schedule, plan.predicted
    words = f"predicted {_ms(p.step_time_s)} per step"
    if plan.mesh.pp > 1:
        words += f", {s.name} with {s.num_microbatches} microbatches over {len(plan.stages)} stages"
    fitting = [a for a in plan.alternatives if a.fits and a.lost_by in (None, "slower")]
    if fitting:
        nxt = min(fitting, key=lambda a: a.step_time_s)
        gap = nxt.step_time_s - p.step_time_s
        words += f"; the next best that fits ({nxt.mesh.short()}) is {_ms(gap, sign=True)} slower"
    return words


def _pinned_tp_table(plan: Plan) -> list[str]:
    """With tp pinned: the forced sharding against the cost model's own choice on the mesh."""
    pin = plan.pinned_tp
    if pin is None:
        return []
    p = plan.predicted
    free_step = pin.free_step_time_s
    free_mem = pin.free_peak_memory_bytes
    rows = [
        ("modules sharded", str(pin.sharded_modules), str(pin.free_sharded_modules), ""),
        (
            "step time",
            _ms(p.step_time_s),
            "does not fit" if free_step is None else _ms(free_step),
            "-" if free_step is None else _ms(p.step_time_s - free_step, sign=True),
        ),
        (
            "peak memory",
            _size(p.peak_memory_bytes),
            _size(free_mem),
            "-" if free_mem is None else _size_diff(p.peak_memory_bytes - free_mem),
        ),
    ]
    head = ("", f"pinned tp={plan.mesh.tp} (this plan)", "cost model's own choice", "diff")
    title = (
        f"tp={plan.mesh.tp} is pinned: every module that can be sharded at tp={plan.mesh.tp} is; "
        f"against the cost model's own choice on {plan.mesh.short()}"
    )
    return [title] + _table(head, rows, right=(1, 2, 3)) + [""]


def _time_table(expl: Explanation) -> list[str]:
    total = expl.step_time_s
    rows = [
        (name, _ms(sec), f"{sec / total:.1%}" if total else "-", PART_WORDS.get(name, ""))
        for name, sec in expl.time_parts.items()
    ]
    rows.append(("total", _ms(sum(expl.time_parts.values())), "100.0%", "predicted step time"))
    return ["step time"] + _table(("part", "time", "share", "what"), rows, right=(1, 2))


def _expert_table(plan: Plan) -> list[str]:
    """ep > 1: the all-to-all per step and the experts' state per rank, against ep = 1."""
    ep = plan.expert_parallel
    if ep is None:
        return []
    e = plan.mesh.ep
    rows = [
        ("experts per rank", f"{ep.num_experts // e} of {ep.num_experts}", f"top-{ep.top_k}"),
        (
            "all-to-all / step",
            _ms(ep.all_to_all_s),
            f"4 per MoE block and microbatch, busiest rank at {ep.imbalance:g}x the mean tokens",
        ),
        (
            "expert state / rank",
            _size(ep.expert_bytes_per_rank),
            f"params + grads + optimizer; {_size(ep.expert_bytes_at_ep1)} at ep=1",
        ),
    ]
    title = f"expert parallel: ep={e} over {len(ep.blocks)} MoE blocks"
    return ["", title] + _table(("", "value", "what"), rows, right=(1,))


def _stage_table(plan: Plan) -> list[str]:
    stages = plan.predicted.stages
    if not stages:
        return ["stages: no per-stage predictions in this plan"]
    rows = []
    for j, st in enumerate(stages):
        layers = plan.stages[j] if j < len(plan.stages) else []
        span = (
            f"{layers[0]} .. {layers[-1]} ({len(layers)})" if len(layers) > 1 else "".join(layers)
        )
        rows.append(
            (
                str(j),
                str(st.rank),
                span or "-",
                _ms(st.fwd_s),
                _ms(st.bwd_s),
                _ms(st.recompute_s),
                f"{st.in_flight:g}",
                _size(st.memory_bytes),
            )
        )
    title = "per stage, one microbatch" if plan.mesh.pp > 1 else "the one stage (no pipeline)"
    head = ("stage", "rank", "layers", "fwd", "bwd", "recompute", "in flight", "memory")
    return [title] + _table(head, rows, right=(3, 4, 5, 6, 7))


def _memory_table(expl: Explanation) -> list[str]:
    cap = expl.capacity_bytes
    mixed = len({rm.capacity_bytes for rm in expl.rank_memory}) > 1  # each rank its group's
    rows = []
    for rm in expl.rank_memory:
        m = rm.memory
        own = rm.capacity_bytes
        rows.append(
            (
                str(rm.rank),
                ",".join(map(str, rm.stages)) or "-",
                *(_size(getattr(m, k)) for k in MEMORY_KINDS),
                _size(m.total),
                *((_size(own),) if mixed else ()),
                (f"{m.total / own:.1%}" if own else "-") + ("" if rm.fits else " (over)"),
            )
        )
    if mixed:
        head = ("rank", "stages", *MEMORY_KINDS, "total", "its group's", "of it")
        title = "memory per pipeline rank (each against its own group's device memory)"
    else:
        head = ("rank", "stages", *MEMORY_KINDS, "total", "of device")
        title = f"memory per pipeline rank (device: {_size(cap)})"
    return [title] + _table(head, rows, right=tuple(range(2, len(head))))


def _alternatives_table(expl: Explanation, plan: Plan) -> list[str]:
    if not expl.alternatives:
        return ["alternatives: none (the constraints leave one candidate)"]
    chosen = plan.predicted.step_time_s
    rows = []
    for i, a in enumerate(expl.alternatives, 1):
        if a.step_time_s is None:
            step, diff = "-", "-"
        elif a.lost_by == "pruned":
            step, diff = f">={_ms(a.step_time_s)}", f">={_ms(a.step_time_s - chosen, sign=True)}"
        else:
            step, diff = _ms(a.step_time_s), _ms(a.step_time_s - chosen, sign=True)
        memory = _size(a.memory_bytes) if a.memory_bytes else "-"
        rows.append((str(i), a.label, step, diff, memory, "yes" if a.fits else "no", a.why))
    head = ("#", "alternative", "step", "vs chosen", "memory", "fits", "why it lost")
    title = f"top {len(rows)} alternatives (best first)"
    return [title] + _table(head, rows, right=(2, 3, 4))


# -- --elastic ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ElasticRow:
    """One node count of an elastic plan set (``plan --elastic MIN:MAX``)."""

    nodes: int
    world_size: int
    mesh: str
    """the plan's mesh, short form (``fsdp=2,tp=2``)."""
    accumulation_steps: int
    """microbatches per step at pp = 1 (accumulation), else 1: what fits the global batch."""
    step_time_s: float
    tokens_per_s: float | None
    samples_per_s: float
    vs_largest: float
    """this node count's throughput over the largest node count's (1.0 for the largest)."""


def elastic_rows(plans: dict[int, Plan]) -> list[ElasticRow]:
    """The plan for each node count and its predicted throughput, largest node count first."""
    largest = plans[max(plans)].predicted.samples_per_s
    rows = []
    for nodes in sorted(plans, reverse=True):
        plan = plans[nodes]
        p = plan.predicted
        accumulation = plan.schedule.num_microbatches if plan.mesh.pp == 1 else 1
        rows.append(
            ElasticRow(
                nodes=nodes,
                world_size=plan.world_size,
                mesh=plan.mesh.short(),
                accumulation_steps=accumulation,
                step_time_s=p.step_time_s,
                tokens_per_s=p.tokens_per_s,
                samples_per_s=p.samples_per_s,
                vs_largest=p.samples_per_s / largest if largest > 0 else 0.0,
            )
        )
    return rows


def elastic_table(plans: dict[int, Plan]) -> str:
    """``--explain``'s table of an elastic plan set: what losing (or gaining) a node costs."""
    rows = []
    for r in elastic_rows(plans):
        rate = (
            f"{r.tokens_per_s:,.0f} tok/s" if r.tokens_per_s else f"{r.samples_per_s:.2f} samples/s"
        )
        accumulation = str(r.accumulation_steps) if r.accumulation_steps > 1 else "-"
        rows.append(
            (str(r.nodes), str(r.world_size), r.mesh, accumulation, _ms(r.step_time_s), rate,
             f"{100 * r.vs_largest:.0f}%")
        )  # fmt: skip
    head = ("nodes", "ranks", "mesh", "accum", "step", "throughput", "vs largest")
    title = (
        f"elastic plans for {min(plans)}..{max(plans)} nodes (same global batch; the run "
        "takes the plan for the nodes it finds)"
    )
    return "\n".join([title, *_table(head, rows, right=(0, 1, 4, 5, 6))]) + "\n"


# -- --why-not ---------------------------------------------------------------------------------


def why_not(chosen: Plan, pins: str, forced: Plan | None, error: str | None = None) -> WhyNot:
    """The forced plan (the search's best under ``pins``) side by side with the chosen one, or
    why ``pins`` admit no plan (``error``)."""
    if forced is None:
        verdict = f"{pins} is ruled out: {error or 'no plan'}"
        rows: list[tuple[str, str, float, float]] = []
        text = f"why not {pins}?\n  verdict: {verdict}\n"
        return WhyNot(pins, None, error, rows, verdict, text)
    a, b = chosen.predicted, forced.predicted
    ta, tb = a.time_breakdown_s.parts(), b.time_breakdown_s.parts()
    names = list(dict.fromkeys([*ta, *tb]))
    rows = [("time", n, ta.get(n, 0.0), tb.get(n, 0.0)) for n in names]
    rows.append(("time", "step time", a.step_time_s, b.step_time_s))
    ma, mb = a.memory_breakdown_bytes, b.memory_breakdown_bytes
    rows += [("memory", k, float(getattr(ma, k)), float(getattr(mb, k))) for k in MEMORY_KINDS]
    rows.append(("memory", "peak", float(ma.total), float(mb.total)))
    verdict = _verdict(chosen, forced, pins, ta, tb)
    table = []
    for section, name, x, y in rows:
        if section == "time":
            table.append((f"time: {name}", _ms(x), _ms(y), _ms(y - x, sign=True)))
        else:
            table.append((f"memory: {name}", _size(x), _size(y), _size_diff(y - x)))
    head = ("part", f"chosen {chosen.mesh.short()}", f"forced {forced.mesh.short()}", "diff")
    lines = [f"why not {pins}?", f"  chosen: {_describe(chosen)}", f"  forced: {_describe(forced)}"]
    lines += [""] + _table(head, table, right=(1, 2, 3)) + ["", f"verdict: {verdict}"]
    return WhyNot(pins, forced, None, rows, verdict, "\n".join(lines) + "\n")


def _describe(plan: Plan) -> str:
    s = plan.schedule
    words = plan.mesh.short()
    if plan.mesh.pp > 1:
        words += f", {s.name} x{s.num_microbatches} microbatches, {len(plan.stages)} stages"
    ckpt = sum(v == "full" for v in plan.checkpointing.values())
    words += f", {len(plan.tensor_parallel)} TP-sharded modules, {ckpt} layers checkpointed"
    return words


def _verdict(chosen: Plan, forced: Plan, pins: str, ta: dict, tb: dict) -> str:
    a, b = chosen.predicted, forced.predicted
    if forced.mesh == chosen.mesh and forced.schedule == chosen.schedule:
        return f"{pins} gives the chosen plan itself"
    gap = b.step_time_s - a.step_time_s
    diffs = {n: tb.get(n, 0.0) - ta.get(n, 0.0) for n in set(ta) | set(tb)}
    if gap > 0:
        worst = max(diffs, key=lambda n: diffs[n])
        mem = b.peak_memory_bytes - a.peak_memory_bytes
        return (
            f"{pins} is {_ms(gap, sign=True)} per step ({gap / a.step_time_s:+.1%}) slower, mostly "
            f"{worst} ({_ms(diffs[worst], sign=True)}: {PART_WORDS.get(worst, worst)}); it "
            f"needs {_size(b.peak_memory_bytes)} per device ({_size_diff(mem)})"
        )
    if forced.mesh.tp > 1 and not forced.tensor_parallel:
        return (
            f"{pins} predicts {_ms(-gap)} less per step, but its TP group shards no module "
            "(every rank repeats the same work): such meshes rank after every other that fits"
        )
    return (
        f"{pins} predicts {_ms(-gap)} less per step than the chosen plan: the search ranks "
        "by step time, so this is a tie or a gap the pins opened (see the rows above)"
    )


# -- the timeline ------------------------------------------------------------------------------


def timeline(plan: Plan) -> list[Block]:
    """Approximate per-rank blocks of one step (module docstring); [] without stage data."""
    stages = plan.predicted.stages
    if not stages:
        return []
    parts = plan.predicted.time_breakdown_s.parts()
    if plan.mesh.pp == 1:
        return _single_rank(stages[0], parts)
    blocks = _pipeline_blocks(plan)
    tail = [("dp_comm", parts.get("dp_comm", 0.0)), ("optimizer", parts.get("optimizer", 0.0))]
    end = {r: max(b.end_s for b in blocks if b.rank == r) for r in range(plan.mesh.pp)}
    for r in range(plan.mesh.pp):
        t = end[r]
        for kind, sec in tail:
            if sec > 0:
                blocks.append(Block(r, t, t + sec, kind))
                t += sec
    return blocks


def _single_rank(stage, parts: dict[str, float]) -> list[Block]:
    """pp = 1: forward, backward (with recompute), then the exposed communication and the
    optimizer, each drawn as one block of its predicted total."""
    compute = parts.get("compute", 0.0)
    work = stage.fwd_s + stage.bwd_s
    fwd = compute * (stage.fwd_s / work if work else 1 / 3)
    seq = [
        ("F", fwd),
        ("B", compute - fwd + parts.get("recompute", 0.0)),
        ("tp_comm", parts.get("tp_comm", 0.0)),
        ("cp_comm", parts.get("cp_comm", 0.0)),
        ("dp_comm", parts.get("dp_comm", 0.0) + parts.get("other_comm", 0.0)),
        ("optimizer", parts.get("optimizer", 0.0)),
    ]
    blocks, t = [], 0.0
    for kind, sec in seq:
        if sec > 0:
            first = 0 if kind in ("F", "B") else None
            blocks.append(Block(0, t, t + sec, kind, first, first))
            t += sec
    return blocks


def _pipeline_blocks(plan: Plan) -> list[Block]:
    sched = plan.schedule
    p, v, m = plan.mesh.pp, sched.stages_per_rank, sched.num_microbatches
    n_stages = len(plan.predicted.stages)
    queues = {}
    for r in range(p):
        count: dict[tuple[int, str], int] = {}
        ops = []
        for chunk, kind in schedules.rank_ops(sched.name, p, v, r, m):
            group = "B" if kind in ("B", "I") else kind  # B and I both start a backward
            mb = count.get((chunk, group), 0)
            count[(chunk, group)] = mb + 1
            ops.append((schedules.local_stage(sched.name, p, r, chunk), kind, mb))
        queues[r] = ops
    done: dict[tuple[int, str, int], float] = {}  # (stage, F|B|W, microbatch) -> end time
    free = dict.fromkeys(range(p), 0.0)
    pos = dict.fromkeys(range(p), 0)
    blocks: list[Block] = []
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(queues[r]):
                j, kind, mb = queues[r][pos[r]]
                dep = _dependency(j, kind, mb, n_stages)
                if dep is not None and dep not in done:
                    break
                st = plan.predicted.stages[j]
                start = max(free[r], done.get(dep, 0.0) if dep else 0.0)
                end = start + _duration(st, kind)
                done[(j, "W" if kind == "W" else ("B" if kind in "BI" else "F"), mb)] = end
                blocks.append(Block(r, start, end, kind, j, mb))
                free[r] = end
                pos[r] += 1
                progress = True
    return blocks


def _dependency(j: int, kind: str, mb: int, n_stages: int) -> tuple[int, str, int] | None:
    if kind == "F":
        return (j - 1, "F", mb) if j > 0 else None
    if kind == "W":
        return (j, "B", mb)
    return (j + 1, "B", mb) if j < n_stages - 1 else (j, "F", mb)


def _duration(st, kind: str) -> float:
    if kind == "F":
        return st.fwd_s
    if kind == "B":
        return st.bwd_s + st.recompute_s
    if kind == "I":
        return st.bwd_s - st.bwd_weight_s + st.recompute_s
    return st.bwd_weight_s


# -- formatting --------------------------------------------------------------------------------


def _table(head: tuple[str, ...], rows: list[tuple[str, ...]], right: tuple[int, ...] = ()):
    """Aligned columns under a header and a rule; the last column runs free."""
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def fmt(row):
        cells = []
        for i, cell in enumerate(row):
            last = i == len(row) - 1
            if last and i not in right:
                cells.append(cell)
            else:
                cells.append(cell.rjust(widths[i]) if i in right else cell.ljust(widths[i]))
        return ("  " + "  ".join(cells)).rstrip()

    rule = "  " + "  ".join("-" * w for w in widths)
    return [fmt(head), rule] + [fmt(r) for r in rows]


def _ms(seconds: float, sign: bool = False) -> str:
    if not math.isfinite(seconds):
        return "inf"
    ms = seconds * 1e3
    text = f"{ms:+.3f}" if sign else f"{ms:.3f}"
    return f"{text} ms"


def _size(num_bytes: float | None) -> str:
    if num_bytes is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes:.0f} B"


def _size_diff(num_bytes: float) -> str:
    return ("+" if num_bytes >= 0 else "-") + _size(abs(num_bytes))
