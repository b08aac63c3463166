"""benchmarks/overhead.py (issue 26 item 6): the hand-written baseline applies the plan's own
tensor-parallel styles, and the benchmark's scripts run end to end (slow: planning and four
torchrun runs)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from autopar.codegen.apply import runtime

ROOT = Path(__file__).resolve().parent.parent
rt = runtime()  # the emitted autopar_runtime package, imported as train.py imports it


def handwritten():
    path = ROOT / "benchmarks" / "overhead" / "handwritten.py"
    spec = importlib.util.spec_from_file_location("handwritten", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def layouts(style) -> tuple:
    return tuple(
        getattr(style, name, None)
        for name in ("input_layouts", "output_layouts", "desired_input_layouts",
                     "sequence_sharding", "use_local_output")
    )  # fmt: skip


def test_stock_styles_are_the_runtime_styles():
    """Each style name the baseline translates to stock torch is, in the emitted runtime, the
    same kind of style with the same layouts: the two programs run one TP plan."""
    for name, stock in handwritten().STOCK_STYLES.items():
        emitted = rt.TP_STYLES[name]
        assert isinstance(emitted, type(stock)), (name, type(emitted), type(stock))
        assert layouts(emitted) == layouts(stock), name


@pytest.mark.slow
def test_overhead_benchmark_runs(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--cases", "tp",
           "--steps", "4", "--warmup", "1", "--rounds", "1", "--parts", "--keep", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode in (0, 3), done.stderr  # 3: a ratio over the limit (a figure)
    row = next(line for line in done.stdout.splitlines() if line.startswith("tp "))
    emitted, hand, ratio = map(float, row.split()[1:4])
    assert emitted > 0 and hand > 0 and ratio == pytest.approx(emitted / hand, abs=1e-3)
    parts = next(line for line in done.stdout.splitlines() if "parts (median ms" in line)
    for name in (
        "train_step",
        "grad_norm_share",
        "StepTotals",
        "totals_wait",
        "log_step",
        "batches",
    ):
        assert f" {name} " in parts, parts
