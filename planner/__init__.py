"""Planner: the search (intra-layer ILP, mesh enumeration) and the Plan it returns."""

from autopar.planner.plan import Plan, PlanError

__all__ = ["Plan", "PlanError"]
