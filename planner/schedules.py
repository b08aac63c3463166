"""The pipeline schedules autopar plans: one table read by the search, the stage DP
(:mod:`planner.stages`), the explanations and codegen.

Per schedule: the ``torch.distributed.pipelining`` class that runs it, stages per rank, the
microbatch rules, where each virtual stage lives (loop or V placement), whether the weight
gradient runs apart (zero bubble), whether it composes with data parallelism, and whether the
search tries it unasked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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


def min_microbatches(name: str, pp: int) -> int:
    return max(1, RULES[name].min_microbatches_per_rank * pp)


def check_schedule(
    name: str, num_stages: int, num_microbatches: int, stages_per_rank: int | None = None
) -> int:
    """Raise ScheduleError where torch (or our stricter rule) refuses; return stages_per_rank."""
    r = rule(name)
    p, m, v = num_stages, num_microbatches, default_stages_per_rank(name, stages_per_rank)
    if p < 1 or m < 1:
        raise ScheduleError(f"need >= 1 stage and microbatch, got {p} stages, {m} microbatches")
    if r.stages_per_rank is not None and v != r.stages_per_rank:
        raise ScheduleError(f"{name} runs {r.stages_per_rank} stage(s) per rank, got {v}")
    if r.stages_per_rank is None and v < 2:
        raise ScheduleError(f"{name} needs >= 2 stages per rank, got {v}; use 1f1b")
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
    m, v, p = num_microbatches, stages_per_rank, pp
    if RULES[name].zero_bubble:
        return 3 * m * v + 2 * (p - 1)
    return 2 * (m * v + p - 1)


def searched(data_parallel: int, pinned: str | None = None) -> tuple[Schedule, ...]:
    """The schedules a search over a mesh with ``data_parallel`` = dp x fsdp tries (``pinned``:
    the user's --schedule); ScheduleError where the pinned one does not compose."""
    if pinned is not None:
        if not rule(pinned).data_parallel and data_parallel > 1:
            raise ScheduleError(
                f"--schedule {pinned} with data parallelism (dp x fsdp = {data_parallel}) is not "
                "supported: emitted programs did not match the single-process model; pin "
                "dp=1,fsdp=1 or choose 1f1b/interleaved-1f1b"
            )
        return (pinned,)  # type: ignore[return-value]
    return tuple(
        r.name for r in RULES.values() if r.searched and (r.data_parallel or data_parallel == 1)
    )
