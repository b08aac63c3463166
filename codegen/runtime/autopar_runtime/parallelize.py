"""The plan applied to a model in torchtitan's order: activation checkpointing, torch.compile of
each layer (--compile), and ``parallelize`` (tensor parallel, checkpointing, compile, FSDP2 or
DDP), which ``Plan.apply`` calls.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh

from .common import Constants, has_submodule
from .data_parallel import apply_data_parallel, apply_ddp
from .tensor_parallel import apply_tp

__all__ = ["apply_checkpointing", "compile_backend", "apply_compile", "parallelize"]


def apply_checkpointing(c: Constants, model: nn.Module) -> None:
    """Wrap each CHECKPOINT layer so its activations are recomputed in backward."""
    for fqn in c.CHECKPOINT:
        if has_submodule(model, fqn):  # else held by another pipeline stage
            parent_fqn, _, name = fqn.rpartition(".")
            parent = model.get_submodule(parent_fqn)
            setattr(parent, name, checkpoint_wrapper(getattr(parent, name)))


def compile_backend() -> str:
    """torch.compile's backend for --compile (apply_compile), whose needs check_compile checks:
    inductor."""
    return "inductor"


def apply_compile(c: Constants, model: nn.Module) -> None:
    """--compile: each planned layer (LAYERS) becomes torch.compile(layer) in its place, after
    checkpointing and before FSDP (torchtitan's order): a compiled layer holds its forward and
    its recomputation, while FSDP2's gathers and reduce-scatters run around it, uncompiled.
    Inductor (compile_backend) needs a C++ compiler on CPU (checked by check_compile)."""
    backend = compile_backend()
    tp = bool(c.TP_PLAN)
    for fqn in c.LAYERS:
        if fqn and has_submodule(model, fqn):  # else held by another pipeline stage
            layer = model.get_submodule(fqn)
            if tp and fqn in c.CHECKPOINT:
                # torch 2.13 fails to compile a checkpointed region that holds DTensors
                # (AOTAutograd: "expected all tensors_saved_with_vc_check to be Tensors"): the
                # layer inside the checkpoint is compiled, the checkpoint runs around it.
                fqn, layer = f"{fqn}._checkpoint_wrapped_module", layer._checkpoint_wrapped_module
            model.set_submodule(fqn, torch.compile(layer, backend=backend))


def parallelize(
    c: Constants, model: nn.Module, mesh: DeviceMesh, compile: bool = False
) -> nn.Module:
    """What train.py's parallelize does, for Plan.apply: TP, checkpointing, (compile,) data
    parallel."""
    if c.TP_PLAN:  # empty without tensor parallelism
        apply_tp(c, model, mesh["tp"])
    apply_checkpointing(c, model)
    if compile:
        apply_compile(c, model)
    return apply_ddp(c, apply_data_parallel(c, model, mesh), mesh)
