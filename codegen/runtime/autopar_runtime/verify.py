"""--verify: the sharded run against the single-process model, the tolerances and the verdict.

The reference is the single-process model trained on the global batch whole (loop's
reference_pieces, VERIFY_REFERENCE "global batch"): where the model couples the samples of a
batch (a batch norm in training mode, a contrastive loss) and this run gives each forward a
slice of it, the two differ and the verdict says FAILED, naming the worst tensor and that the
run cut the batch. (Comparing with the same slices run in one process, as --verify did before,
says ok there: both runs compute the per-slice model.)
"""

from __future__ import annotations

import argparse
import logging
import math

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .common import Constants

__all__ = ["tolerances", "unwrapped_name", "verify", "sliced_note"]


def tolerances(c: Constants, args: argparse.Namespace) -> tuple[float, float]:
    """(loss, parameter) tolerances: absolute, and relative to the values' magnitude.

    SGD in fp32 differs from the single-process run only by reduction order: 1e-5. AdamW
    divides by sqrt(v): on a coordinate whose gradient is ~0, 1e-8 of noise can flip the sign
    of its update, so a parameter may move up to lr the other way each step. Parameters then
    get 2 * lr * steps more; the loss, which those coordinates barely move, 1e-4. bf16 rounds
    every matmul to 8 bits of mantissa (2^-8 = 4e-3 relative), and the sharded run rounds
    other partial sums than the reference (a local batch, a TP slice), though both run the same
    precision regime (see Precision): 2e-2. Measured on examples/gpt.py, 3 AdamW steps with
    clipping: losses within 4e-4 and parameters within 3.2e-3 (fsdp=2 with the policy, dp=2
    with autocast, pp=2 x fsdp=2); SGD on fsdp=2: 2e-5 and 7e-7. The total gradient norms must agree to the
    loss tolerance, relative.
    """
    loss_tol = param_tol = 2e-2 if c.DTYPE == "bf16" else 1e-5
    if args.optimizer == "adamw":
        loss_tol = max(loss_tol, 1e-4)
        param_tol += 2 * args.lr * args.steps
    return loss_tol, param_tol


def unwrapped_name(name: str) -> str:
    """A parameter's name in the plain model: drop what DDP, checkpointing and compile add."""
    name = name.removeprefix("module.")
    wrappers = ("_checkpoint_wrapped_module", "_orig_mod")
    return ".".join(part for part in name.split(".") if part not in wrappers)


def verify(
    c: Constants,
    named_params: list[tuple[str, nn.Parameter]],
    reference: nn.Module | None,
    history: dict[str, tuple[list[float], list[float]]],
    args: argparse.Namespace,
    mesh: DeviceMesh,
) -> bool:
    """Compare with the unsharded run; every rank decides the same (from all ranks' findings).

    ``named_params`` are the parameters this rank holds (with a pipeline: its stages'); each is
    compared whole (a DTensor gathered over its sub-mesh) with the reference's of that name.
    ``history``: "loss" and "grad_norm" -> (this run's values per step, the reference's); the
    gradient norms must agree to the loss tolerance, relative (named in the verdict only when
    losses and parameters agree: a wrong weight is the more useful name).
    """
    loss_tol, param_tol = tolerances(c, args)
    worst, worst_ratio = "", 0.0
    losses, ref_losses = history["loss"]
    max_loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    for step, (a, b) in enumerate(zip(losses, ref_losses), 1):
        ratio = abs(a - b) / (loss_tol * (1 + abs(b)))
        if ratio > worst_ratio:
            worst, worst_ratio = f"loss at step {step} diff={abs(a - b):.3e}", ratio
    norm_worst, norm_ratio = "", 0.0  # the same on every rank (all-reduced norms)
    for step, (a, b) in enumerate(zip(*history["grad_norm"]), 1):
        ratio = abs(a - b) / (loss_tol * max(abs(b), 1e-12))
        if ratio > norm_ratio:
            norm_worst, norm_ratio = f"grad_norm at step {step} {a:.6g} vs {b:.6g}", ratio
    # Gathering a parameter sharded on two mesh dims makes torch warn about reduction order; a
    # gather does not reduce, so the comparison is exact. Keep the output to the verdict.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    ref_params = dict(reference.named_parameters())
    max_param_diff = 0.0
    held = []
    # named_parameters has the same order on every rank of a stage's sub-mesh, so the
    # full_tensor gathers line up.
    for name, p in named_params:
        full = p.full_tensor() if isinstance(p, DTensor) else p
        name = unwrapped_name(name)
        assert name in ref_params, f"parallel parameter {name!r} has no unsharded counterpart"
        held.append(name)
        ref = ref_params[name]
        diff = (full.detach() - ref.detach()).abs().max().item()
        max_param_diff = max(max_param_diff, diff)
        ratio = diff / (param_tol * (1 + ref.detach().abs().max().item()))
        if ratio > worst_ratio:
            worst, worst_ratio = f"{name} diff={diff:.3e}", ratio
    # Every parameter must be held by some rank (a pipeline stage's, an ep rank's experts).
    held_by_pp_ranks = [None] * dist.get_world_size()
    dist.all_gather_object(held_by_pp_ranks, held)
    missing = set(ref_params).difference(*held_by_pp_ranks)
    if missing:
        worst, worst_ratio = f"parameters held by no rank: {sorted(missing)}", math.inf
    # Every rank's findings to every rank (each pipeline rank saw only its own stages): all
    # decide alike, and rank 0 names the worst tensor over all ranks.
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, (worst_ratio, worst, max_param_diff))
    worst_ratio, worst, _ = max(found, key=lambda f: f[0])
    max_param_diff = max(f[2] for f in found)
    if worst_ratio <= 1 < norm_ratio:
        worst, worst_ratio = norm_worst, norm_ratio
    ok = worst_ratio <= 1
    seen = getattr(args, "dropout_off", None)
    note = " (dropout off in both runs)" if seen is not None and seen.seen else ""
    if dist.get_rank() == 0:
        if ok:
            print(
                f"verify: ok max_loss_diff={max_loss_diff:.3e} max_param_diff={max_param_diff:.3e}"
                + note
            )
        else:
            print(
                f"verify: FAILED {worst} (tolerance: loss {loss_tol:.1e}, params {param_tol:.1e})"
                + note
                + sliced_note(c)
            )
    return ok


def sliced_note(c: Constants) -> str:
    """Where the reference trained on the global batch whole and this run on pieces of it: a
    model that couples the samples of its batch differs for that reason alone (the plan's
    batch_coupling names what couples, and the fix)."""
    pieces = c.data_parallel * (c.MICROBATCHES if c.MESH["pp"] > 1 else c.ACCUMULATION_STEPS)
    if c.VERIFY_REFERENCE != "global batch" or pieces == 1:
        return ""
    return (
        f"; the reference trained on the global batch of {c.GLOBAL_BATCH}, this run on "
        f"{pieces} pieces of it: see plan.json's batch_coupling for a batch norm or a loss "
        "that couples the samples of a batch"
    )
