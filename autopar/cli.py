"""The ``plan`` command: model file -> plan -> (optionally) the emitted training program.

    plan examples/gpt.py --cluster cpu:4 --global-batch 8 --seq-len 64 --out out/
    plan --plan out/plan.json --out out2/        # re-emit a saved (maybe hand-edited) plan

Exit codes: 0 success; 2 a user error (an :class:`autopar.errors.UserError` or an argparse usage
error: one ``error:`` line on stderr, ``--debug`` adds the traceback); 130 interrupted (Ctrl-C,
one line); 1 anything else, which is a bug: its traceback is printed.

Output: stdout carries what was asked for (the summary table; with ``--json`` the plan JSON and
nothing else); stderr carries messages and, on a terminal, a progress line that rewrites itself
while the model is traced and the meshes are scored (never with ``--quiet``, never when stderr is
not a TTY). ``--explain`` (breakdowns and alternatives) and ``--why-not MESH`` (the search with
those pins, diffed against the chosen plan) print after the summary, or on stderr with
``--json`` so that stdout stays one JSON document; ``--quiet`` drops the summary but not what
``--explain``/``--why-not`` ask for. ``--report PATH.html`` writes the self-contained HTML report.

Every argument is checked before the model file is imported, cheapest first. While the model is
loaded, traced and planned, what it and torch print (stdout, stderr, torch's log handlers, and
file descriptor 1 itself, which C code and ``os.write(1, ...)`` use) is held back: replayed on
stderr when the run succeeds (so ``--json`` stays one JSON document), dropped when it fails (so a
failed run prints one line; ``--debug`` replays it). A model file that calls ``os._exit`` or
``sys.exit``, or leaves a non-daemon thread running, is a user error, not an exit.

``--out DIR`` and ``--report`` are resolved to absolute paths before the model file is imported
(a model file may ``os.chdir``), and ``--report``'s folder is checked to be writable before
``--out`` is written. ``--out`` replaces only the files autopar wrote there before, each
atomically, and leaves everything else in DIR (see :mod:`autopar.codegen.write`); a failed run
leaves no new directory and an existing one untouched.

``--plan`` loads ``plan.json`` through :meth:`Plan.from_json` (JSON, pydantic validation and the
version check: no pickle, no eval, the model file is not imported) and re-emits it without
searching. The search flags (``--cluster``, ``--global-batch``, ``--seq-len``, ``--dtype``,
``--optimizer``, ``--mesh``, ``--sync-batchnorm``...) are refused with it: a plan fixes them. ``MODEL`` may be given to point
the emitted script at another copy of the model file (checked to exist, not imported).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

from autopar._plan import Plan
from autopar.codegen.launch import run_hint
from autopar.codegen.write import existing_ancestor, read_manifest, resolve_out
from autopar.collect import full_collections_deferred
from autopar.cost_model import apply_profile, load_profile, parse_cluster
from autopar.errors import UserError
from autopar.model_file import (
    ModelFileError,
    check_threads,
    resolve_model_spec,
    stray_threads,
)
from autopar.planner.plan import ModelRef, PlanError
from autopar.planner.request import check_pins, check_training
from autopar.planner.schedules import SCHEDULES
from autopar.planner.search import parse_mesh
from autopar.refit_cli import add_refit_args, refit_for_cli

EXIT_USER, EXIT_BUG, EXIT_INTERRUPTED = 2, 1, 130
_SEARCH_FLAGS = {
    "cluster": "--cluster",
    "global_batch": "--global-batch",
    "seq_len": "--seq-len",
    "dtype": "--dtype",
    "optimizer": "--optimizer",
    "mesh": "--mesh",
    "schedule": "--schedule",
    "microbatches": "--microbatches",
    "checkpoint": "--checkpoint",
    "sync_batchnorm": "--sync-batchnorm",
    "profile": "--profile",
    "refit": "--refit",
    "elastic": "--elastic",
}


class UsageError(UserError):
    """Arguments that do not fit together; one line, like every other user error."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, like every other user error
        self.exit(2, f"error: {message} (see `plan --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="plan",
        description="Plan data/tensor parallelism for a PyTorch model and emit a torchrun script.",
        epilog="With --plan, the search flags are refused: the saved plan fixes them.",
    )
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="model file: path/to/model.py[:factory] (optional with --plan: overrides the "
        "plan's model file)",
    )
    p.add_argument(
        "--plan",
        default=None,
        metavar="PLAN_JSON",
        help="re-emit a saved plan.json (or a directory holding one) without searching",
    )
    p.add_argument(
        "--cluster", default=None, help="cpu:N, 8xH100, 4x8xA100-80GB, H200, or a .json/.toml file"
    )
    p.add_argument("--global-batch", type=int, default=None, help="samples per optimizer step")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample (sequence models)")
    p.add_argument("--dtype", default=None, help="compute dtype: fp32 (default) or bf16")
    p.add_argument("--optimizer", default=None, choices=["adamw", "sgd"], help="default adamw")
    p.add_argument(
        "--mesh", default=None, help="pin mesh axes, e.g. tp=2 or dp=2,tp=2 (pp, dp, fsdp, tp)"
    )
    p.add_argument(
        "--schedule",
        default=None,
        choices=SCHEDULES,
        help="pipeline schedule when pp > 1 (default: searched)",
    )
    p.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="microbatches per step (pp > 1) or accumulation steps (pp = 1)",
    )
    p.add_argument(
        "--checkpoint",
        default=None,
        choices=["auto", "none", "full"],
        help="activation checkpointing: chosen per layer (auto, default), none, or every layer",
    )
    p.add_argument(
        "--sync-batchnorm",
        action="store_const",
        const=True,
        default=None,
        help="take batch norms' statistics over the data-parallel ranks' global batch",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="PROFILE_JSON",
        help="cost model fitted by `plan profile --cluster ... --out profile.json`",
    )
    add_refit_args(p)
    p.add_argument(
        "--elastic",
        default=None,
        metavar="MIN:MAX",
        help="plan every node count MIN..MAX of --cluster's nodes (same global batch and "
        "settings) and emit them all: the run takes the plan for the nodes it finds",
    )
    p.add_argument("--out", default=None, help="write plan.json, train.py, launch.sh here")
    p.add_argument("--json", action="store_true", help="print the plan JSON on stdout")
    p.add_argument(
        "--explain",
        action="store_true",
        help="explain the plan: step time and memory by part, the alternatives and why each lost",
    )
    p.add_argument(
        "--why-not",
        default=None,
        metavar="MESH",
        help="search again with these axes pinned (e.g. tp=8,pp=2) and diff against the plan",
    )
    p.add_argument(
        "--report",
        default=None,
        metavar="PATH.html",
        help="write a self-contained HTML report (timeline, memory, alternatives; needs the "
        "viz extra: matplotlib)",
    )
    p.add_argument(
        "-q", "--quiet", action="store_true", help="print nothing but errors (and --json)"
    )
    p.add_argument(
        "--no-cache",
        action="store_true",
        help="trace the model again instead of reading the plan cache ($AUTOPAR_CACHE_DIR, "
        "else ~/.cache/autopar), and store nothing there",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    return p


def main(argv: list[str] | None = None) -> int:
    """The ``plan`` command; returns the exit code. Called without ``argv`` (the console script,
    ``python -m autopar``) it owns the process: a thread a model file left running cannot keep
    it alive."""
    from_command_line = argv is None
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["profile"]:  # plan profile --cluster cpu:N --out profile.json [--quick]
        from autopar.cost_model.profile import main as profile_main

        return profile_main(argv[1:])
    args = build_parser().parse_args(argv)
    held = io.StringIO()
    progress = ProgressLine(sys.stderr, enabled=not args.quiet)
    threads = set(threading.enumerate())
    code = EXIT_BUG
    try:
        _resolve_paths(args)
        _check_extras(args)
        # torch's import, the trace and the search: no full collections (autopar.collect)
        with _hold_output(held, args.model or args.plan), full_collections_deferred():
            from autopar.api import PlanningSession, why_not
            from autopar.cache import PlanCache

            # why-not reuses the graph the search traced; the plan cache keeps it for next time
            session = PlanningSession(None if args.no_cache else PlanCache.default())
            plans = None  # --elastic: node count -> plan; `plan` is the largest's
            if args.plan is not None:
                plan = _load_saved(args)
            else:
                plans = _search(args, progress, session)
                plan = plans[max(plans)]
            why = None
            if args.why_not is not None:
                why = why_not(plan, args.why_not, session=session, progress=progress)
            check_threads(threads, args.model)
        progress.clear()
        sys.stderr.write(held.getvalue())
        code = _report(plan, args, why, plans if args.elastic else None)
    except UserError as e:
        progress.clear()
        if args.debug:
            sys.stderr.write(held.getvalue())
            traceback.print_exc()
        print(f"error: {_one_line(e)}", file=sys.stderr)
        code = EXIT_USER
    except KeyboardInterrupt:
        progress.clear()
        print("error: interrupted (Ctrl-C): nothing was written", file=sys.stderr)
        code = EXIT_INTERRUPTED
    except Exception:
        progress.clear()
        sys.stderr.write(held.getvalue())
        traceback.print_exc()
        print(
            "plan: internal error (a bug in autopar, not in your input): please report it with "
            "the traceback above",
            file=sys.stderr,
        )
        code = EXIT_BUG
    finally:
        progress.clear()
    if from_command_line and stray_threads(threads):
        # a model file's non-daemon thread would keep the process alive after main returns
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


class ProgressLine:
    """One status line on a terminal, rewritten in place (``\\r`` + erase line), cleared at the
    end. Silent unless enabled and ``stream`` is a TTY, so pipes, files and ``--json`` consumers
    never see it. The stream is bound at creation: the CLI holds sys.stderr back while planning.
    """

    def __init__(self, stream, enabled: bool = True) -> None:
        self.stream = stream
        self.enabled = enabled and _isatty(stream)
        self.start = time.perf_counter()
        self.shown = False

    def __call__(self, text: str) -> None:
        if not self.enabled:
            return
        width = shutil.get_terminal_size((100, 24)).columns
        line = f"plan: {text}  [{time.perf_counter() - self.start:.1f} s]"[: max(10, width - 1)]
        self.stream.write(f"\r\x1b[2K{line}")
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()
            self.shown = False


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _resolve_paths(args: argparse.Namespace) -> None:
    """Absolute ``--out`` (a symbolic link followed) and ``--report``, fixed before the model file
    runs: it may change the working directory."""
    if args.out is not None:
        args.out = str(resolve_out(args.out))
    if args.report is not None:
        args.report = os.path.abspath(args.report)


def _check_extras(args: argparse.Namespace) -> None:
    """The flags that need more than the search, checked before any work."""
    if args.why_not is not None and not parse_mesh(args.why_not):
        raise UsageError("--why-not needs at least one axis: e.g. --why-not tp=2,pp=2")
    if args.report is not None:
        if Path(args.report).is_dir():
            raise UsageError(f"--report {args.report!r} is a directory: give a file path (.html)")
        _check_writable_folder(args.report)
        if importlib.util.find_spec("matplotlib") is None:
            raise UsageError(
                "--report draws its figures with matplotlib, which is not installed: "
                "pip install 'autopar[viz]' (or pip install matplotlib)"
            )


def _check_writable_folder(path_text: str) -> None:
    """``--report``'s folder (or its nearest existing ancestor) must be a directory this user can
    write, so that a report that cannot be written fails before ``--out`` is written."""
    parent = existing_ancestor(Path(path_text))
    if not parent.is_dir():
        raise UsageError(
            f"--report {path_text!r} lies under {str(parent)!r}, which is a file: give a path in "
            "a directory"
        )
    try:  # a real probe: permissions, read-only mounts and /proc-like folders all show here
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as e:
        raise UsageError(
            f"--report {path_text!r} cannot be written: {str(parent)!r} does not take new files "
            f"({e.strerror or e}); choose a writable path"
        ) from None
    existing = Path(path_text)
    if existing.is_symlink() or (existing.exists() and not existing.is_file()):
        raise UsageError(
            f"--report {path_text!r} exists and is not a regular file: give a path to a file"
        )


# -- the search ----------------------------------------------------------------------------------


def _search(args: argparse.Namespace, progress=None, session=None) -> dict[int, Plan]:
    """Check every flag (cheap ones first), then import, trace and plan the model: node count
    -> plan (one for ``--cluster``, or one per node count of ``--elastic``)."""
    from autopar.api import plan_model_file
    from autopar.elastic import parse_elastic, plan_node_counts

    missing = [
        name
        for name, value in (
            ("MODEL", args.model),
            ("--cluster", args.cluster),
            ("--global-batch", args.global_batch),
        )
        if value is None
    ]
    if missing:
        raise UsageError(
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required to plan: "
            "e.g. plan model.py --cluster cpu:2 --global-batch 8 (or re-emit a saved plan "
            "with --plan plan.json)"
        )
    dtype = args.dtype if args.dtype is not None else "fp32"
    optimizer = args.optimizer or "adamw"
    check_training(args.global_batch, args.seq_len, dtype, optimizer)  # the API's own check
    pins = parse_mesh(args.mesh) if args.mesh is not None else {}
    cluster = parse_cluster(args.cluster)
    elastic = parse_elastic(args.elastic) if args.elastic is not None else None
    if args.refit:  # fit the runs' profiles; the search then plans with the fitted one
        args.profile, args.refit_table = refit_for_cli(args, progress)
    profile = load_profile(args.profile) if args.profile is not None else None
    if profile is not None:  # measured (or datasheet) figures replace the catalog's
        cluster = apply_profile(cluster, profile)

    def plan_one(on) -> Plan:
        check_pins(pins, on, args.global_batch)  # before the model is traced
        plan = plan_model_file(
            args.model,
            on,
            global_batch=args.global_batch,
            seq_len=args.seq_len,
            dtype=dtype,
            mesh=pins,
            optimizer=optimizer,
            schedule=args.schedule,
            microbatches=args.microbatches,
            checkpoint=args.checkpoint or "auto",
            progress=progress,
            session=session,
            sync_batchnorm=bool(args.sync_batchnorm),
        )
        if profile is None:
            return plan
        used = f"cost model: {profile.source} profile {profile.name!r} from {args.profile}"
        return plan.model_copy(update={"notes": [*plan.notes, used]})

    if elastic is None:
        return {cluster.num_nodes: plan_one(cluster)}
    return plan_node_counts(plan_one, cluster, *elastic)


# -- a saved plan --------------------------------------------------------------------------------


def _load_saved(args: argparse.Namespace) -> Plan:
    """``--plan``: load and validate a saved plan (never importing or executing anything)."""
    given = [flag for name, flag in _SEARCH_FLAGS.items() if getattr(args, name) is not None]
    if given:
        raise UsageError(
            f"--plan re-emits a saved plan, which fixes {', '.join(given)}: drop "
            f"{'it' if len(given) == 1 else 'them'}, or plan the model file again without --plan"
        )
    plan = load_plan(args.plan)
    if args.model is not None:
        path, factory = resolve_model_spec(args.model)
        plan = plan.model_copy(update={"model": ModelRef(file=path, factory=factory)})
    else:
        _check_model_exists(plan, args.plan)
    _check_emittable(plan, args.plan)
    return plan


def _check_model_exists(plan: Plan, where: str) -> None:
    """The emitted script imports the plan's model file: it must be there (not imported here)."""
    try:
        resolve_model_spec(plan.model.file)
    except ModelFileError as e:
        raise PlanError(
            f"--plan {where!r}: model.file {plan.model.file!r} cannot be used ({e}); pass the "
            "model file's path as MODEL (plan MODEL --plan plan.json) or edit model.file"
        ) from None


def _check_emittable(plan: Plan, where: str) -> None:
    """Everything codegen refuses, before anything is written: emitting is pure."""
    from autopar.codegen import emit

    try:
        emit(plan)
    except UserError:
        raise
    except ValueError as e:  # codegen's checks of a plan it cannot turn into a script
        raise PlanError(f"--plan {where!r}: {_one_line(e)}") from None


def load_plan(path_text: str) -> Plan:
    """A plan from ``plan.json`` (or a directory holding one), validated; PlanError otherwise."""
    path = Path(path_text)
    if path.is_dir() and (path / "plan.json").is_file():
        path = path / "plan.json"
    if not path.is_file():
        what = "is a directory without plan.json" if path.is_dir() else "does not exist"
        raise PlanError(
            f"--plan {path_text!r} {what}: pass the plan.json that `plan ... --out DIR` wrote"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PlanError(
            f"--plan {path_text!r} is not UTF-8 text (byte {e.start}): pass a plan.json"
        ) from None
    except OSError as e:
        raise PlanError(f"--plan {path_text!r} cannot be read ({e.strerror}): check it") from None
    try:
        plan = Plan.from_json(text)
    except PlanError as e:
        raise PlanError(f"--plan {path_text!r}: {e}") from None
    _check_consistent(plan, path_text)
    return plan


def _check_consistent(plan: Plan, where: str) -> None:
    """What a hand edit can break that pydantic alone does not see: the mesh rules with the
    plan's own cluster and training (:meth:`Plan.mesh_refusal`), and checkpointing by layer."""
    refusal = plan.mesh_refusal()
    if refusal is not None:
        raise PlanError(f"--plan {where!r}: mesh {plan.mesh.short()}: {refusal.line()}")
    unknown = [fqn for fqn in plan.checkpointing if fqn not in plan.layers]
    if unknown:
        raise PlanError(
            f"--plan {where!r}: checkpointing names {unknown[0]!r}, which is not in layers: "
            "checkpoint only layers the plan lists"
        )


# -- output --------------------------------------------------------------------------------------


def _write(plan: Plan, out: str, elastic: dict[int, Plan] | None = None) -> Path:
    """Emit into ``out`` atomically; parents this call created are removed again on failure."""
    path = Path(out).absolute()
    created = []
    parent = path.parent
    while not parent.exists():
        created.append(parent)
        parent = parent.parent
    try:
        if elastic is None:
            return plan.emit(out)
        from autopar.codegen import write_outputs

        return write_outputs(plan, out, elastic=elastic)
    except OSError as e:
        raise UsageError(
            f"--out {out!r} cannot be written ({e.strerror or e}): choose a writable directory"
        ) from e
    finally:
        if not path.exists():
            for folder in created:  # innermost first
                with contextlib.suppress(OSError):
                    folder.rmdir()


def _report(plan: Plan, args: argparse.Namespace, why=None, elastic=None) -> int:
    if args.out:
        out = _write(plan, args.out, elastic)
        if not args.quiet:
            print(f"wrote {out}: {', '.join(sorted(read_manifest(out)))}", file=sys.stderr)
    expl = None
    if args.explain or args.report:
        from autopar.planner.explain import explain

        expl = explain(plan)
    if args.report:
        _write_report(plan, args, expl, why, elastic)
    if args.json:
        print(plan.to_json())
        for line in plan.batch_coupling.warnings if plan.batch_coupling and not args.quiet else []:
            print(f"warning: {line}", file=sys.stderr)  # the summary's, which --json leaves out
    elif not args.quiet:
        print(plan.summary())
        if args.out:
            nodes = (min(elastic), max(elastic)) if elastic is not None else None
            print("\n" + run_hint(plan, args.out, nodes))
    # asked-for text goes to stdout, unless stdout carries the JSON
    extra = sys.stderr if args.json else sys.stdout
    texts = [t.text for t in (expl if args.explain else None, why) if t is not None]
    if elastic is not None and args.explain:
        from autopar.planner.explain import elastic_table

        texts.insert(1, elastic_table(elastic))
    texts += [t for t in [getattr(args, "refit_table", None)] if t]
    for i, text in enumerate(texts):
        gap = i > 0 or not (args.quiet or args.json)
        print(("\n" if gap else "") + text, end="", file=extra)
    return 0


def _write_report(plan: Plan, args: argparse.Namespace, expl, why, elastic=None) -> None:
    from autopar.codegen.report import write_report

    try:
        path = write_report(plan, args.report, expl, why, elastic=elastic)
    except OSError as e:
        raise UsageError(
            f"--report {args.report!r} cannot be written ({e.strerror or e}): choose a writable "
            "path"
        ) from e
    if not args.quiet:
        print(f"wrote {path}", file=sys.stderr)


@contextlib.contextmanager
def _hold_output(held: io.StringIO, model: str | None) -> Iterator[None]:
    """Send stdout, stderr, torch's log handlers and file descriptor 1 into ``held`` for the
    duration, and make ``os._exit`` a user error instead of an exit."""
    with _hold_fd1(held), _no_os_exit(model), _hold_streams(held):
        yield


@contextlib.contextmanager
def _hold_fd1(held: io.StringIO) -> Iterator[None]:
    """File descriptor 1 (what C code, subprocesses and ``os.write(1, ...)`` write to) goes to a
    temporary file, appended to ``held`` afterwards: stdout carries only what the CLI prints."""
    with contextlib.ExitStack() as stack:
        try:
            sys.stdout.flush()
            saved = os.dup(1)
        except (OSError, ValueError):  # no fd 1 to protect
            yield
            return
        stack.callback(os.close, saved)
        sink = stack.enter_context(tempfile.TemporaryFile())
        os.dup2(sink.fileno(), 1)
        try:
            yield
        finally:
            with contextlib.suppress(OSError, ValueError):
                sys.stdout.flush()
            os.dup2(saved, 1)
            sink.seek(0)
            held.write(sink.read().decode("utf-8", errors="replace"))


@contextlib.contextmanager
def _no_os_exit(model: str | None) -> Iterator[None]:
    """``os._exit`` ends the process on the spot, with no error line and maybe exit code 0; while
    the model file runs it raises a ModelFileError instead."""
    real = os._exit

    def refuse(status: int = 0) -> None:
        raise ModelFileError(
            f"model file {model!r} called os._exit({status}), which would end the planner with "
            "no plan and no message: do not exit from the model file (raise an exception "
            "instead)"
        )

    os._exit = refuse
    try:
        yield
    finally:
        os._exit = real


@contextlib.contextmanager
def _hold_streams(held: io.StringIO) -> Iterator[None]:
    """Send stdout, stderr and torch's log handlers into ``held`` for the duration."""
    handlers = []
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if name.split(".")[0] == "torch" and isinstance(logger, logging.Logger):
            for h in logger.handlers:
                if type(h) is logging.StreamHandler and h not in [x for x, _ in handlers]:
                    handlers.append((h, h.stream))
    # assign, not setStream(): that flushes the old stream, which may be closed by now (a
    # handler made while an earlier caller had redirected stderr)
    for h, _ in handlers:
        h.stream = held
    try:
        with contextlib.redirect_stdout(held), contextlib.redirect_stderr(held):
            yield
    finally:
        for h, stream in handlers:
            h.stream = stream


def _one_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
