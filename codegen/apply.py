"""``plan.apply(model)``: parallelize a model in this process, through the emitted script's code.

The plan's ``train.py`` (``codegen.emit``) is executed as a module, never as ``__main__``, so its
training loop does not run; this module then calls its ``build_mesh`` and ``parallelize``
(``apply_tp`` -> ``apply_checkpointing`` -> ``apply_data_parallel``) on the caller's model. One
source for both: the emitted script stays standalone (torch and the model file only), and a user
who keeps their own training loop gets exactly the sharding the script would apply.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import types

import torch
import torch.distributed as dist
from autopar.codegen.emit import emit
from autopar.planner.plan import Plan
from torch import nn

__all__ = ["apply", "local_batch", "script_module"]


def apply(plan: Plan, model: nn.Module) -> nn.Module:
    """Parallelize ``model`` (real weights, any device) for ``plan`` on this rank; returns the
    module to train. Initializes the process group (as the script does) unless the caller did.
    """
    if plan.mesh.pp > 1:
        raise ValueError(
            f"plan.apply handles plans without pipeline parallelism; this one has pp="
            f"{plan.mesh.pp}: run the emitted train.py (plan.emit(dir)), whose build_pipeline "
            "cuts the stages and drives the schedule"
        )
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    if world != plan.world_size:
        raise ValueError(
            f"this plan needs {plan.world_size} ranks, this process runs with {world}: launch "
            f"your script with `torchrun --nproc-per-node {plan.world_size} ...`"
        )
    if any(p.is_meta for p in model.parameters()):
        raise ValueError(
            "plan.apply needs a model with real weights (it is on meta): build it on a real "
            "device, e.g. without `with torch.device('meta')`"
        )
    script = script_module(plan)
    device = script.local_device()
    if dist.is_initialized():
        mesh = torch.distributed.device_mesh.init_device_mesh(
            device.type, tuple(script.MESH.values()), mesh_dim_names=tuple(script.MESH)
        )
    else:
        mesh = script.build_mesh(device)
    return script.parallelize(model.to(device), mesh)


def local_batch(plan: Plan, batch):
    """This rank's share of the global ``(inputs, target)`` batch: the script's ``local_slice``
    with its data-parallel rank (mesh order pp, dp, fsdp, tp: TP peers share a slice)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    dp_rank = (rank // plan.mesh.tp) % plan.mesh.data_parallel
    return script_module(plan).local_slice(batch, dp_rank)


def script_module(plan: Plan) -> types.ModuleType:
    """The plan's emitted ``train.py``, executed as a module (cached per plan)."""
    return _module(plan.to_json())


@functools.lru_cache(maxsize=8)
def _module(plan_json: str) -> types.ModuleType:
    plan = Plan.from_json(plan_json)
    source = emit(plan)["train.py"]
    name = "autopar_train_" + hashlib.sha256(plan_json.encode()).hexdigest()[:12]
    module = types.ModuleType(name)
    module.__file__ = f"<{name}: train.py for {plan.mesh.short()}>"
    sys.modules[name] = module  # fx and pickling look modules up by name
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module
