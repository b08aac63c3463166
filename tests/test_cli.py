"""The ``plan`` CLI end to end: a good run, every bad input as one ``error:`` line with exit 2 and
no ``--out`` left behind, and a 70B-parameter plan made without allocating weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from planner.cli import main

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples" / "gpt.py")


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_writes_outputs_and_prints_summary(tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, _ = _run(
        [GPT, "--cluster", "cpu:2", "--global-batch", "8", "--seq-len", "32", "--out", str(out)],
        capsys,
    )
    assert code == 0
    assert {p.name for p in out.iterdir()} == {"plan.json", "train.py", "launch.sh"}
    assert "mesh" in stdout and "step time" in stdout and "tokens/s" in stdout
    plan = json.loads((out / "plan.json").read_text())
    assert plan["version"] == 1 and plan["mesh"]["pp"] == 1


def test_json_output_is_clean(capsys):
    code, stdout, _ = _run(
        [GPT, "--cluster", "cpu:2", "--global-batch", "4", "--seq-len", "16", "--json"], capsys
    )
    assert code == 0
    assert json.loads(stdout)["mesh"]["dp"] * json.loads(stdout)["mesh"]["fsdp"] in (1, 2)


BAD_FILES = {
    "no_factory.py": "import torch\n",
    "forward_fails.py": textwrap.dedent(
        """
        import torch
        from torch import nn

        class Broken(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 8)

            def forward(self, x):
                return self.lin(x.view(-1, 3, 5))

        def build_model():
            return Broken()

        def make_batch(batch_size, seq_len=None):
            return (torch.randn(batch_size, 8),), torch.randn(batch_size, 8)
        """
    ),
}


@pytest.mark.parametrize(
    ("case", "argv_tail", "needle"),
    [
        ("missing file", ["missing.py"], "does not exist"),
        ("no build_model", ["no_factory.py"], "build_model"),
        ("forward fails", ["forward_fails.py"], "forward"),
        ("unknown device", [GPT, "--cluster", "8xB999"], "B999"),
        ("malformed mesh", [GPT, "--mesh", "tp:2"], "--mesh"),
        ("mesh not dividing world", [GPT, "--mesh", "tp=3"], "does not divide the world size 4"),
        ("tp not dividing heads", [GPT, "--cluster", "cpu:3", "--mesh", "tp=3"], "attention heads"),
        ("bad dtype", [GPT, "--dtype", "fp8"], "fp8"),
        ("zero seq len", [GPT, "--seq-len", "0"], "sequence length 0"),
        ("zero batch", [GPT, "--global-batch", "0"], "global batch 0"),
    ],
)
def test_bad_input_is_one_error_line_and_leaves_nothing(
    case, argv_tail, needle, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    for name, text in BAD_FILES.items():
        (tmp_path / name).write_text(text)
    defaults = {"--cluster": "cpu:4", "--global-batch": "8", "--seq-len": "16"}
    argv = list(argv_tail)
    for flag, value in defaults.items():
        if flag not in argv:
            argv += [flag, value]
    out = tmp_path / "out"
    code, stdout, stderr = _run(argv + ["--out", str(out)], capsys)
    assert code == 2, (case, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (case, stderr)
    assert needle in lines[0], (case, lines[0])
    assert "Traceback" not in stderr
    assert not out.exists()


def test_debug_shows_the_traceback(tmp_path, capsys):
    code, _, stderr = _run(
        [str(tmp_path / "nope.py"), "--cluster", "cpu:2", "--global-batch", "2", "--debug"],
        capsys,
    )
    assert code == 2 and "Traceback" in stderr and stderr.strip().endswith("")


def test_console_script_exit_code_and_single_line():
    """The installed entry point, as a user runs it (a fresh process)."""
    proc = subprocess.run(
        [sys.executable, "-m", "planner.cli", GPT, "--cluster", "cpu:0", "--global-batch", "8"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: ") and len(proc.stderr.strip().splitlines()) == 1


def test_70b_gpt_plans_on_meta_under_3gb():
    """80 layers, dim 8192, 64 heads, vocab 128256 (~70B parameters) for 8x8xH100: the planner
    builds and traces it on meta; the child's peak RSS is read from its own rusage."""
    env = dict(
        os.environ,
        GPT_LAYERS="80",
        GPT_DIM="8192",
        GPT_HEADS="64",
        GPT_VOCAB="128256",
        GPT_MAX_SEQ="2048",
    )
    script = textwrap.dedent(
        f"""
        import json, resource, subprocess, sys
        p = subprocess.run([sys.executable, "-m", "planner.cli", {GPT!r}, "--cluster",
                            "8x8xH100", "--global-batch", "64", "--seq-len", "2048",
                            "--dtype", "bf16", "--json"], capture_output=True, text=True)
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        print(json.dumps({{"rc": p.returncode, "rss": rss, "err": p.stderr[-2000:],
                          "plan": json.loads(p.stdout) if p.returncode == 0 else None}}))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    result = json.loads(proc.stdout)
    assert result["rc"] == 0, result["err"]
    plan = result["plan"]
    params = sum(1 for _ in plan["layers"])
    assert params == 80 + 4  # tok_emb, pos_emb, 80 blocks, ln_f, head
    assert plan["mesh"]["pp"] * plan["mesh"]["dp"] * plan["mesh"]["fsdp"] * plan["mesh"]["tp"] == 64
    assert plan["predicted"]["peak_memory_bytes"] <= 80e9
    assert result["rss"] < 3 * 2**30, f"peak RSS {result['rss'] / 2**30:.2f} GiB"
