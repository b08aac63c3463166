"""The tests' faults for the emitted program, injected from outside it: the shipped runtime
holds no test hook. Every Python process started with this folder on ``PYTHONPATH`` imports this
module when it starts (``site`` imports ``sitecustomize``), torchrun's workers included; tests put
it there through ``_plans.harness_env`` whenever they set one of the variables below. Once
``train.py`` imports ``autopar_runtime``, the runtime's functions named below are wrapped or
replaced, in every module of the package that holds them (a module reads the names it imported
from another as its own globals). Each fault is inert unless its variable is set:

- ``AUTOPAR_TEST_KILL_AT_STEP=N`` (``AUTOPAR_TEST_KILL_RANK=R``, default 0;
  ``AUTOPAR_TEST_KILL_MARKER=PATH``): after step N's ``after_step`` (its log line and checkpoint
  out), rank R kills itself with SIGKILL, on torchrun's first attempt only
  (``TORCHELASTIC_RESTART_COUNT=0``), or, with a marker, only while PATH does not exist (it is
  made first): on several nodes the torchruns' restart counts and the ranks' places can differ;
- ``AUTOPAR_TEST_STOP_AT_STEP=N`` (``AUTOPAR_TEST_KILL_MARKER=PATH``): after step N's
  ``after_step``, the first rank of the node where the variable is set stops
  (SIGSTOP) once, making PATH first: the others wait in their next collective, and the test
  takes the node away (kills every process of its network namespace) at a known step;
- ``AUTOPAR_TEST_STEP_SLEEP_S=S``: every rank sleeps S seconds after each step (a run that
  stays mid-run while a test adds a node);
- ``AUTOPAR_TEST_COMPILE_BACKEND=NAME``: torch.compile's backend for ``--compile``
  (``compile_backend``; aot_eager: dynamo and AOTAutograd without code generation), so
  ``check_compile`` asks nothing of inductor;
- ``AUTOPAR_TEST_EP_SHIFT=K``: expert parallel sends every route K ep ranks too far
  (``ep_forward`` gets each token's experts moved by K ep ranks' worth): a wrong dispatch,
  which ``--verify`` must catch;
- ``AUTOPAR_TEST_BLOCK_AUTOPAR=1``: ``import autopar`` fails, so a run shows that the emitted
  program needs none of it.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import signal
import sys
import time
from pathlib import Path

PACKAGE = "autopar_runtime"


def _replace(package, name: str, new) -> None:
    """``new`` for ``name`` wherever the package's modules hold the original."""
    original = getattr(package, name)
    for module_name, module in list(sys.modules.items()):
        if module_name == PACKAGE or module_name.startswith(PACKAGE + "."):
            if getattr(module, name, None) is original:
                setattr(module, name, new)


def _kill_after(after_step):
    def after_step_then_kill(c, args, step, *rest, **kwargs):
        after_step(c, args, step, *rest, **kwargs)
        if os.environ.get("AUTOPAR_TEST_KILL_AT_STEP") != str(step):
            return
        marker = os.environ.get("AUTOPAR_TEST_KILL_MARKER")
        if marker is None and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return
        if marker is not None and Path(marker).exists():
            return
        import torch.distributed as dist

        dist.barrier()  # rank 0 has printed the step
        if dist.get_rank() == int(os.environ.get("AUTOPAR_TEST_KILL_RANK", 0)):
            if marker is not None:
                Path(marker).touch()
            os.kill(os.getpid(), signal.SIGKILL)

    return after_step_then_kill


def _stop_after(after_step):
    def after_step_then_stop(c, args, step, *rest, **kwargs):
        after_step(c, args, step, *rest, **kwargs)
        pause = float(os.environ.get("AUTOPAR_TEST_STEP_SLEEP_S", 0))
        if pause:
            time.sleep(pause)
        marker = Path(os.environ.get("AUTOPAR_TEST_KILL_MARKER", "/nonexistent/marker"))
        if os.environ.get("AUTOPAR_TEST_STOP_AT_STEP") != str(step) or marker.exists():
            return
        if os.environ.get("LOCAL_RANK") == "0":  # no barrier: only this node has the variable
            marker.touch()
            os.kill(os.getpid(), signal.SIGSTOP)

    return after_step_then_stop


def _shifted(ep_forward, shift: int):
    def wrong_dispatch(ep, local_forward, hidden, top_k_index, top_k_weights):
        moved = (top_k_index + shift * ep.local) % ep.num_experts
        return ep_forward(ep, local_forward, hidden, moved, top_k_weights)

    return wrong_dispatch


def inject(package) -> None:
    """The faults the environment asks for, into the imported runtime package."""
    if os.environ.get("AUTOPAR_TEST_KILL_AT_STEP"):
        _replace(package, "after_step", _kill_after(package.after_step))
    if os.environ.get("AUTOPAR_TEST_STOP_AT_STEP") or os.environ.get("AUTOPAR_TEST_STEP_SLEEP_S"):
        _replace(package, "after_step", _stop_after(package.after_step))
    backend = os.environ.get("AUTOPAR_TEST_COMPILE_BACKEND")
    if backend:
        _replace(package, "compile_backend", lambda: backend)
    shift = int(os.environ.get("AUTOPAR_TEST_EP_SHIFT", "0"))
    if shift:
        _replace(package, "ep_forward", _shifted(package.ep_forward, shift))


class _Injector(importlib.abc.MetaPathFinder):
    """Finds ``autopar_runtime`` as Python would, and injects the faults once it has run."""

    def find_spec(self, name, path=None, target=None):
        if name == "autopar" and os.environ.get("AUTOPAR_TEST_BLOCK_AUTOPAR"):
            raise ModuleNotFoundError("autopar is blocked (AUTOPAR_TEST_BLOCK_AUTOPAR)", name=name)
        if name != PACKAGE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_inject(module) -> None:
            exec_module(module)
            inject(module)

        spec.loader.exec_module = exec_and_inject
        return spec


if any(key.startswith("AUTOPAR_TEST_") for key in os.environ):
    sys.meta_path.insert(0, _Injector())
