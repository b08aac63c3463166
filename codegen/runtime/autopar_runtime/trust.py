"""Trusted input: the safe reader of a DCP checkpoint's metadata and values, the ownership and
permission checks of --checkpoint-dir and a DCP --init-from, and the checkpoint directory's lock.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

__all__ = [
    "MetadataUnpickler",
    "SafeReader",
    "SafeLoadPlanner",
    "trusted_dir_problem",
    "LOCK",
    "lock_checkpoint_dir",
    "release_lock",
]

# --checkpoint-dir and a DCP --init-from are trusted input: a DCP checkpoint's .metadata is a
# pickle, and its non-tensor values (the optimizer's param groups) are torch.save'd objects.
# Both are read here without running code: .metadata through an unpickler that admits only
# DCP's own metadata classes and torch's value types (SafeReader), other values with
# torch.load(weights_only=True) (SafeLoadPlanner). The directories must also be this user's and
# not writable by others. Safetensors and JSON (HF weights, plans, --data) hold no code.
_DCP_METADATA = "torch.distributed.checkpoint.metadata"


_SAFE_GLOBALS = {
    _DCP_METADATA: {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "MetadataIndex",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict", "int", "float", "str", "bytes"},
}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP .metadata, refusing every global that is not DCP's metadata or a torch
    value type (a crafted pickle's os.system, eval, ... raise UnpicklingError, never run)."""

    def find_class(self, module: str, name: str):
        allowed = name in _SAFE_GLOBALS.get(module, ())
        if module == "torch" and not allowed:  # torch.float32, torch.strided, ...
            value = getattr(torch, name, None)
            allowed = isinstance(value, torch.dtype | torch.layout | torch.memory_format)
        if not allowed:
            raise pickle.UnpicklingError(
                f"it names {module}.{name}, which is not DCP checkpoint metadata (not loaded)"
            )
        return super().find_class(module, name)


class SafeReader(dcp.FileSystemReader):
    """DCP's FileSystemReader, its .metadata read by MetadataUnpickler."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        rank = kwargs.get("rank")
        with self.fs.create_stream(self._get_metadata_path(rank), "rb") as f:
            metadata = MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not DCP Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's default load planner, its non-tensor values read with weights_only=True (plain
    data and tensors; DCP itself reads them with weights_only=False)."""

    def load_bytes(self, read_item, value) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def trusted_dir_problem(directory: Path) -> str:
    """Why ``directory`` (which exists) cannot be trusted input, or "": another user's, or
    writable by others (anyone could plant a checkpoint there)."""
    st = directory.stat()
    if st.st_uid != os.getuid():
        return (
            f"{directory} belongs to another user (uid {st.st_uid}); checkpoints are trusted "
            "input (DCP metadata is a pickle): use your own"
        )
    if st.st_mode & 0o002:
        return (
            f"{directory} is world-writable; checkpoints are trusted input (DCP metadata is a "
            f"pickle): chmod o-w {directory}, or use another directory"
        )
    return ""


LOCK = ".autopar-lock"


_held_lock: list[Path] = []  # the lock this process holds (rank 0), released by finish()


def _lock_holder() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
    }


def _lock_is_stale(holder: dict) -> bool:
    """A lock a new start may take over: its run's restart (same torchrun run id), or its
    process is gone (same host)."""
    me = _lock_holder()
    if holder.get("run_id") and holder.get("run_id") == me["run_id"]:
        return True
    if holder.get("host") == me["host"]:
        try:
            os.kill(int(holder.get("pid", 0)), 0)
        except ProcessLookupError:
            return True
        except (PermissionError, ValueError, OverflowError):
            return False
    return False


def lock_checkpoint_dir(directory: Path) -> str:
    """Rank 0 takes ``directory``'s lock (an empty string) or says who holds it."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                holder = json.loads(path.read_text())
            except (OSError, ValueError):
                holder = {}
            if not isinstance(holder, dict) or not _lock_is_stale(holder):
                who = f"{holder.get('host')} pid {holder.get('pid')}" if holder else "?"
                return (
                    f"--checkpoint-dir {directory} is in use by another training ({who}): "
                    f"wait for it, use another directory, or delete {path} if that run is dead"
                )
            path.unlink(missing_ok=True)  # a dead run's lock, or our own restart's
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(_lock_holder(), f)
        _held_lock.append(path)
        return ""
    return f"--checkpoint-dir {directory}: cannot take its lock {path}"


def release_lock() -> None:
    for path in _held_lock:
        path.unlink(missing_ok=True)
    _held_lock.clear()
