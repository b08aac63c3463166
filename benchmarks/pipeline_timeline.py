"""A pipeline step on CPU, action by action, against what the stage search charges for it.

    python benchmarks/pipeline_timeline.py [--mesh pp=2] [--schedule 1f1b] [--microbatches 2]
        [--global-batch 8] [--seq-len 64] [--steps 12] [--last 3] [--profile P.json]
        [--keep DIR]

Plans ``examples/gpt.py`` for cpu:2 with the mesh, schedule and microbatches pinned (no
checkpointing; the built-in catalog, or ``--profile`` a profile.json from ``plan profile``),
emits it and runs its ``train.py`` under ``torchrun --standalone`` with a ``sitecustomize`` on
``PYTHONPATH`` (written into a temporary directory, never into the emitted program) that times,
on every rank, torch's own pipeline calls: each stage's ``forward_one_chunk`` and
``backward_one_chunk`` (``F<i>``, ``B<i>``), the loss of each microbatch on the last stage
(``loss<i>``), the posting of each batch of sends and receives (``post``) and the waits for them
(``wait``), and the schedule's whole ``step``. Both ranks share one clock
(``time.perf_counter``: CLOCK_MONOTONIC on Linux).

It prints, for each of the ``--last`` steps, each rank's actions from the earliest rank's start of
the step (start, duration, in ms), and then, per rank over those steps, the mean of: the forward
and backward actions against the plan's predicted stage forward and backward of one microbatch
(``predicted.stages``; the mean of a rank's stages under an interleaved schedule), the losses, the
posts, the waits, and the rest of the step (what the schedule does between these calls), with the
pipeline's predicted runtime and p2p charge (``pp_comm``) beside them. What the stage search
charges per action is its stage's forward or backward (the loss is in the last layer's cost); what
an action costs beyond that is the runtime's per-action work (``pipeline_action_s``), the posts and
waits the link's.
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

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "gpt.py"

# timed in every rank of the run (not in torchrun's agent: it has no LOCAL_RANK)
SITECUSTOMIZE = """
import json, os, time
if "LOCAL_RANK" in os.environ:
    import torch.distributed.pipelining.schedules as _s
    import torch.distributed.pipelining.stage as _st

    _events = []
    _out = os.environ["AUTOPAR_TIMELINE_DIR"]

    def _timed(owner, name, label):
        real = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                end = time.perf_counter()
                _events.append((label(args, kwargs), start, end))
                if name == "step":
                    with open(os.path.join(_out, f"rank{os.environ['RANK']}.json"), "w") as f:
                        json.dump(_events, f)

        setattr(owner, name, timed)

    _timed(_st._PipelineStageBase, "forward_one_chunk", lambda a, k: f"F{a[1]}")
    _timed(_st._PipelineStageBase, "backward_one_chunk", lambda a, k: f"B{a[1]}")
    _timed(_s._PipelineSchedule, "_maybe_compute_loss", lambda a, k: f"loss{a[4]}")
    _timed(_s, "_batch_p2p", lambda a, k: "post")
    _timed(_s, "_wait_batch_p2p", lambda a, k: "wait")
    _timed(_s.PipelineScheduleSingle, "step", lambda a, k: "STEP")
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh", default="pp=2")
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--last", type=int, default=3, help="steps shown and averaged (the last ones)")
    p.add_argument("--profile", default=None, help="a profile.json (default: the catalog)")
    p.add_argument("--keep", type=Path, default=None, help="emit here and keep it")
    args = p.parse_args()
    if not 1 <= args.last < args.steps:
        p.error("--last must be >= 1 and below --steps (the first step is a warm-up)")
    with tempfile.TemporaryDirectory(prefix="pipeline_timeline_") as tmp:
        ranks, logged, plan = _run(args, Path(tmp))
    report(plan, ranks, logged, args.last)


def _run(args: argparse.Namespace, work: Path) -> tuple[dict[int, list], list[float], dict]:
    """Plan, emit and run the program with the timing hooks in ``work``: each rank's events, the
    logged step times and the plan."""
    out = args.keep or work / "out"
    plan_cmd = [sys.executable, "-m", "autopar", str(GPT), "--cluster", "cpu:2",
                "--global-batch", str(args.global_batch), "--seq-len", str(args.seq_len),
                "--mesh", args.mesh, "--schedule", args.schedule,
                "--microbatches", str(args.microbatches), "--checkpoint", "none",
                "--out", str(out), "-q"]  # fmt: skip
    if args.profile:
        plan_cmd += ["--profile", args.profile]
    subprocess.run(plan_cmd, check=True, capture_output=True, text=True)
    hooks = work / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
    events = work / "events"
    events.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DIST_TIMEOUT_S": "120",
           "PYTHONPATH": os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")]),
           "AUTOPAR_TIMELINE_DIR": str(events)}  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(out / "train.py"), "--steps", str(args.steps)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    if run.returncode != 0:
        sys.exit(f"error: the emitted program failed (exit {run.returncode}): "
                 f"{(run.stderr.strip().splitlines() or ['(no output)'])[-1]}")  # fmt: skip
    logged = [json.loads(x)["step_time_s"] for x in run.stdout.splitlines() if x.startswith("{")]
    plan = json.loads((out / "plan.json").read_text())
    ranks = {r: json.loads((events / f"rank{r}.json").read_text()) for r in (0, 1)}
    return ranks, logged, plan


def report(plan: dict, ranks: dict[int, list], logged: list[float], last: int) -> None:
    """Print the last ``last`` steps' actions and the per-rank means (module docstring)."""
    ms = 1e3
    steps = {r: [e for e in ev if e[0] == "STEP"][-last:] for r, ev in ranks.items()}
    predicted = plan["predicted"]
    stages = predicted["stages"]
    schedule = plan["schedule"]
    mesh = ",".join(f"{k}={v}" for k, v in plan["mesh"].items() if v > 1)
    parts = predicted["time_breakdown_s"]
    print(f"# {plan['model']['file']}: mesh {mesh}, {schedule['name']} with "
          f"{schedule['num_microbatches']} microbatches; predicted step "
          f"{predicted['step_time_s'] * ms:.2f} ms (pp_comm {parts['pp_comm'] * ms:.2f} ms, "
          f"bubble {parts['bubble'] * ms:.2f} ms); logged steps "
          f"{' '.join(f'{t * ms:.2f}' for t in logged[-last:])} ms")  # fmt: skip
    sums: dict[int, dict[str, list[float]]] = {r: {} for r in ranks}
    for k in range(last):
        t0 = min(steps[r][k][1] for r in ranks)
        print(f"step {len(logged) - last + k + 1}: each rank's actions (start from the earliest "
              f"rank's step start, duration), ms")  # fmt: skip
        for r, ev in ranks.items():
            _, start, end = steps[r][k]
            inside = [(n, a, b) for n, a, b in ev if start <= a and b <= end and n != "STEP"]
            cells = " ".join(f"{n}@{(a - t0) * ms:.2f}+{(b - a) * ms:.2f}" for n, a, b in inside)
            print(f"  rank {r}: step {(end - start) * ms:.2f} ({cells})")
            kinds = {"F": 0.0, "B": 0.0, "loss": 0.0, "post": 0.0, "wait": 0.0}
            counts = {"F": 0, "B": 0}
            for n, a, b in inside:
                kind = "loss" if n.startswith("loss") else n.rstrip("0123456789")
                kinds[kind] += b - a
                if kind in counts:
                    counts[kind] += 1
            kinds["rest"] = (end - start) - sum(kinds.values())
            for kind, t in kinds.items():
                sums[r].setdefault(kind, []).append(t)
            for kind in ("F", "B"):
                sums[r].setdefault(f"{kind} per action", []).append(
                    kinds[kind] / max(1, counts[kind])
                )
    print(
        f"per rank, the mean of those {last} steps, ms (predicted: the plan's stage per microbatch)"
    )
    for r in ranks:
        mean = {k: statistics.mean(v) * ms for k, v in sums[r].items()}
        held = [s for s in stages if s["rank"] == r]  # several with an interleaved schedule
        pf = f"{statistics.mean(s['fwd_s'] for s in held) * ms:.2f}" if held else "-"
        pb = f"{statistics.mean(s['bwd_s'] for s in held) * ms:.2f}" if held else "-"
        print(f"  rank {r}: forward {mean['F per action']:.2f} per action (predicted {pf}), "
              f"backward {mean['B per action']:.2f} (predicted {pb}); per step: losses "
              f"{mean['loss']:.2f}, posts {mean['post']:.2f}, waits {mean['wait']:.2f}, the "
              f"schedule's rest {mean['rest']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
