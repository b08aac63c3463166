"""Plans built by hand, for tests that exercise codegen without running the search."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from autopar.cost_model import Cluster, MemoryBreakdown, parse_cluster
from autopar.planner.plan import Mesh, ModelRef, Predicted, Schedule, TimeBreakdown, Training

from autopar import Plan

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "gpt.py")
MLP = str(ROOT / "examples" / "mlp.py")


def tiered(cases, slow: set) -> list:
    """``cases`` as pytest parameters, those in ``slow`` marked slow: the default tier runs each
    feature once, ``make test-all`` every combination. A name in ``slow`` that is not a case is an
    error (a renamed case must not silently leave the default tier)."""
    cases = list(cases)
    unknown = slow - {c if isinstance(c, str) else tuple(c) for c in cases}
    assert not unknown, f"slow cases that do not exist: {sorted(map(str, unknown))}"
    return [
        pytest.param(*(c if isinstance(c, tuple) else (c,)), marks=pytest.mark.slow)
        if (c if isinstance(c, str) else tuple(c)) in slow
        else c
        for c in cases
    ]


def allocator_buffers(memory: MemoryBreakdown) -> int:
    """The buffers of a predicted breakdown less the allocator's headroom they include
    (cost_model.peak: the cpu device's figure, at most the step's moment: activations + grads)."""
    from autopar.cost_model.catalog import cpu_device

    cap = cpu_device().allocator_headroom_bytes
    return memory.buffers - math.ceil(min(cap, memory.activations + memory.grads))


def cpu_cluster(world: int) -> Cluster:
    return parse_cluster(f"cpu:{world}")


def forced_plan(
    model_file: str,
    world: int,
    mesh: dict[str, int],
    tensor_parallel: dict[str, str],
    *,
    global_batch: int = 8,
    seq_len: int | None = 16,
    layers: list[str],
    checkpointing: dict[str, str] | None = None,
    module_attrs: dict[str, dict[str, int]] | None = None,
    optimizer: str = "adamw",
    lr: float = 1e-3,
    stages: list[list[str]] | None = None,
    schedule: dict | None = None,
) -> Plan:
    """A valid Plan with the given mesh and TP styles; predicted figures are zeros.

    ``stages`` (module FQNs per pipeline stage; default: one stage of all ``layers``) and
    ``schedule`` (``{"name", "num_microbatches", "stages_per_rank"}``; default: none) describe a
    pipeline for ``mesh["pp"] > 1``.
    """
    plan_mesh = Mesh(**mesh)
    assert plan_mesh.world_size == world, f"mesh {mesh} is not {world} ranks"
    zero_time = TimeBreakdown(compute=0, exposed_comm=0, bubble=0, optimizer=0)
    zero_memory = MemoryBreakdown(params=0, grads=0, optimizer=0, activations=0, buffers=0)
    return Plan(
        model=ModelRef(file=model_file),
        cluster=cpu_cluster(world),
        training=Training(global_batch=global_batch, seq_len=seq_len, optimizer=optimizer, lr=lr),
        mesh=plan_mesh,
        layers=layers,
        stages=stages if stages is not None else [layers],
        schedule=Schedule(**(schedule or {})),
        tensor_parallel=tensor_parallel,
        module_attrs=module_attrs or {},
        checkpointing=checkpointing or {fqn: "none" for fqn in layers},
        predicted=Predicted(
            step_time_s=0,
            peak_memory_bytes=0,
            memory_breakdown_bytes=zero_memory,
            samples_per_s=0,
            mfu=0,
            time_breakdown_s=zero_time,
        ),
        planning_time_s=0,
    )


def megatron_gpt(num_layers: int = 4) -> dict[str, str]:
    """The Megatron TP plan for examples/gpt.py: attention and MLP split, vocab-parallel ends."""
    plan = {"tok_emb": "rowwise_from_replicate", "head": "colwise_gather"}
    for i in range(num_layers):
        for name in ("attn.q", "attn.k", "attn.v", "mlp.up"):
            plan[f"blocks.{i}.{name}"] = "colwise"
        for name in ("attn.o", "mlp.down"):
            plan[f"blocks.{i}.{name}"] = "rowwise"
    return plan


def megatron_mlp(num_blocks: int = 4) -> dict[str, str]:
    """examples/mlp.py: each block's up projection colwise, down projection rowwise."""
    plan = {}
    for i in range(num_blocks):
        plan[f"blocks.{i}.up"] = "colwise"
        plan[f"blocks.{i}.down"] = "rowwise"
    return plan


def gpt_layers(num_layers: int = 4) -> list[str]:
    """The layers of examples/gpt.py in forward order, as the planner's IR lists them."""
    return ["tok_emb", "pos_emb", *(f"blocks.{i}" for i in range(num_layers)), "ln_f", "head"]


def mlp_layers(num_blocks: int = 4) -> list[str]:
    """The layers of examples/mlp.py in forward order."""
    return ["proj", *(f"blocks.{i}" for i in range(num_blocks)), "norm", "head"]


def split_layers(layers: list[str], num_stages: int) -> list[list[str]]:
    """``layers`` cut into ``num_stages`` contiguous stages, as even as possible (earlier
    stages take the extra layers)."""
    size, extra = divmod(len(layers), num_stages)
    out, start = [], 0
    for k in range(num_stages):
        end = start + size + (k < extra)
        out.append(layers[start:end])
        start = end
    return out


BIN = Path(sys.executable).parent


HARNESS = Path(__file__).resolve().parent / "harness"
"""The tests' fault harness (``harness/sitecustomize.py``): the test hooks the runtime does not
ship, injected into the emitted program by every process that finds it on PYTHONPATH."""


def harness_env(env: dict[str, str]) -> dict[str, str]:
    """``env``, with the fault harness first on PYTHONPATH where it sets an ``AUTOPAR_TEST_``
    variable (a fault to inject; see harness/sitecustomize.py)."""
    if not any(key.startswith("AUTOPAR_TEST_") for key in env):
        return env
    path = os.pathsep.join(filter(None, [str(HARNESS), env.get("PYTHONPATH")]))
    return {**env, "PYTHONPATH": path}


def run_bounded(cmd: list[str], cwd: Path, timeout_s: float, **env: str) -> tuple[int, str]:
    """Run ``cmd`` (torchrun, launch.sh, python) with one torch thread and the venv first on
    PATH, stdout and stderr together; past ``timeout_s`` kill its whole process group and fail
    the test. ``AUTOPAR_TEST_`` variables in ``env`` inject faults (harness_env). Returns the
    exit code and the output."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{BIN}:{os.environ['PATH']}"}
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=harness_env({**full_env, **env}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} ran over {timeout_s} s:\n{out[-4000:]}")
    return proc.returncode, out


# A script run under torchrun by tests of Plan.apply: APPLY_PRELUDE loads the plan (argv[1]) and
# its model file, applies the plan (`model`, and `inner` without a DDP wrapper); a test appends
# its checks, printing one line on rank 0, then APPLY_EPILOGUE ends the process group.
APPLY_PRELUDE = """
import importlib.util, json, os, sys
import torch
import torch.distributed as dist
from autopar import Plan

plan = Plan.load(sys.argv[1])
spec = importlib.util.spec_from_file_location("user_model", plan.model.file)
user_model = importlib.util.module_from_spec(spec)
spec.loader.exec_module(user_model)
torch.manual_seed(0)
model = plan.apply(user_model.build_model())
inner = getattr(model, "module", model)
"""
APPLY_EPILOGUE = """
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
"""


VERIFY_DROPOUT = re.compile(
    r"^verify: ok max_loss_diff=(\S+) max_param_diff=(\S+) \(dropout off in both runs\)$",
    re.MULTILINE,
)


def verify_dropout_off(plan: Plan, out_dir: Path, timeout_s: float) -> Path:
    """Emit ``plan`` into ``out_dir`` and run it through launch.sh: 3 SGD steps with --verify,
    which must say ok with dropout off in both runs, losses and parameters within 1e-5, and
    log 3 steps. Returns ``out_dir``."""
    from autopar.codegen import write_outputs

    out = write_outputs(plan, out_dir)
    rc, text = run_bounded(
        ["bash", "launch.sh", "--steps", "3", "--verify", "--optimizer", "sgd"], out, timeout_s,
        DIST_TIMEOUT_S="120",
    )  # fmt: skip
    assert rc == 0, text[-4000:]
    m = VERIFY_DROPOUT.search(text)
    assert m and float(m.group(1)) <= 1e-5 and float(m.group(2)) <= 1e-5, text[-4000:]
    assert text.count('"step": ') == 3, text[-4000:]
    return out


# The plan applied in one plain process on a fake 2-rank process group: each parameter's
# placements and local shape as the runtime's apply_tp leaves them (None: a plain tensor).
SHOW_PARAMS = """
import json, sys
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore
from autopar import Plan
from autopar.model_file import load_model_file

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
plan = Plan.load(sys.argv[1])
model = plan.apply(load_model_file(f"{plan.model.file}:{plan.model.factory}").build())
rows = {
    name: [[type(pl).__name__, getattr(pl, "dim", None)] for pl in p.placements]
    + [list(p.to_local().shape), list(p.shape)] if isinstance(p, DTensor) else None
    for name, p in model.named_parameters()
}
print("PARAMS " + json.dumps(rows), flush=True)
dist.destroy_process_group()
"""


def show_params(out: Path, tmp_path: Path) -> dict:
    """name -> [placements..., local shape, global shape] (None: a plain tensor) of the plan in
    ``out`` applied on a fake 2-rank process group."""
    script = tmp_path / "show_params.py"
    script.write_text(SHOW_PARAMS)
    rc, text = run_bounded([sys.executable, str(script), str(out / "plan.json")], tmp_path, 120)
    assert rc == 0, text[-4000:]
    return json.loads(next(x for x in text.splitlines() if x.startswith("PARAMS "))[7:])
