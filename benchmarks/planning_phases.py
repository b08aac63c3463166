"""Where one plan's CPU time goes, phase by phase (issue 26 item 5's figures).

    python benchmarks/planning_phases.py [hf:llama3-70b] [64x8xH100] [1024] [8192]

Plans the model file (or HF config) as ``plan`` does, in this process, and prints the process's
CPU seconds (``time.process_time``) at each phase's end: importing torch, importing the API,
loading the model file (an HF config imports transformers' model classes), building on meta and
tracing (to the first mesh scored), and the search (to the plan in hand). Run on an idle machine;
benchmarks/planning_time.py gives the end-to-end figure the limits are on.
"""

from __future__ import annotations

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
    seen: set[str] = set()

    def progress(text: str) -> None:
        if text.startswith("scoring mesh") and "scoring" not in seen:
            seen.add("scoring")
            mark("build on meta + trace (first mesh scored)")

    plan = api.plan_model_file(
        mf, cluster, global_batch=int(batch), seq_len=int(seq), dtype="bf16", progress=progress
    )
    mark(f"search done: {plan.mesh.short()}")


if __name__ == "__main__":
    main()
