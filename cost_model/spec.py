"""Device, link and cluster specs: frozen, validated pydantic data."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    model_validator,
)

from autopar.errors import UserError

Dtype = Literal["fp32", "bf16"]


class ClusterSpecError(UserError):
    """An invalid device or cluster spec; the message is one line: value, rule, fix."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class CollectiveCost(_Frozen):
    """A measured collective: ``t = alpha_s + num_bytes / bytes_per_s`` for one kind and group
    size, ``num_bytes`` the full tensor as :func:`cost_model.estimate.collective_time_s` takes it
    (fitted by :mod:`cost_model.profile`)."""

    kind: str
    group_size: int = Field(ge=2)
    alpha_s: float = Field(ge=0)
    bytes_per_s: PositiveFloat


class Link(_Frozen):
    """A communication link class (intra-node or inter-node)."""

    name: str
    """e.g. ``nvlink4``, ``ib-ndr400``, ``gloo-loopback``."""
    bandwidth_bytes_per_s: PositiveFloat
    """bus bandwidth a collective achieves per rank, as nccl-tests reports ``busbw``."""
    latency_s: float = Field(ge=0)
    """fixed cost of one collective or message (alpha)."""
    source: str = ""
    """where the figures come from."""
    measured: tuple[CollectiveCost, ...] = ()
    """profiled per-kind costs; where one covers a collective it replaces the ring model."""


class DeviceSpec(_Frozen):
    """One accelerator (or one CPU process) and what it can do."""

    name: str
    """short name users type: ``H100``, ``A100-80GB``, ``cpu``."""
    kind: Literal["gpu", "cpu"]
    memory_bytes: PositiveInt
    """usable device memory per rank."""
    peak_flops: dict[Dtype, PositiveFloat]
    """dense peak FLOP/s per compute dtype (the matmul units: tensor cores for bf16)."""
    vector_flops: dict[Dtype, PositiveFloat] = Field(default_factory=dict)
    """peak FLOP/s of non-matmul ops (CUDA cores, CPU vector units); a missing dtype: peak_flops."""
    memory_bandwidth_bytes_per_s: PositiveFloat
    matmul_efficiency: float = Field(gt=0, le=1)
    """fraction of peak that large matmuls reach."""
    memory_efficiency: float = Field(gt=0, le=1)
    """fraction of peak memory bandwidth that memory-bound ops reach."""
    op_overhead_s: float = Field(ge=0)
    """fixed time per launched op (kernel launch / framework dispatch)."""
    tp_op_overhead_s: float = Field(default=0.0, ge=0)
    """extra dispatch time per op that runs on DTensors under tensor parallelism."""
    dtensor_optimizer_op_s: float | None = Field(default=None, ge=0)
    """extra time per optimizer op on a DTensor parameter (FSDP2 shards); None:
    ``tp_op_overhead_s``."""
    ddp_comm_scale: PositiveFloat = 1.0
    """DDP's gradient all-reduces inside a training step over their time alone, measured by
    ``plan profile`` (on CPU the cores that compute also run gloo, and DDP copies into buckets);
    1 for datasheet figures."""
    fsdp_tensor_overhead_s: float = Field(default=0.0, ge=0)
    """FSDP2's time per parameter tensor per step beyond its all-gathers and reduce-scatters
    (copy-in/out, DTensor wrapping, hooks), measured likewise; 0 for datasheet figures."""
    compute_scale: PositiveFloat = 1.0
    """training forward + backward time over the roofline's: measured by ``plan profile`` on a
    reference transformer block (backward kernels, transposed matmuls, the autograd engine and
    the allocator cost what isolated microbenchmarks do not show); 1 for datasheet figures."""
    source: str = ""
    """where the figures come from."""


class Cluster(_Frozen):
    """A homogeneous cluster: num_nodes x devices_per_node devices of one kind."""

    spec: str
    """what the user typed (``cpu:4``, ``8xH100``, a file path), kept for the plan and messages."""
    device: DeviceSpec
    num_nodes: PositiveInt
    devices_per_node: PositiveInt
    intra_node: Link
    inter_node: Link
    backend: Literal["gloo", "nccl"]

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.devices_per_node

    @model_validator(mode="after")
    def _check_backend(self) -> Cluster:
        if self.device.kind == "cpu" and self.backend != "gloo":
            raise ValueError("a cpu cluster uses the gloo backend")
        return self


class MemoryBreakdown(_Frozen):
    """Predicted bytes per rank, by kind."""

    params: NonNegativeInt
    grads: NonNegativeInt
    optimizer: NonNegativeInt
    activations: NonNegativeInt
    buffers: NonNegativeInt
    """transients: FSDP all-gather buffers, collective buffers, logits, allocator reserve."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers
