"""CP-SAT, reached through its model proto: the few constructs the TP ILP (:mod:`planner.ilp`)
needs, written as ortools' own ``cp_model`` writes them.

ortools' ``cp_model`` module imports pandas at import time (for its Series helpers): 0.42 s of
import time on a 2-core machine, 0.29 s of it pandas (``python -X importtime -c "from ortools.sat.python
import cp_model"``); its C++ core (``cp_model_helper``: the ``CpModelProto`` message and the
solve) is a fraction of that. A plan cached for one node count and re-planned for another solves a
few new ILP keys and paid that import for them. This module builds the proto itself: boolean
variables, exactly-one constraints, linear equalities and a linear objective, each encoded as
``cp_model`` encodes it (terms merged per variable, zero coefficients dropped, variables in
index order; a maximization as the negated minimization with scaling factor -1), so a model
here and the same model written with ``cp_model`` are the same proto and solve alike
(tests/test_sat.py compares them).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["Model", "Result", "solve"]

Terms = Iterable[tuple[int, int]]
"""(variable index, coefficient) pairs of a linear expression."""


def _helper() -> Any:
    """ortools' C++ CP-SAT binding, imported on the first model."""
    from ortools.sat.python import cp_model_helper

    return cp_model_helper


class Model:
    """A CP-SAT model under construction: variables are ints (their index in the proto)."""

    def __init__(self, proto: Any = None) -> None:
        self.proto = _helper().CpModelProto()
        if proto is not None:
            self.proto.copy_from(proto)

    def bool_var(self, name: str) -> int:
        """A new 0/1 variable; its index."""
        var = self.proto.variables.add()
        var.name = name
        var.domain.extend([0, 1])
        return len(self.proto.variables) - 1

    def exactly_one(self, literals: Iterable[int]) -> None:
        self.proto.constraints.add().exactly_one.literals.extend(list(literals))

    def equal(self, terms: Terms, value: int = 0) -> None:
        """sum(coefficient * variable) == value."""
        vars_, coeffs = _canonical(terms)
        linear = self.proto.constraints.add().linear
        linear.vars.extend(vars_)
        linear.coeffs.extend(coeffs)
        linear.domain.extend([value, value])

    def minimize(self, terms: Terms) -> None:
        self._objective(terms, 1)

    def maximize(self, terms: Terms) -> None:
        self._objective(terms, -1)

    def _objective(self, terms: Terms, sign: int) -> None:
        vars_, coeffs = _canonical(terms)
        objective = self.proto.objective
        objective.vars.extend(vars_)
        objective.coeffs.extend([sign * c for c in coeffs])
        objective.scaling_factor = sign

    def clone(self) -> Model:
        return Model(self.proto)


def _canonical(terms: Terms) -> tuple[list[int], list[int]]:
    """Terms merged per variable, zero coefficients dropped, in variable order."""
    merged: dict[int, int] = {}
    for var, coeff in terms:
        merged[var] = merged.get(var, 0) + coeff
    kept = sorted((v, c) for v, c in merged.items() if c != 0)
    return [v for v, _ in kept], [c for _, c in kept]


@dataclass(frozen=True)
class Result:
    """A solve's outcome: ``status`` is ortools' CpSolverStatus name."""

    status: str
    values: tuple[int, ...]
    """per variable index, its value (empty where no solution was found)."""
    objective: float

    @property
    def optimal(self) -> bool:
        return self.status == "OPTIMAL"

    @property
    def solved(self) -> bool:
        """A solution was found (proven optimal or not)."""
        return self.status in ("OPTIMAL", "FEASIBLE")


def solve(model: Model, time_limit_s: float, workers: int = 1) -> Result:
    """One solve of ``model`` with at most ``time_limit_s`` seconds on ``workers`` workers (one:
    deterministic)."""
    cmh = _helper()
    params = cmh.SatParameters()
    params.max_time_in_seconds = time_limit_s
    params.num_workers = workers
    wrapper = cmh.SolveWrapper()
    wrapper.set_parameters(params)
    response = wrapper.solve(model.proto)
    return Result(response.status.name, tuple(response.solution), response.objective_value)
