"""Which loss tensors a torch.distributed.pipelining schedule keeps, run under torchrun with 2
ranks (tests/test_peak.py): stepped with ``return_outputs=False`` as the emitted program does,
rank 1 (the last stage) prints per microbatch how many earlier microbatches' outputs and loss
tensors (what cross-entropy saves for backward) are still alive."""

from __future__ import annotations

import gc
import sys
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, schedules

VOCAB, WIDTH, MICROBATCHES = 512, 16, 4


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    first = nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH))
    last = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, VOCAB))
    stage = PipelineStage(first if rank == 0 else last, rank, 2, torch.device("cpu"))
    outputs: list = []
    saved: list = []

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        gc.collect()
        alive = sum(w() is not None for w in outputs), sum(w() is not None for w in saved)
        print(f"held {alive[0]} {alive[1]}", flush=True)
        outputs.append(weakref.ref(out))

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.numel() >= out.numel():
                saved.append(weakref.ref(t))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return F.cross_entropy(out.flatten(0, 1), target.flatten())

    schedule = getattr(schedules, sys.argv[1])(stage, MICROBATCHES, loss_fn=loss_fn)
    x = torch.randint(0, VOCAB, (MICROBATCHES, 8))
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=torch.randint(0, VOCAB, x.shape), losses=[], return_outputs=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
