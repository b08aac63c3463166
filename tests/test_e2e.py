"""End to end as a user runs it: ``plan MODEL --cluster cpu:4 --out DIR`` picks the plan by search,
then the emitted program trains under torchrun and ``--verify`` proves it matches the
single-process model."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from test_codegen_dist import _run

ROOT = Path(__file__).resolve().parents[1]
VERIFY_OK = re.compile(r"^verify: ok max_loss_diff=(\S+) max_param_diff=(\S+)$", re.MULTILINE)

pytestmark = pytest.mark.dist


def _plan(model: str, out: Path, *extra: str) -> dict:
    code, log = _run(
        [sys.executable, "-m", "autopar", str(ROOT / "examples" / model), "--cluster",
         "cpu:4", "--global-batch", "8", "--out", str(out), *extra],
        ROOT,
    )  # fmt: skip
    assert code == 0, log
    return json.loads((out / "plan.json").read_text())


@pytest.mark.parametrize(
    ("model", "extra"),
    [
        # covered by test_readme_commands_pass_verify_with_adamw: gpt.py planned for cpu:4, --verify
        pytest.param("gpt.py", ["--seq-len", "32"], marks=pytest.mark.slow),
        pytest.param("mlp.py", [], marks=pytest.mark.slow),
    ],
)
def test_planner_choice_on_4_ranks_trains_like_one_process(model, extra, tmp_path):
    out = tmp_path / "out"
    plan = _plan(model, out, *extra)
    mesh = plan["mesh"]
    assert mesh["pp"] * mesh["dp"] * mesh["fsdp"] * mesh["tp"] == 4
    code, log = _run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
         str(out / "train.py"), "--steps", "3", "--optimizer", "sgd", "--verify"],
        tmp_path,
    )  # fmt: skip
    assert code == 0, log
    steps = [json.loads(line) for line in log.splitlines() if line.startswith('{"step"')]
    assert [s["step"] for s in steps] == [1, 2, 3]
    match = VERIFY_OK.search(log)
    assert match, log
    assert float(match.group(1)) <= 1e-5 and float(match.group(2)) <= 1e-5


def test_readme_commands_pass_verify_with_adamw(tmp_path):
    """The README's by-hand example: default optimizer (AdamW), 5 steps, --verify."""
    out = tmp_path / "out"
    _plan("gpt.py", out, "--seq-len", "64")
    code, log = _run([str(out / "launch.sh"), "--steps", "5", "--verify"], tmp_path)
    assert code == 0, log
    assert VERIFY_OK.search(log), log
