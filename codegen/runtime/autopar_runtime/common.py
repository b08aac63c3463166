"""What every module of the runtime reads: the plan's constants (``Constants``), a user error
(``fail``: one line, exit 2, told to the other ranks through the launch store; ``InputError``
for checks that collect their message first), rank 0's lines (``say``) and module lookup.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
import types
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from .trust import release_lock

__all__ = [
    "Constants",
    "fail",
    "user_error_exit_code",
    "several_nodes",
    "dist_timeout",
    "launch_store",
    "tell_other_ranks",
    "InputError",
    "say",
    "has_submodule",
    "ModelFile",
    "Part",
]

ModelFile = types.ModuleType | types.SimpleNamespace
"""The user's model file as train.py loads it (build_model, make_batch, optionally loss_fn,
make_dataset, init_weights), or the one hf_model_file builds from an HF config."""
Part = tuple[nn.Module, torch.optim.Optimizer]
"""A model (or one pipeline stage) and its optimizer: what a checkpoint holds, part by part."""


@dataclasses.dataclass(frozen=True)
class Constants:
    """The plan as ``train.py`` states it (see the comments there for each name)."""

    MODEL_FILE: str
    FACTORY: str
    MESH: dict
    WORLD_SIZE: int
    CLUSTER: str
    RANKS_PER_NODE: int
    BACKEND: str
    GLOBAL_BATCH: int
    SEQ_LEN: int | None
    DTYPE: str
    OPTIMIZER: str
    LR: float
    TP_PLAN: dict = dataclasses.field(default_factory=dict)
    MODULE_ATTRS: dict = dataclasses.field(default_factory=dict)
    CHECKPOINT: list = dataclasses.field(default_factory=list)
    LAYERS: list = dataclasses.field(default_factory=list)
    OFFLOAD: bool = False
    MODEL_FLOPS: float | None = None
    PEAK_FLOPS: float | None = None
    AUTOPAR_VERSION: str | None = None
    HF_CONFIG: dict | None = None
    HF_TASK: str | None = None
    MASK_FRACTION: float = 0.15
    STAGES: list = dataclasses.field(default_factory=list)
    SCHEDULE: str = "none"
    MICROBATCHES: int = 1
    STAGES_PER_RANK: int = 1
    ACCUMULATION_STEPS: int = 1
    CONTEXT_PARALLEL: dict = dataclasses.field(default_factory=dict)
    EXPERT_PARALLEL: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def from_namespace(cls, namespace: dict) -> Constants:
        """The fields found in ``namespace`` (``train.py``'s ``globals()``)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in namespace.items() if k in names})

    @property
    def data_parallel(self) -> int:
        return self.MESH["dp"] * self.MESH["fsdp"]


def fail(message: str, *, tell_others: bool = True) -> None:
    """A user error: exit 2, before any collective so no rank waits on another. Every rank
    checks the same things and stops; rank 0 says why, in one line. On several nodes a check
    can fail on one node only (its model file, its launch): the rank tells the others through
    the rendezvous store (agree_on_launch), and every node's first rank prints the line."""
    if tell_others and several_nodes() and not dist.is_initialized():
        message = tell_other_ranks(message)
    first_of_node = several_nodes() and os.environ.get("LOCAL_RANK") == "0"
    if int(os.environ.get("RANK", 0)) == 0 or first_of_node:
        print(f"error: {message}", file=sys.stderr, flush=True)
    code = user_error_exit_code(message)
    release_lock()  # the checkpoint directory's, when this rank took it
    if dist.is_initialized():  # every rank stops here together (gloo's teardown is not forgiving)
        dist.barrier()
    sys.exit(code)


def user_error_exit_code(message: str) -> int:
    """2; or 0 under launch.sh's torchrun, once the error is recorded in AUTOPAR_ERROR_FILE.
    torchrun restarts the whole group after any failed worker, so a user error (exit 2) would
    run again --max-restarts times, printing the same line each time. Every rank of every node
    reaches fail() alike: each records the error in its node's file and ends cleanly, so every
    node's torchrun finishes at once without restarting, and each node's launch.sh, finding the
    file non-empty, exits 2. Crashes (tracebacks, a killed rank, a lost node) are still
    restarted."""
    path = os.environ.get("AUTOPAR_ERROR_FILE")
    if not path or "TORCHELASTIC_RUN_ID" not in os.environ:
        return 2
    try:
        with open(path, "a") as f:
            f.write(f"rank {os.environ.get('RANK', 0)}: {message}\n")
    except OSError:
        return 2
    return 0


def several_nodes() -> bool:
    """Whether torchrun started this run on more than one node."""
    return "RANK" in os.environ and int(os.environ.get("GROUP_WORLD_SIZE", 1)) > 1


def dist_timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get("DIST_TIMEOUT_S", 300)))


@functools.cache
def launch_store() -> tuple[dist.Store, int, int]:
    """This attempt's rendezvous store, rank and world size (under torchrun)."""
    store, rank, world = next(dist.rendezvous("env://", timeout=dist_timeout()))
    # torchrun's shared store keeps a dead attempt's keys (the ranks' addresses): prefix each
    # attempt's, or ranks of a restarted group connect to dead peers (torch 2.13). On one node
    # the restart count is the attempt; launch.sh for several nodes turns the sharing off
    # (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: rank 0 hosts a fresh store each attempt), since
    # the nodes' torchruns need not agree on their restart counts.
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"attempt_{attempt}", store)
    return store, rank, world


def _launch_key(rank: int) -> str:
    return f"autopar/launch/{rank}"


def tell_other_ranks(message: str) -> str:
    """Publish this rank's launch error for the others (agree_on_launch reads it); the rank
    that hosts the store waits (bounded) until every other rank has read it."""
    store, rank, world = launch_store()
    where = f"rank {rank} on node {os.environ.get('GROUP_RANK', '?')}"
    store.set(_launch_key(rank), f"error {message} ({where})")
    _wait_for_readers(store, rank, world)
    return f"{message} ({where})"


def _wait_for_readers(store: dist.Store, rank: int, world: int) -> None:
    store.add("autopar/launch/read", 1)
    if rank != 0:  # rank 0 hosts the store without torchrun's sharing: it leaves last
        return
    deadline = time.monotonic() + min(60.0, dist_timeout().total_seconds())
    while store.add("autopar/launch/read", 0) < world and time.monotonic() < deadline:
        time.sleep(0.05)


class InputError(Exception):
    """Bad data or weights given by the user: the script prints ``error: <message>`` and exits 2."""


def say(line: str) -> None:
    """Rank 0 prints ``line``."""
    if dist.get_rank() == 0:
        print(line, flush=True)


def has_submodule(model: nn.Module, fqn: str) -> bool:
    """Whether ``model`` holds the module ``fqn`` (a pipeline stage holds only its own)."""
    try:
        model.get_submodule(fqn)
    except AttributeError:
        return False
    return True
