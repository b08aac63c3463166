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
from typing import Any, TextIO

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
    "write_line",
    "has_submodule",
    "ModelFile",
    "Part",
]

ModelFile = types.ModuleType | types.SimpleNamespace
"""The user's model file as train.py loads it (build_model, make_batch, optionally loss_fn,
make_dataset, init_weights), or the one hf_model_file builds from an HF config."""
Part = tuple[nn.Module, torch.optim.Optimizer]
"""A model (or one pipeline stage) and its optimizer: what a checkpoint holds, part by part."""


def _constant(doc: str = "", default: Any = dataclasses.MISSING) -> Any:
    """A field of :class:`Constants`. ``doc``: the comment train.py states above it, which
    also covers the fields after it that have none (a group); ``default``: the value where a
    program does not state it (the feature is off)."""
    metadata = {"doc": " ".join(doc.split())}
    if isinstance(default, (dict, list)):
        assert not default, "a mutable default is empty"
        return dataclasses.field(default_factory=type(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Constants:
    """The plan as ``train.py`` states it: the one list of the plan's constants. ``emit``
    writes train.py's constants block from these fields (their order, each group's comment)
    with the plan's values; a program states the fields its plan uses, the others keep their
    defaults. They are the planner's answers (the mesh, FSDP2 or DDP, the schedule's class and
    where each stage runs): the runtime executes them and decides none of them again."""

    MODEL_FILE: str = _constant(
        "The user's model file, imported by absolute path, and the function in it that builds "
        "the model."
    )
    FACTORY: str = _constant()
    MESH: dict = _constant(
        "Degrees of the device mesh, outermost first; their product is the world size. pp cuts "
        "the model into pipeline stages, dp replicates it, fsdp shards parameters/grads/optimizer "
        "state, tp splits layers (innermost, so one TP group's ranks are adjacent: inside a node)."
    )
    WORLD_SIZE: int = _constant()
    DATA_PARALLEL: str = _constant(
        'How the data-parallel ranks hold the model (the planner\'s choice): "fsdp2" (FSDP2 '
        'fully_shard; HSDP where dp > 1), "ddp" (DistributedDataParallel over dp) or "none"; see '
        "autopar_runtime/data_parallel.py.",
        "none",
    )
    CLUSTER: str = _constant(
        "The cluster planned for, the ranks it runs on each node, and its backend: gloo on CPU, "
        "nccl on GPU (one rank per GPU)."
    )
    RANKS_PER_NODE: int = _constant()
    BACKEND: str = _constant()
    GLOBAL_BATCH: int = _constant(
        "Samples per optimizer step over all data-parallel ranks, and tokens per sample (None: no "
        "sequence dimension)."
    )
    SEQ_LEN: int | None = _constant()
    DTYPE: str = _constant(
        "fp32, or bf16: compute in bf16 over fp32 parameters (FSDP2 MixedPrecisionPolicy where "
        "DATA_PARALLEL is fsdp2, else autocast; see autopar_runtime/data_parallel.py)."
    )
    OPTIMIZER: str = _constant()
    LR: float = _constant()
    TP_PLAN: dict = _constant(
        "Module FQN -> tensor-parallel style (rt.TP_STYLES, autopar_runtime/tensor_parallel.py); "
        "others are replicated. Empty: no tensor parallelism.",
        {},
    )
    MODULE_ATTRS: dict = _constant(
        "Module FQN -> int attributes to set before TP, e.g. a head count that must become local.",
        {},
    )
    CHECKPOINT: list = _constant(
        "Layers whose activations are recomputed in backward instead of kept (saves memory).", []
    )
    LAYERS: list = _constant(
        "The planned layers: each one FSDP2 unit (gathered just before use, freed after), but a "
        "layer holding a weight tied to another's joins the root unit (rt.fsdp_units); --compile "
        "compiles each.",
        [],
    )
    FSDP_ROOT: list = _constant(
        "Layers the root FSDP2 unit holds (gathered for the whole step), not units of their own: "
        "each holds a weight that code outside it reads too (F.linear(x, self.wte.weight)).",
        [],
    )
    OFFLOAD: bool = _constant(
        "Keep parameters, gradients and optimizer state in host memory (FSDP2 CPUOffloadPolicy): "
        "the planner's last resort when they do not fit on the device; the optimizer step runs "
        "on the CPU.",
        False,
    )
    MODEL_FLOPS: float | None = _constant(
        "For the logged MFU: the model's forward + backward FLOPs for one global batch as "
        "autopar's IR counts them (2 per multiply-add of matmuls and attention, 1 per element of "
        "other ops; not the recomputation of checkpointed layers), and one device's peak FLOP/s "
        "for DTYPE (the cluster spec's). None: not known (a plan made by hand).",
        None,
    )
    PEAK_FLOPS: float | None = _constant(default=None)
    AUTOPAR_VERSION: str | None = _constant(
        "The autopar that emitted this program (recorded in --profile-steps' profile.json).", None
    )
    HF_CONFIG: dict | None = _constant(
        'The HuggingFace transformers config the model is built from, and its head: "causal-lm" '
        '(AutoModelForCausalLM), "masked-lm" (AutoModelForMaskedLM) or "seq2seq-lm" '
        "(AutoModelForSeq2SeqLM); see hf_model_file.",
        None,
    )
    HF_TASK: str | None = _constant(default=None)
    MASK_FRACTION: float = _constant(default=0.15)
    STAGES: list = _constant("Pipeline stages, in order: the layers (module FQNs) each runs.", [])
    SCHEDULE: str = _constant(
        "The pipeline schedule, the torch.distributed.pipelining class that runs it, and the "
        "microbatches each step's batch is cut into.",
        "none",
    )
    SCHEDULE_CLASS: str = _constant(default="")
    MICROBATCHES: int = _constant(default=1)
    STAGES_PER_RANK: int = _constant(
        "Stages per pipeline rank, and the stages (indices into STAGES) each pipeline rank runs, "
        "by rank: placed as the schedule places them (stage j on rank j % pp, or V-shaped).",
        1,
    )
    RANK_STAGES: list = _constant(default=[])
    CONTEXT_PARALLEL: dict = _constant(
        'Context parallel (MESH["cp"] ranks split each sample\'s sequence; see '
        "autopar_runtime/context_parallel.py): the layer where the sequence is cut, the attention "
        "form, the load balance.",
        {},
    )
    EXPERT_PARALLEL: dict = _constant(
        "Expert parallel (ep ranks carved out of dp x fsdp; see autopar_runtime/expert_parallel.py):"
        " each MoE block named keeps num_experts / ep of its experts per rank (stacked in one "
        "module, or the modules of an expert list), and tokens reach them by all-to-all.",
        {},
    )
    SYNC_BATCHNORM: bool = _constant(
        "Batch norms take their statistics over the data-parallel ranks' samples (plan "
        "--sync-batchnorm; see autopar_runtime/global_batch.py).",
        False,
    )
    GATHER_LOSS: bool = _constant(
        "loss_fn takes gather: it gets every data-parallel rank's outputs (a contrastive loss "
        "over the global batch; see autopar_runtime/global_batch.py).",
        False,
    )
    VERIFY_REFERENCE: str = _constant(
        "What --verify's single-process reference trains on per step: the global batch whole, "
        "or each data-parallel rank's slice (a MoE's load-balancing statistic is per slice by "
        "design).",
        "global batch",
    )
    ACCUMULATION_STEPS: int = _constant(
        "Gradient accumulation: each rank's batch runs in this many equal microbatches per "
        "optimizer step, gradients synced over data-parallel ranks on the last one only (saves "
        "activations).",
        1,
    )
    BATCH_SHARES: list | None = _constant(
        "A cluster of several kinds of nodes: samples per step of each data-parallel rank, by "
        "rank, proportional to its speed (they sum to GLOBAL_BATCH); each rank's loss is "
        "weighted by its share, so the gradients are the global batch's mean. None: even.",
        None,
    )
    PIPELINE_BLOCKS: list | None = _constant(
        "A cluster of several kinds of nodes: pipeline rank r runs on block PIPELINE_BLOCKS[r] "
        "of the world's pp equal blocks of consecutive ranks (each group's blocks together, the "
        "groups in the order the planner found fastest). None: block r.",
        None,
    )
    ELASTIC_PLANS: dict = _constant(
        "Elastic runs (plan --elastic MIN:MAX; launch.sh starts torchrun's elastic agent): node "
        "count -> the program planned for it (relative to train.py's folder). A worker runs the one "
        "for the nodes it finds (rt.take_elastic_plan) and resumes from the latest checkpoint.",
        {},
    )

    @classmethod
    def from_namespace(cls, namespace: dict) -> Constants:
        """The fields found in ``namespace`` (``train.py``'s ``globals()``)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in namespace.items() if k in names})

    @property
    def data_parallel(self) -> int:
        """The data-parallel ranks (dp x fsdp): each trains on its own GLOBAL_BATCH share."""
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
        write_line(f"error: {message}", sys.stderr)
    code = user_error_exit_code(message)
    release_lock()  # the checkpoint directory's, when this rank took it
    if dist.is_initialized():  # every rank stops here together (gloo's teardown is not forgiving)
        dist.barrier()
        if "TORCHELASTIC_RUN_ID" in os.environ:  # a worker of torchrun: leave as finish() does
            # gloo's threads can abort the interpreter's exit ("terminate called without an
            # active exception"), and torchrun restarts a group whose worker aborted
            dist.destroy_process_group()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
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


def write_line(line: str, stream: TextIO | None = None) -> None:
    """``line`` and its newline to ``stream`` (stdout) in one write, flushed. print() writes
    the two apart, and where Python's output is unbuffered (PYTHONUNBUFFERED, which container
    images often set) each goes out on its own: another writer on the same stream (the
    profiler's C++ log line, a launcher's) can land between them and break a JSON line."""
    stream = sys.stdout if stream is None else stream
    stream.write(line + "\n")
    stream.flush()


def say(line: str) -> None:
    """Rank 0 prints ``line``."""
    if dist.get_rank() == 0:
        write_line(line)


def has_submodule(model: nn.Module, fqn: str) -> bool:
    """Whether ``model`` holds the module ``fqn`` (a pipeline stage holds only its own)."""
    try:
        model.get_submodule(fqn)
    except AttributeError:
        return False
    return True
