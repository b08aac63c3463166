"""A rank's peak memory in a training step: the larger of two moments, plus the allocator's headroom.

Per rank (bytes, local shards), with S = parameters + optimizer state + persistent buffers
(DDP's gradient buckets, FSDP's unit transients, autocast's weight copies, the GPU reserve):

  backward   the rank's gradients and saved activations as the backward finds them, plus the
             loss on the rank that computes it (:func:`loss_bytes`)
  optimizer  G + the model output the loop still holds + the optimizer's temporaries
             (:func:`optimizer_temp_bytes`)
  peak       S + max(backward, optimizer) + headroom
  headroom   min(``DeviceSpec.allocator_headroom_bytes``, the larger moment): what the process
             holds above the live tensors at its peak because freed transients stay resident
             (CPU: glibc keeps freed heap blocks, up to its trim threshold, twice its dynamic
             mmap threshold, at most 64 MiB; GPU: the caching allocator's fragmentation), never
             more than the step frees; a coefficient of the device, measured by
             benchmarks/memory.py (its RSS high-water mark against its tensor-level peak)

The backward's moment with one microbatch on the rank (no accumulation, no pipeline): layers run
backward last to first, each freeing its saved activations and allocating its gradients, so
    backward = O + max(A + 3 O, max_i (sum_{j >= i} g_j + sum_{j < i} a_j + r_i))
with a_j layer j's saved activations (what a checkpointed layer holds), g_j its gradients, r_i
the recompute of layer i when checkpointed, O the model's output (held by the loop). With
several microbatches the gradients of the first stay allocated while the next ones' activations
are saved: backward = G + A + the loss's bytes.

The loss (cross-entropy or MSE over the output, the default ``loss_fn``): the output O (logits)
is held, the loss saves a tensor of its size (log-probabilities, or the difference), and its
backward makes the gradients of both: 4 O at the start of the backward. A pipeline's last stage
holds them for each microbatch in flight (the stage plan's activations): torch.distributed.
pipelining, stepped with ``return_outputs=False`` as the emitted program does, frees a
microbatch's output and loss tensors with its backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from autopar.cost_model.spec import DeviceSpec

LOSS_COPIES = 3
"""beyond the output itself: the loss's saved tensor, its gradient and the output's gradient."""
CPU_ADAMW_TEMPS = 2
"""torch's for-loop AdamW (CPU's default): ``exp_avg_sq.sqrt() / bias_correction2_sqrt`` makes two
tensors of the parameter's size at once (measured: two 16 MiB allocations for a 16 MiB weight)."""
GPU_ADAMW_TEMPS = 1
"""torch's foreach AdamW (the default on CUDA): ``_foreach_sqrt`` of every moment of a dtype group
at once: one copy of the rank's trainable parameters in fp32."""


def loss_bytes(output_bytes: float) -> float:
    """The loss's bytes at the start of the backward: the model output the loop holds and the
    loss's own copies."""
    return output_bytes * (1 + LOSS_COPIES)


def optimizer_temp_bytes(
    device: DeviceSpec,
    optimizer: Literal["adamw", "sgd"],
    largest_tensor_bytes: float,
    trainable_fp32_bytes: float,
    fused: bool = False,
) -> float:
    """The optimizer step's temporaries on a rank: AdamW for-loop (CPU) two copies of the largest
    local trainable tensor (fp32), foreach (GPU) one copy of all of them, fused (``fused``:
    torchtitan's default, Megatron-LM's FusedAdam) none; SGD without momentum or weight decay
    updates in place."""
    if optimizer != "adamw" or fused:
        return 0.0
    if device.kind == "cpu":
        return CPU_ADAMW_TEMPS * largest_tensor_bytes
    return GPU_ADAMW_TEMPS * trainable_fp32_bytes


def single_pass_backward_bytes(
    layer_acts: Sequence[float],
    layer_grads: Sequence[float],
    output_bytes: float,
    recompute: Sequence[float] | None = None,
) -> float:
    """The backward's moment with one microbatch (the module docstring's formula): layers in
    forward order, ``layer_acts`` what each holds saved, ``layer_grads`` its gradients'
    bytes, ``recompute`` the transient of re-running a checkpointed layer (0 otherwise)."""
    n = len(layer_acts)
    recompute = recompute or [0.0] * n
    worst = sum(layer_acts) + LOSS_COPIES * output_bytes
    held, grads = sum(layer_acts), 0.0
    for i in reversed(range(n)):  # layer i's gradients appear before its activations go
        grads += layer_grads[i]
        worst = max(worst, held + grads + recompute[i])
        held -= layer_acts[i]
    return output_bytes + worst


def headroom_bytes(device: DeviceSpec, transient_bytes: float) -> float:
    """What the allocator holds above the live tensors at the peak (module docstring)."""
    return min(float(device.allocator_headroom_bytes), transient_bytes)
