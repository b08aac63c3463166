"""The actions a user takes on a plan, and the one ``Plan`` type they act on.

There is one plan type, :class:`autopar.planner.plan.Plan`: frozen, validated data with its
JSON (``to_json`` / ``from_json`` / ``load`` / ``save``), its summary (``print(plan)``) and its
explanation (``explain``), all of which the planner owns. What needs the packages above the
planner (codegen writes the program and the report, the session traces the model again) are the
functions below; this module, the home of ``autopar.Plan``, also attaches them to the class as
thin methods (``plan.emit(dir)`` is ``emit(plan, dir)``), so the planner never imports upward
and a plan loaded from JSON has the same methods as a fresh one. Nothing here re-traces a model
that a session given to it holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from autopar.planner.plan import Plan

if TYPE_CHECKING:
    from autopar.planner.explain import WhyNot
    from autopar.session import PlanningSession

__all__ = ["Plan", "apply", "emit", "local_batch", "report", "why_not"]


def why_not(
    plan: Plan, mesh: str | dict[str, int], session: PlanningSession | None = None
) -> WhyNot:
    """Search again with ``mesh`` pinned (``"tp=8,pp=2"``) and compare with ``plan``
    (:func:`autopar.api.why_not`; ``session``: the one holding the plan's graph)."""
    from autopar.api import why_not as _why_not

    return _why_not(plan, mesh, session=session)


def report(
    plan: Plan,
    path: str | Path,
    why_not: str | dict[str, int] | None = None,
    session: PlanningSession | None = None,
) -> Path:
    """Write a self-contained HTML report (figures as inline SVG; needs matplotlib, the ``viz``
    extra) to ``path``; returns its path. ``why_not`` adds that comparison (searched on
    ``session``'s graph where it holds the plan's)."""
    from autopar.api import why_not as _why_not
    from autopar.codegen.report import write_report
    from autopar.planner.explain import explain

    extra = None if why_not is None else _why_not(plan, why_not, session=session)
    return write_report(plan, path, explain(plan), extra)


def apply(plan: Plan, model):
    """Parallelize ``model`` in this process as the emitted ``train.py`` would (TP,
    checkpointing, then DDP/FSDP2), for your own training loop; run under torchrun with the
    plan's world size (a 1-rank plan also runs under plain python). pp = 1 plans only. Returns
    the module to train (DDP wraps it; FSDP2 and TP modify it in place)."""
    from autopar.codegen.apply import apply as _apply

    return _apply(plan, model)


def local_batch(plan: Plan, batch):
    """This rank's share of a global ``(inputs, target)`` batch, as the emitted script slices
    it (a contiguous slice per data-parallel rank; TP peers share one)."""
    from autopar.codegen.apply import local_batch as _local_batch

    return _local_batch(plan, batch)


def emit(plan: Plan, directory: str | Path) -> Path:
    """Write ``train.py``, ``plan.json``, the runtime package and the launchers into
    ``directory``, atomically."""
    from autopar.codegen import write_outputs

    return write_outputs(plan, directory)


def _attach() -> None:
    """The actions as methods of the one Plan class (module docstring)."""
    for action in (why_not, report, apply, local_batch, emit):
        setattr(Plan, action.__name__, action)


_attach()
