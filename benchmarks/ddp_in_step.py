"""What DDP's gradient all-reduce costs inside a training step, measured side by side.

    python benchmarks/ddp_in_step.py [--rounds 2] [--steps 40] [--profile P.json]

The calibrate plans are predicted too fast on CPU (README, "calibrate"); this splits the DDP
plan's step the way the cost model does. It launches itself under torchrun on 2 gloo ranks (one
thread each) and runs examples/gpt.py's model at calibrate's ``gpt ddp`` shape (4 sequences of
64 tokens per rank, AdamW) in these modes, in turn, ``--rounds`` times:

- ``plain``: forward + backward, no wrapper: the ranks' compute alone;
- ``ddp``: DistributedDataParallel (its bucket's all-reduce runs inside backward);
- ``ddp no-op hook``: DDP with a comm hook that reduces nothing: DDP's own work;
- ``one all-reduce after``: backward under ``no_sync``, then a 4-byte all-reduce (the wait for
  the other rank, timed apart: the mean of the two ranks' waits) and the flattened gradients
  all-reduced once.

Apart from the steps, the same gradient all-reduce back to back (as the profile's collective
benchmark times it: median and mean of the repeats). Every figure is the median over steps of
the slowest rank's, in ms; ``excess`` is over ``plain``. ``--profile P`` (``plan profile
--cluster cpu:2 --quick --out P``) also prints what the cost model charges the same plan
(``plan examples/gpt.py --mesh dp=2 --checkpoint none``, global batch 8, seq 64): its compute
and dp_comm terms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "gpt.py"
LOCAL_BATCH, SEQ = 4, 64
MODES = ("plain", "ddp", "ddp no-op hook", "one all-reduce after")


def _worker(rounds: int, steps: int, out: str) -> None:
    import importlib.util

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    spec = importlib.util.spec_from_file_location("gpt_model", GPT)
    gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt)  # type: ignore[union-attr]

    def slowest(values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def mean(values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t)
        return (t / dist.get_world_size()).tolist()

    def no_op(state, bucket):
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    def measure(mode: str) -> tuple[float, float]:
        """(the median slowest rank's forward + backward, the ranks' median mean wait)."""
        torch.manual_seed(0)
        model = gpt.build_model()
        if mode != "plain":
            model = DDP(model)
        if mode == "ddp no-op hook":
            model.register_comm_hook(None, no_op)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        torch.manual_seed(1 + rank)
        x, y = gpt.make_batch(LOCAL_BATCH, SEQ)
        flag = torch.zeros(1)

        def step() -> tuple[float, float]:
            t0 = time.perf_counter()
            wait = 0.0
            if mode == "one all-reduce after":
                with model.no_sync():
                    F.cross_entropy(model(*x).flatten(0, 1), y.flatten()).backward()
                t1 = time.perf_counter()
                dist.all_reduce(flag)
                wait = time.perf_counter() - t1
                dist.all_reduce(torch.cat([p.grad.flatten() for p in model.parameters()]))
            else:
                F.cross_entropy(model(*x).flatten(0, 1), y.flatten()).backward()
            elapsed = time.perf_counter() - t0
            opt.step()
            opt.zero_grad(set_to_none=True)
            return elapsed, wait

        for _ in range(5):
            step()
        dist.barrier()
        timed = [step() for _ in range(steps)]
        return (
            statistics.median(slowest([a for a, _ in timed])),
            statistics.median(mean([w for _, w in timed])),
        )

    figures: dict[str, list[float]] = {}
    for _ in range(rounds):
        for mode in MODES:
            elapsed, wait = measure(mode)
            figures.setdefault(mode, []).append(elapsed)
            if mode == "one all-reduce after":
                figures.setdefault("wait", []).append(wait)
    grads = torch.zeros(sum(p.numel() for p in gpt.build_model().parameters()))
    for _ in range(5):
        dist.all_reduce(grads)
    alone = []
    for _ in range(steps):
        t0 = time.perf_counter()
        dist.all_reduce(grads)
        alone.append(time.perf_counter() - t0)
    alone = slowest(alone)
    if rank == 0:
        result = {mode: statistics.median(v) for mode, v in figures.items()}
        result["alone median"] = statistics.median(alone)
        result["alone mean"] = statistics.fmean(alone)
        result["grad bytes"] = grads.numel() * 4
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _predicted(profile: str) -> dict[str, float]:
    sys.path.insert(0, str(ROOT))
    from autopar.cost_model import parse_cluster
    from autopar.cost_model.profile import apply_profile, load_profile

    import autopar._plan  # noqa: F401  (the plan's actions)
    from autopar.api import plan_model_file

    cluster = apply_profile(parse_cluster("cpu:2"), load_profile(profile))
    plan = plan_model_file(str(GPT), cluster, global_batch=2 * LOCAL_BATCH, seq_len=SEQ,
                           mesh={"dp": 2}, checkpoint="none")  # fmt: skip
    terms = plan.predicted.time_breakdown_s
    return {"compute": terms.compute, "dp_comm": terms.dp_comm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--profile", help="a profile of cpu:2: print the cost model's terms too")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args.rounds, args.steps, args.worker)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               "2", __file__, "--rounds", str(args.rounds), "--steps", str(args.steps),
               "--worker", str(out)]  # fmt: skip
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        got = json.loads(out.read_text())
    load = os.getloadavg()[0]
    print(f"examples/gpt.py on 2 gloo ranks, {LOCAL_BATCH} x {SEQ} tokens per rank, "
          f"{args.rounds} rounds of {args.steps} steps; load average {load:.1f}")  # fmt: skip
    plain = got["plain"]
    for mode in MODES:
        excess = "" if mode == "plain" else f"   excess {(got[mode] - plain) * 1e3:6.2f}"
        print(f"  {mode:22s} fwd+bwd {got[mode] * 1e3:7.2f} ms{excess}")
    print(f"    of which the wait at a 4-byte all-reduce right after backward (ranks' mean): "
          f"{got['wait'] * 1e3:.2f} ms")  # fmt: skip
    print(f"  the gradients' all-reduce ({got['grad bytes'] / 2**10:.0f} KiB) back to back: "
          f"median {got['alone median'] * 1e3:.2f} ms, mean {got['alone mean'] * 1e3:.2f} ms")  # fmt: skip
    if args.profile:
        terms = _predicted(args.profile)
        print(f"  cost model ({args.profile}): compute {terms['compute'] * 1e3:.2f} ms, "
              f"dp_comm {terms['dp_comm'] * 1e3:.2f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
