"""The installed package, not the source tree: build the wheel, install it into a fresh venv,
and plan from it with the ``plan`` command and ``python -m autopar``.

The fresh venv gets its third-party dependencies (torch, ortools, pydantic, ...) from this
checkout's venv through a path file (no network), never autopar itself: its editable finder
is not activated there, so only the wheel provides ``autopar``; ``import planner`` (the old
top-level name) must fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def _run(args, cwd, timeout=300, env=None) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{args}: {proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with the autopar wheel installed; returns its bin directory."""
    tmp = tmp_path_factory.mktemp("wheel")
    wheels = tmp / "dist"
    # build from a copy of the tracked files: setuptools keeps a build/ folder in the tree it
    # builds, whose stale files (a module moved away) would land in the next wheel
    source = tmp / "src"
    tracked = _run(["git", "ls-files", "-z"], cwd=ROOT).stdout.split("\0")
    for name in filter(None, tracked):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
          "-w", str(wheels), str(source)], cwd=tmp)  # fmt: skip
    (wheel,) = wheels.glob("autopar-*.whl")
    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=False)
    bin_dir = env_dir / "bin"
    python = bin_dir / "python"
    site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                cwd=tmp).stdout.strip()  # fmt: skip
    # third-party dependencies from this venv, after the fresh venv's own site-packages
    (Path(site) / "zz_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", site,
          str(wheel)], cwd=tmp)  # fmt: skip
    # pip --target does not write console scripts: the `plan` entry point as pip would
    (bin_dir / "plan").write_text(
        f"#!{python}\nimport sys\nfrom autopar.cli import main\nsys.exit(main())\n"
    )
    (bin_dir / "plan").chmod(0o755)
    return bin_dir


def test_the_wheel_installs_one_import_root(installed, tmp_path):
    python = str(installed / "python")
    code = (
        "import importlib.util, autopar\n"
        "from autopar import auto_parallelize, Plan\n"
        "print(autopar.__file__)\n"
        "print([m for m in ('planner', 'ir', 'codegen', 'cost_model') "
        "if importlib.util.find_spec(m) is not None])\n"
    )
    out = _run([python, "-c", code], cwd=tmp_path).stdout.splitlines()
    assert "site-packages" in out[0] and str(ROOT) not in out[0], out
    assert out[1] == "[]", f"generic top-level names importable: {out[1]}"
    proc = subprocess.run([python, "-c", "import planner"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode != 0 and "No module named 'planner'" in proc.stderr


def test_plan_runs_from_the_wheel(installed, tmp_path):
    model = tmp_path / "gpt.py"
    model.write_text((ROOT / "examples" / "gpt.py").read_text())
    args = [str(model), "--cluster", "cpu:2", "--global-batch", "4", "--seq-len", "16",
            "--json", "--out", str(tmp_path / "out")]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    plan = json.loads(_run([str(installed / "plan"), *args], cwd=tmp_path, env=env).stdout)
    assert plan["cluster"]["spec"] == "cpu:2" and plan["predicted"]["step_time_s"] > 0
    assert (tmp_path / "out" / "train.py").is_file()
    assert (tmp_path / "out" / "autopar_runtime" / "__init__.py").is_file()
    again = _run([str(installed / "python"), "-m", "autopar", *args[:-2], "--out",
                  str(tmp_path / "out2")], cwd=tmp_path, env=env)  # fmt: skip
    assert json.loads(again.stdout)["mesh"] == plan["mesh"]
