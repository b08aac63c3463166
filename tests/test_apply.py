"""``plan.apply(model)`` in the user's own training loop, under torchrun, trains exactly like the
emitted script on the same plan (same seed, same data convention: the global batch drawn per
step after ``torch.manual_seed(seed + 1000 + step)``, each data-parallel rank on its slice)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _plans import GPT, forced_plan, megatron_gpt, run_bounded
from autopar.codegen import write_outputs

TIMEOUT_S = 180
BIN = Path(sys.executable).parent
GPT_LAYERS = [f"blocks.{i}" for i in range(4)]
STEPS = 3

# The user's script: their own model construction, optimizer and loop; only apply and
# local_batch come from the plan.
USER_LOOP = """
import importlib.util
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar import Plan

plan = Plan.load(sys.argv[1])
steps = int(sys.argv[2])
spec = importlib.util.spec_from_file_location("user_model", plan.model.file)
user_model = importlib.util.module_from_spec(spec)
spec.loader.exec_module(user_model)

torch.manual_seed(0)
model = plan.apply(user_model.build_model())
optimizer = torch.optim.SGD(model.parameters(), lr=plan.training.lr)
for step in range(1, steps + 1):
    torch.manual_seed(1000 + step)
    batch = user_model.make_batch(plan.training.global_batch, plan.training.seq_len)
    (idx,), target = plan.local_batch(batch)
    loss = F.cross_entropy(model(idx).flatten(0, -2), target.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    if dist.get_rank() == 0:
        print(json.dumps({"step": step, "loss": mean.item() / dist.get_world_size()}), flush=True)
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
"""


def _run(cmd: list[str], cwd: Path) -> str:
    rc, out = run_bounded(cmd, cwd, TIMEOUT_S, DIST_TIMEOUT_S="120")
    assert rc == 0, out[-4000:]
    return out


def _losses(out: str) -> list[float]:
    return [json.loads(line)["loss"] for line in out.splitlines() if line.startswith('{"step"')]


@pytest.mark.dist
@pytest.mark.parametrize("mesh", [{"tp": 2}, pytest.param({"fsdp": 2}, marks=pytest.mark.slow)])
def test_apply_in_own_loop_matches_emitted_script(mesh, tmp_path: Path) -> None:
    styles = megatron_gpt() if "tp" in mesh else {}
    plan = forced_plan(GPT, 2, mesh, styles, layers=GPT_LAYERS, optimizer="sgd", lr=0.05)
    out_dir = write_outputs(plan, tmp_path / "out")
    emitted = _losses(_run(["bash", "launch.sh", "--steps", str(STEPS)], out_dir))
    user = tmp_path / "user_loop.py"
    user.write_text(USER_LOOP)
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"]
    applied = _losses(
        _run([*torchrun, str(user), str(out_dir / "plan.json"), str(STEPS)], tmp_path)
    )
    assert len(emitted) == len(applied) == STEPS
    assert applied == pytest.approx(emitted, abs=1e-6), (applied, emitted)
    assert len(set(emitted)) == STEPS  # fresh batches and updated weights: no repeats


def test_apply_refuses_a_pipeline_plan_and_a_wrong_world(monkeypatch) -> None:
    import torch

    pp = forced_plan(
        GPT, 2, {"pp": 2}, {}, layers=GPT_LAYERS,
        stages=[GPT_LAYERS[:2], GPT_LAYERS[2:]], schedule={"name": "gpipe", "num_microbatches": 2},
    )  # fmt: skip
    with pytest.raises(ValueError, match="pipeline"):
        pp.apply(torch.nn.Linear(2, 2))
    tp = forced_plan(GPT, 2, {"tp": 2}, megatron_gpt(), layers=GPT_LAYERS)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="needs 2 ranks"):
        tp.apply(torch.nn.Linear(2, 2))
