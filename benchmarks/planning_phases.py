"""Where one plan's CPU time goes, phase by phase (issue 26 item 5's figures).

    python benchmarks/planning_phases.py [hf:llama3-70b] [64x8xH100] [1024] [8192]

Plans the model file (or HF config) as ``plan`` does, in this process, and prints the process's
CPU seconds (``time.process_time``) at each phase's end: importing torch, importing the API,
loading the model file (an HF config imports transformers' model classes), building on meta and
tracing, the search's space, its first pass (each mesh's floor: the ILP at its per-replica
batch; ortools' C++ binding loaded at the first solve), and the rest of the search (to the plan
in hand). Full collections are deferred as the ``plan`` command defers them
(``autopar.collect``). Run on an idle machine; benchmarks/planning_time.py gives the end-to-end
figure the limits are on.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    defaults = ["hf:llama3-70b", "64x8xH100", "1024", "8192"]
    spec, cluster, batch, seq = [*sys.argv[1:5], *defaults[len(sys.argv[1:5]) :]]

    def mark(what: str) -> None:
        print(f"{time.process_time():6.2f} s CPU  {what}", flush=True)

    import torch  # noqa: F401

    mark("import torch")
    import autopar.api as api
    from autopar.model_file import load_model_file

    mark("import autopar.api")
    mf = load_model_file(spec)
    mark("load_model_file")
    # the phases' ends, marked by wrapping the functions that end them (no progress line tells
    # them apart: the search's first pass prints nothing)
    import autopar.planner.search as search

    from autopar.session import PlanningSession

    def after(owner, name: str, what: str) -> None:
        real = getattr(owner, name)

        def wrapped(*args, **kwargs):
            out = real(*args, **kwargs)
            mark(what)
            return out

        setattr(owner, name, wrapped)

    after(PlanningSession, "front", "build on meta + trace (the front)")
    after(search, "make_space", "the search's space (the ILP's collapsed graph, layer groups)")
    real_scored = search._scored

    def scored(meshes, evaluate, progress=None, global_batch=0):
        first = evaluate  # the first pass is the one with bound -inf: mark where it ends

        def marked(mesh, bound):
            if bound != -math.inf and not marked.second:
                marked.second = True
                mark(f"the first pass: each of {len(meshes)} meshes' floor")
            return first(mesh, bound)

        marked.second = False
        return real_scored(meshes, marked, progress, global_batch)

    search._scored = scored
    plan = api.plan_model_file(mf, cluster, global_batch=int(batch), seq_len=int(seq), dtype="bf16")
    mark(f"the search done (meshes scored, the plan built): {plan.mesh.short()}")


if __name__ == "__main__":
    from autopar.collect import full_collections_deferred

    with full_collections_deferred():  # as the plan command runs, from torch's import on
        main()
