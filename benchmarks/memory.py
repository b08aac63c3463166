"""Predicted vs measured peak memory per rank of emitted runs, one plan per way of parallelizing.

    python benchmarks/memory.py [--plans ddp,fsdp,...] [--steps 2] [--json] [--rows FILE]

Each plan is planned on cpu:2 (fp32, AdamW) with its mesh, schedule, accumulation or
checkpointing forced, emitted, and run under torchrun with ``--profile-steps``: every rank's
``profile.json`` record holds the RSS high-water mark (VmHWM) of each profiled step.

Measured peak of a rank = its VmHWM over the profiled steps minus torch's own footprint on that
rank, measured the same way: the same plan, emitted and run the same way, of the same model at a
negligible size (``TINY``: same layers, batch and sequence, every width tiny), whose VmHWM minus
its own (tiny) predicted peak is what the program holds besides the model's tensors (the Python
interpreter, torch, gloo, the runtime, the profiler). ``tensors``: the rank's peak as the profile counts tensors (params, optimizer state and module
buffers at the step's start plus the most allocated at once in it, from torch's profiler
records), plus DDP's gradient buckets (allocated before the step: not in those records), set
against ``pred``, the prediction less the allocator's headroom (:mod:`cost_model.peak`). Predicted peak of a
rank: the plan's
``rank_memory_bytes`` entry of the pipeline rank it holds (params + grads + optimizer +
activations + buffers).

The GPT is examples/gpt.py (``SIZE``); the EP plan uses tests/models/moe.py, resized the same
way (a model file written beside the run that sets its module constants).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]

SIZE = {"GPT_DIM": "512", "GPT_HEADS": "8", "GPT_LAYERS": "4", "GPT_VOCAB": "8192",
        "GPT_MAX_SEQ": "128"}  # fmt: skip
TINY = {**SIZE, "GPT_DIM": "16", "GPT_HEADS": "2", "GPT_VOCAB": "64"}
MOE = {"VOCAB": 4096, "DIM": 256, "HEADS": 4, "LAYERS": 2, "EXPERTS": 4, "TOP_K": 2}
MOE_TINY = {**MOE, "VOCAB": 64, "DIM": 16, "HEADS": 2}
GLOBAL_BATCH, SEQ = 4, 128
PLANS = {
    # name: (model, plan flags)
    "ddp": ("gpt", ["--mesh", "dp=2"]),
    "fsdp": ("gpt", ["--mesh", "fsdp=2"]),
    "tp": ("gpt", ["--mesh", "tp=2"]),
    "pp 1f1b m=4": ("gpt", ["--mesh", "pp=2", "--schedule", "1f1b", "--microbatches", "4"]),
    "cp": ("gpt", ["--mesh", "cp=2"]),
    "ep": ("moe", ["--mesh", "ep=2"]),
    "ddp accum 2": ("gpt", ["--mesh", "dp=2", "--microbatches", "2"]),
    "ddp ckpt": ("gpt", ["--mesh", "dp=2", "--checkpoint", "full"]),
}


def _moe_file(where: Path, sizes: dict) -> Path:
    """A model file: tests/models/moe.py with its module constants set to ``sizes``."""
    path = where / "moe_sized.py"
    lines = [
        "import sys",
        f"sys.path.insert(0, {str(ROOT / 'tests' / 'models')!r})",
        "import moe",
        *(f"moe.{k} = {v!r}" for k, v in sizes.items()),
        "from moe import build_model  # noqa: E402,F401",
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _run_plan(name: str, model: str, flags: list[str], tiny: bool, tmp: Path, steps: int) -> dict:
    """Plan, emit and run one plan; its predicted and measured (VmHWM) peak per rank."""
    env = {**os.environ, **(TINY if tiny else SIZE), "OMP_NUM_THREADS": "1",
           "DIST_TIMEOUT_S": "300"}  # fmt: skip
    out = tmp / (name.replace(" ", "_").replace("=", "") + ("_tiny" if tiny else ""))
    out.mkdir()
    if model == "gpt":
        model_file = ROOT / "examples" / "gpt.py"
    else:
        model_file = _moe_file(out, MOE_TINY if tiny else MOE)
    bin_dir = Path(sys.executable).parent
    subprocess.run(
        [sys.executable, "-m", "autopar", str(model_file), "--cluster", "cpu:2",
         "--global-batch", str(GLOBAL_BATCH), "--seq-len", str(SEQ), *flags,
         "--out", str(out / "run"), "-q"],
        env=env, cwd=ROOT, check=True, timeout=600,
    )  # fmt: skip
    plan = json.loads((out / "run" / "plan.json").read_text())
    profile = out / "profile.json"
    proc = subprocess.run(
        [str(bin_dir / "torchrun"), "--standalone", "--nproc-per-node", "2",
         str(out / "run" / "train.py"), "--steps", str(steps + 2), "--profile-steps", str(steps),
         "--profile-out", str(profile)],
        env=env, cwd=out, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(
            f"{name}: emitted run failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )
    ranks = json.loads(profile.read_text())["ranks"]
    predicted = plan["predicted"]["rank_memory_bytes"]
    pp = plan["mesh"]["pp"]
    rows = []
    for r in sorted(ranks, key=lambda r: r["rank"]):
        pp_rank = r["mesh_coords"].get("pp", 0) if pp > 1 else 0
        rows.append({
            "rank": r["rank"],
            "predicted_bytes": sum(predicted[pp_rank].values()),
            "predicted": predicted[pp_rank],
            "vmhwm_bytes": max(s["memory"]["peak_rss_bytes"] for s in r["steps"]),
            "allocated_bytes": r["memory"],
        })  # fmt: skip
    return {"plan": name, "mesh": plan["mesh"], "ranks": rows}


def run(names: list[str] | None = None, steps: int = 2, progress: bool = False) -> list[dict]:
    """Each plan of ``names`` (default: all of PLANS) at full size and tiny; per rank the
    predicted and measured peak (VmHWM minus the tiny run's footprint) and their error
    (``progress``: each row to stderr as it is measured)."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names or list(PLANS):
            model, flags = PLANS[name]
            start = time.time()
            big = _run_plan(name, model, flags, False, Path(tmp), steps)
            tiny = _run_plan(name, model, flags, True, Path(tmp), steps)
            for b, t in zip(big["ranks"], tiny["ranks"], strict=True):
                footprint = t["vmhwm_bytes"] - t["predicted_bytes"]
                measured = b["vmhwm_bytes"] - footprint
                rows.append({
                    "plan": name, "mesh": big["mesh"], "rank": b["rank"],
                    "predicted_bytes": b["predicted_bytes"], "measured_bytes": measured,
                    "vmhwm_bytes": b["vmhwm_bytes"], "footprint_bytes": footprint,
                    "error": b["predicted_bytes"] / measured - 1, "predicted": b["predicted"],
                    "allocated": b["allocated_bytes"], "seconds": time.time() - start,
                })  # fmt: skip
                if progress:
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def _tensor_level(r: dict) -> tuple[float, float]:
    """(predicted, measured) at the tensor level: the prediction less the allocator's headroom
    (cost_model.peak, the cpu device's figure); the profile's tensor peak plus DDP's gradient
    buckets (a copy of the gradients, allocated before the step: not in the profile's records)."""
    from autopar.cost_model import peak
    from autopar.cost_model.catalog import cpu_device
    from autopar.cost_model.precision import uses_fsdp2

    p = r["predicted"]
    headroom = math.ceil(peak.headroom_bytes(cpu_device(2), p["activations"] + p["grads"]))
    ddp = r["mesh"]["dp"] > 1 and not uses_fsdp2(SimpleNamespace(**r["mesh"]))
    return r["predicted_bytes"] - headroom, r["allocated"]["peak_bytes"] + (
        p["grads"] if ddp else 0
    )


def table(rows: list[dict]) -> str:
    """The rows as the script prints them."""
    mib = 2**20
    lines = [f"{'plan':<14}{'rank':>5}{'VmHWM MiB':>11}{'footprint':>11}{'measured':>10}"
             f"{'predicted':>11}{'error':>8}{'tensors':>9}{'pred':>7}{'error':>8}   predicted "
             f"params/grads/optim/acts/buffers MiB"]  # fmt: skip
    for r in rows:
        parts = "/".join(f"{r['predicted'][k] / mib:.0f}" for k in
                         ("params", "grads", "optimizer", "activations", "buffers"))  # fmt: skip
        pred_t, meas_t = _tensor_level(r)
        lines.append(f"{r['plan']:<14}{r['rank']:>5}{r['vmhwm_bytes'] / mib:>11.1f}"
                     f"{r['footprint_bytes'] / mib:>11.1f}{r['measured_bytes'] / mib:>10.1f}"
                     f"{r['predicted_bytes'] / mib:>11.1f}{r['error']:>+8.1%}"
                     f"{meas_t / mib:>9.1f}{pred_t / mib:>7.1f}{pred_t / meas_t - 1:>+8.1%}"
                     f"   {parts}")  # fmt: skip
    within = sum(1 for r in rows if abs(r["error"]) <= 0.05)
    lines.append(f"{within}/{len(rows)} rank peaks within 5%")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plans", default=None, help=f"comma-separated, of: {', '.join(PLANS)}")
    p.add_argument("--steps", type=int, default=2, help="profiled steps (after 2 warm-up)")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--rows",
        type=Path,
        default=None,
        help="print the table of rows an earlier run wrote to stderr (JSON lines)",
    )
    args = p.parse_args()
    if args.rows:
        lines = args.rows.read_text().splitlines()
        print(table([json.loads(x) for x in lines if x.startswith("{")]))
        return
    names = args.plans.split(",") if args.plans else None
    start = time.time()
    rows = run(names, args.steps, progress=True)
    if args.json:
        print(json.dumps(rows))
        return
    print(table(rows))
    print(f"elapsed {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
