"""Checkpoints under --checkpoint-dir: save (atomically, a folder per step), resume (from the
latest complete one, under any plan), and what follows each step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from .batch import DataStream
from .common import Constants, Part, fail, write_line
from .loop import LRSchedule, collective_device
from .tensor_parallel import from_storage, storage_form
from .trust import SafeLoadPlanner, SafeReader, lock_checkpoint_dir, trusted_dir_problem

__all__ = [
    "COMPLETE",
    "STATE_OPTIONS",
    "training_state",
    "save_checkpoint",
    "keep_aside",
    "complete_steps",
    "latest_complete_step",
    "check_checkpoint_dir",
    "check_same_model",
    "state_bytes",
    "full_disk",
    "resume",
    "all_finite",
    "check_finite",
    "after_step",
    "PROGRESS",
    "log_elastic_start",
]

# --checkpoint-dir holds a folder per saved step, step_<N>/: DCP's .metadata, a .distcp file per
# rank, and COMPLETE, which rank 0 writes last. A save writes .tmp-step_<N>/, and rank 0 renames
# it to step_<N>/ once every rank's files and the marker are in, so a save cut short leaves a
# .tmp- folder (deleted at the next start) and only a step_<N>/ holding COMPLETE is ever loaded.
# A start resumes from the complete checkpoint with the largest N.
#
# The model and optimizer are saved under the model's own parameter names (get_state_dict drops
# the DDP and checkpoint wrappers; FSDP and TP parameters are DTensors, stored shard by shard; a
# pipeline rank holds only its stages', and the union over ranks is the whole model), so another
# plan of the same model loads them: DCP reshards. With them go the step, which is also the data
# position (each step seeds its own batch), and each rank's RNG states.
COMPLETE = "COMPLETE"
# An elastic run (ELASTIC_PLANS) also keeps, in --checkpoint-dir, the last step it finished and
# the mesh it ran on, replaced after every step by rank 0: the next start (another node count,
# after a node left or joined) says from it how many steps since the checkpoint were lost.
PROGRESS = "elastic-progress.json"


# Optimizer state keyed by parameter name, not position: it reshards across plans and stages.
STATE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def training_state(
    parts: list[Part],
    step: int,
    device: torch.device,
    data: DataStream | None = None,
    schedule: LRSchedule | None = None,
) -> tuple[dict, list]:
    """The state to save (or load into), and the keys of each (module, optimizer) part in it;
    ``schedule``: the LRSchedule (its steps done and base lr)."""
    rng = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    state = {"model": {}, "optimizer": {}, "step": torch.tensor(step), "rng": {}}
    state["rng"][f"rank{dist.get_rank()}"] = rng
    if data is not None:  # the data stream's position (see DataStream)
        state["data"] = data.state(step)
    if schedule is not None:
        state["lr_schedule"] = schedule.state_dict()
    keys = []
    for module, optimizer in parts:
        model_state, optimizer_state = get_state_dict(module, optimizer, options=STATE_OPTIONS)
        state["model"] |= model_state
        state["optimizer"] |= optimizer_state
        keys.append((list(model_state), list(optimizer_state)))
    return state, keys


def save_checkpoint(
    c: Constants,
    directory: Path,
    step: int,
    parts: list[Part],
    device: torch.device,
    data: DataStream | None = None,
    schedule: LRSchedule | None = None,
) -> None:
    if not all_finite(parts):  # never publish weights a later run would resume from
        fail(
            f"step {step}: the parameters hold non-finite values (training diverged); not "
            "saved. Lower --lr; checkpoints already saved are kept"
        )
    start = time.perf_counter()
    tmp, final = directory / f".tmp-step_{step}", directory / f"step_{step}"
    stored = training_state(parts, step, device, data, schedule)[0]
    storage_form(stored)
    why = ""
    try:
        dcp.save(stored, checkpoint_id=tmp)
    except (Exception, dcp.CheckpointException) as e:  # a full disk, on any rank: every rank's
        why = _why(e)
    if not _agree(why) and dist.get_rank() == 0:
        try:
            with open(tmp / COMPLETE, "w") as f:
                json.dump({"step": step, "world_size": c.WORLD_SIZE, "mesh": c.MESH}, f)
                f.flush()
                os.fsync(f.fileno())
            if final.exists():
                keep_aside(final)
            os.rename(tmp, final)
            _fsync(directory)  # make the rename durable
        except OSError as e:
            why = _why(e)
    why = _agree(why)  # every rank stops alike, and none restarts on a disk that stays full
    if why:
        why = full_disk(why, directory, state_bytes(stored))
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # this save's own part-written files
        kept = complete_steps(directory)
        fail(
            f"step {step}: saving the checkpoint to {directory} failed ({why}); not restarted. "
            + (f"The earlier checkpoints (step_{kept[0]}, ...) are kept: " if kept else "")
            + "free space on that disk (or give another --checkpoint-dir), then run the same "
            "command again to resume"
        )
    if dist.get_rank() == 0:
        seconds = time.perf_counter() - start
        print(f"checkpoint: saved step {step} to {final} in {seconds:.2f} s", flush=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def keep_aside(path: Path) -> Path:
    """Rename the step_N folder a new save of step N would replace, never deleting it: one
    resume skipped as unreadable (``step_N.unreadable``), or one without its COMPLETE marker
    (``step_N.incomplete``: autopar renames a checkpoint into place only once it is complete,
    so that is a copy or another tool's). The new name is never taken for a checkpoint."""
    kind = "unreadable" if (path / COMPLETE).is_file() else "incomplete"
    aside, n = path.with_name(f"{path.name}.{kind}"), 1
    while aside.exists():
        aside, n = path.with_name(f"{path.name}.{kind}.{n}"), n + 1
    os.rename(path, aside)
    print(f"warning: checkpoint {path} ({kind}) is kept as {aside.name}", file=sys.stderr)
    return aside


def complete_steps(directory: Path) -> list[int]:
    """The N of every step_<N>/ holding COMPLETE in ``directory``, newest first; names are
    matched exactly (step_0007 is not step 7)."""
    steps = []
    for path in directory.glob("step_*"):
        number = path.name.removeprefix("step_")
        if number.isdigit() and path.name == f"step_{int(number)}" and (path / COMPLETE).is_file():
            steps.append(int(number))
    return sorted(steps, reverse=True)


def latest_complete_step(directory: Path) -> int:
    """The largest N of a step_<N>/ holding COMPLETE in ``directory`` (0: none)."""
    return max(complete_steps(directory), default=0)


def check_checkpoint_dir(directory: Path) -> None:
    """--checkpoint-dir before any collective: a directory (or a path one can be made at) this
    user owns, writable, not writable by others (trusted input: see check_trusted_dir), and no
    symlinked .tmp-step_N in it (the start tidies those up, and never follows a link)."""
    if directory.exists() and not directory.is_dir():
        fail(f"--checkpoint-dir {directory} is not a directory: give a directory path")
    existing = directory if directory.exists() else directory.parent
    while not existing.exists():
        existing = existing.parent
    if not os.access(existing, os.W_OK | os.X_OK):
        fail(f"--checkpoint-dir {directory} is not writable by this user: give a writable path")
    if directory.exists():
        why = trusted_dir_problem(directory)
        if why:
            fail(f"--checkpoint-dir {why}")
        links = [p.name for p in directory.glob(".tmp-step_*") if p.is_symlink()]
        if links:
            fail(
                f"--checkpoint-dir {directory} holds {links[0]}, a symlink where autopar keeps a "
                "save in progress (it would delete what the link points to): remove the link "
                f"({directory / links[0]}), or use another directory"
            )


def check_same_model(path: Path, state: dict, saved: dict) -> None:
    """Fail (every rank alike) when the checkpoint's model differs from this one: a parameter
    missing from it, one it has that the model lacks, or one of another shape."""
    mine = {}
    for key, t in state["model"].items():
        mine[f"model.{key}"] = tuple(t.shape)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    union = {k: v for d in everyone for k, v in d.items()}
    stored = {
        k: tuple(m.size) for k, m in saved.items() if k.startswith("model.") and hasattr(m, "size")
    }
    problems = [f"{k[6:]} is missing from it" for k in union if k not in stored]
    problems += [f"it has {k[6:]}, which this model lacks" for k in stored if k not in union]
    problems += [
        f"{k[6:]} has shape {list(stored[k])} there, {list(v)} here"
        for k, v in union.items()
        if k in stored and stored[k] != v
    ]
    if problems:
        message = (
            f"the checkpoint {path} is of another model: {problems[0]}"
            + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
            + "; use the checkpoint directory of this model, or another --checkpoint-dir"
        )
        fail(message)


def _why(error: BaseException) -> str:
    """One line of what went wrong reading a checkpoint: DCP's CheckpointException (a
    BaseException, raised on every rank alike) names the rank that failed and its error."""
    where = ""
    if isinstance(error, dcp.CheckpointException) and error.failures:
        rank, failure = next(iter(error.failures.items()))
        error = failure[0] if isinstance(failure, tuple) else failure
        where = f"rank {rank}: "
    text = str(error).splitlines()[0] if str(error) else ""
    text = text if len(text) <= 120 else text[:117] + "..."
    return f"{where}{type(error).__name__}" + (f": {text}" if text else "")


def state_bytes(state: Any) -> int:
    """The bytes this rank writes of ``state`` (a nested dict; DTensors: the local shard)."""
    total = 0
    for t in pytree.tree_leaves(state):
        if isinstance(t, torch.Tensor):
            local = t.to_local() if isinstance(t, DTensor) else t
            total += local.numel() * local.element_size()
    return total


def full_disk(why: str, directory: Path, needed: int) -> str:
    """``why`` a write into ``directory`` failed, said plainly when its disk has less free
    space than this rank's ``needed`` bytes (torch.save reports a full disk as "unexpected pos",
    not ENOSPC)."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return why
    if free >= needed and "No space left" not in why:
        return why
    return f"the disk is full: {free / 2**20:.1f} MiB free, this save needs {needed / 2**20:.1f} MiB; {why}"


def _agree(why: str) -> str:
    """Every rank's verdict on one checkpoint: "" when it read back on all of them, else the
    first failure (the same answer on every rank, so all of them fall back together)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, why)
    return next((w for w in everyone if w), "")


def resume(
    directory: Path,
    parts: list[Part],
    device: torch.device,
    data: DataStream | None = None,
    schedule: LRSchedule | None = None,
) -> int:
    """Take ``directory``'s lock, then load its newest complete checkpoint that reads back on
    every rank and return its step (0: the directory holds no complete checkpoint).

    A checkpoint that does not read back (a truncated or corrupt .metadata or shard, a folder
    holding only its COMPLETE marker), on any rank, is skipped by all ranks with one warning
    line, and the previous complete one is tried, and so on; it is left in place (see
    save_checkpoint). When none reads back, that is one error line: a run never starts from
    step 1 over a directory of checkpoints it silently ignored. ``schedule`` (the LRSchedule)
    continues from the saved one (a checkpoint without one: at its step)."""
    info = [None]
    if dist.get_rank() == 0:  # rank 0 locks, looks, and tidies up what a crashed save left
        refused = lock_checkpoint_dir(directory)
        if not refused:
            for tmp in directory.glob(".tmp-step_*"):  # a crashed save's (links: refused)
                if not tmp.is_symlink():
                    shutil.rmtree(tmp)
        info = [(refused, complete_steps(directory) if not refused else [])]
    dist.broadcast_object_list(info, src=0)  # all ranks load the same checkpoint
    refused, candidates = info[0]
    if refused:
        fail(refused)
    skipped = []
    for number in candidates:
        path = directory / f"step_{number}"
        saved, why = {}, ""
        try:
            saved = SafeReader(path).read_metadata().state_dict_metadata
        except (Exception, dcp.CheckpointException) as e:  # a missing or truncated .metadata
            why = _why(e)
        why = _agree(why)  # before check_same_model's collective: every rank takes one path
        if not why:
            use_data = data if "data.position" in saved else None
            use_schedule = schedule if "lr_schedule.done" in saved else None
            state, keys = training_state(parts, 0, device, use_data, use_schedule)
            check_same_model(path, state, saved)
            rng_key = f"rng.rank{dist.get_rank()}.cpu"
            if rng_key not in saved:  # saved by a plan with fewer ranks: keep this rank's RNG
                del state["rng"]
            # state holds the live parameters and optimizer state (get_state_dict's tensors):
            # a load that fails part-way leaves some of them overwritten, but the next
            # checkpoint's load, which must succeed on every rank to be used, overwrites every
            # one of them again (DCP refuses a checkpoint lacking any key); when none loads,
            # the run stops.
            try:
                pairs = storage_form(state)
                dcp.load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner())
                from_storage(pairs)
            except (Exception, dcp.CheckpointException) as e:  # a truncated or corrupt shard
                why = _why(e)
            why = _agree(why)
        if not why:
            break
        skipped.append(f"{path.name} ({why})")
        if dist.get_rank() == 0:
            print(
                f"warning: checkpoint {path} is unreadable ({why}); it is kept as it is, "
                "and the previous complete checkpoint is tried",
                file=sys.stderr,
                flush=True,
            )
    else:
        if skipped:
            fail(
                f"no checkpoint in --checkpoint-dir {directory} reads back ("
                + "; ".join(skipped)
                + "): restore a readable copy, or move them out of the directory (or give "
                "another --checkpoint-dir) to train from step 1; nothing was deleted"
            )
        return 0
    for (module, optimizer), (model_keys, optimizer_keys) in zip(parts, keys):
        set_state_dict(
            module,
            optimizer,
            model_state_dict={k: state["model"][k] for k in model_keys},
            optim_state_dict={k: state["optimizer"][k] for k in optimizer_keys},
            options=STATE_OPTIONS,
        )
    if "rng" in state:
        rng = state["rng"][f"rank{dist.get_rank()}"]
        torch.set_rng_state(rng["cpu"])
        if device.type == "cuda" and "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"], device)
    step = int(state["step"])
    if "data" in state:
        data.restore(state["data"], step)
    if "lr_schedule" in state:
        schedule.load_state_dict(state["lr_schedule"])
    elif schedule is not None:
        schedule.load_state_dict({"done": step, "base": schedule.base})
    if dist.get_rank() == 0:
        print(f"checkpoint: resumed from step {step} ({path})", flush=True)
    return step


def all_finite(parts: list[Part]) -> bool:
    """Whether every parameter of every rank is finite (all ranks get the same answer)."""
    bad = torch.zeros((), dtype=torch.int64, device=collective_device())
    with torch.no_grad():  # summed on the device: one sync for the whole model, not one a tensor
        for module, _ in parts:
            for p in module.parameters():
                local = p.to_local() if isinstance(p, DTensor) else p
                bad += (~torch.isfinite(local)).any().to(bad.device)
    dist.all_reduce(bad)
    return bad.item() == 0


def check_finite(step: int, loss: float, ref_losses: list[float]) -> None:
    """Stop at the first non-finite loss (every rank holds the same all-reduced value), before
    anything is saved: one line, exit 2."""
    values = [("loss", loss)] + [("--verify reference's loss", v) for v in ref_losses[-1:]]
    for name, value in values:
        if not math.isfinite(value):
            fail(
                f"step {step}: the {name} is {value} (not finite): training diverged; lower --lr "
                "or fix the model/data. Checkpoints already saved are kept; none of this step is "
                "saved"
            )


def after_step(
    c: Constants,
    args: argparse.Namespace,
    step: int,
    parts: list[Part],
    device: torch.device,
    data: DataStream | None = None,
    schedule: LRSchedule | None = None,
) -> None:
    """What follows a logged step: the checkpoint it is due (every --checkpoint-every steps and
    after the last)."""
    every = args.checkpoint_every or args.steps
    if args.checkpoint_dir is not None and (step % every == 0 or step == args.steps):
        save_checkpoint(c, args.checkpoint_dir, step, parts, device, data, schedule)
    if c.ELASTIC_PLANS and args.checkpoint_dir is not None and dist.get_rank() == 0:
        record = {"step": step, "world_size": c.WORLD_SIZE, "mesh": c.MESH}
        tmp = args.checkpoint_dir / f".{PROGRESS}.tmp"
        tmp.write_text(json.dumps(record) + "\n")
        os.replace(tmp, args.checkpoint_dir / PROGRESS)


def _read_record(path: Path) -> dict:
    """A small JSON record autopar wrote ({} where missing or unreadable)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def log_elastic_start(c: Constants, directory: Path | None, step: int) -> None:
    """Rank 0's one JSON line as an elastic run starts: the nodes, ranks and mesh it runs on;
    those of the run before it (its progress record, else the checkpoint's marker); the step
    it resumed from (0: none) and the steps the run before finished past it, now lost."""
    if dist.get_rank() != 0:
        return
    before = _read_record(directory / PROGRESS) if directory is not None else {}
    if step and not before:
        before = _read_record(directory / f"step_{step}" / COMPLETE)
    world = before.get("world_size")
    last = before.get("step", step)
    record = {
        "elastic": "start",
        "nodes": max(1, c.WORLD_SIZE // c.RANKS_PER_NODE),
        "world_size": c.WORLD_SIZE,
        "mesh": c.MESH,
        "previous_nodes": max(1, world // c.RANKS_PER_NODE) if isinstance(world, int) else None,
        "previous_world_size": world,
        "previous_mesh": before.get("mesh"),
        "resumed_from_step": step,
        "steps_lost": max(0, last - step) if isinstance(last, int) else None,
    }
    write_line(json.dumps(record))
