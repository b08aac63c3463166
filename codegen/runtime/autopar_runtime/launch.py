"""The launch, in the order ``train.py`` runs it: the flags (``parse_args``), every check before any
collective (``check_launch``, ``check_flags``, ``check_compile``, ``check_fqns``,
``check_pipeline``, ``open_inputs``), the device and the mesh (``local_device``, ``build_mesh``,
with the ranks' agreement on what they run), the rendezvous report ``launch.sh`` prints, and the
end of the run (``finish``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import math
import os
import runpy
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .batch import DataStream
from .checkpoint import check_checkpoint_dir
from .common import (
    Constants,
    InputError,
    ModelFile,
    _launch_key,
    _wait_for_readers,
    dist_timeout,
    fail,
    has_submodule,
    launch_store,
    say,
    several_nodes,
)
from .data import add_data_args, check_global_batch, open_dataset
from .data_parallel import uses_fsdp
from .expert_parallel import check_experts, expert_report
from .export import check_save_hf
from .parallelize import compile_backend
from .profiling import add_profile_args, check_profile_flags
from .tensor_parallel import dtensor_blocks
from .trust import release_lock
from .weights import check_dtypes, init_source, match_names, saved_tensors

__all__ = [
    "Flags",
    "parse_args",
    "take_elastic_plan",
    "check_launch",
    "check_flags",
    "check_compile",
    "tie_to_launcher",
    "local_device",
    "release_freed_host_memory",
    "check_fqns",
    "check_pipeline",
    "vocab_size",
    "open_inputs",
    "launch_digest",
    "agree_on_launch",
    "build_mesh",
    "finish",
]


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
    add_profile_args(p)
    if c.MESH["pp"] > 1:
        p.add_argument("--show-stages", action="store_true", help="print the stages' code and exit")
    return p.parse_args(argv)


def take_elastic_plan(c: Constants, script: str) -> None:
    """An elastic run (ELASTIC_PLANS, started by torchrun's elastic agent with --nnodes
    MIN:MAX): the node count the agent found (GROUP_WORLD_SIZE) picks the program. This plan's
    own count: return, and ``script`` goes on. Another count that was planned: its program
    (a path relative to ``script``'s folder) runs in this process, which ends with it. A
    count that was not planned: one line, exit 2."""
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", 1))
    if nodes == max(1, c.WORLD_SIZE // c.RANKS_PER_NODE):
        return
    counts = sorted(int(k) for k in c.ELASTIC_PLANS)
    if str(nodes) not in c.ELASTIC_PLANS:
        fail(
            f"this run has {nodes} node(s), and the plans emitted with {Path(script).name} are "
            f"for {counts[0]} to {counts[-1]} nodes of {c.RANKS_PER_NODE} ranks: start it on "
            f"{counts[0]} to {counts[-1]} nodes (launch.sh), or plan again with --elastic "
            f"{min(nodes, counts[0])}:{max(nodes, counts[-1])}"
        )
    target = Path(script).resolve().parent / c.ELASTIC_PLANS[str(nodes)]
    if not target.is_file():
        fail(
            f"this run has {nodes} node(s), and the program planned for them, {target}, is "
            "not there: start train.py (launch.sh) in the folder autopar wrote, or emit the "
            "plans again (plan ... --elastic MIN:MAX --out DIR)"
        )
    sys.argv[0] = str(target)
    runpy.run_path(str(target), run_name="__main__")
    sys.exit(0)


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
    check_profile_flags(args)  # --profile-steps, --profile-out


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


def local_device(c: Constants) -> torch.device:
    """One GPU per rank (LOCAL_RANK) with nccl, the CPU with gloo."""
    if c.BACKEND == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        return device
    if uses_fsdp(c):  # only FSDP2 frees large blocks each unit; elsewhere a fixed threshold
        release_freed_host_memory()  # costs fresh zeroed pages every step (DDP: +12% CPU)
    return torch.device("cpu")


def release_freed_host_memory() -> None:
    """Make glibc hand large freed blocks back to the OS: on CPU, FSDP's unsharded parameters
    and gradients are freed after each unit, but glibc's adaptive mmap threshold rises to the
    size of such a block once one is freed and keeps the later ones in the heap, so a rank's RSS
    grows towards the whole model. A fixed threshold (mallopt M_MMAP_THRESHOLD) of 4 MiB: every
    block above it is fresh zeroed pages at each allocation, so it must sit above the blocks
    that are only activations. Measured on tests/test_meta_init.py's 2 GB GPT (fsdp=4, blocks of
    4 and 16 MiB weights), peak RSS per rank: 1.60 GB at 1 MiB, 1.61 GB at 4 MiB, 2.9-3.2 GB at
    32 MiB or glibc's default; at 1 MiB every 1 MiB activation of benchmarks/overhead.py's fsdp
    case paid fresh pages each step (about 5% of its CPU time)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 4 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


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


def vocab_size(c: Constants, model: nn.Module) -> int | None:
    """The model's vocabulary (token ids must be below it), where it has one."""
    if c.HF_CONFIG is not None and "vocab_size" in c.HF_CONFIG:
        return c.HF_CONFIG["vocab_size"]
    emb = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    return emb.num_embeddings if emb is not None else None


def open_inputs(
    c: Constants, args: argparse.Namespace, model_file: ModelFile, model: nn.Module
) -> tuple[DataStream | None, tuple | None]:
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


def launch_digest() -> str:
    """What every rank must run alike: the emitted train.py (the plan) and every module of this
    package (each file's name and bytes)."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
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
                    f"autopar_runtime/ differ: digest {text} vs {digest}): start every node "
                    "with the same emitted files (the same plan)",
                    tell_others=False,
                )
        if pending and time.monotonic() > deadline:
            fail(
                f"ranks {sorted(pending)} did not start within {dist_timeout()}", tell_others=False
            )
        if pending:
            time.sleep(0.05)


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
    shape, names = tuple(c.MESH.values()), tuple(c.MESH)
    if c.PIPELINE_BLOCKS is not None:  # pipeline rank r on block PIPELINE_BLOCKS[r] (mixed)
        ranks = torch.arange(dist.get_world_size()).reshape(shape)[c.PIPELINE_BLOCKS]
        mesh = DeviceMesh(device.type, ranks, mesh_dim_names=names)
        held = ", ".join(f"{r}: {b.flatten().tolist()}" for r, b in enumerate(ranks))
        say(f"pipeline: the groups in the planned order, pipeline rank -> ranks {{{held}}}")
    else:
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    if device.type == "cuda" and c.MESH["tp"] > 1:
        # DTensor's RNG tracker (random ops on DTensors: each shard draws its own part of one
        # mask), created here without its default broadcast of rank 0's state to every rank,
        # which would give all data-parallel ranks one mask; step_seed seeds each step.
        from torch.distributed.tensor import _random

        _random.manual_seed(0, mesh["tp"])
    return mesh


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
