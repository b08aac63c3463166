"""Profiling: microbenchmarks under torchrun, their least-squares fit, the versioned profile JSON.

    plan profile --cluster cpu:2 --out profile.json [--quick]
    python -m autopar.cost_model.profile --cluster cpu:2 --out profile.json [--quick]

``main`` launches ``torchrun --standalone --nproc-per-node N`` on this module's worker (gloo on
CPU; nccl and one GPU per rank on a GPU node: one node is profiled, ``devices_per_node`` ranks).
Every rank runs every benchmark at the same time, so a CPU cluster with more processes than cores
is measured oversubscribed, as its training runs will be. The worker times (median of repeats):

- ``matmul``: ``torch.mm`` over square and transformer-like shapes, fp32 and bf16;
- ``elementwise``: ``torch.add(x, y, out=z)`` from 4 KB to 64 MB (memory-bound);
- ``sdpa``: ``scaled_dot_product_attention`` forward over sequence lengths and head dims;
- ``eager_op``: one tiny ``add`` (the framework's dispatch floor);
- ``train_step``: forward + backward + AdamW of a tiny residual MLP at two depths, plain and with
  its linears tensor-parallel (``ColwiseParallel`` / ``RowwiseParallel``) on a 1-rank TP mesh
  (DTensor dispatch without communication);
- collectives ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all`` over every group
  size > 1 dividing the world (groups of consecutive ranks, all groups at once) and ``send_recv``
  between rank pairs, 1 KB .. 256 MB of full tensor (the ``num_bytes`` that
  :func:`cost_model.estimate.collective_time_s` takes), fp32.

The parent fits (:mod:`cost_model.fit`, relative least squares, parameters >= 0):

- matmul per dtype and sdpa: ``t = overhead + flops / flops_per_s``;
- memory: ``t = overhead + bytes / bytes_per_s``;
- per-op overhead as the planner counts ops: the step time of the MLP against
  ``3 * (compute nodes of its traced graph) + 10 * (parameter tensors)`` (the ILP charges three
  ops per forward node, forward and backward; torch's for-loop AdamW ten per tensor), over the two
  depths; the DTensor overhead likewise against ``15 * (styled linear calls)`` (the ILP's count
  per styled call) from the TP'd minus the plain step;
- per collective kind and group size: ``t = alpha + bytes / beta``; per link class, the ring
  model the planner uses, ``t = latency * steps(kind, n) + factor(kind, n) * bytes / busbw``
  over every kind and size, and per kind the ratio of its measured time to that ring figure.

The profile keeps the raw samples, the fitted parameters and the fit residuals; ``load_profile``
validates it and checks ``version``; ``apply_profile`` returns a Cluster with the fitted
DeviceSpec and Links. Quick sweep on 2 CPU processes: 10-25 s measured; the full sweep (up to
256 MB collectives, 1024^2 matmuls on CPU) has not been timed yet (estimated a few minutes).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

from autopar.cost_model.estimate import (
    ADAMW_OPS_PER_TENSOR,
    OPS_PER_NODE,
    TP_OPS_PER_STYLED_CALL,
)
from autopar.cost_model.fit import LinearFit, fit_linear, fit_slope, nonneg_lstsq
from autopar.cost_model.spec import Cluster, ClusterSpecError, CollectiveCost, DeviceSpec, Link
from autopar.cost_model.versioned import parse_versioned
from pydantic import BaseModel, ConfigDict, Field

from autopar.errors import UserError

PROFILE_VERSION = 1
# Ops the planner charges (cost_model.estimate is their one home):
PLANNER_OPS_PER_NODE = OPS_PER_NODE  # per forward node: forward + backward
ADAMW_OPS_PER_TENSOR_CPU = ADAMW_OPS_PER_TENSOR["cpu"]
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


class ProfileError(UserError):
    """A profile that cannot be used; the message is one line: what, why, the fix."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Sample(_Frozen):
    """One measured point: the median over repeats, averaged over the ranks that ran it."""

    bench: Literal["matmul", "elementwise", "sdpa", "eager_op", "train_step", "collective"]
    op: str
    """mm, add, sdpa, mlp, mlp_tp, block, adamw, adamw_dtensor, or the collective kind."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    shape: list[int] = Field(default_factory=list)
    """matmul (m, k, n); sdpa (b, h, s, d); elementwise (numel,); train_step (depth, width), for
    block (depth, dim, heads, batch, seq)."""
    group_size: int = Field(default=1, ge=1)
    flops: float = Field(default=0.0, ge=0)
    bytes: float = Field(default=0.0, ge=0)
    time_s: float = Field(gt=0)
    reps: int = Field(ge=1)


class Fit(_Frozen):
    """``t = intercept_s + x / rate`` with its residuals over ``num_samples`` samples."""

    intercept_s: float = Field(ge=0)
    rate: float = Field(gt=0)
    """FLOP/s or bytes/s (a huge value where the size term vanished)."""
    rel_rms: float = Field(ge=0)
    max_rel: float = Field(ge=0)
    num_samples: int = Field(ge=0)

    @classmethod
    def of(cls, f: LinearFit) -> Fit:
        rate = f.rate if math.isfinite(f.rate) else 1e30
        return cls(
            intercept_s=f.intercept,
            rate=rate,
            rel_rms=f.rel_rms,
            max_rel=f.max_rel,
            num_samples=f.n,
        )

    def predict(self, x: float) -> float:
        return self.intercept_s + x / self.rate


class CollectiveFit(_Frozen):
    kind: str
    group_size: int = Field(ge=2)
    link: Literal["intra_node", "inter_node"]
    fit: Fit
    """alpha = intercept_s, beta = rate (bytes/s) of t = alpha + bytes / beta."""
    ring_ratio: float = Field(gt=0)
    """median of measured / the link's ring-model time over this kind's samples."""


class OverheadFit(_Frozen):
    eager_op_s: float = Field(ge=0)
    """one tiny eager op, no autograd."""
    op_overhead_s: float = Field(ge=0)
    """per op as the planner counts them (3 per forward node + 10 per AdamW tensor)."""
    tp_op_overhead_s: float = Field(ge=0)
    """per DTensor op as the planner counts them (15 per styled call)."""
    dtensor_optimizer_op_s: float | None = Field(default=None, ge=0)
    """extra per AdamW op on a sharded DTensor parameter (10 ops per tensor)."""
    rel_rms: float = Field(ge=0)
    detail: str = ""


class Fits(_Frozen):
    matmul: dict[str, Fit] = Field(default_factory=dict)
    """per dtype: t = launch overhead + flops / achieved FLOP/s."""
    sdpa: dict[str, Fit] = Field(default_factory=dict)
    memory: Fit | None = None
    overhead: OverheadFit | None = None
    collectives: list[CollectiveFit] = Field(default_factory=list)
    links: dict[str, Link] = Field(default_factory=dict)
    """link class -> the ring-model fit over every collective kind (what the planner uses)."""


class Profile(_Frozen):
    """A device + link profile: measured (``plan profile``) or from the datasheet."""

    version: Literal[1] = PROFILE_VERSION
    source: Literal["measured", "datasheet"]
    name: str
    """e.g. ``cpu:2 measured on <host>`` or ``H100 datasheet``."""
    device: DeviceSpec
    """the fitted (or datasheet) device: what the planner uses."""
    intra_node: Link
    inter_node: Link
    backend: Literal["gloo", "nccl"]
    world_size: int = Field(ge=1)
    """ranks profiled at once (processes on one node)."""
    quick: bool = False
    created: str = ""
    host: str = ""
    torch_version: str = ""
    elapsed_s: float = Field(default=0.0, ge=0)
    assumptions: list[str] = Field(default_factory=list)
    """each assumption behind a figure, with its source (datasheet profiles)."""
    fits: Fits = Field(default_factory=Fits)
    samples: list[Sample] = Field(default_factory=list)

    def summary(self) -> str:
        d = self.device
        lines = [
            f"profile {self.name} (source {self.source}, version {self.version})",
            f"  matmul fp32 {d.peak_flops['fp32'] * d.matmul_efficiency:.3g} FLOP/s, "
            f"bf16 {d.peak_flops.get('bf16', 0) * d.matmul_efficiency:.3g} FLOP/s",
            f"  memory {d.memory_bandwidth_bytes_per_s * d.memory_efficiency:.3g} B/s, "
            f"op overhead {d.op_overhead_s * 1e6:.3g} us, DTensor op {d.tp_op_overhead_s * 1e6:.3g} us",
            f"  intra-node link {self.intra_node.name}: latency {self.intra_node.latency_s * 1e6:.3g}"
            f" us/step, busbw {self.intra_node.bandwidth_bytes_per_s:.3g} B/s",
        ]
        for c in self.fits.collectives:
            lines.append(
                f"  {c.kind:<15} n={c.group_size}: alpha {c.fit.intercept_s * 1e6:8.1f} us, "
                f"beta {c.fit.rate:.3g} B/s, rms {c.fit.rel_rms:.1%}, x ring {c.ring_ratio:.2f}"
            )
        return "\n".join(lines)


# -- loading and applying --------------------------------------------------------------------------


def load_profile(path: str | os.PathLike) -> Profile:
    """Read and validate a profile JSON; raises :class:`ProfileError` with one line."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ProfileError(
            f"profile {str(p)!r} not found: run `plan profile --cluster ... --out {p}`"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ProfileError(f"profile {str(p)!r} cannot be read ({e}): regenerate it") from None
    return parse_profile(text, where=str(p))


def parse_profile(text: str, where: str = "profile") -> Profile:
    return parse_versioned(
        text,
        Profile,
        PROFILE_VERSION,
        error=ProfileError,
        kind=f"{where}: profile" if where != "profile" else "profile",
        regenerate="regenerate it with `plan profile`",
        field_fix="regenerate the profile",
    )


def apply_profile(cluster: Cluster, profile: Profile) -> Cluster:
    """``cluster`` with the profile's DeviceSpec (memory kept from the cluster) and Links.

    The profile must describe the cluster's device: the same catalog name, and for CPU clusters
    the same number of processes (oversubscription changes every figure). A profile measured on
    one node keeps the cluster's inter-node link when the cluster has several nodes.
    """
    dev = cluster.device
    if profile.device.kind != dev.kind or profile.device.name != dev.name:
        raise ProfileError(
            f"profile {profile.name!r} is for device {profile.device.name!r}, the cluster "
            f"{cluster.spec!r} has {dev.name!r}: profile this cluster or pick its profile"
        )
    if dev.kind == "cpu" and profile.world_size != cluster.devices_per_node:
        raise ProfileError(
            f"profile {profile.name!r} was measured with {profile.world_size} processes, the "
            f"cluster {cluster.spec!r} runs {cluster.devices_per_node}: CPU figures depend on the "
            f"process count; run `plan profile --cluster {cluster.spec}`"
        )
    device = profile.device.model_copy(update={"memory_bytes": dev.memory_bytes})
    inter = profile.inter_node
    if profile.source == "measured" and cluster.num_nodes > 1:
        inter = cluster.inter_node  # one node measured: nothing known about the network
    return cluster.model_copy(
        update={"device": device, "intra_node": profile.intra_node, "inter_node": inter}
    )


# -- datasheet profiles ----------------------------------------------------------------------------


def datasheet_profile(device_name: str) -> Profile:
    """The catalog's figures for a GPU as a Profile (``source: "datasheet"``), every efficiency
    assumption stated with its source (see :mod:`cost_model.catalog`)."""
    from autopar.cost_model import catalog

    name = catalog.canonical_name(device_name)
    if name == "cpu":
        raise ProfileError(
            "there is no datasheet profile for cpu: measure one with `plan profile --cluster cpu:N`"
        )
    dev = catalog.device(name)
    intra, inter = catalog.gpu_links(name)
    return Profile(
        source="datasheet",
        name=f"{name} datasheet",
        device=dev,
        intra_node=intra,
        inter_node=inter,
        backend="nccl",
        world_size=1,
        assumptions=catalog.datasheet_assumptions(name),
    )


# -- the benchmarks (run on every rank under torchrun) -----------------------------------------


def _sizes(quick: bool, kind: str, is_gpu: bool) -> list:
    if kind == "matmul":
        squares = [64, 128, 256, 512] if quick else [32, 64, 128, 256, 512, 768, 1024]
        if is_gpu:
            squares = [256, 1024, 2048, 4096] if quick else [256, 512, 1024, 2048, 4096, 8192]
        shapes = [(n, n, n) for n in squares]
        # transformer-like: many tokens against a narrow hidden size
        shapes += [(2048, 64, 256), (2048, 256, 64)] if not is_gpu else [(16384, 4096, 4096)]
        return shapes
    if kind == "elementwise":
        exps = [10, 14, 18, 22] if quick else [10, 12, 14, 16, 18, 20, 22, 24]
        if is_gpu:
            exps = [16, 20, 24, 28] if quick else [14, 16, 18, 20, 22, 24, 26, 28]
        return [2**e for e in exps]
    if kind == "sdpa":
        seqs = [64, 256] if quick else [64, 128, 256, 512]
        if is_gpu:
            seqs = [512, 2048] if quick else [512, 1024, 2048, 4096]
        return [(2, 4, s, d) for s in seqs for d in (16, 64)]
    if kind == "collective":
        top = 24 if quick else 28  # 16 MB / 256 MB
        step = 5 if quick else 2
        return [2 ** (10 + i) for i in range(0, top - 10 + 1, step)] + ([2**24] if quick else [])
    raise ValueError(kind)


class _Progress:
    """A progress display on stderr (rank 0): rich's bar if installed, else a plain line."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self._bar = None
        if enabled:
            try:
                from rich.progress import Progress

                self._bar = Progress(transient=False)
                self._bar.start()
                self._task = self._bar.add_task("profiling", total=total)
            except ImportError:
                self._bar = None

    def step(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, advance=1, description=f"profiling {what:<28}")
        else:
            print(f"\rprofiling [{self.done}/{self.total}] {what:<40}", end="", file=sys.stderr)
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            if self._bar is not None:
                self._bar.stop()
            else:
                print(file=sys.stderr)


class _Worker:
    def __init__(self, quick: bool) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.quick = quick
        self.is_gpu = torch.cuda.is_available()
        if self.is_gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            self.device = torch.device("cuda")
            backend = "nccl"
        else:
            self.device = torch.device("cpu")
            backend = "gloo"
        timeout = _dt.timedelta(seconds=float(os.environ.get("DIST_TIMEOUT_S", 300)))
        dist.init_process_group(backend, timeout=timeout)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.samples: list[dict] = []
        self.budget_s = 0.15 if quick else 0.4  # timed seconds per point, about

    def sync(self) -> None:
        if self.is_gpu:
            self.torch.cuda.synchronize()

    def _agree(self, value: float) -> float:
        """The max of ``value`` over the ranks (so every rank runs as many repeats)."""
        t = self.torch.tensor([value], dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t.item())

    def _mean(self, value: float) -> float:
        t = self.torch.tensor([value], dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(t)
        return float(t.item()) / self.world

    def time(self, fn, group=None, inner: int = 1) -> tuple[float, int]:
        """Median seconds of one call of ``fn`` (``inner`` calls per timed repeat) over repeats
        sized to the budget; every rank runs the same repeats; averaged over ranks."""
        fn()
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        first = self._agree(time.perf_counter() - t0)
        reps = int(min(50 if self.quick else 100, max(3, self.budget_s / max(first, 1e-7))))
        if inner == 1 and first < 2e-4:
            inner = int(min(1000, max(1, 2e-3 / max(first, 1e-7))))
        times = []
        for _ in range(reps):
            if group is not None:
                self.dist.barrier(group=group)
            self.sync()
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            self.sync()
            times.append((time.perf_counter() - t0) / inner)
        return self._mean(statistics.median(times)), reps

    def add(self, **kw) -> None:
        self.samples.append(kw)

    # -- compute
    def matmul(self, progress: _Progress) -> None:
        torch = self.torch
        for dtype in ("fp32", "bf16"):
            tdt = torch.float32 if dtype == "fp32" else torch.bfloat16
            for m, k, n in _sizes(self.quick, "matmul", self.is_gpu):
                a = torch.randn(m, k, device=self.device, dtype=tdt)
                b = torch.randn(k, n, device=self.device, dtype=tdt)
                out = torch.empty(m, n, device=self.device, dtype=tdt)
                t, reps = self.time(lambda a=a, b=b, out=out: torch.mm(a, b, out=out))
                self.add(bench="matmul", op="mm", dtype=dtype, shape=[m, k, n],
                         flops=2.0 * m * k * n, time_s=t, reps=reps)  # fmt: skip
                progress.step(f"matmul {dtype} {m}x{k}x{n}")

    def elementwise(self, progress: _Progress) -> None:
        torch = self.torch
        for numel in _sizes(self.quick, "elementwise", self.is_gpu):
            x = torch.randn(numel, device=self.device)
            y, z = torch.randn_like(x), torch.empty_like(x)
            t, reps = self.time(lambda x=x, y=y, z=z: torch.add(x, y, out=z))
            self.add(bench="elementwise", op="add", shape=[numel], bytes=3.0 * 4 * numel,
                     flops=float(numel), time_s=t, reps=reps)  # fmt: skip
            progress.step(f"add {numel * 4 // 1024} KB")

    def sdpa(self, progress: _Progress) -> None:
        torch = self.torch
        F = torch.nn.functional
        dtype = "bf16" if self.is_gpu else "fp32"
        tdt = torch.bfloat16 if self.is_gpu else torch.float32
        for b, h, s, d in _sizes(self.quick, "sdpa", self.is_gpu):
            q, k, v = (torch.randn(b, h, s, d, device=self.device, dtype=tdt) for _ in range(3))
            t, reps = self.time(
                lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
            )
            self.add(bench="sdpa", op="sdpa", dtype=dtype, shape=[b, h, s, d],
                     flops=4.0 * b * h * s * s * d, time_s=t, reps=reps)  # fmt: skip
            progress.step(f"sdpa s={s} d={d}")

    def overhead(self, progress: _Progress) -> None:
        torch = self.torch
        a, b, c = torch.ones(4, device=self.device), torch.ones(4, device=self.device), None
        c = torch.empty(4, device=self.device)
        t, reps = self.time(lambda: torch.add(a, b, out=c), inner=2000)
        self.add(bench="eager_op", op="add", shape=[4], time_s=t, reps=reps)
        progress.step("eager op")
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        dev_type = "cuda" if self.is_gpu else "cpu"
        mesh = init_device_mesh(dev_type, (self.world, 1), mesh_dim_names=("dp", "tp"))
        from torch.distributed.tensor import Shard, distribute_tensor

        for dt in (False, True):
            params = []
            for _ in range(OPT_TENSORS):
                w = torch.randn(64, 16, device=self.device)
                if dt:  # sharded over every rank, as FSDP2 holds parameters
                    w = distribute_tensor(w, mesh["dp"], [Shard(0)])
                params.append(torch.nn.Parameter(w))
            for q in params:
                q.grad = torch.ones_like(q)
            opt = torch.optim.AdamW(params, lr=1e-4)
            t, reps = self.time(opt.step)
            self.add(bench="train_step", op="adamw_dtensor" if dt else "adamw",
                     shape=[OPT_TENSORS], time_s=t, reps=reps)  # fmt: skip
            progress.step(f"adamw{' dtensor' if dt else ''}")
        for depth in MLP_DEPTHS:
            for tp in (False, True):
                torch.manual_seed(0)
                model = tiny_mlp(depth, MLP_WIDTH).to(self.device)
                if tp:
                    plan = {}
                    for i in range(depth):
                        plan[f"blocks.{i}.up"] = ColwiseParallel()
                        plan[f"blocks.{i}.down"] = RowwiseParallel()
                    parallelize_module(model, mesh["tp"], plan)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
                x = torch.randn(MLP_BATCH, MLP_WIDTH, device=self.device)

                def step(model=model, opt=opt, x=x) -> None:
                    model(x).square().mean().backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)

                for _ in range(3):
                    step()
                t, reps = self.time(step)
                self.add(bench="train_step", op="mlp_tp" if tp else "mlp",
                         shape=[depth, MLP_WIDTH], time_s=t, reps=reps)  # fmt: skip
                progress.step(f"mlp step depth {depth}{' tp' if tp else ''}")

    def block(self, progress: _Progress) -> None:
        """Forward + backward of the reference transformer block at two depths (no optimizer:
        the step's compute as the planner's compute term counts it), plain and, with more
        than one rank, data-parallel over every rank under DDP and FSDP2."""
        torch = self.torch
        dim, heads, batch, seq, dtype = block_shape(self.is_gpu)
        name = "bf16" if dtype == "bfloat16" else "fp32"
        wraps = (None, "ddp", "fsdp") if self.world > 1 else (None,)
        for depth in BLOCK_DEPTHS:
            x = torch.randn(batch, seq, dim, device=self.device, dtype=getattr(torch, dtype))
            for wrap in wraps:
                t, reps = self.time(self._block_step(wrap, depth, dim, heads, x))
                self.add(bench="train_step", op="block" if wrap is None else f"block_{wrap}",
                         dtype=name, shape=[depth, dim, heads, batch, seq],
                         group_size=1 if wrap is None else self.world, time_s=t, reps=reps)  # fmt: skip
                progress.step(f"block fwd+bwd depth {depth}{f' {wrap}' if wrap else ''}")

    def _block_step(self, wrap: str | None, depth: int, dim: int, heads: int, x):
        """One warmed-up fwd+bwd step of the reference block, wrapped in DDP / FSDP2 or not."""
        torch = self.torch
        torch.manual_seed(0)
        model = reference_block(depth, dim, heads).to(self.device, x.dtype)
        if wrap == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        elif wrap == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cuda" if self.is_gpu else "cpu", (self.world,))
            for b in model.blocks:
                fully_shard(b, mesh=mesh)
            fully_shard(model, mesh=mesh)

        def step() -> None:
            model(x).float().square().mean().backward()
            for q in model.parameters():
                q.grad = None

        for _ in range(3):
            step()
        return step

    # -- communication
    def collectives(self, progress: _Progress) -> None:
        torch, dist = self.torch, self.dist
        sizes = _sizes(self.quick, "collective", self.is_gpu)
        for g in group_sizes(self.world):
            group, _ = dist.new_subgroups(g)
            for kind in COLLECTIVES:
                if kind == "send_recv" and g != 2:
                    continue
                for nbytes in sizes:
                    fn = self._collective(kind, nbytes, g, group)
                    t, reps = self.time(fn, group=group)
                    self.add(bench="collective", op=kind, group_size=g, bytes=float(nbytes),
                             time_s=t, reps=reps)  # fmt: skip
                    progress.step(f"{kind} n={g} {_human(nbytes)}")
                    del fn
        del torch

    def _collective(self, kind: str, nbytes: int, g: int, group):
        torch, dist = self.torch, self.dist
        numel = max(g, nbytes // 4 // g * g)
        x = torch.ones(numel, device=self.device)
        if kind == "all_reduce":
            return lambda: dist.all_reduce(x, group=group)
        if kind == "all_gather":
            part = x[: numel // g].clone()
            return lambda: dist.all_gather_into_tensor(x, part, group=group)
        if kind == "reduce_scatter":
            part = torch.empty(numel // g, device=self.device)
            return lambda: dist.reduce_scatter_tensor(part, x, group=group)
        if kind == "all_to_all":
            out = torch.empty_like(x)
            return lambda: dist.all_to_all_single(out, x, group=group)
        if kind == "send_recv":
            ranks = dist.get_process_group_ranks(group)
            me = ranks.index(self.rank)
            peer = ranks[1 - me]
            if me == 0:
                return lambda: dist.send(x, dst=peer)
            return lambda: dist.recv(x, src=peer)
        raise ValueError(kind)

    def finish(self) -> None:
        self.dist.barrier()
        self.dist.destroy_process_group()


MLP_DEPTHS = (1, 6)
MLP_WIDTH = 16
MLP_BATCH = 8
OPT_TENSORS = 16


def tiny_mlp(depth: int, width: int):
    """The residual MLP the overhead benchmark trains (tiny: its time is all op overhead)."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.up = nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(depth))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    return MLP()


BLOCK_DEPTHS = (1, 3)


def block_shape(is_gpu: bool) -> tuple[int, int, int, int, str]:
    """(dim, heads, batch, seq, torch dtype name) of the reference block benchmark: compute
    dominates its launch overhead on both kinds of device."""
    return (1024, 16, 8, 1024, "bfloat16") if is_gpu else (128, 4, 4, 64, "float32")


def reference_block(depth: int, dim: int, heads: int):
    """A stack of pre-norm transformer blocks (causal SDPA attention, GELU MLP): the op mix of
    the decoder models autopar plans, for ``compute_scale``."""
    import torch
    from torch import nn

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(dim, 3 * dim)
            self.proj = nn.Linear(dim, dim)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(b, s, dim))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.attn = Attention()
            self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

        def forward(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x))))

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(depth))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    return Stack()


def group_sizes(world: int) -> list[int]:
    return [g for g in range(2, world + 1) if world % g == 0]


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.0f}"


def _worker_main(out: str, quick: bool) -> int:
    w = _Worker(quick)
    plan = [w.matmul, w.elementwise, w.sdpa, w.overhead, w.block, w.collectives]
    total = (
        2 * len(_sizes(quick, "matmul", w.is_gpu))
        + len(_sizes(quick, "elementwise", w.is_gpu))
        + len(_sizes(quick, "sdpa", w.is_gpu))
        + 1
        + 2 * len(MLP_DEPTHS)
        + 2
        + len(BLOCK_DEPTHS) * (3 if w.world > 1 else 1)
        + sum(
            (len(COLLECTIVES) - (g != 2)) * len(_sizes(quick, "collective", w.is_gpu))
            for g in group_sizes(w.world)
        )
    )
    progress = _Progress(total, enabled=w.rank == 0)
    try:
        for bench in plan:
            bench(progress)
    finally:
        progress.close()
    if w.rank == 0:
        meta = {
            "world_size": w.world,
            "backend": "nccl" if w.is_gpu else "gloo",
            "torch_version": w.torch.__version__,
            "gpu": w.torch.cuda.get_device_name() if w.is_gpu else None,
            "threads": w.torch.get_num_threads(),
        }
        Path(out).write_text(json.dumps({"meta": meta, "samples": w.samples}))
    w.finish()
    return 0


# -- fitting ---------------------------------------------------------------------------------------


def _ring(kind: str, n: int) -> tuple[float, int]:
    from autopar.cost_model.estimate import _ring as ring

    return ring(kind, n)


def _planner_op_counts(depth: int) -> tuple[int, int, int]:
    """(compute nodes, parameter tensors, styled linear calls) of ``tiny_mlp(depth)`` as the
    planner's graph counts them (traced on meta)."""
    import torch
    from autopar.ir.trace import trace

    with torch.device("meta"):
        model = tiny_mlp(depth, MLP_WIDTH)
        x = torch.zeros(MLP_BATCH, MLP_WIDTH)
    graph = trace(model, (x,), saved_for="cpu")
    nodes = sum(1 for n in graph.nodes if n.kind == "compute")
    tensors = sum(1 for _ in model.parameters())
    return nodes, tensors, 2 * depth


def fit_samples(
    samples: list[Sample], base: DeviceSpec, base_link: Link
) -> tuple[Fits, DeviceSpec, Link]:
    """Fit the samples; returns (fits, the fitted DeviceSpec, the fitted intra-node Link).
    Figures with no samples keep ``base``'s / ``base_link``'s."""
    by = lambda bench, **kw: [  # noqa: E731
        s for s in samples if s.bench == bench and all(getattr(s, k) == v for k, v in kw.items())
    ]
    matmul = {}
    for dtype in ("fp32", "bf16"):
        pts = by("matmul", dtype=dtype)
        if len(pts) >= 2:
            matmul[dtype] = Fit.of(fit_linear([s.flops for s in pts], [s.time_s for s in pts]))
    sdpa = {}
    for dtype in ("fp32", "bf16"):
        pts = by("sdpa", dtype=dtype)
        if len(pts) >= 2:
            sdpa[dtype] = Fit.of(fit_linear([s.flops for s in pts], [s.time_s for s in pts]))
    pts = by("elementwise")
    memory = Fit.of(fit_linear([s.bytes for s in pts], [s.time_s for s in pts])) if pts else None
    overhead = _fit_overhead(samples)

    update: dict = {"matmul_efficiency": 1.0, "memory_efficiency": 1.0}
    peak = dict(base.peak_flops)
    for dtype, f in matmul.items():
        peak[dtype] = f.rate
    update["peak_flops"] = peak
    if memory is not None:
        update["memory_bandwidth_bytes_per_s"] = memory.rate
    if overhead is not None:
        update["op_overhead_s"] = overhead.op_overhead_s
        update["tp_op_overhead_s"] = overhead.tp_op_overhead_s
        update["dtensor_optimizer_op_s"] = overhead.dtensor_optimizer_op_s
    if base.kind == "cpu":
        # CPU vector units: elementwise FLOP/s are memory-bound; keep the fp32 matmul figure
        update["vector_flops"] = {d: peak["fp32"] for d in peak}
    else:  # GPU: keep the matmul efficiency relative to the datasheet peak
        update["peak_flops"] = base.peak_flops
        update["matmul_efficiency"] = min(
            1.0, *(matmul[d].rate / base.peak_flops[d] for d in matmul if d in base.peak_flops)
        ) if matmul else base.matmul_efficiency  # fmt: skip
        if memory is not None:
            update["memory_bandwidth_bytes_per_s"] = base.memory_bandwidth_bytes_per_s
            update["memory_efficiency"] = min(1.0, memory.rate / base.memory_bandwidth_bytes_per_s)
    update["source"] = (
        "fitted by cost_model.profile: "
        + ", ".join(
            f"matmul {d} {f.rate:.3g} FLOP/s (rms {f.rel_rms:.0%})" for d, f in matmul.items()
        )
        + (f", memory {memory.rate:.3g} B/s" if memory else "")
        + (
            f", op {overhead.op_overhead_s * 1e6:.3g} us, DTensor op "
            f"{overhead.tp_op_overhead_s * 1e6:.3g} us"
            if overhead
            else ""
        )
    )
    device = base.model_copy(update=update)
    scale = _fit_compute_scale(samples, device)
    if scale is not None:
        device = device.model_copy(update={
            "compute_scale": scale[0],
            "source": device.source + f", compute x{scale[0]:.2f} ({scale[1]})",
        })  # fmt: skip
    collectives, link = _fit_collectives(samples, base_link)
    wrap = _fit_wrapper_overheads(samples, link)
    if wrap:
        device = device.model_copy(update={
            **wrap,
            "source": device.source
            + (f", DDP all-reduce x{wrap['ddp_comm_scale']:.2f} in a step"
               if "ddp_comm_scale" in wrap else "")
            + (f", FSDP2 {wrap['fsdp_tensor_overhead_s'] * 1e6:.3g} us per tensor"
               if "fsdp_tensor_overhead_s" in wrap else ""),
        })  # fmt: skip
    DeviceSpec.model_validate(device.model_dump())  # the update passed every check

    fits = Fits(
        matmul=matmul,
        sdpa=sdpa,
        memory=memory,
        overhead=overhead,
        collectives=collectives,
        links={"intra_node": link} if collectives else {},
    )
    return fits, device, link


def _fit_compute_scale(samples: list[Sample], device: DeviceSpec) -> tuple[float, str] | None:
    """(compute_scale, detail): the reference block's measured forward + backward against the
    planner's prediction for its traced graph (``cost_model.estimate.graph_time_s``, op overhead
    included), the roofline part scaled so the two agree (least squares over the depths)."""
    pts = [s for s in samples if s.bench == "train_step" and s.op == "block"]
    if not pts:
        return None
    import torch
    from autopar.cost_model.estimate import graph_time_s
    from autopar.ir.trace import trace

    plain = device.model_copy(update={"compute_scale": 1.0})
    rooflines, rest = [], []
    for s in pts:
        depth, dim, heads, batch, seq = s.shape
        with torch.device("meta"):
            model = reference_block(depth, dim, heads)
            x = torch.zeros(batch, seq, dim)
        dt = torch.bfloat16 if s.dtype == "bf16" else None
        graph = trace(model, (x,), dtype=dt, saved_for="cuda" if device.kind == "gpu" else "cpu")
        nodes = sum(1 for n in graph.nodes if n.kind == "compute" and n.out is not None)
        overhead = PLANNER_OPS_PER_NODE * nodes * device.op_overhead_s
        rooflines.append(graph_time_s(graph, plain, s.dtype or "fp32") - overhead)
        rest.append(s.time_s - overhead)
    if min(rest) <= 0:
        return None
    theta, _ = nonneg_lstsq([rooflines], rest)
    if theta[0] <= 0:
        return None
    detail = (
        f"reference block fwd+bwd {[round(s.time_s * 1e3, 3) for s in pts]} ms vs roofline "
        f"{[round(r * 1e3, 3) for r in rooflines]} ms"
    )
    return float(theta[0]), detail


def _fit_wrapper_overheads(samples: list[Sample], link: Link) -> dict[str, float]:
    """What DDP and FSDP2 cost inside the reference block's data-parallel step beyond its plain
    step: DDP as a multiple of the gradient all-reduce the planner charges (``ddp_comm_scale``),
    FSDP2 as time per parameter tensor beyond its collectives (two all-gathers and a
    reduce-scatter per unit: ``fsdp_tensor_overhead_s``); least squares through the origin over
    the depths. (On 2 CPU processes the DDP excess followed the gradient bytes, 2-4x the isolated
    all-reduce, alike at both depths, while FSDP2's followed its per-tensor work.)"""
    from autopar.cost_model.estimate import collective_time_s

    plain = {tuple(s.shape): s for s in samples if s.bench == "train_step" and s.op == "block"}
    out = {}
    for wrap in ("ddp", "fsdp"):
        pts = [s for s in samples if s.bench == "train_step" and s.op == f"block_{wrap}"]
        xs, extra = [], []
        for s in pts:
            if tuple(s.shape) not in plain:
                continue
            depth, dim, heads = s.shape[:3]
            numel, per_block = _block_params(dim, heads)
            unit = numel * (2 if s.dtype == "bf16" else 4)  # one block's parameter bytes
            n, excess = s.group_size, s.time_s - plain[tuple(s.shape)].time_s
            if wrap == "ddp":
                xs.append(collective_time_s("all_reduce", depth * unit, n, link))
                extra.append(excess)
            else:
                comm = depth * (2 * collective_time_s("all_gather", unit, n, link)
                                + collective_time_s("reduce_scatter", unit, n, link))  # fmt: skip
                xs.append(per_block * depth)
                extra.append(excess - comm)
        if xs and min(extra) > 0:
            theta, _ = nonneg_lstsq([xs], extra)
            key = "ddp_comm_scale" if wrap == "ddp" else "fsdp_tensor_overhead_s"
            out[key] = max(1.0, float(theta[0])) if wrap == "ddp" else float(theta[0])
    return out


def _block_params(dim: int, heads: int) -> tuple[int, int]:
    """(parameters, parameter tensors) of one reference block, counted on meta."""
    import torch

    with torch.device("meta"):
        params = list(reference_block(1, dim, heads).parameters())
    return sum(p.numel() for p in params), len(params)


def _fit_overhead(samples: list[Sample]) -> OverheadFit | None:
    eager = [s.time_s for s in samples if s.bench == "eager_op"]
    plain = {s.shape[0]: s.time_s for s in samples if s.bench == "train_step" and s.op == "mlp"}
    tp = {s.shape[0]: s.time_s for s in samples if s.bench == "train_step" and s.op == "mlp_tp"}
    if len(plain) < 2:
        return None
    depths = sorted(plain)
    counts = {d: _planner_op_counts(d) for d in depths}
    ops = [
        PLANNER_OPS_PER_NODE * counts[d][0] + ADAMW_OPS_PER_TENSOR_CPU * counts[d][1]
        for d in depths
    ]
    _, per_op, rms = fit_slope(ops, [plain[d] for d in depths])
    per_tp = 0.0
    if len(tp) == len(plain):
        calls = [TP_OPS_PER_STYLED_CALL * counts[d][2] for d in depths]
        _, per_tp, _ = fit_slope(calls, [tp[d] - plain[d] for d in depths])
    adamw = {s.op: s for s in samples if s.bench == "train_step" and s.op.startswith("adamw")}
    opt_op = None
    if {"adamw", "adamw_dtensor"} <= set(adamw):
        extra = adamw["adamw_dtensor"].time_s - adamw["adamw"].time_s
        opt_op = max(0.0, extra / (ADAMW_OPS_PER_TENSOR_CPU * adamw["adamw"].shape[0]))
    return OverheadFit(
        dtensor_optimizer_op_s=opt_op,
        eager_op_s=min(eager) if eager else 0.0,
        op_overhead_s=max(0.0, per_op),
        tp_op_overhead_s=max(0.0, per_tp),
        rel_rms=rms,
        detail=(
            f"MLP depths {depths}: planner ops {ops}, step {[round(plain[d], 6) for d in depths]} s"
            + (f", TP'd step {[round(tp[d], 6) for d in depths]} s" if tp else "")
        ),
    )


def _fit_collectives(samples: list[Sample], base: Link) -> tuple[list[CollectiveFit], Link]:
    """Per kind and group size, ``t = alpha + bytes / beta``; the link's own latency and
    bandwidth are the point-to-point (send/recv) fit where measured, else the ring model fitted
    over every kind: ``t = latency * steps(kind, n) + factor(kind, n) * bytes / busbw``."""
    coll = [s for s in samples if s.bench == "collective"]
    if not coll:
        return [], base
    rows = [_ring(s.op, s.group_size) for s in coll]
    theta, rel = nonneg_lstsq(
        [[steps for _, steps in rows], [f * s.bytes for s, (f, _) in zip(coll, rows)]],
        [s.time_s for s in coll],
    )
    latency = float(theta[0])
    busbw = 1.0 / float(theta[1]) if theta[1] > 0 else base.bandwidth_bytes_per_s
    ring_rms = math.sqrt(sum(r * r for r in rel) / len(rel))
    fits = []
    for kind in COLLECTIVES:
        for g in sorted({s.group_size for s in coll if s.op == kind}):
            pts = [s for s in coll if s.op == kind and s.group_size == g]
            if len(pts) < 2:
                continue
            f = Fit.of(fit_linear([s.bytes for s in pts], [s.time_s for s in pts]))
            factor, steps = _ring(kind, g)
            ratios = [s.time_s / (latency * steps + factor * s.bytes / busbw) for s in pts]
            fits.append(
                CollectiveFit(
                    kind=kind,
                    group_size=g,
                    link="intra_node",
                    fit=f,
                    ring_ratio=statistics.median(ratios),
                )  # fmt: skip
            )
    p2p = next((c.fit for c in fits if c.kind == "send_recv"), None)
    measured = tuple(
        CollectiveCost(
            kind=c.kind,
            group_size=c.group_size,
            alpha_s=c.fit.intercept_s,
            bytes_per_s=c.fit.rate,
        )  # fmt: skip
        for c in fits
        if c.kind != "send_recv"
    )
    name = base.name.removesuffix("-fitted") + "-fitted"
    link = Link(
        name=name,
        bandwidth_bytes_per_s=p2p.rate if p2p else busbw,
        latency_s=p2p.intercept_s if p2p else latency,
        measured=measured,
        source=(
            f"fitted by cost_model.profile from {len(coll)} collective samples: latency and "
            f"bandwidth {'of send/recv' if p2p else 'of the ring model over every kind'}; "
            f"per-kind costs in 'measured' (the ring model alone: latency {latency * 1e6:.3g} us"
            f"/step, busbw {busbw:.3g} B/s, relative rms {ring_rms:.0%})"
        ),
    )
    return fits, link


def build_profile(raw: dict, cluster: Cluster, *, quick: bool, elapsed_s: float) -> Profile:
    samples = [Sample.model_validate(s) for s in raw["samples"]]
    fits, device, link = fit_samples(samples, cluster.device, cluster.intra_node)
    meta = raw["meta"]
    inter = link if cluster.device.kind == "cpu" else cluster.inter_node
    return Profile(
        source="measured",
        name=f"{cluster.spec} measured on {platform.node()}",
        device=device,
        intra_node=link,
        inter_node=inter,
        backend=meta["backend"],
        world_size=meta["world_size"],
        quick=quick,
        created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        host=platform.node(),
        torch_version=meta["torch_version"],
        elapsed_s=elapsed_s,
        assumptions=[
            f"{meta['threads']} torch thread(s) per process, as torchrun sets OMP_NUM_THREADS",
            "collective times are the median over repeats (a barrier before each), averaged "
            "over ranks",
            "a measured profile is exact for this process count only",
        ],
        fits=fits,
        samples=samples,
    )


def run_profile(cluster_spec: str, *, quick: bool = False, timeout_s: float = 1800) -> Profile:
    """Profile ``cluster_spec`` (one node: ``devices_per_node`` ranks under torchrun)."""
    from autopar.cost_model.cluster import parse_cluster

    cluster = parse_cluster(cluster_spec)
    nproc = cluster.devices_per_node
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="autopar-profile-") as tmp:
        out = Path(tmp) / "samples.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "autopar.cost_model.profile",
            "--worker",
            str(out),
        ] + (["--quick"] if quick else [])
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "DIST_TIMEOUT_S": "300"}
        if cluster.device.kind == "cpu":
            env.setdefault("OMP_NUM_THREADS", "1")
        proc = subprocess.run(
            cmd, stdout=subprocess.PIPE, stderr=None, text=True, timeout=timeout_s, env=env
        )
        if proc.returncode != 0 or not out.exists():
            raise ProfileError(
                f"profiling {cluster_spec} failed (torchrun exit {proc.returncode}): see the "
                "messages above"
            )
        raw = json.loads(out.read_text())
    return build_profile(raw, cluster, quick=quick, elapsed_s=time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    """``plan profile --cluster SPEC --out profile.json [--quick]``; exit 0, or 2 with one
    ``error:`` line."""
    p = argparse.ArgumentParser(prog="plan profile", description="Profile a cluster's devices.")
    p.add_argument("--cluster", default=None, help="cpu:N, or a GPU node such as 8xH100")
    p.add_argument("--out", default=None, help="where to write the profile JSON")
    p.add_argument("--quick", action="store_true", help="a reduced sweep (~1 min on cpu:2)")
    p.add_argument("--datasheet", action="store_true", help="write the datasheet profile")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return _worker_main(args.worker, args.quick)
    try:
        if not args.cluster or not args.out:
            raise ProfileError("plan profile needs --cluster SPEC and --out FILE.json")
        from autopar.cost_model.cluster import parse_cluster

        cluster = parse_cluster(args.cluster)
        if args.datasheet:
            profile = datasheet_profile(cluster.device.name)
        else:
            if cluster.device.kind == "gpu":
                _require_gpus(cluster)
            profile = run_profile(args.cluster, quick=args.quick)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(profile.model_dump_json(indent=1))
        tmp.replace(out)
    except (ProfileError, ClusterSpecError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(profile.summary(), file=sys.stderr)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _require_gpus(cluster: Cluster) -> None:
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < cluster.devices_per_node:
        raise ProfileError(
            f"--cluster {cluster.spec} needs {cluster.devices_per_node} GPUs on this node, found "
            f"{have}: profile on a node of the cluster, or use --datasheet"
        )


if __name__ == "__main__":
    sys.exit(main())
