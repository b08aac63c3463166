"""Tier 3 (gloo numerics): emitted scripts run under torchrun and match a single-process run.

Each case forces a plan by hand (tests/_plans.py), writes it with ``codegen.write_outputs``,
launches the emitted ``launch.sh`` (torchrun on gloo, or plain python for one rank) with
``--verify``, and checks the step lines and the verdict. A few pure tests at the end cover
``emit``/``write_outputs`` without a process group.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _plans import (
    GPT,
    MLP,
    ROOT,
    cpu_cluster,
    forced_plan,
    megatron_gpt,
    megatron_mlp,
    run_bounded,
    tiered,
)
from autopar.codegen import emit, write_outputs

TIMEOUT_S = 240
BIN = Path(sys.executable).parent
GPT_LAYERS = [f"blocks.{i}" for i in range(4)]
MLP_LAYERS = [f"blocks.{i}" for i in range(4)]
# The keys of a step line, and ref_grad_norm with --verify.
STEP_KEYS = {"step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "mfu"}
STEP_KEYS |= {"peak_memory_bytes"}
VERIFY_OK = re.compile(r"^verify: ok max_loss_diff=(\S+) max_param_diff=(\S+)$", re.MULTILINE)

# A causal LM without make_batch or the default loss: the script draws token ids from the
# embedding's vocabulary and calls this loss_fn.
TINY_LM = """
import torch
from torch import nn


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.out = nn.Linear(16, 50)

    def forward(self, idx):
        return self.out(torch.tanh(self.emb(idx)))


def build_model():
    return TinyLM()


def loss_fn(output, target):
    return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
"""


def _run(cmd: list[str], cwd: Path) -> tuple[int, str]:
    """Run ``cmd`` bounded by TIMEOUT_S; on timeout kill its whole process group."""
    return run_bounded(cmd, cwd, TIMEOUT_S, DIST_TIMEOUT_S="120")


def _launch(plan, tmp_path: Path, *args: str) -> tuple[int, str]:
    out_dir = write_outputs(plan, tmp_path / "out")
    return _run(["bash", "launch.sh", *args], out_dir)


def _steps(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith('{"step"')]


def _check_verified(out: str, rc: int, steps: int, loss_tol: float, param_tol: float) -> None:
    assert rc == 0, out[-4000:]
    records = _steps(out)
    assert [r["step"] for r in records] == list(range(1, steps + 1)), out[-4000:]
    for r in records:
        assert set(r) - {"ref_grad_norm"} == STEP_KEYS, r
        assert math.isfinite(r["loss"]) and r["step_time_s"] > 0 and r["peak_memory_bytes"] > 0
    m = VERIFY_OK.search(out)
    assert m, out[-4000:]
    loss_diff, param_diff = float(m.group(1)), float(m.group(2))
    assert loss_diff <= loss_tol and param_diff <= param_tol, m.group(0)


SGD_CASES = {
    "gpt-ddp2": (GPT, 2, {"dp": 2}, {}, {}),
    "gpt-fsdp2": (GPT, 2, {"fsdp": 2}, {}, {}),
    "gpt-tp2": (GPT, 2, {"tp": 2}, megatron_gpt(), {}),
    "gpt-tp2-fsdp2-ckpt": (GPT, 4, {"fsdp": 2, "tp": 2}, megatron_gpt(), {"blocks.1": "full"}),
    "gpt-hsdp-dp2-fsdp2-ckpt": (GPT, 4, {"dp": 2, "fsdp": 2}, {}, {"blocks.0": "full"}),
    "mlp-ddp2": (MLP, 2, {"dp": 2}, {}, {}),
    "mlp-fsdp2": (MLP, 2, {"fsdp": 2}, {}, {}),
    "mlp-tp2": (MLP, 2, {"tp": 2}, megatron_mlp(), {}),
    "mlp-tp2-fsdp2": (MLP, 4, {"fsdp": 2, "tp": 2}, megatron_mlp(), {}),
    "mlp-dp2-tp2": (MLP, 4, {"dp": 2, "tp": 2}, megatron_mlp(), {}),
}


# The default tier keeps gpt-hsdp-dp2-fsdp2-ckpt and mlp-dp2-tp2 (dp x tp); the mlp cases repeat
# on a second model what the gpt cases cover, and each gpt case below is covered by another
# default-tier launch of the same plan (one line each):
SGD_SLOW = {"mlp-ddp2", "mlp-fsdp2", "mlp-tp2", "mlp-tp2-fsdp2"}
# gpt-ddp2: test_data.py::test_token_file_verifies_and_logs_eval_loss (gpt dp=2, sgd, --verify)
SGD_SLOW.add("gpt-ddp2")
# gpt-fsdp2: test_gradient_accumulation_matches_single_process[gpt-fsdp2-x4] (gpt fsdp=2, sgd)
SGD_SLOW.add("gpt-fsdp2")
# gpt-tp2: test_adamw_matches_within_documented_bound (the same Megatron tp=2 plan, --verify)
SGD_SLOW.add("gpt-tp2")
# gpt-tp2-fsdp2-ckpt: test_loop.py::test_clipping_with_weight_decay_verifies_on_fsdp_tp (same plan)
SGD_SLOW.add("gpt-tp2-fsdp2-ckpt")


@pytest.mark.dist
@pytest.mark.parametrize("case", tiered(SGD_CASES, SGD_SLOW))
def test_sgd_matches_single_process(case: str, tmp_path: Path) -> None:
    model_file, world, mesh, tp, ckpt = SGD_CASES[case]
    layers = GPT_LAYERS if model_file == GPT else MLP_LAYERS
    seq_len = 16 if model_file == GPT else None
    # gpt.py views with -1 heads, so local head counts change nothing; set them anyway, as the
    # planner does, to run the MODULE_ATTRS path.
    attrs = (
        {f"{b}.attn": {"n_head": 4 // mesh["tp"]} for b in layers}
        if model_file == GPT and tp
        else None
    )
    plan = forced_plan(
        model_file,
        world,
        mesh,
        tp,
        layers=layers,
        seq_len=seq_len,
        checkpointing=ckpt or None,
        module_attrs=attrs,
    )
    rc, out = _launch(plan, tmp_path, "--steps", "3", "--optimizer", "sgd", "--verify")
    # SGD in fp32 differs from the single process only by reduction order.
    _check_verified(out, rc, steps=3, loss_tol=1e-5, param_tol=1e-5)
    if seq_len:
        assert all(r["tokens_per_s"] > 0 for r in _steps(out))
    else:
        assert all(r["tokens_per_s"] is None for r in _steps(out))


@pytest.mark.dist
def test_adamw_matches_within_documented_bound(tmp_path: Path) -> None:
    plan = forced_plan(GPT, 2, {"tp": 2}, megatron_gpt(), layers=GPT_LAYERS, lr=1e-3)
    rc, out = _launch(plan, tmp_path, "--steps", "3", "--verify")  # the plan's AdamW
    # The emitted tolerances (train.py: tolerances): loss 1e-4, parameters 1e-5 + 2 * lr * steps.
    _check_verified(out, rc, steps=3, loss_tol=1e-4, param_tol=1e-5 + 2 * 1e-3 * 3)


@pytest.mark.parametrize("model", ["mlp", "tiny_lm_at_odd_path"])
def test_one_rank_plan_runs_as_plain_python(model: str, tmp_path: Path) -> None:
    if model == "mlp":
        model_file, seq_len = MLP, None
    else:
        # Quotes, a backslash and a space in the path: the script must still import it.
        odd = tmp_path / "odd 'dir\" \\x"
        odd.mkdir()
        (odd / "lm.py").write_text(TINY_LM)
        model_file, seq_len = str(odd / "lm.py"), 8
    plan = forced_plan(model_file, 1, {}, {}, layers=[], seq_len=seq_len)
    out_dir = write_outputs(plan, tmp_path / "out")
    last = (out_dir / "launch.sh").read_text().splitlines()[-1]
    assert last == 'exec python "$here/train.py" "$@"', last
    rc, out = _run(["bash", "launch.sh", "--steps", "2", "--verify"], out_dir)
    _check_verified(out, rc, steps=2, loss_tol=0.0, param_tol=0.0)


# covered by test_checkpoint.py::test_world_mismatch_is_one_error_line_and_exit_2_on_every_rank
@pytest.mark.slow
@pytest.mark.dist
def test_wrong_world_size_is_one_error_line(tmp_path: Path) -> None:
    plan = forced_plan(GPT, 2, {"tp": 2}, megatron_gpt(), layers=GPT_LAYERS)
    out_dir = write_outputs(plan, tmp_path / "out")
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "1", "train.py"]
    rc, out = _run([*torchrun, "--steps", "2"], out_dir)
    # torchrun reports any failed worker as its own exit 1; the worker's code was 2.
    assert rc != 0 and "exitcode: 2" in out, out[-4000:]
    assert "error: this plan needs 2 ranks, launched with 1" in out
    rc, out = _run([sys.executable, "train.py", "--steps", "2"], out_dir)
    assert rc == 2 and out.startswith("error: this plan needs 2 ranks"), out
    rc, out = _run([sys.executable, "train.py", "--checkpoint-every", "2"], out_dir)
    assert rc == 2 and out.startswith("error: this plan needs 2 ranks"), out


@pytest.mark.dist
def test_verify_catches_a_corrupted_shard(tmp_path: Path) -> None:
    plan = forced_plan(GPT, 2, {"tp": 2}, megatron_gpt(), layers=GPT_LAYERS)
    out_dir = write_outputs(plan, tmp_path / "out")
    script = out_dir / "train.py"
    anchor = (
        "    rt.materialize([model], order, recorded, device, args.seed, model_file, reference)\n"
    )
    text = script.read_text()
    assert text.count(anchor) == 1
    corrupt = (
        "    if torch.distributed.get_rank() == 1:  # test: scale rank 1's shard of a weight\n"
        "        with torch.no_grad():\n"
        '            model.get_submodule("blocks.0.mlp.down").weight.to_local().mul_(1.5)\n'
    )
    script.write_text(text.replace(anchor, anchor + corrupt))
    rc, out = _run(["bash", "launch.sh", "--steps", "2", "--optimizer", "sgd", "--verify"], out_dir)
    assert rc == 1, out[-4000:]
    assert re.search(r"^verify: FAILED blocks\.0\.mlp\.down\.weight diff=", out, re.MULTILINE), out


# ---- emit and write_outputs, no process group ----------------------------------------------


def test_emitted_scripts_pass_ruff(tmp_path: Path) -> None:
    ruff = shutil.which("ruff", path=str(BIN)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    for name, (model_file, world, mesh, tp, ckpt) in SGD_CASES.items():
        attrs = {"blocks.0.attn": {"n_head": 2}} if tp and model_file == GPT else None
        plan = forced_plan(
            model_file, world, mesh, tp, layers=GPT_LAYERS, checkpointing=ckpt, module_attrs=attrs
        )
        (tmp_path / f"{name}.py").write_text(emit(plan)["train.py"])
    for check in (["check", "--no-cache"], ["format", "--check", "--no-cache"]):
        result = subprocess.run(
            [ruff, *check, "--config", str(ROOT / "pyproject.toml"), str(tmp_path)],
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, result.stdout + result.stderr


def test_launch_sh_forms(tmp_path: Path) -> None:
    two_nodes = cpu_cluster(4).model_copy(update={"num_nodes": 2, "devices_per_node": 2})
    plan = forced_plan(GPT, 4, {"fsdp": 4}, {}, layers=GPT_LAYERS)
    launch = emit(plan.model_copy(update={"cluster": two_nodes}))["launch.sh"]
    assert (
        "torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \\\n"
        '  --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RDZV_ID" --rdzv-conf "$conf" \\\n'
        '  --max-restarts "${MAX_RESTARTS:-$restarts}" "${extra[@]}" "$here/train.py" "$@" &'
    ) in launch
    assert 'export RDZV_ENDPOINT RDZV_ID="${RDZV_ID:-autopar-fsdp4}"' in launch
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in launch
    slurm = emit(plan.model_copy(update={"cluster": two_nodes}))["launch.slurm"]
    assert "#SBATCH --nodes=2" in slurm and 'bash launch.sh "$@"' in slurm
    files = emit(plan)
    assert (
        'torchrun --max-restarts "${MAX_RESTARTS:-$restarts}" --standalone '
        '--nproc-per-node 4 "$here/train.py" "$@" &'
    ) in files["launch.sh"]
    assert "    torchrun --standalone --nproc-per-node 4 train.py\n" in files["train.py"]
    assert type(plan).from_json(files["plan.json"]) == plan


def test_emit_rejects_indivisible_batch() -> None:
    plan = forced_plan(MLP, 4, {"dp": 4}, {}, layers=MLP_LAYERS, global_batch=6, seq_len=None)
    with pytest.raises(
        ValueError, match="global batch 6 is not divisible by the data-parallel size 4"
    ):
        emit(plan)


def test_cpu_offload_matches_single_process(tmp_path):
    """FSDP2 with CPUOffloadPolicy (the planner's last resort for memory) trains like one process:
    on CPU the policy's code path runs (host-resident shards, CPU optimizer step) unchanged."""
    layers = [f"blocks.{i}" for i in range(4)]
    plan = forced_plan(GPT, 2, {"fsdp": 2}, {}, layers=layers, optimizer="sgd")
    plan = plan.model_copy(update={"offload": True})
    assert "OFFLOAD = True" in emit(plan)["train.py"]
    rc, out = _launch(plan, tmp_path, "--steps", "3", "--optimizer", "sgd", "--verify")
    _check_verified(out, rc, 3, 1e-5, 1e-5)


def test_offload_without_fsdp_is_refused():
    plan = forced_plan(GPT, 2, {"dp": 2}, {}, layers=["blocks.0"]).model_copy(
        update={"offload": True}
    )
    with pytest.raises(ValueError, match="CPU offload is an FSDP2 policy"):
        emit(plan)


ACCUMULATION_CASES = {
    "gpt-ddp2-x2": (GPT, {"dp": 2}, 2),
    "gpt-fsdp2-x4": (GPT, {"fsdp": 2}, 4),
    "mlp-ddp2-x4": (MLP, {"dp": 2}, 4),
    "mlp-fsdp2-x2": (MLP, {"fsdp": 2}, 2),
}


def _accumulating(model_file: str, mesh: dict, steps: int):
    layers = GPT_LAYERS if model_file == GPT else MLP_LAYERS
    plan = forced_plan(model_file, 2, mesh, {}, layers=layers, optimizer="sgd")
    schedule = plan.schedule.model_copy(update={"name": "none", "num_microbatches": steps})
    return plan.model_copy(update={"schedule": schedule})


@pytest.mark.dist
@pytest.mark.parametrize("case", tiered(ACCUMULATION_CASES, {"gpt-ddp2-x2", "mlp-fsdp2-x2"}))
def test_gradient_accumulation_matches_single_process(case: str, tmp_path: Path) -> None:
    """pp = 1 plans with accumulation steps: each rank's batch in N microbatches, gradients
    synced on the last only, equal to the whole batch's (the reference trains unsplit)."""
    model_file, mesh, steps = ACCUMULATION_CASES[case]
    plan = _accumulating(model_file, mesh, steps)
    assert f"ACCUMULATION_STEPS = {steps}" in emit(plan)["train.py"]
    rc, out = _launch(plan, tmp_path, "--steps", "3", "--optimizer", "sgd", "--verify")
    _check_verified(out, rc, 3, loss_tol=1e-5, param_tol=1e-5)


def test_accumulation_steps_must_divide_the_local_batch(tmp_path: Path) -> None:
    plan = _accumulating(MLP, {"dp": 2}, 3)  # local batch 4
    rc, out = _launch(plan, tmp_path, "--steps", "1")
    assert rc != 0 and "does not split into 3 accumulation steps" in out, out[-2000:]
