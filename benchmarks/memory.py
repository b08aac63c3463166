"""Predicted vs measured peak memory of emitted runs that differ in checkpointing and microbatches.

    python benchmarks/memory.py [--steps 3] [--json]

Each plan is GPT (examples/gpt.py at d_model 256, 4 layers, seq 512) on cpu:2 with pp=2, global
batch 8, forced to a schedule / microbatch count / checkpointing; the emitted script runs under
torchrun and logs rank 0's peak RSS (VmHWM: a real high-water mark) every step. Rank 0 holds
pipeline stage 0, the one with most microbatches in flight.

RSS includes what every plan shares (the torch runtime, the whole model that every rank builds
before keeping its stage), so the figures to compare are the increments over the plan predicted leanest:
predicted and measured, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZE = {"GPT_DIM": "256", "GPT_HEADS": "4", "GPT_LAYERS": "4", "GPT_MAX_SEQ": "512"}
PLANS = [
    # name, schedule, microbatches, checkpoint
    ("gpipe m=8", "gpipe", 8, "none"),
    ("1f1b m=4", "1f1b", 4, "none"),
    ("1f1b m=8", "1f1b", 8, "none"),
    ("1f1b m=8 ckpt", "1f1b", 8, "full"),
]


def run(steps: int = 3) -> list[dict]:
    env = {**os.environ, **SIZE, "OMP_NUM_THREADS": "1", "DIST_TIMEOUT_S": "120"}
    bin_dir = Path(sys.executable).parent
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, schedule, micro, ckpt in PLANS:
            out = Path(tmp) / name.replace(" ", "_").replace("=", "")
            subprocess.run(
                [sys.executable, "-m", "autopar", str(ROOT / "examples" / "gpt.py"),
                 "--cluster", "cpu:2", "--global-batch", "8", "--seq-len", "512", "--mesh",
                 "pp=2", "--schedule", schedule, "--microbatches", str(micro), "--checkpoint",
                 ckpt, "--out", str(out), "-q"],
                env=env, cwd=ROOT, check=True, timeout=300,
            )  # fmt: skip
            plan = json.loads((out / "plan.json").read_text())
            proc = subprocess.run(
                [str(bin_dir / "torchrun"), "--standalone", "--nproc-per-node", "2",
                 str(out / "train.py"), "--steps", str(steps)],
                env=env, cwd=tmp, capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            if proc.returncode != 0:
                raise RuntimeError(f"{name}: emitted run failed:\n{proc.stdout[-3000:]}")
            steps_logged = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
            rows.append(
                {
                    "plan": name,
                    "predicted_bytes": plan["predicted"]["peak_memory_bytes"],
                    "predicted_activations": plan["predicted"]["memory_breakdown_bytes"][
                        "activations"
                    ],
                    "measured_bytes": max(s["peak_memory_bytes"] for s in steps_logged),
                }
            )
    lean = min(rows, key=lambda r: r["predicted_bytes"])  # both increments from this plan
    lean_p, lean_m = lean["predicted_bytes"], lean["measured_bytes"]
    for r in rows:
        r["predicted_over_leanest"] = r["predicted_bytes"] - lean_p
        r["measured_over_leanest"] = r["measured_bytes"] - lean_m
        r["ratio"] = (
            r["predicted_over_leanest"] / r["measured_over_leanest"]
            if r["measured_over_leanest"] > 0
            else None
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows = run(args.steps)
    if args.json:
        print(json.dumps(rows))
        return
    mib = 2**20
    print(f"{'plan':<16}{'predicted MiB':>15}{'measured MiB':>14}"
          f"{'pred over leanest':>19}{'meas over leanest':>19}{'ratio':>7}")  # fmt: skip
    for r in rows:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        print(f"{r['plan']:<16}{r['predicted_bytes'] / mib:>15.1f}{r['measured_bytes'] / mib:>14.1f}"
              f"{r['predicted_over_leanest'] / mib:>19.1f}{r['measured_over_leanest'] / mib:>19.1f}"
              f"{ratio:>7}")  # fmt: skip


if __name__ == "__main__":
    main()
