"""Device, link and cluster specs: frozen, validated pydantic data."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    model_validator,
)

from autopar.errors import UserError

Dtype = Literal["fp32", "bf16"]

# The largest world the search is sized for: mesh enumeration is linear in it (720720 devices
# plan in ~13 s); a bigger count is a typo. Checked for --cluster and for a loaded plan alike.
MAX_WORLD_SIZE = 2**20

# Bounds that keep every figure finite through the cost model (bytes over a rate, a count times
# a time, a sum of bytes as a float): a value outside them is a typo or an overflow in waiting,
# never a machine (1e-300 B/s, 10**400 bytes). Infinity and NaN are refused everywhere.
MIN_RATE, MAX_RATE = 1.0, 1e30
"""bytes/s and FLOP/s."""
MAX_SECONDS = 3600.0
"""a latency or per-op overhead."""
MAX_MEMORY_BYTES = 2**60
"""1 EiB per device."""
MIN_SCALE, MAX_SCALE = 1e-6, 1e6
"""a measured ratio (compute_scale, ddp_comm_scale)."""

Rate = Annotated[float, Field(ge=MIN_RATE, le=MAX_RATE, allow_inf_nan=False)]
Seconds = Annotated[float, Field(ge=0, le=MAX_SECONDS, allow_inf_nan=False)]
Scale = Annotated[float, Field(ge=MIN_SCALE, le=MAX_SCALE, allow_inf_nan=False)]
MemoryBytes = Annotated[int, Field(gt=0, le=MAX_MEMORY_BYTES)]


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
    alpha_s: Seconds
    bytes_per_s: Rate


class Link(_Frozen):
    """A communication link class (intra-node or inter-node)."""

    name: str
    """e.g. ``nvlink4``, ``ib-ndr400``, ``gloo-loopback``."""
    bandwidth_bytes_per_s: Rate
    """bus bandwidth a collective achieves per rank, as nccl-tests reports ``busbw``."""
    latency_s: Seconds
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
    memory_bytes: MemoryBytes
    """usable device memory per rank."""
    peak_flops: dict[Dtype, Rate]
    """dense peak FLOP/s per compute dtype (the matmul units: tensor cores for bf16)."""
    vector_flops: dict[Dtype, Rate] = Field(default_factory=dict)
    """peak FLOP/s of non-matmul ops (CUDA cores, CPU vector units); a missing dtype: peak_flops."""
    memory_bandwidth_bytes_per_s: Rate
    matmul_efficiency: float = Field(gt=0, le=1)
    """fraction of peak that large matmuls reach."""
    memory_efficiency: float = Field(gt=0, le=1)
    """fraction of peak memory bandwidth that memory-bound ops reach."""
    op_overhead_s: Seconds
    """fixed time per launched op (kernel launch / framework dispatch)."""
    op_row_s: Seconds = 0.0
    """time per launched op per row of its output (its elements over the last dim) beyond the
    roofline: what narrow rows cost (per-row loops of norms and softmax, attention per head,
    short vectors), so that a layer's time neither scales with its width alone nor stays
    fixed with its batch. ``plan profile`` fits it with ``compute_scale`` and
    ``op_overhead_s`` from the reference block at two widths and two batches; 0 for datasheet
    figures."""
    tp_op_overhead_s: Seconds = 0.0
    """extra dispatch time per op that runs on DTensors under tensor parallelism."""
    optimizer_op_s: Seconds | None = None
    """fixed time per optimizer op on a plain tensor (AdamW's element-wise ops, no autograd);
    None: ``op_overhead_s``. ``plan profile`` measures it apart from ``op_overhead_s`` (a
    forward or backward op with autograd recording): on this 2-core CPU 3.9 us against 16 us."""
    dtensor_optimizer_op_s: Seconds | None = None
    """extra time per optimizer op on a DTensor parameter (FSDP2 shards); None:
    ``tp_op_overhead_s``."""
    ddp_comm_scale: Scale = 1.0
    """DDP's gradient all-reduces inside a training step over their time alone, measured by
    ``plan profile`` (on CPU the cores that compute also run gloo, and the ranks wait for each
    other there); its per-tensor work is ``ddp_tensor_overhead_s``; 1 for datasheet figures."""
    fsdp_tensor_overhead_s: Seconds = 0.0
    """FSDP2's time per parameter tensor per step beyond its all-gathers and reduce-scatters
    (copy-in/out, DTensor wrapping, hooks), measured likewise; 0 for datasheet figures."""
    tp_collective_overhead_s: Seconds = 0.0
    """time per blocking collective inside a layer beyond the collective itself (the wait for
    the other ranks inside a step, the Python wrappers around the call), measured by ``plan
    profile`` on tensor parallelism's: the tiny MLP tensor-parallel over every rank against
    the same on a one-rank mesh, its collectives' fitted time taken out. Charged on TP's
    collectives, context parallel's keys and values, expert parallel's all-to-alls and the
    loop's totals after the gradient norm (:func:`cost_model.estimate.blocking_collective_s`; the name is the profile's key since it
    was TP's alone); 0 for datasheet figures."""
    ddp_tensor_overhead_s: Seconds = 0.0
    """DDP's own time per parameter tensor per step, its all-reduces aside (the gradient hook,
    the copy into the bucket and out of it), measured by ``plan profile`` as DDP with a comm
    hook that reduces nothing against no wrapper; 0 for datasheet figures (and profiles made
    before 2026-12-06, whose ``ddp_comm_scale`` holds it)."""
    pipeline_action_s: Seconds | None = None
    """host time per action of torch's pipeline runtime (a stage's forward or backward of one
    microbatch: scheduling, p2p set-up and waits, shape checks) beyond the stage's compute and
    the p2p the stage search charges, with one process per core; ``plan profile`` measures it on
    a two-stage pipeline of tiny stages. None: :data:`cost_model.step.PP_ACTION_S` of the kind."""
    checkpoint_layer_s: Seconds | None = None
    """fixed time per checkpointed layer per microbatch beyond its recomputed forward
    (checkpoint_wrapper's saved-tensor hooks, RNG state); ``plan profile`` measures it on the
    tiny MLP with every block wrapped. None: :data:`cost_model.step.CKPT_WRAPPER_S` of the kind."""
    host_cpus: PositiveInt | None = None
    """CPU cores of the host the device's processes share (cpu devices: ``os.cpu_count()`` of
    the machine the cluster was parsed on); None: one core per process."""
    compute_scale: Scale = 1.0
    """training forward + backward time over the roofline's: measured by ``plan profile`` on a
    reference transformer block (backward kernels, transposed matmuls, the autograd engine and
    the allocator cost what isolated microbenchmarks do not show); 1 for datasheet figures."""
    allocator_headroom_bytes: Annotated[int, Field(ge=0, le=MAX_MEMORY_BYTES)] = 0
    """bytes the process holds above its live tensors at its memory peak, at most the step's
    transient bytes (:mod:`cost_model.peak`): freed blocks the allocator keeps resident (glibc's
    heap on CPU, the caching allocator's fragmentation on GPU); measured by
    benchmarks/memory.py, fitted by ``plan --refit`` from a run's profile; 0 for datasheet
    figures."""
    source: str = ""
    """where the figures come from."""


class NodeGroup(_Frozen):
    """Nodes of one kind within a cluster of several (``2x8xH100+2x8xA100-80GB``): its device,
    node count and links; every group has the cluster's devices_per_node."""

    device: DeviceSpec
    num_nodes: PositiveInt
    devices: PositiveInt
    """the group's devices (ranks): num_nodes x the cluster's devices_per_node; CPU groups
    are groups of processes on one host (the cluster is then one node of them all)."""
    intra_node: Link
    inter_node: Link
    """between this group's nodes."""


class Cluster(_Frozen):
    """num_nodes x devices_per_node devices: of one kind, or of several (``groups``: nodes of
    one kind each, ranks numbered group after group). ``device`` is then the uniform treatment
    every term can read: the slowest group's device with the smallest group's memory; the
    planner reads ``groups`` where a group's own speed matters (which stages, what batch
    share: :mod:`planner.groups`)."""

    spec: str
    """what the user typed (``cpu:4``, ``8xH100``, a file path), kept for the plan and messages."""
    device: DeviceSpec
    num_nodes: PositiveInt
    devices_per_node: PositiveInt
    intra_node: Link
    inter_node: Link
    """between nodes (with groups: the slowest link between any two nodes)."""
    backend: Literal["gloo", "nccl"]
    groups: tuple[NodeGroup, ...] = ()
    """empty for a cluster of one kind; else at least two, in rank order."""

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.devices_per_node

    @property
    def heterogeneous(self) -> bool:
        return len(self.groups) > 1

    def total_peak_flops(self, dtype: str) -> float | None:
        """Every rank's peak FLOP/s at ``dtype`` summed, each group at its own device's (MFU's
        denominator: the uniform device's peak times the world would put a mixed cluster's MFU
        above 100%); None where a device has no figure for ``dtype``."""
        parts = [(g.device, g.devices) for g in self.groups] or [(self.device, self.world_size)]
        peaks = [(dev.peak_flops.get(dtype), n) for dev, n in parts]
        if any(not peak for peak, _ in peaks):
            return None
        return sum(peak * n for peak, n in peaks)

    def group_of_rank(self, rank: int) -> int:
        """The index of the group that holds global ``rank`` (0 for a cluster of one kind)."""
        for g, group in enumerate(self.groups):
            if rank < group.devices:
                return g
            rank -= group.devices
        return 0

    @model_validator(mode="after")
    def _check_backend(self) -> Cluster:
        if self.device.kind == "cpu" and self.backend != "gloo":
            raise ValueError("a cpu cluster uses the gloo backend")
        if self.world_size > MAX_WORLD_SIZE:
            raise ValueError(
                f"{self.num_nodes} x {self.devices_per_node} = {self.world_size} devices is more "
                f"than the {MAX_WORLD_SIZE} autopar plans for: check the node and device counts"
            )
        if self.device.kind == "gpu" and self.backend != "nccl":
            raise ValueError("a gpu cluster uses the nccl backend (gloo has no GPU collectives)")
        if len(self.groups) == 1:
            raise ValueError("a cluster of one kind has no groups: leave 'groups' out")
        if self.groups and sum(g.devices for g in self.groups) != self.world_size:
            raise ValueError(
                f"the groups' devices ({' + '.join(str(g.devices) for g in self.groups)}) are "
                f"not the cluster's {self.world_size}"
            )
        if any(g.device.kind != self.device.kind for g in self.groups):
            raise ValueError("every group of a cluster is of one kind: all gpu or all cpu")
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
