"""The profiled steps' records from torch's profiler (user scopes only, cheap): each process
group's collectives (``gloo:all_reduce`` with shapes and dtypes, told apart by the group's
worker threads, learned from tiny all-reduces per group) and, on CPU, every tensor allocation
and free; read by ``profiling.StepProfiler``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from .common import say

__all__ = ["Records"]

_P2P = ("send", "recv")
_ALL_TO_ALL = ("all_to_all", "alltoall", "alltoall_base")
_DTYPE_BYTES = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8,
                "int": 4, "bool": 1, "unsigned char": 1, "signed char": 1, "short int": 2}  # fmt: skip


class Records:
    """The process groups' own records and, on CPU, every tensor allocation and free (torch's
    profiler, user scopes only) over the profiled steps; None where this torch lacks the
    private entry points used."""

    def __init__(
        self, groups: dict[str, Any], cuda: bool, all_to_all_of: dict[str, str] | None = None
    ) -> None:
        self.groups, self.cuda, self.threads = groups, cuda, {}
        self.all_to_all_of = all_to_all_of or {}  # group -> the axis its all-to-alls serve
        self.windows: list[tuple[int, int]] = []  # time.time_ns() of each step, profiler's clock
        self.events, self.source, self.kernel_s = None, None, {}  # kernel_s: GPU's times
        self.allocations: list[tuple[int, int]] = []  # (time ns, bytes: + allocated, - freed)

    def start(self) -> None:
        try:
            from torch._C import _autograd as A
            from torch._C import _profiler as P

            # shapes recorded; allocations (CPU: the allocator keeps no peak of its own)
            config = P.ProfilerConfig(P.ProfilerState.KINETO, True, not self.cuda, False, False,
                                      False, P._ExperimentalConfig(), "")  # fmt: skip
            activities = {P.ProfilerActivity.CPU}
            if self.cuda:
                activities.add(P.ProfilerActivity.CUDA)
            A._prepare_profiler(config, activities)
            A._enable_profiler(config, activities, {P.RecordScope.USER_SCOPE})
        except (ImportError, AttributeError, TypeError, RuntimeError) as e:
            say(f"profile: collectives not recorded (this torch's profiler: {e})")
            return
        self.source = "torch.profiler:user_scope"
        # Each group's worker threads: tiny all-reduces, told apart by their length.
        for i, group in enumerate(self.groups.values()):
            device = "cuda" if self.cuda else "cpu"
            works = [
                dist.all_reduce(torch.zeros(3 + i, device=device), group=group, async_op=True)
                for _ in range(8)
            ]
            for work in works:
                work.wait()

    def stop(self) -> None:
        if self.source is None:
            return
        from torch._C._autograd import _disable_profiler

        events = sorted(_disable_profiler().events(), key=lambda e: e.start_ns())
        names = list(self.groups)
        first = self.windows[0][0] if self.windows else 0
        kept = []
        for e in events:
            kind = self._kind(e)
            if kind is None:
                if e.name() == "[memory]" and e.device_type() == torch._C._autograd.DeviceType.CPU:
                    self.allocations.append((e.start_ns(), e.nbytes()))
                continue
            if e.start_ns() < first:  # calibration
                shapes = e.shapes()
                index = shapes[0][0] - 3 if shapes and len(shapes[0]) == 1 else -1
                if kind == "all_reduce" and 0 <= index < len(names):
                    tid, name = e.start_thread_id(), names[index]
                    # a thread seen for two groups (nccl records on the caller's) is no group's
                    self.threads[tid] = name if self.threads.get(tid, name) == name else None
                continue
            kept.append(e)
        self.events = kept
        if self.cuda:  # nccl's records time the launch: take each one's kernel, in order
            kernels = [k for k in events if "nccl" in k.name().lower() and k.start_ns() >= first
                       and k.device_type() == torch._C._autograd.DeviceType.CUDA]  # fmt: skip
            self.kernel_s = {id(e): k.duration_ns() / 1e9 for e, k in zip(kept, kernels)}

    @staticmethod
    def _kind(e: Any) -> str | None:
        name = e.name()
        for prefix in ("gloo:", "nccl:"):
            if name.startswith(prefix):
                return name[len(prefix) :]
        return None

    def summary(self, mesh_sizes: dict[str, int]) -> list[dict] | None:
        """[{kind, group, group_size, message_bytes, num_calls, time_s}] per step (the mean over
        the profiled steps), one row per (kind, group, bytes)."""
        if self.events is None:
            return None
        rows: dict[tuple, dict] = {}
        for e in self.events:
            if not any(a <= e.start_ns() < b for a, b in self.windows):
                continue
            kind = self._kind(e)
            group = self.threads.get(e.start_thread_id())
            if group is None and kind in _P2P:
                group = "pp" if mesh_sizes.get("pp", 1) > 1 else None
            if kind in _ALL_TO_ALL and group in self.all_to_all_of:
                group = self.all_to_all_of[group]
            size = dist.get_world_size() if group == "world" else mesh_sizes.get(group)
            nbytes = sum(
                math.prod(shape) * _DTYPE_BYTES.get(dtype, 4)
                for shape, dtype in zip(e.shapes(), e.dtypes())
                if dtype
            )
            row = rows.setdefault((kind, group, nbytes), {
                "kind": kind, "group": group, "group_size": size, "message_bytes": nbytes,
                "num_calls": 0, "time_s": 0.0})  # fmt: skip
            row["num_calls"] += 1
            row["time_s"] += self.kernel_s.get(id(e), e.duration_ns() / 1e9)
        n = max(1, len(self.windows))
        return [{**r, "num_calls": r["num_calls"] / n, "time_s": r["time_s"] / n}
                for r in rows.values()]  # fmt: skip

    def peak_increment(self, window: tuple[int, int]) -> int | None:
        """The most tensor bytes allocated at once in ``window`` above its start (CPU)."""
        if self.source is None or self.cuda:
            return None
        now = peak = 0
        for t, nbytes in self.allocations:
            if window[0] <= t < window[1]:
                now += nbytes
                peak = max(peak, now)
        return peak
