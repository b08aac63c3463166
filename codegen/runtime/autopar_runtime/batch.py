"""Batches: the model file's ``make_batch`` and the pytree of tensors it returns (moved, split and
sliced per data-parallel rank leaf by leaf), the default loss, and the --data stream (the
seeded order, each step's positions, the loaders, ``DataStream``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

from .common import Constants, InputError, ModelFile, fail

__all__ = [
    "batch_maker",
    "call",
    "tensor_map",
    "device_of",
    "batch_rows",
    "batch_split",
    "the_tensor",
    "default_loss",
    "local_slice",
    "EVAL_BATCHES",
    "step_positions",
    "sample_at",
    "StepSampler",
    "collate",
    "make_loader",
    "eval_loader",
    "data_state",
    "DataStream",
    "to_device",
]


def batch_maker(
    c: Constants, model_file: ModelFile, model: nn.Module
) -> Callable[[int, int | None], tuple]:
    """The model file's make_batch, or random token ids for a causal LM without one."""
    if hasattr(model_file, "make_batch"):
        return model_file.make_batch
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if emb is None or c.SEQ_LEN is None:
        fail(
            f"{c.MODEL_FILE} defines no make_batch(batch_size, seq_len) and the model is not a "
            "causal LM with an nn.Embedding and a seq_len: add make_batch to the model file"
        )
    vocab = emb.num_embeddings

    def make_tokens(batch_size: int, seq_len: int):
        idx = torch.randint(0, vocab, (batch_size, seq_len + 1))
        return (idx[:, :-1],), idx[:, 1:]

    return make_tokens


# Batches of any shape. make_batch returns (inputs, target): inputs are the forward's arguments
# (a tuple) or its keyword arguments (a dict); each argument, and the target, may be a tensor or
# any pytree of them (dicts, lists, tuples; None and numbers pass through). Every tensor of one
# dim or more has the batch as its first dim: batches move to the device leaf by leaf, and
# data-parallel ranks and accumulation microbatches take their rows of every leaf. loss_fn gets
# the model's output as the forward returns it (a tensor, a dict, a tuple such as (logits,
# aux_loss), an HF ModelOutput) and the target as make_batch returns it.
def call(model: Callable[..., Any], inputs: tuple | dict) -> Any:
    """model(*inputs), or model(**inputs) for keyword inputs (a dict)."""
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def tensor_map(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``tree`` with ``fn`` applied to every tensor in it (the rest as is)."""
    return pytree.tree_map_only(torch.Tensor, fn, tree)


def device_of(tree: Any) -> torch.device:
    """The device of the first tensor in ``tree`` (the CPU when it holds none)."""
    leaf = next((x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)), None)
    return leaf.device if leaf is not None else torch.device("cpu")


def batch_rows(tree: Any, start: int, stop: int) -> Any:
    """Rows start:stop (the batch dim) of every tensor in ``tree``; 0-d tensors as they are."""
    return tensor_map(lambda x: x[start:stop] if x.dim() else x, tree)


def batch_split(tree: Any, n: int) -> list:
    """``tree`` in ``n`` microbatches of (nearly) equal rows, as Tensor.tensor_split."""
    if n == 1:
        return [tree]
    leaves, spec = pytree.tree_flatten(tree)
    pieces = [
        x.tensor_split(n) if isinstance(x, torch.Tensor) and x.dim() else [x] * n for x in leaves
    ]
    return [pytree.tree_unflatten([p[i] for p in pieces], spec) for i in range(n)]


def the_tensor(output: Any) -> torch.Tensor:
    """The model's output as one tensor for default_loss: the output itself, or the one
    tensor of a dict, tuple or ModelOutput that holds one; several need the file's loss_fn."""
    if isinstance(output, torch.Tensor):
        return output
    tensors = [x for x in pytree.tree_leaves(output) if isinstance(x, torch.Tensor)]
    if len(tensors) != 1:
        fail(
            f"the model returns a {type(output).__name__} of {len(tensors)} tensors and the "
            "model file defines no loss_fn: define loss_fn(output, target) in the model file"
        )
    return tensors[0]


def default_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    # Mean over all samples (and tokens): with equal local batches, the mean of the data-parallel
    # ranks' losses is the global mean, which is what DDP/FSDP gradient averaging assumes. In
    # fp32 (a bf16 plan's output is bf16).
    output = the_tensor(output)
    if target.is_floating_point():
        return F.mse_loss(output.float(), target.float())
    return F.cross_entropy(output.flatten(0, -2).float(), target.flatten())


def local_slice(c: Constants, batch: tuple, dp_rank: int) -> tuple:
    """This data-parallel rank's contiguous share of the global batch (TP peers share one): the
    rows [start, stop) of each step's batch, even (GLOBAL_BATCH / data_parallel) or the plan's
    uneven BATCH_SHARES (a cluster of several kinds of nodes)."""
    shares = c.BATCH_SHARES
    if shares is None:
        n = c.GLOBAL_BATCH // c.data_parallel
        return batch_rows(batch, dp_rank * n, (dp_rank + 1) * n)
    start = sum(shares[:dp_rank])
    return batch_rows(batch, start, start + shares[dp_rank])


# Order: the samples of epoch e are a permutation seeded by (data seed, e); the run reads them as
# one stream, GLOBAL_BATCH positions per step, and data-parallel rank r takes its contiguous share
# of each step's positions (TP and PP peers the same share). The position in that stream (samples
# consumed) and the data seed are saved in every checkpoint: a resumed run reads exactly the
# samples the uninterrupted one would have, even under another plan of another global batch.
# Evaluation (--eval-data, --eval-every K) reads the first EVAL_BATCHES global batches of the
# eval set in order, every K steps.
EVAL_BATCHES = 8


def step_positions(
    step: int,
    global_batch: int,
    dp_rank: int,
    dp_size: int,
    start: tuple[int, int] = (0, 0),
    shares: list[int] | None = None,
) -> range:
    """Stream positions read by ``dp_rank`` at ``step`` (1-based); ``start`` is (step,
    position) of the checkpoint resumed from; ``shares``: uneven samples per rank
    (BATCH_SHARES), else an even split."""
    first_step, first_position = start
    local = global_batch // dp_size if shares is None else shares[dp_rank]
    offset = dp_rank * local if shares is None else sum(shares[:dp_rank])
    base = first_position + (step - first_step - 1) * global_batch + offset
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

    def __init__(
        self,
        num_samples: int,
        global_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        first: int,
        last: int,
        start: tuple[int, int],
        shares: list[int] | None = None,
    ) -> None:
        self.args = num_samples, global_batch, dp_rank, dp_size, seed
        self.first, self.last, self.start, self.shares = first, last, start, shares

    def __len__(self) -> int:
        return max(0, self.last - self.first + 1)

    def __iter__(self):
        n, batch, rank, size, seed = self.args
        for step in range(self.first, self.last + 1):
            positions = step_positions(step, batch, rank, size, self.start, self.shares)
            yield [sample_at(p, n, seed) for p in positions]


def collate(items: list[tuple]) -> tuple:
    """Stack (inputs, target) samples: inputs a tensor, a tuple of them, or a dict (keyword
    inputs), each tensor possibly nested in lists, tuples and dicts (see call)."""
    inputs = [x if isinstance(x, tuple | list | dict) else (x,) for x, _ in items]
    stacked = torch.utils.data.default_collate(inputs)
    stacked = tuple(stacked) if isinstance(stacked, list) else stacked
    return stacked, torch.utils.data.default_collate([t for _, t in items])


def make_loader(
    dataset: torch.utils.data.Dataset,
    *,
    global_batch: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    first: int,
    last: int,
    start: tuple[int, int],
    workers: int = 2,
    shares: list[int] | None = None,
) -> torch.utils.data.DataLoader:
    """A DataLoader of this rank's batches for steps first..last (worker processes prefetch;
    pinned memory on CUDA); ``shares``: uneven samples per rank (BATCH_SHARES)."""
    sampler = StepSampler(
        len(dataset), global_batch, dp_rank, dp_size, seed, first, last, start, shares
    )
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


def eval_loader(
    dataset: torch.utils.data.Dataset, *, global_batch: int, dp_rank: int, dp_size: int
) -> torch.utils.data.DataLoader:
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


class DataStream:
    """The training batches of --data (or the model file's make_dataset): see the section's
    comment for the order. ``start`` is the (step, stream position) the run continues from."""

    def __init__(
        self,
        c: Constants,
        dataset: torch.utils.data.Dataset,
        seed: int,
        workers: int,
        eval_dataset: torch.utils.data.Dataset | None = None,
    ) -> None:
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

    def batches(
        self, first: int, last: int, device: torch.device, dp_rank: int, full: bool
    ) -> Iterator[tuple[int, tuple, tuple | None]]:
        """(step, this rank's batch, the global batch if ``full`` else None) for each step."""
        c = self.c
        common = dict(global_batch=c.GLOBAL_BATCH, seed=self.seed, first=first, last=last)
        loader = make_loader(
            self.dataset,
            dp_rank=dp_rank,
            dp_size=c.data_parallel,
            start=self.start,
            workers=self.workers,
            shares=c.BATCH_SHARES,
            **common,
        )
        full_loader = (
            make_loader(self.dataset, dp_rank=0, dp_size=1, start=self.start, workers=0, **common)
            if full
            else [None] * (last - first + 1)
        )
        for step, batch, whole in zip(range(first, last + 1), loader, full_loader):
            yield step, to_device(batch, device), to_device(whole, device)

    def eval_batches(self, device: torch.device, dp_rank: int) -> Iterator[tuple]:
        loader = eval_loader(
            self.eval_dataset,
            global_batch=self.c.GLOBAL_BATCH,
            dp_rank=dp_rank,
            dp_size=self.c.data_parallel,
        )
        for batch in loader:
            yield to_device(batch, device)


def to_device(batch: Any, device: torch.device) -> Any:
    if batch is None:
        return None
    return tensor_map(lambda x: x.to(device, non_blocking=True), batch)
