"""The model-file contract: ``path/to/model.py[:factory]``, loaded and built on meta.

The file defines ``build_model()`` (or the factory named after ``:``), optionally
``make_batch(batch_size, seq_len)`` returning ``(inputs, target)`` and ``loss_fn(output,
target)``. Every failure is a :class:`ModelFileError` with one line: the value, the rule, the fix.

Batches of any shape: ``inputs`` is a tuple of the forward's positional arguments
(``forward(*inputs)``) or a dict of its keyword arguments (``forward(**inputs)``); each argument,
and the target, may be a tensor or any pytree of them (dicts, lists, tuples; None, numbers and
strings pass through as they are), e.g. ``(({"input_ids": ids, "mask": m},), target)`` for
``forward(self, batch: dict)``. Every tensor of one dim or more has the batch as its first dim
(checked here): the emitted script gives each data-parallel rank and accumulation microbatch its
rows of every tensor. ``loss_fn(output, target)`` gets the output as the forward returns it (a
tensor, a dict, ``(logits, aux_loss)``, an HF ModelOutput) and the target as make_batch returns
it; without ``loss_fn``, a forward returning several tensors is refused at plan time (the
default loss takes one). A pipeline stage takes positional tensors only: models with other
inputs plan without pipeline parallelism (pp pinned above 1 is one error line).
"""

from __future__ import annotations

import hashlib
import importlib.util
import linecache
import os
import sys
import threading
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autopar.errors import UserError

DEFAULT_FACTORY = "build_model"


class ModelFileError(UserError):
    """A model file that breaks the contract; the message is one line saying how to fix it."""


@dataclass(frozen=True)
class ModelFile:
    """A loaded model file."""

    path: str
    """absolute path of the file."""
    factory: str
    """name of the factory function (``build_model`` by default)."""
    build: Callable[[], nn.Module]
    make_batch: Callable[..., Any] | None
    loss_fn: Callable[..., Any] | None
    module: types.ModuleType
    """the imported Python module."""


def resolve_model_spec(spec: str) -> tuple[str, str]:
    """``path/to/model.py[:factory]`` -> (absolute path, factory), checked without importing;
    ``hf:<name or config.json>`` -> (``hf:<absolute config path>``, causal_lm | masked_lm)."""
    if spec.startswith("hf:"):
        from autopar.hf import factory_of, load_config, resolve_hf_spec

        return resolve_hf_spec(spec), factory_of(load_config(spec))
    path, factory = spec, DEFAULT_FACTORY
    head, sep, tail = spec.rpartition(":")
    if sep and not os.path.exists(spec):
        if tail.isidentifier():
            path, factory = head, tail
        elif os.path.isfile(head):
            raise ModelFileError(
                f"model spec {spec!r}: the factory after ':' must be a Python function name, "
                f"got {tail!r}: write {head}:build_model"
            )
    path = os.path.abspath(path)
    fix = f"pass the path of a Python file that defines {factory}()"
    if not os.path.exists(path):
        raise ModelFileError(f"model file {path!r} does not exist: {fix}")
    if not os.path.isfile(path):
        raise ModelFileError(f"model file {path!r} is not a file: {fix}")
    if not path.endswith(".py"):
        raise ModelFileError(f"model file {path!r} is not a .py file: {fix}")
    return path, factory


def load_model_file(spec: str) -> ModelFile:
    """Import ``path/to/model.py[:factory]`` by path and check that it defines the factory.

    ``hf:<name or config.json>`` is a HuggingFace transformers model built from its config
    (:mod:`autopar.hf`)."""
    if spec.startswith("hf:"):
        from autopar.hf import hf_model_file

        return hf_model_file(spec)
    path, factory = resolve_model_spec(spec)
    module = _import(path)
    build = getattr(module, factory, None)
    if not callable(build):
        found = "is not callable" if build is not None else "is not defined"
        raise ModelFileError(
            f"{factory!r} {found} in model file {path!r}: define {factory}() returning an "
            f"nn.Module, or name the factory as {os.path.basename(path)}:<function>"
        )
    return ModelFile(
        path=path,
        factory=factory,
        build=build,
        make_batch=_optional_callable(module, "make_batch"),
        loss_fn=_optional_callable(module, "loss_fn"),
        module=module,
    )


def build_on_meta(mf: ModelFile) -> nn.Module:
    """Call the factory under ``torch.device("meta")`` (no real weights) in training mode."""
    try:
        with torch.device("meta"):
            model = mf.build()
    except ModelFileError:
        raise
    except (Exception, SystemExit) as e:
        raise ModelFileError(
            f"{mf.factory}() in {mf.path!r} raised {_describe(e)}{_user_line(e, mf.path)}: "
            f"make {mf.factory}() build the model without touching weight values "
            f'(it runs under torch.device("meta"))'
        ) from e
    if not isinstance(model, nn.Module):
        raise ModelFileError(
            f"{mf.factory}() in {mf.path!r} returned {type(model).__name__}, not a "
            f"torch.nn.Module: return the model instance"
        )
    try:
        return model.train()
    except RecursionError:
        raise too_deep(mf.path) from None


def too_deep(path: str) -> ModelFileError:
    """The error for a model whose module tree (or forward) recurses past Python's limit."""
    return ModelFileError(
        f"the model of {path!r} nests modules (or recurses in forward) deeper than Python's "
        f"recursion limit ({sys.getrecursionlimit()}) allows: flatten the module tree, e.g. hold "
        "repeated blocks in one nn.ModuleList instead of nesting each in the previous"
    )


def example_inputs(
    mf: ModelFile, model: nn.Module, batch_size: int, seq_len: int | None
) -> tuple[tuple, Any]:
    """(forward args, target) on meta for ``batch_size`` samples of ``seq_len`` tokens.

    Uses the file's ``make_batch`` when it has one; otherwise assumes a causal LM taking int64
    token ids of shape (batch_size, seq_len), with a target of the same shape.
    """
    if mf.make_batch is None:
        if seq_len is None:
            raise ModelFileError(
                f"model file {mf.path!r} defines no make_batch() and no sequence length was "
                f"given: define make_batch(batch_size, seq_len) or pass --seq-len"
            )
        ids = torch.zeros(batch_size, seq_len, dtype=torch.int64, device="meta")
        return (ids,), torch.zeros_like(ids)
    try:
        with torch.device("meta"):
            batch = mf.make_batch(batch_size, seq_len)
    except ModelFileError:
        raise
    except (Exception, SystemExit) as e:
        raise ModelFileError(
            f"make_batch({batch_size}, {seq_len}) in {mf.path!r} raised "
            f"{_describe(e)}{_user_line(e, mf.path)}: make it build tensors from shapes only"
        ) from e
    if not (
        isinstance(batch, tuple) and len(batch) == 2 and isinstance(batch[0], tuple | list | dict)
    ):
        raise ModelFileError(
            f"make_batch() in {mf.path!r} returned {_short_type(batch)}: return "
            f"((forward args...), target), e.g. ((idx,), targets), or ({{keyword args}}, target)"
        )
    inputs, target = batch
    if isinstance(inputs, dict) and not all(isinstance(k, str) for k in inputs):
        raise ModelFileError(
            f"make_batch() in {mf.path!r} returned keyword inputs with a key that is no string "
            f"({next(k for k in inputs if not isinstance(k, str))!r}): key them by the forward's "
            "argument names"
        )
    _check_batch_dim(mf, (inputs, target), batch_size, seq_len)
    inputs = {k: _to_meta(v) for k, v in inputs.items()} if isinstance(inputs, dict) else inputs
    return _to_meta(tuple(inputs) if isinstance(inputs, list) else inputs), _to_meta(target)


def call_args(inputs: tuple | dict) -> tuple[tuple, dict]:
    """(args, kwargs) of a forward call from make_batch's inputs: a tuple of arguments, or a
    dict of keyword arguments (``forward(**inputs)``)."""
    return ((), dict(inputs)) if isinstance(inputs, dict) else (tuple(inputs), {})


def is_flat(inputs: tuple | dict) -> bool:
    """Whether ``inputs`` are positional tensor arguments only (what a pipeline stage takes)."""
    return isinstance(inputs, tuple | list) and all(isinstance(x, torch.Tensor) for x in inputs)


def _check_batch_dim(mf: ModelFile, batch: Any, batch_size: int, seq_len: int | None) -> None:
    """Every tensor of one dim or more in make_batch's (inputs, target) has the batch first: the
    emitted script slices each along dim 0 for data-parallel ranks and microbatches."""
    from torch.utils import _pytree as pytree

    for path, leaf in pytree.tree_flatten_with_path(batch)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() and leaf.shape[0] != batch_size:
            where = ("inputs" if path[0].idx == 0 else "target") + pytree.keystr(path[1:])
            raise ModelFileError(
                f"make_batch({batch_size}, {seq_len}) in {mf.path!r} returned {where} of shape "
                f"{tuple(leaf.shape)}: every tensor in a batch must have the batch size "
                f"({batch_size}) as its first dim (the script gives each data-parallel rank its "
                "rows); build it from batch_size, or pass a shared tensor as a 0-dim tensor or "
                "a buffer of the model"
            )


def _import(path: str) -> types.ModuleType:
    stem = os.path.splitext(os.path.basename(path))[0]
    digest = hashlib.sha1(path.encode()).hexdigest()[:8]
    name = f"_autopar_model_{stem}_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look classes up by module name
    sys.path.insert(0, os.path.dirname(path))
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        del sys.modules[name]
        raise ModelFileError(
            f"model file {path!r} has a syntax error at line {e.lineno}: {e.msg}; fix the file"
        ) from e
    except ModelFileError:
        del sys.modules[name]
        raise
    except (Exception, SystemExit) as e:
        del sys.modules[name]
        raise ModelFileError(
            f"importing model file {path!r} raised {_describe(e)}{_user_line(e, path)}: "
            f"fix the import (sibling modules of the file are importable)"
        ) from e
    finally:
        if os.path.dirname(path) in sys.path:
            sys.path.remove(os.path.dirname(path))
    return module


def _optional_callable(module: types.ModuleType, name: str) -> Callable[..., Any] | None:
    value = getattr(module, name, None)
    if value is not None and not callable(value):
        raise ModelFileError(
            f"{name} in model file {module.__file__!r} is a {type(value).__name__}, not a "
            f"function: define it with def {name}(...) or remove it"
        )
    return value


def _describe(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0]}" if msg else type(e).__name__


def _user_line(e: BaseException, path: str) -> str:
    """`` at model.py:12 (code)`` for the innermost traceback frame in the model file's folder."""
    folder = os.path.dirname(path) + os.sep
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename.startswith(folder)]
    if not frames:
        return ""
    f = frames[-1]
    code = (f.line or linecache.getline(f.filename, f.lineno or 0)).strip()
    return f" at {os.path.basename(f.filename)}:{f.lineno} ({code})"


def _short_type(value: Any) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)} ({', '.join(type(v).__name__ for v in value)})"
    return f"a {type(value).__name__}"


def _to_meta(value: Any) -> Any:
    """``value`` with every tensor in it (any pytree: tuples, lists, dicts) on meta."""
    from torch.utils import _pytree as pytree

    return pytree.tree_map_only(torch.Tensor, lambda t: t if t.is_meta else t.to("meta"), value)


def stray_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """Non-daemon threads started since ``before`` that are still running."""
    return [t for t in threading.enumerate() if t not in before and t.is_alive() and not t.daemon]


def check_threads(before: set[threading.Thread], model: str) -> None:
    """A model file that left a non-daemon thread running (at import or build) is a user error:
    it would keep the process alive after planning."""
    stray = stray_threads(before)
    if stray:
        raise ModelFileError(
            f"model file {model!r} started thread {stray[0].name!r}, which is not a daemon "
            "and still runs: it would keep the process alive after planning; start threads "
            "with daemon=True, or not at import and build time"
        )
