"""The model: loaded from the user's file (or an HF config), built on meta, and materialized shard
by shard with the single-process model's initial weights.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .common import Constants, ModelFile
from .hf_model import hf_model_parts
from .verify import unwrapped_name

__all__ = [
    "load_model_file",
    "hf_model_file",
    "build_on_meta",
    "copy_full",
    "tied_parameters",
    "retie",
    "materialize",
]


def load_model_file(c: Constants) -> ModelFile:
    """The user's model file as a module (a HuggingFace model: one built here, see hf_model_file)."""
    if c.HF_CONFIG is not None:
        return hf_model_file(c)
    spec = importlib.util.spec_from_file_location(Path(c.MODEL_FILE).stem, c.MODEL_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def hf_model_file(c: Constants) -> types.SimpleNamespace:
    """The HuggingFace model of HF_CONFIG as a model file (hf_model.hf_model_parts: FACTORY
    builds it, make_batch and loss_fn as HF_TASK trains it)."""
    return hf_model_parts(c.HF_CONFIG, c.HF_TASK, c.FACTORY, c.MASK_FRACTION)


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


def build_on_meta(build: Callable[[], nn.Module]) -> tuple[nn.Module, dict]:
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
    modules: list[nn.Module], order: list[nn.Module], recorded: dict, device: torch.device,
    seed: int, model_file: ModelFile, reference: nn.Module | None = None,
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
