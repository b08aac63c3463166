"""The emitted runtime (issue 26): the package ``autopar_runtime/`` beside ``train.py``, one module
per concern, each at most 600 lines with an ``__all__`` and annotated public functions; torch-only
(it imports nothing of autopar, and the emitted program runs where autopar cannot be imported);
no test hook shipped (the tests inject their faults from tests/harness); every module of it in
the launch digest that the ranks of several nodes compare.

All in process but one run of a one-rank train.py (a few seconds)."""

from __future__ import annotations

import ast
import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _plans import forced_plan, harness_env, run_bounded
from autopar.codegen import emit, write_outputs
from autopar.codegen.apply import runtime
from autopar.codegen.write import MANIFEST

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "codegen" / "runtime" / "autopar_runtime"
MODULES = sorted(PACKAGE.glob("*.py"))
MLP = str(ROOT / "examples" / "mlp.py")
MAX_LINES = 600


def _mlp_plan():
    return forced_plan(MLP, 1, {}, {}, layers=[], seq_len=None)


def _top_level_names(tree: ast.Module) -> list[str]:
    names = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    return [n for n in names if n != "__all__"]


def _all_of(tree: ast.Module) -> list[str] | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [
            "__all__"
        ]:
            return [ast.literal_eval(e) for e in node.value.elts]
    return None


def test_the_package_is_emitted_beside_train_py(tmp_path: Path) -> None:
    """Every module, byte for byte, in autopar_runtime/ (listed in the manifest), no old
    autopar_runtime.py; train.py imports the package."""
    assert {p.stem for p in MODULES} >= {
        "launch", "tensor_parallel", "data_parallel", "pipeline", "context_parallel",
        "expert_parallel", "checkpoint", "data", "weights", "loop", "verify",
    }  # fmt: skip
    files = emit(_mlp_plan())
    assert "import autopar_runtime as rt" in files["train.py"]
    out = write_outputs(_mlp_plan(), tmp_path / "out")
    emitted = sorted((out / "autopar_runtime").glob("*.py"))
    assert [p.name for p in emitted] == [p.name for p in MODULES]
    assert all(p.read_bytes() == (PACKAGE / p.name).read_bytes() for p in emitted)
    assert not (out / "autopar_runtime.py").exists()
    manifest = json.loads((out / MANIFEST).read_text())["files"]
    assert {f"autopar_runtime/{p.name}" for p in MODULES} <= set(manifest)


def test_an_old_single_file_runtime_is_replaced_by_the_package(tmp_path: Path) -> None:
    """An earlier autopar's autopar_runtime.py (in the manifest, unchanged) goes; a file named
    autopar_runtime where the folder belongs is refused and kept."""
    out = write_outputs(_mlp_plan(), tmp_path / "out", extra={"autopar_runtime.py": "# old\n"})
    write_outputs(_mlp_plan(), out)
    assert not (out / "autopar_runtime.py").exists()
    assert (out / "autopar_runtime" / "__init__.py").is_file()
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "autopar_runtime").write_text("mine")
    with pytest.raises(Exception, match="already holds autopar_runtime, which is not a folder"):
        write_outputs(_mlp_plan(), blocked)
    assert (blocked / "autopar_runtime").read_text() == "mine"
    assert sorted(p.name for p in blocked.iterdir()) == ["autopar_runtime"]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.stem)
def test_each_module_is_small_states_its_names_and_annotates_them(path: Path) -> None:
    text = path.read_text()
    lines = text.count("\n")
    assert lines <= MAX_LINES, f"{path.name} has {lines} lines (at most {MAX_LINES})"
    tree = ast.parse(text)
    assert ast.get_docstring(tree), f"{path.name} says what it owns in its docstring"
    if path.name == "__init__.py":
        return
    names = _all_of(tree)
    assert names is not None, f"{path.name} has no __all__"
    defined = _top_level_names(tree)
    public = [n for n in defined if not n.startswith("_")]
    assert sorted(names) == sorted(public), (
        f"{path.name}: __all__ must list exactly its public names; "
        f"missing {sorted(set(public) - set(names))}, extra {sorted(set(names) - set(public))}"
    )
    bare = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            a = node.args
            params = [x for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x]
            bare += [f"{node.name}({x.arg})" for x in params if x.annotation is None]
            bare += [f"{node.name} -> ?"] if node.returns is None else []
    assert not bare, f"{path.name}: unannotated {bare}"


def test_the_package_reexports_every_modules_names() -> None:
    """``rt.X`` for each public name of each module (train.py reads them so), once each."""
    rt = runtime()
    union = []
    for path in MODULES:
        if path.stem != "__init__":
            union += importlib.import_module(f"autopar_runtime.{path.stem}").__all__
    assert len(union) == len(set(union)), "a public name is defined in two modules"
    assert sorted(rt.__all__) == sorted(union)
    for path in MODULES:
        if path.stem != "__init__":
            module = importlib.import_module(f"autopar_runtime.{path.stem}")
            assert all(getattr(rt, n) is getattr(module, n) for n in module.__all__)


def test_the_shipped_runtime_has_no_test_hook_and_no_autopar_import() -> None:
    bad = []
    for path in MODULES:
        text = path.read_text()
        if "AUTOPAR_TEST_" in text:
            bad.append(
                f"{path.name} reads a test hook (AUTOPAR_TEST_): tests/harness injects faults"
            )
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                roots = [] if node.level else [(node.module or "").split(".")[0]]
            else:
                continue
            if "autopar" in roots:
                bad.append(f"{path.name}:{node.lineno} imports autopar")
    assert not bad, "\n".join(bad)


def test_importing_the_runtime_leaves_pipelining_and_dynamo_unloaded() -> None:
    """Every rank imports the runtime at start-up: torch.distributed.pipelining and
    torch.nn.attention.bias (each loads torch._dynamo, ~1.4 s of CPU per rank) are imported
    only where a pipeline or context parallel runs."""
    probe = "import sys, autopar_runtime; print(sorted(m for m in sys.modules if m in {mods!r}))"
    mods = {"torch._dynamo", "torch.distributed.pipelining", "torch.nn.attention.bias"}
    out = subprocess.run(
        [sys.executable, "-c", probe.format(mods=mods)],
        cwd=PACKAGE.parent,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_emitted_program_runs_where_autopar_cannot_be_imported(tmp_path: Path) -> None:
    """A one-rank train.py, with every import of autopar failing (the harness's
    AUTOPAR_TEST_BLOCK_AUTOPAR), trains and verifies."""
    env = harness_env({"AUTOPAR_TEST_BLOCK_AUTOPAR": "1", "PYTHONPATH": ""})
    probe = subprocess.run(
        [sys.executable, "-c", "import autopar"], env=env, capture_output=True, text=True
    )
    assert probe.returncode == 1 and "autopar is blocked" in probe.stderr, probe.stderr
    out = write_outputs(_mlp_plan(), tmp_path / "out")
    rc, log = run_bounded(
        [sys.executable, "train.py", "--steps", "1", "--verify"],
        out,
        120,
        AUTOPAR_TEST_BLOCK_AUTOPAR="1",
    )
    assert rc == 0 and "verify: ok" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def test_launch_digest_covers_every_module(tmp_path: Path, monkeypatch) -> None:
    """Another byte in any module (not only launch.py) is another digest: ranks that run other
    copies of the runtime stop before the first collective (agree_on_launch)."""
    launch = importlib.import_module("autopar_runtime.launch")
    copy = tmp_path / "autopar_runtime"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(launch, "__file__", str(copy / "launch.py"))
    digest = launch.launch_digest()
    for path in sorted(copy.glob("*.py")):
        text = path.read_text()
        path.write_text(text + "# another copy\n")
        assert launch.launch_digest() != digest, f"{path.name} is not in the digest"
        path.write_text(text)
    assert launch.launch_digest() == digest
