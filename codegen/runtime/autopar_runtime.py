"""The machinery of an autopar ``train.py``: launch checks, model building and initialization,
pipeline stages, verification and checkpoints.

autopar emits this file verbatim beside ``train.py``; it depends on torch only (and transformers
for HuggingFace models), never on autopar. ``train.py`` holds the plan's constants and reads
like a training script; every function here takes what it needs of the plan as a ``Constants``
(built from ``train.py``'s upper-case names) or as plain arguments.

Test hooks (inert unless set): ``AUTOPAR_TEST_KILL_AT_STEP`` / ``AUTOPAR_TEST_KILL_RANK`` (see
``after_step``), ``AUTOPAR_TEST_COMPILE_BACKEND`` (see ``apply_compile``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import importlib.util
import inspect
import json
import logging
import math
import operator
import os
import pickle
import re
import resource
import shutil
import signal
import socket
import stat
import sys
import tempfile
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
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard
from torch.nn.attention.bias import causal_lower_right
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils import _pytree as pytree


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


# ---- Launch ----------------------------------------------------------------------------------
class Flags(argparse.ArgumentParser):
    """train.py's flags. A mistyped one (an unknown --optimizer, `--steps abc`) is a user error
    like any other, through fail: one line, exit 2, recorded for launch.sh so that torchrun does
    not restart the group (argparse's own error() prints its usage on every rank and exits 2,
    which torchrun counts as a crash and retries). --help still prints and exits 0."""

    def error(self, message: str):
        fail(f"{message}: see `{self.prog} --help`")


def parse_args(c: Constants, doc: str, argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; their types here, their ranges in check_flags (before any collective)."""
    p = Flags(description=(doc or "").splitlines()[0] if doc else None)
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
    p.add_argument(
        "--lr-schedule",
        choices=["constant", "cosine", "linear"],
        default="constant",
        help="after --warmup-steps, decay the lr to 0 at the end (see lr_factor)",
    )
    p.add_argument("--warmup-steps", type=int, default=0, help="linear warmup from lr/N to lr")
    p.add_argument(
        "--weight-decay",
        type=float,
        default=None,
        help="AdamW's decoupled decay, SGD's L2 term; default: torch's (AdamW 0.01, SGD 0)",
    )
    p.add_argument(
        "--max-grad-norm",
        type=float,
        default=None,
        help="clip the total gradient norm (over all shards and stages) to this",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile each planned layer")
    p.add_argument("--verify", action="store_true")
    add_data_args(p)
    if c.MESH["pp"] > 1:
        p.add_argument("--show-stages", action="store_true", help="print the stages' code and exit")
    return p.parse_args(argv)


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


def _wait_for_readers(store, rank: int, world: int) -> None:
    store.add("autopar/launch/read", 1)
    if rank != 0:  # rank 0 hosts the store without torchrun's sharing: it leaves last
        return
    deadline = time.monotonic() + min(60.0, dist_timeout().total_seconds())
    while store.add("autopar/launch/read", 0) < world and time.monotonic() < deadline:
        time.sleep(0.05)


def launch_digest() -> str:
    """What every rank must run alike: the emitted train.py (the plan) and this module."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    digest = hashlib.sha256(Path(__file__).read_bytes())
    if main_file is not None:
        digest.update(Path(main_file).read_bytes())
    return digest.hexdigest()[:16]


def agree_on_launch() -> None:
    """Before the first collective, on several nodes: every rank publishes the digest of what it
    runs, then reads every other rank's. A rank that failed its checks published its error
    instead: all stop with that one line rather than wait in a collective until the timeout;
    a node started with other files (another plan) stops every node too."""
    store, rank, world = launch_store()
    digest = launch_digest()
    store.set(_launch_key(rank), f"ok {digest}")
    deadline = time.monotonic() + dist_timeout().total_seconds()
    pending = set(range(world))
    while pending:
        for other in sorted(pending):
            if not store.check([_launch_key(other)]):
                continue
            pending.discard(other)
            state, _, text = store.get(_launch_key(other)).decode().partition(" ")
            if state == "error":
                _wait_for_readers(store, rank, world)
                fail(text, tell_others=False)
            if text != digest:
                _wait_for_readers(store, rank, world)
                fail(
                    f"rank {other} runs other files than rank {rank} (train.py or "
                    f"autopar_runtime.py differ: digest {text} vs {digest}): start every node "
                    "with the same emitted files (the same plan)",
                    tell_others=False,
                )
        if pending and time.monotonic() > deadline:
            fail(
                f"ranks {sorted(pending)} did not start within {dist_timeout()}", tell_others=False
            )
        if pending:
            time.sleep(0.05)


# launch.sh on several nodes bounds the rendezvous: past RDZV_TIMEOUT_S with no rank started on
# its node, it runs report_rendezvous, which reads torch's c10d rendezvous state from the store
# at RDZV_ENDPOINT (as a client, bounded; torch keeps the state under "torch.rendezvous.<id>",
# base64 of a pickle, read here with an unpickler that builds only the state's own classes) and
# says which nodes arrived; launch.sh then ends its torchrun (no rank has started) and exits 2.
_RENDEZVOUS_CLASSES = {
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_RendezvousState"),
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_NodeDesc"),
    ("datetime", "datetime"),
    ("datetime", "timezone"),
    ("datetime", "timedelta"),
    ("builtins", "set"),
}


def _rendezvous_state(host: str, port: int, run_id: str, wait_s: float = 10.0):
    """(torch's rendezvous state, "") or (None, why there is none): a TCP connection first
    (nothing listening is quick to tell), then a store client in a thread, since a server that
    is not a torch store (another program on the port) leaves the client waiting past its
    timeout."""
    import base64
    import io
    import pickle
    import threading

    try:
        socket.create_connection((host, port), timeout=wait_s).close()
    except OSError as e:
        return None, f"nothing answers at {host}:{port} ({e.strerror or e})"
    found: dict = {}

    def read() -> None:
        with contextlib.suppress(Exception):  # no store there: found stays empty
            store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=wait_s))
            key = f"torch.rendezvous.{run_id}"
            found["bits"] = store.get(key) if store.check([key]) else b""

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(wait_s + 1)
    if "bits" not in found:
        return (
            None,
            f"{host}:{port} answers, but not as a torch rendezvous: another program holds it",
        )
    bits = base64.b64decode(found["bits"]) if found["bits"] else b""
    if bits in (b"", b"canimadam"):  # torch's sentinel for a rendezvous no node has joined
        return None, f"the store at {host}:{port} holds no rendezvous {run_id!r}"

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            if (module, name) not in _RENDEZVOUS_CLASSES:
                raise pickle.UnpicklingError(f"{module}.{name} is not in a rendezvous state")
            return super().find_class(module, name)

    try:
        return Unpickler(io.BytesIO(bits)).load(), ""
    except Exception as e:  # another torch's state, or not torch's: say so, nothing more
        return None, f"the rendezvous state at {host}:{port} is unreadable ({e})"


def _node_name(addr: str) -> str:
    """A node as SLURM names it: a hostname's first label; an IP address whole."""
    return addr if addr.replace(".", "").isdigit() or ":" in addr else addr.split(".")[0]


def report_rendezvous(nodes: int, timeout_s: int) -> None:
    """launch.sh's rendezvous wait ran out on this node (see above): exit 0 if the rendezvous
    completed after all (the ranks are starting), else say which nodes arrived and which did
    not (by name where AUTOPAR_NODES lists the job's nodes, as launch.slurm sets it), record
    the line for launch.sh (AUTOPAR_ERROR_FILE) and exit 2."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    endpoint, run_id = os.environ["RDZV_ENDPOINT"], os.environ["RDZV_ID"]
    host, port = parse_rendezvous_endpoint(endpoint, default_port=29400)
    state, why = _rendezvous_state(host, port, run_id)
    if state is not None and state.complete:
        sys.exit(0)
    waited = f"within {timeout_s} s (RDZV_TIMEOUT_S)"
    same = "with the same RDZV_ENDPOINT and RDZV_ID"
    if state is None:
        me = os.environ.get("LOCAL_ADDR") or socket.getfqdn()
        fix = (
            "choose a free port (RDZV_ENDPOINT or MASTER_PORT)"
            if "another program" in why
            else f"start launch.sh on the first node, which hosts it (with RDZV_IS_HOST=1 if "
            f"its hostname is not {host}), {same}"
        )
        message = (
            f"the rendezvous at {endpoint} (RDZV_ID {run_id}) did not start {waited}: {why}; "
            f"1 of {nodes} nodes ({me}) waited: {fix}"
        )
    else:
        arrived = sorted({n.addr for n in [*state.participants, *state.wait_list]})
        expected = os.environ.get("AUTOPAR_NODES", "").split()
        missing = sorted(set(expected) - {_node_name(a) for a in arrived})
        absent = f"{nodes - len(arrived)} did not" + (f" ({', '.join(missing)})" if missing else "")
        message = (
            f"the rendezvous at {endpoint} (RDZV_ID {run_id}) did not complete {waited}: "
            f"{len(arrived)} of {nodes} nodes arrived ({', '.join(arrived) or 'none'}), "
            f"{absent}: start launch.sh on every node {same} (or wait longer: RDZV_TIMEOUT_S)"
        )
    print(f"error: {message}", file=sys.stderr, flush=True)
    with contextlib.suppress(OSError, KeyError), open(os.environ["AUTOPAR_ERROR_FILE"], "a") as f:
        f.write(f"{message}\n")
    sys.exit(2)


def check_launch(c: Constants, args: argparse.Namespace, script: str = "train.py") -> None:
    """The world and the flags against the plan, before any collective: every rank finds the
    same and exits 2, so none waits for another."""
    tie_to_launcher()
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world != c.WORLD_SIZE:
        fail(
            f"this plan needs {c.WORLD_SIZE} ranks, launched with {world}: run "
            f"`torchrun --nproc-per-node {c.WORLD_SIZE} {Path(script).name}` (see launch.sh)"
        )
    if c.HF_CONFIG is None and not Path(c.MODEL_FILE).is_file():
        fail(
            f"the model file {c.MODEL_FILE} is not on this node: put it at that path on every "
            "node (or plan again where it is)"
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
    check_flags(c, args)
    every = args.checkpoint_every
    if every is not None and (args.checkpoint_dir is None or every < 1):
        fail(f"--checkpoint-every {every} needs --checkpoint-dir, and K >= 1")
    if args.checkpoint_dir is not None and args.verify:
        fail(
            "--verify compares with a run from step 1 and cannot resume: drop --checkpoint-dir "
            "or --verify"
        )
    if args.checkpoint_dir is not None:
        check_checkpoint_dir(args.checkpoint_dir)
    if c.MESH["pp"] > 1:
        check_pipeline(c)
    local_batch = c.GLOBAL_BATCH // c.data_parallel
    if c.ACCUMULATION_STEPS > 1 and local_batch % c.ACCUMULATION_STEPS:
        fail(
            f"the local batch of {local_batch} samples does not split into "
            f"{c.ACCUMULATION_STEPS} accumulation steps: plan a count that divides it"
        )


def check_flags(c: Constants, args: argparse.Namespace) -> None:
    """Every flag of train.py in its range (parse_args checked the types), in this one place,
    before any collective: a mistyped value is one line and exit 2 on every rank, never a
    traceback from inside torch at step 1 nor a NaN run. Not errors: --warmup-steps beyond
    --steps (a short trial of a long run's flags ramps the lr as the long run would) and
    --log-every beyond --steps (the last step is always logged). The data flags are checked
    with the data (open_inputs), the checkpoint flags in check_launch."""
    if args.steps < 1 or args.log_every < 1:
        fail(f"--steps ({args.steps}) and --log-every ({args.log_every}) must be >= 1")
    if not (math.isfinite(args.lr) and args.lr >= 0):  # 0: weights unchanged (an export)
        fail(f"--lr {args.lr} must be a finite number >= 0 (the plan's is {c.LR})")
    if args.warmup_steps < 0:
        fail(f"--warmup-steps {args.warmup_steps} must be >= 0 (0: no warmup)")
    decay = args.weight_decay
    if decay is not None and not (math.isfinite(decay) and decay >= 0):
        fail(
            f"--weight-decay {decay} must be a finite number >= 0 (0: no decay; omit it for "
            "torch's default)"
        )
    norm = args.max_grad_norm
    if norm is not None and not (math.isfinite(norm) and norm > 0):
        fail(f"--max-grad-norm {norm} must be a finite number > 0 (omit it to not clip)")
    if not 0 <= args.seed < 2**32:  # the seeds derived from it (the data order's, each
        # step's batch and dropout) stay within the 64 bits torch.manual_seed takes
        fail(f"--seed {args.seed} must be in 0 .. 2**32 - 1 (e.g. --seed 0)")
    if args.compile:
        check_compile(c)


def check_compile(c: Constants) -> None:
    """--compile where it cannot work: blocks on DTensors, or inductor on CPU without a C++
    compiler (it would fail at the first step, a traceback from inside torch on every rank)."""
    on_dtensors = sorted(dtensor_blocks(c))
    if on_dtensors:
        fail(
            f"--compile: this plan runs {len(on_dtensors)} blocks ({on_dtensors[0]}, ...) on "
            "DTensors, which torch 2.13 fails to compile here (measured: a RecursionError in "
            "backward): drop --compile"
        )
    if c.BACKEND != "gloo" or compile_backend() != "inductor":
        return
    try:  # the search inductor itself runs: torch._inductor.config.cpp.cxx ($CXX, else g++)
        from torch._inductor import config, cpp_builder
        from torch._inductor.exc import InvalidCxxCompiler
    except ImportError:  # another torch: it will say so itself
        return
    try:
        cpp_builder.get_cpp_compiler()
    except InvalidCxxCompiler:
        tried = ", ".join(str(cxx) for cxx in config.cpp.cxx if cxx)
        fail(
            f"--compile: inductor builds C++ on CPU and finds no working compiler (tried "
            f"{tried}, from CXX or the default g++): install one (apt install g++) or set CXX "
            "to its path, or drop --compile"
        )


def tie_to_launcher() -> None:
    """Under torchrun, first: this rank stops (SIGTERM) when its torchrun agent ends, however
    it ends. torchrun starts its workers in sessions of their own, so a SIGKILL to it (or to
    launch.sh, whose death ends torchrun the same way, see codegen/launch.py) would otherwise
    leave them training and writing checkpoints. Linux's prctl(PR_SET_PDEATHSIG) does this;
    elsewhere nothing. Also tells launch.sh's bounded rendezvous wait that the rendezvous is
    done: its ranks have started (AUTOPAR_STARTED_FILE)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # not glibc: no tie
            pass
        if os.getppid() == 1:  # the agent died before the tie was made
            os.kill(os.getpid(), signal.SIGTERM)
    started = os.environ.get("AUTOPAR_STARTED_FILE")
    if started:
        with contextlib.suppress(OSError), open(started, "a") as f:
            f.write(f"rank {os.environ.get('RANK', 0)}\n")


def check_fqns(c: Constants, model: nn.Module) -> None:
    """Every module the plan names (TP styles, attributes, checkpointing, FSDP units) exists in
    the model, checked before any collective: one line, exit 2 (not a torch warning and an
    unsharded run)."""
    named = [("tensor-parallel", c.TP_PLAN), ("module_attrs", c.MODULE_ATTRS)]
    named += [("checkpointing", c.CHECKPOINT)]
    named += [("expert-parallel", c.EXPERT_PARALLEL.get("experts", []))]
    for what, fqns in named:
        missing = [fqn for fqn in fqns if not has_submodule(model, fqn)]
        if missing:
            fail(
                f"the plan's {what} module {missing[0]!r} is not in the model built by "
                f"{Path(c.MODEL_FILE).name}:{c.FACTORY}() (the model changed since planning?): "
                "re-plan it"
            )
    if c.EXPERT_PARALLEL:
        check_experts(c, model)


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
    release_freed_host_memory()
    return torch.device("cpu")


def release_freed_host_memory() -> None:
    """Make glibc hand large freed blocks back to the OS: on CPU, FSDP's unsharded parameters
    and gradients are freed after each unit, but glibc's adaptive mmap threshold keeps such
    blocks in the heap, so a rank's RSS grows towards the whole model (measured: 2.8 GB instead
    of 1.5 GB for a 2 GB model on fsdp=4). A fixed 1 MiB threshold (mallopt M_MMAP_THRESHOLD)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


def build_mesh(c: Constants, device: torch.device) -> DeviceMesh:
    timeout = dist_timeout()
    if "RANK" in os.environ:  # under torchrun
        store, rank, world = launch_store()
        if several_nodes():
            agree_on_launch()
        dist.init_process_group(
            c.BACKEND, store=store, rank=rank, world_size=world, timeout=timeout
        )
    else:  # plain `python train.py` of a 1-rank plan: an in-process store, no ports
        dist.init_process_group(c.BACKEND, store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh(device.type, tuple(c.MESH.values()), mesh_dim_names=tuple(c.MESH))
    if device.type == "cuda" and c.MESH["tp"] > 1:
        # DTensor's RNG tracker (random ops on DTensors: each shard draws its own part of one
        # mask), created here without its default broadcast of rank 0's state to every rank,
        # which would give all data-parallel ranks one mask; step_seed seeds each step.
        from torch.distributed.tensor import _random

        _random.manual_seed(0, mesh["tp"])
    return mesh


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
    expert_report()
    dist.barrier()
    release_lock()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)


# ---- Parallelize -----------------------------------------------------------------------------
class SequenceParallelGather(SequenceParallel):
    """SequenceParallel on a norm, its output then all-gathered along the sequence into a
    replicated DTensor: Megatron-LM's sequence-parallel "g", once for all the colwise linears
    that read it (each takes the replicated DTensor as it is); in backward their partial input
    gradients add up and one reduce-scatter returns the norm's sequence shard."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            self._replicate_module_fn,
            functools.partial(self._prepare_input_fn, self.sequence_sharding),
            lambda mod, out, mesh: out.redistribute(mesh, [Replicate()]),
        )


class SequenceScatter(ParallelStyle):
    """A layer's first positional input, replicated, enters the sequence-parallel region: each
    rank keeps its slice of dim 1 (no communication); backward all-gathers the gradient."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def split(mod, args, kwargs):
            if not args or not isinstance(args[0], torch.Tensor):
                raise RuntimeError(
                    f"sequence_scatter: {type(mod).__name__} got no tensor as its first "
                    "positional argument to split along the sequence"
                )
            x = DTensor.from_local(args[0], device_mesh, [Replicate()], run_check=False)
            return (x.redistribute(device_mesh, [Shard(1)]).to_local(), *args[1:]), kwargs

        module.register_forward_pre_hook(split, with_kwargs=True)
        return module


# ---- Blocks that run on DTensors -------------------------------------------------------------
# An attention block whose views name full sizes (nanoGPT's ``C // self.n_head``, a head count
# written as a number) gets colwise styles that hand on DTensors of full shape (``*_dtensor``):
# its own ops run on DTensors, which keep the global shapes its code names, up to its rowwise
# linear. The planner proved it runs only ops DTensor carries and reads only its own buffers
# besides its input (ir._heads.dtensor_blocks). A fused linear whose output the block splits
# into k equal pieces (nanoGPT's c_attn into q, k, v: ``*_fused{k}_dtensor``) holds rows
# ``_StridedShard(0, split_factor=k)``: each rank its slice of every piece.
def dtensor_blocks(c: Constants) -> dict[str, bool]:
    """The blocks that run on DTensors (parents of ``*_dtensor`` styles) -> whether one of their
    linears is fused (``*_fused{k}_dtensor``: their splits go through :class:`FusedSplits`)."""
    blocks: dict[str, bool] = {}
    for fqn, style in c.TP_PLAN.items():
        if style.endswith("_dtensor"):
            parent = fqn.rpartition(".")[0]
            blocks[parent] = blocks.get(parent, False) or "_fused" in style
    return blocks


class ColwiseFused(ColwiseParallel):
    """ColwiseParallel for a linear whose output is split into ``parts`` equal pieces along its
    last dim: weight rows ``_StridedShard(0, split_factor=parts)`` (rank r holds rows r of each
    piece), so the output is ``_StridedShard(-1, parts)`` and :class:`FusedSplits`
    hands out the pieces as ``Shard(-1)`` DTensors with no communication."""

    def __init__(self, parts: int, **kwargs) -> None:
        super().__init__(use_local_output=False, **kwargs)
        self.parts = parts

    def _partition_linear_fn(self, name, module, device_mesh):
        for pname, param in module.named_parameters():
            # the bias replicated: added to the strided output, each rank takes its rows (no
            # communication); FSDP2 can then shard it as any other (fsdp_shard_dim)
            placement = [
                _StridedShard(0, split_factor=self.parts) if param.ndim == 2 else Replicate()
            ]
            dist_param = distribute_tensor(param, device_mesh, placement, src_data_rank=None)
            module.register_parameter(
                pname, nn.Parameter(dist_param, requires_grad=param.requires_grad)
            )


class FusedSplits(torch.overrides.TorchFunctionMode):
    """``split(size, dim)`` / ``chunk(k, dim)`` of a DTensor that is ``_StridedShard(dim, k)``
    into its k pieces: each rank splits its local rows into its slice of every piece, each a
    ``Shard(dim)`` DTensor (DTensor itself would all-gather first: a split along a sharded dim).
    Differentiable (to_local / from_local); anything else runs as called."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        pieces = fused_pieces(func, args, kwargs)
        return pieces if pieces is not None else func(*args, **kwargs)


def fused_pieces(func, args, kwargs):
    """:class:`FusedSplits`' split, or None where ``func`` is not one it takes (a module
    function: torch.compile guards a staticmethod of a mode by ``__func__`` and fails)."""
    if func not in (torch.Tensor.split, torch.split, torch.Tensor.chunk, torch.chunk):
        return None
    x = args[0] if args else None
    if not isinstance(x, DTensor):
        return None
    arg = args[1] if len(args) > 1 else kwargs.get("split_size_or_sections", kwargs.get("chunks"))
    dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % x.ndim
    strided = [
        i for i, p in enumerate(x.placements)
        if isinstance(p, _StridedShard) and p.dim == dim
    ]  # fmt: skip
    if not isinstance(arg, int) or len(strided) != 1:
        return None
    (i,) = strided
    k = x.placements[i].split_factor
    chunk = func in (torch.Tensor.chunk, torch.chunk)
    if (arg if chunk else x.shape[dim] // arg) != k or x.shape[dim] % k:
        return None
    placements = [Shard(dim) if j == i else p for j, p in enumerate(x.placements)]
    shape = list(x.shape)
    shape[dim] //= k
    stride = torch.empty(shape, device="meta").stride()
    local = x.to_local()
    return tuple(
        DTensor.from_local(t, x.device_mesh, placements, run_check=False,
                           shape=torch.Size(shape), stride=stride)
        for t in local.chunk(k, dim)
    )  # fmt: skip


def run_on_dtensors(block: nn.Module, mesh: DeviceMesh, fused: bool) -> None:
    """Each call of ``block`` with its own buffers (a causal mask) lent as replicated DTensors,
    so they meet its DTensors as DTensors (the plain buffers back after the call: state dicts
    and checkpoints never see them), and, where a linear is ``fused``, its output split by
    :class:`FusedSplits` (a mode that sees every op of the call: only where needed)."""
    names = [n for n, b in block.named_buffers(recurse=False) if b is not None]
    forward = block.forward

    def on_dtensors(self, *args, **kwargs):
        plain = {n: self._buffers[n] for n in names}
        try:
            for n, b in plain.items():
                self._buffers[n] = DTensor.from_local(b, mesh, [Replicate()], run_check=False)
            with FusedSplits() if fused else contextlib.nullcontext():
                return forward(*args, **kwargs)
        finally:
            self._buffers.update(plain)

    block.forward = types.MethodType(on_dtensors, block)  # a bound method, as torch.compile expects


def storage_form(state: dict) -> list:
    """DCP cannot write or read a ``_StridedShard`` on a TP dim (a fused linear's rows: each
    rank's rows are not one block; measured, torch 2.13: "overlapping chunks"). Puts each such
    tensor of the nested ``state`` in place as a copy redistributed to ``Shard`` there (the
    layout every other TP weight has): the containers stay the caller's, so what DCP loads by
    replacing a value (an int, the data position) lands in them. Returns (container, key, live,
    stored) for :func:`from_storage` after a load."""
    pairs = []
    items = list(state.items()) if isinstance(state, dict) else list(enumerate(state))
    for key, t in items:
        if isinstance(t, (dict, list)):
            pairs += storage_form(t)
            continue
        if not isinstance(t, DTensor):
            continue
        names = t.device_mesh.mesh_dim_names or ()
        placements = [
            Shard(p.dim) if isinstance(p, _StridedShard) and i < len(names) and names[i] == "tp"
            else p
            for i, p in enumerate(t.placements)
        ]  # fmt: skip
        if placements != list(t.placements):
            state[key] = t.detach().redistribute(placements=placements)
            pairs.append((state, key, t, state[key]))
    return pairs


def from_storage(pairs: list) -> None:
    """Copy what a load put into :func:`storage_form`'s copies back into the live tensors, and
    put the live ones back in their containers."""
    with torch.no_grad():
        for container, key, live, stored in pairs:
            live.to_local().copy_(stored.redistribute(placements=live.placements).to_local())
            container[key] = live


@functools.cache
def register_cpu_sdpa_sharding() -> None:
    """CPU's fused attention kernel has no DTensor sharding rule (torch 2.13: "does not have a
    sharding strategy registered"; CUDA's kernels have theirs). Attention is independent per
    batch row and per head: register that q, k, v, the output, its logsumexp and their
    gradients shard alike on dim 0 or 1 (a mask replicated), or all replicate."""
    from torch.distributed.tensor.experimental import register_sharding

    aten = torch.ops.aten

    def strategies(n_out: int, n_in: int, attn_mask: object) -> list:
        mask = [] if attn_mask is None else [Replicate()]
        out = [([Replicate()] * n_out, [Replicate()] * n_in + mask)]
        out += [([Shard(d)] * n_out, [Shard(d)] * n_in + mask) for d in (0, 1)]
        return out

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)
    def forward(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
        return strategies(2, 3, attn_mask)

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    def backward(grad_out, query, key, value, out, lse, dropout_p, is_causal, *, attn_mask=None,
                 scale=None):  # fmt: skip
        return strategies(3, 6, attn_mask)


# ---- HF Conv1D (GPT-2's c_attn, c_proj, c_fc) ------------------------------------------------
# A linear whose weight is stored (in, out) and computed as addmm(bias, x.view(-1, in), weight)
# .view(..., nf). torch's styles take nn.Linear and nn.Embedding only; these shard a Conv1D the
# same way (colwise: weight Shard(1), bias Shard(0); rowwise: weight Shard(0), bias replicated).
# Its forward then runs on DTensors of full shape, its views included.
def is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _conv1d_partition(placements: dict):
    """A partition function putting a Conv1D's weight (2-D) and bias (1-D) on ``placements``
    (ndim -> placement)."""

    def partition(name, module, mesh):
        for pname, p in list(module.named_parameters()):
            dp = distribute_tensor(p, mesh, [placements[p.ndim]], src_data_rank=None)
            module.register_parameter(pname, nn.Parameter(dp, requires_grad=p.requires_grad))

    return partition


def _apply_to_conv1d(style, module: nn.Module, mesh: DeviceMesh, placements: dict) -> nn.Module:
    """``style`` (a Colwise or Rowwise) on a Conv1D: its partition, torch's input and output
    hooks (the same as on a linear)."""
    return distribute_module(
        module,
        mesh,
        _conv1d_partition(placements),
        functools.partial(
            style._prepare_input_fn, style.input_layouts, style.desired_input_layouts
        ),
        functools.partial(style._prepare_output_fn, style.output_layouts, style.use_local_output),
    )


class Colwise(ColwiseParallel):
    """ColwiseParallel that also takes an HF Conv1D."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        return _apply_to_conv1d(self, module, device_mesh, {2: Shard(1), 1: Shard(0)})


class Rowwise(RowwiseParallel):
    """RowwiseParallel that also takes an HF Conv1D."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)  # as RowwiseParallel sets it for a linear
        return _apply_to_conv1d(self, module, device_mesh, {2: Shard(0), 1: Replicate()})


# The plan's style names as torch ParallelStyles. Between a colwise and a rowwise layer the
# activation stays sharded on its last dim; Shard(1) is the sequence dim (sequence parallel).
TP_STYLES = {
    "colwise": Colwise(),
    "colwise_from_seq": Colwise(input_layouts=Shard(1)),
    "colwise_dtensor": Colwise(use_local_output=False),
    "colwise_from_seq_dtensor": Colwise(input_layouts=Shard(1), use_local_output=False),
    **{
        f"colwise{seq}_fused{k}_dtensor": ColwiseFused(
            k, **({"input_layouts": Shard(1)} if seq else {})
        )
        for seq in ("", "_from_seq")
        for k in (2, 3)
    },
    "colwise_gather": Colwise(output_layouts=Replicate()),
    "colwise_from_seq_gather": Colwise(input_layouts=Shard(1), output_layouts=Replicate()),
    "rowwise": Rowwise(),
    "rowwise_to_seq": Rowwise(output_layouts=Shard(1)),
    "rowwise_from_replicate": RowwiseParallel(input_layouts=Replicate()),
    "rowwise_from_replicate_to_seq": RowwiseParallel(
        input_layouts=Replicate(), output_layouts=Shard(1)
    ),
    "sequence_parallel": SequenceParallel(),
    "sequence_parallel_local": SequenceParallel(use_local_output=True),
    "heads_parallel_local": SequenceParallel(sequence_dim=2, use_local_output=True),
    "sequence_parallel_gather": SequenceParallelGather(),
    "sequence_scatter": SequenceScatter(),
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
    for fqn, fused in dtensor_blocks(c).items():
        if has_submodule(model, fqn):
            register_cpu_sdpa_sharding()
            run_on_dtensors(model.get_submodule(fqn), tp_mesh, fused)


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
    if mesh.get("cp", 1) > 1 or getattr(c, "EXPERT_PARALLEL", None):  # fsdp x cp; experts
        return True
    return mesh["fsdp"] > 1 or (mesh["dp"] > 1 and (mesh["tp"] > 1 or mesh["pp"] > 1))


# ---- Precision -------------------------------------------------------------------------------
# fp32 plans compute and keep everything in fp32. bf16 plans:
# - where FSDP2 applies (uses_fsdp: fsdp > 1, or dp > 1 with TP or a pipeline): FSDP2's
#   MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32). Parameters, gradients and the
#   optimizer state stay fp32 and sharded; each unit's parameters are all-gathered in bf16 (the
#   fp32 shard cast first), the forward and backward compute in bf16 (activations, and
#   activation gradients, bf16; floating inputs cast to bf16 at each FSDP root), and the bf16
#   unsharded gradients are cast to fp32 before the reduce-scatter (fp32 over dp with HSDP too).
#   No autocast. --verify's reference runs each forward with bf16 copies of its fp32 parameters
#   (functional_call): the same regime in one process.
# - where it does not (DDP, TP alone, a pipeline alone, one rank): fp32 parameters, gradients
#   (all-reduced in fp32 by DDP) and optimizer state, the forward under torch.autocast(bf16):
#   matmuls in bf16, precision-sensitive ops (softmax, norms, losses) in fp32; TP's collectives
#   move the bf16 activations of the layers they follow. The reference uses autocast too.
def mixed_precision_policy(c: Constants) -> bool:
    """Whether the plan trains bf16 through FSDP2's MixedPrecisionPolicy (else autocast)."""
    return c.DTYPE == "bf16" and uses_fsdp(c)


def autocast(c: Constants, device_type: str):
    """torch.autocast(bf16) for bf16 plans without FSDP2; a no-op context otherwise."""
    enabled = c.DTYPE == "bf16" and not uses_fsdp(c)
    return torch.autocast(device_type, torch.bfloat16, enabled=enabled)


def say(line: str) -> None:
    """Rank 0 prints ``line``."""
    if dist.get_rank() == 0:
        print(line, flush=True)


def precision_note(c: Constants) -> str:
    if c.DTYPE != "bf16":
        return "fp32 parameters, gradients, optimizer state and compute"
    if mixed_precision_policy(c):
        return (
            "bf16 compute (FSDP2 MixedPrecisionPolicy: parameters all-gathered in bf16, "
            "gradients reduce-scattered in fp32); fp32 sharded parameters, gradients and "
            "optimizer state"
        )
    return "bf16 autocast over fp32 parameters, gradients and optimizer state (no FSDP2)"


def forward(c: Constants, model, inputs, reference: bool = False):
    """The model's output in the plan's precision (see above); ``reference``: --verify's
    unsharded model, which mirrors FSDP2's bf16 parameters with bf16 copies of its own.
    ``inputs``: the forward's arguments (a tuple) or keyword arguments (a dict), see call."""
    if reference and mixed_precision_policy(c):
        # 0-dim parameters stay fp32: FSDP2 leaves them out (replicate_scalars)
        params = {n: p.to(torch.bfloat16) if p.ndim else p for n, p in model.named_parameters()}
        cast = tensor_map(lambda x: x.to(torch.bfloat16) if x.is_floating_point() else x, inputs)
        args, kwargs = ((), cast) if isinstance(cast, dict) else (tuple(cast), None)
        return torch.func.functional_call(model, params, args, kwargs)
    with autocast(c, device_of(inputs).type):
        return call(model, inputs)


def compile_backend() -> str:
    """torch.compile's backend for --compile: inductor, or a test's (apply_compile)."""
    return os.environ.get("AUTOPAR_TEST_COMPILE_BACKEND", "inductor")


def apply_compile(c: Constants, model: nn.Module) -> None:
    """--compile: each planned layer (LAYERS) becomes torch.compile(layer) in its place, after
    checkpointing and before FSDP (torchtitan's order): a compiled layer holds its forward and
    its recomputation, while FSDP2's gathers and reduce-scatters run around it, uncompiled.
    Inductor (the default backend) needs a C++ compiler on CPU (checked by check_compile); a
    test may pick a faster backend with AUTOPAR_TEST_COMPILE_BACKEND (aot_eager: dynamo and
    AOTAutograd, no codegen)."""
    backend = compile_backend()
    tp = c.MESH["tp"] > 1 and bool(c.TP_PLAN)
    for fqn in c.LAYERS:
        if fqn and has_submodule(model, fqn):  # else held by another pipeline stage
            layer = model.get_submodule(fqn)
            if tp and fqn in c.CHECKPOINT:
                # torch 2.13 fails to compile a checkpointed region that holds DTensors
                # (AOTAutograd: "expected all tensors_saved_with_vc_check to be Tensors"): the
                # layer inside the checkpoint is compiled, the checkpoint runs around it.
                fqn, layer = f"{fqn}._checkpoint_wrapped_module", layer._checkpoint_wrapped_module
            model.set_submodule(fqn, torch.compile(layer, backend=backend))


def fsdp_units(c: Constants, model: nn.Module) -> tuple[list[str], list[str]]:
    """(the planned layers that become their own FSDP2 unit, those left to the root's unit).

    FSDP2 manages a tensor in one unit only, so a layer holding a parameter that a module
    outside it holds too (a tied weight: ``head.weight = tok_emb.weight``) is not a unit of its
    own: its parameters join the root's unit, which gathers them for the whole forward and
    backward (the planner charges them so). A layer that contains every holder of its tied
    parameters stays a unit; layers this model (a pipeline stage) lacks are neither."""
    holders: dict[int, set[str]] = {}  # parameter -> the modules that hold it
    for fqn, module in model.named_modules(remove_duplicate=False):
        for p in module._parameters.values():
            if p is not None:
                holders.setdefault(id(p), set()).add(fqn)
    units, root = [], []
    for fqn in c.LAYERS:  # a layer naming no submodule (functional ops): the root's
        if not has_submodule(model, fqn):
            continue
        prefix = fqn + "."
        inside = model.get_submodule(fqn).named_parameters(remove_duplicate=False)
        tied = any(h != fqn and not h.startswith(prefix) for _, p in inside for h in holders[id(p)])
        (root if tied else units).append(fqn)
    return units, root


def fsdp_shard_dim(param: nn.Parameter) -> Shard | None:
    """FSDP2 shards dim 0, but a fused linear's weight (:class:`ColwiseFused`) is already
    ``_StridedShard`` on dim 0 over tp, and a second split of that dim is not the layout DTensor
    reads its placements as (measured: --verify's first loss off at tp=2 x fsdp=2): shard its
    columns. None: dim 0."""
    if isinstance(param, DTensor) and param.ndim == 2:
        if any(isinstance(p, _StridedShard) for p in param.placements):
            return Shard(1)
    return None


def apply_data_parallel(c: Constants, model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard the model with FSDP2 over the fsdp axis (HSDP over (dp, fsdp) with dp > 1 too),
    each planned layer one unit (but for layers with tied parameters: fsdp_units), bf16 plans
    with the MixedPrecisionPolicy above; works on meta. DDP, which needs real weights, comes
    after materialize (apply_ddp)."""
    if uses_fsdp(c):
        dp_mesh = mesh["dp", "fsdp"] if c.MESH["dp"] > 1 else mesh["fsdp"]
        if c.MESH.get("cp", 1) > 1:  # shard over fsdp x cp (torchtitan's dp_shard_cp)
            flat = mesh["fsdp", "cp"]._flatten("fsdp_cp")
            dp_mesh = mesh["dp", "fsdp_cp"] if c.MESH["dp"] > 1 else flat
        offload = {"offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())}
        options = offload if c.OFFLOAD else {}
        if mixed_precision_policy(c):
            options["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
        if any(dtensor_blocks(c).values()):
            options["shard_placement_fn"] = fsdp_shard_dim
        scalars = [name for name, p in model.named_parameters() if p.ndim == 0]
        if scalars:  # fully_shard refuses 0-dim parameters: kept replicated, see replicate_scalars
            options["ignored_params"] = {model.get_parameter(name) for name in scalars}
            replicate_scalars(model, scalars, dp_mesh)
        units, root = fsdp_units(c, model)
        if root:
            say(f"tied parameters: {', '.join(root)} stay in the root FSDP unit (gathered for "
                f"the whole step)")  # fmt: skip
        for fqn in units:
            fully_shard(model.get_submodule(fqn), mesh=dp_mesh, **options)
        fully_shard(model, mesh=dp_mesh, **options)
    return model


def replicate_scalars(model: nn.Module, names: list[str], dp_mesh: DeviceMesh) -> None:
    """Keep the 0-dim parameters ``names`` (CLIP's logit_scale, a ReZero gate) whole on every
    rank, as DDP would: FSDP2 cannot shard them (torch 2.13's fully_shard raises "doesn't support
    scalar parameters"), so apply_data_parallel leaves them out of its units (ignored_params:
    plain tensors, fp32 under a bf16 MixedPrecisionPolicy too) and each one's gradient is
    averaged over ``dp_mesh`` here, by a hook, as each backward produces it (per microbatch:
    the mean of sums is the sum of means). The hooks go on at each forward, on the parameter
    objects the model holds then: materialize's to_empty replaces the meta ones."""
    groups, size = [dp_mesh.get_group(i) for i in range(dp_mesh.ndim)], dp_mesh.size()

    def average(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        for group in groups:  # HSDP: over replicas and shards, every data-parallel rank
            dist.all_reduce(grad, group=group)
        return grad.div_(size)

    def hook_scalars(module, args) -> None:
        for name in names:
            p = module.get_parameter(name)
            if p.requires_grad and not getattr(p, "autopar_replicated", False):
                p.register_hook(average)
                p.autopar_replicated = True

    model.register_forward_pre_hook(hook_scalars)


def apply_ddp(c: Constants, model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Replicate the (materialized) model with DDP over dp when the plan does not use FSDP2:
    gradients are all-reduced (averaged) over the dp group."""
    if c.MESH["dp"] > 1 and not uses_fsdp(c):
        return DDP(model, process_group=mesh["dp"].get_group())
    return model


def parallelize(c: Constants, model: nn.Module, mesh: DeviceMesh, compile: bool = False):
    """What train.py's parallelize does, for Plan.apply: TP, checkpointing, (compile,) data
    parallel."""
    if c.MESH["tp"] > 1 and c.TP_PLAN:
        apply_tp(c, model, mesh["tp"])
    apply_checkpointing(c, model)
    if compile:
        apply_compile(c, model)
    return apply_ddp(c, apply_data_parallel(c, model, mesh), mesh)


# ---- Context parallel ------------------------------------------------------------------------
# CONTEXT_PARALLEL (mesh cp > 1): each rank of a cp group trains on its 1/cp of every sample's
# tokens. The sequence is cut into 2 cp chunks and rank r holds chunks r and 2 cp - 1 - r
# (head-tail: under causal attention every rank then does the same work). The layers before
# CONTEXT_PARALLEL["shard_at"] (the embeddings) run on the whole sequence; a forward pre-hook on
# that layer and every later one keeps only this rank's positions of each tensor argument whose
# dim 1 is the whole sequence (the hidden states; position tables such as rotary cos/sin), and
# the targets are cut the same way, so the loss is this rank's tokens' mean. Attention: a
# TorchFunctionMode, entered by each of those layers' forward while cp is on (cp_active, around
# the step's forward and backward: checkpointed layers recompute inside backward), replaces
# F.scaled_dot_product_attention: keys and values are
# all-gathered over the cp group (their gradients reduce-scattered back), put in sequence
# order, and each local query chunk attends to
# the keys up to its own end with a lower-right causal mask (torch.nn.attention.bias). torch
# 2.13's own context_parallel has no rule for the CPU SDPA op; this form runs on gloo and nccl.
# Parameters are FSDP-sharded over fsdp x cp and gradients averaged over dp x fsdp x cp, so the
# ranks' mean of their local-token losses trains exactly like the whole batch.
class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim`` over ``group`` (rank order); backward: the sum of the ranks'
    gradients of this rank's part."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim, ctx.n = group, dim, x.shape[dim]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, grad):
        rank, world = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        parts = [p.contiguous() for p in grad.chunk(world, ctx.dim)]
        out = torch.empty_like(parts[rank])
        dist.reduce_scatter(out, parts, group=ctx.group)  # the list form: gloo has it too
        return out, None, None


class ContextParallel:
    """One rank's view of the cp group: its positions and the attention that replaces SDPA."""

    def __init__(self, c: Constants, cp_mesh: DeviceMesh) -> None:
        self.group, self.size = cp_mesh.get_group(), cp_mesh.size()
        self.rank, self.seq_len = cp_mesh.get_local_rank(), c.SEQ_LEN
        self.chunk = c.SEQ_LEN // (2 * self.size)
        chunks = (self.rank, 2 * self.size - 1 - self.rank)
        self.positions = torch.cat(
            [torch.arange(k * self.chunk, (k + 1) * self.chunk) for k in chunks]
        )
        self.on = False

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's positions of ``x`` along dim 1 (a whole sequence)."""
        return x.index_select(1, self.positions.to(x.device))

    def pre_hook(self, module, args, kwargs):
        if not self.on:
            return None

        # nested too: HF decoder layers take position_embeddings=(cos, sin)
        return pytree.tree_map(self.pre_hook_cut, (tuple(args), dict(kwargs)))

    def pre_hook_cut(self, x):
        """``x`` cut to this rank's positions if it is a tensor over the whole sequence."""
        whole = isinstance(x, torch.Tensor) and x.dim() > 1 and x.shape[1] == self.seq_len
        return self.shard(x) if whole else x

    def attention(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        if attn_mask is not None or dropout_p:
            fail("context parallel: attention with a mask or dropout cannot be split; re-plan "
                 "without cp")  # fmt: skip
        k, v = (self._in_order(_GatherSequence.apply(t, self.group, 2)) for t in (k, v))
        if not is_causal:
            return F.scaled_dot_product_attention(q, k, v, **kw)
        n, outs = self.chunk, []
        for i, chunk in enumerate((self.rank, 2 * self.size - 1 - self.rank)):
            end = (chunk + 1) * n  # this query chunk sees the keys before its own end
            mask = causal_lower_right(n, end)
            outs.append(F.scaled_dot_product_attention(
                q[:, :, i * n : (i + 1) * n], k[:, :, :end], v[:, :, :end], attn_mask=mask, **kw
            ))  # fmt: skip
        return torch.cat(outs, 2)

    def _in_order(self, gathered: torch.Tensor) -> torch.Tensor:
        """Gathered chunks (rank r's chunks r and 2 cp - 1 - r, rank by rank) in sequence order."""
        slot = {k: 2 * k if k < self.size else 2 * (2 * self.size - 1 - k) + 1
                for k in range(2 * self.size)}  # fmt: skip
        n = self.chunk
        return torch.cat([gathered[:, :, slot[k] * n : (slot[k] + 1) * n] for k in slot], 2)


class _ContextParallelAttention(torch.overrides.TorchFunctionMode):
    def __init__(self, cp: ContextParallel) -> None:
        super().__init__()
        self.cp = cp

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            return self.cp.attention(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def apply_context_parallel(c: Constants, model: nn.Module, mesh: DeviceMesh) -> None:
    """Before TP, checkpointing and FSDP: the sequence cut at CONTEXT_PARALLEL["shard_at"] and
    every later planned layer (see above); the state rides on the model (``autopar_cp``)."""
    cp = ContextParallel(c, mesh["cp"])
    start = c.LAYERS.index(c.CONTEXT_PARALLEL["shard_at"])
    for fqn in c.LAYERS[start:]:
        if has_submodule(model, fqn):
            layer = model.get_submodule(fqn)
            layer.register_forward_pre_hook(cp.pre_hook, with_kwargs=True)
            layer.forward = _with_cp_attention(cp, layer.forward)
    model.autopar_cp = cp


def _with_cp_attention(cp: ContextParallel, forward):
    """``forward`` with SDPA replaced while cp is on: per layer, so that the recomputation of a
    checkpointed layer in backward (which the autograd engine runs outside any mode entered
    around the step) attends like its forward did."""

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not cp.on:
            return forward(*args, **kwargs)
        with _ContextParallelAttention(cp):
            return forward(*args, **kwargs)

    return run


@contextlib.contextmanager
def cp_active(cp: ContextParallel | None):
    """Context parallel on for the forward and backward inside (nothing without cp)."""
    if cp is None:
        yield
        return
    cp.on = True
    try:
        yield
    finally:
        cp.on = False


def cp_shard(cp: ContextParallel | None, target):
    """The targets of this rank's tokens (all of them without cp): every tensor of the target
    whose dim 1 is the whole sequence, cut like the hidden states."""
    if cp is None:
        return target
    return pytree.tree_map(cp.pre_hook_cut, target)


# ---- Expert parallel -------------------------------------------------------------------------
# EXPERT_PARALLEL (ep > 1): each MoE block's experts module (one module holding the experts'
# weights stacked, first dim = experts, called as experts(hidden [N, h], top_k_index [N, k],
# top_k_weights [N, k]) -> [N, h]: HF transformers' Mixtral/Qwen3-MoE/DeepSeek-V3 experts) keeps
# only its ep rank's E/ep experts on each rank. The ep ranks are carved out of the data-parallel
# ranks (dp x fsdp, each training on its own samples): data-parallel rank d is ep rank d % ep of
# ep group d // ep. Its forward (ep_forward) sends each (token, slot) route to the rank owning
# its expert (expert // (E/ep)), tokens sorted by owner, with autograd-aware all-to-alls on the
# ep group; the owner runs its local experts on the rows it received (weight 1), the outputs go
# back by the reverse all-to-all and are combined on the sending rank with the routing weights
# (so the router's gradients stay local). Gradients: the other parameters sync over all dp x fsdp
# ranks as before; an expert's gradient at its owner already sums the contributions of its ep
# group's samples, so each experts module is its own FSDP2 unit over the ranks holding the same
# experts (dp x fsdp / ep of them: "ep_replicas"), which divides by their count, and ep_forward
# scales the experts' parameter gradients by 1/ep more (ScaleGrad; FSDP2's own divide factor
# needs PREMUL_SUM, which gloo lacks): the mean over every data-parallel rank's loss, as the
# single process computes it.
# Each stacked expert weight is a DTensor of the whole model's shape (all E experts), Shard(0)
# over the ep dim (FSDP2 then shards its local part over ep_replicas: a 2-D DTensor, as FSDP
# over TP makes), so everything that handles TP-sharded weights handles experts too: DCP
# checkpoints store every expert once and reshard them into another plan (ep=2 -> ep=1 and
# back), --save-hf gathers whole expert tensors, --init-from reads each rank's experts, and
# --verify compares whole tensors. ep_forward runs the module's own forward on the local
# experts (the DTensors' local parts, to_local: gradients flow back to the DTensors).
class ExpertParallel:
    """The ep groups and this rank's place in them (one per run; see above)."""

    def __init__(self, c: Constants, device_type: str) -> None:
        self.ep = c.EXPERT_PARALLEL["ep"]
        self.num_experts = c.EXPERT_PARALLEL["num_experts"]
        ranks = torch.arange(dist.get_world_size())
        shape = (c.MESH["pp"], c.data_parallel // self.ep, self.ep)  # tp = cp = 1 (ep_rule)
        self.mesh = DeviceMesh(
            device_type, ranks.reshape(shape), mesh_dim_names=("pp", "ep_replicas", "ep")
        )
        self.group = self.mesh["ep"].get_group()
        self.rank = self.mesh["ep"].get_local_rank()
        self.local = self.num_experts // self.ep
        # A test-only knob: send every route to the next rank over (a wrong dispatch, which
        # --verify must catch).
        self.shift = int(os.environ.get("AUTOPAR_TEST_EP_SHIFT", "0"))
        self.rows_sent = [0, 0]  # routes sent to other ep ranks, all routes (this rank)
        self.shapes: dict[str, tuple] = {}  # local shapes of the split expert weights


_EP: ExpertParallel | None = None


def check_experts(c: Constants, model: nn.Module) -> None:
    """Each experts module the plan splits exists, stacks its weights (first dim = experts) and
    is called with (hidden, top_k_index, top_k_weights): one line, exit 2, before any collective."""
    e = c.EXPERT_PARALLEL["num_experts"]
    for fqn in c.EXPERT_PARALLEL["experts"]:
        if not has_submodule(model, fqn):
            continue  # held by another pipeline stage, or missing (check_fqns)
        module = model.get_submodule(fqn)
        params = list(module.named_parameters())
        odd = [n for n, p in params if p.dim() < 1 or p.shape[0] != e]
        call = inspect.signature(type(module).forward).parameters
        if not params or odd or len(call) < 4:
            fail(
                f"expert parallel: {fqn} ({type(module).__name__}) is not an experts module "
                f"with its {e} experts' weights stacked (first dim {e}; "
                f"{odd[0] if odd else 'forward'} is not) and called as experts(hidden, "
                "top_k_index, top_k_weights): plan with --mesh ep=1"
            )


def apply_expert_parallel(c: Constants, model: nn.Module, mesh: DeviceMesh) -> None:
    """Keep this rank's experts of each planned experts module (on meta: each stacked weight
    becomes a DTensor of all E experts, Shard(0) over ep, holding E/ep here), route its
    forward through ep_forward, and make it an FSDP2 unit over the ranks holding the same
    experts (before apply_data_parallel, which leaves it alone)."""
    global _EP
    if _EP is None:
        _EP = ExpertParallel(c, mesh.device_type)
    ep = _EP
    options = {}
    if mixed_precision_policy(c):
        options["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for fqn in c.EXPERT_PARALLEL["experts"]:
        if not has_submodule(model, fqn):
            continue
        module = model.get_submodule(fqn)
        for name, p in list(module.named_parameters(recurse=False)):
            local = torch.empty((ep.local, *p.shape[1:]), dtype=p.dtype, device="meta")
            whole = DTensor.from_local(
                local, ep.mesh["ep"], [Shard(0)], run_check=False, shape=p.shape,
                stride=p.stride(),
            )  # fmt: skip
            setattr(module, name, nn.Parameter(whole, requires_grad=p.requires_grad))
            ep.shapes[f"{fqn}.{name}"] = tuple(local.shape)
        if hasattr(module, "num_experts"):
            module.num_experts = ep.local
        module.forward = functools.partial(ep_forward, ep, local_experts(module))
        fully_shard(module, mesh=ep.mesh["ep_replicas"], **options)


class ScaleGrad(torch.autograd.Function):
    """The identity forward, the gradient times ``scale`` backward."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def local_experts(module: nn.Module):
    """``module``'s own forward, run with its parameters' local experts: each DTensor (all E
    experts, this rank's E/ep held; FSDP2 has gathered them over ep_replicas by then) is
    replaced by its local part for the call, differentiably (to_local), then put back."""
    forward = module.forward

    def run(*args):
        held = dict(module._parameters)
        for name, p in held.items():
            if isinstance(p, DTensor):
                module._parameters[name] = p.to_local()
        try:
            return forward(*args)
        finally:
            module._parameters.update(held)

    return run


def ep_forward(ep: ExpertParallel, local_forward, hidden, top_k_index, top_k_weights):
    """The experts module's forward under expert parallelism (see above): the same output as
    the whole module's for this rank's tokens."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    def exchange(x, out_sizes, in_sizes):  # rows, with gradients sent back in backward
        return wait_tensor(all_to_all_single_autograd(x, out_sizes, in_sizes, ep.group))

    n, k = top_k_index.shape
    routes = top_k_index.reshape(-1)
    owner = (routes // ep.local + ep.shift) % ep.ep
    order = torch.argsort(owner, stable=True)
    send = torch.bincount(owner, minlength=ep.ep)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=ep.group)
    send_sizes, recv_sizes = send.tolist(), recv.tolist()
    ep.rows_sent[0] += len(routes) - send_sizes[ep.rank]
    ep.rows_sent[1] += len(routes)
    ids = routes.new_empty(sum(recv_sizes))
    dist.all_to_all_single(ids, (routes % ep.local)[order], recv_sizes, send_sizes, ep.group)
    rows = exchange(hidden[order // k], recv_sizes, send_sizes)
    # The experts' parameter gradients scaled by 1/ep (FSDP2 divides by the ep_replicas count;
    # see above), their input gradients not: the experts are linear in the output gradient.
    rows = ScaleGrad.apply(rows, float(ep.ep))
    out = local_forward(rows, ids[:, None], top_k_weights.new_ones((len(ids), 1)))
    out = ScaleGrad.apply(out, 1.0 / ep.ep)
    back = exchange(out, send_sizes, recv_sizes)
    back = back[torch.argsort(order)].view(n, k, -1)
    return (back * top_k_weights[..., None].to(back.dtype)).sum(1).to(hidden.dtype)


def expert_report() -> None:
    """Rank 0 prints which experts each rank held and how many routes crossed ranks (the
    all-to-all's work); every rank takes part."""
    if _EP is None:
        return
    held = [None] * dist.get_world_size()
    dist.all_gather_object(held, (_EP.rank, _EP.rows_sent, _EP.shapes))
    sent = sum(h[1][0] for h in held)
    total = sum(h[1][1] for h in held)
    for rank, (ep_rank, _, shapes) in enumerate(held):
        first = ep_rank * _EP.local
        text = ", ".join(f"{n} {tuple(s)}" for n, s in list(shapes.items())[:2])
        say(f"expert parallel: rank {rank} holds experts {first}-{first + _EP.local - 1} of "
            f"{_EP.num_experts}: {text}")  # fmt: skip
    say(f"expert parallel: {sent} of {total} routes sent to another ep rank by all-to-all")


# ---- Build on meta, materialize the shard ------------------------------------------------------
# No rank holds the whole model. build_on_meta builds it with every parameter and buffer on the
# meta device (nn.Module.register_parameter puts the parameters of modules that can re-create
# them, those with reset_parameters, on meta as they are registered, so they are never
# allocated; the few others, a custom nn.Parameter(torch.linspace(...)) say, and the buffers,
# such as rotary tables, are built for real, recorded, and moved to meta). parallelize (TP,
# checkpointing, FSDP2, the pipeline cut) runs on meta; then materialize gives each rank's shard
# storage (to_empty) and values: module by module in construction order, from the same seed, a
# full-size copy of the module's own parameters is initialized the way its constructor did
# (reset_parameters, then a HuggingFace model's _init_weights) or from the recorded values, and
# each rank copies its shard out of it. So one module's parameters are whole at a time, and a
# sharded model starts from the single-process model's weights (for a model whose constructor
# draws random numbers only in reset_parameters). A model file's init_weights(model), when it
# defines one, then runs on the sharded model (its random ops on DTensors: torchtitan's
# convention). --verify copies the reference's weights in, so it compares like with like.
@contextlib.contextmanager
def _parameters_on_meta():
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param) -> None:
        if param is not None and not param.is_meta and hasattr(type(module), "reset_parameters"):
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def build_on_meta(build) -> tuple[nn.Module, dict]:
    """(model with every parameter and buffer on meta, {(id(module), name): recorded value})."""
    with _parameters_on_meta():
        model = build()
    recorded, meta = {}, {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None or t.is_meta:
                    continue
                recorded[id(module), name] = t.detach().clone()
                if id(t) not in meta:  # tied tensors stay tied
                    on_meta = t.detach().to("meta")
                    if isinstance(t, nn.Parameter):
                        on_meta = nn.Parameter(on_meta, requires_grad=t.requires_grad)
                    meta[id(t)] = on_meta
                table[name] = meta[id(t)]
    return model, recorded


def copy_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Set ``param`` (a DTensor shard or a plain tensor) from the whole tensor ``full``, which
    every rank holds alike: each rank copies its own shard, no communication."""
    if isinstance(param, DTensor):
        full = full.to(param.device, param.dtype)
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())
    else:
        param.copy_(full)


def tied_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """(module, parameter name) of every parameter that several modules share (a tied
    embedding and head; BART's shared embedding), grouped by tensor."""
    groups: dict = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                groups.setdefault(id(p), []).append((module, name))
    return [g for g in groups.values() if len(g) > 1]


def retie(groups: list[list[tuple[nn.Module, str]]]) -> None:
    """Share each group's parameter again: to_empty replaces a tied parameter once per module
    that holds it (meta -> device makes new tensors), which would untie them."""
    for (owner, name), *others in groups:
        first = owner._parameters[name]
        for module, other in others:
            if module._parameters[other] is not first:
                module._parameters[other] = first


def materialize(
    modules: list[nn.Module], order: list[nn.Module], recorded: dict, device, seed: int,
    model_file, reference: nn.Module | None = None,
) -> None:  # fmt: skip
    """Storage and initial values for ``modules`` (this rank's parallelized model or stages);
    ``order``: every module of the model as built, in construction order (see above)."""
    ties = [tied_parameters(module) for module in modules]
    ties = dict(zip(map(id, modules), ties))
    for module in modules:
        module.to_empty(device=device)
        retie(ties[id(module)])
    hf_init = getattr(order[0], "_init_weights", None) if getattr(model_file, "hf", False) else None
    torch.manual_seed(seed)
    done = set()
    with torch.no_grad():
        for module in order:
            own = {n: p for n, p in module._parameters.items() if p is not None}
            for name, b in module._buffers.items():
                if b is not None and not b.is_meta and (id(module), name) in recorded:
                    copy_full(b, recorded[id(module), name])
            if not own:
                continue
            # The module's own parameters, whole, on the CPU (a shallow copy; object.__new__
            # because FSDP2's module classes construct anew in __new__).
            twin = object.__new__(type(module))
            twin.__dict__.update(module.__dict__)
            twin._parameters = {
                n: None
                if p is None
                else nn.Parameter(
                    recorded.get((id(module), n), torch.empty(p.shape, dtype=p.dtype)).clone(),
                    requires_grad=False,
                )
                for n, p in module._parameters.items()
            }
            twin._buffers = {
                n: None if b is None else torch.empty(b.shape, dtype=b.dtype)
                for n, b in module._buffers.items()
            }
            if not all((id(module), n) in recorded for n in own):
                if hasattr(twin, "reset_parameters"):
                    twin.reset_parameters()
                if hf_init is not None:
                    hf_init(twin)
            for n, p in own.items():
                if not p.is_meta and id(p) not in done:
                    done.add(id(p))
                    copy_full(p, twin._parameters[n].detach())
        for module in modules:  # a pipeline stage's own copies of state read outside layers
            for target, (owner, name) in getattr(module, "state_sources", {}).items():
                if (id(owner), name) in recorded:
                    prefix, _, attr = target.rpartition(".")
                    tensor = getattr(module.get_submodule(prefix), attr)
                    copy_full(tensor, recorded[id(owner), name])
        init_weights = getattr(model_file, "init_weights", None)
        if callable(init_weights) and len(modules) == 1 and modules[0] is order[0]:
            init_weights(modules[0])
        if reference is not None:
            ref = dict(reference.named_parameters())
            for module in modules:
                for name, p in module.named_parameters():
                    copy_full(p, ref[unwrapped_name(name)].detach())
    still_meta = [
        n for m in modules for n, t in [*m.named_parameters(), *m.named_buffers()] if t.is_meta
    ]
    assert not still_meta, f"left on meta after materialize: {still_meta[:3]}"


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
    by one); a seq2seq LM (T5, BART) reads input_ids and decoder_input_ids as keyword inputs,
    decoder_input_ids being a decoder sequence that starts with the decoder start token and
    the target the same sequence shifted by one; a masked LM reads input_ids with MASK_FRACTION of each sample's positions (the same
    count in every sample) replaced by the mask token, and its target holds the original ids
    there and -100 elsewhere. Loss: cross-entropy of the logits, ignoring -100, computed here
    (not by the model), the same for the sharded run and the --verify reference; plus
    ``router_aux_loss_coef`` times the model's ``aux_loss`` for a mixture of experts whose config
    sets ``output_router_logits`` (as transformers trains it).
    """
    # Grouped-query attention through SDPA's enable_gqa (the planner traced it so).
    os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    import transformers

    hf_config = c.HF_CONFIG
    kwargs = {k: v for k, v in hf_config.items() if k not in ("model_type", "torch_dtype", "dtype")}
    config = transformers.AutoConfig.for_model(hf_config["model_type"], **kwargs)
    config.use_cache = False
    masked, seq2seq = c.HF_TASK == "masked-lm", c.HF_TASK == "seq2seq-lm"
    auto = transformers.AutoModelForMaskedLM if masked else transformers.AutoModelForCausalLM
    auto = transformers.AutoModelForSeq2SeqLM if seq2seq else auto
    vocab = config.vocab_size
    mask_id = hf_config.get("mask_token_id", 103 if vocab > 103 else vocab - 1)
    start_id = next(
        (hf_config[k] for k in ("decoder_start_token_id", "pad_token_id")
         if isinstance(hf_config.get(k), int)),
        0,
    )  # fmt: skip

    def build_model():
        try:
            return auto.from_config(config, attn_implementation="sdpa", dtype=torch.float32).train()
        except ValueError as e:  # no SDPA in the architecture (Gemma 2, BLOOM): eager, as planned
            if "does not support an attention implementation through" not in str(e):
                raise
            return auto.from_config(
                config, attn_implementation="eager", dtype=torch.float32
            ).train()

    def make_batch(batch_size: int, seq_len: int):
        if seq2seq:  # keyword inputs; the decoder reads its targets shifted right by one
            source = torch.randint(0, vocab, (batch_size, seq_len))
            decoder = torch.randint(0, vocab, (batch_size, seq_len + 1))
            decoder[:, 0] = start_id
            return {"input_ids": source, "decoder_input_ids": decoder[:, :-1]}, decoder[:, 1:]
        if not masked:
            ids = torch.randint(0, vocab, (batch_size, seq_len + 1))
            return (ids[:, :-1],), ids[:, 1:]
        ids = torch.randint(0, vocab, (batch_size, seq_len))
        count = max(1, round(c.MASK_FRACTION * seq_len))
        where = torch.rand(batch_size, seq_len).argsort(dim=1)[:, :count]
        labels = torch.full_like(ids, -100).scatter(1, where, ids.gather(1, where))
        return (ids.scatter(1, where, mask_id),), labels

    aux_coef = getattr(config, "router_aux_loss_coef", None)
    router_logits = bool(getattr(config, "output_router_logits", False)) and aux_coef is not None

    def loss_fn(output, target: torch.Tensor) -> torch.Tensor:
        logits = output if isinstance(output, torch.Tensor) else output["logits"]  # pp: tensor
        loss = F.cross_entropy(logits.flatten(0, -2).float(), target.flatten(), ignore_index=-100)
        # a mixture of experts whose config outputs router logits trains its load-balancing
        # loss as transformers does (loss + router_aux_loss_coef * aux_loss)
        aux = None if isinstance(output, torch.Tensor) else output.get("aux_loss")
        if router_logits and aux is not None:
            loss = loss + aux_coef * aux.float()
        return loss

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


# Batches of any shape. make_batch returns (inputs, target): inputs are the forward's arguments
# (a tuple) or its keyword arguments (a dict); each argument, and the target, may be a tensor or
# any pytree of them (dicts, lists, tuples; None and numbers pass through). Every tensor of one
# dim or more has the batch as its first dim: batches move to the device leaf by leaf, and
# data-parallel ranks and accumulation microbatches take their rows of every leaf. loss_fn gets
# the model's output as the forward returns it (a tensor, a dict, a tuple such as (logits,
# aux_loss), an HF ModelOutput) and the target as make_batch returns it.
def call(model, inputs):
    """model(*inputs), or model(**inputs) for keyword inputs (a dict)."""
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def tensor_map(fn, tree):
    """``tree`` with ``fn`` applied to every tensor in it (the rest as is)."""
    return pytree.tree_map_only(torch.Tensor, fn, tree)


def device_of(tree) -> torch.device:
    """The device of the first tensor in ``tree`` (the CPU when it holds none)."""
    leaf = next((x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)), None)
    return leaf.device if leaf is not None else torch.device("cpu")


def batch_rows(tree, start: int, stop: int):
    """Rows start:stop (the batch dim) of every tensor in ``tree``; 0-d tensors as they are."""
    return tensor_map(lambda x: x[start:stop] if x.dim() else x, tree)


def batch_split(tree, n: int) -> list:
    """``tree`` in ``n`` microbatches of (nearly) equal rows, as Tensor.tensor_split."""
    if n == 1:
        return [tree]
    leaves, spec = pytree.tree_flatten(tree)
    pieces = [
        x.tensor_split(n) if isinstance(x, torch.Tensor) and x.dim() else [x] * n for x in leaves
    ]
    return [pytree.tree_unflatten([p[i] for p in pieces], spec) for i in range(n)]


def the_tensor(output):
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


def default_loss(output, target: torch.Tensor) -> torch.Tensor:
    # Mean over all samples (and tokens): with equal local batches, the mean of the data-parallel
    # ranks' losses is the global mean, which is what DDP/FSDP gradient averaging assumes. In
    # fp32 (a bf16 plan's output is bf16).
    output = the_tensor(output)
    if target.is_floating_point():
        return F.mse_loss(output.float(), target.float())
    return F.cross_entropy(output.flatten(0, -2).float(), target.flatten())


def local_slice(c: Constants, batch, dp_rank: int):
    """This data-parallel rank's contiguous share of the global batch (TP peers share one)."""
    n = c.GLOBAL_BATCH // c.data_parallel
    return batch_rows(batch, dp_rank * n, (dp_rank + 1) * n)


# Dropout. Training keeps the model's dropout: each step reseeds the RNG from (--seed, step,
# data-parallel rank) (step_seed), so data-parallel ranks draw different masks, TP peers and
# pipeline ranks of one replica the same stream (a replicated activation gets the same mask on
# every TP rank; on GPU, DTensor's RNG tracker gives each shard of a sharded DTensor its part of
# one mask), and a resumed run draws what an uninterrupted one would. --verify runs the sharded
# model and the reference with dropout off (DropoutOff), since two runs cannot draw one mask
# over different shards and batch slices; nothing else of training mode changes.
def step_seed(seed: int, step: int, dp_rank: int) -> int:
    """The RNG seed of ``step`` on data-parallel rank ``dp_rank`` (apart from the batch's)."""
    digest = hashlib.sha256(f"dropout/{seed}/{step}/{dp_rank}".encode()).digest()
    return int.from_bytes(digest[:7], "big")


class DropoutOff(torch.overrides.TorchFunctionMode):
    """Inside it, dropout is the identity: nn.Dropout and its kin, F.dropout (and the 1d/2d/3d
    and alpha variants, whatever p a module passes, e.g. HF's float attributes), their in-place
    and aten forms (a pipeline stage's exported graph calls ``aten.dropout`` for a dropout
    outside its layers), and attention's ``dropout_p``: F.scaled_dot_product_attention (and its
    aten op) and F.multi_head_attention_forward (nn.MultiheadAttention, hence
    nn.TransformerEncoderLayer and nn.Transformer). Attention gets its ``dropout_p`` zeroed
    rather than its inner dropout caught: a mode runs a function it handles with itself popped,
    so the SDPA (or F.dropout) that F.multi_head_attention_forward calls would escape it.
    ``seen``: dropouts it turned off."""

    aten = torch.ops.aten
    FUNCTIONS = (
        F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
        F.feature_alpha_dropout, torch.dropout, torch.alpha_dropout, torch.feature_dropout,
        torch.feature_alpha_dropout, torch.dropout_, torch.alpha_dropout_, torch.feature_dropout_,
        torch.feature_alpha_dropout_, aten.dropout.default, aten.alpha_dropout.default,
        aten.feature_dropout.default, aten.feature_alpha_dropout.default, aten.dropout_.default,
        aten.alpha_dropout_.default, aten.feature_dropout_.default,
        aten.feature_alpha_dropout_.default,
    )  # fmt: skip
    NATIVE = (torch.native_dropout, aten.native_dropout.default)  # -> (output, keep mask)
    NAMES = ("input", "p", "training")
    # attention -> the position of its dropout_p argument, and of its training flag (if any)
    ATTENTION = {
        F.scaled_dot_product_attention: (4, None),
        aten.scaled_dot_product_attention.default: (4, None),
        F.multi_head_attention_forward: (10, 13),
    }

    def __init__(self, parent: DropoutOff | None = None) -> None:
        super().__init__()
        self.seen, self.depth, self.parent = 0, 0, parent

    def __enter__(self):
        self.depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        self.depth -= 1
        return super().__exit__(*exc)

    def count(self) -> None:
        if self.parent is not None:
            self.parent.count()
        else:
            self.seen += 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FUNCTIONS or func in self.NATIVE:
            given = {**dict(zip(self.NAMES, args)), **kwargs}
            training = given.get("training", given.get("train", True))
            if given.get("p", 0.5) > 0 and training is not False:
                self.count()
            x = given["input"]
            return (x, torch.ones_like(x, dtype=torch.bool)) if func in self.NATIVE else x
        if func in self.ATTENTION:
            at, training_at = self.ATTENTION[func]
            p = args[at] if len(args) > at else kwargs.get("dropout_p", 0.0)
            training = args[training_at] if training_at and len(args) > training_at else None
            if p and kwargs.get("training", training) is not False:
                self.count()
            if len(args) > at:
                args = (*args[:at], 0.0, *args[at + 1 :])
            kwargs = {**kwargs, "dropout_p": 0.0} if "dropout_p" in kwargs else kwargs
        return func(*args, **kwargs)


def dropout_off(args: argparse.Namespace, modules=()):
    """With --verify, the DropoutOff this run's steps (sharded and reference) run under. The
    recomputation of a checkpointed layer in backward runs outside any mode entered around the
    step: each checkpointed module of ``modules`` enters one of its own while the step's is
    entered (see _with_dropout_off)."""
    if not args.verify:
        return contextlib.nullcontext()
    mode = args.__dict__.setdefault("dropout_off", DropoutOff())
    for module in modules:
        if getattr(module, "autopar_dropout_walked", False):  # every step: walk once
            continue
        module.autopar_dropout_walked = True
        for sub in module.modules():
            inner = getattr(sub, "_checkpoint_wrapped_module", None)
            if inner is not None and not hasattr(inner, "autopar_dropout_off"):
                inner.autopar_dropout_off = mode
                inner.forward = _with_dropout_off(mode, inner.forward)
    return mode


def _with_dropout_off(mode: DropoutOff, forward):
    """``forward`` under a DropoutOff of its own while ``mode`` is entered (its recomputation in
    backward included)."""

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not mode.depth:
            return forward(*args, **kwargs)
        with DropoutOff(parent=mode):
            return forward(*args, **kwargs)

    return run


def dp_rank_of(c: Constants, mesh: DeviceMesh) -> int:
    """This rank's index among the data-parallel ranks (dp major, fsdp minor)."""
    return mesh["dp"].get_local_rank() * c.MESH["fsdp"] + mesh["fsdp"].get_local_rank()


def batches(
    c: Constants, make_batch, seed, first_step, steps, device, dp_rank, data=None, full=True
):
    """(step, this rank's batch, the global batch) for each step: synthetic batches, the same
    global batch on every rank (drawn from a seed that depends only on the step, so a resumed
    run sees what an uninterrupted one would), each data-parallel rank training on its slice;
    with --data (``data``), the DataStream's batches (the global one only if ``full``)."""
    for step, batch, whole in _batches(c, make_batch, seed, first_step, steps, device, dp_rank,
                                       data, full):  # fmt: skip
        torch.manual_seed(step_seed(seed, step, dp_rank))  # this step's dropout (see above)
        yield step, batch, whole


def _batches(c: Constants, make_batch, seed, first_step, steps, device, dp_rank, data, full):
    if data is not None:
        yield from data.batches(first_step, steps, device, dp_rank, full)
        return
    for step in range(first_step, steps + 1):
        torch.manual_seed(seed + 1000 + step)
        inputs, target = make_batch(c.GLOBAL_BATCH, c.SEQ_LEN)
        batch = tensor_map(lambda x: x.to(device), (inputs, target))
        yield step, local_slice(c, batch, dp_rank), batch


def build_optimizer(params, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW (decoupled weight decay) or SGD (weight decay as an L2 term in the gradient), on
    every parameter (norms and biases too); --weight-decay unset keeps torch's defaults."""
    params = list(params)
    decay = {} if args.weight_decay is None else {"weight_decay": args.weight_decay}
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=args.lr, **decay)
    return torch.optim.AdamW(params, lr=args.lr, **decay)


def lr_factor(kind: str, warmup: int, steps: int, step: int) -> float:
    """The lr of step ``step`` (1, 2, ..., ``steps``) over --lr. Warmup: step / warmup for the
    first ``warmup`` steps (from lr / warmup up to lr). Then, with d = steps - warmup decay steps
    and p = (step - warmup - 1) / d, constant 1, linear 1 - p, cosine (1 + cos(pi p)) / 2: the
    first step after warmup runs at lr and the decay reaches 0 one step past the last (every
    step trains with an lr above 0, the last at lr / d for linear)."""
    if step <= warmup:
        return step / warmup
    if kind == "constant":
        return 1.0
    progress = (step - warmup - 1) / max(1, steps - warmup)
    if kind == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


class LRSchedule:
    """--lr-schedule and --warmup-steps on the optimizers (one per pipeline stage): sets each
    param group's lr before every step. Its state (steps done, base lr) is saved in every
    checkpoint; a resumed run continues the schedule where it stopped, at the saved base lr."""

    def __init__(self, args: argparse.Namespace, optimizers) -> None:
        self.kind, self.warmup, self.steps = args.lr_schedule, args.warmup_steps, args.steps
        self.optimizers, self.base, self.done = list(optimizers), args.lr, 0
        self.apply()

    def lr(self) -> float:
        """The lr of the next step."""
        return self.base * lr_factor(self.kind, self.warmup, self.steps, self.done + 1)

    def apply(self) -> None:
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = self.lr()

    def step(self) -> None:
        self.done += 1
        self.apply()

    def state_dict(self) -> dict:
        return {
            "done": torch.tensor(self.done),
            "base": torch.tensor(self.base, dtype=torch.float64),
        }

    def load_state_dict(self, state: dict) -> None:
        self.done, self.base = int(state["done"]), float(state["base"])
        self.apply()


def collective_device() -> torch.device:
    """Where a tensor for a collective lives: this rank's GPU with nccl, else the CPU."""
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def grad_norm(c: Constants, params, max_norm: float | None = None, distributed=True) -> float:
    """The total gradient norm of the whole model (before clipping), and, with ``max_norm``,
    every gradient scaled by min(1, max_norm / norm) (torch's clip_grad_norm_ rule).

    Each rank holds some shards of its stages' parameters: plain tensors (DDP, TP-replicated
    layers), DTensors sharded over TP and/or FSDP mesh dims, replicated over others. The squares
    of the rank's local gradients are summed, each divided by the number of ranks that hold that
    very shard (world / pp / the product of its Shard dims), then summed over the whole world in
    one all-reduce: every element counted once, the stages of every pipeline rank included.
    (torch.nn.utils.clip_grad_norm_ handles DTensors of one mesh only. Measured on torch 2.13:
    with fsdp x tp it raises, "All operands in aten.stack.default must have the same mesh" (the
    un-TP'd parameters are on the 1-D fsdp mesh, the others on fsdp x tp); on pp=2 each rank
    gets its own stage's norm, 0.797 and 0.378 of a total 0.882.) ``distributed`` False: one
    process's plain model (--verify's reference)."""
    holders = dist.get_world_size() // c.MESH["pp"] if distributed else 1
    groups: dict = {}  # (copies, device, dtype) -> local gradients
    for p in params:
        g = p.grad
        if g is None:
            continue
        shards = 1
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):  # a pending sum: make it whole
                whole = [Replicate() if pl.is_partial() else pl for pl in g.placements]
                p.grad = g = g.redistribute(placements=whole)
            # Shard and FSDP2's _StridedShard (a TP-sharded dim sharded again) split a tensor.
            shards = math.prod(
                g.device_mesh.size(i)
                for i, pl in enumerate(g.placements)
                if not (pl.is_replicate() or pl.is_partial())
            )
            g = g.to_local()
        groups.setdefault((holders // shards, g.device, g.dtype), []).append(g)
    total = torch.zeros((), dtype=torch.float64, device=collective_device())
    with torch.no_grad():
        for (copies, _, _), grads in groups.items():
            norms = torch.stack(torch._foreach_norm(grads)).to(total.device, torch.float64)
            total += norms.square().sum() / copies
        if distributed:
            dist.all_reduce(total)
        norm = total.sqrt().item()
        if max_norm is not None and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for grads in groups.values():
                torch._foreach_mul_(grads, scale)
    return norm


def train_step(c: Constants, model, optimizer, loss_fn, batch, args, reference=False):
    """One optimizer step on ``batch``: (loss, total gradient norm before clipping). It runs
    in the plan's ACCUMULATION_STEPS equal microbatches: gradients accumulate without
    data-parallel sync until the last microbatch, each loss scaled by 1/N so the gradients are
    the whole batch's; then they are clipped to --max-grad-norm. ``reference`` (--verify's
    unsharded model, the global batch) runs the same pieces as the sharded run, each data-parallel
    rank's slice in its microbatches (:func:`reference_pieces`)."""
    pieces = reference_pieces(c, batch) if reference else batch_split(batch, c.ACCUMULATION_STEPS)
    steps = len(pieces)
    device = device_of(batch)
    total = torch.zeros((), device=device)
    cp = None if reference else getattr(model, "autopar_cp", None)
    for i, (micro_inputs, micro_target) in enumerate(pieces):
        with gradient_sync(model, i == steps - 1), dropout_off(args, [model]), cp_active(cp):
            output = forward(c, model, micro_inputs, reference)
            with autocast(c, device.type):
                loss = loss_fn(output, cp_shard(cp, micro_target)) / steps
            loss.backward()
        total += loss.detach()
    norm = grad_norm(c, model.parameters(), args.max_grad_norm, distributed=not reference)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, norm


def reference_pieces(c: Constants, batch) -> list:
    """The global batch as the sharded run splits it: each data-parallel rank's slice, in its
    microbatches (accumulation steps, or the pipeline's). The loss of every piece is averaged,
    so a loss that is a mean over samples is the whole batch's either way, and one that is not
    (a mixture of experts' load-balancing loss, a statistic of the routing over the batch) is
    what the sharded run computes: the reference differs from it by reduction order only."""
    per_rank = c.MICROBATCHES if c.MESH["pp"] > 1 else c.ACCUMULATION_STEPS
    slices = [local_slice(c, batch, r) for r in range(c.data_parallel)]
    return [piece for one in slices for piece in batch_split(one, per_rank)]


@contextlib.contextmanager
def gradient_sync(model, sync: bool):
    """Data-parallel gradient sync on (the last microbatch of a step) or off (the others):
    DDP's no_sync, FSDP2's set_requires_gradient_sync; nothing to do without data parallel."""
    if sync:
        yield
    elif isinstance(model, DDP):
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def mean_loss(c: Constants, loss: torch.Tensor) -> float:
    """The step's loss, the mean over data-parallel ranks: the ranks of the last pipeline stage
    (all ranks without a pipeline) hold their slice's loss, TP peers the same one, the other
    stages 0, so the sum over all ranks divided by the last stage's rank count."""
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    return loss.item() / (dist.get_world_size() // c.MESH["pp"])


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: the caching allocator's peak. CPU: this process's peak RSS, read from Linux's
    VmHWM (the high-water mark of this program's own memory). Not ru_maxrss: Linux carries a
    process's ru_maxrss over from its parent across fork and exec, so a rank started by a large
    process (a test runner at 1 GB, say) reports the parent's RSS as its own peak (measured)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def log_step(c: Constants, step: int, loss: float, step_time_s: float, device, **more) -> None:
    """Rank 0's JSON line for a step (called on every rank: peak_memory_bytes is the largest
    over all ranks). ``more``: lr, grad_norm (and --verify's ref_grad_norm). mfu is MODEL_FLOPS
    / (step time x world size x PEAK_FLOPS), null where the plan has no FLOPs figure."""
    peak = torch.tensor(peak_memory_bytes(device), dtype=torch.int64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if dist.get_rank() != 0:
        return
    tokens = c.GLOBAL_BATCH * c.SEQ_LEN if c.SEQ_LEN else None
    mfu = None
    if c.MODEL_FLOPS and c.PEAK_FLOPS:
        mfu = round(c.MODEL_FLOPS / (step_time_s * c.WORLD_SIZE * c.PEAK_FLOPS), 6)
    finite = lambda x: x if x is not None and math.isfinite(x) else None  # noqa: E731 (JSON)
    record = {
        "step": step,
        "loss": finite(loss),
        "lr": more.pop("lr", None),
        "grad_norm": finite(more.pop("grad_norm", None)),
        "step_time_s": round(step_time_s, 6),
        "tokens_per_s": round(tokens / step_time_s, 1) if tokens else None,
        "mfu": mfu,
        "peak_memory_bytes": int(peak),
        **{k: finite(v) for k, v in more.items()},
    }
    print(json.dumps(record), flush=True)


# ---- Pipeline stages -------------------------------------------------------------------------
# How the model is cut. Its forward need not be a sequence of children (a GPT adds position
# embeddings at the root and loops over a ModuleList; a Llama slices its rope buffers to the
# sequence; HF models build masks with data-dependent Python), so the cut is made on the graph
# autopar planned on: the model is exported (torch.export, non-strict, at the microbatch shape)
# with the call signature of every planned layer preserved, unflattened back into its module
# hierarchy, and the model's own layer modules are put back in place of their exported copies
# (TP then finds nn.Linear, FSDP and --verify the real parameters under their FQNs). A layer
# called with a string (Gemma 3's rotary embedding, once per attention type) cannot keep its
# signature: such a layer without parameters is inlined like the modules in between (the base
# model, containers): one graph of layer calls and the aten ops between them. A layer call goes
# to the stage that lists the layer. Ops outside layers run as late as they can (in their first
# reader's stage), except that an op reading a non-tensor value (the pytree glue around each
# layer call) runs in that value's stage: only tensors cross stages. Each stage is an
# fx.GraphModule running its slice of the graph: its inputs are the values earlier stages
# computed that it or later stages need (the forward's arguments for stage 0), its outputs those
# later stages need, made contiguous, and its inputs hand their gradients back contiguous: p2p
# sends need contiguous tensors both ways (an LSTM's batch-first output, HF's expanded mask, the
# gradient of a tensor that a torch.cat or a transpose read). It holds the user's module objects
# under their original FQNs (blocks.2.attn.q); state read outside layers (a root-level rope
# buffer or parameter) is its own copy, initialized from the model's (STATE_SOURCES). The
# planner runs the same functions (layer_program, stage_of_nodes, cut_stages) on meta when it
# plans, so a plan it accepts is a plan that cuts. --show-stages prints each stage's code.
class CutError(Exception):
    """The model cannot be cut into the planned stages: one line, what and why."""


@dataclasses.dataclass
class LayerProgram:
    """The forward as one fx graph of layer calls and the ops between them (see above)."""

    root: nn.Module
    graph: torch.fx.Graph
    kinds: dict
    """node name -> the type name of its value, for the values that are no tensor."""


def forward_mode(example_inputs: tuple):
    """(context, inputs) to run a forward on ``example_inputs``: on meta, under a FakeTensorMode
    (shapes only, like meta, but tensors that tracing-aware code recognizes: HuggingFace's
    masking utils call .item() on a plain meta tensor and skip it on a fake one)."""
    if not any(isinstance(x, torch.Tensor) and x.is_meta for x in example_inputs):
        return contextlib.nullcontext(), example_inputs
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # a shape environment lets data-dependent sizes (a MoE's tokens per expert) stay symbolic
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    inputs = tuple(
        mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs
    )
    both = contextlib.ExitStack()
    both.enter_context(mode)
    both.enter_context(MetaGroupedMM())
    return both, inputs


class MetaGroupedMM(torch.utils._python_dispatch.TorchDispatchMode):
    """``aten._grouped_mm`` on meta at any dtype. Its meta kernel follows the CUDA kernel and
    takes bf16 only; the CPU kernel takes fp32 too, and HF's grouped experts (Mixtral,
    Qwen3-MoE) call it at the model's dtype. On meta its shape comes from a bf16 call, returned
    in the dtype the real kernel gives."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default and args[0].is_meta:
            if args[0].dtype != torch.bfloat16:
                dtype = kwargs.get("out_dtype") or args[0].dtype
                a, b = (x.to(torch.bfloat16) for x in args[:2])
                return func(a, b, *args[2:], **{**kwargs, "out_dtype": None}).to(dtype)
        return func(*args, **kwargs)


def no_cache(model: nn.Module) -> dict:
    """Keyword arguments of every forward the cut runs: no KV cache (an HF model's config may
    ask for one; training never reads it, and a cache object cannot cross stages)."""
    return (
        {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    )


def unsignable_layers(model: nn.Module, layers, example_inputs: tuple) -> dict[str, str]:
    """The layers called with an argument torch.export cannot keep in a call signature (a
    string, an object) -> that argument, in a few words: one forward, shapes only on meta,
    with hooks on the layers."""
    plain = (torch.Tensor, int, float, bool, type(None))
    found, handles = {}, []

    def hook(fqn):
        def record(module, args, kwargs):
            odd = [
                x
                for x in torch.utils._pytree.tree_leaves((args, kwargs))
                if not isinstance(x, plain)
            ]
            if odd and fqn not in found:
                text = repr(odd[0]) if isinstance(odd[0], str) else "object"
                found[fqn] = f"{type(odd[0]).__name__} {text}"[:80]

        return record

    for fqn in layers:
        handles.append(
            model.get_submodule(fqn).register_forward_pre_hook(hook(fqn), with_kwargs=True)
        )
    mode, inputs = forward_mode(example_inputs)
    try:
        with torch.no_grad(), mode, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(*inputs, **no_cache(model))
    finally:
        for h in handles:
            h.remove()
    return found


def inlined_layers(model: nn.Module, layers, example_inputs: tuple) -> dict[str, str]:
    """The layers called with a string or an object (unsignable_layers); raises CutError for
    one that holds parameters (it cannot be inlined)."""
    try:
        odd = unsignable_layers(model, layers, example_inputs)
    except Exception as e:  # the user's forward raises many kinds
        raise CutError(
            f"{type(model).__name__}.forward fails on the microbatch ({describe(e)})"
        ) from e
    held = [
        f for f in layers if f in odd and any(True for _ in model.get_submodule(f).parameters())
    ]
    if held:
        raise CutError(
            f"layer {held[0]} is called with a {odd[held[0]]} argument and holds parameters: "
            "torch.export cannot keep a string or an object in a call signature, so a pipeline "
            "stage cannot call it; pass tensors, ints or floats to it, or plan without "
            "pipeline parallelism (--mesh pp=1)"
        )
    return odd


def export_layers(model: nn.Module, layers: set, example_inputs: tuple, last_try: bool = False):
    """The unflattened export of the forward with the call signatures of ``layers`` kept;
    raises the export's error, or (``last_try``) CutError."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            program = torch.export.export(
                model, example_inputs, no_cache(model), strict=False,
                preserve_module_call_signature=tuple(sorted(layers)),
            )  # fmt: skip
            return torch.export.unflatten(program)
        except Exception as e:  # export raises many kinds
            if not last_try:
                raise
            raise CutError(
                f"cannot export {type(model).__name__} to cut it into pipeline stages "
                f"({describe(e)}): plan without pipeline parallelism (--mesh pp=1)"
            ) from e


def layer_program(model: nn.Module, stages, example_inputs: tuple) -> LayerProgram:
    """The forward of ``model`` on ``example_inputs`` as a graph of calls of the layers that
    ``stages`` (lists of module FQNs) name; raises CutError where torch.export cannot."""
    layers = [fqn for stage in stages for fqn in stage if fqn and has_submodule(model, fqn)]
    try:
        root = export_layers(model, set(layers), example_inputs)
    except Exception:  # a layer called with a string? find out (one forward) and try again
        layers = set(layers) - set(inlined_layers(model, layers, example_inputs))
        root = export_layers(model, layers, example_inputs, last_try=True)
    layers = set(layers)
    for fqn in layers:
        root.set_submodule(fqn, model.get_submodule(fqn))
    graph = torch.fx.Graph()
    out = inline_graph(root, "", graph, None, layers, skip=set(no_cache(model)))
    graph.output(out[0] if isinstance(out, tuple | list) and len(out) == 1 else out)
    kinds = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            result = super().run_node(n)
            if not isinstance(result, torch.Tensor):
                kinds[n.name] = type(result).__name__
            return result

    mode, inputs = forward_mode(example_inputs)
    try:
        with torch.no_grad(), mode, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            Recorder(torch.fx.GraphModule(root, graph)).run(*inputs)
    except Exception as e:  # the user's modules and aten ops, rerun from the export: many kinds
        raise CutError(f"the exported forward does not run as layer calls ({describe(e)})") from e
    return LayerProgram(root, graph, kinds)


def describe(e: BaseException) -> str:
    """An exception in a few words: its type and the first line of its message."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text[:160]}" if text else type(e).__name__


def inline_graph(
    module: nn.Module, prefix: str, graph: torch.fx.Graph, args, layers: set[str], skip=()
):
    """Copy ``module.graph`` into ``graph``, inlining calls of submodules that are no planned
    layer; return what its output node returns (``args``: values of its placeholders; at the
    top, ``skip``: keyword arguments bound at export, left out)."""
    env, inputs = {}, iter(args or ())
    for n in module.graph.nodes:
        if n.op == "placeholder" and args is None and n.target in skip and not n.users:
            continue
        if n.op == "placeholder":
            env[n] = graph.placeholder(n.name) if args is None else next(inputs)
        elif n.op == "output":
            return torch.fx.map_arg(n.args[0], env.__getitem__)
        elif n.op == "call_module" and layer_call(prefix + n.target) not in layers:
            sub_args = torch.fx.map_arg(n.args, env.__getitem__)
            sub = module.get_submodule(n.target)
            env[n] = inline_graph(sub, f"{prefix}{n.target}.", graph, sub_args, layers)
        elif not n.users and "_assert" in getattr(n.target, "__name__", ""):
            continue  # export's checks of the traced dtypes and devices (meta, here)
        elif n.target is operator.getitem and isinstance(env[n.args[0]], tuple | list):
            env[n] = env[n.args[0]][n.args[1]]  # an element of an inlined module's outputs
        else:
            env[n] = graph.node_copy(n, env.__getitem__)
            if n.op in ("call_module", "get_attr"):
                env[n].target = prefix + n.target
                if n.op == "call_module":  # a second call of a layer (unflatten's layer@1)
                    env[n].target = layer_call(env[n].target)
    raise AssertionError("a graph without output")


def layer_call(target: str) -> str:
    """The module a call_module target calls: unflatten names a module's second call ``m@1``."""
    return ".".join(part.split("@")[0] for part in target.split("."))


def layer_of(fqn: str, layers) -> str | None:
    """The planned layer that is the module ``fqn`` or holds it."""
    parts = fqn.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in layers:
            return ".".join(parts[:i])
    return None


def stage_of_nodes(program: LayerProgram, model: nn.Module, stages) -> dict:
    """The stage of every node of ``program`` but the placeholders and the output, for the
    stages ``stages`` (lists of layer FQNs); raises CutError where the cut cannot run."""
    stage_of_layer = {fqn: k for k, layers in enumerate(stages) for fqn in layers}
    holder = {}  # a tied weight (GPT-2's lm_head = wte) cannot live in two stages
    for k, stage_layers in enumerate(stages):
        for fqn in stage_layers:
            if not fqn or not has_submodule(model, fqn):
                continue
            for pname, p in model.get_submodule(fqn).named_parameters():
                if holder.setdefault(id(p), (k, f"{fqn}.{pname}"))[0] != k:
                    raise CutError(
                        f"{fqn}.{pname} is tied to {holder[id(p)][1]} in stage "
                        f"{holder[id(p)][0]}: a pipeline cannot share a weight between stages; "
                        "plan without pipeline parallelism, or untie (tie_word_embeddings=false)"
                    )
    graph = program.graph
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    stage = {}
    for n in nodes:
        layer = layer_of(n.target, stage_of_layer) if n.op == "call_module" else None
        if layer is not None:
            stage[n] = stage_of_layer[layer]
    if not stage:
        raise CutError(f"the forward calls none of the planned layers {sorted(stage_of_layer)}")
    last = len(stages) - 1
    layer_calls = set(stage)
    for n in reversed(nodes):  # the rest as late as it can: in its first reader's stage
        if n not in layer_calls and n.users:
            stage[n] = min((stage[u] for u in n.users if u in stage), default=last)
    for n in nodes:  # an op nothing reads: with what it reads
        if n not in stage:
            stage[n] = max((stage[a] for a in n.all_input_nodes if a in stage), default=0)
    glue = [n for n in nodes if n not in layer_calls]
    for _ in range(len(glue)):  # ... but where a non-tensor value it reads is made
        changed = False
        for n in glue:
            fixed = [stage[a] for a in n.all_input_nodes if a.name in program.kinds and a in stage]
            if fixed and min(fixed) < stage[n]:
                stage[n], changed = min(fixed), True
        for n in reversed(glue):
            earliest = min((stage[u] for u in n.users if u in stage), default=stage[n])
            if earliest < stage[n]:
                stage[n], changed = earliest, True
        if not changed:
            break
    for n in nodes:
        if n.op == "get_attr" and len({stage[u] for u in n.users if u in stage}) > 1:
            readers = sorted({stage[u] for u in n.users if u in stage})
            raise CutError(
                f"{n.target} is read by stages {readers} (tied weights?): a pipeline cannot "
                "share a tensor between stages; plan its readers into one stage"
            )
        for arg in n.all_input_nodes:
            if stage.get(arg, 0) > stage[n]:
                raise CutError(
                    f"the forward runs {n.target} (stage {stage[n]}) after {arg.target} (stage "
                    f"{stage[arg]}): stages must follow the order the forward calls layers in"
                )
            if stage.get(arg, 0) < stage[n] and arg.name in program.kinds:
                k = stage.get(arg, 0)
                raise CutError(
                    f"the cut after {stages[k][-1]} would pass a {program.kinds[arg.name]} "
                    f"({arg.name}) from stage {k} to stage {stage[n]}: pipeline stages pass "
                    "only tensors; cut at another layer boundary"
                )
    empty = sorted(set(range(len(stages))) - {stage[n] for n in layer_calls})
    if empty:
        raise CutError(
            f"pipeline stage {empty[0]} calls no layer: its layers {stages[empty[0]]} hold no "
            "module the forward calls (a layer without parameters called with a string is "
            "inlined); cut at another layer boundary"
        )
    return stage


class ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward makes the gradient contiguous (a stage sends the
    gradients of its inputs back with p2p)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def contiguous_grad(x: torch.Tensor) -> torch.Tensor:
    return ContiguousGrad.apply(x) if x.is_floating_point() else x


def cut_stages(
    program: LayerProgram, model: nn.Module, stages, example_inputs: tuple
) -> list[torch.fx.GraphModule]:
    """The model cut into len(stages) modules that, called in a chain, compute its forward
    (checked on ``example_inputs``); raises CutError where the cut cannot run."""
    stage = stage_of_nodes(program, model, stages)
    graph, num_stages = program.graph, len(stages)
    output = next(n for n in graph.nodes if n.op == "output")
    values = [n for n in graph.nodes if n.op != "output"]  # placeholders first, in graph order

    def last_use(value: torch.fx.Node) -> int:
        return max((stage.get(u, num_stages - 1) for u in value.users), default=-1)

    modules, carried = [], [n for n in values if n.op == "placeholder"]
    for k in range(num_stages):
        g = torch.fx.Graph()
        env = {}
        for v in carried:  # stage 0: the forward's own placeholders
            env[v] = g.node_copy(v) if k == 0 else g.placeholder(v.name)
            if k > 0:
                env[v] = g.call_function(contiguous_grad, (env[v],))
        for n in values:
            if stage.get(n) == k:
                env[n] = g.node_copy(n, env.__getitem__)
        if k == num_stages - 1:
            g.output(torch.fx.map_arg(output.args[0], env.__getitem__))
        else:
            carried = [v for v in values if v in env and last_use(v) > k]
            outputs = [g.call_method("contiguous", (env[v],)) for v in carried]
            g.output(outputs[0] if len(outputs) == 1 else tuple(outputs))
        module = torch.fx.GraphModule(program.root, g, class_name=f"Stage{k}")
        module.state_sources = state_sources(module, model)
        modules.append(module)
    check_split(model, modules, example_inputs)
    return modules


def state_sources(module: torch.fx.GraphModule, model: nn.Module) -> dict:
    """The stage's own tensors read outside layers (get_attr) -> (the model's module that
    owns the tensor, its name): materialize initializes them from the model's values."""
    out = {}
    for n in module.graph.nodes:
        if n.op == "get_attr":
            owner, _, name = n.target.rpartition(".")
            if has_submodule(model, owner):
                m = model.get_submodule(owner)
                if name in m._parameters or name in m._buffers:
                    out[n.target] = (m, name)
    return out


def split_into_stages(
    c: Constants, model: nn.Module, example_inputs: tuple
) -> list[torch.fx.GraphModule]:
    """The model cut into len(STAGES) modules that, called in a chain, compute its forward."""
    try:
        program = layer_program(model, c.STAGES, example_inputs)
        modules = cut_stages(program, model, c.STAGES, example_inputs)
    except CutError as e:
        fail(str(e))
    if any(isinstance(x, torch.Tensor) and x.is_meta for x in example_inputs):
        # Exported on meta: ops that create tensors (arange for positions, masks) were recorded
        # with device=meta; they run on this rank's device.
        device = local_device(c)
        for module in modules:
            for n in module.graph.nodes:
                n.args, n.kwargs = torch.fx.node.map_aggregate(
                    (n.args, n.kwargs),
                    lambda a: device if isinstance(a, torch.device) and a.type == "meta" else a,
                )
            module.recompile()
    return modules


def check_split(model: nn.Module, stages: list[nn.Module], example_inputs: tuple) -> None:
    """Run the stages in a chain on one batch, in eval mode, and compare with the forward
    (shapes only on meta, see forward_mode)."""
    training = model.training
    model.eval()
    on_meta = any(isinstance(x, torch.Tensor) and x.is_meta for x in example_inputs)
    mode, example_inputs = forward_mode(example_inputs)
    leaves = torch.utils._pytree.tree_leaves
    try:
        with torch.no_grad(), mode:
            full = model(*example_inputs, **no_cache(model))
            expected = [x for x in leaves(full) if isinstance(x, torch.Tensor)]
            values = example_inputs
            for k, stage in enumerate(stages):
                out = stage(*values)
                values = out if isinstance(out, tuple) and k < len(stages) - 1 else (out,)
    except Exception as e:  # the cut runs the user's modules and aten ops: many kinds
        raise CutError(f"the pipeline stages do not run in a chain ({describe(e)})") from e
    finally:
        model.train(training)
    got = [x for x in leaves(out) if isinstance(x, torch.Tensor)]
    same = len(got) == len(expected) and all(
        a.shape == b.shape if on_meta else torch.equal(a, b) for a, b in zip(got, expected)
    )
    if not same:
        raise CutError("the pipeline stages in a chain do not compute the model's forward (a bug)")


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


def pipeline_step(c: Constants, schedule, parts, batch, holds_last: bool, args):
    """One step: (the loss, mean over microbatches, where this rank holds the last stage, else
    0; the total gradient norm over every stage, before clipping to --max-grad-norm)."""
    inputs, target = batch
    losses = []
    with autocast(c, device_of(batch).type), dropout_off(args, [m for m, _ in parts]):
        schedule.step(*inputs, target=target, losses=losses, return_outputs=False)
    params = [p for module, _ in parts for p in module.parameters()]
    norm = grad_norm(c, params, args.max_grad_norm)
    for _, optimizer in parts:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if holds_last:
        return torch.stack([loss.detach().float() for loss in losses]).mean(), norm
    return torch.zeros((), device=device_of(batch)), norm


# ---- Verification ----------------------------------------------------------------------------
def tolerances(c: Constants, args: argparse.Namespace) -> tuple[float, float]:
    """(loss, parameter) tolerances: absolute, and relative to the values' magnitude.

    SGD in fp32 differs from the single-process run only by reduction order: 1e-5. AdamW
    divides by sqrt(v): on a coordinate whose gradient is ~0, 1e-8 of noise can flip the sign
    of its update, so a parameter may move up to lr the other way each step. Parameters then
    get 2 * lr * steps more; the loss, which those coordinates barely move, 1e-4. bf16 rounds
    every matmul to 8 bits of mantissa (2^-8 = 4e-3 relative), and the sharded run rounds
    other partial sums than the reference (a local batch, a TP slice), though both run the same
    precision regime (see Precision): 2e-2. Measured on examples/gpt.py, 3 AdamW steps with
    clipping: losses within 4e-4 and parameters within 3.2e-3 (fsdp=2 with the policy, dp=2
    with autocast, pp=2 x fsdp=2); SGD on fsdp=2: 2e-5 and 7e-7. The total gradient norms must agree to the
    loss tolerance, relative.
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


def verify(c: Constants, named_params, reference, history, args, mesh) -> bool:
    """Compare with the unsharded run; every rank decides the same (from all ranks' findings).

    ``named_params`` are the parameters this rank holds (with a pipeline: its stages'); each is
    compared whole (a DTensor gathered over its sub-mesh) with the reference's of that name.
    ``history``: "loss" and "grad_norm" -> (this run's values per step, the reference's); the
    gradient norms must agree to the loss tolerance, relative (named in the verdict only when
    losses and parameters agree: a wrong weight is the more useful name).
    """
    loss_tol, param_tol = tolerances(c, args)
    worst, worst_ratio = "", 0.0
    losses, ref_losses = history["loss"]
    max_loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    for step, (a, b) in enumerate(zip(losses, ref_losses), 1):
        ratio = abs(a - b) / (loss_tol * (1 + abs(b)))
        if ratio > worst_ratio:
            worst, worst_ratio = f"loss at step {step} diff={abs(a - b):.3e}", ratio
    norm_worst, norm_ratio = "", 0.0  # the same on every rank (all-reduced norms)
    for step, (a, b) in enumerate(zip(*history["grad_norm"]), 1):
        ratio = abs(a - b) / (loss_tol * max(abs(b), 1e-12))
        if ratio > norm_ratio:
            norm_worst, norm_ratio = f"grad_norm at step {step} {a:.6g} vs {b:.6g}", ratio
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
    if worst_ratio <= 1 < norm_ratio:
        worst, worst_ratio = norm_worst, norm_ratio
    ok = worst_ratio <= 1
    seen = getattr(args, "dropout_off", None)
    note = " (dropout off in both runs)" if seen is not None and seen.seen else ""
    if dist.get_rank() == 0:
        if ok:
            print(
                f"verify: ok max_loss_diff={max_loss_diff:.3e} max_param_diff={max_param_diff:.3e}"
                + note
            )
        else:
            print(
                f"verify: FAILED {worst} (tolerance: loss {loss_tol:.1e}, params {param_tol:.1e})"
                + note
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


def training_state(
    parts, step: int, device: torch.device, data=None, schedule=None
) -> tuple[dict, list]:
    """The state to save (or load into), and the keys of each (module, optimizer) part in it;
    ``schedule``: the LRSchedule (its steps done and base lr)."""
    rng = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    state = {"model": {}, "optimizer": {}, "step": torch.tensor(step), "rng": {}}
    state["rng"][f"rank{dist.get_rank()}"] = rng
    if data is not None:  # the data stream's position (see DataStream)
        state["data"] = data.state(step)
    if schedule is not None:
        state["lr_schedule"] = schedule.state_dict()
    keys = []
    for module, optimizer in parts:
        model_state, optimizer_state = get_state_dict(module, optimizer, options=STATE_OPTIONS)
        state["model"] |= model_state
        state["optimizer"] |= optimizer_state
        keys.append((list(model_state), list(optimizer_state)))
    return state, keys


def save_checkpoint(
    c: Constants, directory: Path, step: int, parts, device, data=None, schedule=None
) -> None:
    if not all_finite(parts):  # never publish weights a later run would resume from
        fail(
            f"step {step}: the parameters hold non-finite values (training diverged); not "
            "saved. Lower --lr; checkpoints already saved are kept"
        )
    start = time.perf_counter()
    tmp, final = directory / f".tmp-step_{step}", directory / f"step_{step}"
    stored = training_state(parts, step, device, data, schedule)[0]
    storage_form(stored)
    why = ""
    try:
        dcp.save(stored, checkpoint_id=tmp)
    except (Exception, dcp.CheckpointException) as e:  # a full disk, on any rank: every rank's
        why = _why(e)
    if not _agree(why) and dist.get_rank() == 0:
        try:
            with open(tmp / COMPLETE, "w") as f:
                json.dump({"step": step, "world_size": c.WORLD_SIZE, "mesh": c.MESH}, f)
                f.flush()
                os.fsync(f.fileno())
            if final.exists():
                keep_aside(final)
            os.rename(tmp, final)
            _fsync(directory)  # make the rename durable
        except OSError as e:
            why = _why(e)
    why = _agree(why)  # every rank stops alike, and none restarts on a disk that stays full
    if why:
        why = full_disk(why, directory, state_bytes(stored))
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # this save's own part-written files
        kept = complete_steps(directory)
        fail(
            f"step {step}: saving the checkpoint to {directory} failed ({why}); not restarted. "
            + (f"The earlier checkpoints (step_{kept[0]}, ...) are kept: " if kept else "")
            + "free space on that disk (or give another --checkpoint-dir), then run the same "
            "command again to resume"
        )
    if dist.get_rank() == 0:
        seconds = time.perf_counter() - start
        print(f"checkpoint: saved step {step} to {final} in {seconds:.2f} s", flush=True)


def keep_aside(path: Path) -> Path:
    """Rename the step_N folder a new save of step N would replace, never deleting it: one
    resume skipped as unreadable (``step_N.unreadable``), or one without its COMPLETE marker
    (``step_N.incomplete``: autopar renames a checkpoint into place only once it is complete,
    so that is a copy or another tool's). The new name is never taken for a checkpoint."""
    kind = "unreadable" if (path / COMPLETE).is_file() else "incomplete"
    aside, n = path.with_name(f"{path.name}.{kind}"), 1
    while aside.exists():
        aside, n = path.with_name(f"{path.name}.{kind}.{n}"), n + 1
    os.rename(path, aside)
    print(f"warning: checkpoint {path} ({kind}) is kept as {aside.name}", file=sys.stderr)
    return aside


def complete_steps(directory: Path) -> list[int]:
    """The N of every step_<N>/ holding COMPLETE in ``directory``, newest first; names are
    matched exactly (step_0007 is not step 7)."""
    steps = []
    for path in directory.glob("step_*"):
        number = path.name.removeprefix("step_")
        if number.isdigit() and path.name == f"step_{int(number)}" and (path / COMPLETE).is_file():
            steps.append(int(number))
    return sorted(steps, reverse=True)


def latest_complete_step(directory: Path) -> int:
    """The largest N of a step_<N>/ holding COMPLETE in ``directory`` (0: none)."""
    return max(complete_steps(directory), default=0)


def check_checkpoint_dir(directory: Path) -> None:
    """--checkpoint-dir before any collective: a directory (or a path one can be made at) this
    user owns, writable, not writable by others (trusted input: see check_trusted_dir), and no
    symlinked .tmp-step_N in it (the start tidies those up, and never follows a link)."""
    if directory.exists() and not directory.is_dir():
        fail(f"--checkpoint-dir {directory} is not a directory: give a directory path")
    existing = directory if directory.exists() else directory.parent
    while not existing.exists():
        existing = existing.parent
    if not os.access(existing, os.W_OK | os.X_OK):
        fail(f"--checkpoint-dir {directory} is not writable by this user: give a writable path")
    if directory.exists():
        why = trusted_dir_problem(directory)
        if why:
            fail(f"--checkpoint-dir {why}")
        links = [p.name for p in directory.glob(".tmp-step_*") if p.is_symlink()]
        if links:
            fail(
                f"--checkpoint-dir {directory} holds {links[0]}, a symlink where autopar keeps a "
                "save in progress (it would delete what the link points to): remove the link "
                f"({directory / links[0]}), or use another directory"
            )


# ---- Trusted input ---------------------------------------------------------------------------
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


def check_same_model(path: Path, state: dict, saved: dict) -> None:
    """Fail (every rank alike) when the checkpoint's model differs from this one: a parameter
    missing from it, one it has that the model lacks, or one of another shape."""
    mine = {}
    for key, t in state["model"].items():
        mine[f"model.{key}"] = tuple(t.shape)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    union = {k: v for d in everyone for k, v in d.items()}
    stored = {
        k: tuple(m.size) for k, m in saved.items() if k.startswith("model.") and hasattr(m, "size")
    }
    problems = [f"{k[6:]} is missing from it" for k in union if k not in stored]
    problems += [f"it has {k[6:]}, which this model lacks" for k in stored if k not in union]
    problems += [
        f"{k[6:]} has shape {list(stored[k])} there, {list(v)} here"
        for k, v in union.items()
        if k in stored and stored[k] != v
    ]
    if problems:
        message = (
            f"the checkpoint {path} is of another model: {problems[0]}"
            + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
            + "; use the checkpoint directory of this model, or another --checkpoint-dir"
        )
        fail(message)


def _why(error: BaseException) -> str:
    """One line of what went wrong reading a checkpoint: DCP's CheckpointException (a
    BaseException, raised on every rank alike) names the rank that failed and its error."""
    where = ""
    if isinstance(error, dcp.CheckpointException) and error.failures:
        rank, failure = next(iter(error.failures.items()))
        error = failure[0] if isinstance(failure, tuple) else failure
        where = f"rank {rank}: "
    text = str(error).splitlines()[0] if str(error) else ""
    text = text if len(text) <= 120 else text[:117] + "..."
    return f"{where}{type(error).__name__}" + (f": {text}" if text else "")


def state_bytes(state) -> int:
    """The bytes this rank writes of ``state`` (a nested dict; DTensors: the local shard)."""
    total = 0
    for t in pytree.tree_leaves(state):
        if isinstance(t, torch.Tensor):
            local = t.to_local() if isinstance(t, DTensor) else t
            total += local.numel() * local.element_size()
    return total


def full_disk(why: str, directory: Path, needed: int) -> str:
    """``why`` a write into ``directory`` failed, said plainly when its disk has less free
    space than this rank's ``needed`` bytes (torch.save reports a full disk as "unexpected pos",
    not ENOSPC)."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return why
    if free >= needed and "No space left" not in why:
        return why
    return f"the disk is full: {free / 2**20:.1f} MiB free, this save needs {needed / 2**20:.1f} MiB; {why}"


def _agree(why: str) -> str:
    """Every rank's verdict on one checkpoint: "" when it read back on all of them, else the
    first failure (the same answer on every rank, so all of them fall back together)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, why)
    return next((w for w in everyone if w), "")


def resume(directory: Path, parts, device: torch.device, data=None, schedule=None) -> int:
    """Take ``directory``'s lock, then load its newest complete checkpoint that reads back on
    every rank and return its step (0: the directory holds no complete checkpoint).

    A checkpoint that does not read back (a truncated or corrupt .metadata or shard, a folder
    holding only its COMPLETE marker), on any rank, is skipped by all ranks with one warning
    line, and the previous complete one is tried, and so on; it is left in place (see
    save_checkpoint). When none reads back, that is one error line: a run never starts from
    step 1 over a directory of checkpoints it silently ignored. ``schedule`` (the LRSchedule)
    continues from the saved one (a checkpoint without one: at its step)."""
    info = [None]
    if dist.get_rank() == 0:  # rank 0 locks, looks, and tidies up what a crashed save left
        refused = lock_checkpoint_dir(directory)
        if not refused:
            for tmp in directory.glob(".tmp-step_*"):  # a crashed save's (links: refused)
                if not tmp.is_symlink():
                    shutil.rmtree(tmp)
        info = [(refused, complete_steps(directory) if not refused else [])]
    dist.broadcast_object_list(info, src=0)  # all ranks load the same checkpoint
    refused, candidates = info[0]
    if refused:
        fail(refused)
    skipped = []
    for number in candidates:
        path = directory / f"step_{number}"
        saved, why = {}, ""
        try:
            saved = SafeReader(path).read_metadata().state_dict_metadata
        except (Exception, dcp.CheckpointException) as e:  # a missing or truncated .metadata
            why = _why(e)
        why = _agree(why)  # before check_same_model's collective: every rank takes one path
        if not why:
            use_data = data if "data.position" in saved else None
            use_schedule = schedule if "lr_schedule.done" in saved else None
            state, keys = training_state(parts, 0, device, use_data, use_schedule)
            check_same_model(path, state, saved)
            rng_key = f"rng.rank{dist.get_rank()}.cpu"
            if rng_key not in saved:  # saved by a plan with fewer ranks: keep this rank's RNG
                del state["rng"]
            # state holds the live parameters and optimizer state (get_state_dict's tensors):
            # a load that fails part-way leaves some of them overwritten, but the next
            # checkpoint's load, which must succeed on every rank to be used, overwrites every
            # one of them again (DCP refuses a checkpoint lacking any key); when none loads,
            # the run stops.
            try:
                pairs = storage_form(state)
                dcp.load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner())
                from_storage(pairs)
            except (Exception, dcp.CheckpointException) as e:  # a truncated or corrupt shard
                why = _why(e)
            why = _agree(why)
        if not why:
            break
        skipped.append(f"{path.name} ({why})")
        if dist.get_rank() == 0:
            print(
                f"warning: checkpoint {path} is unreadable ({why}); it is kept as it is, "
                "and the previous complete checkpoint is tried",
                file=sys.stderr,
                flush=True,
            )
    else:
        if skipped:
            fail(
                f"no checkpoint in --checkpoint-dir {directory} reads back ("
                + "; ".join(skipped)
                + "): restore a readable copy, or move them out of the directory (or give "
                "another --checkpoint-dir) to train from step 1; nothing was deleted"
            )
        return 0
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
    if "data" in state:
        data.restore(state["data"], step)
    if "lr_schedule" in state:
        schedule.load_state_dict(state["lr_schedule"])
    elif schedule is not None:
        schedule.load_state_dict({"done": step, "base": schedule.base})
    if dist.get_rank() == 0:
        print(f"checkpoint: resumed from step {step} ({path})", flush=True)
    return step


def all_finite(parts) -> bool:
    """Whether every parameter of every rank is finite (all ranks get the same answer)."""
    bad = torch.zeros((), dtype=torch.int64, device=collective_device())
    with torch.no_grad():  # summed on the device: one sync for the whole model, not one a tensor
        for module, _ in parts:
            for p in module.parameters():
                local = p.to_local() if isinstance(p, DTensor) else p
                bad += (~torch.isfinite(local)).any().to(bad.device)
    dist.all_reduce(bad)
    return bad.item() == 0


def check_finite(step: int, loss: float, ref_losses: list[float]) -> None:
    """Stop at the first non-finite loss (every rank holds the same all-reduced value), before
    anything is saved: one line, exit 2."""
    values = [("loss", loss)] + [("--verify reference's loss", v) for v in ref_losses[-1:]]
    for name, value in values:
        if not math.isfinite(value):
            fail(
                f"step {step}: the {name} is {value} (not finite): training diverged; lower --lr "
                "or fix the model/data. Checkpoints already saved are kept; none of this step is "
                "saved"
            )


def after_step(c: Constants, args, step: int, parts, device, data=None, schedule=None) -> None:
    """What follows a logged step: the checkpoint it is due (every --checkpoint-every steps and
    after the last), then the test hook."""
    every = args.checkpoint_every or args.steps
    if args.checkpoint_dir is not None and (step % every == 0 or step == args.steps):
        save_checkpoint(c, args.checkpoint_dir, step, parts, device, data, schedule)
    kill_for_test(step)


def kill_for_test(step: int) -> None:
    """A test hook (tests/test_checkpoint.py), inert unless AUTOPAR_TEST_KILL_AT_STEP is set:
    after that step (its log line and checkpoint out), rank AUTOPAR_TEST_KILL_RANK kills itself
    with SIGKILL, on torchrun's first attempt only (TORCHELASTIC_RESTART_COUNT=0), or, with
    AUTOPAR_TEST_KILL_MARKER (a path), only while that file does not exist (it is made first):
    on several nodes the torchruns' restart counts and the ranks' places can differ."""
    if os.environ.get("AUTOPAR_TEST_KILL_AT_STEP") != str(step):
        return
    marker = os.environ.get("AUTOPAR_TEST_KILL_MARKER")
    if marker is None and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if marker is not None and Path(marker).exists():
        return
    dist.barrier()  # rank 0 has printed the step
    if dist.get_rank() == int(os.environ.get("AUTOPAR_TEST_KILL_RANK", 0)):
        if marker is not None:
            Path(marker).touch()
        os.kill(os.getpid(), signal.SIGKILL)


# ---- Data and weights -----------------------------------------------------------------------------
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
#
# Order: the samples of epoch e are a permutation seeded by (data seed, e); the run reads them as
# one stream, GLOBAL_BATCH positions per step, and data-parallel rank r takes its contiguous share
# of each step's positions (TP and PP peers the same share). The position in that stream (samples
# consumed) and the data seed are saved in every checkpoint: a resumed run reads exactly the
# samples the uninterrupted one would have, even under another plan of another global batch.
# Evaluation (--eval-data, --eval-every K) reads the first EVAL_BATCHES global batches of the
# eval set in order, every K steps.
import numpy as np  # noqa: E402 (only this section reads numpy)

EVAL_BATCHES = 8
TOKEN_SUFFIXES = (".bin", ".npy")
TABLE_SUFFIXES = (".parquet", ".jsonl", ".arrow")
INT64_LIMIT = 2**63
SAVED = "write the dataset again with datasets' save_to_disk"


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


def _column_chunks(table, path: Path) -> list:
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


def _bad_ids(ids) -> str:
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


def _row_ids(ids, path: Path, number: int) -> np.ndarray:
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


def _inside(root: Path, name, listed_in: Path, what: str) -> Path:
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
    return TokenWindows(token_chunks(Path(path), split, vocab_size), seq_len, str(path))


def check_global_batch(dataset, source: str, global_batch: int) -> None:
    """Training and eval data hold at least one global batch of samples."""
    if len(dataset) < global_batch:
        windows = ""
        if isinstance(dataset, TokenWindows):
            windows = f" ({dataset.num_tokens} tokens, windows of {dataset.seq_len + 1})"
        raise InputError(
            f"{source} holds {len(dataset)} samples{windows}, fewer than one global batch of "
            f"{global_batch}: give more data, or plan a smaller --global-batch"
        )


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
    """Stack (inputs, target) samples: inputs a tensor, a tuple of them, or a dict (keyword
    inputs), each tensor possibly nested in lists, tuples and dicts (see call)."""
    inputs = [x if isinstance(x, tuple | list | dict) else (x,) for x, _ in items]
    stacked = torch.utils.data.default_collate(inputs)
    stacked = tuple(stacked) if isinstance(stacked, list) else stacked
    return stacked, torch.utils.data.default_collate([t for _, t in items])


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
# sharing the embedding) is loaded through whichever of its names the checkpoint has. A DCP
# source is trusted input (see Trusted input: this user's, read without running code); the
# checkpoint's dtypes must be floating where the model's are (an integer tensor is refused, a
# float of another precision is cast and said so).
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


def init_source(path) -> tuple[str, Path]:
    """("dcp" | "hf", directory) of an --init-from path. Safetensors (no code) are preferred
    where a directory holds both; a DCP source is trusted input, checked as --checkpoint-dir is
    (trusted_dir_problem), the directory given and the step read alike."""
    path = Path(path)
    if not path.is_dir():
        raise InputError(f"--init-from {path}: no such directory (a DCP or HF safetensors one)")
    if any(path.glob("*.safetensors")):
        return "hf", path
    source = path if (path / ".metadata").is_file() else None
    steps = [
        p
        for p in path.glob("step_*")
        if p.name[5:].isdigit() and (p / "COMPLETE").is_file() and (p / ".metadata").is_file()
    ]
    if source is None and steps:
        source = max(steps, key=lambda p: int(p.name[5:]))
    if source is None:
        raise InputError(
            f"--init-from {path} holds neither a DCP checkpoint (.metadata) nor *.safetensors files"
        )
    for directory in dict.fromkeys((path, source)):
        why = trusted_dir_problem(directory)
        if why:
            raise InputError(f"--init-from {why}")
    return "dcp", source


def _storage_reader(kind: str, path: Path):
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    return HuggingFaceStorageReader(str(path)) if kind == "hf" else SafeReader(str(path))


def saved_tensors(kind: str, path: Path) -> dict:
    """Name -> (shape, dtype) of every tensor in the checkpoint (headers only)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = _storage_reader(kind, path).read_metadata()
    except Exception as e:  # a damaged file: safetensors and pickle raise many kinds
        raise InputError(f"--init-from {path}: cannot read it ({type(e).__name__}: {e})") from None
    return {
        name: (tuple(md.size), md.properties.dtype)
        for name, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }


def saved_shapes(kind: str, path: Path) -> dict:
    """Name -> shape of every tensor in the checkpoint (headers only)."""
    return {name: shape for name, (shape, _) in saved_tensors(kind, path).items()}


def check_dtypes(model, mapping: dict, saved: dict, path) -> str:
    """The checkpoint's dtypes against the model's, for each tensor loaded by name (``mapping``
    from match_names, ``saved`` from saved_tensors): an integer or bool tensor into a floating
    one (or the reverse) is refused, since a cast would load ids or counts as weights; a float
    of another precision is cast, and the returned line says which (empty: none)."""
    state = model.state_dict()
    refused, cast = [], {}
    for name, source in mapping.items():
        if not isinstance(source, str) or source not in saved or name not in state:
            continue
        mine, theirs = state[name].dtype, saved[source][1]
        if mine == theirs:
            continue
        if (
            mine.is_floating_point != theirs.is_floating_point
            or mine.is_complex != theirs.is_complex
        ):
            refused.append(f"{source} ({str(theirs)[6:]}, the model's {str(mine)[6:]})")
        else:
            cast.setdefault(f"{str(theirs)[6:]} to {str(mine)[6:]}", []).append(source)
    if refused:
        raise InputError(
            f"--init-from {path} holds {_few(refused)}: an integer tensor is no weight of a "
            "floating one (nothing loaded): convert the checkpoint to the model's dtype"
        )
    return "; ".join(f"cast {len(v)} tensors from {k}" for k, v in sorted(cast.items()))


def tied_groups(model) -> list[list[str]]:
    """The model's state-dict names, grouped by the tensor they name (a tied weight: several)."""
    groups: dict = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return list(groups.values())


def _few(names) -> str:
    names = sorted(names)
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


# A HuggingFace model whose checkpoints come in an older layout (transformers 5 keeps Mixtral's
# and Qwen3-MoE's experts stacked, gate_up_proj [E, 2 I, H], while save_pretrained and the Hub
# write one tensor per expert, block_sparse_moe.experts.3.w1.weight) is read through
# transformers' own conversion rules for the model (get_model_conversion_mapping): renamings,
# and converters that stack one tensor per expert (MergeModulelist) and join several of them
# (Concatenate); a stacked tensor is built whole on each rank from its per-expert tensors
# (read with safetensors) and each rank keeps its shard. Other operations are not applied
# (their tensors stay unmatched: the usual error line).
@dataclasses.dataclass(frozen=True)
class Stacked:
    """A model tensor built from per-expert checkpoint tensors: ``sources[j][e]`` is expert
    e's tensor of the rule's j-th source; each list is stacked (dim ``stack``), then the
    stacks are concatenated (dim ``concat``; None: one source)."""

    sources: tuple
    stack: int
    concat: int | None

    def build(self, read) -> torch.Tensor:
        parts = [torch.stack([read(n) for n in names], self.stack) for names in self.sources]
        return parts[0] if self.concat is None else torch.cat(parts, self.concat)


def _conversion_rules(model) -> tuple[list, list]:
    """(renamings [(regex, replacement)], converters [(source regexes, target, stack,
    concat)]) of transformers' checkpoint conversion for ``model``; none for other models."""
    if not type(model).__module__.startswith("transformers."):
        return [], []
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping

        rules = get_model_conversion_mapping(model)
    except Exception:  # an older transformers, or a model it has no rules for
        return [], []
    renames, converters = [], []
    for rule in rules:
        sources = list(getattr(rule, "_original_source_patterns", rule.source_patterns))
        targets = list(getattr(rule, "_original_target_patterns", rule.target_patterns))
        if not hasattr(rule, "operations"):
            with contextlib.suppress(re.error):
                renames += [(re.compile(src), targets[0]) for src in sources if len(targets) == 1]
            continue
        # only stacking (and joining the stacks), never a Concatenate over shards or any
        # other operation
        ops = [(type(op).__name__, getattr(op, "dim", None)) for op in rule.operations]
        plain = all(getattr(op, "num_shards_attribute", None) is None for op in rule.operations)
        names = [name for name, _ in ops]
        stacks = names in (["MergeModulelist"], ["MergeModulelist", "Concatenate"])
        if not stacks or not plain or len(targets) != 1:
            continue
        regexes = [re.compile(re.escape(src).replace(r"\*", r"(\d+)") + "$") for src in sources]
        concat = ops[1][1] if len(ops) == 2 else None
        converters.append((regexes, targets[0], ops[0][1], concat))
    return renames, converters


def legacy_layout(model, saved: dict) -> tuple[dict, dict]:
    """(``saved`` in the model's layout: name -> shape, {such name: its checkpoint name, or
    the Stacked recipe}) under transformers' conversion rules (above)."""
    renames, converters = _conversion_rules(model)
    own = set(model.state_dict())
    layout, origin, groups = {}, {}, {}
    for key, shape in saved.items():
        name = key
        if name not in own:
            for regex, target in renames:
                name = regex.sub(target, name, count=1)
        for regexes, target, stack, concat in converters:
            hits = [(j, m) for j, rx in enumerate(regexes) if (m := rx.search(name))]
            if hits:
                j, m = hits[0]
                group = groups.setdefault(name[: m.start()] + target, (stack, concat, {}))
                group[2].setdefault(j, {})[int(m.group(1))] = (key, shape)
                break
        else:
            layout[name], origin[name] = shape, key
    for name, (stack, concat, by_source) in groups.items():
        sources = []
        for j in sorted(by_source):
            experts = by_source[j]
            if sorted(experts) != list(range(len(experts))):
                break  # a gap in the expert numbers: leave it unmatched
            sources.append([experts[e] for e in range(len(experts))])
        else:
            meta = [
                torch.stack([torch.empty(s, device="meta") for _, s in experts], stack)
                for experts in sources
            ]
            whole = meta[0] if concat is None else torch.cat(meta, concat)
            layout[name] = tuple(whole.shape)
            names = tuple(tuple(key for key, _ in experts) for experts in sources)
            origin[name] = Stacked(names, stack, concat)
    return layout, origin


def _read_safetensors(path: Path):
    """A reader of single tensors (by name) from a directory of *.safetensors files."""
    from safetensors import safe_open

    where = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            where.update(dict.fromkeys(f.keys(), file))

    def read(name: str) -> torch.Tensor:
        with safe_open(str(where[name]), "pt") as f:
            return f.get_tensor(name)

    return read


def match_names(model, saved: dict, path) -> dict:
    """Model name -> checkpoint name for every tensor of the unsharded ``model`` (meta is fine)
    in ``saved`` (name -> shape); InputError naming the first few missing, unexpected or
    wrong-shaped names. A --checkpoint-dir step holds the model under "model.". A tensor of
    a HuggingFace checkpoint in an older layout maps to its checkpoint name or a Stacked
    recipe (legacy_layout)."""
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    origin = {}
    if not set(shapes) <= set(saved) and "step" not in saved:
        layout, origin = legacy_layout(model, saved)
        if sum(k in layout for k in shapes) > sum(k in saved for k in shapes):
            saved = layout
        else:
            origin = {}
    if "step" in saved and any(k.startswith("model.") for k in saved):  # see training_state
        saved = {k[6:]: v for k, v in saved.items() if k.startswith("model.")}
        outer = "model."  # keys as training_state nests them
    else:
        outer = ""
    # A checkpoint of the base model (or of the model with a head, into the base) names tensors
    # without (with) the base model's attribute: HF's base_model_prefix ("model", "transformer").
    base = (getattr(model, "base_model_prefix", "") or "model") + "."
    candidates = [lambda k: k, lambda k: k.removeprefix(base), lambda k: base + k]
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
    # buffers the model does not save (older HF checkpoints hold attention masks) are no surprise
    transient = {
        rename(f"{name}.{buffer}".lstrip("."))
        for name, module in model.named_modules()
        for buffer in module._non_persistent_buffers_set
    }
    unexpected = set(saved) - transient - {m[len(outer) :] for m in mapping.values()}
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
    return {k: origin.get(v, v) for k, v in mapping.items()}


def load_weights(kind: str, path: Path, mapping: dict, modules) -> None:
    """Load the checkpoint into the (sharded) ``modules`` (this rank's: one, or its pipeline
    stages), each rank reading only its shards."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    states = [get_model_state_dict(m) for m in modules]
    plain = {k: v for k, v in mapping.items() if isinstance(v, str)}
    wanted = {plain[k]: v for state in states for k, v in state.items() if k in plain}
    if wanted:
        pairs = storage_form(wanted)
        dcp.load(wanted, storage_reader=_storage_reader(kind, path), planner=SafeLoadPlanner())
        from_storage(pairs)
    loaded = {k: wanted[plain[k]] for state in states for k in state if k in plain}
    read = _read_safetensors(path) if len(plain) < len(mapping) else None
    for state in states:  # tensors built from per-expert ones: whole, then this rank's shard
        for k, v in state.items():
            if k in mapping and k not in plain:
                full = mapping[k].build(read).to(v.device, v.dtype)
                if isinstance(v, DTensor):
                    full = distribute_tensor(full, v.device_mesh, v.placements, src_data_rank=None)
                loaded[k] = full
    for module, state in zip(modules, states):
        mine = {k: loaded[k] for k in state if k in loaded}
        set_model_state_dict(module, mine, options=StateDictOptions(strict=False))


def load_reference_weights(kind: str, path: Path, mapping: dict, model) -> None:
    """Load the whole checkpoint into the unsharded ``model`` (--verify's reference), in this
    process alone."""
    state = model.state_dict()
    plain = {k: v for k, v in mapping.items() if isinstance(v, str)}
    wanted = {plain[k]: v for k, v in state.items() if k in plain}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(
            wanted,
            storage_reader=_storage_reader(kind, path),
            planner=SafeLoadPlanner(),
            no_dist=True,
        )
    loaded = {k: wanted[plain[k]] for k in state if k in plain}
    read = _read_safetensors(path) if len(plain) < len(mapping) else None
    for k in state:
        if k in mapping and k not in plain:
            loaded[k] = mapping[k].build(read).to(state[k].device, state[k].dtype)
    model.load_state_dict(loaded, strict=False)


def check_save_hf(directory, **others) -> None:
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


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _written_by_save_hf(directory: Path) -> list[str]:
    """The files an earlier --save-hf listed in its marker (an older marker lists none)."""
    try:
        files = json.loads((directory / SAVE_HF_MARKER).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return []
    return (
        [f for f in files if isinstance(f, str) and "/" not in f] if isinstance(files, list) else []
    )


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
    for name in sorted(old - set(new)):
        (directory / name).unlink(missing_ok=True)
    _fsync(directory)
    tmp.rmdir()


def save_hf(directory, modules, config=None, checkpoint_dir=None, steps=None) -> None:
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
    saved = {}
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
            install_save_hf(tmp, directory)
        except OSError as e:
            why = _why(e)
    why = _agree(why)
    if why:
        why = full_disk(why, tmp.parent, state_bytes(state))
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # this save's own files, nothing else
        where = f"{directory} is as it was" if directory.exists() else f"{directory} was not made"
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


def hf_file_index(sizes, limit: int = SAVE_HF_FILE_BYTES) -> dict:
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
    return tensor_map(lambda x: x.to(device, non_blocking=True), batch)


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
        if c.HF_TASK in ("masked-lm", "seq2seq-lm") and (args.data or args.eval_data):
            raise InputError(
                "--data gives next-token windows (a causal LM's inputs and targets); this plan "
                f"trains a {c.HF_TASK.split('-')[0]} LM: plan a causal LM, or train it on "
                "synthetic batches"
            )
        if args.save_hf is not None:
            check_save_hf(
                args.save_hf, **{"checkpoint-dir": args.checkpoint_dir, "init-from": args.init_from}
            )
        if args.init_from is not None:
            kind, path = init_source(args.init_from)
            saved = saved_tensors(kind, path)
            shapes = {name: shape for name, (shape, _) in saved.items()}
            mapping = match_names(model, shapes, path)
            init = kind, path, mapping, check_dtypes(model, mapping, saved, path)
        vocab = vocab_size(c, model)
        own = hasattr(model_file, "make_dataset")
        data = None
        if args.data is not None or own:
            dataset = open_dataset(args.data, c.SEQ_LEN, vocab, "train", model_file)
            source = "make_dataset('train')" if args.data is None else f"--data {args.data}"
            check_global_batch(dataset, source, c.GLOBAL_BATCH)
            eval_dataset = None
            if args.eval_data is not None:
                eval_dataset = open_dataset(args.eval_data, c.SEQ_LEN, vocab, "eval", model_file)
                check_global_batch(eval_dataset, f"--eval-data {args.eval_data}", c.GLOBAL_BATCH)
            data = DataStream(c, dataset, args.seed, args.data_workers, eval_dataset)
        elif args.eval_data is not None:
            raise InputError("--eval-data needs --data (training on synthetic batches)")
    except InputError as e:
        fail(str(e))
    if data is None and rank0:
        print("data: no --data given, training on synthetic batches", file=sys.stderr, flush=True)
    return data, init


def load_init(init, modules, reference=None) -> None:
    """--init-from into this rank's (sharded) modules, and into --verify's reference."""
    if init is None:
        return
    kind, path, mapping, cast = init
    load_weights(kind, path, mapping, modules)
    if reference is not None:
        load_reference_weights(kind, path, mapping, reference)
    if dist.get_rank() == 0:
        note = f"; {cast}" if cast else ""
        print(f"init: loaded {len(mapping)} tensors from {path} ({kind}){note}", flush=True)


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
    losses = [mean_loss(c, forward_loss(b)) for b in data.eval_batches(device, dp_rank)]
    if dist.get_rank() == 0:
        print(json.dumps({"step": step, "eval_loss": sum(losses) / len(losses)}), flush=True)


def eval_loss_fn(c, model, loss_fn):
    """This rank's forward-only loss of a batch (--eval-data), the model in eval mode."""

    def run(batch):
        inputs, target = batch
        model.eval()
        cp = getattr(model, "autopar_cp", None)
        with torch.no_grad(), autocast(c, device_of(batch).type), cp_active(cp):
            loss = loss_fn(call(model, inputs), cp_shard(cp, target))
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
        with torch.no_grad(), autocast(c, device_of(batch).type):
            schedule.eval(*inputs, target=target, losses=losses)
        for m in modules:
            m.train()
        if holds_last:
            return torch.stack([loss.detach().float() for loss in losses]).mean()
        return torch.zeros((), device=device_of(batch))

    return run
