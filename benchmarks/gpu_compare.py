"""Predicted vs measured step time and peak memory of emitted runs (benchmarks/gpu_check.sh).

    python benchmarks/gpu_compare.py CASE_DIR... [--skip 5] [--json]

Each CASE_DIR holds the plan.json autopar wrote and run.log, the output of its train.py run with
``--log-every 1`` (rank 0's JSON line per step). Measured step time is the median over the steps
after the first ``--skip`` (warm-up: allocator growth, kernel selection); measured peak memory is
the largest ``peak_memory_bytes`` logged (torch.cuda.max_memory_allocated on a GPU, peak RSS on
a CPU). Standard library only: it runs where the GPUs are, beside torch, without autopar.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def steps_of(log: Path) -> list[dict]:
    records = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "step" in record and "step_time_s" in record:
                records.append(record)
    return records


def compare(case: Path, skip: int) -> dict:
    plan = json.loads((case / "plan.json").read_text())
    records = steps_of(case / "run.log")
    if not records:
        raise SystemExit(f"error: {case / 'run.log'} has no step lines: did the run fail?")
    timed = records[skip:] or records[-1:]
    measured_s = statistics.median(r["step_time_s"] for r in timed)
    measured_peak = max(r["peak_memory_bytes"] for r in records)
    predicted = plan["predicted"]
    return {
        "case": case.name,
        "mesh": plan["mesh"],
        "steps_timed": len(timed),
        "predicted_step_s": predicted["step_time_s"],
        "measured_step_s": measured_s,
        "step_ratio": measured_s / predicted["step_time_s"],
        "predicted_peak_bytes": predicted["peak_memory_bytes"],
        "measured_peak_bytes": measured_peak,
        "peak_ratio": measured_peak / predicted["peak_memory_bytes"],
        "predicted_mfu": predicted.get("mfu"),
        "final_loss": records[-1].get("loss"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="+", type=Path)
    ap.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the median")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = [compare(case, args.skip) for case in args.cases]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    gib = 2**30
    print(
        f"{'case':<10} {'step s pred':>11} {'measured':>9} {'ratio':>6}   "
        f"{'peak GiB pred':>13} {'measured':>9} {'ratio':>6}   final loss"
    )
    for r in rows:
        print(
            f"{r['case']:<10} {r['predicted_step_s']:>11.4f} {r['measured_step_s']:>9.4f} "
            f"{r['step_ratio']:>6.2f}   {r['predicted_peak_bytes'] / gib:>13.2f} "
            f"{r['measured_peak_bytes'] / gib:>9.2f} {r['peak_ratio']:>6.2f}   {r['final_loss']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
