"""The profile's storage: the versioned profile JSON (raw samples, fitted parameters, residuals)
as frozen pydantic data, loading it (``version`` checked, one line on any problem), applying it
to a Cluster, and the datasheet profile that stands in where nothing was measured.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Literal

from autopar.cost_model.estimate import (
    ADAMW_OPS_PER_TENSOR,
    OPS_PER_NODE,
)
from autopar.cost_model.fit import LinearFit
from autopar.cost_model.spec import Cluster, DeviceSpec, Link
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

    bench: Literal[
        "matmul", "elementwise", "sdpa", "eager_op", "train_step", "collective", "pipeline"
    ]
    op: str
    """mm, add, sdpa, mlp, mlp_tp, mlp_fb, mlp_fb_tp, mlp_fwd, mlp_fb_ckpt, block, adamw,
    adamw_dtensor, the collective kind, or the pipeline schedule (1f1b)."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    shape: list[int] = Field(default_factory=list)
    """matmul (m, k, n); sdpa (b, h, s, d); elementwise (numel,); train_step (depth, width), for
    block (depth, dim, heads, batch, seq); pipeline (microbatches, width, microbatch size)."""
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
    """per op as the planner counts them (3 per forward node; from the forward + backward of
    the tiny MLP alone where the profile has it, else also 10 per AdamW tensor of its step)."""
    optimizer_op_s: float | None = Field(default=None, ge=0)
    """per AdamW op on a plain tensor (10 per tensor), its traffic taken out; None: an older
    profile, op_overhead_s."""
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


BUSY_HOST_CORES = 0.2
"""Other work on the host, in cores averaged over a profile, above which ``plan profile`` warns:
on 2026-12-06 a few seconds of one core's other work beside a 20-s quick profile of cpu:2
priced every calibrate plan 7-102% too slow and changed the GPT's plan to one that ran 19%
slower."""


class Profile(_Frozen):
    """A device + link profile: measured (``plan profile``) or from the datasheet."""

    version: Literal[1] = PROFILE_VERSION
    source: Literal["measured", "datasheet", "refit"]
    """refit: ``plan --refit`` fitted it to runs' profiles (cost_model.refit)."""
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
    host_busy_cores: float | None = Field(default=None, ge=0)
    """cores' worth of CPU the host spent on other work than the profile's processes while it
    ran (:class:`cost_model.profile.HostLoad`; None: not measured). Above
    :data:`BUSY_HOST_CORES` the timings were taken on a busy host."""
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
        if (busy := self.busy_host()) is not None:
            lines.append(f"  warning: {busy}")
        return "\n".join(lines)

    def busy_host(self) -> str | None:
        """One line where other work took more than :data:`BUSY_HOST_CORES` of the host while
        this profile was measured, else None."""
        busy = self.host_busy_cores
        if busy is None or busy <= BUSY_HOST_CORES:
            return None
        return (
            f"other processes used {busy:.2f} cores of this host while it was profiled (more "
            f"than {BUSY_HOST_CORES}): its timings, and the plans made with them, may be slow; "
            "profile again on an idle host"
        )


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
    if profile.source != "datasheet" and cluster.num_nodes > 1:
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
