"""The inter-layer DP: pipeline stages, schedule, microbatches and per-layer checkpointing.

A pure function of cost tables (stdlib + numpy): the planner builds one `LayerCost` per layer
(embeddings and head included, in order) for ONE microbatch at the stage's tp degree, and this
module cuts the layers into stages.

Notation
--------
L layers i = 0..L-1; p pipeline ranks; v = stages_per_rank; S = p*v virtual stages j = 0..S-1;
m microbatches. Per layer (one microbatch): f_i = fwd_s, b_i = bwd_s (input + weight grad),
w_i = bwd_weight_s (weight-grad part of b_i), a_i = act_bytes, c_i = act_ckpt_bytes, s_i =
static_bytes, o_i = out_bytes, e_i = grad_sync_s + optimizer_s (once per step).

Placement: virtual stage j lives on rank
    rank(j) = j mod p                         (gpipe, 1f1b, interleaved-1f1b: "looped")
    rank(j) = j if j < p else 2p - 1 - j      (zbv, dualpipev: "V", rank r holds r and 2p-1-r)

Variables
---------
Stage boundaries 0 = x_0 < x_1 < ... < x_S = L (stage j holds layers [x_j, x_{j+1}), >= 1 layer),
and a checkpoint flag k_i in {0, 1} per layer ("none": all 0, "full": all 1, "auto": chosen).

Per-stage quantities (stage j = layers I_j, n_j = in_flight(j), see below)
---------------------------------------------------------------------------
    t_j   = sum_{I_j} (f_i + b_i) + sum_{I_j} k_i r_i     per microbatch (r_i: recompute, default f_i)
    mem_j = sum_{I_j} s_i + n_j * sum_{I_j} (k_i c_i + (1 - k_i) a_i) + max_{i in I_j, k_i=1} a_i
            (the last term: the recompute transient, one checkpointed layer for one microbatch)
    e_r   = sum over the layers of rank r of e_i                    (exposed DP sync + optimizer)
    q_j   = 2 * (p2p_latency_s + o_{x_j - 1} * p2p_s_per_byte)      boundary j-1 | j, 0 if same rank

Constraint (one family, `planner.knapsack._exact_options`): mem_j <= budget_j = M_rank(j) / v,
    M_r the memory limit of rank r (mem_limit_bytes; a mixed cluster's ranks each their own
    group's, ``rank_mem_limit_bytes``).
    For v = 1 this is exactly "rank memory <= limit". For v > 1 a rank's memory is the sum of its
    v stages, which couples stages far apart in the layer order (no prefix DP captures that; the
    exact search is exponential in v). We give each virtual stage an equal 1/v share of its rank.
    This is sound (sum over the rank <= limit) and matches how in_flight attributes a rank's peak
    evenly to its chunks; it is conservative when a rank's chunks differ a lot in memory.

Objective (lexicographic, `_dp`)
--------------------------------
    1. minimise tau = max_j t_j                      (the pipeline clock: every schedule's
                                                      steady state runs at the slowest stage)
    2. then minimise latency = sum_j t_j + sum_j q_j  (one microbatch's trip through the pipeline:
                                                      alpa's  sum_j t_j + (m-1) max_j t_j)
    3. then minimise sum_j t_j^2                      (balance: equal step times, more headroom
                                                      against cost-model error)
    Checkpointing per stage ("auto") is a knapsack: fit memory first, then minimise t_j
    (`_exact_options`); since stages are independent given the budget, each stage's min-time
    fitting choice is optimal for both criteria.
    DP over prefixes: F_j[b] = min_a max(F_{j-1}[a], T_j[a,b]); tau = F_{S-1}[L]; then
    G_j[b] = min_a G_{j-1}[a] + q(a) + T_j[a,b] over T_j[a,b] <= tau; a backward pass H marks the
    edges on latency-optimal paths, and a last pass minimises sum t^2 over them.
    O(S L^2), numpy-vectorized.
    Exact against brute force (tests/test_stages.py) where the knapsack is exact: over checkpoint
    counts per group of identical layers (repeated blocks), the largest group in closed form and
    every count vector of the others while those are <= 512 combinations; beyond, it falls back
    to the greedy order f_i / (a_i - c_i) (`planner.knapsack._greedy_options`, the only approximation here). The exposed e_r is reported, not traded against tau (left open).

Bounds (`partition`'s ``bound``, :func:`planner.schedule_search.best_schedule`'s search)
----------------------------------------------------------------
    A candidate's step is at least m v tau + (p - 1) tau (non-zero-bubble schedules) + the mean
    per-step sync (`_floor_at`). Before any knapsack, its relaxation (every layer's recompute
    at the cheapest seconds per byte saved of its range, `planner.knapsack._lower_tables`)
    gives a tau no greater than the DP's: where even that has no partition, none fits (the
    StageError's words are written only when read); where its floor is above the caller's
    bound, the knapsack is not run. After the DP's first pass, tau is exact and checked again
    before the cuts are chosen. Every bound is a lower bound: the plan returned is the one an
    unbounded call returns.

Microbatches in flight (`in_flight`), the step time of a schedule (`step_time`) and the
schedules' rules (`check_schedule`): :mod:`planner.schedules`, the schedule table, with their
formulas.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from autopar.cost_model.step import boundary_p2p_s
from autopar.planner.knapsack import (
    _REL_TOL,
    Checkpoint,
    _exact_options,
    _first_of_kinds,
    _greedy_options,
    _is_exact,
    _Layers,
    _layers,
    _lower_tables,
    _one_range_lower,
    _tables,
)
from autopar.planner.schedules import (
    RULES,
    SCHEDULES,
    Schedule,
    ScheduleError,
    check_schedule,
    in_flight,
    stage_in_flight,
    stage_rank,
    step_time,
)

__all__ = [
    "SCHEDULES",
    "Cuts",
    "LayerCost",
    "ScheduleError",
    "StageError",
    "StagePlan",
    "check_schedule",
    "in_flight",
    "partition",
    "stage_rank",
    "step_time",
]


class StageError(ValueError):
    """No stage partition fits; the message names the binding constraint and what to relax.

    ``message`` may be a function that writes it: it runs the first time the message is read
    (``str``), once. The search raises and catches many of these and reads few (a candidate
    that loses to another that fits never shows its message), and writing one is a search of
    its own (:func:`_explain`)."""

    def __init__(self, message: str | Callable[[], str], *, relaxed: bool = False):
        super().__init__()
        self._message = message
        self.relaxed = relaxed
        """Refused by the knapsack's relaxation (:func:`partition`): no range of layers a
        stage needs fits even with every layer checkpointed and no recompute transient, a
        test that only more memory per layer or more microbatches in flight can fail again
        (:func:`planner.schedule_search.best_schedule` skips such candidates)."""

    def __str__(self) -> str:
        if callable(self._message):
            self._message = self._message()
        return self._message


class BoundExceeded(Exception):
    """No schedule x microbatch count can beat the caller's bound (:func:`planner.schedule_search.best_schedule`):
    ``floor`` is a lower bound of every candidate's step time."""

    def __init__(self, floor: float):
        super().__init__(f"every candidate's step time is at least {floor:.4g} s")
        self.floor = floor


@dataclass(frozen=True)
class LayerCost:
    """Costs of one layer for ONE microbatch at the stage's tp degree, on one rank."""

    fwd_s: float
    """Forward time."""
    bwd_s: float
    """Backward time, input grad + weight grad."""
    act_bytes: float
    """Activations saved for backward, not checkpointed."""
    act_ckpt_bytes: float
    """What stays saved when the layer is checkpointed (its inputs)."""
    static_bytes: float
    """Params + grads + optimizer state on this rank (already divided by fsdp/tp)."""
    out_bytes: float = 0.0
    """The activation sent on to the next layer (the p2p payload at a stage boundary)."""
    bwd_weight_s: float = 0.0
    """The weight-grad part of bwd_s (zero-bubble schedules run it separately)."""
    grad_sync_s: float = 0.0
    """Exposed data-parallel gradient communication, once per step."""
    optimizer_s: float = 0.0
    """Optimizer step, once per step."""
    recompute_s: float | None = None
    """Extra time when the layer is checkpointed (default: one more forward, fwd_s)."""

    def __post_init__(self):
        for name, value in vars(self).items():
            if value is None:
                continue
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"LayerCost.{name} must be finite and >= 0, got {value}")
        if self.bwd_weight_s > self.bwd_s:
            raise ValueError(f"bwd_weight_s ({self.bwd_weight_s}) > bwd_s ({self.bwd_s})")
        # hashed once: a cost table (a tuple of these) is a cache key of the DP's layer arrays
        object.__setattr__(self, "_hash", hash(tuple(vars(self).values())))

    def __hash__(self) -> int:
        return self._hash


@dataclass(frozen=True)
class StagePlan:
    """The chosen cut. Stage lists are per virtual stage, in pipeline order."""

    schedule: Schedule
    num_microbatches: int
    stages_per_rank: int
    boundaries: tuple[tuple[int, int], ...]
    """Half-open layer ranges [start, end) per virtual stage."""
    checkpointed: tuple[int, ...]
    """Sorted indices of the checkpointed layers."""
    stage_time_s: tuple[float, ...]
    """Per-microbatch fwd + bwd (+ recompute) time per virtual stage."""
    stage_memory_bytes: tuple[float, ...]
    rank_memory_bytes: tuple[float, ...]
    """Sum of the rank's stages, per pipeline rank."""
    stage_in_flight: tuple[float, ...]
    step_time_s: float
    bubble_s: float
    p2p_s: float
    """p2p on the critical path (activation + grad per boundary), once per step."""
    per_step_s: float
    """Exposed DP gradient sync + optimizer, max over ranks."""


@dataclass(frozen=True)
class Cuts:
    """Where the ordered layers can be cut into pipeline stages, as the emitted script cuts
    them (checked on the model by the caller: the planner itself sees only costs).

    A boundary b (1 <= b < L) is the cut between layers b - 1 and b. ``allowed``: the
    boundaries that can be cut; ``why``: (boundary, reason) for some that cannot; ``refused``:
    why the model cannot be cut at all (then nothing is allowed)."""

    allowed: frozenset[int]
    why: tuple[tuple[int, str], ...] = ()
    refused: str | None = None

    def too_few(self, num_layers: int, num_stages: int) -> str:
        """Why ``num_stages`` stages cannot be cut (the allowed boundaries are too few)."""
        if self.refused is not None:
            return f"the model cannot be cut into pipeline stages: {self.refused}"
        ok = sum(0 < b < num_layers for b in self.allowed)
        first = f": {self.why[0][1]}" if self.why else ""
        return (
            f"{num_stages} pipeline stages need {num_stages - 1} cuts, and only {ok} of the "
            f"{num_layers - 1} layer boundaries can be cut{first}"
        )


# ---------------------------------------------------------------------------------------------
# the DP


def _time_caps(P: _Layers, S: int) -> tuple[float, ...]:
    """Growing caps on a stage's time for :func:`_tables`, the last unbounded: most partitions
    have tau within 1.5x its floor (the layers' mean per stage, the slowest layer)."""
    floor = max(float(P.fb.sum()) / S, float(P.fb.max(initial=0.0)))
    return (1.5 * floor, 4 * floor, math.inf)


def _dp(T_stage: list[np.ndarray], q: list[np.ndarray], L: int):
    """Lexicographic (min max_j t_j, then min sum_j t_j + q_j, then min sum_j t_j^2): returns
    (tau, cuts) or (inf, None).

    T_stage[j][a, b]: stage j's time on [a, b); q[j][a]: cost of the boundary before stage j at
    layer a (q[0] = 0). The third pass keeps only edges on some latency-optimal path (forward
    G + backward H) and prefers balanced stages among them."""
    tau = _tau(T_stage, L)
    if not np.isfinite(tau):
        return math.inf, None
    return tau, _cuts(T_stage, q, L, tau)


def _tau(T_stage: list[np.ndarray], L: int) -> float:
    """The DP's first pass: the least max_j t_j over every partition (inf: none). Stage j
    starts only where j stages before it and S - j from it fit (layers j .. L - S + j): the
    other rows cannot lie on a path from 0 to L, and are not read (S - 1 rows of L + 1 at
    most L - S + 1 wide, not (L + 1) wide: a deep pipeline's tables are mostly such rows)."""
    S = len(T_stage)
    F = T_stage[0][0].copy()  # F[b]: best max over stages 0..j ending at b
    for j in range(1, S):
        lo, hi = j, L - S + j + 1  # the rows stage j may start at
        F = np.min(np.maximum(F[lo:hi, None], T_stage[j][lo:hi]), axis=0)
    return float(F[L])


def _cuts(T_stage: list[np.ndarray], q: list[np.ndarray], L: int, tau: float) -> list[int]:
    """The DP's other passes, at its first pass's finite ``tau``: the cuts."""
    S = len(T_stage)
    cap = tau * (1 + _REL_TOL)
    T = [np.where(t <= cap, t, np.inf) for t in T_stage]
    start = np.full(L + 1, np.inf)
    start[0] = 0.0
    G = [start]  # G[j][a]: min latency of stages 0..j-1 ending at a (incl. the boundary at a)
    for j in range(S):
        G.append(np.min(G[j][:, None] + T[j], axis=0) + (q[j + 1] if j + 1 < S else 0.0))
    H = [None] * S + [np.where(np.arange(L + 1) == L, 0.0, np.inf)]  # H[j][a]: stages j.. from a
    for j in range(S - 1, -1, -1):
        H[j] = np.min(T[j] + H[j + 1][None, :] + (q[j + 1][None, :] if j + 1 < S else 0.0), axis=1)
    best = G[S][L]
    K = start
    back = []
    for j in range(S):
        after = H[j + 1] + (q[j + 1] if j + 1 < S else 0.0)
        on_path = G[j][:, None] + T[j] + after[None, :] <= best + _REL_TOL * abs(best)
        cand = K[:, None] + np.where(on_path, T[j] ** 2, np.inf)
        arg = np.argmin(cand, axis=0)
        back.append(arg)
        K = cand[arg, np.arange(L + 1)]
    cuts = [L]
    for arg in reversed(back):
        cuts.append(int(arg[cuts[-1]]))
    assert cuts[-1] == 0 and np.isfinite(K[L]), cuts
    return cuts[::-1]


def partition(
    costs: Sequence[LayerCost],
    *,
    num_stages: int,
    num_microbatches: int,
    mem_limit_bytes: float,
    schedule: Schedule = "1f1b",
    stages_per_rank: int | None = None,
    checkpoint: Checkpoint = "auto",
    p2p_s_per_byte: float = 0.0,
    p2p_latency_s: float = 0.0,
    cuts: Cuts | None = None,
    rank_time_scale: Sequence[float] | None = None,
    rank_mem_limit_bytes: Sequence[float] | None = None,
    bound: float = math.inf,
) -> StagePlan:
    """Cut the ordered layers into num_stages * stages_per_rank contiguous stages (module
    docstring: variables, objective, constraint), only at ``cuts.allowed`` where given (a
    ScheduleError where those are too few). ``rank_time_scale``: per pipeline rank, its time
    for the layers' costs over theirs (a faster group of a mixed cluster: < 1; None: 1 each).
    ``rank_mem_limit_bytes``: per pipeline rank, its memory limit (a mixed cluster's group
    memory; None: ``mem_limit_bytes`` each). Raises ScheduleError or StageError, and
    BoundExceeded where the plan's step time is surely above ``bound`` (its least max stage
    time known, before the cuts are chosen: :func:`_floor_at`). One stage's relaxation is
    computed on its one range alone (:func:`knapsack._one_range_lower`, the same figures),
    before the layers' arrays and tables are built (a one-stage plan the search prunes or
    refuses never builds them)."""
    p, m = num_stages, num_microbatches
    v = check_schedule(schedule, p, m, stages_per_rank)
    costs, S, L = list(costs), p * v, len(costs)
    if L < S:
        raise StageError(
            f"{L} layers cannot fill {S} pipeline stages ({p} ranks x {v} per rank) with one "
            f"layer each; lower pp or stages per rank"
        )
    allowed = None
    if cuts is not None:
        allowed = np.zeros(L + 1, bool)
        allowed[[0, L, *(b for b in cuts.allowed if 0 < b < L)]] = True
        if allowed.sum() < S + 1:
            raise ScheduleError(cuts.too_few(L, S))
    limits = rank_mem_limit_bytes or [mem_limit_bytes] * p
    assert len(limits) == p, (limits, p)
    budget = [float(limits[stage_rank(schedule, p, j)]) / v for j in range(S)]
    budgets = sorted(set(budget))  # one set of tables per distinct budget
    bud = [budgets.index(x) for x in budget]
    n_stage = list(stage_in_flight(schedule, p, v, m))
    n_classes = sorted(set(n_stage))
    cls = [n_classes.index(x) for x in n_stage]
    ranks = rank_time_scale or [1.0] * p
    scale = [float(ranks[stage_rank(schedule, p, j)]) for j in range(S)]
    ends = () if allowed is None else tuple(np.flatnonzero(allowed).tolist())

    @functools.cache
    def problem() -> _Problem:  # the layers' arrays and boundary costs, built where first needed
        P = _layers(tuple(costs))
        payload = np.concatenate([[0.0], P.out])  # payload[a]: layer a - 1's
        q = [np.zeros(L + 1)] + [
            _boundary_cost(payload, schedule, p, j, p2p_s_per_byte, p2p_latency_s)
            for j in range(1, S)
        ]
        return _Problem(costs, P, schedule, p, v, m, n_stage, budget, checkpoint, q, allowed, scale)

    def tables(cap_s: float = math.inf):
        """Per distinct budget, :func:`_tables`; whether all are complete."""
        P = problem().P
        out = [_tables(P, S, n_classes, b, checkpoint, cap_s, ends) for b in budgets]
        return [t for t, _, _ in out], [mm for _, mm, _ in out], all(c for _, _, c in out)

    def per_stage(T: list[np.ndarray]) -> list[np.ndarray]:
        """Each stage's table (shared by the stages of one budget, in-flight value and speed):
        its budget's at its in-flight value (filled only where a stage may start and end), at
        its rank's speed. Where a stage j cannot lie for want of layers before or after it
        (:func:`_valid`) needs no mask: no path of the DP from 0 to L reads it there."""
        out: dict[tuple[int, int, float], np.ndarray] = {}
        for j in range(S):
            key = (bud[j], cls[j], scale[j])
            if key not in out:
                t = T[bud[j]][cls[j]]
                out[key] = t * scale[j] if scale[j] != 1.0 else t
        return [out[bud[j], cls[j], scale[j]] for j in range(S)]

    def why() -> str:  # when asked: from the memory of every range (the tables uncapped)
        M = tables()[1]
        return _explain(problem(), [M[bud[j]][cls[j]] for j in range(S)])

    # the knapsack's relaxation first: where it finds no partition, none fits; where its plan
    # is above the bound, the knapsack's is too
    if S == 1:  # one range: its sums straight from the costs
        tau_lb, sync, opt = _one_range_lower(costs, n_stage[0], budget[0], checkpoint)
        tau_lb = tau_lb * scale[0] if scale[0] != 1.0 else tau_lb
    else:
        P = problem().P
        sync, opt = P.sync.sum(), P.opt.sum()
        lower = [_lower_tables(P, S, n_classes, b, checkpoint, ends) for b in budgets]
        tau_lb = _tau(per_stage(lower), L)
    # the busiest rank's sync + optimizer per step is at least the mean over ranks
    per_step = float(sync + opt * min(scale)) / p
    if not math.isfinite(tau_lb):
        raise StageError(why, relaxed=True)
    floor = _floor_at(tau_lb, schedule, p, v, m, per_step)
    if floor > bound:
        raise BoundExceeded(floor)
    prob = problem()
    for cap_s in _time_caps(prob.P, S):
        T, _, complete = tables(cap_s)
        T_stage = per_stage(T)
        tau = _tau(T_stage, L)
        # every range the DP reads (time <= tau (1 + _REL_TOL)) is in the tables: a range left
        # out takes > cap_s (scaled: > cap_s min(scale)) >= that, so the answer is the one of
        # the whole tables
        if complete or tau * (1 + 1e-6) <= cap_s * min(scale):
            break
        if not math.isfinite(tau):  # nothing fits with the ranges tried: mostly memory, so all
            T_stage = per_stage(tables()[0])
            tau = _tau(T_stage, L)
            break
    if not math.isfinite(tau):
        raise StageError(why)
    # the step at this tau, every other term at its least (step_floor's, tau now exact)
    floor = _floor_at(tau, schedule, p, v, m, per_step)
    if floor > bound:
        raise BoundExceeded(floor)
    return _plan(prob, _cuts(T_stage, prob.q, L, tau))


def fits_unchecked(
    costs: Sequence[LayerCost],
    *,
    num_microbatches: int,
    mem_limit_bytes: float,
    schedule: Schedule,
) -> bool:
    """Whether one stage of every layer fits without checkpointing, as :func:`partition` with
    one stage and ``checkpoint`` other than "full" decides it before any knapsack: where it
    does, that partition checkpoints no layer."""  # fmt: skip
    n = in_flight(schedule, 1, 1, 0, num_microbatches)
    static = np.cumsum([c.static_bytes for c in costs])[-1]
    mem = static + n * np.cumsum([c.act_bytes for c in costs])[-1]
    return bool(mem <= mem_limit_bytes * (1 + _REL_TOL))


@dataclass(frozen=True)
class _Problem:
    """One partition problem: the layers, the schedule's shape and the memory budget."""

    costs: list[LayerCost]
    P: _Layers
    schedule: Schedule
    p: int
    v: int
    m: int
    n_stage: list[float]
    """microbatches in flight per virtual stage."""
    budget: list[float]
    """bytes per virtual stage (its rank's limit over v)."""
    checkpoint: Checkpoint
    q: list[np.ndarray]
    """per stage boundary, its p2p cost by cut position."""
    allowed: np.ndarray | None = None
    """per cut position 0..L, whether a stage may start or end there (None: everywhere)."""
    scale: list[float] | None = None
    """per virtual stage, its rank's time scale (None: 1 each)."""


def _valid(T: np.ndarray, j: int, S: int, L: int, allowed: np.ndarray | None = None) -> np.ndarray:
    """Stage j's table with the ranges it cannot take masked: a >= j, b <= L - (S - 1 - j),
    and a, b where a stage may start or end (``allowed``, if given)."""
    out = T.copy()
    out[:j, :] = np.inf
    out[:, L - (S - 1 - j) + 1 :] = np.inf
    if allowed is not None:
        out[~allowed, :] = np.inf
        out[:, ~allowed] = np.inf
    return out


def _boundary_cost(payload, schedule, p, j, per_byte, latency) -> np.ndarray:
    """q[a] for the boundary between stages j-1 and j at layer a (``payload[a]``: the bytes
    layer a - 1 sends on): activation + grad, one way each; zero where both stages are on the
    same rank (the middle of a V, or p = 1)."""
    if stage_rank(schedule, p, j - 1) == stage_rank(schedule, p, j):
        return np.zeros(len(payload))
    return boundary_p2p_s(payload, latency, per_byte)


def _stage_choices(P: _Layers, cuts, n_stage, budget, checkpoint) -> list[tuple[float, list[int]]]:
    """(time, checkpointed layers) of each stage [cuts[j], cuts[j + 1]) at its in-flight value
    and its budget (``budget[j]``): the knapsack of every stage, the exact ones in one batch per
    distinct budget."""
    a, b = np.asarray(cuts[:-1]), np.asarray(cuts[1:])
    sets = P.counts[b] - P.counts[a]
    n_values, n_of = np.unique(np.asarray(n_stage, float), return_inverse=True)
    exact = _is_exact(sets, checkpoint)
    out: dict[int, tuple[float, list[int]]] = {}
    for value in sorted(set(budget)):
        mine = exact & (np.asarray(budget) == value)
        if not mine.any():
            continue
        t, _, choice = _exact_options(P, sets[mine], n_values, value, checkpoint)
        for row, j in enumerate(np.flatnonzero(mine)):
            k = choice[row, n_of[j]]
            layers = _first_of_kinds(P, int(a[j]), int(b[j]), dict(enumerate(k.tolist())))
            out[int(j)] = (float(t[row, n_of[j]]), layers)
    for j in np.flatnonzero(~exact):
        tj, _, chosen = _greedy_options(
            P, int(a[j]), int(b[j]), np.array([n_stage[j]], float), budget[j]
        )
        out[int(j)] = (float(tj[0]), chosen[0])
    return [out[j] for j in range(len(sets))]


def _plan(prob: _Problem, cuts: list[int]) -> StagePlan:
    costs, schedule, p, v, m = prob.costs, prob.schedule, prob.p, prob.v, prob.m
    n_stage, q, S = prob.n_stage, prob.q, prob.p * prob.v
    times, mems, ckpt, fwd, bwd, bw_w = [], [], [], [], [], []
    per_rank_e, rank_mem = [0.0] * p, [0.0] * p
    choices = _stage_choices(prob.P, cuts, n_stage, prob.budget, prob.checkpoint)
    scale = prob.scale or [1.0] * S
    for j, (t, chosen) in enumerate(choices):
        a, b = cuts[j], cuts[j + 1]
        layers = costs[a:b]
        k = scale[j]
        ck = set(chosen)
        mem = (
            sum(c.static_bytes for c in layers)
            + n_stage[j]
            * sum(c.act_ckpt_bytes if a + i in ck else c.act_bytes for i, c in enumerate(layers))
            + max((costs[i].act_bytes for i in chosen), default=0.0)
        )
        r = stage_rank(schedule, p, j)
        per_rank_e[r] += sum(c.grad_sync_s + c.optimizer_s * k for c in layers)
        rank_mem[r] += mem
        times.append(t * k)
        mems.append(float(mem))
        ckpt += chosen
        fwd.append((sum(c.fwd_s for c in layers) + sum(costs[i].fwd_s for i in chosen)) * k)
        bwd.append(sum(c.bwd_s for c in layers) * k)
        bw_w.append(sum(c.bwd_weight_s for c in layers) * k)
    p2p = float(sum(q[j][cuts[j]] for j in range(1, S)))
    total, bubble = step_time(
        schedule,
        times,
        m,
        [p2p],
        v,
        stage_fwd_s=fwd,
        stage_bwd_s=bwd,
        stage_bwd_weight_s=bw_w,
        per_step_s=max(per_rank_e),
    )
    return StagePlan(
        schedule=schedule,
        num_microbatches=m,
        stages_per_rank=v,
        boundaries=tuple((cuts[j], cuts[j + 1]) for j in range(S)),
        checkpointed=tuple(sorted(ckpt)),
        stage_time_s=tuple(times),
        stage_memory_bytes=tuple(mems),
        rank_memory_bytes=tuple(rank_mem),
        stage_in_flight=tuple(float(x) for x in n_stage),
        step_time_s=total,
        bubble_s=bubble,
        p2p_s=p2p,
        per_step_s=max(per_rank_e),
    )


def _explain(prob: _Problem, M: list[np.ndarray]) -> str:
    """One line: the stage that overflows most in the partition that overflows least
    (``M``: per stage, the memory table at its in-flight value and budget)."""
    costs, schedule, p, v = prob.costs, prob.schedule, prob.p, prob.v
    n_stage, budget, checkpoint = prob.n_stage, prob.budget, prob.checkpoint
    L, S = len(costs), p * v
    ratio = [_valid(M[j], j, S, L, prob.allowed) / budget[j] for j in range(S)]
    _, cuts = _dp(ratio, [np.zeros(L + 1)] * S, L)
    assert cuts is not None
    worst = max(range(S), key=lambda j: ratio[j][cuts[j], cuts[j + 1]])
    a, b = cuts[worst], cuts[worst + 1]
    need = M[worst][a, b]
    how = {
        "none": "with checkpointing off (checkpoint='none'; allow 'auto')",
        "full": "even with every layer checkpointed",
        "auto": "even with every layer checkpointed",
    }[checkpoint]
    have = budget[worst]
    share = f" (its 1/{v} share of a rank's {have * v / 1e9:.1f} GB)" if v > 1 else ""
    return (
        f"stage {worst} (layers {a}-{b - 1}, rank {stage_rank(schedule, p, worst)}) needs "
        f"{need / 1e9:.1f} GB > {have / 1e9:.1f} GB{share} {how}, holding "
        f"{n_stage[worst]:g} microbatches in flight under {schedule}; relax: more pipeline "
        f"stages, fewer microbatches in flight (1f1b instead of gpipe), a smaller microbatch, "
        f"more fsdp/tp sharding, or GPUs with more memory"
    )


def step_floor(costs: Sequence[LayerCost], schedule: Schedule, p: int, v: int, m: int) -> float:
    """A lower bound of :func:`partition`'s ``step_time_s`` (hence of the step with any
    non-negative overhead): tau (the slowest of the p v stages, each at least its layers' fwd +
    bwd) is at least the layers' mean per stage and the slowest layer (:func:`_floor_at`)."""
    return _floor_of(_cost_sums(costs), schedule, p, v, m)


def _cost_sums(costs: Sequence[LayerCost]) -> tuple[float, float, float]:
    """(sum of fwd + bwd, the largest fwd + bwd, sum of sync + optimizer) over the layers."""
    fb = [c.fwd_s + c.bwd_s for c in costs]
    return sum(fb), max(fb, default=0.0), sum(c.grad_sync_s + c.optimizer_s for c in costs)


def _floor_of(sums: tuple[float, float, float], schedule: Schedule, p: int, v: int, m: int):
    """:func:`step_floor` from the layers' :func:`_cost_sums`."""
    work, slowest, per_step = sums
    return _floor_at(max(work / (p * v), slowest), schedule, p, v, m, per_step / p)


def _floor_at(tau: float, schedule: Schedule, p: int, v: int, m: int, per_step: float) -> float:
    """A lower bound of :func:`step_time` where the slowest stage takes ``tau``: the bubble is
    (p - 1) tau for gpipe and 1f1b schedules (zero-bubble ones: >= 0); p2p >= 0; the per-step
    sync + optimizer of the busiest rank is at least ``per_step``, the mean over ranks. Shaved
    by 1e-9 so a float summed in another order never prunes the candidate that would have
    won."""
    bubble = 0.0 if RULES[schedule].zero_bubble else (p - 1) * tau
    return (m * v * tau + bubble + per_step) * (1 - 1e-9)
