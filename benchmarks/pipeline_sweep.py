"""GPT-3 175B on 128x8xA100-80GB (seq 2048, global batch 1536, bf16): the free plan against every
plan forced to a (tp, pp) pair, as a table. The free plan must be at least as fast as each.

    python benchmarks/pipeline_sweep.py [--tp 1,2,4,8] [--pp 1,2,4,8,16,32]

The model is examples/gpt.py at GPT-3's shape (96 layers, d_model 12288, 96 heads, vocab 50257),
built and traced on meta: no weights are allocated.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GPT3 = {
    "GPT_LAYERS": "96",
    "GPT_DIM": "12288",
    "GPT_HEADS": "96",
    "GPT_VOCAB": "50257",
    "GPT_MAX_SEQ": "2048",
}


def setup(cluster_spec: str = "128x8xA100-80GB", global_batch: int = 1536, seq_len: int = 2048):
    """Trace GPT-3 once; return what search() needs."""
    from autopar.cost_model import parse_cluster
    from autopar.ir.trace import trace
    from autopar.planner.plan import ModelRef, Training

    from autopar.model_file import build_on_meta, example_inputs, load_model_file
    from autopar.session import trace_batch, trace_options

    cluster = parse_cluster(cluster_spec)
    saved = {k: os.environ.get(k) for k in GPT3}
    os.environ.update(GPT3)  # the example reads its sizes at import
    try:
        mf = load_model_file(str(ROOT / "examples" / "gpt.py"))
        model = build_on_meta(mf)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    args, _ = example_inputs(mf, model, trace_batch(seq_len), seq_len)
    graph = trace(model, tuple(args), seq_len=seq_len, **trace_options(cluster, "bf16"))
    training = Training(global_batch=global_batch, seq_len=seq_len, dtype="bf16")
    return graph, cluster, training, ModelRef(file=mf.path)


def sweep(graph, cluster, training, model, tps, pps):
    """The free plan, and per (tp, pp) the best plan with those two degrees pinned (or why none)."""
    from autopar.planner.search import PlanningError, search

    free = search(graph, cluster, training, model=model)
    rows = []
    for tp in tps:
        for pp in pps:
            try:
                plan = search(graph, cluster, training, model=model, pins={"tp": tp, "pp": pp})
                rows.append((tp, pp, plan, None))
            except PlanningError as e:
                rows.append((tp, pp, None, str(e)))
    return free, rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", default="1,2,4,8")
    p.add_argument("--pp", default="1,2,4,8,16,32")
    args = p.parse_args()
    start = time.perf_counter()
    graph, cluster, training, model = setup()
    traced = time.perf_counter() - start
    free, rows = sweep(
        graph, cluster, training, model,
        [int(x) for x in args.tp.split(",")], [int(x) for x in args.pp.split(",")],
    )  # fmt: skip
    print(f"GPT-3 175B ({graph.num_params / 1e9:.1f} B params) on {cluster.spec}, trace "
          f"{traced:.1f} s, sweep {time.perf_counter() - start - traced:.1f} s")  # fmt: skip
    print(f"{'tp':>3} {'pp':>3}  {'mesh':<28} {'schedule':<22} {'step s':>8} {'GB/GPU':>7}  note")
    for tp, pp, plan, err in rows:
        if plan is None:
            print(f"{tp:>3} {pp:>3}  {'-':<28} {'-':<22} {'-':>8} {'-':>7}  {err[:90]}")
            continue
        s = plan.schedule
        sched = f"{s.name} m={s.num_microbatches} v={s.stages_per_rank}"
        print(f"{tp:>3} {pp:>3}  {plan.mesh.short():<28} {sched:<22} "
              f"{plan.predicted.step_time_s:>8.3f} {plan.predicted.peak_memory_bytes / 1e9:>7.1f}")  # fmt: skip
    s = free.schedule
    print(f"free plan: {free.mesh.short()}, {s.name} m={s.num_microbatches} "
          f"v={s.stages_per_rank}, {free.predicted.step_time_s:.3f} s, "
          f"{free.predicted.peak_memory_bytes / 1e9:.1f} GB/GPU, MFU {free.predicted.mfu:.1%}")  # fmt: skip
    forced = [plan.predicted.step_time_s for _, _, plan, _ in rows if plan is not None]
    ok = all(free.predicted.step_time_s <= t * (1 + 1e-9) for t in forced)
    print(f"free plan at least as fast as every forced plan: {ok}")


if __name__ == "__main__":
    main()
