"""Write a plan's files to disk: the one place codegen touches the file system."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

from autopar.codegen.emit import emit
from autopar.planner.plan import Plan

__all__ = ["write_outputs"]


def write_outputs(plan: Plan, out_dir: str | Path, extra: dict[str, str] | None = None) -> Path:
    """Write ``emit(plan)`` (and ``extra`` files) to ``out_dir`` atomically; return its path.

    The files go into a temporary directory next to ``out_dir``, renamed into place once
    complete. An existing ``out_dir`` is replaced only then (renamed away, the new one renamed
    in, the old one deleted), so a failure leaves either the old outputs or the new, never half.
    """
    files = emit(plan)
    for name, text in (extra or {}).items():
        if not name or Path(name).name != name or name in (".", ".."):
            raise ValueError(f"extra output name {name!r} must be a plain file name, no folders")
        files[name] = text
    out = Path(out_dir).absolute()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file: give a directory path (it will be created)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it 0700: give the usual permissions
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        (tmp / "launch.sh").chmod(0o777 & ~umask)
        if out.is_dir() and any(out.iterdir()):
            old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
            out.rename(old)
            try:
                tmp.rename(out)
            except BaseException:
                old.rename(out)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            if out.is_dir():
                out.rmdir()
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
