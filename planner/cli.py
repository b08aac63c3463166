"""The ``plan`` command: model file -> plan -> (optionally) the emitted training program.

    plan examples/gpt.py --cluster cpu:4 --global-batch 8 --seq-len 64 --out out/

Exit codes: 0 success, 2 a user error (one ``error:`` line on stderr; ``--debug`` adds the
traceback), 1 an internal error.
"""

from __future__ import annotations

import argparse
import sys
import traceback

from cost_model import ClusterSpecError
from ir.model_file import ModelFileError, load_model_file
from ir.trace import TraceError
from planner.plan import PlanError
from planner.search import PlanningError, parse_mesh

USER_ERRORS = (ModelFileError, TraceError, ClusterSpecError, PlanningError, PlanError, ValueError)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, like every other user error
        self.exit(2, f"error: {message} (see `plan --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="plan",
        description="Plan data/tensor parallelism for a PyTorch model and emit a torchrun script.",
    )
    p.add_argument("model", help="model file: path/to/model.py[:factory]")
    p.add_argument(
        "--cluster",
        required=True,
        help="cpu:N, 8xH100, 4x8xA100-80GB, H200, or a cluster .json/.toml file",
    )
    p.add_argument("--global-batch", type=int, required=True, help="samples per optimizer step")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample (sequence models)")
    p.add_argument("--dtype", default="fp32", help="compute dtype: fp32 or bf16")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    p.add_argument(
        "--mesh", default=None, help="pin mesh axes, e.g. tp=2 or dp=2,tp=2 (pp, dp, fsdp, tp)"
    )
    p.add_argument("--out", default=None, help="write plan.json, train.py, launch.sh here")
    p.add_argument("--json", action="store_true", help="print the plan JSON on stdout")
    p.add_argument(
        "-q", "--quiet", action="store_true", help="print nothing but errors (and --json)"
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except USER_ERRORS as e:
        if args.debug:
            traceback.print_exc()
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from planner.api import plan_model_file

    pins = parse_mesh(args.mesh) if args.mesh else {}
    if args.dtype not in ("fp32", "bf16"):
        raise ValueError(f"--dtype {args.dtype!r} is not one of fp32, bf16: pass --dtype fp32")
    mf = load_model_file(args.model)
    plan = plan_model_file(
        mf,
        args.cluster,
        global_batch=args.global_batch,
        seq_len=args.seq_len,
        dtype=args.dtype,
        mesh=pins,
        optimizer=args.optimizer,
    )
    if args.out:
        out = plan.emit(args.out)
        if not args.quiet:
            print(f"wrote {out}/train.py, plan.json, launch.sh", file=sys.stderr)
    if args.json:
        print(plan.to_json())
    elif not args.quiet:
        print(plan.summary())
        if args.out:
            print(
                f"\nrun it:  torchrun --standalone --nproc-per-node {plan.world_size} "
                f"{args.out.rstrip('/')}/train.py --steps 10 --verify"
            )
    return 0


def _one_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
