"""``plan MODEL --cluster SPEC --refit RUN/profile.json [--refit ...] [--profile BASE.json]
[--refit-out FITTED.json]``: fit the cost model to runs' profiles (:mod:`cost_model.refit`),
store the fitted cluster profile, and plan with it (``--profile FITTED.json`` names it next
time). With ``--explain``, a table per run: each term predicted before and after the refit
against what that run measured.

The fitted profile is written to ``--refit-out`` (default: ``refit-profile.json`` beside the
first run profile) through a temporary sibling and a rename; an existing file there is replaced
only if it is a cluster profile (a file autopar wrote), else refused in one line.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import tempfile
from pathlib import Path

from autopar._plan import Plan
from autopar.cost_model import apply_profile, load_profile, parse_cluster
from autopar.cost_model.measured import (
    MeasuredProfile,
    MeasuredProfileError,
    TermComparison,
    check_belongs,
    compare_terms,
    load_measured,
)
from autopar.cost_model.precision import precision
from autopar.cost_model.profile_data import Profile, ProfileError, parse_profile
from autopar.cost_model.refit import RefitResult, RunFacts, fit_runs, rows_of
from autopar.errors import UserError
from autopar.model_file import resolve_model_spec

__all__ = ["DEFAULT_NAME", "add_refit_args", "refit", "refit_for_cli", "refit_table", "run_facts"]

DEFAULT_NAME = "refit-profile.json"


def add_refit_args(p: argparse.ArgumentParser) -> None:
    """The ``--refit`` and ``--refit-out`` flags."""
    p.add_argument(
        "--refit",
        action="append",
        default=None,
        metavar="RUN_PROFILE_JSON",
        help="fit the cost model to a run's profile.json (train.py --profile-steps N) and plan "
        "with it; repeatable",
    )
    p.add_argument(
        "--refit-out",
        default=None,
        metavar="PATH.json",
        help=f"where --refit writes the fitted cluster profile (default: {DEFAULT_NAME} beside "
        "the first run profile)",
    )


def _autopar_version() -> str:
    try:
        return importlib.metadata.version("autopar")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _base_profile(cluster, profile_path: str | None) -> Profile:
    if profile_path is not None:
        return load_profile(profile_path)
    return Profile(
        source="datasheet",
        name=f"{cluster.spec} catalog",
        device=cluster.device,
        intra_node=cluster.intra_node,
        inter_node=cluster.inter_node,
        backend=cluster.backend,
        world_size=cluster.devices_per_node,
    )


def run_facts(plan: Plan, name: str) -> RunFacts:
    """The numbers of a plan that a refit needs."""
    regime = precision(plan.training.dtype, plan.mesh, "autopar")
    return RunFacts(
        name=name,
        mesh=plan.mesh.model_dump(),
        global_batch=plan.training.global_batch,
        num_microbatches=plan.schedule.num_microbatches,
        dtype=plan.training.dtype,
        optimizer=plan.training.optimizer,
        tensor_parallel=dict(plan.tensor_parallel),
        checkpointed=frozenset(f for f, mode in plan.checkpointing.items() if mode != "none"),
        adamw_step_bytes=regime.adamw_step_bytes,
    )


def _ran_plan(run: MeasuredProfile, where: str) -> Plan:
    try:
        return Plan.from_json(json.dumps(run.plan))
    except UserError as e:
        raise MeasuredProfileError(
            f"profile {where!r} holds a plan this autopar cannot read ({e}): emit the plan "
            "again and profile that run"
        ) from None


def refit(args: argparse.Namespace, progress=None) -> tuple[str, RefitResult, list]:
    """Fit, write the fitted profile; returns (its path, the result, per run (name, profile,
    plan that ran, graph)) for the explanation."""
    from autopar.api import _trace_plan_model

    if args.model is None or args.cluster is None:
        raise UserError("--refit needs MODEL and --cluster: the model and cluster the runs ran")
    out = _out_path(args)
    cluster = parse_cluster(args.cluster)
    base = _base_profile(cluster, args.profile)
    based = apply_profile(cluster, base)
    file, factory = resolve_model_spec(args.model)
    version = _autopar_version()
    runs, rows, graphs = [], [], {}
    for path in args.refit:
        run = load_measured(path)
        check_belongs(run, model={"file": file, "factory": factory}, cluster=cluster.spec,
                      autopar_version=version, name=path)  # fmt: skip
        plan = _ran_plan(run, path)
        key = (plan.training.seq_len, plan.training.dtype)
        if key not in graphs:
            if progress is not None:
                progress(f"tracing the model for {path}")
            graphs[key] = _trace_plan_model(plan, None)
        graph = graphs[key]
        rows.append(rows_of(run, graph, run_facts(plan, path), based.device))
        runs.append((path, run, plan, graph))
    result = fit_runs(base, based, rows, sources=list(args.refit))
    _write_profile(result.profile, out)
    return str(out), result, runs


def refit_for_cli(args: argparse.Namespace, progress=None) -> tuple[str, str | None]:
    """What ``plan --refit`` does before it plans: (the fitted profile's path, which the search
    then loads as ``--profile``; the ``--explain`` table, or None)."""
    path, result, runs = refit(args, progress)
    return path, (refit_table(result, runs) if args.explain else None)


def _out_path(args: argparse.Namespace) -> Path:
    out = Path(args.refit_out) if args.refit_out else Path(args.refit[0]).parent / DEFAULT_NAME
    out = out.absolute()
    if out.is_dir():
        raise UserError(f"--refit-out {str(out)!r} is a directory: give a file path (.json)")
    if out.exists() or out.is_symlink():
        try:
            parse_profile(out.read_text(encoding="utf-8"), where=str(out))
        except (ProfileError, OSError, UnicodeDecodeError):
            raise UserError(
                f"--refit-out {str(out)!r} exists and is not a cluster profile autopar wrote: "
                "give another path (autopar replaces only its own profiles)"
            ) from None
    return out


def _write_profile(profile: Profile, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(profile.model_dump_json(indent=1))
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def replayed(plan: Plan, graph, fitted: Profile) -> Plan:
    """``plan`` predicted again with the fitted profile (its mesh, schedule, checkpointing
    pinned: :func:`planner.search.replay`)."""
    from autopar.planner.search import replay

    return replay(graph, plan.model_copy(update={"cluster": apply_profile(plan.cluster, fitted)}))


def after_terms(run: MeasuredProfile, plan: Plan, graph, fitted: Profile) -> list[TermComparison]:
    """:func:`compare_terms` of ``run`` with the prediction the fitted profile makes for its
    plan."""
    again = replayed(plan, graph, fitted)
    doc = {**(run.plan or {}), "predicted": json.loads(again.to_json())["predicted"]}
    return compare_terms(run.model_copy(update={"plan": doc}))


def refit_table(result: RefitResult, runs: list) -> str:
    """Per run: each term measured, predicted before and after the refit, the errors."""
    lines = [f"refit: {result.profile.name}"]
    for k, (a, b) in sorted(result.changes.items()):
        lines.append(f"  {k:<40} {a:>12.4g} -> {b:<12.4g}")
    if not result.changes:
        lines.append("  (no coefficient changed)")
    for name, run, plan, graph in runs:
        before = compare_terms(run)
        after = {r.term: r for r in after_terms(run, plan, graph, result.profile)}
        lines += ["", f"run {name} (mesh {plan.mesh.short()}): predicted before / after the "
                  "refit against measured", f"  {'term':<22}{'measured':>12}{'before':>12}"
                  f"{'err':>8}{'after':>12}{'err':>8}"]  # fmt: skip
        for row in before:
            new = after.get(row.term)
            lines.append(
                f"  {row.term:<22}{_fmt(row.measured, row.unit):>12}"
                f"{_fmt(row.predicted, row.unit):>12}{_err(row.predicted, row.measured):>8}"
                f"{_fmt(new and new.predicted, row.unit):>12}"
                f"{_err(new and new.predicted, row.measured):>8}"
            )
    return "\n".join(lines) + "\n"


def _fmt(x: float | None, unit: str) -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.2f} ms" if unit == "s" else f"{x / 2**20:.1f} MiB"


def _err(predicted: float | None, measured: float) -> str:
    if not predicted or not measured:
        return "-"
    return f"{(predicted - measured) / measured:+.0%}"
