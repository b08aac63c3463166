"""The machinery of an autopar ``train.py``: launch checks, model building and initialization,
pipeline stages, verification and checkpoints.

autopar emits this file verbatim beside ``train.py``; it depends on torch only (and transformers
for HuggingFace models), never on autopar. ``train.py`` holds the plan's constants and reads
like a training script; every function here takes what it needs of the plan as a ``Constants``
(built from ``train.py``'s upper-case names) or as plain arguments.

Test hooks (inert unless set): ``AUTOPAR_TEST_KILL_AT_STEP`` / ``AUTOPAR_TEST_KILL_RANK`` (see
``after_step``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import json
import logging
import math
import operator
import os
import resource
import shutil
import signal
import sys
import time
import types
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import Replicate, Shard
from torch.nn.parallel import DistributedDataParallel as DDP


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
    FSDP_UNITS: list = dataclasses.field(default_factory=list)
    OFFLOAD: bool = False
    HF_CONFIG: dict | None = None
    HF_TASK: str | None = None
    MASK_FRACTION: float = 0.15
    STAGES: list = dataclasses.field(default_factory=list)
    SCHEDULE: str = "none"
    MICROBATCHES: int = 1
    STAGES_PER_RANK: int = 1

    @classmethod
    def from_namespace(cls, namespace: dict) -> Constants:
        """The fields found in ``namespace`` (``train.py``'s ``globals()``)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in namespace.items() if k in names})

    @property
    def data_parallel(self) -> int:
        return self.MESH["dp"] * self.MESH["fsdp"]


# ---- Launch ----------------------------------------------------------------------------------
def parse_args(c: Constants, doc: str, argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(doc or "").splitlines()[0] if doc else None)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default=c.OPTIMIZER)
    p.add_argument("--lr", type=float, default=c.LR)
    p.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="resume from the latest complete checkpoint here, and save checkpoints here",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        help="save every K steps (and after the last); default: only after the last step",
    )
    p.add_argument("--verify", action="store_true")
    if c.MESH["pp"] > 1:
        p.add_argument("--show-stages", action="store_true", help="print the stages' code and exit")
    return p.parse_args(argv)


def fail(message: str) -> None:
    """A user error: exit 2, before any collective so no rank waits on another. Every rank
    checks the same things and stops; rank 0 says why, in one line."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def check_launch(c: Constants, args: argparse.Namespace, script: str = "train.py") -> None:
    """The world and the flags against the plan, before any collective: every rank finds the
    same and exits 2, so none waits for another."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world != c.WORLD_SIZE:
        fail(
            f"this plan needs {c.WORLD_SIZE} ranks, launched with {world}: run "
            f"`torchrun --nproc-per-node {c.WORLD_SIZE} {Path(script).name}` (see launch.sh)"
        )
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if local_world != c.RANKS_PER_NODE:
        fail(
            f"this plan runs {c.RANKS_PER_NODE} ranks per node (cluster {c.CLUSTER}), launched "
            f"with {local_world} on this node: use launch.sh, or plan for this cluster"
        )
    if c.BACKEND == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        fail(
            f"this plan is for CUDA GPUs with nccl (cluster {c.CLUSTER}), but this torch "
            f"{torch.__version__} sees no CUDA device or has no nccl: run it on the GPUs, or "
            "plan for this machine (--cluster cpu:N)"
        )
    if c.BACKEND == "nccl" and torch.cuda.device_count() < local_world:
        fail(
            f"this plan runs {local_world} ranks on this node, one per GPU, but only "
            f"{torch.cuda.device_count()} GPU(s) are visible (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): free or expose {local_world} GPUs"
        )
    if args.steps < 1 or args.log_every < 1:
        fail(f"--steps ({args.steps}) and --log-every ({args.log_every}) must be >= 1")
    every = args.checkpoint_every
    if every is not None and (args.checkpoint_dir is None or every < 1):
        fail(f"--checkpoint-every {every} needs --checkpoint-dir, and K >= 1")
    if args.checkpoint_dir is not None and args.verify:
        fail(
            "--verify compares with a run from step 1 and cannot resume: drop --checkpoint-dir "
            "or --verify"
        )
    if c.MESH["pp"] > 1:
        check_pipeline(c)


def check_pipeline(c: Constants) -> None:
    """The schedule's rules, checked before launch: torch would raise on some ranks only and
    leave the others waiting for them."""
    pp, n, num_stages = c.MESH["pp"], c.MICROBATCHES, len(c.STAGES)
    if num_stages != pp * c.STAGES_PER_RANK:
        fail(
            f"the plan has {num_stages} stages, not pp x stages_per_rank = {pp * c.STAGES_PER_RANK}"
        )
    per_rank = {"gpipe": 1, "1f1b": 1, "zbv": 2, "dualpipev": 2}.get(c.SCHEDULE, c.STAGES_PER_RANK)
    if c.STAGES_PER_RANK != per_rank:
        fail(
            f"schedule {c.SCHEDULE} runs {per_rank} stage(s) per rank, the plan {c.STAGES_PER_RANK}"
        )
    local_batch = c.GLOBAL_BATCH // c.data_parallel
    if local_batch % n:
        fail(
            f"the local batch of {local_batch} samples (global batch {c.GLOBAL_BATCH} over "
            f"{c.data_parallel} data-parallel ranks) does not split into {n} "
            "microbatches: plan a microbatch count that divides it"
        )
    if c.SCHEDULE in ("1f1b", "zbv", "dualpipev") and n < num_stages:
        fail(
            f"schedule {c.SCHEDULE} needs at least as many microbatches as stages: {n} "
            f"microbatches < {num_stages} stages; plan with --microbatches {num_stages} or more"
        )
    rounds = max(1, n // pp)
    if c.SCHEDULE == "interleaved-1f1b" and n % rounds:
        fail(
            f"interleaved-1f1b runs microbatches in rounds of pp={pp}: {n} microbatches is not "
            f"a multiple of its {rounds} rounds; plan a multiple of {pp}"
        )


def local_device(c: Constants) -> torch.device:
    """One GPU per rank (LOCAL_RANK) with nccl, the CPU with gloo."""
    if c.BACKEND == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def build_mesh(c: Constants, device: torch.device) -> DeviceMesh:
    timeout = timedelta(seconds=float(os.environ.get("DIST_TIMEOUT_S", 300)))
    if "RANK" in os.environ:  # under torchrun
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        # A restarted group reuses torchrun's store, where the dead attempt's keys remain (the
        # ranks' addresses): without a prefix per attempt, ranks connect to dead peers (torch
        # 2.13). Every node's torchrun counts the restart when its ranks fail alike.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"attempt_{attempt}", store)
        dist.init_process_group(
            c.BACKEND, store=store, rank=rank, world_size=world, timeout=timeout
        )
    else:  # plain `python train.py` of a 1-rank plan: an in-process store, no ports
        dist.init_process_group(c.BACKEND, store=dist.HashStore(), rank=0, world_size=1)
    return init_device_mesh(device.type, tuple(c.MESH.values()), mesh_dim_names=tuple(c.MESH))


def has_submodule(model: nn.Module, fqn: str) -> bool:
    """Whether ``model`` holds the module ``fqn`` (a pipeline stage holds only its own)."""
    try:
        model.get_submodule(fqn)
    except AttributeError:
        return False
    return True


def finish(ok: bool) -> None:
    """Leave every rank together: a barrier (ranks leaving at different times can abort in
    gloo's teardown), then exit without C++ static destructors (after a clean run gloo's
    threads can still abort the process at interpreter exit, ~1 run in 3)."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)


# ---- Parallelize -----------------------------------------------------------------------------
# The plan's style names as torch ParallelStyles. Between a colwise and a rowwise layer the
# activation stays sharded on its last dim; Shard(1) is the sequence dim (sequence parallel).
TP_STYLES = {
    "colwise": ColwiseParallel(),
    "colwise_from_seq": ColwiseParallel(input_layouts=Shard(1)),
    "colwise_gather": ColwiseParallel(output_layouts=Replicate()),
    "colwise_from_seq_gather": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    "rowwise": RowwiseParallel(),
    "rowwise_to_seq": RowwiseParallel(output_layouts=Shard(1)),
    "rowwise_from_replicate": RowwiseParallel(input_layouts=Replicate()),
    "rowwise_from_replicate_to_seq": RowwiseParallel(
        input_layouts=Replicate(), output_layouts=Shard(1)
    ),
    "sequence_parallel": SequenceParallel(),
}


def apply_tp(c: Constants, model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split the planned layers across the TP group (Megatron style); a pipeline stage holds
    some of the model's modules (under their own FQNs): style those."""
    for fqn, attrs in c.MODULE_ATTRS.items():
        if has_submodule(model, fqn):
            for name, value in attrs.items():
                setattr(model.get_submodule(fqn), name, value)
    styles = {f: TP_STYLES[s] for f, s in c.TP_PLAN.items() if has_submodule(model, f)}
    parallelize_module(model, tp_mesh, styles)


def apply_checkpointing(c: Constants, model: nn.Module) -> None:
    """Wrap each CHECKPOINT layer so its activations are recomputed in backward."""
    for fqn in c.CHECKPOINT:
        if has_submodule(model, fqn):  # else held by another pipeline stage
            parent_fqn, _, name = fqn.rpartition(".")
            parent = model.get_submodule(parent_fqn)
            setattr(parent, name, checkpoint_wrapper(getattr(parent, name)))


def uses_fsdp(c: Constants) -> bool:
    """FSDP2 for sharding, and for replicas of a TP model or of pipeline stages (HSDP with a
    shard group of one): DDP holds no DTensor parameters and breaks inside a pipeline."""
    mesh = c.MESH
    return mesh["fsdp"] > 1 or (mesh["dp"] > 1 and (mesh["tp"] > 1 or mesh["pp"] > 1))


def apply_data_parallel(c: Constants, model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard the model with FSDP2 over the fsdp axis (HSDP over (dp, fsdp) with dp > 1 too),
    or replicate it with DDP over dp (gradients all-reduced, averaged)."""
    if uses_fsdp(c):
        dp_mesh = mesh["dp", "fsdp"] if c.MESH["dp"] > 1 else mesh["fsdp"]
        offload = {"offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())}
        options = offload if c.OFFLOAD else {}
        for fqn in c.FSDP_UNITS:  # a layer naming no submodule (functional ops): the root's
            if has_submodule(model, fqn):
                fully_shard(model.get_submodule(fqn), mesh=dp_mesh, **options)
        fully_shard(model, mesh=dp_mesh, **options)
    elif c.MESH["dp"] > 1:
        model = DDP(model, process_group=mesh["dp"].get_group())
    return model


def parallelize(c: Constants, model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """What train.py's parallelize does, for Plan.apply: TP, checkpointing, data parallel."""
    if c.MESH["tp"] > 1 and c.TP_PLAN:
        apply_tp(c, model, mesh["tp"])
    apply_checkpointing(c, model)
    return apply_data_parallel(c, model, mesh)


# ---- Model, data, loss -----------------------------------------------------------------------
def load_model_file(c: Constants):
    """The user's model file as a module (a HuggingFace model: one built here, see hf_model_file)."""
    if c.HF_CONFIG is not None:
        return hf_model_file(c)
    spec = importlib.util.spec_from_file_location(Path(c.MODEL_FILE).stem, c.MODEL_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def hf_model_file(c: Constants):
    """The HuggingFace model as a model file: build_model (from HF_CONFIG with from_config, fp32,
    sdpa attention, no cache, no download), make_batch and loss_fn.

    Batches: a causal LM reads input_ids and predicts the next token (target = the ids shifted
    by one); a masked LM reads input_ids with MASK_FRACTION of each sample's positions (the same
    count in every sample) replaced by the mask token, and its target holds the original ids
    there and -100 elsewhere. Loss: cross-entropy of the logits, ignoring -100, computed here
    (not by the model), the same for the sharded run and the --verify reference.
    """
    # Grouped-query attention through SDPA's enable_gqa (the planner traced it so).
    os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    import transformers

    hf_config = c.HF_CONFIG
    kwargs = {k: v for k, v in hf_config.items() if k not in ("model_type", "torch_dtype", "dtype")}
    config = transformers.AutoConfig.for_model(hf_config["model_type"], **kwargs)
    config.use_cache = False
    masked = c.HF_TASK == "masked-lm"
    auto = transformers.AutoModelForMaskedLM if masked else transformers.AutoModelForCausalLM
    vocab = config.vocab_size
    mask_id = hf_config.get("mask_token_id", 103 if vocab > 103 else vocab - 1)

    def build_model():
        return auto.from_config(config, attn_implementation="sdpa", dtype=torch.float32).train()

    def make_batch(batch_size: int, seq_len: int):
        if not masked:
            ids = torch.randint(0, vocab, (batch_size, seq_len + 1))
            return (ids[:, :-1],), ids[:, 1:]
        ids = torch.randint(0, vocab, (batch_size, seq_len))
        count = max(1, round(c.MASK_FRACTION * seq_len))
        where = torch.rand(batch_size, seq_len).argsort(dim=1)[:, :count]
        labels = torch.full_like(ids, -100).scatter(1, where, ids.gather(1, where))
        return (ids.scatter(1, where, mask_id),), labels

    def loss_fn(output, target: torch.Tensor) -> torch.Tensor:
        logits = output if isinstance(output, torch.Tensor) else output["logits"]  # pp: tensor
        return F.cross_entropy(logits.flatten(0, -2).float(), target.flatten(), ignore_index=-100)

    # FACTORY names the head (causal_lm or masked_lm): main() calls it like a model file's.
    return types.SimpleNamespace(
        **{c.FACTORY: build_model}, make_batch=make_batch, loss_fn=loss_fn, hf=True
    )


def batch_maker(c: Constants, model_file, model: nn.Module):
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


def default_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # Mean over all samples (and tokens): with equal local batches, the mean of the data-parallel
    # ranks' losses is the global mean, which is what DDP/FSDP gradient averaging assumes.
    if target.is_floating_point():
        return F.mse_loss(output, target)
    return F.cross_entropy(output.flatten(0, -2), target.flatten())


def local_slice(c: Constants, batch, dp_rank: int):
    """This data-parallel rank's contiguous share of the global batch (TP peers share one)."""
    n = c.GLOBAL_BATCH // c.data_parallel
    inputs, target = batch
    inputs = tuple(x[dp_rank * n : (dp_rank + 1) * n] for x in inputs)
    return inputs, target[dp_rank * n : (dp_rank + 1) * n]


def dp_rank_of(c: Constants, mesh: DeviceMesh) -> int:
    """This rank's index among the data-parallel ranks (dp major, fsdp minor)."""
    return mesh["dp"].get_local_rank() * c.MESH["fsdp"] + mesh["fsdp"].get_local_rank()


def batches(c: Constants, make_batch, seed: int, first_step: int, steps: int, device, dp_rank):
    """(step, this rank's batch, the global batch) for each step: synthetic batches, the same
    global batch on every rank (drawn from a seed that depends only on the step, so a resumed
    run sees what an uninterrupted one would), each data-parallel rank training on its slice."""
    for step in range(first_step, steps + 1):
        torch.manual_seed(seed + 1000 + step)
        inputs, target = make_batch(c.GLOBAL_BATCH, c.SEQ_LEN)
        batch = tuple(x.to(device) for x in inputs), target.to(device)
        yield step, local_slice(c, batch, dp_rank), batch


def build_optimizer(params, args: argparse.Namespace) -> torch.optim.Optimizer:
    params = list(params)
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=args.lr)
    return torch.optim.AdamW(params, lr=args.lr)


def train_step(c: Constants, model, optimizer, loss_fn, batch) -> torch.Tensor:
    inputs, target = batch
    with torch.autocast(target.device.type, torch.bfloat16, enabled=c.DTYPE == "bf16"):
        loss = loss_fn(model(*inputs), target)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def mean_loss(c: Constants, loss: torch.Tensor) -> float:
    """The step's loss, the mean over data-parallel ranks: the ranks of the last pipeline stage
    (all ranks without a pipeline) hold their slice's loss, TP peers the same one, the other
    stages 0, so the sum over all ranks divided by the last stage's rank count."""
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    return loss.item() / (dist.get_world_size() // c.MESH["pp"])


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def log_step(c: Constants, step: int, loss: float, step_time_s: float, device) -> None:
    """Rank 0's JSON line for a step."""
    if dist.get_rank() != 0:
        return
    tokens = c.GLOBAL_BATCH * c.SEQ_LEN if c.SEQ_LEN else None
    record = {
        "step": step,
        "loss": loss if math.isfinite(loss) else None,
        "step_time_s": round(step_time_s, 6),
        "tokens_per_s": round(tokens / step_time_s, 1) if tokens else None,
        "peak_memory_bytes": peak_memory_bytes(device),
    }
    print(json.dumps(record), flush=True)


# ---- Pipeline stages -------------------------------------------------------------------------
# How the model is cut. Its forward need not be a sequence of children (a GPT adds position
# embeddings at the root and loops over a ModuleList), so it is traced with torch.fx, each
# planned layer kept as one opaque call to the user's own module: the graph is the layer calls
# and the root-level ops between them. A layer call goes to the stage that lists the layer; a
# root-level op goes with the preceding layer's stage (the first layer's, before any layer), as
# in autopar's IR. Each stage is an fx.GraphModule running its slice of the graph: its inputs are
# the values earlier stages computed that it or later stages need (the forward's arguments for
# stage 0), its outputs those later stages need. It holds the user's module objects under their
# original FQNs (blocks.2.attn.q), so TP, FSDP, checkpointing and --verify use the user's names;
# --show-stages prints each stage's code.
def layer_of(fqn: str, layers) -> str | None:
    """The planned layer that is the module ``fqn`` or holds it."""
    parts = fqn.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in layers:
            return ".".join(parts[:i])
    return None


class LayerTracer(torch.fx.Tracer):
    """Traces the forward down to the planned layers, each one a single call_module node."""

    def __init__(self, layers: set[str]) -> None:
        super().__init__()
        self.layers = layers

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if layer_of(qualname, self.layers) is not None:
            return True
        holds_layer = any(layer.startswith(qualname + ".") for layer in self.layers)
        return not holds_layer and super().is_leaf_module(m, qualname)


def trace_layers(c: Constants, model: nn.Module, num_args: int) -> torch.fx.Graph:
    """The forward as an fx graph of layer calls; arguments make_batch does not pass keep their
    defaults (so ``if mask is not None`` traces)."""
    params = list(inspect.signature(model.forward).parameters.values())[num_args:]
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    stage_of_layer = {fqn for layers in c.STAGES for fqn in layers}
    try:
        return LayerTracer(stage_of_layer).trace(model, concrete_args=defaults or None)
    except Exception as e:  # fx raises many kinds (TraceError, TypeError, ...)
        fail(
            f"cannot trace {type(model).__name__}.forward with torch.fx to cut it into pipeline "
            f"stages ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): plan "
            "without pipeline parallelism (--mesh pp=1)"
        )


def assign_stages(c: Constants, graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    """Stage index of every node but the placeholders and the output."""
    stage_of_layer = {fqn: k for k, layers in enumerate(c.STAGES) for fqn in layers}
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    stage = {}
    for n in nodes:
        layer = layer_of(n.target, stage_of_layer) if n.op == "call_module" else None
        if layer is not None:
            stage[n] = stage_of_layer[layer]
    if not stage:
        fail(f"the forward calls none of the planned layers {sorted(stage_of_layer)}")
    previous = next(iter(stage.values()))  # root-level ops before any layer: the first stage
    for n in nodes:
        if n.op != "get_attr":
            previous = stage.setdefault(n, previous)
    for n in nodes:
        if n.op == "get_attr":  # a parameter or buffer read at root level: its reader's stage
            readers = {stage[u] for u in n.users if u in stage}
            if len(readers) > 1:
                fail(
                    f"{n.target} is read by stages {sorted(readers)} (tied weights?): a pipeline "
                    "cannot share a tensor between stages; plan its readers into one stage"
                )
            stage[n] = readers.pop() if readers else previous
    for n in nodes:
        for arg in n.all_input_nodes:
            if stage.get(arg, 0) > stage[n]:
                fail(
                    f"the forward runs {n.target} (stage {stage[n]}) after {arg.target} (stage "
                    f"{stage[arg]}): stages must follow the order the forward calls layers in"
                )
    empty = sorted(set(range(len(c.STAGES))) - set(stage.values()))
    if empty:
        layers = c.STAGES[empty[0]]
        fail(f"pipeline stage {empty[0]} runs nothing: its layers {layers} are never called")
    return stage


# HF models defeat torch.fx (forwards with **kwargs, masks built by data-dependent code), so
# their layer graph comes from torch.export: the model is exported (non-strict, in training
# mode, at the microbatch shape) with the call signature of every planned layer preserved,
# unflattened back into its module hierarchy, and the model's own layer modules are put back in
# place of their exported copies (TP then finds nn.Linear, FSDP and --verify the real
# parameters under their FQNs). The modules in between (the base model, containers) are inlined:
# one graph of layer calls and the aten ops between them. Ops outside layers run as late as
# they can (in their first reader's stage), except that an op reading a non-tensor value (the
# pytree glue around each layer call) runs in that value's stage: only tensors cross stages.
def export_layers(c: Constants, model: nn.Module, example_inputs: tuple):
    """(root module, fx graph of layer calls, names of the nodes whose values are no tensor)."""
    layers = {fqn for stage in c.STAGES for fqn in stage if has_submodule(model, fqn)}
    holder = {}  # a tied weight (GPT-2's lm_head = wte) cannot live in two stages
    for k, stage_layers in enumerate(c.STAGES):
        for fqn in sorted(layers.intersection(stage_layers)):
            for name, p in model.get_submodule(fqn).named_parameters():
                if holder.setdefault(id(p), (k, f"{fqn}.{name}"))[0] != k:
                    fail(
                        f"{fqn}.{name} is tied to {holder[id(p)][1]} in stage "
                        f"{holder[id(p)][0]}: a pipeline cannot share a weight between stages; "
                        "plan without pipeline parallelism, or untie (tie_word_embeddings=false)"
                    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            program = torch.export.export(
                model, example_inputs, strict=False, preserve_module_call_signature=tuple(layers)
            )
        except Exception as e:  # export raises many kinds
            fail(
                f"cannot export {type(model).__name__} to cut it into pipeline stages "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): plan "
                "without pipeline parallelism (--mesh pp=1)"
            )
        root = torch.export.unflatten(program)
    for fqn in layers:
        root.set_submodule(fqn, model.get_submodule(fqn))
    graph = torch.fx.Graph()
    out = inline_graph(root, "", graph, None, layers)
    graph.output(out[0] if isinstance(out, tuple | list) and len(out) == 1 else out)
    values = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            values[n.name] = result = super().run_node(n)
            return result

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Recorder(torch.fx.GraphModule(root, graph)).run(*example_inputs)
    non_tensor = {name for name, v in values.items() if not isinstance(v, torch.Tensor)}
    return root, graph, non_tensor


def inline_graph(module: nn.Module, prefix: str, graph: torch.fx.Graph, args, layers: set[str]):
    """Copy ``module.graph`` into ``graph``, inlining calls of submodules that are no planned
    layer; return what its output node returns (``args``: values of its placeholders)."""
    env, inputs = {}, iter(args or ())
    for n in module.graph.nodes:
        if n.op == "placeholder":
            env[n] = graph.placeholder(n.name) if args is None else next(inputs)
        elif n.op == "output":
            return torch.fx.map_arg(n.args[0], env.__getitem__)
        elif n.op == "call_module" and prefix + n.target not in layers:
            sub_args = torch.fx.map_arg(n.args, env.__getitem__)
            sub = module.get_submodule(n.target)
            env[n] = inline_graph(sub, f"{prefix}{n.target}.", graph, sub_args, layers)
        elif n.target is operator.getitem and isinstance(env[n.args[0]], tuple | list):
            env[n] = env[n.args[0]][n.args[1]]  # an element of an inlined module's outputs
        else:
            env[n] = graph.node_copy(n, env.__getitem__)
            if n.op in ("call_module", "get_attr"):
                env[n].target = prefix + n.target
    raise AssertionError("a graph without output")


def place_glue(c: Constants, graph: torch.fx.Graph, stage: dict, non_tensor: set[str]) -> None:
    """Move the ops outside layers to their first reader's stage, and ops reading a non-tensor
    value to that value's stage (see above); layer calls keep theirs."""
    last = len(c.STAGES) - 1
    layer_calls = {n for n in stage if n.op == "call_module"}
    nodes = [n for n in stage if n not in layer_calls]
    for n in reversed(list(graph.nodes)):
        if n in stage and n not in layer_calls:
            stage[n] = min((stage[u] for u in n.users if u in stage), default=last)
    for _ in range(len(nodes)):
        changed = False
        for n in nodes:
            fixed = [stage[a] for a in n.all_input_nodes if a.name in non_tensor and a in stage]
            if fixed and min(fixed) < stage[n]:
                stage[n], changed = min(fixed), True
        for n in reversed(nodes):
            earliest = min((stage[u] for u in n.users if u in stage), default=stage[n])
            if earliest < stage[n]:
                stage[n], changed = earliest, True
        if not changed:
            return


def split_into_stages(
    c: Constants, model: nn.Module, example_inputs: tuple
) -> list[torch.fx.GraphModule]:
    """The model cut into len(STAGES) modules that, called in a chain, compute its forward."""
    hf = c.HF_CONFIG is not None
    if hf:
        root, graph, non_tensor = export_layers(c, model, example_inputs)
        stage = assign_stages(c, graph)
        place_glue(c, graph, stage, non_tensor)
    else:
        root, graph = model, trace_layers(c, model, len(example_inputs))
        stage = assign_stages(c, graph)
    num_stages = len(c.STAGES)
    output = next(n for n in graph.nodes if n.op == "output")
    values = [n for n in graph.nodes if n.op != "output"]  # placeholders first, in graph order

    def last_use(value: torch.fx.Node) -> int:
        return max((stage.get(u, num_stages - 1) for u in value.users), default=-1)

    modules, carried = [], [n for n in values if n.op == "placeholder"]
    for k in range(num_stages):
        g = torch.fx.Graph()
        env = {}
        for v in carried:  # stage 0: the forward's own placeholders (defaults included)
            env[v] = g.node_copy(v) if k == 0 else g.placeholder(v.name)
        for n in values:
            if stage.get(n) == k:
                env[n] = g.node_copy(n, env.__getitem__)
        if k == num_stages - 1:
            g.output(torch.fx.map_arg(output.args[0], env.__getitem__))
        else:
            carried = [v for v in values if v in env and last_use(v) > k]
            outputs = [env[v] for v in carried]
            if hf:  # p2p sends need contiguous tensors (HF's attention mask is an expanded view)
                outputs = [g.call_method("contiguous", (v,)) for v in outputs]
            g.output(outputs[0] if len(outputs) == 1 else tuple(outputs))
        modules.append(torch.fx.GraphModule(root, g, class_name=f"Stage{k}"))
    check_split(model, modules, example_inputs, hf)
    return modules


def check_split(model: nn.Module, stages: list[nn.Module], example_inputs: tuple, hf: bool) -> None:
    """Run the stages in a chain on one batch, in eval mode, and compare with the forward."""
    training = model.training
    model.eval()
    with torch.no_grad():
        expected = model(*example_inputs)
        if hf:
            expected = expected["logits"]  # the last stage returns the logits alone
        values = example_inputs
        for k, stage in enumerate(stages):
            kinds = [type(v).__name__ for v in values if not isinstance(v, torch.Tensor)]
            if kinds:
                fail(
                    f"pipeline stage {k} would receive a {kinds[0]} from stage {k - 1}; stages "
                    "can pass only tensors: move the stage boundary"
                )
            out = stage(*values)
            values = out if isinstance(out, tuple) and k < len(stages) - 1 else (out,)
    model.train(training)
    if isinstance(expected, torch.Tensor) and not torch.equal(out, expected):
        fail("the pipeline stages in a chain do not compute the model's forward (a bug in the cut)")


def show_stages(c: Constants, modules: list[torch.fx.GraphModule]) -> None:
    """--show-stages: rank 0 prints each stage's code; every rank exits 0."""
    if int(os.environ.get("RANK", 0)) == 0:
        for k, module in enumerate(modules):
            print(f"# stage {k}: {c.STAGES[k]}{module.code}")
    sys.exit(0)


def stage_ids_of(c: Constants, pp_rank: int) -> list[int]:
    """The stages a pipeline rank runs: looped placement (stage j on rank j % pp) or, for the
    V-shaped schedules zbv and dualpipev, stages r and 2 * pp - 1 - r on rank r."""
    pp = c.MESH["pp"]
    if c.SCHEDULE in ("zbv", "dualpipev"):
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return list(range(pp_rank, len(c.STAGES), pp))


def build_schedule(c: Constants, local: dict, mesh: DeviceMesh, device: torch.device, loss_fn):
    """The schedule that runs this rank's (parallelized) stages ``{stage id: module}``; the loss
    is computed on the last stage, once per microbatch."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import (
        Schedule1F1B,
        ScheduleDualPipeV,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleZBVZeroBubble,
    )

    classes = {
        "gpipe": ScheduleGPipe,
        "1f1b": Schedule1F1B,
        "interleaved-1f1b": ScheduleInterleaved1F1B,
        "zbv": ScheduleZBVZeroBubble,
        "dualpipev": ScheduleDualPipeV,
    }
    group = mesh["pp"].get_group()
    n = len(c.STAGES)
    stages = [PipelineStage(m, j, n, device, group=group) for j, m in local.items()]
    # scale_grads (the default): gradients are divided by the number of microbatches, so with a
    # mean loss they are the full batch's, as without a pipeline.
    if c.SCHEDULE in ("gpipe", "1f1b"):  # one stage per rank
        return classes[c.SCHEDULE](stages[0], c.MICROBATCHES, loss_fn=loss_fn)
    return classes[c.SCHEDULE](stages, c.MICROBATCHES, loss_fn=loss_fn)


def pipeline_step(c: Constants, schedule, optimizers, batch, holds_last: bool) -> torch.Tensor:
    """One step; the loss (mean over microbatches) where this rank holds the last stage, else 0."""
    inputs, target = batch
    losses = []
    with torch.autocast(target.device.type, torch.bfloat16, enabled=c.DTYPE == "bf16"):
        schedule.step(*inputs, target=target, losses=losses, return_outputs=False)
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if holds_last:
        return torch.stack([loss.detach().float() for loss in losses]).mean()
    return torch.zeros((), device=target.device)


# ---- Verification ----------------------------------------------------------------------------
def tolerances(c: Constants, args: argparse.Namespace) -> tuple[float, float]:
    """(loss, parameter) tolerances: absolute, and relative to the values' magnitude.

    SGD in fp32 differs from the single-process run only by reduction order: 1e-5. AdamW
    divides by sqrt(v): on a coordinate whose gradient is ~0, 1e-8 of noise can flip the sign
    of its update, so a parameter may move up to lr the other way each step. Parameters then
    get 2 * lr * steps more; the loss, which those coordinates barely move, 1e-4. bf16 rounds
    every matmul to 8 bits of mantissa: 2e-2.
    """
    loss_tol = param_tol = 2e-2 if c.DTYPE == "bf16" else 1e-5
    if args.optimizer == "adamw":
        loss_tol = max(loss_tol, 1e-4)
        param_tol += 2 * args.lr * args.steps
    return loss_tol, param_tol


def unwrapped_name(name: str) -> str:
    """A parameter's name in the plain model: drop what DDP, checkpointing and compile add."""
    name = name.removeprefix("module.")
    wrappers = ("_checkpoint_wrapped_module", "_orig_mod")
    return ".".join(part for part in name.split(".") if part not in wrappers)


def verify(c: Constants, named_params, reference, losses, ref_losses, args, mesh) -> bool:
    """Compare with the unsharded run; every rank decides the same (from all ranks' findings).

    ``named_params`` are the parameters this rank holds (with a pipeline: its stages'); each is
    compared whole (a DTensor gathered over its sub-mesh) with the reference's of that name.
    """
    loss_tol, param_tol = tolerances(c, args)
    worst, worst_ratio = "", 0.0
    max_loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    for step, (a, b) in enumerate(zip(losses, ref_losses), 1):
        ratio = abs(a - b) / (loss_tol * (1 + abs(b)))
        if ratio > worst_ratio:
            worst, worst_ratio = f"loss at step {step} diff={abs(a - b):.3e}", ratio
    # Gathering a parameter sharded on two mesh dims makes torch warn about reduction order; a
    # gather does not reduce, so the comparison is exact. Keep the output to the verdict.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    ref_params = dict(reference.named_parameters())
    max_param_diff = 0.0
    held = []
    # named_parameters has the same order on every rank of a stage's sub-mesh, so the
    # full_tensor gathers line up.
    for name, p in named_params:
        full = p.full_tensor() if isinstance(p, DTensor) else p
        name = unwrapped_name(name)
        assert name in ref_params, f"parallel parameter {name!r} has no unsharded counterpart"
        held.append(name)
        ref = ref_params[name]
        diff = (full.detach() - ref.detach()).abs().max().item()
        max_param_diff = max(max_param_diff, diff)
        ratio = diff / (param_tol * (1 + ref.detach().abs().max().item()))
        if ratio > worst_ratio:
            worst, worst_ratio = f"{name} diff={diff:.3e}", ratio
    # Every parameter must be held by some pipeline rank (all of them by each rank without one).
    held_by_pp_ranks = [None] * c.MESH["pp"]
    dist.all_gather_object(held_by_pp_ranks, held, group=mesh["pp"].get_group())
    missing = set(ref_params).difference(*held_by_pp_ranks)
    if missing:
        worst, worst_ratio = f"parameters held by no rank: {sorted(missing)}", math.inf
    # Every rank's findings to every rank (each pipeline rank saw only its own stages): all
    # decide alike, and rank 0 names the worst tensor over all ranks.
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, (worst_ratio, worst, max_param_diff))
    worst_ratio, worst, _ = max(found, key=lambda f: f[0])
    max_param_diff = max(f[2] for f in found)
    ok = worst_ratio <= 1
    if dist.get_rank() == 0:
        if ok:
            print(
                f"verify: ok max_loss_diff={max_loss_diff:.3e} max_param_diff={max_param_diff:.3e}"
            )
        else:
            print(
                f"verify: FAILED {worst} (tolerance: loss {loss_tol:.1e}, params {param_tol:.1e})"
            )
    return ok


# ---- Checkpoints -----------------------------------------------------------------------------
# --checkpoint-dir holds a folder per saved step, step_<N>/: DCP's .metadata, a .distcp file per
# rank, and COMPLETE, which rank 0 writes last. A save writes .tmp-step_<N>/, and rank 0 renames
# it to step_<N>/ once every rank's files and the marker are in, so a save cut short leaves a
# .tmp- folder (deleted at the next start) and only a step_<N>/ holding COMPLETE is ever loaded.
# A start resumes from the complete checkpoint with the largest N.
#
# The model and optimizer are saved under the model's own parameter names (get_state_dict drops
# the DDP and checkpoint wrappers; FSDP and TP parameters are DTensors, stored shard by shard; a
# pipeline rank holds only its stages', and the union over ranks is the whole model), so another
# plan of the same model loads them: DCP reshards. With them go the step, which is also the data
# position (each step seeds its own batch), and each rank's RNG states.
COMPLETE = "COMPLETE"
# Optimizer state keyed by parameter name, not position: it reshards across plans and stages.
STATE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def training_state(parts, step: int, device: torch.device) -> tuple[dict, list]:
    """The state to save (or load into), and the keys of each (module, optimizer) part in it."""
    rng = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    state = {"model": {}, "optimizer": {}, "step": torch.tensor(step), "rng": {}}
    state["rng"][f"rank{dist.get_rank()}"] = rng
    keys = []
    for module, optimizer in parts:
        model_state, optimizer_state = get_state_dict(module, optimizer, options=STATE_OPTIONS)
        state["model"] |= model_state
        state["optimizer"] |= optimizer_state
        keys.append((list(model_state), list(optimizer_state)))
    return state, keys


def save_checkpoint(c: Constants, directory: Path, step: int, parts, device) -> None:
    start = time.perf_counter()
    tmp, final = directory / f".tmp-step_{step}", directory / f"step_{step}"
    dcp.save(training_state(parts, step, device)[0], checkpoint_id=tmp)
    dist.barrier()  # every rank's files are written
    if dist.get_rank() == 0:
        with open(tmp / COMPLETE, "w") as f:
            json.dump({"step": step, "world_size": c.WORLD_SIZE, "mesh": c.MESH}, f)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():  # left incomplete by an earlier run (no complete one is newer)
            shutil.rmtree(final)
        os.rename(tmp, final)
        fd = os.open(directory, os.O_RDONLY)  # make the rename durable
        os.fsync(fd)
        os.close(fd)
        seconds = time.perf_counter() - start
        print(f"checkpoint: saved step {step} to {final} in {seconds:.2f} s", flush=True)


def latest_complete_step(directory: Path) -> int:
    """The largest N of a step_<N>/ holding COMPLETE in ``directory`` (0: none)."""
    steps = [
        int(path.name.removeprefix("step_"))
        for path in directory.glob("step_*")
        if path.name.removeprefix("step_").isdigit() and (path / COMPLETE).is_file()
    ]
    return max(steps, default=0)


def resume(directory: Path, parts, device: torch.device) -> int:
    """Load the latest complete checkpoint in ``directory``; return its step (0: none)."""
    found = torch.zeros((), dtype=torch.int64, device=device)
    if dist.get_rank() == 0:  # rank 0 looks, and tidies up what a crashed save left
        directory.mkdir(parents=True, exist_ok=True)
        for tmp in directory.glob(".tmp-step_*"):
            shutil.rmtree(tmp)
        found.fill_(latest_complete_step(directory))
    dist.broadcast(found, src=0)  # all ranks load the same checkpoint
    if found.item() == 0:
        return 0
    path = directory / f"step_{found.item()}"
    state, keys = training_state(parts, 0, device)
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    rng_key = f"rng.rank{dist.get_rank()}.cpu"
    if rng_key not in saved:  # saved by a plan with fewer ranks: keep this rank's RNG
        del state["rng"]
    dcp.load(state, checkpoint_id=path)
    for (module, optimizer), (model_keys, optimizer_keys) in zip(parts, keys):
        set_state_dict(
            module,
            optimizer,
            model_state_dict={k: state["model"][k] for k in model_keys},
            optim_state_dict={k: state["optimizer"][k] for k in optimizer_keys},
            options=STATE_OPTIONS,
        )
    if "rng" in state:
        rng = state["rng"][f"rank{dist.get_rank()}"]
        torch.set_rng_state(rng["cpu"])
        if device.type == "cuda" and "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"], device)
    step = int(state["step"])
    if dist.get_rank() == 0:
        print(f"checkpoint: resumed from step {step} ({path})", flush=True)
    return step


def after_step(c: Constants, args, step: int, parts, device) -> None:
    """What follows a logged step: the checkpoint it is due (every --checkpoint-every steps and
    after the last), then the test hook."""
    every = args.checkpoint_every or args.steps
    if args.checkpoint_dir is not None and (step % every == 0 or step == args.steps):
        save_checkpoint(c, args.checkpoint_dir, step, parts, device)
    kill_for_test(step)


def kill_for_test(step: int) -> None:
    """A test hook (tests/test_checkpoint.py), inert unless AUTOPAR_TEST_KILL_AT_STEP is set:
    after that step (its log line and checkpoint out), rank AUTOPAR_TEST_KILL_RANK kills itself
    with SIGKILL, on torchrun's first attempt only (TORCHELASTIC_RESTART_COUNT=0)."""
    if os.environ.get("AUTOPAR_TEST_KILL_AT_STEP") != str(step):
        return
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    dist.barrier()  # rank 0 has printed the step
    if dist.get_rank() == int(os.environ.get("AUTOPAR_TEST_KILL_RANK", 0)):
        os.kill(os.getpid(), signal.SIGKILL)
