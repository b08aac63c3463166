"""The reference transformer block at several widths and batches: measured against a profile.

    python benchmarks/block_widths.py [--profile P.json] [--widths 32,64,128,256]
        [--batches 1,4] [--reps 30] [--procs 2] [--one-width-out P1.json]

Without ``--profile`` it makes a quick profile of cpu:2 first (``plan profile --quick``). Then
``--procs`` processes at once (default 2, one thread each: the ranks of a cpu:2 run, every core
busy, as the profile times its block) each time the forward + backward of
``cost_model.profile_bench.reference_block`` (the profile's own block, 64-token samples, 4
heads) at each width and batch and at depths 1 and 3, then examples/gpt.py (benchmarks/
calibrate.py's model) at batches 1, 2, 4 and 8 with its cross-entropy; the slowest process's
median is printed against two predictions:

- ``profile``: the profile's device as fitted (``compute_scale``, ``op_overhead_s`` and
  ``op_row_s``, from the block at two widths and two batches);
- ``one width``: ``compute_scale`` refitted from the profile's block samples at its main width
  alone, the tiny MLP's per-op cost kept (how profiles were fitted before the second width).

``--one-width-out P1.json`` also writes the profile refitted as ``one width`` (its block samples
at the main width and batch alone: how profiles were fitted before the other two were timed),
to compare the two fits on the same runs: ``python benchmarks/calibrate.py --profile P.json
--also-profile P1.json``.

The roofline is ``cost_model.estimate.graph_time_s`` at compute_scale 1 and no per-op cost; ops
are 3 per compute node and rows ``estimate.op_rows`` per op, as the planner counts them. What
no layer pays (the loss's own ops, the backward's start) is in the measured times: the model's
per-step fixed cost.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _timed(step, reps: int) -> float:
    for _ in range(3):
        step()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _features(model, x, device) -> tuple[float, int, float]:
    """(roofline seconds at compute_scale 1 and no per-op cost, the planner's ops, their rows)."""
    from autopar.cost_model.estimate import graph_time_s, op_rows
    from autopar.cost_model.profile_data import PLANNER_OPS_PER_NODE
    from autopar.ir.trace import trace

    graph = trace(model, (x,), saved_for="cpu")
    nodes = [n for n in graph.nodes if n.kind == "compute" and n.out is not None]
    unit = device.model_copy(update={"compute_scale": 1.0, "op_overhead_s": 0.0, "op_row_s": 0.0})
    rows = PLANNER_OPS_PER_NODE * sum(op_rows(graph, n) for n in nodes)
    return graph_time_s(graph, unit, "fp32"), PLANNER_OPS_PER_NODE * len(nodes), rows


HEADS, SEQ = 4, 64


def _cases(widths: list[int], batches: list[int]) -> list[tuple]:
    """(name, kind, depth, width, batch) of every timed model, in order."""
    cases = [(f"block w{w} b{b} depth {d}", "block", d, w, b)
             for w in widths for b in batches for d in (1, 3)]  # fmt: skip
    return cases + [(f"examples/gpt.py b{b}", "gpt", 0, 0, b) for b in (1, 2, 4, 8)]


def _gpt():
    spec = importlib.util.spec_from_file_location("bench_gpt", ROOT / "examples" / "gpt.py")
    gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt)
    return gpt


def _build(kind: str, depth: int, width: int, batch: int):
    """(model, input, loss of the output): built on the current default device."""
    import torch
    import torch.nn.functional as F
    from autopar.cost_model.profile_bench import reference_block

    if kind == "block":
        return (reference_block(depth, width, HEADS), torch.randn(batch, SEQ, width),
                lambda out: out.float().square().mean())  # fmt: skip
    gpt = _gpt()
    (x,), y = gpt.make_batch(batch, SEQ)
    return gpt.build_model(), x, lambda out: F.cross_entropy(out.flatten(0, 1), y.flatten())


def _worker(cases: list[tuple], reps: int) -> list[float]:
    """The median forward + backward of every case, in this process (one thread)."""
    import torch

    torch.set_num_threads(1)
    out = []
    for _, kind, depth, width, batch in cases:
        torch.manual_seed(0)
        model, x, loss = _build(kind, depth, width, batch)

        def step(model=model, x=x, loss=loss) -> None:
            loss(model(x)).backward()
            for q in model.parameters():
                q.grad = None

        out.append(_timed(step, reps))
    return out


def _one_width(profile, samples: list):
    """``profile`` refitted from ``samples`` (its block at the main width and batch alone), as
    ``plan profile`` fits: the per-op cost fitted before the block's is kept, no per-row cost."""
    from autopar.cost_model import parse_cluster
    from autopar.cost_model.profile_fit import fit_samples

    cluster = parse_cluster(f"cpu:{profile.world_size}")
    fits, device, link = fit_samples(samples, cluster.device, cluster.intra_node,
                                     world=profile.world_size)  # fmt: skip
    return profile.model_copy(update={"device": device, "intra_node": link, "inter_node": link,
                                      "fits": fits, "samples": samples})  # fmt: skip


def _write_one_width(refitted, out: Path) -> None:
    """``refitted`` (:func:`_one_width`) written to ``out``, a new file (one there already is
    never replaced)."""
    text = refitted.model_dump_json(indent=1)
    try:
        with out.open("x", encoding="utf-8") as f:
            f.write(text)
    except FileExistsError:
        raise SystemExit(f"--one-width-out {out}: exists; name a new file") from None
    print(f"wrote {out}", file=sys.stderr)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default=None, help="a profile.json (default: profile --quick)")
    p.add_argument("--widths", default="32,64,128,256")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--procs", type=int, default=2, help="processes timing at once")
    p.add_argument("--one-width-out", default=None, metavar="P1",
                   help="write the profile refitted from its block at one width here")  # fmt: skip
    args = p.parse_args()
    if args.one_width_out and Path(args.one_width_out).exists():  # before the minutes of work
        p.error(f"--one-width-out {args.one_width_out}: exists; name a new file")
    cases = _cases([int(w) for w in args.widths.split(",")],
                   [int(b) for b in args.batches.split(",")])  # fmt: skip

    import multiprocessing

    import torch
    from autopar.cost_model import apply_profile, load_profile, parse_cluster
    from autopar.cost_model.profile import run_profile
    from autopar.cost_model.profile_bench import block_shape

    if args.profile:
        profile = load_profile(args.profile)
    else:
        print("profiling cpu:2 (--quick) ...", file=sys.stderr, flush=True)
        profile = run_profile("cpu:2", quick=True)
    device = apply_profile(parse_cluster("cpu:2"), profile).device
    dim, _, batch = block_shape(False)[:3]
    at_main = [s for s in profile.samples
               if not (s.op == "block" and (s.shape[1], s.shape[3]) != (dim, batch))]  # fmt: skip
    one = _one_width(profile, at_main)
    old_scale, mlp_op = one.device.compute_scale, one.device.op_overhead_s
    if args.one_width_out:
        _write_one_width(one, Path(args.one_width_out))

    with multiprocessing.get_context("spawn").Pool(args.procs) as pool:
        runs = pool.starmap(_worker, [(cases, args.reps)] * args.procs)
    measured = [max(times) for times in zip(*runs, strict=True)]

    print(f"profile: compute_scale {device.compute_scale:.3f}, op_overhead_s "
          f"{device.op_overhead_s * 1e6:.2f} us, op_row_s {device.op_row_s * 1e9:.1f} ns; one "
          f"width: compute_scale {old_scale:.3f}, the MLP's op {mlp_op * 1e6:.2f} us; "
          f"{args.procs} processes at once")  # fmt: skip
    print(f"{'model':<26} {'measured ms':>11} {'profile':>9} {'error':>7} {'one width':>9} "
          f"{'error':>7}")  # fmt: skip
    errors: dict[str, list[float]] = {"profile": [], "one width": []}
    for (name, kind, depth, width, b), t in zip(cases, measured, strict=True):
        with torch.device("meta"):
            model, x, _ = _build(kind, depth, width, b)
            roofline, ops, rows = _features(model, x, device)
        new = device.compute_scale * roofline + device.op_overhead_s * ops + device.op_row_s * rows
        before = old_scale * roofline + mlp_op * ops
        errors["profile"].append(abs(new / t - 1))
        errors["one width"].append(abs(before / t - 1))
        print(f"{name:<26} {t * 1e3:>11.3f} {new * 1e3:>9.3f} {new / t - 1:>+7.1%} "
              f"{before * 1e3:>9.3f} {before / t - 1:>+7.1%}")  # fmt: skip
    print("median |error|: " + ", ".join(f"{k} {statistics.median(v):.1%}"
                                          for k, v in errors.items()))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
