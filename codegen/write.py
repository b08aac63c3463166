"""Write a plan's files into a directory: the one place codegen touches the file system.

``--out DIR`` may hold anything else of the user's (their own files, the model file, a ``ckpt/``
checkpoint directory): ``write_outputs`` only ever replaces the files autopar itself writes, and
leaves every other entry of ``DIR`` in place.

- Each file is written to a temporary file inside ``DIR`` and renamed over its name
  (``os.replace``), so every file is either the old one or the new one, never half. All the new
  contents are written before the first rename, so an error while writing (a plan codegen
  refuses, a full disk) changes nothing.
- ``DIR/.autopar-outputs`` (the manifest, JSON) lists the files autopar wrote there with their
  SHA-256. A later run replaces a file only when the manifest lists it and it still has the
  recorded content, and removes the files the manifest lists that the new plan no longer emits
  (e.g. ``launch.slurm`` of a multi-node plan). A file of one of autopar's names that autopar did
  not write, or that was edited since, is refused (:class:`OutputConflict`), never overwritten.
- ``DIR`` itself is never renamed, replaced or deleted; a symbolic link ``DIR`` is followed (the
  files go into the directory it points to); a dangling link or a non-directory is refused.
- The runtime package's files go into one folder, ``DIR/autopar_runtime/``, under the same rules
  (the manifest names them ``autopar_runtime/<module>.py``); autopar creates the folder where it
  is missing and refuses a file or a symbolic link of that name. An elastic plan set
  (``elastic=``) also writes ``DIR/plans/`` (``<K>nodes.py`` and ``<K>nodes.json`` per node
  count) under the same rules. No other folder is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path

from autopar.codegen.emit import PLANS_FOLDER, RUNTIME_PACKAGE, emit
from autopar.planner.plan import NO_FILE, Plan

from autopar.errors import UserError

__all__ = ["MANIFEST", "EmitError", "OutputConflict", "read_manifest", "write_outputs"]

MANIFEST = ".autopar-outputs"
_EXECUTABLE = (".sh", ".slurm")


class OutputConflict(UserError):
    """``--out`` holds a file of one of autopar's names that autopar did not write."""


class EmitError(UserError):
    """A plan that cannot become a program (its model has no file to import)."""


def write_outputs(
    plan: Plan,
    out_dir: str | Path,
    extra: dict[str, str] | None = None,
    elastic: dict[int, Plan] | None = None,
) -> Path:
    """Write ``emit(plan, elastic)`` (and ``extra`` files, e.g. a report) into ``out_dir``;
    return its path. ``elastic``: node count -> plan (``plan --elastic``; ``plan`` the largest).

    Only the files written here are replaced, each atomically; see the module docstring.
    """
    if not plan.model.has_file:
        raise EmitError(
            f"cannot emit a program for {plan.model.file.removeprefix(NO_FILE + ': ')}: no file "
            "defines its class (a notebook cell?), and train.py imports the model from a file on "
            "every rank: put the class and a build_model() in a module (e.g. model.py) and plan "
            "with model_file='model.py' (or `plan model.py`)"
        )
    files = emit(plan, elastic)
    odd = next((name for name in files if not _output_name(name) or name == MANIFEST), None)
    if odd is not None:
        raise ValueError(
            f"codegen emitted {odd!r}: output names must be plain file names, or plain file "
            f"names in {RUNTIME_PACKAGE}/ or {PLANS_FOLDER}/"
        )
    for name, text in (extra or {}).items():
        if not _plain_name(name) or name == MANIFEST:
            raise ValueError(f"extra output name {name!r} must be a plain file name, no folders")
        files[name] = text
    data = {name: text.encode("utf-8") for name, text in files.items()}  # may raise: nothing done
    out = resolve_out(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    old = read_manifest(out)
    folders = sorted({str(Path(name).parent) for name in data} - {"."})
    for folder in folders:
        _check_folder(out, folder)
    for name, blob in data.items():
        _check_replaceable(out, name, old, hashlib.sha256(blob).hexdigest())
    umask = os.umask(0)
    os.umask(umask)
    temps: dict[str, str] = {}
    made = [out / folder for folder in folders if not (out / folder).exists()]
    try:
        for folder in made:
            folder.mkdir(mode=0o777 & ~umask)
        for name, blob in data.items():
            temps[name] = _write_temp(
                out, name, blob, 0o777 & ~umask if _executable(name) else 0o666 & ~umask
            )
        # the manifest first lists old and new names, so a crash below leaves every file autopar
        # wrote recorded as autopar's
        new = {name: hashlib.sha256(blob).hexdigest() for name, blob in data.items()}
        _write_manifest(out, {**old, **new}, umask)
        for name, tmp in temps.items():
            os.replace(tmp, out / name)
        temps.clear()
    finally:
        for tmp in temps.values():
            Path(tmp).unlink(missing_ok=True)
        if temps:  # a failed write: the folders it made go too
            for folder in made:
                with contextlib.suppress(OSError):
                    folder.rmdir()
    for name, digest in old.items():  # stale outputs of an earlier plan, if still untouched
        path = out / name
        inside = path.parent == out or not path.parent.is_symlink()
        if name not in new and inside and path.is_file() and not path.is_symlink():
            if _digest(path) == digest:
                path.unlink()
            else:
                new[name] = digest  # edited since: keep it, and keep it listed as autopar's
    plans = out / PLANS_FOLDER  # an elastic set's folder, emptied above: it goes too
    if not any(name.startswith(f"{PLANS_FOLDER}/") for name in new) and plans.is_dir():
        with contextlib.suppress(OSError):
            plans.rmdir()  # only when empty: a user's files there stay
    _write_manifest(out, new, umask)
    return out


def resolve_out(out_dir: str | Path) -> Path:
    """``out_dir`` as an absolute path, a symbolic link followed; UserError when it cannot be a
    directory (a file, a dangling link, a path under a file)."""
    given = Path(out_dir)
    out = given.absolute()
    if out.is_symlink():
        target = out.resolve()
        if not target.is_dir():
            raise UserError(
                f"--out {str(given)!r} is a symbolic link to {str(target)!r}, which is not a "
                "directory: point it at a directory or give a directory path"
            )
        return target
    if out.exists() and not out.is_dir():
        raise UserError(
            f"--out {str(given)!r} is a file, not a directory: give a directory path (it will "
            "be created)"
        )
    parent = existing_ancestor(out)
    if not parent.is_dir():
        raise UserError(
            f"--out {str(given)!r} lies under {str(parent)!r}, which is a file: give a "
            "directory path"
        )
    return out


def existing_ancestor(path: Path) -> Path:
    """The nearest ancestor of ``path`` that exists (what a mkdir -p would create under)."""
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return parent


def _check_folder(out: Path, folder: str) -> None:
    """The runtime package's (or plans') folder in ``out`` is missing or a real directory
    (never followed through a symbolic link, never a user's file replaced)."""
    path = out / folder
    what = "its runtime package" if folder == RUNTIME_PACKAGE else "the plans of each node count"
    if os.path.lexists(path) and (path.is_symlink() or not path.is_dir()):
        raise OutputConflict(
            f"--out {str(out)!r} already holds {folder}, which is not a folder (autopar writes "
            f"{what} into {folder}/): move {folder} away (or pass another --out) "
            "and run again"
        )


def _check_replaceable(out: Path, name: str, manifest: dict[str, str], new_digest: str) -> None:
    path = out / name
    if not os.path.lexists(path):
        return
    plain = path.is_file() and not path.is_symlink()
    if plain and _digest(path) in (manifest.get(name), new_digest):
        return  # autopar's unchanged output, or the very bytes it would write: nothing is lost
    why = (
        "was edited since autopar wrote it"
        if plain and name in manifest
        else f"autopar did not write (it is not in {MANIFEST})"
    )
    raise OutputConflict(
        f"--out {str(out)!r} already holds {name}, which {why}: autopar replaces only its own "
        f"unchanged outputs, so move {name} away (or pass another --out) and run again"
    )


def read_manifest(out: Path) -> dict[str, str]:
    path = out / MANIFEST
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # unreadable: nothing is known to be autopar's
    files = raw.get("files") if isinstance(raw, dict) else None
    if not isinstance(files, dict):
        return {}
    return {
        name: digest
        for name, digest in files.items()
        if _output_name(name) and name != MANIFEST and isinstance(digest, str)
    }


def _write_manifest(out: Path, files: dict[str, str], umask: int) -> None:
    text = json.dumps(
        {
            "about": "files autopar wrote here; a re-run replaces or removes only these",
            "files": dict(sorted(files.items())),
        },
        indent=2,
    )
    tmp = _write_temp(out, MANIFEST, (text + "\n").encode(), 0o666 & ~umask)
    os.replace(tmp, out / MANIFEST)


def _write_temp(out: Path, name: str, blob: bytes, mode: int) -> str:
    path = out / name
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return tmp


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _executable(name: str) -> bool:
    return name.endswith(_EXECUTABLE)


def _output_name(name: object) -> bool:
    """A name autopar writes: a plain file name, or one inside the runtime package's folder
    (or an elastic plan set's)."""
    if not isinstance(name, str):
        return False
    folder, _, file = name.rpartition("/")
    return _plain_name(name) or (folder in (RUNTIME_PACKAGE, PLANS_FOLDER) and _plain_name(file))


def _plain_name(name: object) -> bool:
    return (
        isinstance(name, str)
        and bool(name)
        and name not in (".", "..")
        and Path(name).name == name
        and "\\" not in name
        and "\0" not in name
    )
