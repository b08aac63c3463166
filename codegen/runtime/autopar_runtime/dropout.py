"""Dropout and each step's seed: the RNG reseeded per (seed, step, data-parallel rank), and
--verify's dropout-off mode (both runs draw no mask)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["step_seed", "seed_rng", "DropoutOff", "dropout_off"]


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


def seed_rng(seed: int) -> None:
    """torch.manual_seed(seed) for the generators a step draws from: the CPU's, the GPUs' where
    CUDA has started. torch.manual_seed also queues a seed for each device type not started
    (CUDA, MTIA, even on a CPU-only build), formatting the stack for each: 0.55 ms a call,
    measured on torch 2.13, more than the step's batch. CUDA there but not started: it is that."""
    if torch.cuda.is_available() and not torch.cuda.is_initialized():
        torch.manual_seed(seed)
        return
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


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


def dropout_off(
    args: argparse.Namespace, modules: Iterable[nn.Module] = ()
) -> contextlib.AbstractContextManager:
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
