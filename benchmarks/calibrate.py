"""Calibrate the cost model against real runs: predicted vs measured step time of forced plans.

    python benchmarks/calibrate.py --cluster cpu:2 [--json] [--profile p.json | --catalog]
        [--steps 40] [--rounds 1] [--terms] [--also-profile other.json ...] [--refit-from NAME]

Without ``--profile`` it first profiles the cluster (``cost_model.profile``, the quick sweep) and
plans with the fitted figures; ``--catalog`` plans with the built-in catalog instead (to compare).
It plans 16 distinct forced plans (``examples/gpt.py`` and ``examples/mlp.py``: DDP, FSDP, TP, PP
with 1f1b and gpipe, CP, checkpointing, accumulation, microbatch counts; tests/models/moe.py with
EP; HF Llama (examples/hf/tiny-llama.json) with TP) plus the planner's own choice for the GPT and
the MLP, emits each, runs it under ``torchrun`` for a few steps, and takes the median
``step_time_s`` of the steps after the first. It prints per plan predicted vs measured, the median
absolute relative error, the Spearman rank correlation, and whether the planner's own choice is the
measured fastest (or within 10% of it). ``--rounds N`` runs every plan N times, in turn, and
takes the median of the rounds' medians (the machine's load moves between runs). Where it
profiles the cluster itself (no ``--profile``), each round of ``--rounds`` begins with a quick
profile of its own and predicts that round's plans with it (``planner.search.replay`` of each
plan on the round's figures): the profile is a measurement of a shared machine too, and one made
at one moment prices every run of the next ten minutes (2026-12-06: 7.4% then 15.8% median
error in two runs of the same code). A plan's predicted figure is then the median of its
rounds' predictions, and the first round's profile alone is printed beside it (``one profile``);
``--one-profile`` keeps the first round's for every round. ``--terms``
runs each plan once more with ``--profile-steps`` and prints its time terms, measured against
predicted (``cost_model.measured.compare_terms``). ``--also-profile P`` (repeatable) predicts the same runs with another profile too and prints
its median |error| and Spearman beside: profiles compared on one set of measurements (the
machine's drift between two calibrate runs is as large as the difference sought).
``--refit-from NAME`` closes the loop on the same measurements: it runs that case's plan once
more with ``--profile-steps``, refits the cost model from that one run over the profile the
plans were made with (``plan --refit``'s fit, ``autopar.refit_cli.refit``), predicts every plan
again with the fitted profile and prints the median |error| of the other plans (issue 27:
after one refit from a single run, the other plans). ``--json``
prints one object instead:
``{"plans": [{"mesh", "predicted_s", "measured_s", ...}], "median_abs_error", "spearman", ...}``.
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
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autopar.cost_model import Cluster, parse_cluster  # noqa: E402
from autopar.cost_model.profile import apply_profile, load_profile, run_profile  # noqa: E402

from autopar.session import PlanningSession  # noqa: E402

GPT = str(ROOT / "examples" / "gpt.py")
MLP = str(ROOT / "examples" / "mlp.py")
MOE = str(ROOT / "tests" / "models" / "moe.py")  # a top-2 mixture of experts, written by hand
LLAMA = "hf:" + str(ROOT / "examples" / "hf" / "tiny-llama.json")  # HF Llama, GQA, RMSNorm
# issue 27 item 4: from the profiled device alone
TARGET_ERROR = 0.10
TARGET_SPEARMAN = 0.95


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    global_batch: int
    seq_len: int | None
    mesh: dict[str, int] | None
    """None: the planner's own choice."""
    schedule: str | None = None
    microbatches: int | None = None
    checkpoint: str = "auto"


def cases(world: int) -> list[Case]:
    """The forced plans for ``world`` ranks (written for 2; other sizes scale the pinned axis)."""
    w = world
    return [
        Case("gpt ddp", GPT, 8, 64, {"dp": w}, checkpoint="none"),
        Case("gpt ddp ckpt", GPT, 8, 64, {"dp": w}, checkpoint="full"),
        Case("gpt fsdp", GPT, 8, 64, {"fsdp": w}, checkpoint="none"),
        Case("gpt tp", GPT, 8, 64, {"tp": w}, checkpoint="none"),
        Case("gpt pp 1f1b mb2", GPT, 8, 64, {"pp": w}, "1f1b", 2, "none"),
        Case("gpt pp gpipe mb4", GPT, 8, 64, {"pp": w}, "gpipe", 4, "none"),
        Case("gpt pp 1f1b mb8 ckpt", GPT, 8, 64, {"pp": w}, "1f1b", 8, "full"),
        Case("mlp ddp", MLP, 64, None, {"dp": w}, checkpoint="none"),
        Case("mlp fsdp", MLP, 64, None, {"fsdp": w}, checkpoint="none"),
        Case("mlp tp", MLP, 64, None, {"tp": w}, checkpoint="none"),
        Case("mlp pp 1f1b mb4", MLP, 64, None, {"pp": w}, "1f1b", 4, "none"),
        Case("gpt fsdp ckpt", GPT, 8, 64, {"fsdp": w}, checkpoint="full"),
        Case("gpt ddp accum 2", GPT, 8, 64, {"dp": w}, microbatches=2, checkpoint="none"),
        Case("gpt cp", GPT, 8, 64, {"cp": w}, checkpoint="none"),
        Case("moe ep", MOE, 8, 64, {"ep": w}, checkpoint="none"),
        Case("llama tp", LLAMA, 8, 64, {"tp": w}, checkpoint="none"),
        Case("gpt planner", GPT, 8, 64, None),
        Case("mlp planner", MLP, 64, None, None),
    ]


def plan_case(case: Case, cluster: Cluster, session=None):
    """The plan of one case, as ``plan`` makes it (``autopar.api.plan_model_file``) on
    ``cluster`` (the profiled device where given), its graph held by ``session``."""
    import autopar._plan  # noqa: F401  (the plan's actions: plan.emit)
    from autopar.api import plan_model_file

    return plan_model_file(
        case.model,
        cluster,
        global_batch=case.global_batch,
        seq_len=case.seq_len,
        mesh=dict(case.mesh or {}),
        schedule=case.schedule,
        microbatches=case.microbatches,
        checkpoint=case.checkpoint,  # type: ignore[arg-type]
        session=session,
    )


def quick_profile(spec: str, round_no: int):
    """``plan profile --quick`` of ``spec`` before round ``round_no``, saying so, and saying
    where the host was busy meanwhile (``Profile.busy_host``)."""
    _log(f"round {round_no}: profiling {spec} (--quick) ...")
    profile = run_profile(spec, quick=True)
    if busy := profile.busy_host():
        _log(f"round {round_no}'s profile: {busy}")
    return profile


def repredict(session, plan, cluster: Cluster) -> float:
    """The step time of ``plan`` (the program that runs) predicted on ``cluster``'s figures:
    its mesh, schedule, microbatches and checkpointing pinned (``planner.search.replay``)."""
    from autopar.planner.search import replay

    return replay(
        session.graph(plan), plan.model_copy(update={"cluster": cluster})
    ).predicted.step_time_s


def run_emitted(directory: Path, world: int, steps: int, timeout_s: float) -> list[float]:
    """step_time_s of every logged step of the emitted script."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        str(directory / "train.py"),
        "--steps",
        str(steps),
    ]
    env = {**os.environ, "DIST_TIMEOUT_S": "120", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    times = []
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            try:
                times.append(float(json.loads(line)["step_time_s"]))
            except (ValueError, KeyError):
                pass
    if proc.returncode != 0 or not times:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"{directory / 'train.py'} failed (exit {proc.returncode}): {tail}")
    return times


def profiled_terms(directory: Path, world: int, steps: int = 12) -> list[dict] | str:
    """The emitted plan run with ``--profile-steps`` (two warm-up steps first): per time term of
    :func:`autopar.cost_model.measured.compare_terms`, measured and predicted seconds per step
    (the error's text where the run failed)."""
    from autopar.cost_model.measured import compare_terms, load_measured

    out = directory / "profile.json"  # train.py replaces its own earlier profile, nothing else
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world}", str(directory / "train.py"), "--steps", str(steps + 2),
           "--profile-steps", str(steps), "--profile-out", str(out)]  # fmt: skip
    env = {**os.environ, "DIST_TIMEOUT_S": "120", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    if proc.returncode != 0 or not out.exists():
        return (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    return [
        {"term": t.term, "measured_s": t.measured, "predicted_s": t.predicted}
        for t in compare_terms(load_measured(out))
        if t.unit == "s" and not t.term.startswith("stage")
    ]


def refit_from(row: dict, case: Case, args, profile, out_root: Path, world: int):
    """``row``'s plan run once more with ``--profile-steps`` (unless this run's ``--terms`` did), the cost
    model refitted from that one run over ``profile`` (the one the plans were made with; None:
    the catalog's), as ``plan --refit`` fits it: the :class:`RefitResult`."""
    from autopar.refit_cli import refit

    run = Path(row["dir"]) / "profile.json"
    if not isinstance(row.get("terms"), list):  # not profiled by this run (--keep's folder
        terms = profiled_terms(Path(row["dir"]), world)  # may hold an older one's): now
        if isinstance(terms, str):
            raise RuntimeError(f"--refit-from {case.name!r}: its profiled run failed: {terms}")
    base = None
    if args.profile:
        base = args.profile
    elif profile is not None:
        base = str(out_root / "base-profile.json")
        Path(base).write_text(profile.model_dump_json(indent=1), encoding="utf-8")
    ns = argparse.Namespace(model=case.model, cluster=args.cluster, profile=base,
                            refit=[str(run)], refit_out=str(out_root / "refit-profile.json"))  # fmt: skip
    _log(f"refitting from the profiled run of {case.name!r} ...")
    return refit(ns)[1]


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman rank correlation (average ranks for ties)."""

    def ranks(xs: list[float]) -> list[float]:
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        out = [0.0] * len(xs)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 0.0


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cluster", default="cpu:2")
    p.add_argument("--profile", default=None, help="a profile.json (default: profile --quick)")
    p.add_argument("--catalog", action="store_true", help="plan with the built-in catalog")
    p.add_argument("--steps", type=int, default=40, help="steps per run (the first is dropped)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every plan this many times, in turn; the median of the rounds")  # fmt: skip
    p.add_argument("--terms", action="store_true",
                   help="run each plan again with --profile-steps and print its terms, "
                        "predicted against measured (cost_model.measured.compare_terms)")  # fmt: skip
    p.add_argument("--json", action="store_true")
    p.add_argument("--keep", default=None, help="emit the plans into this directory")
    p.add_argument("--only", default=None, help="comma-separated case names (default: all)")
    p.add_argument("--also-profile", action="append", default=[], metavar="P",
                   help="predict the same runs with this profile.json too, and print its median "
                        "|error| and Spearman beside (repeatable: profiles side by side, one set "
                        "of measurements)")  # fmt: skip
    p.add_argument("--refit-from", default=None, metavar="NAME",
                   help="refit from this case's profiled run alone and predict every plan "
                        "again with the fitted profile")  # fmt: skip
    p.add_argument("--one-profile", action="store_true",
                   help="profile once, before the first round (default: once per round, where "
                        "no --profile is given)")  # fmt: skip
    args = p.parse_args(argv)
    start = time.perf_counter()

    cluster = parse_cluster(args.cluster)
    if cluster.num_nodes != 1 or cluster.device.kind != "cpu":
        p.error("calibrate runs the plans here: use --cluster cpu:N")
    world = cluster.world_size
    only = set(args.only.split(",")) if args.only else None
    named = {c.name: c for c in cases(world)}
    if args.refit_from is not None and (args.refit_from not in named or (
            only is not None and args.refit_from not in only)):  # fmt: skip
        p.error(f"--refit-from {args.refit_from!r}: not a case this run makes; the cases are "
                f"{', '.join(repr(c) for c in named)}")  # fmt: skip
    if only is not None and (unknown := only - set(named)):
        p.error(f"--only {','.join(sorted(unknown))}: not a case; the cases are "
                f"{', '.join(repr(c) for c in named)}")  # fmt: skip
    source = "catalog"
    base = cluster
    reprofile = not args.catalog and not args.profile and not args.one_profile and args.rounds > 1
    if not args.catalog:
        if args.profile:
            profile = load_profile(args.profile)
            source = f"profile {args.profile}"
        else:
            profile = quick_profile(args.cluster, 1)
            source = f"profile (--quick, {profile.elapsed_s:.0f} s)"
            if reprofile:
                source += f", and one more before each of rounds 2-{args.rounds}"
        cluster = apply_profile(cluster, profile)
    session = PlanningSession()  # holds each plan's graph for the rounds' replays

    rows: list[dict] = []
    failed: list[dict] = []
    plans: dict[str, object] = {}  # a run's directory -> its plan
    with tempfile.TemporaryDirectory(prefix="calibrate-") as tmp:
        out_root = Path(args.keep or tmp)
        seen: dict[str, int] = {}
        for i, case in enumerate(cases(world)):
            if only is not None and case.name not in only:
                continue
            plan = plan_case(case, cluster, session)
            key = _plan_key(plan)
            if key in seen:  # the planner's choice repeats a forced plan: reuse its run
                row = dict(rows[seen[key]], name=case.name, own_choice=case.mesh is None)
                rows.append(row)
                _log(f"[{i + 1}] {case.name}: same plan as {rows[seen[key]]['name']}")
                continue
            directory = out_root / f"plan{i:02d}"
            plan.emit(directory)
            try:
                times = run_emitted(directory, world, args.steps, timeout_s=300)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                failed.append({"name": case.name, "mesh": plan.mesh.model_dump(), "error": str(e)})
                _log(f"[{i + 1}] {case.name}: FAILED: {e}")
                continue
            measured = statistics.median(times[1:] if len(times) > 1 else times)
            seen[key] = len(rows)
            plans[str(directory)] = plan
            rows.append(
                {
                    "name": case.name,
                    "dir": str(directory),
                    "mesh": plan.mesh.model_dump(),
                    "schedule": plan.schedule.name,
                    "microbatches": plan.schedule.num_microbatches,
                    "checkpointed": sum(v == "full" for v in plan.checkpointing.values()),
                    "tp_styles": len(plan.tensor_parallel),
                    "predicted_s": plan.predicted.step_time_s,
                    "measured_s": measured,
                    "own_choice": case.mesh is None,
                    "breakdown_s": plan.predicted.time_breakdown_s.model_dump(),
                }
            )
            _log(
                f"[{i + 1}] {case.name:<22} predicted {plan.predicted.step_time_s * 1e3:8.2f} ms"
                f"  measured {measured * 1e3:8.2f} ms"
            )

        # more rounds: every plan again, one after another (the machine's load moves between
        # runs), each plan's figure the median of its rounds' medians
        rounds = {r["dir"]: [r["measured_s"]] for r in rows}
        predictions = {r["dir"]: [r["predicted_s"]] for r in rows}
        for k in range(1, args.rounds):
            if reprofile:
                now = apply_profile(base, quick_profile(args.cluster, k + 1))
                for directory, plan in plans.items():
                    predictions[directory].append(repredict(session, plan, now))
            for directory in rounds:
                try:
                    times = run_emitted(Path(directory), world, args.steps, timeout_s=300)
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    _log(f"round {k + 1}: {directory}: FAILED: {e}")
                    continue
                rounds[directory].append(statistics.median(times[1:] if len(times) > 1 else times))
            _log(f"round {k + 1} of {args.rounds} done")
        for r in rows:
            r["rounds_s"] = rounds[r["dir"]]
            r["measured_s"] = statistics.median(rounds[r["dir"]])
            r["one_profile_s"] = r["predicted_s"]
            r["predictions_s"] = predictions[r["dir"]]
            r["predicted_s"] = statistics.median(predictions[r["dir"]])
        if args.terms:
            for r in rows:
                if not r["own_choice"] or not _dup(r, rows):
                    r["terms"] = profiled_terms(Path(r["dir"]), world)
        fitted = None
        if args.refit_from is not None and not any(r["name"] == args.refit_from for r in rows):
            _log(f"--refit-from {args.refit_from!r}: its run failed, nothing to refit from")
        elif args.refit_from is not None:
            fitted = refit_from(
                next(r for r in rows if r["name"] == args.refit_from), named[args.refit_from],
                args, None if args.catalog else profile, out_root, world,
            )  # fmt: skip

    distinct = [r for r in rows if not r["own_choice"] or not _dup(r, rows)]
    pred = [r["predicted_s"] for r in distinct]
    meas = [r["measured_s"] for r in distinct]
    errors = [abs(p_ - m) / m for p_, m in zip(pred, meas)]
    median_err = statistics.median(errors)
    rho = spearman(pred, meas)
    one = [r["one_profile_s"] for r in distinct]
    one_err = statistics.median(abs(p_ - m) / m for p_, m in zip(one, meas))
    one_rho = spearman(one, meas)

    def predicted_with(profile, leave_out: str | None = None) -> dict:
        """The same runs predicted with ``profile``: per plan, the median |error| (of the plans
        but ``leave_out``; None where none is left) and the Spearman."""
        figures = apply_profile(base, profile)
        alt = [repredict(session, plans[r["dir"]], figures) for r in distinct]
        errs = [abs(a - m) / m for a, m, r in zip(alt, meas, distinct) if r["name"] != leave_out]
        return {
            "predicted_s": dict(zip((r["name"] for r in distinct), alt, strict=True)),
            "median_abs_error": statistics.median(errs) if errs else None,
            "spearman": spearman(alt, meas),
        }

    # --also-profile: the same runs predicted with each other profile; --refit-from: with the
    # profile refitted from one of them, judged on the others
    others = [{"profile": path, **predicted_with(load_profile(path))} for path in args.also_profile]
    refitted = None
    if fitted is not None:
        after = predicted_with(fitted.profile, leave_out=args.refit_from)
        refitted = {"from": args.refit_from, "changes": fitted.profile.assumptions[-1],
                    "median_abs_error_others": after.pop("median_abs_error"), **after}  # fmt: skip
    verdicts = []
    for model in (GPT, MLP):
        name = Path(model).stem
        if only is not None and f"{name} planner" not in only:
            continue  # --only left the planner's own choice out: nothing to judge
        own = next((r for r in rows if r["own_choice"] and r["name"].startswith(name)), None)
        if own is None:
            verdicts.append({"model": name, "ok": False, "error": "the planner's plan failed"})
            continue
        # an idle TP group (tp > 1, no module sharded) repeats the single-device step on every
        # rank: the planner never picks one while a parallel plan fits, so it is not a rival
        fastest = min(
            (r for r in distinct if r["name"].startswith(name) and not _idle(r)),
            key=lambda r: r["measured_s"],
        )
        gap = own["measured_s"] / fastest["measured_s"] - 1
        verdicts.append(
            {
                "model": name,
                "planner_mesh": own["mesh"],
                "planner_measured_s": own["measured_s"],
                "fastest": fastest["name"],
                "fastest_measured_s": fastest["measured_s"],
                "gap": gap,
                "ok": gap <= 0.10,
            }
        )
    elapsed = time.perf_counter() - start
    if args.json:
        print(
            json.dumps(
                {
                    "cluster": args.cluster,
                    "cost_model": source,
                    "plans": distinct,
                    "median_abs_error": median_err,
                    "spearman": rho,
                    "one_profile": {"median_abs_error": one_err, "spearman": one_rho},
                    "also_profiles": others,
                    "refit": refitted,
                    "planner_choice": verdicts,
                    "failed": failed,
                    "elapsed_s": elapsed,
                },
                indent=1,
            )
        )
        return 0
    print(f"cluster {args.cluster}, cost model: {source}")
    print(f"{'plan':<24}{'mesh':<22}{'predicted ms':>14}{'measured ms':>13}{'error':>9}")
    for r in distinct:
        mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items() if v > 1) or "1"
        spread = ""
        if len(r["rounds_s"]) > 1:
            spread = "   rounds " + " ".join(f"{t * 1e3:.2f}" for t in r["rounds_s"])
        if len(r["predictions_s"]) > 1:
            spread += "   predicted " + " ".join(f"{t * 1e3:.2f}" for t in r["predictions_s"])
        print(
            f"{r['name']:<24}{mesh:<22}{r['predicted_s'] * 1e3:>14.2f}"
            f"{r['measured_s'] * 1e3:>13.2f}{(r['predicted_s'] / r['measured_s'] - 1):>+9.1%}"
            + spread
        )
    if args.terms:
        print("terms, measured / predicted ms per step (profiled runs; '-': not predicted):")
        for r in distinct:
            terms = r.get("terms")
            if isinstance(terms, str):
                print(f"  {r['name']:<22} profiled run failed: {terms}")
                continue
            cells = [
                f"{t['term']} {t['measured_s'] * 1e3:.1f}/"
                + ("-" if t["predicted_s"] is None else f"{t['predicted_s'] * 1e3:.1f}")
                for t in terms or []
                if t["measured_s"] or t["predicted_s"]
            ]
            print(f"  {r['name']:<22} " + ", ".join(cells))
    ok_err = "ok" if median_err <= TARGET_ERROR else "MISSED"
    ok_rho = "ok" if rho >= TARGET_SPEARMAN else "MISSED"
    print(f"median |error| {median_err:.1%} (target <= {TARGET_ERROR:.0%}: {ok_err})")
    print(f"Spearman rank correlation {rho:.3f} (target >= {TARGET_SPEARMAN}: {ok_rho})")
    if reprofile:
        print(f"with the first round's profile alone: median |error| {one_err:.1%}, "
              f"Spearman {one_rho:.3f}")  # fmt: skip

    def per_plan(o: dict, median: float | None) -> str:
        err = "-" if median is None else f"{median:.1%}"
        each = ", ".join(f"{r['name']} {o['predicted_s'][r['name']] / r['measured_s'] - 1:+.1%}"
                         for r in distinct)  # fmt: skip
        return f"{err}, Spearman {o['spearman']:.3f} ({each})"

    for o in others:
        print(f"with {o['profile']}: median |error| {per_plan(o, o['median_abs_error'])}")
    if refitted is not None:
        print(f"after one refit from the profiled run of {refitted['from']!r}: median |error| of "
              f"the other plans {per_plan(refitted, refitted['median_abs_error_others'])}")  # fmt: skip
        print(f"  {refitted['changes']}")
    for f in failed:
        print(f"FAILED {f['name']}: {f['error']}")
    for v in verdicts:
        if "error" in v:
            print(f"{v['model']}: planner's choice: {v['error']}")
            continue
        mesh = ",".join(f"{k}={n}" for k, n in v["planner_mesh"].items() if n > 1)
        print(
            f"{v['model']}: planner's choice {mesh} measured "
            f"{v['planner_measured_s'] * 1e3:.2f} ms; fastest measured {v['fastest']} "
            f"{v['fastest_measured_s'] * 1e3:.2f} ms, idle-TP plans aside ({v['gap']:+.1%}: "
            f"{'within 10%' if v['ok'] else 'MISSED'})"
        )
    print(f"elapsed {elapsed:.0f} s")
    return 0


def _idle(row: dict) -> bool:
    return row["mesh"]["tp"] > 1 and row["tp_styles"] == 0


def _plan_key(plan) -> str:
    data = json.loads(plan.to_json())
    keep = ("mesh", "stages", "schedule", "tensor_parallel", "checkpointing")
    return json.dumps({k: data[k] for k in keep}, sort_keys=True)


def _dup(row: dict, rows: list[dict]) -> bool:
    """A planner-choice row that repeats a forced plan's run (not a distinct plan)."""
    return any(
        r is not row and not r["own_choice"] and r["measured_s"] == row["measured_s"] for r in rows
    )


if __name__ == "__main__":
    sys.exit(main())
