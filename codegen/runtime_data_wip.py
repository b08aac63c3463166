# ---- Data and weights ------------------------------------------------------------------------
# --data PATH: a flat token file (.bin of uint16, nanoGPT's train.bin; .npy of uint16/uint32), a
# directory written by HF datasets' save_to_disk, or .parquet / .jsonl files (or a directory of
# them) with an input_ids column. Every source becomes one flat token stream (rows concatenated in
# order, as written: tokenize with an end-of-text token to separate documents) cut into windows of
# seq_len + 1 tokens with a stride of seq_len: sample i is tokens[i*seq_len : (i+1)*seq_len + 1],
# inputs window[:-1], target window[1:]. Without --data, a model file's make_dataset(split) gives a
# map-style Dataset of (inputs, target).
#
# Order: the samples of epoch e are a permutation seeded by (data seed, e); the run reads them as
# one stream, GLOBAL_BATCH positions per step, and data-parallel rank r takes its contiguous share
# of each step's positions (TP and PP peers the same share). The position in that stream (samples
# consumed) and the data seed are saved in every checkpoint: a resumed run reads exactly the
# samples the uninterrupted one would have, even under another plan of another global batch.
# Evaluation (--eval-data, --eval-every K) reads the first EVAL_BATCHES global batches of the
# eval set in order, every K steps.
import json as _json
from pathlib import Path as _Path

import numpy as _np
import torch as _torch

EVAL_BATCHES = 8
TOKEN_SUFFIXES = (".bin", ".npy")
TABLE_SUFFIXES = (".parquet", ".jsonl", ".arrow")


class InputError(Exception):
    """Bad data or weights given by the user: the script prints ``error: <message>`` and exits 2."""


class TokenWindows(_torch.utils.data.Dataset):
    """Windows of seq_len + 1 tokens over a flat stream kept as a list of 1-D arrays (memory
    mapped where the format allows); item i is (inputs, target), int64."""

    def __init__(self, chunks: list, seq_len: int, source: str) -> None:
        self.chunks = [c for c in chunks if len(c)]
        self.starts = _np.cumsum([0] + [len(c) for c in self.chunks])
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

    def tokens(self, start: int, stop: int) -> _np.ndarray:
        first = int(_np.searchsorted(self.starts, start, side="right")) - 1
        parts = []
        while start < stop:
            chunk = self.chunks[first]
            lo = start - int(self.starts[first])
            piece = chunk[lo : lo + stop - start]
            parts.append(_np.asarray(piece))
            start += len(piece)
            first += 1
        return parts[0] if len(parts) == 1 else _np.concatenate(parts)

    def __getitem__(self, i: int):
        if not 0 <= i < len(self):
            raise IndexError(i)
        window = _torch.from_numpy(
            self.tokens(i * self.seq_len, (i + 1) * self.seq_len + 1).astype(_np.int64)
        )
        return window[:-1], window[1:]

    def max_token(self) -> int:
        """The largest token id (read in chunks of 2^26 tokens: a memory-mapped file stays out of
        memory)."""
        step = 1 << 26
        return max(int(c[k : k + step].max()) for c in self.chunks for k in range(0, len(c), step))


def read_token_file(path: _Path) -> _np.ndarray:
    """A .bin (uint16) or .npy (uint16/uint32, 1-D) token file, memory mapped."""
    if path.suffix == ".bin":
        size = path.stat().st_size
        if size % 2:
            raise InputError(
                f"{path} has {size} bytes, an odd count: a .bin token file holds uint16 tokens "
                "(2 bytes each; nanoGPT's train.bin). Write uint32 tokens as .npy"
            )
        return _np.memmap(path, dtype=_np.uint16, mode="r")
    try:
        array = _np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as e:
        raise InputError(f"{path} is not a .npy array ({e})") from None
    if array.dtype not in (_np.uint16, _np.uint32) or array.ndim != 1:
        raise InputError(
            f"{path} holds a {array.ndim}-D {array.dtype} array: a .npy token file holds one "
            "1-D uint16 or uint32 array (np.save(path, tokens.astype(np.uint32)))"
        )
    return array


def _import_pyarrow(path: _Path):
    try:
        import pyarrow  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise InputError(
            f"reading {path} needs pyarrow, which is not installed: pip install pyarrow"
        ) from None
    return pyarrow


def _column_chunks(table, path: _Path) -> list:
    if "input_ids" not in table.column_names:
        raise InputError(
            f"{path} has no input_ids column (columns: {', '.join(table.column_names[:8])}): "
            "tokenize it into input_ids, or give a flat token file"
        )
    chunks = []
    for chunk in table.column("input_ids").chunks:
        values = chunk.flatten() if hasattr(chunk, "flatten") else chunk
        chunks.append(values.to_numpy(zero_copy_only=False))
    return chunks


def _jsonl_chunks(path: _Path) -> list:
    chunks = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = _json.loads(line)
            except ValueError as e:
                raise InputError(f"{path} line {number} is not JSON ({e})") from None
            if not isinstance(row, dict) or "input_ids" not in row:
                raise InputError(
                    f"{path} line {number} has no input_ids field: each line must be a JSON "
                    'object like {"input_ids": [1, 2, 3]}'
                )
            chunks.append(_np.asarray(row["input_ids"], dtype=_np.int64))
    return chunks


def _arrow_chunks(path: _Path) -> list:
    """An Arrow IPC file as save_to_disk writes it (stream format), memory mapped."""
    pa = _import_pyarrow(path)
    source = pa.memory_map(str(path))
    try:
        table = pa.ipc.open_stream(source).read_all()
    except pa.ArrowInvalid:
        table = pa.ipc.open_file(source).read_all()
    return _column_chunks(table, path)


def _saved_dataset_files(path: _Path, split: str) -> list[_Path]:
    """The Arrow files of a save_to_disk directory (of a Dataset, or a DatasetDict's split)."""
    splits_file = path / "dataset_dict.json"
    if splits_file.is_file():
        splits = _json.loads(splits_file.read_text()).get("splits", [])
        wanted = ["train"] if split == "train" else ["validation", "test"]
        found = next((s for s in wanted if s in splits), None)
        if found is None:
            raise InputError(
                f"{path} is a DatasetDict with splits {splits}, none of {wanted}: give the "
                f"split's directory ({path}/<split>)"
            )
        path = path / found
    state = _json.loads((path / "state.json").read_text())
    return [path / f["filename"] for f in state["_data_files"]]


def token_chunks(path: _Path, split: str = "train") -> list:
    """The flat token stream of ``path`` as a list of 1-D integer arrays."""
    if not path.exists():
        raise InputError(f"data path {path} does not exist")
    if path.is_file() and path.suffix in TOKEN_SUFFIXES:
        return [read_token_file(path)]
    if path.is_dir() and (
        (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()
    ):
        files = _saved_dataset_files(path, split)
    elif path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in TABLE_SUFFIXES)
        if not files:
            raise InputError(
                f"{path} holds no save_to_disk dataset and no .parquet/.jsonl/.arrow files"
            )
    elif path.suffix in TABLE_SUFFIXES:
        files = [path]
    else:
        raise InputError(
            f"{path}: unknown data format {path.suffix!r}; give a .bin (uint16) or .npy token "
            "file, .parquet/.jsonl files or a save_to_disk directory with input_ids"
        )
    chunks = []
    for file in files:
        if file.suffix == ".jsonl":
            chunks += _jsonl_chunks(file)
        elif file.suffix == ".arrow":
            chunks += _arrow_chunks(file)
        else:
            pa = _import_pyarrow(file)
            chunks += _column_chunks(pa.parquet.read_table(file, columns=None), file)
    for c in chunks:
        if not _np.issubdtype(c.dtype, _np.integer):
            raise InputError(f"{path}: input_ids hold {c.dtype} values, not integer token ids")
    return chunks


def open_dataset(path, seq_len, vocab_size=None, split="train", model_file=None):
    """The map-style dataset of --data / --eval-data (``path``), or of the model file's
    make_dataset(split) without one. Raises InputError for what the user must fix."""
    if path is None:
        return model_file.make_dataset(split)
    if seq_len is None:
        raise InputError(
            f"--data {path} gives token windows, but the plan has no sequence length: plan with "
            "--seq-len, or define make_dataset(split) in the model file"
        )
    dataset = TokenWindows(token_chunks(_Path(path), split), seq_len, str(path))
    if vocab_size is not None:
        top = dataset.max_token()
        if top >= vocab_size:
            raise InputError(
                f"{path} holds token id {top}, but the model's vocabulary has {vocab_size} "
                "tokens: tokenize with the model's tokenizer"
            )
    return dataset


def step_positions(step: int, global_batch: int, dp_rank: int, dp_size: int, start=(0, 0)):
    """Stream positions read by ``dp_rank`` at ``step`` (1-based); ``start`` is (step,
    position) of the checkpoint resumed from."""
    first_step, first_position = start
    local = global_batch // dp_size
    base = first_position + (step - first_step - 1) * global_batch + dp_rank * local
    return range(base, base + local)


def sample_at(position: int, num_samples: int, seed: int) -> int:
    """The sample index at a stream position: epoch e reads a permutation seeded by (seed, e)."""
    epoch, offset = divmod(position, num_samples)
    return int(_epoch_order(num_samples, seed, epoch)[offset])


_ORDERS: dict = {}


def _epoch_order(num_samples: int, seed: int, epoch: int) -> _torch.Tensor:
    key = (num_samples, seed, epoch)
    if key not in _ORDERS:
        _ORDERS.clear()  # one epoch at a time (two at an epoch boundary)
        generator = _torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        _ORDERS[key] = _torch.randperm(num_samples, generator=generator)
    return _ORDERS[key]


class StepSampler(_torch.utils.data.Sampler):
    """Batch sampler: the sample indices of each step from ``first`` to ``last``, one list a
    step, for one data-parallel rank."""

    def __init__(self, num_samples, global_batch, dp_rank, dp_size, seed, first, last, start):
        self.args = num_samples, global_batch, dp_rank, dp_size, seed
        self.first, self.last, self.start = first, last, start

    def __len__(self) -> int:
        return max(0, self.last - self.first + 1)

    def __iter__(self):
        n, batch, rank, size, seed = self.args
        for step in range(self.first, self.last + 1):
            positions = step_positions(step, batch, rank, size, self.start)
            yield [sample_at(p, n, seed) for p in positions]


def collate(items):
    """Stack (inputs, target) samples: inputs a tensor or a tuple of them."""
    inputs = [x if isinstance(x, tuple | list) else (x,) for x, _ in items]
    stacked = tuple(_torch.stack(column) for column in zip(*inputs))
    return stacked, _torch.stack([_torch.as_tensor(t) for _, t in items])


def make_loader(dataset, *, global_batch, dp_rank, dp_size, seed, first, last, start, workers=2):
    """A DataLoader of this rank's batches for steps first..last (worker processes prefetch;
    pinned memory on CUDA)."""
    sampler = StepSampler(len(dataset), global_batch, dp_rank, dp_size, seed, first, last, start)
    cuda = _torch.cuda.is_available()
    options = {"prefetch_factor": 4, "persistent_workers": False} if workers else {}
    return _torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=workers,
        collate_fn=collate,
        pin_memory=cuda,
        **options,
    )


def eval_loader(dataset, *, global_batch, dp_rank, dp_size):
    """The first EVAL_BATCHES global batches of the eval set, in order, this rank's share."""
    batches = min(EVAL_BATCHES, len(dataset) // global_batch)
    if batches == 0:
        raise InputError(
            f"the eval data holds {len(dataset)} samples, fewer than one global batch of "
            f"{global_batch}: give more eval data"
        )
    local = global_batch // dp_size
    order = [
        list(range(b * global_batch + dp_rank * local, b * global_batch + (dp_rank + 1) * local))
        for b in range(batches)
    ]
    return _torch.utils.data.DataLoader(dataset, batch_sampler=order, collate_fn=collate)


def data_state(position: int, seed: int, num_samples: int) -> dict:
    """What a checkpoint keeps of the data: the stream position, the order's seed, the size."""
    return {
        "position": _torch.tensor(position),
        "seed": _torch.tensor(seed),
        "num_samples": _torch.tensor(num_samples),
    }


# --init-from PATH loads the model's weights before step 1 (not the optimizer: a fresh run from
# pretrained weights): a DCP checkpoint of any plan (a directory with .metadata: a step_<N>/ of
# --checkpoint-dir, or that directory itself for its latest complete step, or any DCP save of a
# model state dict) or a HuggingFace directory of *.safetensors (HuggingFaceStorageReader). Each
# rank reads only the parts of its shards. Names are checked on the unsharded model (on meta)
# before any collective: a checkpoint name may differ from the model's by a leading "model."
# (a base model's checkpoint in a model with a head, or the reverse); a tied weight (an LM head
# sharing the embedding) is loaded through whichever of its names the checkpoint has.
# --save-hf DIR writes the trained weights as HF safetensors (HuggingFaceStorageWriter: each
# rank its shards, consolidated into model-00001-of-00001.safetensors + its index), the config
# of an hf: model beside them, so transformers' from_pretrained(DIR) loads them.
SAVE_HF_MARKER = "autopar-save-hf.json"


def init_source(path) -> tuple[str, _Path]:
    """("dcp" | "hf", directory) of an --init-from path."""
    path = _Path(path)
    if not path.is_dir():
        raise InputError(f"--init-from {path}: no such directory (a DCP or HF safetensors one)")
    if (path / ".metadata").is_file():
        return "dcp", path
    steps = [
        p
        for p in path.glob("step_*")
        if p.name[5:].isdigit() and (p / "COMPLETE").is_file() and (p / ".metadata").is_file()
    ]
    if steps:
        return "dcp", max(steps, key=lambda p: int(p.name[5:]))
    if any(path.glob("*.safetensors")):
        return "hf", path
    raise InputError(
        f"--init-from {path} holds neither a DCP checkpoint (.metadata) nor *.safetensors files"
    )


def _storage_reader(kind: str, path: _Path):
    from torch.distributed.checkpoint import FileSystemReader, HuggingFaceStorageReader

    return HuggingFaceStorageReader(str(path)) if kind == "hf" else FileSystemReader(str(path))


def saved_shapes(kind: str, path: _Path) -> dict:
    """Name -> shape of every tensor in the checkpoint (headers only)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = _storage_reader(kind, path).read_metadata()
    except Exception as e:  # a damaged file: safetensors and pickle raise many kinds
        raise InputError(f"--init-from {path}: cannot read it ({type(e).__name__}: {e})") from None
    return {
        name: tuple(md.size)
        for name, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }


def tied_groups(model) -> list[list[str]]:
    """The model's state-dict names, grouped by the tensor they name (a tied weight: several)."""
    groups: dict = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return list(groups.values())


def _few(names) -> str:
    names = sorted(names)
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def match_names(model, saved: dict, path) -> dict:
    """Model name -> checkpoint name for every tensor of the unsharded ``model`` (meta is fine)
    in ``saved`` (name -> shape); InputError naming the first few missing, unexpected or
    wrong-shaped names. A --checkpoint-dir step holds the model under "model."."""
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if any(k.startswith("model.") for k in saved) and any(
        k.startswith("optimizer.") for k in saved
    ):
        saved = {k[6:]: v for k, v in saved.items() if k.startswith("model.")}
        outer = "model."  # keys as training_state nests them
    else:
        outer = ""
    candidates = [lambda k: k, lambda k: k.removeprefix("model."), lambda k: "model." + k]
    rename = max(candidates, key=lambda f: sum(f(k) in saved for k in shapes))
    mapping, missing, wrong = {}, [], []
    for group in tied_groups(model):
        present = [k for k in group if rename(k) in saved]
        if not present:
            missing.append(group[0])
        for k in present:
            if saved[rename(k)] != shapes[k]:
                wrong.append(f"{rename(k)} {list(saved[rename(k)])} != {list(shapes[k])}")
            mapping[k] = outer + rename(k)
    unexpected = set(saved) - {m[len(outer) :] for m in mapping.values()}
    problems = []
    if missing:
        problems.append(f"missing {_few(missing)}")
    if unexpected:
        problems.append(f"unexpected {_few(unexpected)}")
    if wrong:
        problems.append(f"wrong shape {_few(wrong)}")
    if problems:
        raise InputError(
            f"--init-from {path} does not fit the model: {'; '.join(problems)} (nothing loaded)"
        )
    return mapping


def load_weights(kind: str, path: _Path, mapping: dict, modules) -> None:
    """Load the checkpoint into the (sharded) ``modules`` (this rank's: one, or its pipeline
    stages), each rank reading only its shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    states = [get_model_state_dict(m) for m in modules]
    wanted = {mapping[k]: v for state in states for k, v in state.items() if k in mapping}
    dcp.load(wanted, storage_reader=_storage_reader(kind, path))
    loaded = {k: wanted[mapping[k]] for state in states for k in state if k in mapping}
    for module, state in zip(modules, states):
        mine = {k: loaded[k] for k in state if k in loaded}
        set_model_state_dict(module, mine, options=StateDictOptions(strict=False))


def load_reference_weights(kind: str, path: _Path, mapping: dict, model) -> None:
    """Load the whole checkpoint into the unsharded ``model`` (--verify's reference), in this
    process alone."""
    import torch.distributed.checkpoint as dcp

    state = model.state_dict()
    wanted = {mapping[k]: v for k, v in state.items() if k in mapping}
    dcp.load(wanted, storage_reader=_storage_reader(kind, path), no_dist=True)
    model.load_state_dict({k: wanted[mapping[k]] for k in state if k in mapping}, strict=False)


def check_save_hf(directory) -> None:
    """Before any collective: --save-hf never writes into a directory it did not create."""
    directory = _Path(directory)
    if directory.exists() and (
        not directory.is_dir()
        or (any(directory.iterdir()) and not (directory / SAVE_HF_MARKER).is_file())
    ):
        raise InputError(
            f"--save-hf {directory} exists and was not written by --save-hf: give a new or "
            "empty directory (nothing of yours is overwritten)"
        )


def save_hf(directory, modules, rank: int, config=None) -> None:
    """The trained weights as HF safetensors in ``directory`` (all ranks call it)."""
    import shutil

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    directory = _Path(directory)
    state, seen = {}, set()
    for module in modules:
        for name, tensor in get_model_state_dict(module).items():
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            key = (local.data_ptr(), local.dtype) if local.numel() else id(tensor)
            if key in seen or id(tensor) in seen:  # a tied weight: saved under its first name
                continue
            seen.update((key, id(tensor)))
            state[name] = tensor
    if rank == 0:
        if directory.is_dir():  # an earlier --save-hf's (check_save_hf)
            shutil.rmtree(directory)
        directory.mkdir(parents=True)
        (directory / SAVE_HF_MARKER).write_text(_json.dumps({"files": "written by --save-hf"}))
    dist.barrier()
    writer = HuggingFaceStorageWriter(
        str(directory), save_distributed=True, enable_consolidation=True
    )
    dcp.save(state, storage_writer=writer)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(directory / "sharded", ignore_errors=True)  # the ranks' parts, consolidated
        if config is not None:
            config.save_pretrained(str(directory))
        print(f"save-hf: wrote {len(state)} tensors to {directory}", flush=True)
