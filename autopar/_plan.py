"""The user's Plan: the planner's frozen plan data plus the actions a user takes on it.

``autopar.planner.plan.Plan`` is data and JSON only (the planner imports no codegen); this
subclass adds explaining, reporting, emitting and applying, which need the packages above it.
"""

from __future__ import annotations

from pathlib import Path

from autopar.planner import plan as _core


class Plan(_core.Plan):
    """A parallelization plan. JSON keys are the contract in ARCHITECTURE.md."""

    @classmethod
    def of(cls, plan: _core.Plan) -> Plan:
        """The same plan as this class (no re-validation: ``plan`` is already valid)."""
        if isinstance(plan, cls):
            return plan
        return cls.model_construct(
            **{name: getattr(plan, name) for name in type(plan).model_fields}
        )

    def explain(self) -> str:
        """The step-time and memory breakdowns, and the alternatives with why each lost
        (:func:`autopar.planner.explain.explain` returns the same as data)."""
        from autopar.planner.explain import explain

        return explain(self).text

    def why_not(self, mesh: str | dict[str, int]) -> str:
        """Search again with ``mesh`` pinned (``"tp=8,pp=2"``) and compare with this plan
        (:func:`autopar.api.why_not` returns the same as data)."""
        from autopar.api import why_not

        return why_not(self, mesh).text

    def report(self, path: str | Path, why_not: str | dict[str, int] | None = None) -> Path:
        """Write a self-contained HTML report (figures as inline SVG; needs matplotlib, the
        ``viz`` extra) to ``path``; returns its path."""
        from autopar.api import why_not as _why_not
        from autopar.codegen.report import write_report
        from autopar.planner.explain import explain

        extra = None if why_not is None else _why_not(self, why_not)
        return write_report(self, path, explain(self), extra)

    def apply(self, model):
        """Parallelize ``model`` in this process as the emitted ``train.py`` would (TP,
        checkpointing, then DDP/FSDP2), for your own training loop; run under torchrun with
        this plan's world size (a 1-rank plan also runs under plain python). pp = 1 plans only.
        Returns the module to train (DDP wraps it; FSDP2 and TP modify it in place)."""
        from autopar.codegen.apply import apply

        return apply(self, model)

    def local_batch(self, batch):
        """This rank's share of a global ``(inputs, target)`` batch, as the emitted script
        slices it (a contiguous slice per data-parallel rank; TP peers share one)."""
        from autopar.codegen.apply import local_batch

        return local_batch(self, batch)

    def save(self, directory: str | Path) -> Path:
        """Write ``plan.json`` into ``directory`` (created if missing); returns its path."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        out = path / "plan.json"
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(self.to_json() + "\n")  # the bytes emit writes
        tmp.replace(out)
        return out

    def emit(self, directory: str | Path) -> Path:
        """Write ``train.py``, ``plan.json`` and ``launch.sh`` into ``directory``, atomically."""
        from autopar.codegen import write_outputs

        return write_outputs(self, directory)
