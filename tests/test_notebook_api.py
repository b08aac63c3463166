"""The API as people use it in a notebook (issue 28, item 9): a model class that no file defines
plans (the file is needed only to emit, and emit says so); ``print(plan)`` prints the summary;
``plan.apply`` outside torchrun raises the project's own error with the fix."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from _plans import ROOT

# run as `python -c`, as a notebook runs its cells: __main__ has no file
NOTEBOOK = textwrap.dedent(
    """
    import torch
    from torch import nn
    from autopar import PlanningSession, auto_parallelize, why_not
    from autopar.errors import UserError

    class TwoLinears(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 16)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    session = PlanningSession()
    plan = auto_parallelize(
        TwoLinears(), "cpu:2", global_batch=4, example_inputs=(torch.zeros(2, 16),),
        session=session,
    )
    print("MODEL", plan.model.file)
    print("PRINTED", str(plan).splitlines()[0])
    print("REPR", repr(plan)[:5])
    for action in (lambda: plan.emit("out"), lambda: why_not(plan, "dp=2"),
                   lambda: plan.apply(TwoLinears())):
        try:
            action()
        except UserError as e:
            print("REFUSED", type(e).__name__, "|", e)
    print("WHY_NOT", why_not(plan, "dp=2", session=session).forced.mesh.short())
    """
)


def test_a_class_without_a_file_plans_prints_and_says_what_needs_a_file(tmp_path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", NOTEBOOK], cwd=tmp_path, capture_output=True, text=True,
        timeout=300, env={"PYTHONPATH": str(ROOT / "tests"), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert lines["MODEL"] == "<no file>: __main__.TwoLinears", out.stdout
    assert lines["PRINTED"].startswith("model "), out.stdout  # the summary, not a field dump
    assert lines["REPR"] == "Plan(", out.stdout
    refused = [line for line in out.stdout.splitlines() if line.startswith("REFUSED")]
    assert len(refused) == 3, out.stdout
    emit, trace_again, apply = refused
    assert "EmitError" in emit and "no file defines its class" in emit, emit
    assert "model_file='model.py'" in emit and not (tmp_path / "out").exists(), emit
    assert "PlanningError" in trace_again and "session=" in trace_again, trace_again
    assert "ApplyError" in apply and "torchrun --nproc-per-node 2" in apply, apply
    assert lines["WHY_NOT"].startswith("dp=2"), out.stdout
