"""autopar: plan how to parallelize a PyTorch training run, and emit the program that runs it.

``from autopar import auto_parallelize, Plan``; the ``plan`` command (or ``python -m autopar``)
does the same from a model file. The packages below follow the pipeline, imports pointing one
way: ``autopar.ir`` (trace to a graph on meta) <- ``autopar.cost_model`` (time and memory) <-
``autopar.planner`` (the search, the Plan data) <- ``autopar.codegen`` (the emitted program) <-
``autopar`` (this API and the CLI).
"""

from autopar._plan import Plan
from autopar.api import PlanningSession, auto_parallelize, plan_model_file, why_not

__all__ = ["Plan", "PlanningSession", "auto_parallelize", "plan_model_file", "why_not"]
