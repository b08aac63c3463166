"""The package's shape, read from the source with ast (nothing imported):

- imports point one way: ``ir <- cost_model <- planner <- codegen <- autopar`` (a package may
  import its own and lower layers, never a higher one), at module level or inside functions;
  ``autopar.errors`` is a leaf every layer may import; nothing imports the old top-level names
  (``ir``, ``planner``, ...);
- the emitted program (codegen/templates, codegen/runtime) imports nothing of autopar;
- no module keeps a module-level container keyed by object ids (``CACHE[id(x)]``): caches are
  attributes of objects their caller holds.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"ir": 0, "cost_model": 1, "planner": 2, "codegen": 3}
TOP = 4
"""the thin autopar/ package: api, cli, _plan, model_file, hf."""
LEAVES = {"autopar.errors"}
OLD_ROOTS = set(LAYERS)
EMITTED = ("codegen/templates", "codegen/runtime")


def _modules() -> list[tuple[str, Path]]:
    """(dotted name, path) of every module of the package."""
    out = []
    for folder in (*LAYERS, "autopar"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if str(rel.parent).startswith(EMITTED):
                continue
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join(parts if parts[0] == "autopar" else ["autopar", *parts])
            out.append((name, path))
    return out


def _layer(module: str) -> int | None:
    """The layer of an ``autopar...`` module; None for a leaf."""
    if module in LEAVES or any(module.startswith(leaf + ".") for leaf in LEAVES):
        return None
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in LAYERS:
        return LAYERS[parts[1]]
    return TOP


def _imports(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file, nested ones included."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            out.append((node.lineno, name))
            # ``from autopar import api`` imports autopar.api
            if name == "autopar":
                out += [(node.lineno, f"autopar.{a.name}") for a in node.names]
    return out


def _wrong_way(name: str, path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    mine = _layer(name)
    bad = []
    for line, target in _imports(tree, package):
        root = target.split(".")[0]
        where = f"{path.relative_to(ROOT)}:{line}"
        if root in OLD_ROOTS:
            bad.append(f"{where} imports {target!r}: write autopar.{target}")
            continue
        if root != "autopar" or target == "autopar":
            continue
        theirs = _layer(target)
        if theirs is None:
            continue
        if mine is None:
            bad.append(f"{where}: the leaf {name} imports {target}")
        elif theirs > mine:
            bad.append(f"{where}: {name} (layer {mine}) imports {target} (layer {theirs})")
    return bad


def _id_keyed_globals(path: Path) -> list[str]:
    """Module-level names subscripted or looked up with a key built from ``id(...)``."""
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for stmt in tree.body:
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
        names |= {t.id for t in targets if isinstance(t, ast.Name)}

    def has_id(node: ast.AST | None) -> bool:
        return node is not None and any(
            isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "id"
            for n in ast.walk(node)
        )

    bad = []
    for node in ast.walk(tree):
        hit = None
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
            hit = node.value.id if has_id(node.slice) else None
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.args
        ):
            hit = node.func.value.id if has_id(node.args[0]) else None
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.In | ast.NotIn):
            right = node.comparators[0]
            hit = right.id if isinstance(right, ast.Name) and has_id(node.left) else None
        if hit in names:
            bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {hit} is keyed by id()")
    return bad


def test_imports_point_one_way():
    modules = _modules()
    assert len(modules) > 30 and any(n == "autopar.planner.search" for n, _ in modules)
    bad = [b for name, path in modules for b in _wrong_way(name, path)]
    assert not bad, "\n".join(bad)


def test_the_emitted_program_imports_nothing_of_autopar():
    bad = []
    for folder in EMITTED:
        for path in (ROOT / folder).rglob("*.py"):
            for line, target in _imports(ast.parse(path.read_text()), ""):
                if target.split(".")[0] in {"autopar", *OLD_ROOTS}:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not bad, "\n".join(bad)


def test_no_module_level_dict_keyed_by_object_ids():
    bad = [b for _, path in _modules() for b in _id_keyed_globals(path)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "source, wrong",
    [
        ("from autopar.codegen.emit import emit\n", True),  # planner -> codegen
        ("def f():\n    from autopar.api import why_not\n", True),  # nested, planner -> autopar
        ("from autopar.errors import UserError\n", False),
        ("from autopar.cost_model import step\n", False),
        ("import planner.search\n", True),  # the old top-level name
    ],
)
def test_the_direction_check_catches_a_wrong_arrow(tmp_path, monkeypatch, source, wrong):
    path = ROOT / "planner" / "_probe_imports.py"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: source)
    assert bool(_wrong_way("autopar.planner._probe_imports", path)) is wrong


@pytest.mark.parametrize(
    "source, wrong",
    [
        ("_C: dict = {}\ndef f(x):\n    _C[id(x)] = 1\n", True),
        ("_C = {}\ndef f(g, tp):\n    return _C.get((id(g), tp))\n", True),
        ("_C = {}\ndef f(x):\n    return id(x) in _C\n", True),
        ("def f(x):\n    seen = {}\n    seen[id(x)] = 1\n", False),  # a local: fine
    ],
)
def test_the_id_check_catches_a_global_cache(monkeypatch, source, wrong):
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: source)
    assert bool(_id_keyed_globals(ROOT / "planner" / "_probe.py")) is wrong


HEAVY = ("ortools", "transformers", "autopar.codegen", "autopar.planner.search", "autopar.api")
"""what ``import autopar`` (and ``import autopar.ir.graph``) must not load: they load when
first used (issue 26, item 5: ``import autopar`` <= 1 s)."""


@pytest.mark.parametrize("statement", ["import autopar", "import autopar.ir.graph"])
def test_importing_autopar_loads_nothing_heavy(statement):
    """In a fresh process: the modules in HEAVY stay unloaded; ``import autopar`` alone loads
    not even torch; the public names still resolve (lazily) to the API's objects."""
    import subprocess
    import sys

    code = (
        f"import sys\n{statement}\n"
        f"print(sorted(m for m in {HEAVY + ('torch',)!r} if m in sys.modules))\n"
        "from autopar import Plan, auto_parallelize\n"
        "import autopar.api, autopar._plan\n"
        "print(auto_parallelize is autopar.api.auto_parallelize, Plan is autopar._plan.Plan)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded, resolved = out.stdout.strip().splitlines()
    allowed = ["torch"] if statement != "import autopar" else []  # the IR traces with torch
    assert ast.literal_eval(loaded) == allowed, f"{statement} loads {loaded}"
    assert resolved == "True True"


def test_an_unknown_name_is_an_attribute_error():
    import autopar

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        autopar.nope  # noqa: B018
