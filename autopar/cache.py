"""The plan cache: what a planning session traced, kept on disk for the next session.

Planning the same model again (another cluster size, batch or pin) reads the traced graph from
here instead of importing the model file, building it on meta and tracing it. An entry is one
JSON file, ``<root>/<key>.json``, where the key is the SHA-256 of everything the traced graph
depends on (:func:`entry_key`):

- the model: the model file's bytes, the factory, and the values of the environment variables
  whose names the file spells out as string literals (``os.environ["GPT_LAYERS"]``); for
  ``hf:`` the config file's bytes (its head is decided by the config);
- the trace: sequence length, compute dtype, the device kind whose kernels the saved bytes
  follow, the traced batch size;
- the code: autopar's version and a digest of the front end's own source (``autopar.ir``, the
  model file and HF loaders, the session, wherever installed), torch's and transformers' versions, the IR encoding's
  format.

Beside each graph, a second entry (:func:`answers_key`: the graph's key and a digest of the
planner's and cost model's source) holds the intra-layer ILP's proven optima that the session's
searches found on it (per tp degree and cost inputs, the styles chosen as transition indices),
so a re-plan skips the CP-SAT solves an earlier one ran; the solver takes only answers that are
an assignment of its own graph.

What the key does not see: modules the model file imports (a sibling ``layers.py``), and what
the factory reads other than the environment (a config file it opens). Plan with ``--no-cache``
(``cache=None``) after changing those.

Safety. An entry is data (:mod:`autopar.ir.serial`: the IR's own dataclasses rebuilt by name,
nothing executed, no pickle). One that does not parse, names another key, or holds anything
the IR encoding refuses is a miss, and the session's fresh trace replaces it. Entries are
written to a temporary sibling and renamed into place; autopar replaces only regular files
named ``<64 hex digits>.json`` that start with its own header, and deletes nothing. The root is
``$AUTOPAR_CACHE_DIR``, else ``$XDG_CACHE_HOME/autopar``, else ``~/.cache/autopar``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["PlanCache", "answers_key", "default_root", "entry_key", "source_digest"]

FORMAT = 2
"""bumped when an entry's layout or meaning changes (2: the ILP's answers index transitions
listed alike in every process; under 1 their order followed the process's string hashing)."""
HEADER = '{"autopar_cache":'
"""how every entry autopar writes begins (json.dumps of a dict whose first key is this)."""
_NAME = re.compile(r"^[0-9a-f]{64}\.json$")
_FRONT_END = ("autopar.ir", "autopar.model_file", "autopar.hf", "autopar.session")
"""the modules and packages whose source the traced graph depends on (a change misses)."""


def default_root() -> Path:
    """``$AUTOPAR_CACHE_DIR``, else ``$XDG_CACHE_HOME/autopar``, else ``~/.cache/autopar``."""
    if os.environ.get("AUTOPAR_CACHE_DIR"):
        return Path(os.environ["AUTOPAR_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "autopar"


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def source_digest(modules: tuple[str, ...] = _FRONT_END) -> str:
    """SHA-256 of the source of ``modules`` (a package: every ``.py`` file under it; default
    the front end's, :data:`_FRONT_END`), wherever they are installed: a changed tracer misses."""
    h = hashlib.sha256()
    for name in modules:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None, name
        origin = Path(spec.origin)
        package = spec.submodule_search_locations is not None
        files = sorted(origin.parent.rglob("*.py")) if package else [origin]
        for f in files:
            h.update(f"{name}/{f.relative_to(origin.parent)}".encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def _named_environment(source: bytes) -> dict[str, str]:
    """The environment variables whose names the model file spells as a string literal."""
    text = source.decode("utf-8", "replace")
    return {
        name: value
        for name, value in sorted(os.environ.items())
        if f'"{name}"' in text or f"'{name}'" in text
    }


def entry_key(file: str, factory: str, trace: dict[str, Any]) -> str:
    """The key of a traced graph (the module docstring lists what it covers). ``file`` is the
    model file's absolute path or ``hf:<absolute config path>``; ``trace`` the trace's options
    (JSON values)."""
    from autopar.ir import serial

    hf = file.startswith("hf:")
    source = Path(file[3:] if hf else file).read_bytes()
    parts = {
        "format": FORMAT,
        "ir_format": serial.FORMAT,
        "model": hashlib.sha256(source).hexdigest(),
        "hf": hf,
        "factory": None if hf else factory,
        "environment": {} if hf else _named_environment(source),
        "trace": trace,
        "autopar": _version("autopar"),
        "front_end": source_digest(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def answers_key(graph_key: str) -> str:
    """The key of the intra-layer ILP answers found on the graph of ``graph_key``: that key and
    a digest of the planner's and the cost model's source (the answers are their optima)."""
    digest = source_digest(("autopar.planner", "autopar.cost_model"))
    return hashlib.sha256(f"answers {graph_key} {digest}".encode()).hexdigest()


@dataclass
class PlanCache:
    """Entries under ``root`` (default :func:`default_root`). Counts what it did, for the
    caller and the tests: ``hits``, ``misses`` (absent or unreadable), ``writes``."""

    root: Path
    hits: int = 0
    misses: int = 0
    writes: int = 0

    @classmethod
    def default(cls) -> PlanCache:
        return cls(default_root())

    def path(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def read(self, key: str) -> dict | None:
        """The entry's body, or None: absent, unreadable, not autopar's, or of another key."""
        try:
            document = json.loads(self.path(key).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            document = None
        ok = (
            isinstance(document, dict)
            and document.get("autopar_cache") == FORMAT
            and document.get("key") == key
            and isinstance(document.get("body"), dict)
        )
        if not ok:
            self.misses += 1
            return None
        self.hits += 1
        return document["body"]

    def write(self, key: str, body: dict) -> bool:
        """Store ``body`` (JSON values) as the entry of ``key``, atomically; False where the
        root cannot take it or the path holds something autopar did not write (left as is)."""
        out = self.path(key)
        if not _replaceable(out):
            return False
        text = json.dumps(
            {"autopar_cache": FORMAT, "key": key, "body": body}, separators=(",", ":")
        )
        assert text.startswith(HEADER)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-", suffix=".json")
        except OSError:
            return False
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            if not _replaceable(out):  # appeared meanwhile
                return False
            os.replace(tmp, out)
        except OSError:
            return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        self.writes += 1
        return True


def _replaceable(path: Path) -> bool:
    """Absent, or a regular file of autopar's name that starts with autopar's header."""
    if not path.exists() and not path.is_symlink():
        return True
    if path.is_symlink() or not path.is_file() or not _NAME.match(path.name):
        return False
    try:
        with path.open("rb") as f:
            return f.read(len(HEADER)) == HEADER.encode()
    except OSError:
        return False
