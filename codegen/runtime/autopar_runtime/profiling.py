"""--profile-steps N: the run measures what the cost model predicts, and writes profile.json.

After ``WARMUP_STEPS`` steps (they allocate, initialize, compile, rebuild DDP's buckets), N
steps are timed term by term on every rank. Each step is one timeline of marks (perf_counter on
CPU, CUDA events on GPU), each interval between two marks charged to exactly one term, so the
terms of a step sum to its measured time exactly:

- ``data_wait_s``: the batch iterator (loading, slicing, this step's seeds);
- per planned layer (LAYERS), ``forward_s`` (forward pre-hook to forward hook, FSDP2's
  all-gather wait included: our pre-hook runs first) and ``backward_s`` (from the gradient of
  its output to the gradient of its input: tensor hooks, which leave the autograd graph and its
  numbers as they are; recomputation of a checkpointed layer included);
- ``forward_other_s`` / ``backward_other_s``: work outside the layers (the root's own ops,
  the loss, the end of backward with DDP's / FSDP2's final waits);
- ``pipeline_s`` (pipeline plans): the schedule's time outside this rank's layers: waiting for
  the neighbouring stages (the bubble), send/recv, the loss;
- ``grad_norm_s`` (the total norm, its all-reduce, clipping), ``optimizer_s`` (each
  optimizer's step), ``other_s`` (what follows: zero_grad, the LR schedule, a CUDA sync).

Collectives (kind, group as a mesh dim and its size, bytes, calls, time) come from torch's
profiler restricted to user scopes: the process groups' own records (``gloo:all_reduce``, with
shapes and dtypes, run on each group's worker threads, learned at the start from tiny
all-reduces per mesh dim; send/recv are the pipeline's), not one event per op: cheap. They
overlap compute, so they are not terms of the step's sum.

Memory per rank at the step's peak, split as the cost model splits it: ``params``, ``grads``,
``optimizer`` (bytes of the local shards: measured); the peak (the allocator's on GPU; on CPU the
tensors at the step's start plus the most allocated at once in it, from the profiler's
allocation records); ``activations`` = peak - start - grads (derived: transients such as FSDP2's
gathered parameters included); ``buffers`` = start - params - optimizer (CPU: module buffers).
The RSS high-water mark of the step and the RSS before the model are there for reference.

Rank 0 gathers every rank's figures into one JSON file (``"schema"``, units in the key names)
with the plan (plan.json beside train.py, its sha256), cluster, autopar and torch versions.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from .common import Constants, Part, fail, has_submodule, say
from .expert_parallel import active_expert_parallel
from .records import Records

__all__ = [
    "PROFILE_SCHEMA",
    "PROFILE_KIND",
    "WARMUP_STEPS",
    "add_profile_args",
    "check_profile_flags",
    "profile_path",
    "phase",
    "StepProfiler",
]

PROFILE_SCHEMA = 1
PROFILE_KIND = "autopar-profile"
WARMUP_STEPS = 2
"""Steps run before profiling: the first allocates and initializes (optimizer state, FSDP2's
lazy init, torch.compile); DDP rebuilds its buckets in the second's forward (measured: +0.1 s)."""
_TERMS = ("data_wait", "forward_other", "backward_other", "pipeline", "grad_norm", "optimizer",
         "other")  # fmt: skip
_MEASURED = ("params_bytes", "grads_bytes", "optimizer_bytes", "peak_rss_bytes",
             "runtime_rss_bytes")  # fmt: skip


def _rss_bytes(field: str) -> int | None:
    """VmRSS / VmHWM of this process (Linux), None where /proc is not there."""
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        return next((int(x.split()[1]) * 1024 for x in f if x.startswith(field + ":")), None)
    return None


_FOOTPRINT_BYTES = _rss_bytes("VmRSS")  # torch and the runtime, imported, before any model


def add_profile_args(p: argparse.ArgumentParser) -> None:
    after = f"after {WARMUP_STEPS} warm-up steps, profile N steps and write profile.json"
    p.add_argument("--profile-steps", type=int, default=None, help=after)
    where = "where profile.json goes (default: in --checkpoint-dir, else the current dir)"
    p.add_argument("--profile-out", type=Path, default=None, help=where)


def check_profile_flags(args: argparse.Namespace) -> None:
    """--profile-steps N >= 1 with --steps >= N + WARMUP_STEPS; --profile-out only with it, and
    never a file autopar did not write (a previous profile is replaced)."""
    n = args.profile_steps
    if n is None:
        if args.profile_out is not None:
            fail("--profile-out needs --profile-steps N (the steps to profile)")
        return
    if n < 1 or args.steps < n + WARMUP_STEPS:
        fail(
            f"--profile-steps {n} must be >= 1, with --steps ({args.steps}) >= N + "
            f"{WARMUP_STEPS} (the first {WARMUP_STEPS} steps warm up, not profiled)"
        )
    path = profile_path(args)
    if path.is_dir():
        fail(f"--profile-out {path} is a directory: name a file (e.g. {path / 'profile.json'})")
    if args.profile_out is not None and not path.parent.is_dir():
        fail(f"--profile-out {path}: the folder {path.parent} does not exist: create it first")
    if path.exists() and not _is_our_profile(path):
        fail(f"{path} exists and is not a profile autopar wrote: move it, or name another")


def profile_path(args: argparse.Namespace) -> Path:
    """--profile-out, else profile.json in --checkpoint-dir, else in the current directory."""
    return args.profile_out or (args.checkpoint_dir or Path.cwd()) / "profile.json"


def _is_our_profile(path: Path) -> bool:
    try:
        head = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(head, dict) and head.get("kind") == PROFILE_KIND


def phase(args: argparse.Namespace, name: str) -> contextlib.AbstractContextManager:
    """Charge what runs inside to the term ``name`` of a profiled step (else: nothing)."""
    profiler = getattr(args, "autopar_profiler", None)
    if profiler is None or not profiler.recording:
        return contextlib.nullcontext()
    return profiler.timeline.phase(name)


class _Timeline:
    """One step's marks: each says which term the time from it to the next is charged to."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: list[tuple[Any, object]] = []
        self.stack: list[object] = ["data_wait"]
        self.bwd_layer: str | None = None  # the layer whose backward runs, if any
        self.callback_queued = False  # the end of this backward pass (_bwd_end(None))

    def now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def current(self) -> object:
        return ("bwd", self.bwd_layer) if self.bwd_layer is not None else self.stack[-1]

    def mark(self) -> None:
        self.marks.append((self.now(), self.current()))

    @contextlib.contextmanager
    def phase(self, label: object) -> Iterator[None]:
        self.bwd_layer = None
        self.stack.append(label)
        self.mark()
        try:
            yield
        finally:
            self.stack.pop()
            self.mark()

    def durations(self) -> dict[object, float]:
        """Term -> seconds, the last mark closing the step."""
        if self.cuda:
            self.marks[-1][0].synchronize()
        out: dict[object, float] = {}
        for (t0, label), (t1, _) in zip(self.marks, self.marks[1:]):
            dt = t0.elapsed_time(t1) / 1e3 if self.cuda else t1 - t0
            out[label] = out.get(label, 0.0) + dt
        return out


def _local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


class StepProfiler:
    """--profile-steps: hooks on this rank's planned layers and optimizers for the profiled
    steps only (removed after), the batches timed, profile.json written after the last one.
    Without the flag every method passes its input through and records nothing."""

    def __init__(
        self,
        c: Constants,
        args: argparse.Namespace,
        parts: list[Part],
        mesh: DeviceMesh,
        device: torch.device,
        script: str,
    ) -> None:
        self.c, self.args, self.parts, self.device = c, args, parts, device
        self.active, self.cuda = args.profile_steps is not None, device.type == "cuda"
        self.recording, self.handles, self.steps, self.count = False, [], [], 0
        self.script = Path(script)
        if not self.active:
            return
        args.autopar_profiler = self
        dims = [d for d in mesh.mesh_dim_names if mesh[d].size() > 1]
        groups = {"world": dist.group.WORLD}  # group name -> the mesh dim(s) it spans
        for d in dims:
            if mesh[d].size() == dist.get_world_size():
                groups.pop("world", None)
            groups[d] = mesh[d].get_group()
        self.mesh_sizes = {d: mesh[d].size() for d in mesh.mesh_dim_names}
        self.coords = {d: mesh[d].get_local_rank() for d in mesh.mesh_dim_names}
        experts = active_expert_parallel()
        all_to_all_of = {}  # a group shared with ep (DeviceMesh reuses a process group of the
        if experts is not None:  # same ranks): its all-to-alls are ep's, the dp axes run none
            shared = [name for name, g in groups.items() if g is experts.group]
            if shared:
                all_to_all_of[shared[0]] = "ep"
            else:  # carved from the data-parallel ranks, outside the training mesh
                groups["ep"] = experts.group
            self.mesh_sizes["ep"], self.coords["ep"] = experts.ep, experts.rank
        self.collectives = Records(groups, self.cuda, all_to_all_of)
        self.timeline = _Timeline(self.cuda)
        self.layers = [
            (fqn, module.get_submodule(fqn))
            for module in (m.module if isinstance(m, DDP) else m for m, _ in parts)
            for fqn in c.LAYERS
            if fqn and has_submodule(module, fqn)
        ]

    # -- the loop's side --------------------------------------------------------------------
    def batches(self, inner: Iterable) -> Iterator:
        """``inner``'s items; a profiled step starts when its batch is asked for."""
        it = iter(inner)
        while True:
            profiled = (
                self.active and WARMUP_STEPS <= self.count < WARMUP_STEPS + self.args.profile_steps
            )
            if profiled:
                self._begin()
            try:
                item = next(it)
            except StopIteration:
                if self.handles:
                    self._end_hooks()
                if self.active and 0 < len(self.steps) < self.args.profile_steps:
                    self._write()  # a resumed run that ended first: what it profiled
                return
            if profiled:
                self.timeline.stack[0] = "forward_other"
                self.timeline.mark()
            yield item
            self.count += 1

    def end_step(self, step: int, step_time_s: float) -> None:
        """The profiled step's end (after the optimizer and the LR schedule)."""
        if not self.recording:
            return
        self.timeline.stack = ["end"]
        self.timeline.bwd_layer = None
        self.timeline.mark()
        self.collectives.windows.append((self.window_start, time.time_ns()))
        self.steps.append(self._step_record(step, step_time_s))
        if len(self.steps) == self.args.profile_steps:
            self._end_hooks()
            self._write()
        else:
            self.recording = False

    # -- one step ---------------------------------------------------------------------------
    def _begin(self) -> None:
        if not self.handles:
            self._install()
            self.collectives.start()
        self.timeline = _Timeline(self.cuda)
        self.grads_bytes = 0
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base_bytes = torch.cuda.memory_allocated(self.device)
        else:
            self.base_bytes = 0  # (the tensors' at write time, see _memory)
            with contextlib.suppress(OSError):  # Linux: reset VmHWM to the current RSS
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
        self.window_start = time.time_ns()
        self.recording = True
        self.timeline.mark()

    def _install(self) -> None:
        for fqn, m in self.layers:  # ours first: FSDP2's all-gather inside the layer's time
            self.handles += [m.register_forward_pre_hook(self._pre_hook(fqn), prepend=True,
                                                         with_kwargs=True),
                             m.register_forward_hook(self._post_hook(fqn), prepend=True)]  # fmt: skip
        for _, o in self.parts:
            self.handles += [o.register_step_pre_hook(self._optimizer_pre),
                             o.register_step_post_hook(self._optimizer_post)]  # fmt: skip

    def _end_hooks(self) -> None:
        self.recording = False
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.collectives.stop()

    def _pre_hook(self, fqn: str):
        def hook(module, args, kwargs):
            if not self.recording:
                return None
            t = self.timeline
            if t.stack[0] == "backward_other":  # the next microbatch's forward
                t.stack[0] = "forward_other"
            t.bwd_layer = None
            t.stack.append(("fwd", fqn))
            t.mark()
            if torch.is_grad_enabled():
                for x in torch.utils._pytree.tree_leaves((args, kwargs)):
                    if isinstance(x, torch.Tensor) and x.requires_grad:
                        x.register_hook(self._bwd_end(fqn))

        return hook

    def _post_hook(self, fqn: str):
        def hook(module, args, output):
            if not self.recording:
                return None
            t = self.timeline
            if t.stack[-1] == ("fwd", fqn):
                t.stack.pop()
                t.mark()
            if torch.is_grad_enabled():
                for x in torch.utils._pytree.tree_leaves(output):
                    if isinstance(x, torch.Tensor) and x.requires_grad:
                        x.register_hook(self._bwd_start(fqn))

        return hook

    def _bwd_start(self, fqn: str):
        def hook(grad):
            t = self.timeline
            if not self.recording or t.bwd_layer == fqn:
                return
            if t.stack[0] == "forward_other":
                t.stack[0] = "backward_other"
            t.bwd_layer = fqn
            t.mark()
            if not t.callback_queued:  # the end of this backward pass
                t.callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._bwd_end(None))

        return hook

    def _bwd_end(self, fqn: str | None):
        """The gradient of ``fqn``'s input: its backward is over (None: the backward pass)."""

        def hook(grad=None):
            t = self.timeline
            t.callback_queued = t.callback_queued and fqn is not None
            if self.recording and t.bwd_layer is not None and fqn in (None, t.bwd_layer):
                t.bwd_layer = None
                t.mark()

        return hook

    def _optimizer_pre(self, optimizer, args, kwargs) -> None:
        if self.recording:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            self.grads_bytes += _local_bytes(p.grad for p in params)
            self.timeline.bwd_layer = None
            self.timeline.stack.append("optimizer")
            self.timeline.mark()

    def _optimizer_post(self, optimizer, args, kwargs) -> None:
        if self.recording and self.timeline.stack[-1] == "optimizer":
            self.timeline.stack.pop()
            self.timeline.stack[0] = "other"
            self.timeline.mark()

    def _step_record(self, step: int, step_time_s: float) -> dict:
        durations = self.timeline.durations()
        record: dict[str, Any] = {"step": step}
        record["step_s"] = sum(durations.values())
        record["logged_step_time_s"] = step_time_s
        for term in _TERMS:
            record[f"{term}_s"] = durations.get(term, 0.0)
        record["layers"] = {
            fqn: {"forward_s": durations.get(("fwd", fqn), 0.0),
                  "backward_s": durations.get(("bwd", fqn), 0.0)}
            for fqn, _ in self.layers
        }  # fmt: skip
        peak = torch.cuda.max_memory_allocated(self.device) if self.cuda else None
        record["memory"] = (self.base_bytes, self.grads_bytes, peak, _rss_bytes("VmHWM"))
        return record

    def _memory(self, raw: tuple, window: tuple[int, int]) -> dict:
        """The step's peak split as the cost model splits it (see the module's docstring)."""
        base, grads_bytes, cuda_peak, rss_peak = raw
        params = [p for m, _ in self.parts for p in m.parameters()]
        state = [
            v for _, o in self.parts for s in o.state.values() for v in s.values()
            if isinstance(v, torch.Tensor)
        ]  # fmt: skip
        params_bytes, optimizer_bytes = _local_bytes(params), _local_bytes(state)
        buffers = [b for m, _ in self.parts for b in m.buffers()]
        if self.cuda:  # the allocator's: every tensor, at the step's start and at its peak
            source, peak = "cuda_allocator", cuda_peak
        else:  # the profiler's allocation records in the step, over the tensors we know of
            source, base = "cpu_allocations", params_bytes + optimizer_bytes + _local_bytes(buffers)
            peak = base + (self.collectives.peak_increment(window) or 0)
        activations = max(0, peak - base - grads_bytes)
        return {
            "source": source,
            "peak_bytes": base + grads_bytes + activations,
            "params_bytes": params_bytes,
            "grads_bytes": grads_bytes,
            "optimizer_bytes": optimizer_bytes,
            "activations_bytes": activations,
            "buffers_bytes": base - params_bytes - optimizer_bytes,
            "peak_rss_bytes": rss_peak,
            "runtime_rss_bytes": None if self.cuda else _FOOTPRINT_BYTES,
            "measured": [*_MEASURED, *(["buffers_bytes"] if not self.cuda else [])],
            "derived": ["peak_bytes", "activations_bytes", *(["buffers_bytes"] if self.cuda else [])],
        }  # fmt: skip

    # -- the file ---------------------------------------------------------------------------
    def _rank_record(self) -> dict:
        n = len(self.steps)
        mean: dict[str, Any] = {}
        for key in ("step_s", "logged_step_time_s", *(f"{t}_s" for t in _TERMS)):
            mean[key] = sum(s[key] for s in self.steps) / n
        mean["layers"] = {
            fqn: {k: sum(s["layers"][fqn][k] for s in self.steps) / n
                  for k in ("forward_s", "backward_s")}
            for fqn, _ in self.layers
        }  # fmt: skip
        for s, window in zip(self.steps, self.collectives.windows):
            s["memory"] = self._memory(s["memory"], window)
        peak_step = max(self.steps, key=lambda s: s["memory"]["peak_bytes"])
        return {
            "rank": dist.get_rank(), "mesh_coords": self.coords, "mean": mean,
            "steps": self.steps, "memory": peak_step["memory"],
            "collectives": self.collectives.summary(self.mesh_sizes),
        }  # fmt: skip

    def _write(self) -> None:
        records = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(self._rank_record(), records, dst=0)
        if dist.get_rank() != 0:
            return
        plan_file = self.script.parent / "plan.json"
        plan_text = plan_file.read_bytes() if plan_file.is_file() else None
        document = {
            "kind": PROFILE_KIND, "schema": PROFILE_SCHEMA,
            "autopar_version": self.c.AUTOPAR_VERSION, "torch_version": torch.__version__,
            "cluster": self.c.CLUSTER, "world_size": dist.get_world_size(),
            "backend": dist.get_backend(), "device_type": self.device.type,
            "clock": "cuda_event" if self.cuda else "perf_counter", "mesh": self.c.MESH,
            "plan_sha256": hashlib.sha256(plan_text).hexdigest() if plan_text else None,
            "plan": json.loads(plan_text) if plan_text else None,
            "warmup_steps": WARMUP_STEPS, "profiled_steps": [s["step"] for s in self.steps],
            "collectives_source": self.collectives.source,
            "layers": [fqn for fqn in self.c.LAYERS if fqn], "ranks": records,
        }  # fmt: skip
        path = profile_path(self.args)
        if path.exists() and not _is_our_profile(path):  # appeared since the launch checks
            say(f"profile: not written, {path} exists and is not a profile autopar wrote")
            return
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:  # the run goes on without its profile rather than stop here
            path.parent.mkdir(parents=True, exist_ok=True)  # --checkpoint-dir, before a save
            tmp.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            say(f"profile: not written to {path} ({e})")
            return
        say(f"profile: {len(self.steps)} steps after {WARMUP_STEPS} warm-up, written to {path}")
