"""Planning time: `plan` end to end, in CPU seconds beside wall seconds, each beside its limit.

    python benchmarks/planning_time.py [--cases import,70b-hf,405b-hf] [--runs 3]

Each case runs in a fresh Python process, timed from the interpreter's start to the plan in
hand, as the ``plan`` command runs it (``plan_model_file``: load the model file or HF config,
build on meta, trace, search, the pipeline cut decision): importing torch, transformers and
autopar is counted. "CPU s" is the process's own CPU time (user + system), the figure the
limits are on: the wall time of one busy process on an idle machine, and steady on a shared
one, where "wall s" (printed beside it) is not. ``--runs N`` keeps the best of N runs.

Cases and limits (issue 26, item 5; measured on a 2-core machine):

- ``import``: ``import autopar`` <= 1 s (ortools, transformers and the search load when first
  used);
- ``70b-hf``: HF Llama-3-70B (examples/hf/llama3-70b.json) on 64x8xH100, seq 8192, global batch
  1024, <= 5 s;
- ``405b-hf``: Llama 3.1 405B (examples/hf/llama3-405b.json) on 2048x8xH100, seq 8192, global
  batch 16384, <= 10 s;
- ``70b``, ``175b``, ``405b``: examples/gpt.py at those shapes (a GPT block stands in for the
  Llama block: same matmul shapes), no limit; run with ``--cases``.

benchmarks/plan_snapshots.py plans every case of :data:`CASES` too (its ``time-*`` cases).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CASES = {
    # name: (layers or model spec, d_model, heads, vocab, cluster, global batch, seq)
    "70b": (80, 8192, 64, 128256, "64x8xH100", 1024, 4096),
    "175b": (96, 12288, 96, 50257, "128x8xA100-80GB", 1536, 2048),
    "405b": (126, 16384, 128, 128256, "2048x8xH100", 2048, 8192),
    "70b-hf": ("hf:llama3-70b", None, None, None, "64x8xH100", 1024, 8192),
    "405b-hf": ("hf:llama3-405b", None, None, None, "2048x8xH100", 16384, 8192),
}

LIMITS_S = {"import": 1.0, "70b-hf": 5.0, "405b-hf": 10.0}
"""CPU seconds per case (issue 26, item 5)."""

DEFAULT = ("import", "70b-hf", "405b-hf")

# CPU time since the interpreter started (user + system), and peak RSS, as one JSON line
_USAGE = """
import json, resource
u = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"cpu_s": u.ru_utime + u.ru_stime, "rss_gb": u.ru_maxrss / 2**20, **out}))
"""

IMPORT = "out = {}\nimport autopar\n" + _USAGE

PLAN = """
import sys
sys.path.insert(0, {root!r})
from autopar.api import plan_model_file
from autopar.model_file import load_model_file
plan = plan_model_file(load_model_file({spec!r}), {cluster!r}, global_batch={gb},
                       seq_len={seq}, dtype="bf16")
p = plan.predicted
out = {{"mesh": plan.mesh.short(), "schedule": plan.schedule.name,
        "microbatches": plan.schedule.num_microbatches, "step_s": p.step_time_s,
        "alternatives": len(plan.alternatives)}}
"""


def run(name: str) -> dict:
    """One case in a fresh process: its CPU seconds, wall seconds, peak RSS and plan."""
    env = dict(os.environ)
    if name == "import":
        code = IMPORT
    else:
        layers, dim, heads, vocab, cluster, gb, seq = CASES[name]
        spec = layers if isinstance(layers, str) else str(ROOT / "examples" / "gpt.py")
        if not isinstance(layers, str):
            env |= {"GPT_LAYERS": str(layers), "GPT_DIM": str(dim), "GPT_HEADS": str(heads),
                    "GPT_VOCAB": str(vocab), "GPT_MAX_SEQ": str(seq)}  # fmt: skip
        code = PLAN.format(root=str(ROOT), spec=spec, cluster=cluster, gb=gb, seq=seq) + _USAGE
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=1800)  # fmt: skip
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: {proc.stderr[-3000:]}")
    return {"case": name, "wall_s": wall, **json.loads(proc.stdout.strip().splitlines()[-1])}


def best_of(name: str, runs: int) -> dict:
    """The run with the least CPU time of ``runs``."""
    return min((run(name) for _ in range(runs)), key=lambda r: r["cpu_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(DEFAULT), help=f"of import,{','.join(CASES)}")
    p.add_argument("--runs", type=int, default=1, help="runs per case, the best kept")
    args = p.parse_args()
    print(
        f"{'case':<9}{'cluster':<14}{'CPU s':>7}{'limit':>7}{'':>5}{'wall s':>8}{'RSS GB':>8}  plan"
    )
    over = []
    for name in args.cases.split(","):
        r = best_of(name, args.runs)
        limit = LIMITS_S.get(name)
        verdict = "-" if limit is None else "ok" if r["cpu_s"] <= limit else "OVER"
        if verdict == "OVER":
            over.append(name)
        cluster = CASES[name][4] if name in CASES else ""
        plan = (
            f"{r['mesh']} {r['schedule']} x{r['microbatches']} {r['step_s']:.2f} s/step"
            if "mesh" in r
            else ""
        )
        shown = f"<= {limit:g}" if limit is not None else "-"
        print(f"{name:<9}{cluster:<14}{r['cpu_s']:>7.2f}{shown:>7}{verdict:>5}{r['wall_s']:>8.2f}"
              f"{r['rss_gb']:>8.2f}  {plan}", flush=True)  # fmt: skip
    if over:
        print(f"over the limit: {', '.join(over)}")


if __name__ == "__main__":
    main()
