"""The stage DP's outer search (:mod:`planner.stages` partitions one candidate): every schedule x
microbatch count x stages per rank, lowest step floor first, each partitioned unless its floor
already loses to the fastest so far or to the caller's bound, or it holds no less memory than
one the knapsack's relaxation refused (:func:`_holds_no_less`); the fastest plan and every
candidate with its step time or why it lost."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from autopar.planner.knapsack import Checkpoint, _layers
from autopar.planner.schedules import (
    SCHEDULES,
    Schedule,
    ScheduleError,
    check_schedule,
    default_stages_per_rank,
    stage_choices,
    stage_in_flight,
)
from autopar.planner.stages import (
    BoundExceeded,
    Cuts,
    LayerCost,
    StageError,
    StagePlan,
    _cost_sums,
    _floor_of,
    partition,
)

__all__ = ["Candidate", "best_schedule"]


@dataclass(frozen=True)
class Candidate:
    """One (schedule, microbatches) tried by best_schedule, with its prediction or why it lost."""

    schedule: Schedule
    num_microbatches: int
    stages_per_rank: int
    step_time_s: float | None
    plan: StagePlan | None
    why: str | Exception
    """Empty where feasible; else why not, or the ScheduleError / StageError that says it."""

    @property
    def reason(self) -> str:
        """Empty where feasible; else why not, in words."""
        return str(self.why)


def best_schedule(
    costs_for: Callable[[int], Sequence[LayerCost]],
    *,
    num_stages: int,
    global_batch_per_dp: int,
    mem_limit_bytes: float,
    schedules: Sequence[Schedule] = SCHEDULES,
    microbatch_choices: Sequence[int] | None = None,
    interleave_choices: Sequence[int] | None = None,
    checkpoint: Checkpoint = "auto",
    p2p_s_per_byte: float = 0.0,
    p2p_latency_s: float = 0.0,
    overhead_s: Callable[[StagePlan], float] | None = None,
    cuts: Cuts | None = None,
    bound: float = math.inf,
    rank_time_scale: Sequence[float] | None = None,
    rank_mem_limit_bytes: Sequence[float] | None = None,
) -> tuple[StagePlan, list[Candidate]]:
    """Enumerate schedule x microbatches (divisors of the per-replica batch, or
    microbatch_choices) x stages per rank; return the fastest plan and every candidate.

    costs_for(microbatch_size) gives the per-microbatch layer costs at that size;
    ``overhead_s(plan)`` (default 0) is time the step pays beyond ``plan.step_time_s`` (the
    pipeline runtime's), counted in each candidate's ``step_time_s`` and in the ranking.
    ``cuts``: where stages may start and end (:class:`Cuts`; default: at every layer);
    ``rank_time_scale``, ``rank_mem_limit_bytes``: per pipeline rank (:func:`partition`).
    Raises ScheduleError where those are too few for the stages, else StageError when nothing
    fits. ``overhead_s`` must be >= 0: a candidate whose lower bound (:func:`step_floor`) is
    above the fastest one so far, or above ``bound`` (the caller's best step), is not
    partitioned; BoundExceeded is raised (before any partition) when every candidate's lower
    bound is above ``bound``, and after the partitions when one left out for ``bound`` might
    have beaten every one partitioned (the mesh cannot beat ``bound`` either way). Where it
    returns, it returns the plan an unbounded call returns."""
    B = global_batch_per_dp
    ms = [d for d in range(1, B + 1) if B % d == 0]
    if microbatch_choices is not None:
        bad = [x for x in microbatch_choices if B % x]
        if bad:
            raise ScheduleError(
                f"microbatches {bad} do not divide the per-replica batch {B}; pick divisors"
            )
        ms = sorted(set(microbatch_choices))
    table = lru_cache(maxsize=None)(lambda size: list(costs_for(size)))
    if cuts is not None:  # every schedule runs at least num_stages stages
        L = len(table(B // ms[0]))
        if sum(0 < b < L for b in cuts.allowed) < num_stages - 1:
            raise ScheduleError(cuts.too_few(L, num_stages))
    combos: list[tuple[Schedule, int, int, str | None]] = []  # (schedule, m, v, why not)
    for schedule in schedules:
        vs = stage_choices(schedule)
        if interleave_choices is not None and vs != (None,):
            vs = tuple(interleave_choices)
        for v_choice, m in itertools.product(vs, ms):
            v = default_stages_per_rank(schedule, v_choice)
            try:
                check_schedule(schedule, num_stages, m, v)
            except ScheduleError as err:
                combos.append((schedule, m, v, str(err)))
            else:
                combos.append((schedule, m, v, None))
    # the lower bound of every candidate the loop below runs
    fastest_rank = min(rank_time_scale or [1.0])  # every stage runs at least this fast
    sums = lru_cache(maxsize=None)(lambda size: _cost_sums(table(size)))
    floors = {
        (schedule, m, v): _floor_of(sums(B // m), schedule, num_stages, v, m) * fastest_rank
        for schedule, m, v, why in combos
        if why is None
    }
    if floors and min(floors.values()) > bound:
        raise BoundExceeded(min(floors.values()))
    fastest = math.inf  # the best feasible step time so far (overhead included)
    beyond = math.inf  # the least floor of the candidates left out for the caller's bound
    tried: dict[int, Candidate] = {}
    refused: list[tuple[Schedule, int, int]] = []  # refused by the relaxation (StageError)
    skipped: set[int] = set()  # refused as one of those was, no partition run
    # lowest floor first: a fast plan found early spares the partitions that cannot beat it
    for i in sorted(range(len(combos)), key=lambda i: floors.get(combos[i][:3], -math.inf)):
        schedule, m, v, why = combos[i]
        if why is not None:
            tried[i] = Candidate(schedule, m, v, None, None, why)
            continue
        floor = floors[schedule, m, v]
        if floor > min(fastest, bound):  # cannot win: its partition is not needed
            if floor <= fastest:  # it could beat this mesh's best, not the caller's
                beyond = min(beyond, floor)
            tried[i] = Candidate(schedule, m, v, None, None, _loses(floor, fastest, bound))
            continue
        worse = _holds_no_less(table, B, num_stages, (schedule, m, v), refused)
        if worse is not None:  # its partition would be refused as that one's was
            tried[i] = Candidate(schedule, m, v, None, None, _refused_as(worse))
            skipped.add(i)
            continue
        try:
            plan = partition(
                table(B // m),
                num_stages=num_stages,
                num_microbatches=m,
                mem_limit_bytes=mem_limit_bytes,
                schedule=schedule,
                stages_per_rank=v,
                checkpoint=checkpoint,
                p2p_s_per_byte=p2p_s_per_byte,
                p2p_latency_s=p2p_latency_s,
                cuts=cuts,
                rank_time_scale=rank_time_scale,
                rank_mem_limit_bytes=rank_mem_limit_bytes,
                bound=min(fastest, bound),
            )
        except BoundExceeded as err:  # as above, its floor known once its stages are timed
            if err.floor <= fastest:
                beyond = min(beyond, err.floor)
            tried[i] = Candidate(schedule, m, v, None, None, _loses(err.floor, fastest, bound))
            continue
        except (ScheduleError, StageError) as err:
            tried[i] = Candidate(schedule, m, v, None, None, err)
            if isinstance(err, StageError) and err.relaxed:
                refused.append((schedule, m, v))
            continue
        extra = overhead_s(plan) if overhead_s is not None else 0.0
        tried[i] = Candidate(schedule, m, v, plan.step_time_s + extra, plan, "")
        fastest = min(fastest, plan.step_time_s + extra)
    candidates = [tried[i] for i in range(len(combos))]
    feasible = [c for c in candidates if c.plan is not None]
    if beyond < fastest:  # a candidate left out might beat every one partitioned, not the bound
        raise BoundExceeded(min(beyond, fastest))
    if not feasible:
        # an example a partition gave (a candidate skipped only points at another)
        shown = [c for i, c in enumerate(candidates) if i not in skipped]
        reasons = lambda: sorted({c.reason for c in shown})  # noqa: E731
        raise StageError(lambda: f"no schedule x microbatch count fits; e.g. {reasons()[0]}")
    best = min(feasible, key=lambda c: (c.step_time_s, SCHEDULES.index(c.schedule)))
    assert best.plan is not None
    return best.plan, candidates


def _holds_no_less(
    table: Callable[[int], Sequence[LayerCost]],
    batch: int,
    p: int,
    combo: tuple[Schedule, int, int],
    refused: list[tuple[Schedule, int, int]],
) -> tuple[Schedule, int, int] | None:
    """A candidate of ``refused`` (its partition refused by the knapsack's relaxation) of the
    same schedule and stages per rank that ``combo`` holds no less memory than, if any: every
    layer's static, saved and checkpointed bytes at ``combo``'s microbatch size at least that
    one's, and every stage at least as many microbatches in flight (checked on the cost
    tables, not assumed). The relaxation's test of a range is monotone in exactly those, on
    the same stage budgets, so ``combo``'s partition would be refused too."""
    schedule, m, v = combo
    if not refused:
        return None
    n = stage_in_flight(schedule, p, v, m)
    P = None
    for other in refused:
        if other[0] != schedule or other[2] != v:
            continue
        n_other = stage_in_flight(schedule, p, v, other[1])
        if not all(a >= b for a, b in zip(n, n_other, strict=True)):
            continue
        P = P or _layers(tuple(table(batch // m)))
        Q = _layers(tuple(table(batch // other[1])))
        kept, kept_q = P.act - P.sav, Q.act - Q.sav  # bytes a checkpointed layer keeps
        if (P.static >= Q.static).all() and (P.act >= Q.act).all() and (kept >= kept_q).all():
            return other
    return None


def _refused_as(other: tuple[Schedule, int, int]) -> str:
    schedule, m, v = other
    per_rank = f", {v} stages per rank" if v > 1 else ""
    return (
        f"it holds no less memory than {schedule} with {m} microbatches{per_rank}, whose "
        f"stages fit nowhere even with every layer checkpointed"
    )


def _loses(floor: float, fastest: float, bound: float) -> str:
    return f"its step time is at least {floor:.4g} s, more than {min(fastest, bound):.4g} s"
