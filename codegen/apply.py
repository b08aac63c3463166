"""``plan.apply(model)``: parallelize a model in this process, with the emitted program's runtime.

The plan's emitted ``train.py`` imports the ``autopar_runtime`` package (``codegen/runtime``,
emitted verbatim beside it) and calls its ``apply_tp`` -> ``apply_checkpointing`` ->
``apply_data_parallel`` with the plan's constants. This module imports the same package and calls
the same functions (``parallelize``) on the caller's model, with the same constants
(``emit.constants``): a user who keeps their own training loop gets exactly the sharding the
script would apply, and no generated text is executed.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from autopar.codegen.emit import constants, runtime
from autopar.planner.plan import Plan
from torch import nn

from autopar.errors import UserError

__all__ = ["ApplyError", "apply", "local_batch", "runtime"]


class ApplyError(UserError):
    """``plan.apply`` asked of a plan it does not handle, or outside the world the plan needs
    (e.g. in a notebook, not under torchrun): one line with the fix."""


def apply(plan: Plan, model: nn.Module) -> nn.Module:
    """Parallelize ``model`` (real weights, any device) for ``plan`` on this rank; returns the
    module to train. Initializes the process group (as the script does) unless the caller did.
    """
    if plan.mesh.pp > 1:
        raise ApplyError(
            f"plan.apply handles plans without pipeline parallelism; this one has pp="
            f"{plan.mesh.pp}: run the emitted train.py (plan.emit(dir)), which cuts the stages "
            "and drives the schedule"
        )
    if plan.mesh.cp > 1:
        raise ApplyError(
            f"plan.apply handles plans without context parallelism; this one has cp="
            f"{plan.mesh.cp}: run the emitted train.py (plan.emit(dir)), which splits each "
            "sample's sequence and its targets over the cp ranks"
        )
    if plan.mesh.ep > 1:
        raise ApplyError(
            f"plan.apply handles plans without expert parallelism; this one has ep="
            f"{plan.mesh.ep}: run the emitted train.py (plan.emit(dir)), which splits the "
            "experts over the ep ranks and dispatches tokens to them"
        )
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    if world != plan.world_size:
        raise ApplyError(
            f"this plan needs {plan.world_size} ranks, this process runs with {world}: launch "
            f"your script with `torchrun --nproc-per-node {plan.world_size} ...`"
        )
    if any(p.is_meta for p in model.parameters()):
        raise ApplyError(
            "plan.apply needs a model with real weights (it is on meta): build it on a real "
            "device, e.g. without `with torch.device('meta')`"
        )
    rt = runtime()
    c = _constants(plan)
    device = rt.local_device(c)
    if dist.is_initialized():
        mesh = torch.distributed.device_mesh.init_device_mesh(
            device.type, tuple(c.MESH.values()), mesh_dim_names=tuple(c.MESH)
        )
    else:
        mesh = rt.build_mesh(c, device)
    return rt.parallelize(c, model.to(device), mesh)


def local_batch(plan: Plan, batch):
    """This rank's share of the global ``(inputs, target)`` batch: the runtime's ``local_slice``
    with its data-parallel rank (mesh order pp, dp, fsdp, tp: TP peers share a slice)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    dp_rank = (rank // plan.mesh.tp) % plan.mesh.data_parallel
    return runtime().local_slice(_constants(plan), batch, dp_rank)


def _constants(plan: Plan):
    return runtime().Constants(**constants(plan))
