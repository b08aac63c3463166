"""The pipeline schedules autopar plans: one table read by the search, the stage DP
(:mod:`planner.stages`), the explanations and codegen.

Per schedule: the ``torch.distributed.pipelining`` class that runs it, stages per rank, the
microbatch rules, where each virtual stage lives (loop or V placement), whether the weight
gradient runs apart (zero bubble), whether it composes with data parallelism, and whether the
search tries it unasked.

Microbatches in flight (`in_flight`): the peak number of microbatches whose activations a stage
holds, derived from the order of F/B/W operations on a rank (which is all that matters: memory
depends on the order, not the timing). A rank's op order is that of torch 2.13
`torch.distributed.pipelining.schedules` (replayed by `rank_ops`):
    gpipe:  all F then all B                                             -> n = m
    1f1b:   rank s runs min(m, p-s) warmup F, then B/F pairs            -> n = min(m, p - s)
    interleaved-1f1b (v chunks, m % p == 0): warmup W_r = (v-1)p + 2(p-1-r) F, then F/B pairs,
            so the rank peaks at W_r + 1 = (v+1)p - 2r - 1 chunk-microbatches (capped at m v):
            rank 0 holds ~ (v+1)p chunk-microbatches = (1 + 1/v) p microbatches of its layers.
    zbv:    (Qi et al., "Zero Bubble Pipeline Parallelism", ZB-V) chunk0 runs 2(p-r)-1 + r F
            before any backward, chunk1 r + 1; the steady state keeps the rank at 2p
            chunk-microbatches = p microbatches of the rank's layers: 1F1B's memory, on every rank
            (min(2p, m + r + 1) when m < 2p - 1: torch pads the schedule, then drops the ops).
    dualpipev: F0 x 2(p-r-1), (F0 F1) x (r+1), then overlapped F/B pairs: 2p + 1 chunk-microbatches
            on every rank while an overlapped F&B runs (DualPipe README: activation "PP+1" with
            PP = 2p stages).
    For v > 1 a rank's peak is attributed evenly to its v chunks: in_flight = rank_peak / v
    (exact when the chunks hold equal activations, which these schedules assume).

Step time (`step_time`), per-microbatch stage times t_j, tau = max_j t_j, Q = sum_j q_j,
E = max_r e_r:
    gpipe, 1f1b:      total = (m + p - 1) tau + Q + E            bubble = (p - 1) tau
    interleaved-1f1b: total = (m v + p - 1) tau + Q + E          bubble = (p - 1) tau
                      = (p-1)/v of a rank's per-microbatch time v*tau (Narayanan et al. 2021)
    zbv:              total = 2 m tau + bubble + Q + E,  bubble = (p - 1) max_j (f_j + b_j - 3 w_j)^+
                      ZB paper's ZB-V bubble (p-1)(T_F + T_B - 2 T_W) per chunk, with T_B the
                      input-grad pass only (our b_j = T_B + T_W); our reading of the paper,
                      consistent with its table (bubble 0 when T_F = T_B = T_W).
    dualpipev:        total = 2 m tau + bubble + Q + E,  bubble = (p - 1) max_j (f_j + 2 b_j - 3 w_j)^+
                      DualPipe README: (PP/2 - 1)(F&B + B - 3W) with PP = 2p stages, F&B (an
                      overlapped forward+backward pair) taken as F + B (compute does not overlap).
    Rules (`check_schedule`, ScheduleError): v = 1 for gpipe/1f1b, v >= 2 for interleaved, v = 2
    for zbv/dualpipev; 1f1b needs m >= p (torch raises); interleaved needs m >= p and m % p == 0
    (Megatron's rule; torch 2.13 only needs m % max(1, m // p) == 0, we keep the stricter one so
    every round is full); zbv needs m >= p (torch pads below 2p - 1 and idles); dualpipev needs
    m >= 2p (torch: microbatches >= stages).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import numpy as np
from autopar.cost_model.step import pipeline_actions

Schedule = Literal["gpipe", "1f1b", "interleaved-1f1b", "zbv", "dualpipev"]


class ScheduleError(ValueError):
    """A (schedule, microbatches, stages per rank) combination the runtime does not accept."""


@dataclass(frozen=True)
class ScheduleRule:
    name: Schedule
    torch_class: str
    """the class in ``torch.distributed.pipelining`` that runs it."""
    stages_per_rank: int | None
    """virtual stages per rank; None: 2 or more (interleaved), chosen from ``searched_v``."""
    min_microbatches_per_rank: int
    """microbatches >= this x pp (0: >= 1). zbv: torch accepts fewer, but the emitted script
    (and torch's stage checks for V-shaped schedules) want a microbatch per stage: 2 pp."""
    microbatches_multiple_of_pp: bool
    """interleaved 1F1B runs microbatches in rounds of pp."""
    v_shaped: bool
    """placement: stages r and 2 pp - 1 - r on rank r (else stage j on rank j mod pp)."""
    zero_bubble: bool
    """the weight gradient (W) runs apart from the input gradient (I)."""
    data_parallel: bool
    """composes with dp/fsdp > 1. V-shaped ones trained wrong weights on torch 2.13 (head.weight
    off by ~5e-5 after one SGD step with fsdp=2, while gpipe/1f1b/interleaved matched)."""
    searched: bool
    """tried by the search unasked (GPipe has 1F1B's step time with more microbatches in
    flight: only when asked for)."""
    searched_v: tuple[int, ...] = ()
    """stages per rank the search tries where ``stages_per_rank`` is None."""


RULES: dict[str, ScheduleRule] = {
    r.name: r
    for r in (
        ScheduleRule("gpipe", "ScheduleGPipe", 1, 0, False, False, False, True, False),
        ScheduleRule("1f1b", "Schedule1F1B", 1, 1, False, False, False, True, True),
        ScheduleRule(
            "interleaved-1f1b",
            "ScheduleInterleaved1F1B",
            None,
            1,
            True,
            False,
            False,
            True,
            True,
            searched_v=(2,),
        ),  # fmt: skip
        ScheduleRule("zbv", "ScheduleZBVZeroBubble", 2, 2, False, True, True, False, True),
        ScheduleRule("dualpipev", "ScheduleDualPipeV", 2, 2, False, True, True, False, True),
    )
}
SCHEDULES: tuple[Schedule, ...] = tuple(RULES)  # type: ignore[assignment]


def rule(name: str) -> ScheduleRule:
    """The rule of schedule ``name``; ScheduleError for an unknown one."""
    if name not in RULES:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    return RULES[name]


def default_stages_per_rank(name: str, stages_per_rank: int | None = None) -> int:
    if stages_per_rank is not None:
        return stages_per_rank
    return RULES[name].stages_per_rank or 2


def stage_choices(name: str) -> tuple[int | None, ...]:
    """Stages per rank the search tries (None: the schedule's fixed count)."""
    return RULES[name].searched_v or (None,)


def stage_rank(name: str, pp: int, stage_index: int) -> int:
    """The pipeline rank holding virtual stage ``stage_index``."""
    if RULES[name].v_shaped:
        return stage_index if stage_index < pp else 2 * pp - 1 - stage_index
    return stage_index % pp


def local_stage(name: str, pp: int, rank: int, chunk: int) -> int:
    """The virtual stage of rank ``rank``'s ``chunk``-th local stage."""
    if RULES[name].v_shaped:
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return rank + chunk * pp


def rank_stages(name: str, pp: int, stages_per_rank: int) -> list[list[int]]:
    """The virtual stages each pipeline rank runs, by rank (the emitted RANK_STAGES)."""
    return [[local_stage(name, pp, r, k) for k in range(stages_per_rank)] for r in range(pp)]


def min_microbatches(name: str, pp: int) -> int:
    return max(1, RULES[name].min_microbatches_per_rank * pp)


def stages_rule(name: str, stages_per_rank: int) -> str | None:
    """Why schedule ``name`` cannot run ``stages_per_rank`` virtual stages per rank (None: it
    can): the table's fixed count, or 2 and more for the interleaved ones."""
    r, v = rule(name), stages_per_rank
    if r.stages_per_rank is not None and v != r.stages_per_rank:
        n = r.stages_per_rank
        return (
            f"{name} runs {n} stage{'s' if n > 1 else ''} per rank (stages_per_rank={n}), got {v}"
        )
    if r.stages_per_rank is None and v < 2:
        return f"{name} needs >= 2 stages per rank, got {v}; use 1f1b"
    return None


def data_parallel_rule(name: str, data_parallel: int) -> str | None:
    """Why schedule ``name`` cannot run with ``data_parallel`` = dp x fsdp ranks (None: it can):
    the table's ``data_parallel`` (the V-shaped schedules only without data parallelism)."""
    if rule(name).data_parallel or data_parallel == 1:
        return None
    return (
        f"schedule {name} with data parallelism (dp x fsdp = {data_parallel}) trains wrong "
        "weights on torch 2.13 (its split backward does not compose with FSDP2): pin "
        "dp=1,fsdp=1 or choose 1f1b or interleaved-1f1b"
    )


def check_schedule(
    name: str, num_stages: int, num_microbatches: int, stages_per_rank: int | None = None
) -> int:
    """Raise ScheduleError where torch (or our stricter rule) refuses; return stages_per_rank."""
    r = rule(name)
    p, m, v = num_stages, num_microbatches, default_stages_per_rank(name, stages_per_rank)
    if p < 1 or m < 1:
        raise ScheduleError(f"need >= 1 stage and microbatch, got {p} stages, {m} microbatches")
    why = stages_rule(name, v)
    if why is not None:
        raise ScheduleError(why)
    min_m = min_microbatches(name, p)
    if m < min_m:
        raise ScheduleError(
            f"{name} needs microbatches ({m}) >= {min_m} with {p} pipeline ranks; "
            f"raise the microbatch count or lower pp"
        )
    if r.microbatches_multiple_of_pp and m % p:
        raise ScheduleError(
            f"{name} needs microbatches ({m}) to be a multiple of pp ({p}); "
            f"use {m + (-m) % p} or {m - m % p or p} microbatches"
        )
    return v


def critical_actions(name: str, num_microbatches: int, stages_per_rank: int, pp: int) -> int:
    """Runtime actions on the busiest rank's critical path: 2 (m v + p - 1), or 3 m v + 2 (p - 1)
    when W runs apart."""
    return pipeline_actions(num_microbatches, stages_per_rank, pp, RULES[name].zero_bubble)


def searched(data_parallel: int, pinned: str | None = None) -> tuple[Schedule, ...]:
    """The schedules a search over a mesh with ``data_parallel`` = dp x fsdp tries (``pinned``:
    the user's --schedule); ScheduleError where the pinned one does not compose
    (:func:`data_parallel_rule`)."""
    if pinned is not None:
        why = data_parallel_rule(pinned, data_parallel)
        if why is not None:
            raise ScheduleError(why)
        return (pinned,)  # type: ignore[return-value]
    return tuple(
        r.name for r in RULES.values() if r.searched and (r.data_parallel or data_parallel == 1)
    )


# -- placement, in-flight microbatches, step time ----------------------------------------------


def rank_ops(schedule: Schedule, p: int, v: int, r: int, m: int) -> list[tuple[int, str]]:
    """Rank r's ops as (local chunk, kind) in torch 2.13's order. Kinds: F; B (full backward,
    frees the activations); I (input-grad only, keeps them); W (weight grad, frees them)."""
    if schedule == "gpipe":
        return [(0, "F")] * m + [(0, "B")] * m
    if schedule == "1f1b":
        warm = min(m, p - r)
        ops = [(0, "F")] * warm
        for _ in range(m - warm):
            ops += [(0, "B"), (0, "F")]
        return ops + [(0, "B")] * warm
    if schedule == "interleaved-1f1b":
        mpr = m // max(1, m // p)
        warm = _interleaved_warmup(p, v, r, m)
        fwd = [((k // mpr) % v, "F") for k in range(m * v)]
        bwd = [(v - 1 - (k // mpr) % v, "B") for k in range(m * v)]
        ops = fwd[:warm]
        for i in range(m * v - warm):
            ops += [fwd[warm + i], bwd[i]]
        return ops + bwd[m * v - warm :]
    if schedule == "zbv":
        return _zbv_ops(p, r, m)
    return _dualpipev_ops(p, r, m)


def _interleaved_warmup(p: int, v: int, r: int, m: int) -> int:
    """The forwards rank r runs before its first backward under interleaved 1F1B."""
    mpr = m // max(1, m // p)
    return min((v - 1) * mpr + 2 * (p - 1 - r), m * v)


def _zbv_ops(p: int, r: int, m: int) -> list[tuple[int, str]]:
    n_micro = max(2 * p - 1, m)
    ops: list[tuple[int, str, int]] = []  # (chunk, kind, microbatch)
    cnt = {(c, k): 0 for c in (0, 1) for k in "FIW"}

    def add(*pairs):
        for c, k in pairs:
            ops.append((c, k, cnt[c, k]))
            cnt[c, k] += 1

    add(*[(0, "F")] * (2 * (p - r) - 1))
    add(*[(1, "F"), (0, "F")] * r)
    add(*[(1, "F"), (1, "I"), (1, "W")] * (p - r))
    while cnt[1, "F"] < cnt[0, "F"] or cnt[0, "F"] < n_micro:
        if cnt[0, "F"] < n_micro:
            add((0, "F"))
        add((0, "I"), (0, "W"), (1, "F"), (1, "I"), (1, "W"))
    w0, w1 = cnt[0, "I"], cnt[1, "I"]
    add(*[(0, "I"), (1, "I")] * r)
    for _ in range(p - r):
        add((0, "I"))
        ops.append((0, "W", w0))
        w0 += 1
    ops += [(1, "W", i) for i in range(w1, cnt[1, "I"])]
    ops += [(0, "W", i) for i in range(w0, cnt[0, "I"])]
    return [(c, k) for c, k, mb in ops if mb < m]


def _dualpipev_ops(p: int, r: int, m: int) -> list[tuple[int, str]]:
    ops: list[tuple[int, str]] = []
    pending: list[int] = []  # chunks with an I waiting for its W

    def add(*pairs):
        for c, k in pairs:
            if k == "W":  # torch's add_weight_action_if_pending: the oldest pending I, if any
                if pending:
                    ops.append((pending.pop(0), "W"))
                continue
            ops.append((c, k))
            if k == "I":
                pending.append(c)

    add(*[(0, "F")] * (2 * (p - r - 1)))
    add(*[(0, "F"), (1, "F")] * (r + 1))
    add(*[(1, "I"), (None, "W"), (1, "F")] * (p - r - 1))
    # overlapped F/B pairs: the F is counted before its partner B frees (a conservative peak)
    add(*[(0, "F"), (1, "B"), (1, "F"), (0, "B")] * (m - 2 * p + r + 1))
    add(*[(1, "B"), (1, "F"), (0, "B")] * (p - r - 1))
    zb = False
    for i in range(r + 1):
        zb = zb or (i == (r + 1) // 2 and r % 2 == 1)
        add((1, "I" if zb else "B"))
        zb = zb or (i == (r + 1) // 2 and r % 2 == 0)
        add((0, "I" if zb else "B"))
    add(*[(None, "W"), (0, "I" if zb else "B")] * (p - r - 1))
    add(*[(None, "W")] * (r + 1))
    return ops


_HELD = {"F": 1, "B": -1, "I": 0, "W": -1}
"""What each kind of op does to the chunk-microbatches a rank holds (rank_ops' kinds)."""


@lru_cache(maxsize=4096)
def _rank_peak(schedule: Schedule, p: int, v: int, r: int, m: int) -> int:
    if schedule == "interleaved-1f1b":  # rank_ops': `warm` forwards, then (F, B) pairs
        return min(_interleaved_warmup(p, v, r, m) + 1, m * v)
    alive = list(itertools.accumulate(_HELD[kind] for _, kind in rank_ops(schedule, p, v, r, m)))
    assert not alive or alive[-1] == 0, (schedule, p, v, r, m)
    return max(0, *alive)


def in_flight(
    schedule: Schedule,
    num_stages: int,
    stages_per_rank: int,
    stage_index: int,
    num_microbatches: int,
) -> float:
    """Microbatches whose activations virtual stage `stage_index` holds at its rank's peak.

    num_stages = p pipeline ranks; stage_index in [0, p * stages_per_rank). For v > 1 the rank's
    peak (in chunk-microbatches) is split evenly over its v chunks. See the module docstring.
    """
    p, v, m = num_stages, stages_per_rank, num_microbatches
    r = stage_rank(schedule, p, stage_index)
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, p - r))
    return _rank_peak(schedule, p, v, r, m) / v


@lru_cache(maxsize=1024)
def stage_in_flight(schedule: Schedule, p: int, v: int, m: int) -> tuple[float, ...]:
    """:func:`in_flight` of every virtual stage, in pipeline order (the stage DP asks for the
    same few schedules many times per search)."""
    return tuple(in_flight(schedule, p, v, j, m) for j in range(p * v))


def step_time(
    schedule: Schedule,
    stage_times_s: Sequence[float],
    num_microbatches: int,
    p2p_s: Sequence[float] = (),
    stages_per_rank: int | None = None,
    *,
    stage_fwd_s: Sequence[float] | None = None,
    stage_bwd_s: Sequence[float] | None = None,
    stage_bwd_weight_s: Sequence[float] | None = None,
    per_step_s: float = 0.0,
) -> tuple[float, float]:
    """(total_s, bubble_s) of one step; formulas in the module docstring.

    stage_times_s: per-microbatch fwd + bwd (+ recompute) per virtual stage, S = p * v of them.
    p2p_s: the round-trip p2p time (activation + grad) per boundary on the critical path.
    stage_fwd_s / stage_bwd_s / stage_bwd_weight_s: only the zero-bubble schedules read them
    (absent: no W to fill bubbles, the bubble is (p - 1) tau). per_step_s: exposed DP sync +
    optimizer, max over ranks.
    """
    v = default_stages_per_rank(schedule, stages_per_rank)
    t = np.asarray(stage_times_s, dtype=float)
    assert t.size % v == 0, (t.size, v)
    p, m, tau = t.size // v, num_microbatches, float(t.max())
    if not RULES[schedule].zero_bubble:
        bubble = (p - 1) * tau
    elif stage_fwd_s is None or stage_bwd_weight_s is None:
        bubble = (p - 1) * tau
    else:
        f, w = np.asarray(stage_fwd_s, float), np.asarray(stage_bwd_weight_s, float)
        b = t - f if stage_bwd_s is None else np.asarray(stage_bwd_s, float)
        idle = f + b - 3 * w if schedule == "zbv" else f + 2 * b - 3 * w
        bubble = (p - 1) * float(np.maximum(idle, 0.0).max())
    total = m * v * tau + bubble + float(np.sum(p2p_s)) + per_step_s
    return total, bubble
