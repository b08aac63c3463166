"""The pipeline schedule: which stages a rank holds, the schedule over them, a step and an
evaluation through it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .batch import device_of
from .common import Constants, Part
from .data_parallel import autocast
from .dropout import dropout_off
from .loop import finish_step
from .profiling import phase

if (
    TYPE_CHECKING
):  # torch.distributed.pipelining loads torch._dynamo: imported where a pipeline runs
    from torch.distributed.pipelining.schedules import _PipelineSchedule

__all__ = ["stage_ids_of", "build_schedule", "pipeline_step", "pipeline_eval_loss_fn"]


def stage_ids_of(c: Constants, pp_rank: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` runs (RANK_STAGES: placed as the schedule places
    them, looped or V-shaped)."""
    return list(c.RANK_STAGES[pp_rank])


def build_schedule(
    c: Constants,
    local: dict[int, nn.Module],
    mesh: DeviceMesh,
    device: torch.device,
    loss_fn: Callable[[Any, Any], torch.Tensor],
) -> _PipelineSchedule:
    """The schedule that runs this rank's (parallelized) stages ``{stage id: module}``: an
    instance of SCHEDULE_CLASS; the loss is computed on the last stage, once per microbatch."""
    from torch.distributed.pipelining import schedules

    schedule_class = getattr(schedules, c.SCHEDULE_CLASS)
    group = mesh["pp"].get_group()
    n = len(c.STAGES)
    stages = [_stage_class()(m, j, n, device, group=group) for j, m in local.items()]
    # scale_grads (the default): gradients are divided by the number of microbatches, so with a
    # mean loss they are the full batch's, as without a pipeline.
    if issubclass(schedule_class, schedules.PipelineScheduleSingle):  # one stage per rank
        return schedule_class(stages[0], c.MICROBATCHES, loss_fn=loss_fn)
    return schedule_class(stages, c.MICROBATCHES, loss_fn=loss_fn)


def _stage_class() -> type:
    """torch's PipelineStage, whose first forward (metadata inference: shapes and dtypes, before
    any p2p of values) runs a stage after the first on tensors made from the metadata its
    predecessor sent, zero-filled rather than torch.empty's leftover bytes. A model input that a
    later stage reads (a dual tower's token ids, a decoder's input ids) crosses the stages as an
    integer tensor: uninitialized, its entries index out of an embedding; 0 is an index every
    embedding holds. The real microbatches cross by p2p with their values."""
    from torch.distributed.pipelining import PipelineStage

    class ZeroFilledStage(PipelineStage):
        def _to_tensor(self, arg):  # torch 2.13: a real tensor or a TensorMeta -> a tensor
            t = super()._to_tensor(arg)
            if not isinstance(arg, torch.Tensor):
                with torch.no_grad():
                    t.zero_()
            return t

    return ZeroFilledStage


def pipeline_step(
    c: Constants,
    schedule: _PipelineSchedule,
    parts: list[Part],
    batch: tuple,
    holds_last: bool,
    args: argparse.Namespace,
    logged: bool = False,
) -> tuple[float, float, int | None]:
    """One step, as train_step: (the loss, mean over microbatches and over the last stage's
    data-parallel ranks; the total gradient norm over every stage, before clipping to
    --max-grad-norm; on a ``logged`` step the largest peak memory over ranks, else None)."""
    inputs, target = batch
    losses = []
    with autocast(c, device_of(batch).type), dropout_off(args, [m for m, _ in parts]):
        with phase(args, "pipeline"):  # --profile-steps: the schedule outside the layers
            schedule.step(*inputs, target=target, losses=losses, return_outputs=False)
    params = [p for module, _ in parts for p in module.parameters()]
    if holds_last:
        loss = torch.stack([loss.detach().float() for loss in losses]).mean()
    else:
        loss = torch.zeros((), device=device_of(batch))
    return finish_step(c, params, loss, [optimizer for _, optimizer in parts], args, logged)


def pipeline_eval_loss_fn(
    c: Constants, schedule: _PipelineSchedule, modules: list[nn.Module], holds_last: bool
) -> Callable[[tuple], torch.Tensor]:
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
