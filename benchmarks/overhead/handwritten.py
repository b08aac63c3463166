"""The minimal hand-written training script that benchmarks/overhead.py times the emitted
``train.py`` against: the same plan written as torchtitan writes it, and nothing else.

    torchrun --standalone --nproc-per-node 2 benchmarks/overhead/handwritten.py \
        --case {ddp,fsdp,tp} --plan OUT/plan.json --model-file examples/gpt.py --steps 30 \
        --global-batch 8 --seq-len 128 --lr 0.001

``ddp``: DDP over the 2 ranks; ``fsdp``: FSDP2, ``fully_shard`` on each of the plan's layers
(its LAYERS) and then on the root; ``tp``: ``parallelize_module`` with the plan's TP styles in
their stock torch form (STOCK_STYLES) and its MODULE_ATTRS (local head counts). Built whole on each rank
from one seed, AdamW at ``--lr``, each step's global batch drawn from a seed of its own by the
model file's make_batch, each data-parallel rank training on its rows, cross-entropy loss.

Each step: forward, backward, optimizer step, zero_grad, and the loss logged (``.item()``, as a
training script must): rank 0 prints ``{"step", "loss", "step_time_s", "t", "cpu"}`` per step, where
step_time_s is forward to zero_grad, ``t`` the ``time.perf_counter()`` at the log line and ``cpu``
rank 0's ``time.process_time()`` there (the benchmark takes their step-to-step intervals, or
with turns between the two programs, turns.py, the intervals from ``t0``/``cpu0``, when this
program got its turn back, to the next line).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel as DDP


def load_model_file(path: str):
    spec = importlib.util.spec_from_file_location("model_file", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# autopar's TP style names (its runtime's TP_STYLES) that are stock torch styles, as torch spells
# them; the plan's TP_PLAN is applied through this table (a plan using another style is refused).
STOCK_STYLES = {
    "colwise": ColwiseParallel(),
    "rowwise": RowwiseParallel(),
    "colwise_gather": ColwiseParallel(output_layouts=Replicate()),
    "rowwise_from_replicate": RowwiseParallel(input_layouts=Replicate()),
    "colwise_from_seq": ColwiseParallel(input_layouts=Shard(1)),
    "rowwise_to_seq": RowwiseParallel(output_layouts=Shard(1)),
    "colwise_from_seq_gather": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    "sequence_parallel": SequenceParallel(),
    "sequence_parallel_local": SequenceParallel(use_local_output=True),
}


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: dict) -> None:
    """Megatron-style TP as the plan styles it (``plan``: plan.json's tensor_parallel and
    module_attrs), in stock torch styles, as torchtitan's parallelize_llama writes it."""
    for fqn, attrs in plan["module_attrs"].items():  # e.g. each attention's local head count
        for name, value in attrs.items():
            setattr(model.get_submodule(fqn), name, value)
    styles = {fqn: STOCK_STYLES[style] for fqn, style in plan["tensor_parallel"].items()}
    parallelize_module(model, tp_mesh, styles)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", choices=["ddp", "fsdp", "tp"], required=True)
    p.add_argument("--model-file", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plan", required=True, help="plan.json: its layers (FSDP2 units) and TP")
    args = p.parse_args()
    import turns  # benchmarks/overhead/turns.py, beside this script: a no-op outside the benchmark

    plan = json.loads(Path(args.plan).read_text())
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model_file = load_model_file(args.model_file)
    torch.manual_seed(args.seed)
    model = model_file.build_model()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(args.case,))
    if args.case == "ddp":
        model = DDP(model)
    elif args.case == "fsdp":
        for fqn in plan["layers"]:
            fully_shard(model.get_submodule(fqn), mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        apply_tp(model, mesh, plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    dp_size, dp_rank = (1, 0) if args.case == "tp" else (world, rank)
    rows = args.global_batch // dp_size
    resumed = {}  # when this rank got its turn back after the last step (turns.py)

    for step in range(1, args.steps + 1):
        # the emitted program's batch of this step: make_batch drawn from a seed of its own
        # (torch.manual_seed would also queue a seed for each device type not started, CUDA's
        # and MTIA's, at 0.5 ms a call: the CPU generator is the one make_batch draws from)
        torch.default_generator.manual_seed(args.seed + 1000 + step)
        (idx,), target = model_file.make_batch(args.global_batch, args.seq_len)
        idx, target = idx[dp_rank * rows : (dp_rank + 1) * rows], target[dp_rank * rows :][:rows]
        start = time.perf_counter()
        logits = model(idx)
        loss = F.cross_entropy(logits.flatten(0, -2), target.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_time_s = time.perf_counter() - start
        loss_value = loss.item()
        if rank == 0:
            record = {"step": step, "loss": loss_value, "step_time_s": step_time_s}
            stamp = {"t": time.perf_counter(), "cpu": time.process_time(), **resumed}
            print(json.dumps({**record, **stamp}), flush=True)
        turns.wait(step)  # benchmarks/overhead.py --interleave: the other program's step
        resumed = {"t0": time.perf_counter(), "cpu0": time.process_time()}
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
