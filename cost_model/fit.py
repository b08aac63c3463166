"""Least-squares fits of microbenchmark samples (numpy), pure functions of the samples.

Every model here is linear in its parameters, ``t = X @ theta``, and the samples span orders of
magnitude in time (1 KB and 256 MB collectives; 32^3 and 4096^3 matmuls), so the fit minimises
the *relative* residual: each row is divided by its measured time (weighted least squares with
weights 1/t), else the large samples alone would set every parameter and the intercept (the
launch overhead / latency) would come out as noise, often negative. Parameters are constrained to
be >= 0: where the unconstrained solution has a negative one, that parameter is fixed at 0 and
the rest refitted (an active-set step; with two parameters that is exact).

The residual reported is the root mean square of the relative errors ``(predicted - t) / t``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations

import numpy as np


@dataclass(frozen=True)
class LinearFit:
    """``t = intercept + x / rate`` fitted to (x, t) samples."""

    intercept: float
    """seconds at x = 0: launch overhead or latency (alpha)."""
    rate: float
    """units of x per second: FLOP/s or bytes/s (beta); inf when x explains nothing."""
    rel_rms: float
    """root mean square relative residual."""
    max_rel: float
    """largest relative residual (absolute value)."""
    n: int

    def predict(self, x: float) -> float:
        return self.intercept + (x / self.rate if np.isfinite(self.rate) else 0.0)


def nonneg_lstsq(
    columns: Sequence[Sequence[float]], t: Sequence[float]
) -> tuple[np.ndarray, np.ndarray]:
    """theta >= 0 minimising sum(((X theta - t) / t)^2); returns (theta, relative residuals).

    Exact for few parameters: tries every subset of free parameters (the others fixed at 0) and
    keeps the best non-negative solution.
    """
    X = np.asarray(columns, dtype=float).T
    y = np.asarray(t, dtype=float)
    if X.ndim != 2 or X.shape[0] != y.shape[0] or X.shape[0] == 0:
        raise ValueError(f"fit needs samples: got X {X.shape} and t {y.shape}")
    if np.any(y <= 0) or not np.all(np.isfinite(X)) or not np.all(np.isfinite(y)):
        raise ValueError("fit needs finite samples with positive times")
    w = 1.0 / y
    Xw, yw = X * w[:, None], y * w
    k = X.shape[1]
    best: tuple[float, np.ndarray] | None = None
    for size in range(k, 0, -1):
        for free in combinations(range(k), size):
            sol, *_ = np.linalg.lstsq(Xw[:, free], yw, rcond=None)
            if np.any(sol < 0):
                continue
            theta = np.zeros(k)
            theta[list(free)] = sol
            err = float(np.sum((Xw @ theta - yw) ** 2))
            if best is None or err < best[0] - 1e-15:
                best = (err, theta)
        if best is not None and size == k:
            break  # the unconstrained solution is non-negative
    if best is None:
        theta = np.zeros(k)
    else:
        theta = best[1]
    return theta, (X @ theta - y) / y


def fit_linear(x: Sequence[float], t: Sequence[float]) -> LinearFit:
    """``t = intercept + x / rate`` (compute: x = FLOPs; memory: bytes; collective: bytes)."""
    x = list(map(float, x))
    theta, rel = nonneg_lstsq([[1.0] * len(x), x], t)
    intercept, slope = float(theta[0]), float(theta[1])
    return LinearFit(
        intercept=intercept,
        rate=1.0 / slope if slope > 0 else float("inf"),
        rel_rms=float(np.sqrt(np.mean(rel**2))),
        max_rel=float(np.max(np.abs(rel))),
        n=len(x),
    )


def fit_slope(x: Sequence[float], t: Sequence[float]) -> tuple[float, float, float]:
    """``t = c + s * x`` by ordinary least squares (no weights, no sign constraint): the
    per-unit cost s from samples that differ in x (e.g. per-op overhead from model depths).
    Returns (c, s, relative rms residual)."""
    X = np.column_stack([np.ones(len(x)), np.asarray(x, dtype=float)])
    y = np.asarray(t, dtype=float)
    (c, s), *_ = np.linalg.lstsq(X, y, rcond=None)
    rel = (X @ np.array([c, s]) - y) / y
    return float(c), float(s), float(np.sqrt(np.mean(rel**2)))
