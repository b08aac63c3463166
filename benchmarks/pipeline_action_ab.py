"""The pipeline action's two fits side by side on the same runs: stages that compute, or tiny ones.

    python benchmarks/pipeline_action_ab.py [--cluster cpu:2] [--rounds 2] [--steps 20]

One quick profile (``plan profile --quick``) measures the two-stage 1F1B step both ways (the tiny
MLP, and an MLP block that computes for a few ms per microbatch: ``cost_model.profile_bench``);
``pipeline_action_s`` is fitted from the stages that compute (what ``plan profile`` stores) and,
for the comparison, from the tiny ones alone (what it stored before). The pipeline plans of
``benchmarks/calibrate.py`` are planned on the first, emitted and run ``--rounds`` times each
(the median of each run's steps after the first, then the median over the rounds), and each is
predicted on both figures (``planner.search.replay``: the same program, mesh, schedule and
microbatches). It prints per plan the measured step, both predictions and their errors, and the
median |error| of each: the one difference between the two is the per-action figure, and the
measurements are the same, so the machine's load moves both alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from autopar.cost_model import parse_cluster  # noqa: E402
from autopar.cost_model.profile import apply_profile, run_profile  # noqa: E402
from autopar.cost_model.profile_bench import MLP_BATCH, MLP_WIDTH  # noqa: E402
from autopar.cost_model.profile_fit import _fit_runtime_overheads  # noqa: E402
from calibrate import cases, plan_case, repredict, run_emitted  # noqa: E402

from autopar.session import PlanningSession  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cluster", default="cpu:2")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    base = parse_cluster(args.cluster)
    world = base.world_size
    profile = run_profile(args.cluster, quick=True)
    tiny_only = [
        s for s in profile.samples
        if s.bench != "pipeline" or s.op == "1f1b" and s.shape[1:] == [MLP_WIDTH, MLP_BATCH]
    ]  # fmt: skip
    tiny = _fit_runtime_overheads(tiny_only, profile.device, profile.intra_node, world)
    computing = profile.device.pipeline_action_s
    print(f"# pipeline_action_s: {computing * 1e3:.3f} ms from stages that compute, "
          f"{tiny['pipeline_action_s'] * 1e3:.3f} ms from tiny ones")  # fmt: skip
    tiny_profile = profile.model_copy(
        update={"device": profile.device.model_copy(update=tiny)}
    )  # fmt: skip
    on_computing, on_tiny = apply_profile(base, profile), apply_profile(base, tiny_profile)
    session = PlanningSession()
    rows = []
    with tempfile.TemporaryDirectory(prefix="pipeline_action_ab-") as tmp:
        pipelines = [c for c in cases(world) if c.mesh and c.mesh.get("pp", 1) > 1]
        plans = []
        for i, case in enumerate(pipelines):
            plan = plan_case(case, on_computing, session)
            directory = Path(tmp) / f"plan{i:02d}"
            plan.emit(directory)
            plans.append((case, plan, directory))
        measured: dict[str, list[float]] = {c.name: [] for c, _, _ in plans}
        for _ in range(args.rounds):  # every plan once per round, in turn
            for case, _, directory in plans:
                times = run_emitted(directory, world, args.steps, timeout_s=300)
                measured[case.name].append(statistics.median(times[1:]))
        for case, plan, _ in plans:
            m = statistics.median(measured[case.name])
            a = plan.predicted.step_time_s
            b = repredict(session, plan, on_tiny)
            rows.append((case.name, m, b, a))
    print(f"{'plan':<24}{'measured ms':>12}{'tiny-stage fit':>16}{'error':>9}"
          f"{'computing fit':>15}{'error':>9}")  # fmt: skip
    for name, m, b, a in rows:
        print(f"{name:<24}{m * 1e3:>12.2f}{b * 1e3:>16.2f}{b / m - 1:>+9.1%}"
              f"{a * 1e3:>15.2f}{a / m - 1:>+9.1%}")  # fmt: skip
    for label, k in (("tiny-stage fit", 2), ("computing fit", 3)):
        err = statistics.median(abs(r[k] / r[1] - 1) for r in rows)
        print(f"median |error| with the {label}: {err:.1%}")


if __name__ == "__main__":
    main()
