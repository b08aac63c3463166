"""The stage DP's checkpoint knapsack (:mod:`planner.stages`, its docstring's constraint family):
per range of layers [a, b) and microbatches in flight n, the fastest choice of checkpointed
layers whose memory fits the stage's budget, and the least memory of any choice.

Identical layers (equal ``LayerCost``) form a kind; a range's options depend only on its
multiset of kinds (count vectors), so ranges are grouped by multiset and solved in batches.
Exact (`_exact_options`) while the kinds other than a range's largest have <= _MAX_COMBOS
count combinations; beyond, the greedy order f_i / (a_i - c_i) (`_greedy_options`).

The stage DP reads the answers as tables over the ranges some stage can take (`_tables`), and
first a cheap lower bound of them, the knapsack's linear relaxation (`_lower_tables`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    from autopar.planner.stages import LayerCost

Checkpoint = Literal["auto", "none", "full"]
_MAX_COMBOS = 512  # exact checkpoint knapsack up to this many combinations per stage
_REL_TOL = 1e-9


class _Layers:
    """Per-layer numpy arrays, and a kind id per layer (identical LayerCosts share one)."""

    def __init__(self, costs: Sequence[LayerCost]):
        ids: dict[LayerCost, int] = {}
        by_obj: dict[int, int] = {}  # a run of identical blocks is mostly one object
        kind = []
        for c in costs:
            k = by_obj.get(id(c))
            if k is None:
                k = by_obj[id(c)] = ids.setdefault(c, len(ids))
            kind.append(k)
        self.kind = np.array(kind, dtype=np.int64)
        kinds = list(ids)  # one LayerCost per kind, each column read once per kind
        col = lambda key: np.array([getattr(c, key) for c in kinds], dtype=float)[self.kind]  # noqa: E731
        self.f, self.act, self.static = col("fwd_s"), col("act_bytes"), col("static_bytes")
        self.fb = self.f + col("bwd_s")
        # recompute time of a checkpointed layer (k_i r_i in the docstring's t_j; r_i = f_i
        # unless the cost table says more, e.g. the checkpoint wrapper's own overhead)
        self.r = np.array(
            [c.fwd_s if c.recompute_s is None else c.recompute_s for c in kinds], dtype=float
        )[self.kind]
        self.sav = self.act - col("act_ckpt_bytes")
        self.out, self.sync, self.opt = col("out_bytes"), col("grad_sync_s"), col("optimizer_s")
        # prefix sums: a range [a, b)'s total is pre[b] - pre[a]
        pre = lambda x: np.concatenate([[0.0], np.cumsum(x)])  # noqa: E731
        self.pre_static, self.pre_act, self.pre_fb = pre(self.static), pre(self.act), pre(self.fb)
        self.pre_sav, self.pre_r = pre(self.sav), pre(self.r)
        self.range_sums: dict[tuple, tuple[np.ndarray, ...]] = {}  # :func:`_range_sums`
        self.ratio = np.where(self.sav > 0, self.r / np.where(self.sav > 0, self.sav, 1), np.inf)
        # counts[i, g]: layers of kind g among the first i (a range's multiset is a difference)
        onehot = np.zeros((len(costs), len(ids)), dtype=np.int64)
        onehot[np.arange(len(costs)), self.kind] = 1
        self.counts = np.vstack([np.zeros((1, len(ids)), np.int64), np.cumsum(onehot, axis=0)])
        # one representative layer per kind: its first (kinds are numbered in order of first
        # appearance)
        self.rep = np.unique(self.kind, return_index=True)[1]


@lru_cache(maxsize=64)
def _layers(costs: tuple[LayerCost, ...]) -> _Layers:
    """_Layers of a cost table, shared by the partitions of one table (schedules x microbatch
    counts ask for the same table many times; a LayerCost keeps its hash, and a table's
    identical blocks are mostly one object, so the lookup is cheap)."""
    return _Layers(costs)


def _greedy_options(
    P: _Layers, a: int, b: int, n: np.ndarray, budget: float
) -> tuple[np.ndarray, np.ndarray, list[list[int]]]:
    """The knapsack of layers [a, b) where `_exact_options` does not apply (`_is_exact`), for
    every in-flight value in n: (min time of a checkpoint choice with mem <= budget, inf if none;
    min memory over the choices tried; the chosen layers). The choices are prefixes of the
    layers sorted by seconds per byte saved f_i / (a_i - c_i)."""
    order = a + np.argsort(P.ratio[a:b], kind="stable")
    cum = lambda x: np.concatenate([[0.0], np.cumsum(x)])  # noqa: E731
    extra_s, saved = cum(P.r[order]), cum(P.sav[order])
    transient = np.concatenate([[0.0], np.maximum.accumulate(P.act[order])])
    act_left = P.act[a:b].sum() - saved  # (K,) saved bytes per microbatch
    mem = P.static[a:b].sum() + act_left[:, None] * n[None, :] + transient[:, None]  # (K, N)
    cost = np.where(mem <= budget * (1 + _REL_TOL), P.fb[a:b].sum() + extra_s[:, None], np.inf)
    best = np.argmin(cost, axis=0)
    return cost.min(axis=0), mem.min(axis=0), [sorted(order[:k].tolist()) for k in best]


def _is_exact(sets: np.ndarray, checkpoint: Checkpoint) -> np.ndarray:
    """Per multiset (rows: counts per kind): whether `_exact_options` solves it, i.e. the kinds
    other than its largest have <= _MAX_COMBOS count combinations."""
    if checkpoint != "auto":
        return np.ones(len(sets), dtype=bool)
    combos = np.prod(sets + 1.0, axis=1) / (sets.max(axis=1, initial=0) + 1.0)
    return combos <= _MAX_COMBOS


def _first_of_kinds(P: _Layers, a: int, b: int, counts: dict[int, int]) -> list[int]:
    """The first counts[g] layers of each kind g in [a, b) (identical layers: any will do)."""
    out = []
    for i in range(a, b):
        if counts[P.kind[i]] > 0:
            out.append(i)
            counts[P.kind[i]] -= 1
    return out


# at most this many (multiset, combination, in-flight) cells per vectorized knapsack batch
_MAX_CELLS = 2_000_000


def _unique_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(x, axis=0, return_inverse=True) for non-negative integer rows, through one
    mixed-radix integer per row where that fits in int64 (a 1-D unique is ~10x faster)."""
    radix = x.max(axis=0, initial=0) + 1
    if float(np.prod(radix.astype(float))) < 2.0**62:
        weights = np.concatenate([[1], np.cumprod(radix[:-1])]).astype(np.int64)
        _, first, inverse = np.unique(x @ weights, return_index=True, return_inverse=True)
        return x[first], inverse.reshape(-1)
    sets, inverse = np.unique(x, axis=0, return_inverse=True)
    return sets, inverse.reshape(-1)


def _exact_options(
    P: _Layers,
    sets: np.ndarray,
    n: np.ndarray,
    budget: float,
    checkpoint: Checkpoint,
    most: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The exact checkpoint knapsack for many multisets at once.

    sets (U, K): layers per kind; n (N,): in-flight values; most (K,): the most layers per kind
    the box of count vectors spans (default: the batch's, ``sets.max(axis=0)``; a caller that
    solves part of a batch passes the whole batch's, so each row gets the same box). Returns
    (time (U, N): min t_j of a choice with mem_j <= budget, inf if none; memory (U, N): min
    mem_j over every choice; choice (U, N, K): checkpointed layers per kind of the fastest
    fitting choice).

    "none" and "full" have one choice each. "auto": with g the kind that has the most layers
    (in the batch), every count vector of the other kinds is enumerated (a box of C vectors);
    given one, t_j grows and mem_j falls linearly in k_g, apart from the recompute transient
    that joins at k_g = 1, so the fewest k_g >= 1 that fit is a closed form (then checked, one
    up or down, against rounding), and k_g = 0 is the other candidate."""
    U, K, N = len(sets), sets.shape[1], len(n)
    rep = P.rep
    cap = budget * (1 + _REL_TOL)
    static, act, fb = sets @ P.static[rep], sets @ P.act[rep], sets @ P.fb[rep]
    if checkpoint != "auto":
        ck = np.zeros_like(sets) if checkpoint == "none" else sets
        trans = np.max(np.where(ck > 0, P.act[rep], 0.0), axis=1, initial=0.0)
        mem = static[:, None] + (act - ck @ P.sav[rep])[:, None] * n[None, :] + trans[:, None]
        t = np.where(mem <= cap, (fb + ck @ P.r[rep])[:, None], np.inf)
        return t, mem, np.broadcast_to(ck[:, None, :], (U, N, K)).copy()
    top = sets.max(axis=0) if most is None else most
    g = int(np.argmax(top))
    box = top + 1
    box[g] = 1
    C = int(np.prod(box))
    if U > 1 and U * C * N > _MAX_CELLS:  # split the batch
        step = max(1, _MAX_CELLS // (C * N))
        parts = [_exact_options(P, sets[i : i + step], n, budget, checkpoint, most)
                 for i in range(0, U, step)]  # fmt: skip
        return tuple(np.concatenate([x[i] for x in parts]) for i in range(3))  # type: ignore[return-value]
    combos = np.indices(box).reshape(K, -1).T  # (C, K), k_g = 0
    valid = np.all(combos[None, :, :] <= sets[:, None, :], axis=2)  # (U, C)
    extra, saved = combos @ P.r[rep], combos @ P.sav[rep]  # (C,)
    trans0 = np.max(np.where(combos > 0, P.act[rep], 0.0), axis=1, initial=0.0)  # (C,)
    trans1 = np.maximum(trans0, P.act[rep[g]])
    r_g, sav_g, cnt_g = P.r[rep[g]], P.sav[rep[g]], sets[:, g]
    left = (act[:, None] - saved[None, :])[:, :, None] * n[None, None, :]  # (U, C, N)
    mem0 = static[:, None, None] + left + trans0[None, :, None]
    base1 = static[:, None, None] + left + trans1[None, :, None]  # mem at k_g = 0 + transient

    def mem_at(k):
        return base1 - k * sav_g * n[None, None, :]

    if sav_g > 0:
        k = np.ceil((base1 - cap) / (sav_g * n[None, None, :]))
        k = np.clip(k, 1, None)
        k = np.where((k > 1) & (mem_at(k - 1) <= cap), k - 1, k)  # rounding, either way
        k = np.where(mem_at(k) > cap, k + 1, k)
    else:
        k = np.ones_like(base1)
    ok1 = valid[:, :, None] & (k <= cnt_g[:, None, None]) & (mem_at(k) <= cap)
    t0 = np.where(valid[:, :, None] & (mem0 <= cap), (fb[:, None] + extra[None, :])[:, :, None],
                  np.inf)  # fmt: skip
    t1 = np.where(ok1, (fb[:, None] + extra[None, :])[:, :, None] + k * r_g, np.inf)
    use1 = t1 < t0
    t = np.minimum(t0, t1)  # (U, C, N)
    best = np.argmin(t, axis=1)  # (U, N): first combo of the fastest
    ui, ni = np.arange(U)[:, None], np.arange(N)[None, :]
    choice = combos[best]  # (U, N, K)
    choice[:, :, g] = np.where(use1[ui, best, ni], k[ui, best, ni], 0).astype(choice.dtype)
    full = np.where(cnt_g[:, None, None] > 0, mem_at(cnt_g[:, None, None]), np.inf)
    mem = np.where(valid[:, :, None], np.minimum(mem0, full), np.inf).min(axis=1)
    return t.min(axis=1), mem, choice


def _range_options(P: _Layers, a_idx, b_idx, n, budget, checkpoint, solve=None):
    """(T, M) of shape (len(n), len(a_idx)): the knapsack of every range [a, b) where ``solve``
    (default: everywhere; inf elsewhere).

    A range's options depend only on its multiset of layer kinds, so ranges are grouped by
    multiset (count vectors) and the exact knapsacks are solved in one batch (in chunks where
    it is large, :func:`_chunks`). The batch is that of every range given, whichever are
    solved: a multiset's answer does not depend on which others are asked for."""
    sets, inverse = _unique_rows(P.counts[b_idx] - P.counts[a_idx])
    wanted = np.zeros(len(sets), bool)
    wanted[inverse if solve is None else inverse[solve]] = True
    T = np.full((len(sets), len(n)), np.inf)
    M = np.full((len(sets), len(n)), np.inf)
    exact = _is_exact(sets, checkpoint)
    rows = np.flatnonzero(exact)
    for chunk, most in _chunks(sets[rows], len(n)) if rows.size else ():
        pick = rows[chunk][wanted[rows[chunk]]]
        if pick.size:
            T[pick], M[pick], _ = _exact_options(P, sets[pick], n, budget, checkpoint, most)
    first = np.full(len(sets), -1)
    first[inverse[::-1]] = np.arange(len(inverse))[::-1]  # a range of each multiset
    for u in np.flatnonzero(~exact & wanted):
        r = first[u]
        T[u], M[u], _ = _greedy_options(P, a_idx[r], b_idx[r], n, budget)
    return T[inverse].T, M[inverse].T


def _chunks(sets: np.ndarray, N: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """How :func:`_exact_options` batches ``sets`` (U, K) for N in-flight values: (rows, the
    most layers per kind the chunk's box spans) per chunk of at most _MAX_CELLS cells."""
    top = sets.max(axis=0)
    box = top + 1
    box[int(np.argmax(top))] = 1
    U, C = len(sets), int(np.prod(box))
    if U <= 1 or U * C * N <= _MAX_CELLS:
        return [(np.arange(U), top)]
    step = max(1, _MAX_CELLS // (C * N))
    return [(np.arange(i, min(i + step, U)), sets[i : i + step].max(axis=0))
            for i in range(0, U, step)]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# per range of layers, for the stage DP


def _tables(
    P: _Layers, S, n_classes, budget, checkpoint, cap_s: float = math.inf, ends: tuple = ()
):
    """(T[c, a, b], M[c, a, b], complete): min time / min memory of layers [a, b) at in-flight
    n_classes[c] (inf outside the valid ranges: a stage holds 1 .. L - S + 1 layers). The
    knapsack runs only on the ranges some stage can take (:func:`_usable`), the others stay inf
    (no pass of :func:`_dp` reads them on a path from 0 to L), and only on those whose time
    without checkpointing is <= ``cap_s`` (``complete``: none was left out for that; M, which
    only :func:`_explain` reads, is None unless ``cap_s`` is inf). ``ends``: where a stage may
    start and end (:func:`_ranges`)."""
    L = len(P.f)
    n = np.asarray(n_classes, float)
    T = np.full((len(n), L + 1, L + 1), np.inf)
    M = np.full((len(n), L + 1, L + 1), np.inf) if math.isinf(cap_s) else None
    st, ac, fb = P.pre_static, P.pre_act, P.pre_fb
    a_idx, b_idx = _ranges(L, S, ends)
    if checkpoint != "full":  # fast path, vectorized: no checkpointing fits
        mem0 = st[b_idx] - st[a_idx] + n[:, None] * (ac[b_idx] - ac[a_idx])[None, :]
        fits = mem0 <= budget * (1 + _REL_TOL)
        T[:, a_idx, b_idx] = np.where(fits, (fb[b_idx] - fb[a_idx])[None, :], np.inf)
        if M is not None:
            M[:, a_idx, b_idx] = mem0
        if checkpoint == "none":
            return T, M, True
        need = ~np.all(fits, axis=0)
        a_idx, b_idx = a_idx[need], b_idx[need]
    if not a_idx.size:
        return T, M, True
    cheap = fb[b_idx] - fb[a_idx] <= cap_s
    t, mem = _range_options(P, a_idx, b_idx, n, budget, checkpoint, cheap)
    T[:, a_idx, b_idx] = t
    if M is not None:
        M[:, a_idx, b_idx] = mem
    return T, M, bool(np.all(cheap))


def _lower_tables(P: _Layers, S, n_classes, budget, checkpoint, ends: tuple = ()) -> np.ndarray:
    """T_lb[c, a, b] <= :func:`_tables`' T[c, a, b], without a knapsack: the knapsack's linear
    relaxation. Checkpointing layers frees at most ``n`` saved bytes each per byte they no longer
    save, at no less than the least recompute seconds per byte of any layer, and the recompute
    transient only adds memory; so a range over its budget by D bytes at n in flight pays at
    least D / n times that rate, and one that does not fit with every layer checkpointed (less
    the transient) does not fit at all ("none": exact; "full": every layer's recompute)."""
    L = len(P.f)
    n = np.asarray(n_classes, float)[:, None]
    T = np.full((len(n), L + 1, L + 1), np.inf)
    a, b, *sums = _range_sums(P, S, ends)
    T[:, a, b] = _relaxed(*sums, n, budget, checkpoint)
    return T


def _relaxed(static, act, work, saved, redo, rate, n, budget: float, checkpoint: Checkpoint):
    """The relaxation's least time of a range (inf: no choice of checkpointed layers fits) from
    its layers' sums (:func:`_range_sums`' columns) at ``n`` in flight: elementwise, over the
    tables' arrays or one range's floats (:func:`_lower_tables`' docstring says why)."""
    cap = budget * (1 + _REL_TOL)  # the knapsack's own test
    fits = cap * (1 + _REL_TOL)  # a hair looser: rounding never refuses what the knapsack fits
    if checkpoint == "full":
        return np.where(static + n * (act - saved) <= fits, work + redo, np.inf)
    mem0 = static + n * act
    if checkpoint == "none":
        return np.where(mem0 <= fits, work, np.inf)
    extra = np.maximum(mem0 - cap, 0.0) * (rate / n)
    return np.where(mem0 - n * saved <= fits, work + extra, np.inf)


def _one_range_lower(
    costs: Sequence[LayerCost], n: float, budget: float, checkpoint: Checkpoint
) -> tuple[float, float, float]:
    """:func:`_lower_tables` of one stage of every layer (its one range [0, L)) at ``n`` in
    flight, computed from the costs alone (no :class:`_Layers`, no table): the same sums in the
    same order into :func:`_relaxed`, so the same figure; and the layers' sync and optimizer
    seconds, each as :func:`planner.stages.partition` sums them."""
    rows = [
        (c.fwd_s, c.bwd_s, c.act_bytes, c.act_ckpt_bytes, c.static_bytes, c.grad_sync_s,
         c.optimizer_s, c.fwd_s if c.recompute_s is None else c.recompute_s)
        for c in costs
    ]  # fmt: skip
    f, bwd, act, ckpt, static, sync, opt, r = np.array(rows, dtype=float).reshape(-1, 8).T.copy()
    sav = act - ckpt
    ratio = np.where(sav > 0, r / np.where(sav > 0, sav, 1), np.inf)
    rate = float(ratio.min(initial=np.inf))
    rate = rate if math.isfinite(rate) else 0.0
    # a sum as the tables take it: pre[L] - pre[0] of the prefix sums
    total = lambda x: float(np.cumsum(x)[-1]) if len(x) else 0.0  # noqa: E731
    sums = total(static), total(act), total(f + bwd), total(sav), total(r), rate
    return float(_relaxed(*sums, n, budget, checkpoint)), sync.sum(), opt.sum()


def _range_sums(P: _Layers, S: int, ends: tuple) -> tuple[np.ndarray, ...]:
    """The ranges of :func:`_ranges` and, per range (rows of one), its layers' static bytes,
    saved bytes, fwd + bwd, bytes checkpointing frees, recompute, and the least recompute
    seconds per byte freed of its kinds (0 where none frees any): kept on ``P`` for the
    partitions of one cost table."""
    hit = P.range_sums.get((S, ends))
    if hit is None:
        a, b = _ranges(len(P.f), S, ends)
        diff = lambda pre: (pre[b] - pre[a])[None, :]  # noqa: E731
        present = (P.counts[b] - P.counts[a]) > 0
        rate = np.min(np.where(present, P.ratio[P.rep][None, :], np.inf), axis=1)[None, :]
        rate = np.where(np.isfinite(rate), rate, 0.0)
        hit = P.range_sums[S, ends] = (
            a, b, diff(P.pre_static), diff(P.pre_act), diff(P.pre_fb), diff(P.pre_sav),
            diff(P.pre_r), rate,
        )  # fmt: skip
    return hit


@lru_cache(maxsize=256)
def _ranges(L: int, S: int, ends: tuple = ()) -> tuple[np.ndarray, np.ndarray]:
    """(a, b): the ranges [a, b) some stage of S can take on a partition of L layers
    (:func:`_usable`), only from and to the positions ``ends`` where given (the cuts a model
    allows, 0 and L among them), the only ones :func:`_tables` fills (read-only arrays,
    shared)."""
    a, b = np.triu_indices(L + 1, k=1)
    keep = (b - a <= L - S + 1) & _usable(a, b, S, L)
    if ends:
        allowed = np.zeros(L + 1, bool)
        allowed[list(ends)] = True
        keep &= allowed[a] & allowed[b]
    a, b = a[keep], b[keep]
    a.setflags(write=False)
    b.setflags(write=False)
    return a, b


def _usable(a: np.ndarray, b: np.ndarray, S: int, L: int) -> np.ndarray:
    """Whether some stage j of S can hold layers [a, b) on a partition of all L layers: the
    first starts at 0, the last ends at L, and stage j lies in [j, L - (S - 1 - j)]."""
    first = (a == 0) & ((b == L) if S == 1 else True)
    last = (b == L) & (a >= S - 1) & (S > 1)
    middle = (a >= 1) & (b <= L - 1) & (np.maximum(1, b - L + S - 1) <= np.minimum(a, S - 2))
    return first | last | middle
