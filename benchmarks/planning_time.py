"""Planning time at scale: trace time, search time, meshes scored / pruned, and peak RSS.

    python benchmarks/planning_time.py [--cases 70b,175b,405b] [--whole-cut-check]

Each case runs in a fresh process (so peak RSS is its own, and "total" counts importing torch):
examples/gpt.py at the model's shape (built and traced on meta; a GPT block stands in for the
Llama block: same matmul shapes), or for "70b-hf" the real Llama-3-70B transformers model from
examples/hf/llama3-70b.json (importing transformers included), then the full search (pp, dp,
fsdp, cp, ep, tp, schedule, microbatches, checkpointing). "CPU s" is the search's process time,
steadier than wall time on a shared machine. "cut s" is the pipeline cut check the CLI and API
run on a pipeline plan (autopar._cuts, on the folded model; with ``--whole-cut-check`` also on
the whole model, side by side, with the same verdict asserted); "-" for a plan without pp.
Targets (issue 6): 70B on 512 GPUs <= 5 s end to end, 405B on 16k GPUs <= 30 s, RSS <= 2 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CASES = {
    # name: (layers, d_model, heads, vocab, cluster, global batch, seq)
    "70b": (80, 8192, 64, 128256, "64x8xH100", 1024, 4096),
    "175b": (96, 12288, 96, 50257, "128x8xA100-80GB", 1536, 2048),
    "405b": (126, 16384, 128, 128256, "2048x8xH100", 2048, 8192),
    "70b-hf": ("hf:llama3-70b", None, None, None, "64x8xH100", 1024, 4096),
}

CHILD = """
import json, resource, sys, time
sys.path.insert(0, {root!r})
t0 = time.perf_counter()
from autopar.cost_model import parse_cluster
from autopar.model_file import build_on_meta, example_inputs, load_model_file
from autopar.ir.trace import trace
from autopar.api import _trace_batch, _trace_options
from autopar.planner.plan import ModelRef, Training
from autopar.planner.search import search
cluster = parse_cluster({cluster!r})
mf = load_model_file({spec!r})
model = build_on_meta(mf)
args, _ = example_inputs(mf, model, _trace_batch({seq}), {seq})
t1 = time.perf_counter()
graph = trace(model, tuple(args), seq_len={seq}, **_trace_options(cluster, "bf16"))
t2 = time.perf_counter()
stats = {{}}
c2 = time.process_time()
plan = search(graph, cluster, Training(global_batch={gb}, seq_len={seq}, dtype="bf16"),
              model=ModelRef(file=mf.path), stats=stats)
t3 = time.perf_counter()
c3 = time.process_time()
cut = {{}}
if plan.mesh.pp > 1:
    from autopar._cuts import StageCutter
    for fold in (True, False) if {whole!r} else (True,):
        t4 = time.perf_counter()
        why = StageCutter(model, tuple(args), _trace_options(cluster, "bf16")["dtype"],
                          fold=fold).check(list(plan.layers), plan.stages)
        cut["cut_s" if fold else "cut_whole_s"] = time.perf_counter() - t4
        cut["cut_ok" if fold else "cut_whole_ok"] = why is None
print(json.dumps({{**cut, "params_b": graph.num_params / 1e9, "setup_s": t1 - t0, "trace_s": t2 - t1,
                  "search_s": t3 - t2, "search_cpu_s": c3 - c2, "total_s": t3 - t0, **stats, "mesh": plan.mesh.short(),
                  "schedule": plan.schedule.name, "step_s": plan.predicted.step_time_s,
                  "rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}}))
"""


def run(name: str, whole: bool = False) -> dict:
    layers, dim, heads, vocab, cluster, gb, seq = CASES[name]
    env = dict(os.environ)
    if isinstance(layers, str):  # a model spec
        spec = layers
    else:
        spec = str(ROOT / "examples" / "gpt.py")
        env |= {"GPT_LAYERS": str(layers), "GPT_DIM": str(dim), "GPT_HEADS": str(heads),
                "GPT_VOCAB": str(vocab), "GPT_MAX_SEQ": str(seq)}  # fmt: skip
    code = CHILD.format(root=str(ROOT), cluster=cluster, spec=spec, seq=seq, gb=gb,
                       whole=whole)  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=1800)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return {"case": name, "cluster": cluster, **json.loads(proc.stdout.strip().splitlines()[-1])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--whole-cut-check", action="store_true",
                   help="also time the cut check on the whole (unfolded) model")  # fmt: skip
    args = p.parse_args()
    whole = f"{'whole s':>8}" if args.whole_cut_check else ""
    print(f"{'case':<8}{'cluster':<18}{'params':>8}{'trace s':>9}{'search s':>10}{'CPU s':>7}{'total s':>9}"
          f"{'cut s':>7}{whole}{'meshes':>8}{'pruned':>8}{'ILPs':>6}{'RSS GB':>8}  plan")  # fmt: skip
    for name in args.cases.split(","):
        r = run(name, args.whole_cut_check)
        if r.get("cut_ok") is False or r.get("cut_whole_ok", r.get("cut_ok")) != r.get("cut_ok"):
            raise SystemExit(f"{name}: cut check verdicts differ or refuse: {r}")
        cut = f"{r['cut_s']:>7.1f}" if "cut_s" in r else f"{'-':>7}"
        if args.whole_cut_check:
            cut += f"{r['cut_whole_s']:>8.1f}" if "cut_whole_s" in r else f"{'-':>8}"
        print(f"{name:<8}{r['cluster']:<18}{r['params_b']:>7.0f}B{r['trace_s']:>9.1f}"
              f"{r['search_s']:>10.1f}{r['search_cpu_s']:>7.1f}{r['total_s']:>9.1f}{cut}{r['meshes']:>8}{r['pruned']:>8}"
              f"{r['ilp_solves']:>6}{r['rss_gb']:>8.2f}  {r['mesh']} {r['schedule']} "
              f"{r['step_s']:.2f} s/step", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
