"""Run an emitted ``train.py`` unchanged, with the time of each log line added to it.

    torchrun --standalone --nproc-per-node 2 benchmarks/overhead/stamped.py OUT/train.py ARGS...

The emitted program's own ``step_time_s`` covers forward to the optimizer step only; the
benchmark compares whole steps, so each call of the runtime's ``log_step`` gets one more field,
``t`` (``time.perf_counter()`` at the call, which its JSON line carries like any other, and
``cpu``, rank 0's ``time.process_time()``), and the step-to-step interval of ``t`` is the step
(with turns, see turns.py: from ``t0``, when the rank got its turn back after the last step's
line, to ``t``; ``cpu0`` likewise). With ``AUTOPAR_OVERHEAD_PARTS=1`` the runtime
functions the loop calls each step are timed too, and rank 0 prints one ``{"parts": {name:
[seconds per call, ...]}}`` line before the program exits: what each costs, for the overhead
report. Nothing else changes: the program runs from its own file, as ``torchrun train.py`` would.
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import sys
import time

import torch.distributed as dist

script = os.path.abspath(sys.argv[1])
sys.argv = [script, *sys.argv[2:]]
sys.path.insert(0, os.path.dirname(script))
import autopar_runtime as rt  # noqa: E402  (the emitted runtime beside train.py)
import turns  # noqa: E402  (benchmarks/overhead/turns.py, beside this file)

PARTS = [  # what train.py's loop calls per step (train_step calls finish_step, which calls
    # grad_norm_share, peak_memory_bytes and StepTotals, whose wait is timed as "totals_wait")
    "train_step", "forward", "finish_step", "grad_norm_share", "StepTotals", "check_finite",
    "log_step", "peak_memory_bytes", "after_step", "step_seed", "seed_rng", "dropout_off",
]  # fmt: skip
times: dict[str, list[float]] = {}


def timed(name: str, fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times.setdefault(name, []).append(time.perf_counter() - start)

    return run


def timed_batches(fn):
    """rt.batches is a generator: the time of each next() is the data loader's, per step."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        it = fn(*args, **kwargs)
        while True:
            start = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            times.setdefault("batches", []).append(time.perf_counter() - start)
            yield item

    return run


def replace(name: str, new) -> None:
    """Put ``new`` wherever the runtime holds its function ``name``: the module, or each module
    of the runtime package that defines or imports it (calls inside the runtime look it up
    there)."""
    old = getattr(rt, name)
    for module_name, module in list(sys.modules.items()):
        if module_name.split(".")[0] == "autopar_runtime" and getattr(module, name, None) is old:
            setattr(module, name, new)


log_step = rt.log_step
resumed: dict[str, float] = {}  # when this rank got its turn after the last step (turns.py)


def stamped_log_step(*args, **kwargs):
    log_step(*args, t=time.perf_counter(), cpu=time.process_time(), **resumed, **kwargs)
    turns.wait(args[1])  # --interleave: the other program's step runs here
    resumed.update(t0=time.perf_counter(), cpu0=time.process_time())


if os.environ.get("AUTOPAR_OVERHEAD_PARTS") == "1":
    rt.StepTotals.wait = timed("totals_wait", rt.StepTotals.wait)  # before StepTotals is wrapped
    for name in PARTS:
        replace(name, timed(name, getattr(rt, name)))
    replace("batches", timed_batches(rt.batches))
    finish = rt.finish

    def report_and_finish(ok: bool) -> None:
        if dist.is_initialized() and dist.get_rank() == 0:
            print(json.dumps({"parts": times}), flush=True)
        finish(ok)

    replace("finish", report_and_finish)
    log_step = rt.log_step  # the timed one
replace("log_step", stamped_log_step)
runpy.run_path(script, run_name="__main__")
