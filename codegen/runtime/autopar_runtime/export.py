"""--save-hf: the trained weights written as HF safetensors (and an hf: model's config)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from .checkpoint import _agree, _fsync, _why, full_disk, state_bytes
from .common import Constants, InputError, fail
from .tensor_parallel import storage_form

__all__ = [
    "SAVE_HF_MARKER",
    "SAVE_HF_FILE_BYTES",
    "check_save_hf",
    "install_save_hf",
    "save_hf",
    "hf_file_index",
    "hf_config",
]

# --save-hf DIR writes the trained weights as HF safetensors (HuggingFaceStorageWriter with
# save_distributed: each rank writes its shards, then rank 0 consolidates them into
# model-0000i-of-0000n.safetensors of at most 5 GiB each + model.safetensors.index.json and
# deletes the shards; this works on CPU with gloo), the config of an hf: model beside them, so
# transformers' from_pretrained(DIR) loads them. DIR must be new, empty or an earlier --save-hf's,
# apart from --checkpoint-dir and --init-from. Everything is written into a temporary sibling
# and put in place when complete; an earlier --save-hf's files (its marker lists them) are
# replaced, other files there (a tokenizer the user added) are never touched.
SAVE_HF_MARKER = "autopar-save-hf.json"


SAVE_HF_FILE_BYTES = 5 * 2**30  # tensors per safetensors file, in order, up to this size


def check_save_hf(directory: str | Path, **others: str | Path | None) -> None:
    """Before any collective, so that no training is lost at the end: --save-hf is a new
    directory, an empty one or an earlier --save-hf's; not a symlink; at a place this user can
    write (a probe file in its parent, then in it); and apart from every directory in ``others``
    (flag name -> path: --checkpoint-dir, --init-from), neither equal to one, nor inside one, nor
    holding one (the new weights replace only --save-hf's own files, never a checkpoint)."""
    directory = Path(directory)
    if directory.is_symlink():
        raise InputError(
            f"--save-hf {directory} is a symlink (to {os.readlink(directory)}): give the real "
            "directory (--save-hf replaces its own files there, never through a link)"
        )
    mine = directory.resolve()
    for flag, other in others.items():
        if other is None:
            continue
        theirs = Path(other).resolve()
        if mine == theirs or theirs in mine.parents or mine in theirs.parents:
            where = "is" if mine == theirs else "lies inside" if theirs in mine.parents else "holds"
            raise InputError(
                f"--save-hf {directory} {where} --{flag} {other}: give --save-hf a directory of "
                f"its own, apart from the {flag.replace('-', ' ')} (its files must not be mixed)"
            )
    if directory.exists() and (
        not directory.is_dir()
        or (any(directory.iterdir()) and not (directory / SAVE_HF_MARKER).is_file())
    ):
        raise InputError(
            f"--save-hf {directory} exists and was not written by --save-hf: give a new or "
            "empty directory (nothing of yours is overwritten)"
        )
    existing = directory.parent
    while not existing.exists():
        existing = existing.parent
    for place in (existing, directory) if directory.is_dir() else (existing,):
        try:  # a probe: os.access is blind to read-only mounts and ACLs as root
            fd, probe = tempfile.mkstemp(prefix=".autopar-probe-", dir=place)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise InputError(
                f"--save-hf {directory}: cannot write in {place} ({e.strerror}): give a "
                "writable path (checked now, so that no training is lost at the end)"
            ) from None


def _written_by_save_hf(directory: Path) -> list[str]:
    """The files an earlier --save-hf listed in its marker (an older marker lists none)."""
    try:
        files = json.loads((directory / SAVE_HF_MARKER).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return []
    if not isinstance(files, list):
        return []
    return [f for f in files if isinstance(f, str) and "/" not in f and f not in ("", ".", "..")]


def install_save_hf(tmp: Path, directory: Path) -> None:
    """Put the files of a finished save in ``tmp`` (its marker lists them) in ``directory``.
    A new directory is ``tmp`` renamed; in an earlier --save-hf's directory each file is
    replaced by rename (whole, old or new, never half-written), the marker last, then the files
    only the earlier save wrote (and this one did not) are removed. Nothing else there is
    touched: a tokenizer a user put beside the weights stays."""
    if not directory.exists():
        directory.parent.mkdir(parents=True, exist_ok=True)
        os.rename(tmp, directory)
        _fsync(directory.parent)
        return
    old = set(_written_by_save_hf(directory))
    new = _written_by_save_hf(tmp)
    for name in [n for n in new if n != SAVE_HF_MARKER] + [SAVE_HF_MARKER]:
        os.replace(tmp / name, directory / name)
    # The new save is complete and in place: what follows only tidies, and cannot fail it.
    for name in sorted(old - set(new)):
        stale = directory / name
        if stale.is_file() or stale.is_symlink():  # never a folder, whatever a marker says
            with contextlib.suppress(OSError):
                stale.unlink()
    with contextlib.suppress(OSError):
        _fsync(directory)
        tmp.rmdir()


def save_hf(
    directory: str | Path,
    modules: list[nn.Module],
    config: Any = None,
    checkpoint_dir: Path | None = None,
    steps: int | None = None,
) -> None:
    """The trained weights as HF safetensors in ``directory`` (all ranks call it): written into
    a temporary sibling, fsynced, then put in place (install_save_hf). A failure (a full disk)
    removes the sibling, leaves ``directory`` as it was, and is one error line on every rank
    saying how to export the weights again from the last checkpoint (``checkpoint_dir``, saved
    after step ``steps``)."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    directory, rank = Path(directory), dist.get_rank()
    state, seen = {}, set()
    for module in modules:
        for name, tensor in get_model_state_dict(module).items():
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            key = (local.data_ptr(), local.dtype) if local.numel() else id(tensor)
            if key in seen or id(tensor) in seen:  # a tied weight: saved under its first name
                continue
            seen.update((key, id(tensor)))
            state[name] = tensor
    sizes = [None] * dist.get_world_size()  # every rank's names (pipeline stages: others')
    dist.all_gather_object(sizes, [(k, t.numel() * t.element_size()) for k, t in state.items()])
    file_index = hf_file_index([item for rank_sizes in sizes for item in rank_sizes])
    tmp = [directory.parent / f".{directory.name}.save-hf-{os.getpid()}"]
    why = ""
    if rank == 0:
        try:
            directory.parent.mkdir(parents=True, exist_ok=True)
            tmp[0].mkdir()
        except OSError as e:
            why = _why(e)
    dist.broadcast_object_list(tmp, src=0)  # rank 0's name (its pid) for every rank
    tmp = tmp[0]
    saved, installing, existed = {}, False, directory.exists()
    if not _agree(why):
        try:
            writer = HuggingFaceStorageWriter(
                str(tmp), file_index, save_distributed=True, enable_consolidation=True
            )
            storage_form(state)  # its own dict: the copies stay there
            saved = dcp.save(state, storage_writer=writer).state_dict_metadata
        except (Exception, dcp.CheckpointException) as e:  # a full disk, on any rank
            why = _why(e)
    if not _agree(why) and rank == 0:
        try:
            shutil.rmtree(tmp / "sharded", ignore_errors=True)  # the parts, consolidated
            if config is not None:
                config.save_pretrained(str(tmp))
            files = sorted(p.name for p in tmp.iterdir()) + [SAVE_HF_MARKER]
            (tmp / SAVE_HF_MARKER).write_text(
                json.dumps({"written_by": "--save-hf", "files": files})
            )
            for name in files:
                _fsync(tmp / name)
            _fsync(tmp)
            installing = True
            install_save_hf(tmp, directory)
        except OSError as e:
            why = _why(e)
    why = _agree(why)
    if why:
        why = full_disk(why, tmp.parent, state_bytes(state))
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # this save's own files, nothing else
        installed = [installing]  # rank 0's: whether the files had begun to be put in place
        dist.broadcast_object_list(installed, src=0)
        if installed[0] and existed:  # a rename failed part-way: each file is whole, old or new
            where = f"{directory} holds part of the new files beside the earlier ones"
        else:
            where = f"{directory} is as it was" if existed else f"{directory} was not made"
        if checkpoint_dir is not None:
            again = (
                f"the trained weights are in --checkpoint-dir {checkpoint_dir} (step {steps}): "
                f"free space, then run this command again with --steps {steps}: it resumes "
                "there, trains no step and writes --save-hf"
            )
        else:
            again = (
                "this run's weights are not saved (no --checkpoint-dir): free space and train "
                "again, with --checkpoint-dir to keep them"
            )
        fail(f"--save-hf {directory}: writing the weights failed ({why}); {where}; {again}")
    if rank == 0:
        print(f"save-hf: wrote {len(saved)} tensors to {directory}", flush=True)


def hf_file_index(sizes: dict[str, int], limit: int = SAVE_HF_FILE_BYTES) -> dict:
    """Name -> safetensors file number (1, 2, ...): the tensors in order, a new file whenever
    the next would take the current one past ``limit`` bytes (names listed twice count once)."""
    index, used, out = 1, 0, {}
    for name, nbytes in sizes:
        if name in out:
            continue
        if used and used + nbytes > limit:
            index, used = index + 1, 0
        out[name] = index
        used += nbytes
    return out


def hf_config(c: Constants) -> Any:
    """The transformers config of an hf: plan (written beside --save-hf's weights)."""
    if c.HF_CONFIG is None:
        return None
    import transformers

    kwargs = {k: v for k, v in c.HF_CONFIG.items() if k not in ("model_type", "torch_dtype")}
    return transformers.AutoConfig.for_model(c.HF_CONFIG["model_type"], **kwargs)
