"""The ``plan`` CLI end to end: a good run and a 70B-parameter plan made without allocating
weights. The bad inputs (one ``error:`` line, exit 2, nothing left behind) are in
``test_bad_inputs.py``."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from autopar.cli import main

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
    written = json.loads((out / ".autopar-outputs").read_text())["files"]
    assert {"plan.json", "train.py", "launch.sh"} <= set(written)
    tops = {f.split("/")[0] for f in written}  # the runtime package is one folder of files
    assert {p.name for p in out.iterdir()} == {*tops, ".autopar-outputs"}
    assert "mesh" in stdout and "step time" in stdout and "tokens/s" in stdout
    plan = json.loads((out / "plan.json").read_text())
    assert plan["version"] == 1 and math.prod(plan["mesh"].values()) == 2


def test_json_output_is_clean(capsys):
    code, stdout, _ = _run(
        [GPT, "--cluster", "cpu:2", "--global-batch", "4", "--seq-len", "16", "--json"], capsys
    )
    assert code == 0
    assert json.loads(stdout)["mesh"]["dp"] * json.loads(stdout)["mesh"]["fsdp"] in (1, 2)


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
        p = subprocess.run([sys.executable, "-m", "autopar", {GPT!r}, "--cluster",
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


def test_profile_then_plan_with_it(tmp_path, capsys):
    """`plan profile` measures this machine (quick sweep) and `--profile` plans with it; the plan
    says which cost model it used."""
    prof = tmp_path / "profile.json"
    assert main(["profile", "--cluster", "cpu:2", "--out", str(prof), "--quick"]) == 0
    capsys.readouterr()
    code, stdout, _ = _run(
        [GPT, "--cluster", "cpu:2", "--global-batch", "8", "--seq-len", "16", "--profile",
         str(prof), "--json"],
        capsys,
    )  # fmt: skip
    assert code == 0
    notes = json.loads(stdout)["notes"]
    assert any("measured profile" in n and str(prof) in n for n in notes), notes
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 99}')
    code, _, err = _run([GPT, "--cluster", "cpu:2", "--global-batch", "8", "--profile", str(bad)],
                        capsys)  # fmt: skip
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1
