"""What ``train.py --profile-steps N`` costs, measured side by side, and what its profile says.

    python benchmarks/profile_overhead.py [--mesh fsdp=2] [--steps 12] [--profile-steps 10]
                                          [--rounds 3] [--layers 4] [--dim 128] [--seq-len 128]
                                          [--global-batch 8] [--microbatches 1] [--keep DIR]

examples/gpt.py (GPT_LAYERS, GPT_DIM) is planned for cpu:2 with ``--mesh`` pinned (no
checkpointing, ``--microbatches`` microbatches: 1, or a pipeline's) and emitted once. Its
``train.py`` then runs ``--rounds`` times with ``--profile-steps N`` and as many times without,
alternately (profiled first in even rounds), under ``torchrun --standalone --nproc-per-node 2``
with OMP_NUM_THREADS=1, every run ``--steps`` long with the same seed. The profiled steps are 3 ..
N + 2 (two warm-up steps); the ratio compares the medians of those steps' logged ``step_time_s``
(forward to optimizer, what profiling adds to a step: its hooks, marks and records) in the profiled
runs and the plain runs, and each round's ratio shows the spread. The one-time costs (the
profiler's start, the collectives' calibration, gathering and writing the file) fall outside the
logged steps; the runs' wall times and their processes' CPU times (both ranks), printed too,
include them; the CPU ratio (less sensitive to a loaded machine than wall time) takes each kind's
run less a run of the two warm-up steps alone (startup, warm-up), so it covers steps 3 .. --steps
with the profiler's one-time costs. The load average is printed with the figures: the machine may
be shared.

``--probe`` runs instead, in this one process on one rank, the runtime's StepProfiler around
the same model's steps: ``--profile-steps`` profiled steps, then as many plain ones, and prints
the median process time (CPU, robust to a loaded machine) and wall time of a step of each, and
the one-time cost of gathering and writing the profile.

Then, from the last profiled run: the losses of the two kinds of run (equal bit for bit),
each rank's sum check (the terms of its mean step against its step_s, and step_s less the data
wait against the logged step time), the remainder outside the named terms, and the plan's
prediction against the measurement term by term (cost_model.measured.compare_terms).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from autopar.cost_model.measured import compare_terms, load_measured

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "gpt.py"


def run(out: Path, argv: list[str], env: dict) -> tuple[list[dict], float, float]:
    """Rank 0's step lines of a 2-rank run, its wall time and its processes' CPU time."""
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2",
           "train.py", *argv]  # fmt: skip
    start, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime
    if done.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith('{"step"')]
    return lines, wall, cpu_s


def probe(args: argparse.Namespace) -> None:
    """One process, one rank: the runtime's StepProfiler over examples/gpt.py's steps, the
    profiled block (``--profile-steps``) and as many plain steps after it, each step's process
    time (CPU: robust to a loaded machine) and wall time; then the one-time costs."""
    import importlib.util

    import torch
    import torch.distributed as dist
    from autopar.codegen.apply import runtime
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(GPT_LAYERS=str(args.layers), GPT_DIM=str(args.dim))
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("gpt_probe", GPT)
    gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt)
    rt = runtime()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1, 1, 1, 1), mesh_dim_names=("pp", "dp", "fsdp", "tp"))
    torch.manual_seed(0)
    model = gpt.build_model()
    optimizer = torch.optim.AdamW(model.parameters())
    (idx,), target = gpt.make_batch(args.global_batch, args.seq_len)
    layers = ["tok_emb", "pos_emb", *(f"blocks.{i}" for i in range(args.layers)), "ln_f", "head"]
    c = rt.Constants(MODEL_FILE=str(GPT), FACTORY="build_model", MESH={"pp": 1, "dp": 1, "fsdp": 1, "tp": 1},
                     WORLD_SIZE=1, CLUSTER="cpu:1", RANKS_PER_NODE=1, BACKEND="gloo",
                     GLOBAL_BATCH=args.global_batch, SEQ_LEN=args.seq_len, DTYPE="fp32",
                     OPTIMIZER="adamw", LR=1e-3, LAYERS=layers)  # fmt: skip
    out = Path(tempfile.mkdtemp(prefix="profile_probe_"))
    flags = argparse.Namespace(profile_steps=args.profile_steps, profile_out=out / "p.json",
                               checkpoint_dir=None, max_grad_norm=None)  # fmt: skip
    profiler = rt.StepProfiler(c, flags, [(model, optimizer)], mesh, torch.device("cpu"), __file__)
    total = 2 + 2 * args.profile_steps
    times = {"profiled": [], "plain": []}
    for step in profiler.batches(range(1, total + 1)):
        cpu, wall = time.process_time(), time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), target.flatten())
        loss.backward()
        with rt.phase(flags, "grad_norm"):
            rt.grad_norm(c, model.parameters())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        one_time = time.process_time()
        profiler.end_step(step, wall)
        one_time = time.process_time() - one_time
        if step > 2:
            kind = "profiled" if step <= 2 + args.profile_steps else "plain"
            times[kind].append((cpu, wall))
        if step == 2 + args.profile_steps:
            print(f"probe: the profile's gathering and writing took {one_time:.3f} s CPU")
    for i, unit in ((0, "CPU"), (1, "wall")):
        a, b = (statistics.median(t[i] for t in times[k]) for k in ("profiled", "plain"))
        print(f"probe: median step {unit} {a * 1e3:.2f} ms profiled, {b * 1e3:.2f} ms plain: "
              f"ratio {a / b:.3f}")  # fmt: skip
    dist.destroy_process_group()
    shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh", default="fsdp=2")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--profile-steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument(
        "--microbatches", type=int, default=1, help="microbatches per step (a pipeline needs >= pp)"
    )
    p.add_argument("--keep", type=Path, default=None, help="emit here and keep it")
    p.add_argument("--probe", action="store_true", help="one process: see probe()")
    args = p.parse_args()
    if args.probe:
        return probe(args)
    if args.steps < args.profile_steps + 2:
        sys.exit("error: --steps must be >= --profile-steps + 2 (two warm-up steps)")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GPT_LAYERS": str(args.layers),
           "GPT_DIM": str(args.dim), "DIST_TIMEOUT_S": "300"}  # fmt: skip
    out = args.keep or Path(tempfile.mkdtemp(prefix="profile_overhead_"))
    plan_cmd = [sys.executable, "-m", "autopar", str(GPT), "--cluster", "cpu:2",
                "--global-batch", str(args.global_batch), "--seq-len", str(args.seq_len),
                "--mesh", args.mesh, "--checkpoint", "none",
                "--microbatches", str(args.microbatches),
                "--out", str(out)]  # fmt: skip
    subprocess.run(plan_cmd, env=env, check=True, capture_output=True, text=True)
    profiled_steps = range(3, args.profile_steps + 3)
    flags = ["--steps", str(args.steps), "--seed", "0"]
    timed = {"profiled": [], "plain": []}
    walls = {"profiled": [], "plain": []}
    cpus = {"profiled": [], "plain": [], "startup": []}
    losses = {}
    ratios = []
    print(f"# gpt {args.layers}x{args.dim}, seq {args.seq_len}, batch {args.global_batch}, "
          f"mesh {args.mesh}, cpu:2; load average {os.getloadavg()}")  # fmt: skip
    for r in range(args.rounds):
        medians = {}
        for kind in ("profiled", "plain") if r % 2 == 0 else ("plain", "profiled"):
            extra = ["--profile-steps", str(args.profile_steps)] if kind == "profiled" else []
            lines, wall, cpu_s = run(out, flags + extra, env)
            cpus[kind].append(cpu_s)
            steps = [x["step_time_s"] for x in lines if x["step"] in profiled_steps]
            timed[kind] += steps
            walls[kind].append(wall)
            medians[kind] = statistics.median(steps)
            losses[kind] = [x["loss"] for x in lines]
        ratios.append(medians["profiled"] / medians["plain"])
        print(f"round {r}: profiled {medians['profiled'] * 1e3:.2f} ms, plain "
              f"{medians['plain'] * 1e3:.2f} ms, ratio {ratios[-1]:.3f}")  # fmt: skip
        _, _, cpu_s = run(out, ["--steps", "2", "--seed", "0"], env)  # startup and warm-up
        cpus["startup"].append(cpu_s)
    ratio = statistics.median(timed["profiled"]) / statistics.median(timed["plain"])
    startup = statistics.median(cpus["startup"])
    cpu_ratio = (statistics.median(cpus["profiled"]) - startup) / (
        statistics.median(cpus["plain"]) - startup
    )
    print(f"overhead: median step {statistics.median(timed['profiled']) * 1e3:.2f} ms profiled, "
          f"{statistics.median(timed['plain']) * 1e3:.2f} ms plain: ratio {ratio:.3f} "
          f"(rounds {', '.join(f'{x:.3f}' for x in ratios)}); run wall "
          f"{statistics.median(walls['profiled']):.1f} s vs {statistics.median(walls['plain']):.1f} s, "
          f"CPU {statistics.median(cpus['profiled']):.1f} s vs {statistics.median(cpus['plain']):.1f} s; "
          f"load average now {os.getloadavg()}")  # fmt: skip
    print(
        f"CPU time of steps 3 .. {args.steps} (both ranks; a run's CPU less a 2-step run's): "
        f"ratio {cpu_ratio:.3f} profiled / plain (the profiler's start and file included)"
    )
    print(f"losses bitwise equal: {losses['profiled'] == losses['plain']}")
    profile = load_measured(out / "profile.json")
    for rank in profile.ranks:
        m = rank.mean
        total = sum(m.terms().values())
        named = m.step_s - m.other_s
        print(f"rank {rank.rank}: step_s {m.step_s * 1e3:.2f} ms = sum of terms "
              f"{total * 1e3:.2f} ms; step_s - data wait {(m.step_s - m.data_wait_s) * 1e3:.2f} ms "
              f"vs logged {m.logged_step_time_s * 1e3:.2f} ms "
              f"({(m.step_s - m.data_wait_s) / m.logged_step_time_s - 1:+.2%}); layers + optimizer "
              f"+ grad norm + data wait + outside-layer fwd/bwd = {named / m.step_s:.2%}, "
              f"other_s {m.other_s / m.step_s:.2%}")  # fmt: skip
    print(f"{'term':<22} {'measured':>14} {'predicted':>14} {'ratio':>7}  note")
    for row in compare_terms(profile):
        scale, unit = (1e3, "ms") if row.unit == "s" else (1 / 2**20, "MiB")
        pred = "-" if row.predicted is None else f"{row.predicted * scale:.3f} {unit}"
        ratio_text = "-" if row.ratio is None else f"{row.ratio:.2f}"
        print(f"{row.term:<22} {row.measured * scale:>10.3f} {unit:<3} {pred:>14} "
              f"{ratio_text:>7}  {row.note}")  # fmt: skip
    if args.keep is None:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
