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
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

EVAL_BATCHES = 8
TOKEN_SUFFIXES = (".bin", ".npy")
TABLE_SUFFIXES = (".parquet", ".jsonl", ".arrow")


class InputError(Exception):
    """Bad data or weights given by the user: the script prints ``error: <message>`` and exits 2."""


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

    def max_token(self) -> int:
        """The largest token id (read in chunks of 2^26 tokens: a memory-mapped file stays out of
        memory)."""
        step = 1 << 26
        return max(int(c[k : k + step].max()) for c in self.chunks for k in range(0, len(c), step))


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
    except ValueError as e:
        raise InputError(f"{path} is not a .npy array ({e})") from None
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


def _column_chunks(table, path: Path) -> list:
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


def _jsonl_chunks(path: Path) -> list:
    chunks = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise InputError(f"{path} line {number} is not JSON ({e})") from None
            if not isinstance(row, dict) or "input_ids" not in row:
                raise InputError(
                    f"{path} line {number} has no input_ids field: each line must be a JSON "
                    'object like {"input_ids": [1, 2, 3]}'
                )
            chunks.append(np.asarray(row["input_ids"], dtype=np.int64))
    return chunks


def _arrow_chunks(path: Path) -> list:
    """An Arrow IPC file as save_to_disk writes it (stream format), memory mapped."""
    pa = _import_pyarrow(path)
    source = pa.memory_map(str(path))
    try:
        table = pa.ipc.open_stream(source).read_all()
    except pa.ArrowInvalid:
        table = pa.ipc.open_file(source).read_all()
    return _column_chunks(table, path)


def _saved_dataset_files(path: Path, split: str) -> list[Path]:
    """The Arrow files of a save_to_disk directory (of a Dataset, or a DatasetDict's split)."""
    splits_file = path / "dataset_dict.json"
    if splits_file.is_file():
        splits = json.loads(splits_file.read_text()).get("splits", [])
        wanted = ["train"] if split == "train" else ["validation", "test"]
        found = next((s for s in wanted if s in splits), None)
        if found is None:
            raise InputError(
                f"{path} is a DatasetDict with splits {splits}, none of {wanted}: give the "
                f"split's directory ({path}/<split>)"
            )
        path = path / found
    state = json.loads((path / "state.json").read_text())
    return [path / f["filename"] for f in state["_data_files"]]


def token_chunks(path: Path, split: str = "train") -> list:
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
        if not np.issubdtype(c.dtype, np.integer):
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
    dataset = TokenWindows(token_chunks(Path(path), split), seq_len, str(path))
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


def _epoch_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    key = (num_samples, seed, epoch)
    if key not in _ORDERS:
        _ORDERS.clear()  # one epoch at a time (two at an epoch boundary)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        _ORDERS[key] = torch.randperm(num_samples, generator=generator)
    return _ORDERS[key]


class StepSampler(torch.utils.data.Sampler):
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
    stacked = tuple(torch.stack(column) for column in zip(*inputs))
    return stacked, torch.stack([torch.as_tensor(t) for _, t in items])


def make_loader(dataset, *, global_batch, dp_rank, dp_size, seed, first, last, start, workers=2):
    """A DataLoader of this rank's batches for steps first..last (worker processes prefetch;
    pinned memory on CUDA)."""
    sampler = StepSampler(len(dataset), global_batch, dp_rank, dp_size, seed, first, last, start)
    cuda = torch.cuda.is_available()
    options = {"prefetch_factor": 4, "persistent_workers": False} if workers else {}
    return torch.utils.data.DataLoader(
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
    return torch.utils.data.DataLoader(dataset, batch_sampler=order, collate_fn=collate)


def data_state(position: int, seed: int, num_samples: int) -> dict:
    """What a checkpoint keeps of the data: the stream position, the order's seed, the size."""
    return {
        "position": torch.tensor(position),
        "seed": torch.tensor(seed),
        "num_samples": torch.tensor(num_samples),
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


def init_source(path) -> tuple[str, Path]:
    """("dcp" | "hf", directory) of an --init-from path."""
    path = Path(path)
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


def _storage_reader(kind: str, path: Path):
    from torch.distributed.checkpoint import FileSystemReader, HuggingFaceStorageReader

    return HuggingFaceStorageReader(str(path)) if kind == "hf" else FileSystemReader(str(path))


def saved_shapes(kind: str, path: Path) -> dict:
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


def load_weights(kind: str, path: Path, mapping: dict, modules) -> None:
    """Load the checkpoint into the (sharded) ``modules`` (this rank's: one, or its pipeline
    stages), each rank reading only its shards."""
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


def load_reference_weights(kind: str, path: Path, mapping: dict, model) -> None:
    """Load the whole checkpoint into the unsharded ``model`` (--verify's reference), in this
    process alone."""
    state = model.state_dict()
    wanted = {mapping[k]: v for k, v in state.items() if k in mapping}
    dcp.load(wanted, storage_reader=_storage_reader(kind, path), no_dist=True)
    model.load_state_dict({k: wanted[mapping[k]] for k in state if k in mapping}, strict=False)


def check_save_hf(directory) -> None:
    """Before any collective: --save-hf never writes into a directory it did not create."""
    directory = Path(directory)
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
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    directory = Path(directory)
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
        (directory / SAVE_HF_MARKER).write_text(json.dumps({"files": "written by --save-hf"}))
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


# ---- What train.py calls ----
def add_data_args(p) -> None:
    """The flags of this section (parse_args adds them)."""
    p.add_argument("--data", default=None, help="training data: token file, parquet/jsonl, dir")
    p.add_argument("--eval-data", default=None, help="validation data (the same formats)")
    p.add_argument("--eval-every", type=int, default=None, help="log eval_loss every K steps")
    p.add_argument("--data-workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--init-from", default=None, help="DCP checkpoint or HF safetensors dir")
    p.add_argument("--save-hf", default=None, help="write the final weights as HF safetensors")


class DataStream:
    """The training batches of --data (or the model file's make_dataset): see the section's
    comment for the order. ``start`` is the (step, stream position) the run continues from."""

    def __init__(self, c, dataset, seed: int, workers: int, eval_dataset=None) -> None:
        self.c, self.dataset, self.seed, self.workers = c, dataset, seed, workers
        self.eval_dataset = eval_dataset
        self.start = (0, 0)

    def state(self, step: int) -> dict:
        """For a checkpoint after ``step``."""
        position = self.start[1] + (step - self.start[0]) * self.c.GLOBAL_BATCH
        return data_state(position, self.seed, len(self.dataset))

    def restore(self, state: dict, step: int) -> None:
        """Continue after ``step`` from a checkpoint's data state."""
        self.seed = int(state["seed"])
        self.start = (step, int(state["position"]))
        if int(state["num_samples"]) != len(self.dataset) and dist.get_rank() == 0:
            print(
                f"warning: the checkpoint's data had {int(state['num_samples'])} samples, "
                f"--data has {len(self.dataset)}: the sample order differs from the saved run's",
                file=sys.stderr,
                flush=True,
            )

    def batches(self, first: int, last: int, device, dp_rank: int, full: bool):
        """(step, this rank's batch, the global batch if ``full`` else None) for each step."""
        c = self.c
        common = dict(global_batch=c.GLOBAL_BATCH, seed=self.seed, first=first, last=last)
        loader = make_loader(
            self.dataset,
            dp_rank=dp_rank,
            dp_size=c.data_parallel,
            start=self.start,
            workers=self.workers,
            **common,
        )
        full_loader = (
            make_loader(self.dataset, dp_rank=0, dp_size=1, start=self.start, workers=0, **common)
            if full
            else [None] * (last - first + 1)
        )
        for step, batch, whole in zip(range(first, last + 1), loader, full_loader):
            yield step, to_device(batch, device), to_device(whole, device)

    def eval_batches(self, device, dp_rank: int):
        loader = eval_loader(
            self.eval_dataset,
            global_batch=self.c.GLOBAL_BATCH,
            dp_rank=dp_rank,
            dp_size=self.c.data_parallel,
        )
        for batch in loader:
            yield to_device(batch, device)


def to_device(batch, device):
    if batch is None:
        return None
    inputs, target = batch
    move = lambda x: x.to(device, non_blocking=True)  # noqa: E731
    return tuple(move(x) for x in inputs), move(target)


def vocab_size(c, model) -> int | None:
    """The model's vocabulary (token ids must be below it), where it has one."""
    if c.HF_CONFIG is not None and "vocab_size" in c.HF_CONFIG:
        return c.HF_CONFIG["vocab_size"]
    emb = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    return emb.num_embeddings if emb is not None else None


def open_inputs(c, args, model_file, model):
    """--data / --eval-data / --init-from / --save-hf, opened and checked on every rank before
    any collective (``model``: the unsharded model, on meta or not): (data stream or None,
    (kind, path, name map) or None). A user's mistake is one error line, exit 2."""
    rank0 = int(os.environ.get("RANK", 0)) == 0
    init = None
    try:
        if args.eval_every is not None and (args.eval_every < 1 or args.eval_data is None):
            raise InputError(f"--eval-every {args.eval_every} needs --eval-data, and K >= 1")
        if args.eval_data is not None and args.eval_every is None:
            raise InputError("--eval-data needs --eval-every K (evaluate every K steps)")
        if args.data_workers < 0:
            raise InputError(f"--data-workers {args.data_workers} must be >= 0")
        if args.save_hf is not None:
            check_save_hf(args.save_hf)
        if args.init_from is not None:
            kind, path = init_source(args.init_from)
            init = kind, path, match_names(model, saved_shapes(kind, path), path)
        vocab = vocab_size(c, model)
        own = hasattr(model_file, "make_dataset")
        data = None
        if args.data is not None or own:
            dataset = open_dataset(args.data, c.SEQ_LEN, vocab, "train", model_file)
            eval_dataset = None
            if args.eval_data is not None:
                eval_dataset = open_dataset(args.eval_data, c.SEQ_LEN, vocab, "eval", model_file)
                eval_loader(eval_dataset, global_batch=c.GLOBAL_BATCH, dp_rank=0, dp_size=1)
            data = DataStream(c, dataset, args.seed, args.data_workers, eval_dataset)
        elif args.eval_data is not None:
            raise InputError("--eval-data needs --data (training on synthetic batches)")
    except InputError as e:
        fail(str(e))  # noqa: F821 (the runtime module's)
    if data is None and rank0:
        print("data: no --data given, training on synthetic batches", file=sys.stderr, flush=True)
    return data, init


def load_init(init, modules, reference=None) -> None:
    """--init-from into this rank's (sharded) modules, and into --verify's reference."""
    if init is None:
        return
    kind, path, mapping = init
    load_weights(kind, path, mapping, modules)
    if reference is not None:
        load_reference_weights(kind, path, mapping, reference)
    if dist.get_rank() == 0:
        print(f"init: loaded {len(mapping)} tensors from {path} ({kind})", flush=True)


def hf_config(c):
    """The transformers config of an hf: plan (written beside --save-hf's weights)."""
    if c.HF_CONFIG is None:
        return None
    import transformers

    kwargs = {k: v for k, v in c.HF_CONFIG.items() if k not in ("model_type", "torch_dtype")}
    return transformers.AutoConfig.for_model(c.HF_CONFIG["model_type"], **kwargs)


def evaluate(c, step: int, data, device, dp_rank: int, forward_loss) -> None:
    """Rank 0 logs {"step", "eval_loss"}: the mean loss over the eval batches, where
    ``forward_loss(batch)`` is this rank's loss of a batch (0 off the last pipeline stage)."""
    losses = [mean_loss(c, forward_loss(b)) for b in data.eval_batches(device, dp_rank)]  # noqa: F821
    if dist.get_rank() == 0:
        print(json.dumps({"step": step, "eval_loss": sum(losses) / len(losses)}), flush=True)


def eval_loss_fn(c, model, loss_fn):
    """This rank's forward-only loss of a batch (--eval-data), the model in eval mode."""

    def run(batch):
        inputs, target = batch
        model.eval()
        with (
            torch.no_grad(),
            torch.autocast(target.device.type, torch.bfloat16, enabled=c.DTYPE == "bf16"),
        ):
            loss = loss_fn(model(*inputs), target)
        model.train()
        return loss.detach().float()

    return run


def pipeline_eval_loss_fn(c, schedule, modules, holds_last: bool):
    """As eval_loss_fn through the pipeline schedule (forward only): the mean over
    microbatches where this rank holds the last stage, else 0."""

    def run(batch):
        inputs, target = batch
        losses = []
        for m in modules:
            m.eval()
        with (
            torch.no_grad(),
            torch.autocast(target.device.type, torch.bfloat16, enabled=c.DTYPE == "bf16"),
        ):
            schedule.eval(*inputs, target=target, losses=losses)
        for m in modules:
            m.train()
        if holds_last:
            return torch.stack([loss.detach().float() for loss in losses]).mean()
        return torch.zeros((), device=target.device)

    return run
