"""Refit from one run, predict the others (issue 27, item 2): does the refit generalize?

    python benchmarks/refit.py [--work DIR] [--steps 8 --profile-steps 5] [--plain-steps 0]
        [--base measure|none|PATH] [--reuse] [--json]
    python benchmarks/refit.py --cases RUN_DIR... --fitted FITTED.json [--json]

Plans examples/gpt.py on cpu:2 under several meshes and checkpointing (``plan --mesh ...
--checkpoint ... --out``), runs each emitted program with ``--profile-steps`` (torchrun, gloo),
refits the cost model from the first run's profile alone (``plan --refit``), predicts every plan
again with the fitted profile (its mesh, schedule and checkpointing pinned:
``planner.search.replay``), and prints per plan the measured step time (the slowest rank's mean
profiled step without the data wait) against the prediction before and after the refit, and the
median |error| of the plans the refit did not see. ``--plain-steps K`` runs K more steps after
the profiled ones, unprofiled, in the same run, and measures each plan by their median logged
``step_time_s`` instead: what the plan costs when nobody profiles it (the profiler's hooks and
records cost a small step ~17%, README), which is what a refitted plan is for.
``--base measure`` (the default) first
profiles the cluster (``plan profile --cluster cpu:2 --quick``) and plans every run with that
profile, so that "before" is the profiled device's prediction and the refit starts from it;
``--base none`` starts from the catalog's CPU figures; ``--reuse --work DIR`` refits and predicts
again from the runs kept in DIR (no new runs); ``--cases DIR... --fitted FITTED.json`` predicts
again runs made elsewhere (benchmarks/gpu_check.sh's, on a GPU) with a profile already refitted
from the first of them. Timings depend on the machine's load: the
load average is printed with the figures.
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
TRAINING = ["--cluster", "cpu:2", "--global-batch", "8", "--seq-len", "64"]
# name -> plan flags; the first is the run the refit learns from
PLANS = {
    "A dp=2": ["--mesh", "dp=2", "--checkpoint", "none"],
    "B fsdp=2": ["--mesh", "fsdp=2", "--checkpoint", "none"],
    "C tp=2": ["--mesh", "tp=2", "--checkpoint", "none"],
    "D pp=2": ["--mesh", "pp=2", "--schedule", "1f1b", "--microbatches", "2",
               "--checkpoint", "none"],
    "E dp=2 ckpt": ["--mesh", "dp=2", "--checkpoint", "full"],
}  # fmt: skip


def _env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "DIST_TIMEOUT_S": "120", "PYTHONWARNINGS": "ignore"}  # fmt: skip


def _plan(args: list[str], timeout_s: float) -> None:
    cmd = [sys.executable, "-m", "autopar", GPT, *TRAINING, *args, "--quiet"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=_env())
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr[-2000:]}")


def run_loop(
    work: Path,
    plans: dict[str, list[str]] = PLANS,
    *,
    steps: int = 8,
    profile_steps: int = 5,
    plain_steps: int = 0,
    timeout_s: float = 300,
    base: str | None = None,
    reuse: bool = False,
) -> dict:
    """Plan, run, refit from the first plan's run, predict all again; the figures as a dict.
    ``base``: a cluster profile every plan (and the refit) starts from; ``"measure"``: profile
    the cluster first; None: the catalog's figures."""

    if base == "measure" and reuse and (work / "cluster-profile.json").is_file():
        base = str(work / "cluster-profile.json")
    if base == "measure":
        base = str(work / "cluster-profile.json")
        cmd = [sys.executable, "-m", "autopar", "profile", "--cluster", "cpu:2", "--quick",
               "--out", base]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, timeout=timeout_s, env=_env())
    extra = ["--profile", base] if base else []
    rows = {}
    for name, flags in plans.items():
        out = work / name.split()[0]
        if not (reuse and (out / "profile.json").is_file()):  # else a run kept from before
            _plan([*flags, *extra, "--out", str(out)], timeout_s)
            launch = ["bash", str(out / "launch.sh"), "--steps", str(steps + plain_steps),
                      "--profile-steps", str(profile_steps)]  # fmt: skip
            proc = subprocess.run(launch, capture_output=True, text=True, timeout=timeout_s,
                                  env=_env(), cwd=out)  # fmt: skip
            if proc.returncode != 0:
                raise RuntimeError(f"{name}: {' '.join(launch)} failed: {proc.stderr[-3000:]}")
            (out / "train.log").write_text(proc.stdout)
        plain = plain_step_times(out, steps) if plain_steps else []
        rows[name] = measured_row(out, plain)
    first = next(iter(plans))
    fitted_path = work / "refit-profile.json"
    _plan([*plans[first], *extra, "--refit", str(Path(rows[first]["dir"]) / "profile.json"),
           "--refit-out", str(fitted_path)], timeout_s)  # fmt: skip
    measured_by = (
        f"the median of {plain_steps} unprofiled" if plain_steps else "the mean of the profiled"
    )
    return {**predict_again(rows, first, fitted_path), "base": base or "catalog",
            "measured_by": measured_by}  # fmt: skip


def plain_step_times(case: Path, after: int) -> list[float]:
    """The logged ``step_time_s`` of the steps after step ``after`` (the unprofiled ones) in the
    run's log (``train.log``, rank 0's JSON lines)."""
    times = []
    for line in (case / "train.log").read_text().splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            if rec.get("step", 0) > after and "step_time_s" in rec:
                times.append(float(rec["step_time_s"]))
    return times


def measured_row(case: Path, plain: list[float] | None = None) -> dict:
    """A run's measured step time (the slowest rank's mean profiled step without the data wait;
    with ``plain``, the median of those unprofiled steps' times) and the step its plan
    predicted, from the profile.json in ``case``."""
    from autopar.cost_model.measured import compare_terms, load_measured

    step = next(
        r for r in compare_terms(load_measured(case / "profile.json")) if r.term == "step_time"
    )
    measured = statistics.median(plain) if plain else step.measured
    return {"dir": str(case), "measured_s": measured, "profiled_s": step.measured,
            "before_s": step.predicted}  # fmt: skip


def predict_again(rows: dict[str, dict], first: str, fitted_path: Path) -> dict:
    """Each run's plan predicted again with the fitted profile (``rows`` from measured_row;
    ``first``: the run the refit learned from); the errors before and after, as a dict."""
    from autopar.cost_model.profile_data import load_profile

    from autopar import Plan
    from autopar.api import _trace_plan_model
    from autopar.refit_cli import replayed

    fitted = load_profile(fitted_path)
    graph = None
    for row in rows.values():
        plan = Plan.from_json((Path(row["dir"]) / "plan.json").read_text())
        graph = graph or _trace_plan_model(plan, None)
        row["after_s"] = replayed(plan, graph, fitted).predicted.step_time_s
        for k in ("before", "after"):
            row[f"{k}_err"] = (row[f"{k}_s"] - row["measured_s"]) / row["measured_s"]
    others = [r for name, r in rows.items() if name != first] or list(rows.values())
    return {
        "load": os.getloadavg()[0],
        "fitted": str(fitted_path),
        "refit_from": first,
        "plans": rows,
        "median_abs_err_before": statistics.median(abs(r["before_err"]) for r in others),
        "median_abs_err_after": statistics.median(abs(r["after_err"]) for r in others),
        "changes": fitted.assumptions[-1],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default=None, help="keep the plans and profiles here")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--plain-steps", type=int, default=0,
                   help="unprofiled steps after the profiled ones, in the same run: measure "
                   "each plan by their median step")  # fmt: skip
    p.add_argument("--base", default="measure", help="measure (default), none, or a profile")
    p.add_argument("--reuse", action="store_true", help="refit the runs kept in --work again")
    p.add_argument("--json", action="store_true")
    p.add_argument("--cases", nargs="+", type=Path, default=None, metavar="RUN_DIR",
                   help="no new runs: runs kept elsewhere (each dir: plan.json, profile.json), "
                   "predicted again with --fitted (benchmarks/gpu_check.sh refit)")  # fmt: skip
    p.add_argument("--fitted", type=Path, default=None, help="the refit profile, with --cases")
    args = p.parse_args()
    load = os.getloadavg()[0]
    if args.cases:
        if args.fitted is None:
            p.error(
                "--cases needs --fitted FITTED.json (plan ... --refit RUN/profile.json --refit-out)"
            )
        rows = {case.name: measured_row(case) for case in args.cases}
        res = {**predict_again(rows, args.cases[0].name, args.fitted), "base": "the runs' plans"}
        where = ", ".join(str(case) for case in args.cases)
    else:
        with tempfile.TemporaryDirectory(prefix="autopar-refit-") as tmp:
            work = Path(args.work or tmp)
            work.mkdir(parents=True, exist_ok=True)
            base = None if args.base == "none" else args.base
            res = run_loop(
                work,
                steps=args.steps,
                profile_steps=args.profile_steps,
                plain_steps=args.plain_steps,
                base=base,
                reuse=args.reuse,
            )
        where = "examples/gpt.py on cpu:2, global batch 8, seq 64"
    res["load_before"] = load
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    print(f"{where}; refit from {res['refit_from']} alone, base {res['base']}; "
          f"load average {load:.1f} -> {res['load']:.1f}")  # fmt: skip
    print(f"measured: {res.get('measured_by', 'the mean of the profiled')} steps")
    print(f"{'plan':<14}{'measured':>11}{'before':>11}{'err':>8}{'after':>11}{'err':>8}")
    for name, r in res["plans"].items():
        seen = "  (refit from this run)" if name == res["refit_from"] else ""
        print(f"{name:<14}{r['measured_s'] * 1e3:>8.2f} ms{r['before_s'] * 1e3:>8.2f} ms"
              f"{r['before_err']:>+8.0%}{r['after_s'] * 1e3:>8.2f} ms{r['after_err']:>+8.0%}{seen}")  # fmt: skip
    print(
        f"median |error| of the other plans: before {res['median_abs_err_before']:.0%}, "
        f"after {res['median_abs_err_after']:.0%}"
    )
    print(res["changes"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
