"""The inter-layer DP (planner/stages.py) against brute force, simulators and torch's schedules."""

import collections
import dataclasses
import itertools
import math
import random

import numpy as np
import pytest
from autopar.planner.schedule_search import best_schedule
from autopar.planner.stages import (
    SCHEDULES,
    LayerCost,
    ScheduleError,
    StageError,
    check_schedule,
    in_flight,
    partition,
    stage_rank,
    step_time,
)
from hypothesis import given, settings
from hypothesis import strategies as st

V = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zbv": 2, "dualpipev": 2}
MIN_M = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 1, "zbv": 2, "dualpipev": 2}  # x p


def _random_costs(rng: random.Random, L: int) -> list[LayerCost]:
    out = []
    for _ in range(L):
        act = rng.uniform(1.0, 10.0)
        bwd = rng.uniform(0.5, 3.0)
        out.append(
            LayerCost(
                fwd_s=rng.uniform(0.2, 2.0),
                bwd_s=bwd,
                bwd_weight_s=rng.uniform(0.0, bwd),
                act_bytes=act,
                act_ckpt_bytes=rng.uniform(0.0, act),
                static_bytes=rng.uniform(0.0, 20.0),
                out_bytes=rng.uniform(0.0, 5.0),
            )
        )
    return out


def _brute_force(costs, p, v, schedule, m, limit, checkpoint, per_byte, latency):
    """Every contiguous partition x every checkpoint subset; lexicographic (max t, latency)."""
    L, S = len(costs), p * v
    f = np.array([c.fwd_s for c in costs])
    fb = f + np.array([c.bwd_s for c in costs])
    act = np.array([c.act_bytes for c in costs])
    ck = np.array([c.act_ckpt_bytes for c in costs])
    static = np.array([c.static_bytes for c in costs])
    out = np.array([c.out_bytes for c in costs])
    if checkpoint == "auto":
        subsets = np.array(list(itertools.product([0, 1], repeat=L)), dtype=bool)
    else:
        subsets = np.full((1, L), checkpoint == "full")
    n = [in_flight(schedule, p, v, j, m) for j in range(S)]
    found = []  # (max t, latency) of every feasible (partition, subset)
    for cuts in itertools.combinations(range(1, L), S - 1):
        bounds = (0, *cuts, L)
        tmax = np.zeros(len(subsets))
        total = np.zeros(len(subsets))
        ok = np.ones(len(subsets), dtype=bool)
        for j in range(S):
            a, b = bounds[j], bounds[j + 1]
            k = subsets[:, a:b]
            t = fb[a:b].sum() + (k * f[a:b]).sum(1)
            mem = (
                static[a:b].sum()
                + n[j] * np.where(k, ck[a:b], act[a:b]).sum(1)
                + np.where(k, act[a:b], 0.0).max(1)
            )
            ok &= mem <= limit / v * (1 + 1e-9)
            tmax = np.maximum(tmax, t)
            total += t
            if j and stage_rank(schedule, p, j - 1) != stage_rank(schedule, p, j):
                total += 2 * (latency + out[a - 1] * per_byte)
        found += zip(tmax[ok], total[ok])
    if not found:
        return math.inf, math.inf
    tau = min(tm for tm, _ in found)
    return tau, min(tot for tm, tot in found if tm <= tau * (1 + 1e-9))


_seen: collections.Counter = collections.Counter()


def _check_against_brute_force(seed, L, p, schedule, checkpoint, kinds=None):
    rng = random.Random(seed)
    v = V[schedule]
    if p * v > L:
        return
    m = rng.choice([MIN_M[schedule] * p, MIN_M[schedule] * p * 2])
    costs = _random_costs(rng, L)
    if kinds:  # repeated layers: the knapsack counts per kind
        costs = [rng.choice(costs[:kinds]) for _ in range(L)]
    # a limit between "nothing fits" and "everything fits without checkpointing"
    worst = sum(c.static_bytes for c in costs) + m * sum(c.act_bytes for c in costs)
    limit = v * rng.uniform(0.1, 0.5) * worst
    per_byte, latency = rng.uniform(0, 0.1), rng.uniform(0, 0.1)
    expect = _brute_force(costs, p, v, schedule, m, limit, checkpoint, per_byte, latency)
    kw = dict(num_stages=p, num_microbatches=m, mem_limit_bytes=limit, schedule=schedule)
    kw |= dict(stages_per_rank=v, checkpoint=checkpoint)
    kw |= dict(p2p_s_per_byte=per_byte, p2p_latency_s=latency)
    if math.isinf(expect[0]):
        with pytest.raises(StageError):
            partition(costs, **kw)
        return
    plan = partition(costs, **kw)
    _seen[checkpoint, bool(plan.checkpointed)] += 1
    got = max(plan.stage_time_s), sum(plan.stage_time_s) + plan.p2p_s
    assert got == pytest.approx(expect, rel=1e-9), (seed, L, p, schedule, checkpoint)
    # the plan is self-consistent: contiguous cover, memory within the share
    assert plan.boundaries[0][0] == 0 and plan.boundaries[-1][1] == L
    assert all(x[1] == y[0] for x, y in zip(plan.boundaries, plan.boundaries[1:]))
    assert all(b > a for a, b in plan.boundaries)
    assert max(plan.stage_memory_bytes) <= limit / v * (1 + 1e-9)
    assert max(plan.rank_memory_bytes) <= limit * (1 + 1e-9)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", ["auto", "none", "full"])
def test_dp_equals_brute_force_fixed_seeds(schedule, checkpoint):
    for seed in range(25):
        rng = random.Random(1000 + seed)
        L = rng.randint(3, 8)
        p = rng.randint(1, min(4, L // V[schedule]))
        _check_against_brute_force(seed, L, p, schedule, checkpoint)
    if checkpoint == "auto":  # the tables exercise the knapsack, not only the no-op case
        assert _seen["auto", True] > 0 and _seen["auto", False] > 0


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    L=st.integers(3, 7),
    p=st.integers(1, 3),
    schedule=st.sampled_from(SCHEDULES),
)
def test_dp_equals_brute_force_hypothesis(seed, L, p, schedule):
    _check_against_brute_force(seed, L, p, schedule, "auto")


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b", "zbv"])
def test_dp_equals_brute_force_repeated_layers(schedule):
    """Layers drawn from 2-3 kinds, so a stage holds several identical layers and the exact
    knapsack's closed form for the largest kind (and the box over the others) is exercised."""
    for seed in range(30):
        rng = random.Random(2000 + seed)
        L = rng.randint(5, 10)
        p = rng.randint(1, min(3, L // V[schedule]))
        _check_against_brute_force(seed, L, p, schedule, "auto", kinds=rng.choice([2, 3]))


def test_exact_knapsack_equals_enumeration():
    """_exact_options against every count vector, on multisets with tens of layers per kind."""
    from autopar.planner.stages import _exact_options, _layers

    rng = np.random.default_rng(7)
    for trial in range(40):
        K = int(rng.integers(1, 4))
        pool = _random_costs(random.Random(trial), K)
        if trial % 5 == 0:  # a kind whose checkpoint saves nothing
            pool[0] = LayerCost(1.0, 2.0, act_bytes=3.0, act_ckpt_bytes=3.0, static_bytes=1.0)
        P = _layers(tuple(pool))
        sets = rng.integers(0, 25, size=(6, K))
        sets[:, int(rng.integers(K))] = rng.integers(0, 60, size=6)
        n = np.array([1.0, 3.0, 8.0])
        total = sets @ np.array([c.static_bytes + 8 * c.act_bytes for c in pool])
        budget = float(rng.uniform(0.2, 0.9) * total.max())
        t, mem, choice = _exact_options(P, sets, n, budget, "auto")
        r = np.array([c.fwd_s for c in pool])
        for u, cnt in enumerate(sets):
            ks = np.array(list(itertools.product(*(range(c + 1) for c in cnt))))
            sav = ks @ np.array([c.act_bytes - c.act_ckpt_bytes for c in pool])
            act = cnt @ np.array([c.act_bytes for c in pool])
            trans = np.max(np.where(ks > 0, [c.act_bytes for c in pool], 0.0), axis=1)
            fb = cnt @ np.array([c.fwd_s + c.bwd_s for c in pool])
            for i, x in enumerate(n):
                m = cnt @ np.array([c.static_bytes for c in pool]) + (act - sav) * x + trans
                cost = np.where(m <= budget * (1 + 1e-9), fb + ks @ r, np.inf)
                assert t[u, i] == pytest.approx(cost.min(), rel=1e-9), (trial, u, i)
                assert mem[u, i] == pytest.approx(m.min(), rel=1e-9)
                if np.isfinite(cost.min()):  # the choice is one that fits and takes that time
                    k = choice[u, i]
                    assert np.all(k <= cnt)
                    j = int(np.flatnonzero(np.all(ks == k, axis=1))[0])
                    assert m[j] <= budget * (1 + 1e-9)
                    assert cost[j] == pytest.approx(t[u, i], rel=1e-9)


def test_greedy_knapsack_beyond_the_exact_limit():
    """A stage of 12 distinct layers (2^11 combinations of the non-largest kinds > 512) takes the
    greedy path: its choice fits the budget and is no faster than the exact optimum."""
    rng = random.Random(5)
    costs = _random_costs(rng, 12)
    high = sum(c.static_bytes + c.act_bytes for c in costs)  # nothing checkpointed
    low = sum(c.static_bytes + c.act_ckpt_bytes for c in costs) + max(c.act_bytes for c in costs)
    limit = low + 0.5 * (high - low)
    plan = partition(costs, num_stages=1, num_microbatches=1, mem_limit_bytes=limit,
                     schedule="gpipe")  # fmt: skip
    assert plan.checkpointed and plan.stage_memory_bytes[0] <= limit * (1 + 1e-9)
    best, _ = _brute_force(costs, 1, 1, "gpipe", 1, limit, "auto", 0.0, 0.0)
    assert plan.stage_time_s[0] >= best * (1 - 1e-9)


def _uniform(L, head_fwd=1.0):
    blk = LayerCost(
        fwd_s=1.0, bwd_s=2.0, act_bytes=1.0, act_ckpt_bytes=0.1, static_bytes=1.0, out_bytes=1.0
    )
    head = LayerCost(
        fwd_s=head_fwd, bwd_s=2 * head_fwd, act_bytes=1.0, act_ckpt_bytes=0.1, static_bytes=1.0
    )
    return [blk] * (L - 1) + [head]


@pytest.mark.parametrize("L,p", [(12, 4), (13, 4), (30, 8), (7, 3), (130, 64), (130, 16)])
def test_uniform_model_is_balanced(L, p):
    plan = partition(_uniform(L), num_stages=p, num_microbatches=2 * p, mem_limit_bytes=1e9)
    sizes = [b - a for a, b in plan.boundaries]
    assert max(sizes) - min(sizes) <= 1, sizes
    assert plan.checkpointed == ()


def test_heavy_head_shifts_boundaries():
    light = partition(_uniform(16), num_stages=4, num_microbatches=8, mem_limit_bytes=1e9)
    heavy = partition(
        _uniform(16, head_fwd=3.0), num_stages=4, num_microbatches=8, mem_limit_bytes=1e9
    )
    assert [b - a for a, b in light.boundaries] == [4, 4, 4, 4]
    # the head weighs 3 blocks: the last stage gets fewer layers, the others absorb them
    last = heavy.boundaries[-1]
    assert last[1] - last[0] < 4
    assert heavy.boundaries[0][1] - heavy.boundaries[0][0] >= 4
    assert max(heavy.stage_time_s) < max(light.stage_time_s) * 1.5


# ---------------------------------------------------------------------------------------------
# in flight: a discrete-event simulator of GPipe / 1F1B with real dependencies


def _simulate(schedule, p, m, tf=1.0, tb=2.0):
    """Each stage runs its op list in order, an op starting when the stage is free and its
    input has arrived (F needs F of stage s-1, B needs B of stage s+1 and its own F). Returns
    (peak activations alive per stage, makespan)."""
    if schedule == "gpipe":
        orders = [["F"] * m + ["B"] * m for _ in range(p)]
    else:
        orders = []
        for s in range(p):
            w = min(m, p - s)
            orders.append(["F"] * w + ["B", "F"] * (m - w) + ["B"] * w)
    done = {}  # (kind, stage, mb) -> finish time
    free = [0.0] * p
    pos = [0] * p
    nxt = [{"F": 0, "B": 0} for _ in range(p)]
    alive = [0] * p
    peak = [0] * p
    events = []  # (time, +-1, stage) for the alive counter
    progress = True
    while progress:
        progress = False
        for s in range(p):
            if pos[s] == len(orders[s]):
                continue
            kind = orders[s][pos[s]]
            mb = nxt[s][kind]
            deps = [("F", s - 1, mb)] if kind == "F" and s > 0 else []
            if kind == "B":
                deps = [("F", s, mb)] + ([("B", s + 1, mb)] if s < p - 1 else [])
            if all(d in done for d in deps):
                start = max([free[s]] + [done[d] for d in deps])
                end = start + (tf if kind == "F" else tb)
                done[kind, s, mb] = end
                free[s] = end
                events.append((start if kind == "F" else end, 1 if kind == "F" else -1, s))
                pos[s] += 1
                nxt[s][kind] += 1
                progress = True
    assert all(pos[s] == len(orders[s]) for s in range(p)), "deadlock"
    for _, delta, s in sorted(events, key=lambda e: (e[0], e[1])):  # frees before allocs
        alive[s] += delta
        peak[s] = max(peak[s], alive[s])
    return peak, max(free)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 2), (2, 5), (3, 3), (4, 4), (4, 8), (5, 7)])
def test_in_flight_matches_simulation(schedule, p, m):
    peak, makespan = _simulate(schedule, p, m)
    assert peak == [in_flight(schedule, p, 1, s, m) for s in range(p)]
    # balanced stages: the simulated step is (m + p - 1)(t_f + t_b), the step_time formula
    total, bubble = step_time(schedule, [3.0] * p, m)
    assert makespan == pytest.approx(total)
    assert bubble == pytest.approx((p - 1) * 3.0)


def _torch_rank_peak(schedule, p, v, r, m):
    sched = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = {
        "interleaved-1f1b": sched.ScheduleInterleaved1F1B,
        "zbv": sched.ScheduleZBVZeroBubble,
        "dualpipev": sched.ScheduleDualPipeV,
    }[schedule]
    obj = object.__new__(cls)  # only the op-order generator, no process group
    obj.pp_group_size, obj.n_local_stages, obj._n_microbatches = p, v, m
    obj.num_stages = obj._num_stages = p * v
    obj.number_of_rounds = max(1, m // p)
    obj.microbatches_per_round = m // obj.number_of_rounds
    alive = peak = 0
    for action in obj._calculate_single_rank_operations(r):
        if action is None:
            continue
        for sub in action.sub_actions or (action,):
            kind = sub.computation_type.name
            alive += {"FORWARD": 1, "FULL_BACKWARD": -1, "BACKWARD_INPUT": 0}.get(kind, -1)
            peak = max(peak, alive)
    assert alive == 0
    return peak


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv", "dualpipev"])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_in_flight_matches_torch_op_order(schedule, p, rounds):
    m = rounds * p * (2 if schedule == "dualpipev" else 1)
    for r in range(p):
        j = r  # the rank's first stage under either placement
        assert in_flight(schedule, p, 2, j, m) * 2 == _torch_rank_peak(schedule, p, 2, r, m)
    # closed forms (module docstring), v = 2
    expect = {
        "interleaved-1f1b": lambda r: min(3 * p - 2 * r - 1, 2 * m),
        "zbv": lambda r: min(2 * p, m + r + 1),
        "dualpipev": lambda r: 2 * p + 1,
    }[schedule]
    assert [in_flight(schedule, p, 2, r, m) * 2 for r in range(p)] == [expect(r) for r in range(p)]


def test_in_flight_gpipe_and_1f1b_closed_forms():
    assert [in_flight("gpipe", 4, 1, s, 6) for s in range(4)] == [6] * 4
    assert [in_flight("1f1b", 4, 1, s, 6) for s in range(4)] == [4, 3, 2, 1]


def test_placement():
    assert [stage_rank("interleaved-1f1b", 3, j) for j in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [stage_rank("zbv", 3, j) for j in range(6)] == [0, 1, 2, 2, 1, 0]


# ---------------------------------------------------------------------------------------------
# memory: checkpointing first, then a one-line error naming the stage


def test_shrinking_memory_forces_checkpointing_then_infeasibility():
    blk = LayerCost(fwd_s=1.0, bwd_s=2.0, act_bytes=4e9, act_ckpt_bytes=0.5e9, static_bytes=2e9)
    costs = [blk] * 8
    kw = dict(num_stages=2, num_microbatches=4, schedule="1f1b")
    # stage 0 holds 2 microbatches: 4 layers x (2 GB + 2 x 4 GB) = 40 GB without checkpointing
    free = partition(costs, mem_limit_bytes=40e9, **kw)
    assert free.checkpointed == ()
    some = partition(costs, mem_limit_bytes=36e9, **kw)
    assert 0 < len(some.checkpointed) < 8
    assert max(some.stage_time_s) > max(free.stage_time_s)
    assert max(some.rank_memory_bytes) <= 36e9
    # everything checkpointed: 8 + 2 x 4 x 0.5 + 4 (recompute transient) = 16 GB on stage 0
    full = partition(costs, mem_limit_bytes=16e9, **kw)
    assert len(full.checkpointed) >= 4
    with pytest.raises(StageError) as err:
        partition(costs, mem_limit_bytes=15e9, **kw)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("stage 0 (layers 0-3, rank 0) needs 16.0 GB > 15.0 GB")
    assert "every layer checkpointed" in msg and "relax" in msg
    with pytest.raises(StageError, match="checkpoint='none'"):
        partition(costs, mem_limit_bytes=25e9, checkpoint="none", **kw)
    forced = partition(costs, mem_limit_bytes=80e9, checkpoint="full", **kw)
    assert forced.checkpointed == tuple(range(8))


def test_too_few_layers():
    with pytest.raises(StageError, match="3 layers cannot fill 4"):
        partition(_uniform(3), num_stages=4, num_microbatches=4, mem_limit_bytes=1e9)


# ---------------------------------------------------------------------------------------------
# schedule rules and step time


def test_schedule_rules():
    with pytest.raises(ScheduleError, match=r"1f1b needs microbatches \(3\) >= 4"):
        check_schedule("1f1b", 4, 3)
    with pytest.raises(ScheduleError, match="multiple of pp"):
        check_schedule("interleaved-1f1b", 4, 6)
    with pytest.raises(ScheduleError, match=">= 8"):
        check_schedule("dualpipev", 4, 6)
    with pytest.raises(ScheduleError, match="2 stage"):
        check_schedule("zbv", 2, 4, stages_per_rank=3)
    with pytest.raises(ScheduleError):
        partition(_uniform(8), num_stages=4, num_microbatches=2, mem_limit_bytes=1e9)
    assert check_schedule("gpipe", 4, 1) == 1
    assert check_schedule("interleaved-1f1b", 4, 8) == 2
    assert check_schedule("interleaved-1f1b", 2, 4, stages_per_rank=3) == 3


def test_step_time_formulas():
    t = [3.0] * 8  # 4 ranks x 2 chunks
    assert step_time("interleaved-1f1b", t, 8) == (8 * 2 * 3 + 3 * 3, 3 * 3)
    # zero-bubble: F = 1, B = 2 (W = 1): ZB-V bubble (p-1)(F + B - 3W) = 0, DualPipeV 3(1+4-3)
    f, b, w = [1.0] * 8, [2.0] * 8, [1.0] * 8
    kw = dict(stage_fwd_s=f, stage_bwd_s=b, stage_bwd_weight_s=w)
    assert step_time("zbv", t, 8, **kw) == (48.0, 0.0)
    assert step_time("dualpipev", t, 8, **kw) == (48.0 + 6.0, 6.0)
    total, bubble = step_time("1f1b", [1.0, 2.0], 4, [0.5], per_step_s=0.25)
    assert (total, bubble) == (5 * 2.0 + 0.5 + 0.25, 2.0)


def test_best_schedule_keeps_every_candidate():
    def costs_for(mb_size):
        blk = LayerCost(
            fwd_s=1e-3 * mb_size,
            bwd_s=2e-3 * mb_size,
            bwd_weight_s=1e-3 * mb_size,
            act_bytes=1e9 * mb_size,
            act_ckpt_bytes=1e8 * mb_size,
            static_bytes=2e9,
            out_bytes=1e7 * mb_size,
        )
        return [blk] * 16

    best, cands = best_schedule(
        costs_for,
        num_stages=4,
        global_batch_per_dp=16,
        mem_limit_bytes=40e9,
        p2p_s_per_byte=1e-11,
        p2p_latency_s=1e-5,
    )
    feasible = [c for c in cands if c.plan is not None]
    assert best.step_time_s == min(c.step_time_s for c in feasible)
    assert {c.schedule for c in cands} == set(SCHEDULES)
    # lowest floor first: a candidate that cannot beat the fastest is kept with its reason
    assert all(c.plan is not None or c.reason for c in cands)
    assert any("its step time is at least" in c.reason for c in cands)
    assert any("needs microbatches" in c.reason for c in cands)  # 1f1b with m < 4, kept
    # zero-bubble schedules win on this table (W = 1/2 of B fills the bubble)
    assert best.schedule in ("zbv", "dualpipev")
    with pytest.raises(StageError, match="no schedule"):
        best_schedule(costs_for, num_stages=4, global_batch_per_dp=16, mem_limit_bytes=1e9)


def test_large_tables_are_fast():
    import time

    costs = (
        [LayerCost(1e-4, 2e-4, 1e8, 1e8, 4e9, 5e7)]
        + _uniform(128)
        + [LayerCost(3e-3, 6e-3, 8e9, 1e8, 4e9, 0)]
    )
    start = time.perf_counter()
    for schedule, p, m in [("1f1b", 64, 64), ("interleaved-1f1b", 8, 32), ("zbv", 32, 64)]:
        partition(costs, num_stages=p, num_microbatches=m, mem_limit_bytes=80e9, schedule=schedule)
    assert time.perf_counter() - start < 3.0  # generous: ~0.3 s measured on 2 cores


def test_restricted_tables_give_the_whole_tables_answer(monkeypatch):
    """partition's knapsack skips ranges no stage can take and, first, ranges slower than a cap
    on tau (planner.knapsack._tables): the plan (or the error) equals the one of whole tables."""
    from autopar.planner import knapsack, stages

    def plans():
        out = []
        for seed in range(12):
            rng = random.Random(3000 + seed)
            L = rng.choice([6, 12, 20])
            pool = _random_costs(rng, 4)
            costs = [pool[0], *(rng.choice(pool[1:3]) for _ in range(L - 2)), pool[3]]
            for schedule, p in itertools.product(SCHEDULES, (1, 2, 3)):
                v, m = V[schedule], MIN_M[schedule] * p * rng.choice([1, 2])
                if p == 1 and v > 1:
                    continue
                worst = sum(c.static_bytes for c in costs) + m * sum(c.act_bytes for c in costs)
                kw = dict(num_stages=p, num_microbatches=m, schedule=schedule, stages_per_rank=v)
                kw |= dict(mem_limit_bytes=v * rng.uniform(0.05, 0.6) * worst, p2p_latency_s=0.01)
                try:
                    out.append(partition(costs, **kw))
                except StageError as e:
                    out.append(str(e))
        return out

    fast = plans()
    monkeypatch.setattr(stages, "_time_caps", lambda P, S: (math.inf,))
    monkeypatch.setattr(knapsack, "_usable", lambda a, b, S, L: np.ones(len(a), bool))
    assert plans() == fast
    assert any(isinstance(x, str) for x in fast) and any(not isinstance(x, str) for x in fast)


def test_a_bound_never_changes_the_plan_and_its_floor_is_a_lower_bound():
    """partition(bound=B): the unbounded plan where its step is <= B; BoundExceeded where it is
    above B, with a floor no greater than that step (the knapsack's relaxation and the DP's
    tau are lower bounds). And where the relaxation finds no partition, none fits: the same
    StageError words, written only when read."""
    from autopar.planner.stages import BoundExceeded

    seen = collections.Counter()
    for seed in range(40):
        rng = random.Random(5000 + seed)
        L = rng.choice([5, 9, 14])
        pool = _random_costs(rng, 4)
        costs = [pool[0], *(rng.choice(pool[1:3]) for _ in range(L - 2)), pool[3]]
        schedule = rng.choice(SCHEDULES)
        p = rng.choice([1, 2, 3]) if V[schedule] == 1 else rng.choice([2, 3])
        m = MIN_M[schedule] * p * rng.choice([1, 2])
        worst = sum(c.static_bytes for c in costs) + m * sum(c.act_bytes for c in costs)
        kw = dict(num_stages=p, num_microbatches=m, schedule=schedule, stages_per_rank=V[schedule],
                  mem_limit_bytes=V[schedule] * rng.uniform(0.05, 0.7) * worst,
                  checkpoint=rng.choice(["auto", "auto", "none", "full"]),
                  p2p_latency_s=0.01)  # fmt: skip
        try:
            free = partition(costs, **kw)
        except StageError as e:
            with pytest.raises(StageError) as bounded:
                partition(costs, bound=0.0, **kw)  # no partition at all beats a bound
            assert str(bounded.value) == str(e)
            seen["none fits"] += 1
            continue
        for bound in (free.step_time_s * 1.001, free.step_time_s * 0.999, free.step_time_s / 3):
            try:
                plan = partition(costs, bound=bound, **kw)
            except BoundExceeded as e:
                assert bound < free.step_time_s and e.floor <= free.step_time_s
                seen["bounded"] += 1
            else:
                assert plan == free
                seen["planned"] += 1
    assert seen["none fits"] and seen["bounded"] > 10 and seen["planned"] > 10, seen


def test_the_relaxed_tables_are_lower_bounds_of_the_knapsack():
    """knapsack._lower_tables <= knapsack._tables on every range, finite wherever the knapsack
    finds a choice that fits."""
    from autopar.planner import knapsack

    for seed in range(20):
        rng = random.Random(7000 + seed)
        L = rng.choice([6, 11])
        pool = _random_costs(rng, 4)
        costs = [pool[0], *(rng.choice(pool[1:3]) for _ in range(L - 2)), pool[3]]
        P = knapsack._layers(tuple(costs))
        S, n = rng.choice([1, 2, 3]), [1.0, 2.0, 5.0]
        budget = rng.uniform(0.1, 0.6) * (sum(c.static_bytes + 3 * c.act_bytes for c in costs))
        for checkpoint in ("auto", "none", "full"):
            T, _, _ = knapsack._tables(P, S, n, budget, checkpoint)
            lower = knapsack._lower_tables(P, S, n, budget, checkpoint)
            finite = np.isfinite(T)
            assert np.all(np.isfinite(lower[finite]))
            assert np.all(lower[finite] <= T[finite] * (1 + 1e-9))


def test_a_candidate_skipped_for_a_refused_one_is_refused_by_its_own_partition():
    """best_schedule skips (schedule, m) where a candidate of the same schedule that holds no
    more memory was refused by the knapsack's relaxation: each one skipped, partitioned on its
    own, is refused too; the plan is the one every candidate partitioned gives; and the skip
    is taken (the cost tables here grow with the microbatch, as a model's do)."""
    skipped = 0
    for seed in range(30):
        rng = random.Random(7000 + seed)
        pool = _random_costs(rng, 3)
        L, p = rng.choice([8, 12]), rng.choice([2, 3])
        kinds = [rng.randrange(3) for _ in range(L)]

        def costs_for(size: int, pool=pool, kinds=kinds) -> list[LayerCost]:
            def at(c: LayerCost) -> LayerCost:
                return LayerCost(
                    fwd_s=c.fwd_s * size, bwd_s=c.bwd_s * size,
                    bwd_weight_s=c.bwd_weight_s * size, act_bytes=c.act_bytes * size,
                    act_ckpt_bytes=c.act_ckpt_bytes * size, static_bytes=c.static_bytes,
                    out_bytes=c.out_bytes * size,
                )  # fmt: skip

            table = [at(c) for c in pool]
            return [table[k] for k in kinds]

        batch = 8 * p
        worst = sum(c.static_bytes for c in costs_for(1)) + p * sum(
            c.act_ckpt_bytes for c in costs_for(batch // p)
        )
        limit = rng.uniform(0.1, 0.4) * worst
        kw = dict(num_stages=p, mem_limit_bytes=limit, checkpoint="auto", p2p_latency_s=0.01)
        try:
            best, cands = best_schedule(costs_for, global_batch_per_dp=batch, **kw)
        except StageError:
            best, cands = None, None
        every = []  # each candidate partitioned on its own
        for c in cands or []:
            if "holds no less memory than" in c.reason:
                skipped += 1
                with pytest.raises(StageError):
                    partition(costs_for(batch // c.num_microbatches), num_stages=p,
                              num_microbatches=c.num_microbatches, schedule=c.schedule,
                              stages_per_rank=c.stages_per_rank, mem_limit_bytes=limit,
                              checkpoint="auto", p2p_latency_s=0.01)  # fmt: skip
            elif c.plan is not None:
                every.append(c)
        if best is not None:
            fastest = min(every, key=lambda c: c.step_time_s)
            assert best.step_time_s == fastest.step_time_s
    assert skipped > 10, skipped


def test_one_stage_relaxation_gives_the_tables_figures():
    """partition's one-stage relaxation (its one range's sums straight from the costs, no
    layer arrays or tables) gives the relaxation tables' figure to the last bit, inf where
    they refuse, and the sync and optimizer sums partition reads from the layer arrays."""
    from autopar.planner import knapsack

    seen = collections.Counter()
    for seed in range(80):
        rng = random.Random(9000 + seed)
        L = rng.choice([1, 3, 6, 10])
        pool = _random_costs(rng, 3)
        costs = [rng.choice(pool) for _ in range(L)]
        if seed % 3 == 0:  # a recompute the cost table sets (not the forward's time)
            costs = [
                dataclasses.replace(c, recompute_s=c.fwd_s * 1.3) if i % 2 else c
                for i, c in enumerate(costs)
            ]
        worst = sum(c.static_bytes for c in costs) + sum(c.act_bytes for c in costs)
        n = float(rng.choice([1, 2, 4]))
        budget = rng.uniform(0.1, 1.1) * worst
        checkpoint = rng.choice(["auto", "auto", "none", "full"])
        quick, sync, opt = knapsack._one_range_lower(costs, n, budget, checkpoint)
        P = knapsack._Layers(costs)
        table = knapsack._lower_tables(P, 1, [n], budget, checkpoint)[0, 0, L]
        assert quick == table or (math.isinf(quick) and math.isinf(table)), (seed, quick, table)
        assert (sync, opt) == (P.sync.sum(), P.opt.sum())
        seen["refused" if math.isinf(quick) else "bounded"] += 1
    assert seen["refused"] > 5 and seen["bounded"] > 5, seen
