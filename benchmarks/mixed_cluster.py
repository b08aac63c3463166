"""A mixed cluster's plan against the uniform one, side by side, with ranks made slower on
purpose (issue 30, item 3).

    python benchmarks/mixed_cluster.py [--factor 3] [--steps 20] [--rounds 3]
    python benchmarks/mixed_cluster.py --orders

``--orders`` only plans (no run, no GPU): three GPU groups (A100-40GB, H100, A100-80GB) and a
pipeline of 3 whose activations press on memory; it prints every order of the groups the
search tried with its predicted step, each pipeline rank's memory against its own group's, and
the uniform treatment's step, with checkpointing free and off.

Two CPU processes stand for two node groups: a cluster file declares group 0 ``--factor`` times
as fast as group 1 (peak FLOP/s, bandwidth and per-op overhead scaled), and the run makes rank 1
that much slower on purpose (benchmarks/mixed/sitecustomize.py: every F.linear's matmuls run
``--factor`` times, forward and backward). examples/gpt.py is planned at dp=2 twice: on that
cluster (batch shares by speed) and on ``cpu:2`` treated as uniform (even shares); both emitted
programs run alternately under torchrun with the same slowdown, and the script prints each one's
median step time (the slowest rank's, from the logged step lines), the measured speed-up of the
mixed plan, and the speed-up the planner predicted (the plan's uniform step over its own).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "gpt.py")
SIZES = {"GPT_LAYERS": "4", "GPT_DIM": "256", "GPT_HEADS": "4", "GPT_VOCAB": "512",
         "GPT_MAX_SEQ": "64"}  # fmt: skip


def cluster_file(path: Path, factor: float) -> Path:
    """Two groups of one CPU process each, group 0 ``factor`` times as fast as group 1."""
    from autopar.cost_model.catalog import cpu_device, faster_device

    base = cpu_device(2)
    groups = [
        {"device": faster_device(base, k).model_dump(), "num_nodes": 1, "devices_per_node": 1}
        for k in (factor, 1.0)
    ]
    path.write_text(json.dumps({"groups": groups}))
    return path


def plan(cluster: str, out: Path, env: dict) -> dict:
    cmd = [sys.executable, "-m", "autopar", GPT, "--cluster", cluster, "--global-batch", "16",
           "--seq-len", "64", "--mesh", "dp=2", "--no-cache", "--out", str(out), "-q"]  # fmt: skip
    subprocess.run(cmd, check=True, env=env, capture_output=True, text=True)
    return json.loads((out / "plan.json").read_text())


def run(out: Path, steps: int, env: dict) -> list[float]:
    """The logged step times (rank 0's line holds the step's time over ranks)."""
    torchrun = str(Path(sys.executable).parent / "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", str(out / "train.py"),
           "--steps", str(steps), "--log-every", "1"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=out)
    if proc.returncode != 0:
        raise SystemExit(
            f"error: {out / 'train.py'} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        )
    times = []
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if "step_time_s" in record:
                times.append(record["step_time_s"])
    return times


ORDERS_SIZES = {"GPT_LAYERS": "18", "GPT_DIM": "2048", "GPT_HEADS": "16", "GPT_VOCAB": "8000",
                "GPT_MAX_SEQ": "2048"}  # fmt: skip
ORDERS_CLUSTER = "1x8xA100-40GB+1x8xH100+1x8xA100-80GB"


def orders() -> int:
    """Plan the three-group pipeline (``--orders``) and print what the search decided."""
    env = {**os.environ, **ORDERS_SIZES, "PYTHONWARNINGS": "ignore"}
    print(f"examples/gpt.py {' '.join(f'{k}={v}' for k, v in ORDERS_SIZES.items())}, "
          f"--cluster {ORDERS_CLUSTER}, global batch 4096 x seq 2048, bf16, pp=3,fsdp=8")  # fmt: skip
    for checkpoint in ("auto", "none"):
        cmd = [sys.executable, "-m", "autopar", GPT, "--cluster", ORDERS_CLUSTER,
               "--global-batch", "4096", "--seq-len", "2048", "--dtype", "bf16", "--mesh",
               "pp=3,fsdp=8", "--checkpoint", checkpoint, "--no-cache", "--json"]  # fmt: skip
        plan = json.loads(subprocess.run(cmd, check=True, env=env, capture_output=True,
                                         text=True).stdout)  # fmt: skip
        mixed, groups = plan["mixed_cluster"], plan["cluster"]["groups"]
        print(f"--checkpoint {checkpoint}: step {plan['predicted']['step_time_s'] * 1e3:.3f} ms"
              f", stages of {[len(s) for s in plan['stages']]} layers")  # fmt: skip
        for order in sorted(mixed["pipeline_orders"], key=lambda o: o["step_time_s"] or 1e30):
            step = order["step_time_s"]
            print(f"  groups {' -> '.join(map(str, order['groups']))}: "
                  + (f"{step * 1e3:.3f} ms" if step is not None else order["why"]))  # fmt: skip
        for r, (g, mem) in enumerate(
            zip(mixed["pipeline_groups"], plan["predicted"]["rank_memory_bytes"], strict=True)
        ):
            total, cap = sum(mem.values()), groups[g]["device"]["memory_bytes"]
            print(f"  pipeline rank {r} on group {g} ({groups[g]['device']['name']}): "
                  f"{total / 1e9:.2f} GB of {cap / 1e9:.0f} GB")  # fmt: skip
        uniform = mixed["uniform_step_time_s"]
        print("  treated as uniform: "
              + (f"{uniform * 1e3:.3f} ms" if uniform is not None else "no plan fits"))  # fmt: skip
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--factor", type=float, default=3.0, help="how much slower rank 1 is")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--orders", action="store_true", help="only plan three groups: the orders")
    args = p.parse_args()
    if args.orders:
        return orders()
    env = {**os.environ, **SIZES, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="autopar-mixed-") as tmp:
        work = Path(tmp)
        spec = str(cluster_file(work / "mixed.json", args.factor))
        plans = {"uniform": plan("cpu:2", work / "uniform", env),
                 "mixed": plan(spec, work / "mixed", env)}  # fmt: skip
        slow = {**env, "MIXED_SLOW_RANKS": "1", "MIXED_SLOW_FACTOR": f"{args.factor:g}",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "benchmarks" / "mixed"),
                                                            env.get("PYTHONPATH")]))}  # fmt: skip
        times: dict[str, list[float]] = {name: [] for name in plans}
        for _ in range(args.rounds):
            for name in plans:
                times[name] += run(work / name, args.steps, slow)[args.warmup :]
    median = {name: statistics.median(ts) for name, ts in times.items()}
    mixed = plans["mixed"]["mixed_cluster"]
    predicted = mixed["uniform_step_time_s"] / plans["mixed"]["predicted"]["step_time_s"]
    print(f"examples/gpt.py {' '.join(f'{k}={v}' for k, v in SIZES.items())}, global batch 16 x "
          f"seq 64, dp=2; rank 1 made {args.factor:g}x slower; {args.rounds} rounds x "
          f"{args.steps} steps ({args.warmup} warm-up dropped); load {load[0]:.2f} -> "
          f"{os.getloadavg()[0]:.2f}")  # fmt: skip
    shares = plans["mixed"]["mixed_cluster"]["batch_shares"]
    print(f"uniform plan (shares 8, 8):      {median['uniform'] * 1e3:8.1f} ms a step")
    print(
        f"mixed plan (shares {shares[0]}, {shares[1]}):     {median['mixed'] * 1e3:8.1f} ms a step"
    )
    print(
        f"measured speed-up {median['uniform'] / median['mixed']:.2f}x; predicted "
        f"{predicted:.2f}x (the plan's uniform treatment over its own step)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
