"""Pipeline cuts that run: the planner's stages, checked on the model the way the script cuts it.

The emitted script cuts the model into its stages with the runtime's ``layer_program`` ->
``cut_stages`` (torch.export of the forward, one graph of layer calls, a slice per stage; see
``codegen/runtime/autopar_runtime/stages.py``). The planner sees only costs, so it could choose a
cut the script cannot make (a tuple or a string crossing the boundary, a forward that reads a
layer's weight at the root, a model export cannot take apart). :func:`settle` closes that gap at plan
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

Step 2 runs first on the model with its runs of identical blocks folded as the trace folds them
(:mod:`ir._fold`: a ``ModuleList`` of 80 identical blocks holds its first two while the check
runs), cut at the images of the plan's boundaries: a boundary between blocks i and i + 1 of the
run is the boundary between its first two, the boundaries before the run's first block and after
its last stay where they are. A 70B GPT's check then exports and runs 2 blocks, not 80. The folded
model stands for the whole one under the trace's own assumption (every block of the run does to
its input what the first two do); only a pass is taken from it: where the folded check refuses,
or the folded model does not run, the whole model is checked as before, so every refusal, and
the boundaries of step 3, come from the whole model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from autopar._plan import Plan
from autopar.codegen.apply import runtime
from autopar.ir._fold import Fold, find_folds, folded
from autopar.ir.trace import at_dtype
from autopar.planner.stages import Cuts


class StageCutter:
    """The model and its example inputs, exported at most once for the cut checks, at the
    compute ``dtype`` the planner traced at (kernels such as ``grouped_mm`` exist in bf16 only).
    ``fold``: try a plan's stages on the folded model first (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        example_inputs: tuple,
        dtype: torch.dtype | None = None,
        fold: bool = True,
    ) -> None:
        self.model = model
        self.example_inputs = tuple(example_inputs)
        self.dtype = dtype
        self.fold = fold
        self._program = None
        self._error: str | None = None
        self._folds: list[Fold] | None = None
        self._folded: dict[tuple[str, ...], object] = {}  # folded layers -> program (or None)

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
        if self.fold and self._folded_check(layers, stages):
            return None
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

    def _folded_check(self, layers: list[str], stages: list[list[str]]) -> bool:
        """Whether the folded model cuts at the images of ``stages``' boundaries (False: it
        does not, or there is no fold, or the folded model does not run: check the whole)."""
        if self._folds is None:
            self._folds = find_folds(self.model)
        images = folded_stages(layers, stages, self._folds)
        if images is None:
            return False
        few, few_stages = images
        rt = runtime()
        try:
            with folded(self._folds):
                if tuple(few) not in self._folded:
                    self._folded[tuple(few)] = None
                    with at_dtype(self.model, self.example_inputs, self.dtype) as inputs:
                        self._folded[tuple(few)] = rt.layer_program(self.model, [few], inputs)
                program = self._folded[tuple(few)]
                if program is None:
                    return False
                with at_dtype(self.model, self.example_inputs, self.dtype) as inputs:
                    rt.cut_stages(program, self.model, few_stages, inputs)
        except Exception:  # noqa: BLE001 - a refusal, or a forward that needs every block:
            return False  # the whole model decides
        return True


def folded_stages(
    layers: list[str], stages: list[list[str]], folds: list[Fold]
) -> tuple[list[str], list[list[str]]] | None:
    """The layers of the model with ``folds`` folded (children after each run's second
    dropped) and ``stages`` cut at the images of their boundaries (a layer of child i > start
    of a run stands as the same layer of child start + 1); None where nothing folds or a
    boundary has no image."""

    def child(fqn: str) -> tuple[Fold, int, str] | None:
        for f in folds:
            head, _, rest = fqn.removeprefix(f.fqn + ".").partition(".")
            if fqn.startswith(f.fqn + ".") and head.isdigit() and int(head) >= f.start:
                return f, int(head), rest
        return None

    def image(fqn: str) -> str:
        found = child(fqn)
        if found is None or found[1] <= found[0].start:
            return fqn
        f, _, rest = found
        return f"{f.fqn}.{f.start + 1}" + (f".{rest}" if rest else "")

    few = [x for x in layers if (c := child(x)) is None or c[1] <= c[0].start + 1]
    if len(few) == len(layers) or [x for stage in stages for x in stage] != layers:
        return None
    position = {x: k for k, x in enumerate(few)}
    cuts = set()
    for stage in stages[1:]:
        if not stage or image(stage[0]) not in position:
            return None
        cuts.add(position[image(stage[0])])
    if 0 in cuts:
        return None
    bounds = [0, *sorted(cuts), len(few)]
    return few, [few[a:b] for a, b in zip(bounds, bounds[1:])]


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
