"""--data and --eval-data: the sources (token files, jsonl, parquet, Arrow, save_to_disk
directories), each file checked before step 1, cut into next-token windows.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .common import InputError, ModelFile

__all__ = [
    "add_data_args",
    "TOKEN_SUFFIXES",
    "TABLE_SUFFIXES",
    "INT64_LIMIT",
    "SAVED",
    "TokenWindows",
    "token_range",
    "FILE_KINDS",
    "read_token_file",
    "token_chunks",
    "open_dataset",
    "check_global_batch",
]


def add_data_args(p: argparse.ArgumentParser) -> None:
    """The flags of this section (parse_args adds them)."""
    p.add_argument("--data", default=None, help="training data: token file, parquet/jsonl, dir")
    p.add_argument("--eval-data", default=None, help="validation data (the same formats)")
    p.add_argument("--eval-every", type=int, default=None, help="log eval_loss every K steps")
    p.add_argument("--data-workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--init-from", default=None, help="DCP checkpoint or HF safetensors dir")
    p.add_argument("--save-hf", default=None, help="write the final weights as HF safetensors")


# --data PATH: a flat token file (.bin of uint16, nanoGPT's train.bin; .npy of uint16/uint32), a
# directory written by HF datasets' save_to_disk, or .parquet / .jsonl files (or a directory of
# them) with an input_ids column. Every source becomes one flat token stream (rows concatenated in
# order, as written: tokenize with an end-of-text token to separate documents) cut into windows of
# seq_len + 1 tokens with a stride of seq_len: sample i is tokens[i*seq_len : (i+1)*seq_len + 1],
# inputs window[:-1], target window[1:]. Without --data, a model file's make_dataset(split) gives a
# map-style Dataset of (inputs, target).
#
# Every file is checked before step 1 and a bad one is one InputError line naming it, the rule
# and the fix: a regular file (stat before any open: a FIFO would block), readable, not empty; a
# jsonl row's input_ids a flat list of JSON integers (never a float, bool, string or null); a
# parquet / Arrow column of lists of integers without nulls; every id in 0 .. vocab - 1 (both
# ends, read in pieces: memory-mapped files stay out of memory). A save_to_disk directory's
# state.json / dataset_dict.json must parse and name files inside it; it is then read with
# datasets.load_from_disk where datasets is installed (memory-mapped), by hand otherwise.
TOKEN_SUFFIXES = (".bin", ".npy")


TABLE_SUFFIXES = (".parquet", ".jsonl", ".arrow")


INT64_LIMIT = 2**63


SAVED = "write the dataset again with datasets' save_to_disk"


class TokenWindows(torch.utils.data.Dataset):
    """Windows of seq_len + 1 tokens over a flat stream kept as a list of 1-D arrays (memory
    mapped where the format allows); item i is (inputs, target), int64."""

    def __init__(self, chunks: list, seq_len: int, source: str) -> None:
        self.chunks = [c for c in chunks if len(c)]
        self.starts = np.cumsum([0] + [len(c) for c in self.chunks])
        self.seq_len = seq_len
        self.source = source
        self.num_tokens = int(self.starts[-1])
        if self.num_tokens < seq_len + 1:
            raise InputError(
                f"{source} holds {self.num_tokens} tokens, fewer than one window of seq_len + 1 "
                f"= {seq_len + 1}: give more data or plan a shorter --seq-len"
            )

    def __len__(self) -> int:
        return (self.num_tokens - 1) // self.seq_len

    def tokens(self, start: int, stop: int) -> np.ndarray:
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        parts = []
        while start < stop:
            chunk = self.chunks[first]
            lo = start - int(self.starts[first])
            piece = chunk[lo : lo + stop - start]
            parts.append(np.asarray(piece))
            start += len(piece)
            first += 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def __getitem__(self, i: int):
        if not 0 <= i < len(self):
            raise IndexError(i)
        window = torch.from_numpy(
            self.tokens(i * self.seq_len, (i + 1) * self.seq_len + 1).astype(np.int64)
        )
        return window[:-1], window[1:]


def token_range(chunks: list) -> tuple[int, int]:
    """The smallest and largest token id of ``chunks`` (0, 0 when they hold none), read in
    pieces of 2^26 tokens: a memory-mapped file stays out of memory. Unsigned ids count as >= 0
    without reading them twice."""
    step = 1 << 26
    low, high = 0, 0
    for c in chunks:
        for k in range(0, len(c), step):
            piece = c[k : k + step]
            high = max(high, int(piece.max()))
            if c.dtype.kind == "i":
                low = min(low, int(piece.min()))
    return low, high


def _one_line(e: BaseException) -> str:
    """An exception's text as one line (pyarrow's and numpy's messages may hold several); an
    OSError's reason without the path, which the message names already."""
    text = " ".join((getattr(e, "strerror", None) or str(e)).split()) or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _stat(path: Path) -> os.stat_result:
    """stat ``path`` (following links) without opening it."""
    try:
        return path.stat()
    except FileNotFoundError:
        if path.is_symlink():
            raise InputError(
                f"{path} is a symlink to {os.readlink(path)}, which does not exist: fix the link "
                "or give the file itself"
            ) from None
        raise InputError(f"data path {path} does not exist") from None
    except (OSError, RuntimeError) as e:  # permissions on a parent, a symlink loop
        raise InputError(
            f"cannot read {path} ({_one_line(e)}): check the path and its permissions"
        ) from None


FILE_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def _regular_file(path: Path) -> int:
    """The size of ``path``, once stat shows a regular file (a FIFO or a device is never
    opened: reading one blocks or never ends)."""
    info = _stat(path)
    if not stat.S_ISREG(info.st_mode):
        kind = FILE_KINDS.get(stat.S_IFMT(info.st_mode), "not a regular file")
        raise InputError(
            f"{path} is {kind}, not a regular file: --data and --eval-data read token files, "
            ".parquet/.jsonl/.arrow files or a directory of them"
        )
    return info.st_size


@contextlib.contextmanager
def _reading(path: Path):
    """An OSError while reading ``path`` (permissions, I/O) as one line."""
    try:
        yield
    except OSError as e:
        raise InputError(
            f"cannot read {path} ({_one_line(e)}): check the file and its permissions"
        ) from None


def read_token_file(path: Path) -> np.ndarray:
    """A .bin (uint16) or .npy (uint16/uint32, 1-D) token file, memory mapped."""
    if path.suffix == ".bin":
        size = path.stat().st_size
        if size % 2:
            raise InputError(
                f"{path} has {size} bytes, an odd count: a .bin token file holds uint16 tokens "
                "(2 bytes each; nanoGPT's train.bin). Write uint32 tokens as .npy"
            )
        return np.memmap(path, dtype=np.uint16, mode="r")
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, EOFError) as e:
        raise InputError(
            f"{path} is not a .npy array ({_one_line(e)}): save the tokens with "
            "np.save(path, tokens.astype(np.uint32))"
        ) from None
    if not isinstance(array, np.ndarray):  # an .npz archive
        raise InputError(
            f"{path} is an .npz archive, not a .npy array: save one array with "
            "np.save(path, tokens.astype(np.uint32))"
        )
    if array.dtype not in (np.uint16, np.uint32) or array.ndim != 1:
        raise InputError(
            f"{path} holds a {array.ndim}-D {array.dtype} array: a .npy token file holds one "
            "1-D uint16 or uint32 array (np.save(path, tokens.astype(np.uint32)))"
        )
    return array


def _import_pyarrow(path: Path):
    try:
        import pyarrow  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise InputError(
            f"reading {path} needs pyarrow, which is not installed: pip install pyarrow"
        ) from None
    return pyarrow


def _import_datasets():
    """HF datasets, or None where it is not installed (save_to_disk is then read by hand)."""
    try:
        import datasets
    except ImportError:
        return None
    return datasets


def _column_chunks(table: Any, path: Path) -> list:
    """The input_ids column of an Arrow table: lists of integers, no nulls, one 1-D array of
    ids per record batch (zero copy where Arrow allows)."""
    import pyarrow as pa

    if "input_ids" not in table.column_names:
        raise InputError(
            f"{path} has no input_ids column (columns: {', '.join(table.column_names[:8])}): "
            "tokenize it into input_ids, or give a flat token file"
        )
    column = table.column("input_ids")
    kind = column.type
    is_list = pa.types.is_list(kind) or pa.types.is_large_list(kind)
    if not (is_list or pa.types.is_fixed_size_list(kind)) or not (
        pa.types.is_integer(kind.value_type)
    ):
        raise InputError(
            f"{path}: input_ids is a column of {kind}, not of lists of integer token ids: "
            "write one list of ids per row (a list<int64> column)"
        )
    chunks = []
    for chunk in column.chunks:
        values = chunk.flatten()
        if chunk.null_count or values.null_count:
            raise InputError(
                f"{path}: input_ids holds nulls ({chunk.null_count} null rows, "
                f"{values.null_count} null ids): every row must be a list of token ids"
            )
        chunks.append(values.to_numpy(zero_copy_only=False))
    return chunks


def _bad_ids(ids: Any) -> str:
    """What is wrong with a jsonl row's input_ids (a row that failed the check)."""
    kinds = {bool: "a boolean", float: "a float", str: "a string", list: "a list"}

    def shown(v) -> str:
        text = json.dumps(v)
        return text if len(text) <= 40 else text[:37] + "..."

    if not isinstance(ids, list):
        return f"input_ids is {shown(ids)}, not a list" if ids is not None else "input_ids is null"
    for k, v in enumerate(ids):
        if v is None:
            return f"input_ids[{k}] is null"
        if type(v) is not int:
            return f"input_ids[{k}] is {shown(v)}, {kinds.get(type(v), 'an object')}"
        if not 0 <= v < INT64_LIMIT:
            return f"input_ids[{k}] is {v}, " + ("negative" if v < 0 else "beyond int64")
    raise AssertionError("a row that passes the check")


def _row_ids(ids: Any, path: Path, number: int) -> np.ndarray:
    """A jsonl row's input_ids: a flat list of JSON integers in 0 .. 2^63 - 1 (1.0 and true
    are refused, never truncated)."""
    ok = isinstance(ids, list) and all(type(v) is int for v in ids)
    if ok:
        try:
            array = np.array(ids, dtype=np.int64)
            ok = not (len(array) and array.min() < 0)
        except OverflowError:
            ok = False
    if not ok:
        raise InputError(
            f"{path} line {number}: {_bad_ids(ids)}: input_ids must be a flat list of JSON "
            "integer token ids >= 0, like [1, 2, 3]"
        )
    return array


def _jsonl_chunks(path: Path) -> list:
    chunks = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise InputError(
                        f"{path} line {number} is not JSON ({e}): each line must be a JSON "
                        'object like {"input_ids": [1, 2, 3]}'
                    ) from None
                if not isinstance(row, dict) or "input_ids" not in row:
                    raise InputError(
                        f"{path} line {number} has no input_ids field: each line must be a JSON "
                        'object like {"input_ids": [1, 2, 3]}'
                    )
                chunks.append(_row_ids(row["input_ids"], path, number))
    except UnicodeDecodeError as e:  # decoded in blocks: the line is not known
        raise InputError(
            f"{path} is not UTF-8 text ({_one_line(e)}): write jsonl as UTF-8"
        ) from None
    return [np.concatenate(chunks)] if chunks else []  # one array: not one per row


def _arrow_chunks(path: Path) -> list:
    """An Arrow IPC file as save_to_disk writes it (stream format), memory mapped."""
    pa = _import_pyarrow(path)
    try:
        source = pa.memory_map(str(path))
        try:
            table = pa.ipc.open_stream(source).read_all()
        except (pa.ArrowException, OSError):
            table = pa.ipc.open_file(source).read_all()
    except (pa.ArrowException, OSError, ValueError) as e:
        raise InputError(
            f"{path} is not a readable Arrow IPC file ({_one_line(e)}): write it with pyarrow "
            "(or datasets' save_to_disk), or give parquet / jsonl"
        ) from None
    return _column_chunks(table, path)


def _parquet_chunks(path: Path) -> list:
    pa = _import_pyarrow(path)
    try:
        table = pa.parquet.read_table(path)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise InputError(
            f"{path} is not a readable parquet file ({_one_line(e)}): write it again with "
            "pyarrow.parquet.write_table (or pandas' to_parquet)"
        ) from None
    return _column_chunks(table, path)


def _read_json(path: Path):
    """A save_to_disk JSON file (state.json, dataset_dict.json), parsed."""
    _regular_file(path)
    try:
        with _reading(path):
            return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:  # not JSON, not UTF-8
        raise InputError(f"{path} is not JSON ({_one_line(e)}): {SAVED}") from None


def _inside(root: Path, name: Any, listed_in: Path, what: str) -> Path:
    """``root / name`` for a name read from ``listed_in``: a relative path without '..' that
    stays inside ``root`` once symlinks are followed."""
    if not isinstance(name, str) or not name:
        raise InputError(f"{listed_in} names {what} {json.dumps(name)}, not a file name: {SAVED}")
    target = root / name
    try:
        inside = target.resolve().is_relative_to(root.resolve())
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL in the name
        inside = False
    if Path(name).is_absolute() or ".." in Path(name).parts or not inside:
        raise InputError(
            f"{listed_in} names {what} {name!r} outside {root}: a save_to_disk dataset's files "
            f"lie inside its directory; {SAVED}"
        )
    return target


def _saved_dataset_files(path: Path, split: str) -> tuple[Path, list[Path]]:
    """(the Dataset's directory, its Arrow files) of a save_to_disk directory (of a Dataset, or
    a DatasetDict's split), its JSON checked and every file name inside it."""
    splits_file = path / "dataset_dict.json"
    if os.path.lexists(splits_file):
        info = _read_json(splits_file)
        splits = info.get("splits") if isinstance(info, dict) else None
        if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
            raise InputError(f'{splits_file} has no list of "splits": {SAVED}')
        wanted = ["train"] if split == "train" else ["validation", "test"]
        found = next((s for s in wanted if s in splits), None)
        if found is None:
            raise InputError(
                f"{path} is a DatasetDict with splits {splits}, none of {wanted}: give the "
                f"split's directory ({path}/<split>)"
            )
        path = _inside(path, found, splits_file, "the split")
    state_file = path / "state.json"
    state = _read_json(state_file)
    files = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(files, list) or not files or not all(isinstance(f, dict) for f in files):
        raise InputError(f'{state_file} has no list of "_data_files": {SAVED}')
    names = [f.get("filename") for f in files]
    return path, [_inside(path, name, state_file, "the data file") for name in names]


def _saved_dataset_chunks(directory: Path, files: list[Path]) -> list:
    """The input_ids of a save_to_disk Dataset: through datasets.load_from_disk (its own Arrow
    files, memory mapped) where datasets is installed, else its Arrow files read by hand."""
    for file in files:
        _regular_file(file)  # before datasets opens them
    datasets = _import_datasets()
    if datasets is None:
        return [c for file in files for c in _arrow_chunks(file)]
    try:
        dataset = datasets.load_from_disk(str(directory), keep_in_memory=False)
        table = dataset.data.table
    except Exception as e:  # whatever the library raises on a broken directory
        raise InputError(
            f"datasets.load_from_disk cannot read {directory} ({_one_line(e)}): {SAVED}"
        ) from None
    return _column_chunks(table, directory)


def _file_chunks(path: Path) -> list:
    """The token ids of one data file, by its suffix."""
    if _regular_file(path) == 0:
        raise InputError(f"{path} is empty (0 bytes): give a file of token ids")
    with _reading(path):
        if path.suffix in TOKEN_SUFFIXES:
            return [read_token_file(path)]
        if path.suffix == ".jsonl":
            return _jsonl_chunks(path)
        if path.suffix == ".arrow":
            return _arrow_chunks(path)
        return _parquet_chunks(path)


def _check_ids(chunks: list, source: Path, vocab_size: int | None) -> None:
    """Every token id of ``source`` in 0 .. vocab_size - 1 (or below 2^63 without a vocabulary)."""
    low, high = token_range(chunks)
    if low < 0:
        raise InputError(
            f"{source} holds token id {low}: token ids are >= 0 (tokenize with the model's "
            "tokenizer)"
        )
    if vocab_size is not None and high >= vocab_size:
        raise InputError(
            f"{source} holds token id {high}, but the model's vocabulary has {vocab_size} "
            "tokens: tokenize with the model's tokenizer"
        )
    if high >= INT64_LIMIT:
        raise InputError(f"{source} holds token id {high}, beyond int64: tokenize it again")


def token_chunks(path: Path, split: str = "train", vocab_size: int | None = None) -> list:
    """The flat token stream of ``path`` as a list of 1-D integer arrays, every file checked
    (see the section's comment) and every id in 0 .. vocab_size - 1."""
    is_dir = stat.S_ISDIR(_stat(path).st_mode)
    if is_dir and any(os.path.lexists(path / n) for n in ("state.json", "dataset_dict.json")):
        directory, files = _saved_dataset_files(path, split)
        parts = [(directory, _saved_dataset_chunks(directory, files))]
    else:
        if is_dir:
            files = sorted(p for p in path.iterdir() if p.suffix in TABLE_SUFFIXES)
            if not files:
                raise InputError(
                    f"{path} holds no save_to_disk dataset and no .parquet/.jsonl/.arrow files: "
                    "give a directory of them, or the token file itself"
                )
        elif path.suffix in TOKEN_SUFFIXES + TABLE_SUFFIXES:
            files = [path]
        else:
            raise InputError(
                f"{path}: unknown data format {path.suffix!r}; give a .bin (uint16) or .npy token "
                "file, .parquet/.jsonl files or a save_to_disk directory with input_ids"
            )
        parts = ((file, _file_chunks(file)) for file in files)  # checked as each is read
    chunks = []
    for source, got in parts:
        _check_ids(got, source, vocab_size)
        chunks += got
    return chunks


def open_dataset(
    path: str | Path | None,
    seq_len: int | None,
    vocab_size: int | None = None,
    split: str = "train",
    model_file: ModelFile | None = None,
) -> torch.utils.data.Dataset:
    """The map-style dataset of --data / --eval-data (``path``), or of the model file's
    make_dataset(split) without one. Raises InputError for what the user must fix."""
    if path is None:
        return model_file.make_dataset(split)
    if seq_len is None:
        raise InputError(
            f"--data {path} gives token windows, but the plan has no sequence length: plan with "
            "--seq-len, or define make_dataset(split) in the model file"
        )
    return TokenWindows(token_chunks(Path(path), split, vocab_size), seq_len, str(path))


def check_global_batch(dataset: torch.utils.data.Dataset, source: str, global_batch: int) -> None:
    """Training and eval data hold at least one global batch of samples."""
    if len(dataset) < global_batch:
        windows = ""
        if isinstance(dataset, TokenWindows):
            windows = f" ({dataset.num_tokens} tokens, windows of {dataset.seq_len + 1})"
        raise InputError(
            f"{source} holds {len(dataset)} samples{windows}, fewer than one global batch of "
            f"{global_batch}: give more data, or plan a smaller --global-batch"
        )
