"""Pipeline cuts that run: the planner's stages, checked on the model the way the script cuts it.

The emitted script cuts the model into its stages with the runtime's ``layer_program`` ->
``cut_stages`` (torch.export of the forward, one graph of layer calls, a slice per stage; see
``codegen/runtime/autopar_runtime.py``). The planner sees only costs, so it could choose a cut the
script cannot make (a tuple or a string crossing the boundary, a forward that reads a layer's
weight at the root, a model export cannot take apart). :func:`settle` closes that gap at plan
time, on the meta model the planner traced, with the same functions:

1. a plan without pipeline parallelism needs nothing;
2. otherwise the model is exported once and cut into the plan's stages for real
   (``cut_stages``: the stages run in a chain on meta and must compute the forward's shapes);
   the plan is kept when that passes;
3. otherwise every layer boundary is tried as a two-stage cut (``stage_of_nodes``: graph work,
   no forward): the boundaries that cut are :class:`planner.stages.Cuts`, and the search runs
   again, cutting only there; the new plan is checked the same way, and if even that fails,
   pipeline parallelism is ruled out with the reason (a pinned ``pp`` then fails with it, in
   one line).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from autopar._plan import Plan
from autopar.codegen.apply import runtime
from autopar.ir.trace import at_dtype
from autopar.planner.stages import Cuts


class StageCutter:
    """The model and its example inputs, exported at most once for the cut checks, at the
    compute ``dtype`` the planner traced at (kernels such as ``grouped_mm`` exist in bf16 only)."""

    def __init__(
        self, model: nn.Module, example_inputs: tuple, dtype: torch.dtype | None = None
    ) -> None:
        self.model = model
        self.example_inputs = tuple(example_inputs)
        self.dtype = dtype
        self._program = None
        self._error: str | None = None

    def _exported(self, layers: list[str]):
        rt = runtime()
        if self._program is None and self._error is None:
            try:
                with at_dtype(self.model, self.example_inputs, self.dtype) as inputs:
                    self._program = rt.layer_program(self.model, [layers], inputs)
            except rt.CutError as e:
                self._error = str(e)
        return self._program

    def cuts(self, layers: list[str]) -> Cuts:
        """Which boundaries between ``layers`` (the plan's ordered layers) cut."""
        rt = runtime()
        program = self._exported(layers)
        if program is None:
            return Cuts(allowed=frozenset(), refused=self._error)
        allowed, why = set(), []
        for b in range(1, len(layers)):
            try:
                rt.stage_of_nodes(program, self.model, [layers[:b], layers[b:]])
            except rt.CutError as e:
                why.append((b, str(e)))
            else:
                allowed.add(b)
        return Cuts(allowed=frozenset(allowed), why=tuple(why))

    def check(self, layers: list[str], stages: list[list[str]]) -> str | None:
        """None where the script can cut the model into ``stages``, else why not."""
        rt = runtime()
        program = self._exported(layers)
        if program is None:
            return self._error
        try:
            with at_dtype(self.model, self.example_inputs, self.dtype) as inputs:
                rt.cut_stages(program, self.model, stages, inputs)
        except rt.CutError as e:
            return str(e)
        return None


def settle(plan: Plan, cutter: StageCutter, search: Callable[[Cuts], Plan]) -> Plan:
    """``plan`` where the script can cut it into its stages, else the plan that ``search``
    finds with the cuts the model allows (see the module docstring)."""
    if plan.mesh.pp == 1:
        return plan
    layers = list(plan.layers)
    if cutter.check(layers, plan.stages) is None:
        return plan
    plan = search(cutter.cuts(layers))
    if plan.mesh.pp == 1:
        return plan
    why = cutter.check(layers, plan.stages)
    if why is None:
        return plan
    return search(Cuts(allowed=frozenset(), refused=why))
