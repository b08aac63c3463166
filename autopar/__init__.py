"""autopar: plan how to parallelize a PyTorch training run, and emit the program that runs it.

``from autopar import auto_parallelize, Plan``; the ``plan`` command (or ``python -m autopar``)
does the same from a model file. The packages below follow the pipeline, imports pointing one
way: ``autopar.ir`` (trace to a graph on meta) <- ``autopar.cost_model`` (time and memory) <-
``autopar.planner`` (the search, the Plan data) <- ``autopar.codegen`` (the emitted program) <-
``autopar`` (this API and the CLI).

The names below load on first use (module ``__getattr__``): ``import autopar`` itself imports
nothing heavy (no torch, ortools, transformers, codegen or the search), so ``import
autopar.ir.graph`` or ``python -m autopar --help`` pays only for what it reads.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and readers; at run time see __getattr__
    from autopar._plan import Plan
    from autopar.api import auto_parallelize, plan_model_file, why_not
    from autopar.cache import PlanCache
    from autopar.session import PlanningSession

__all__ = ["Plan", "PlanCache", "PlanningSession", "auto_parallelize", "plan_model_file", "why_not"]

_HOME = {
    "Plan": "autopar._plan",  # autopar.planner.plan.Plan, with its actions attached
    "PlanCache": "autopar.cache",
    "PlanningSession": "autopar.session",
    "auto_parallelize": "autopar.api",
    "plan_model_file": "autopar.api",
    "why_not": "autopar.api",
}


def __getattr__(name: str) -> Any:
    """The public names, imported from their module the first time one is read."""
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'autopar' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
