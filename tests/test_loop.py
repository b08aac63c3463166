"""The emitted training loop (issue 13, item 4): --lr-schedule with --warmup-steps,
--weight-decay, --max-grad-norm, the step line's lr / grad_norm / mfu, bf16 through FSDP2's
MixedPrecisionPolicy, and --compile.

Each emitted plan is written once per module (fixtures) and run under torchrun on gloo with
examples/gpt.py (4 blocks, dim 64, global batch 8, seq 16). --verify trains the unsharded model
in the same process with the same schedule, decay and clipping, and its total gradient norm is
logged beside the sharded run's (ref_grad_norm): they must agree to 1e-4 relative, which a norm
of the local shards only (1/sqrt(2) to 1/2 of the total here) or of one pipeline stage fails.
"""

from __future__ import annotations

import json
import math
import re
import types
from pathlib import Path

import pytest
from _plans import GPT, ROOT, forced_plan, gpt_layers, megatron_gpt, run_bounded, split_layers
from autopar.codegen import emit, write_outputs
from autopar.codegen.apply import runtime
from autopar.codegen.emit import constants

TIMEOUT_S = 240
BLOCKS = [f"blocks.{i}" for i in range(4)]
VERIFY_OK = re.compile(r"^verify: ok max_loss_diff=(\S+) max_param_diff=(\S+)$", re.MULTILINE)
# The flags of the clipping runs: warmup then cosine decay, decoupled decay, and a clip norm
# below every step's gradient norm (about 0.88 for this model), so every step is clipped.
CLIPPED = ("--lr-schedule", "cosine", "--warmup-steps", "2", "--weight-decay", "0.1")
CLIPPED += ("--max-grad-norm", "0.3")


def _run(out_dir: Path, *args: str, **env: str) -> tuple[int, str]:
    return run_bounded(
        ["bash", "launch.sh", *args], out_dir, TIMEOUT_S, DIST_TIMEOUT_S="120", **env
    )


def _steps(log: str) -> list[dict]:
    return [json.loads(line) for line in log.splitlines() if line.startswith('{"step"')]


def _verified(rc: int, log: str, steps: int) -> list[dict]:
    assert rc == 0, log[-4000:]
    assert VERIFY_OK.search(log), log[-4000:]
    records = _steps(log)
    assert [r["step"] for r in records] == list(range(1, steps + 1)), log[-4000:]
    return records


def _check_clipped_norms(records: list[dict]) -> None:
    for r in records:
        # The total norm of the sharded run is the reference model's, not a shard's or a stage's.
        assert r["grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-4), r
        assert r["grad_norm"] > 0.3, r  # every step clipped: the clip ran on the right norm


def _cosine_lr(step: int, steps: int, warmup: int = 2, lr: float = 1e-3) -> float:
    if step <= warmup:
        return lr * step / warmup
    return lr * 0.5 * (1 + math.cos(math.pi * (step - warmup - 1) / (steps - warmup)))


def _with_dtype(plan, dtype: str):
    return plan.model_copy(update={"training": plan.training.model_copy(update={"dtype": dtype})})


# ---- fsdp=2 x tp=2 (4 ranks), one block checkpointed ------------------------------------------
def _fsdp_tp_plan():
    plan = forced_plan(
        GPT,
        4,
        {"fsdp": 2, "tp": 2},
        megatron_gpt(),
        layers=BLOCKS,
        module_attrs={f"{b}.attn": {"n_head": 2} for b in BLOCKS},
        checkpointing={"blocks.1": "full"},
    )
    # Predicted figures as a search would leave them: MODEL_FLOPS = mfu x step x world x peak.
    predicted = plan.predicted.model_copy(update={"mfu": 0.02, "step_time_s": 0.5})
    return plan.model_copy(update={"predicted": predicted})


@pytest.fixture(scope="module")
def fsdp_tp(tmp_path_factory) -> tuple[Path, list[dict]]:
    """The fsdp x tp plan's files, and its 6 clipped, cosine-scheduled, verified steps."""
    out_dir = write_outputs(_fsdp_tp_plan(), tmp_path_factory.mktemp("fsdp_tp") / "out")
    rc, log = _run(out_dir, "--steps", "6", *CLIPPED, "--verify")
    return out_dir, _verified(rc, log, 6)


@pytest.mark.dist
def test_cosine_schedule_with_warmup_logs_the_expected_lr(fsdp_tp) -> None:
    _, records = fsdp_tp
    # warmup 2 of 6 steps: lr/2, lr; then cosine over 4 steps: 1, 0.854, 0.5, 0.146 (x lr).
    expected = [5e-4, 1e-3, 1e-3, 8.5355339e-4, 5e-4, 1.4644661e-4]
    assert [r["lr"] for r in records] == pytest.approx(expected, rel=1e-7)
    assert expected == pytest.approx([_cosine_lr(s, 6) for s in range(1, 7)], rel=1e-7)


@pytest.mark.dist
def test_clipping_with_weight_decay_verifies_on_fsdp_tp(fsdp_tp) -> None:
    _check_clipped_norms(fsdp_tp[1])


@pytest.mark.dist
def test_step_line_has_mfu_from_the_plans_flops(fsdp_tp) -> None:
    out_dir, records = fsdp_tp
    c = runtime().Constants(**_constants_of(out_dir))
    peak = _fsdp_tp_plan().cluster.device.peak_flops["fp32"]
    assert c.PEAK_FLOPS == peak
    assert c.MODEL_FLOPS == pytest.approx(0.02 * 0.5 * 4 * peak, rel=1e-6)
    for r in records:
        expected = c.MODEL_FLOPS / (r["step_time_s"] * 4 * peak)
        assert r["mfu"] == pytest.approx(expected, rel=1e-3, abs=2e-6), r
        # the line rounds tokens_per_s to 0.1: a slow step (a loaded machine) is below 100
        assert r["tokens_per_s"] == pytest.approx(8 * 16 / r["step_time_s"], rel=1e-3, abs=0.05)
        assert r["peak_memory_bytes"] > 0
    # A plan made by hand has no FLOPs figure: the constants say None, the line says null.
    hand = emit(forced_plan(GPT, 2, {"fsdp": 2}, {}, layers=BLOCKS))["train.py"]
    assert "MODEL_FLOPS = None\n" in hand


def _constants_of(out_dir: Path) -> dict:
    """The upper-case constants of an emitted train.py, by executing its assignments only."""
    names = {}
    text = (out_dir / "train.py").read_text()
    block = text[text.index("# ---- The plan") : text.index("PLAN = rt.Constants")]
    exec(compile(block, "train.py", "exec"), {}, names)  # literals only (emit writes them)
    return {k: v for k, v in names.items() if k.isupper()}


# ---- pp=2 (1F1B, 2 ranks) ---------------------------------------------------------------------
@pytest.mark.dist
def test_clipping_with_weight_decay_verifies_on_a_pipeline(tmp_path: Path) -> None:
    layers = gpt_layers()
    plan = forced_plan(
        GPT,
        2,
        {"pp": 2},
        {},
        layers=layers,
        stages=split_layers(layers, 2),
        schedule={"name": "1f1b", "num_microbatches": 2, "stages_per_rank": 1},
    )
    out_dir = write_outputs(plan, tmp_path / "out")
    rc, log = _run(out_dir, "--steps", "4", *CLIPPED, "--verify")
    records = _verified(rc, log, 4)
    # Rank 0 holds stage 0 only: its norm is the whole model's because it sums over stages.
    _check_clipped_norms(records)
    assert [r["lr"] for r in records] == pytest.approx([_cosine_lr(s, 4) for s in range(1, 5)])


# ---- fsdp=2 (2 ranks): resume mid-schedule, bf16 ----------------------------------------------
@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory) -> Path:
    plan = forced_plan(GPT, 2, {"fsdp": 2}, {}, layers=BLOCKS)
    return write_outputs(plan, tmp_path_factory.mktemp("fsdp2") / "out")


@pytest.mark.dist
@pytest.mark.slow  # three launches (~50 s on 2 shared cores)
def test_resume_mid_schedule_logs_the_same_lr_and_losses(fsdp2, tmp_path: Path) -> None:
    flags = ("--steps", "6", *CLIPPED, "--checkpoint-every", "2")
    rc, log = _run(fsdp2, *flags, "--checkpoint-dir", str(tmp_path / "whole"))
    assert rc == 0, log[-4000:]
    whole = {r["step"]: (r["lr"], r["loss"], r["grad_norm"]) for r in _steps(log)}
    assert list(whole) == [1, 2, 3, 4, 5, 6]
    # Killed after step 3 (checkpoint 2 saved), restarted by torchrun, resumed from step 2.
    ckpt = tmp_path / "killed"
    kill = {"AUTOPAR_TEST_KILL_AT_STEP": "3", "AUTOPAR_TEST_KILL_RANK": "1"}
    rc, log = _run(fsdp2, *flags, "--checkpoint-dir", str(ckpt), **kill)
    assert rc == 0 and "checkpoint: resumed from step 2" in log, log[-4000:]
    after = log.split("checkpoint: resumed from step 2", 1)[1]
    resumed = {r["step"]: (r["lr"], r["loss"], r["grad_norm"]) for r in _steps(after)}
    assert resumed == {s: whole[s] for s in (3, 4, 5, 6)}  # bitwise: fp32, gloo, one thread
    # The schedule's state is in the checkpoint (not re-derived from the step).
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(ckpt / "step_4").read_metadata().state_dict_metadata
    assert {"lr_schedule.done", "lr_schedule.base"} <= set(saved)


# A model file that reports, from inside the running program, what the first MLP projection
# computes with: its weight's dtype during forward, and its input's and output's.
PROBE = """
import importlib.util

spec = importlib.util.spec_from_file_location("gpt", {gpt!r})
gpt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpt)
make_batch = gpt.make_batch


def build_model():
    model = gpt.build_model()

    def probe(module, args, output):
        if not getattr(module, "probed", False):
            module.probed = True
            print(f"probe: weight {{module.weight.dtype}} input {{args[0].dtype}} "
                  f"output {{output.dtype}}", flush=True)

    model.blocks[0].mlp.up.register_forward_hook(probe)
    return model
"""


@pytest.mark.dist
@pytest.mark.parametrize("mesh", [{"fsdp": 2}, {"dp": 2}])
def test_bf16_trains_with_fsdp2_mixed_precision_or_autocast(mesh, tmp_path: Path) -> None:
    model_file = tmp_path / "probed_gpt.py"
    model_file.write_text(PROBE.format(gpt=GPT))
    plan = _with_dtype(forced_plan(str(model_file), 2, mesh, {}, layers=BLOCKS), "bf16")
    out_dir = write_outputs(plan, tmp_path / "out")
    rc, log = _run(out_dir, "--steps", "3", "--max-grad-norm", "0.3", "--verify")
    records = _verified(rc, log, 3)
    # Ranks share one stdout: a probe line may start mid-line after another rank's output.
    dtypes = r"weight torch\.\w+? input torch\.\w+? output torch\.\w+?"
    probes = set(re.findall(rf"probe: ({dtypes})(?=probe: |$)", log, re.MULTILINE))
    if "fsdp" in mesh:
        assert "precision: bf16 compute (FSDP2 MixedPrecisionPolicy" in log, log[-3000:]
        # FSDP2 gathers bf16 parameters (the reference uses bf16 copies of its own): no autocast.
        assert probes == {"weight torch.bfloat16 input torch.bfloat16 output torch.bfloat16"}
    else:
        assert "precision: bf16 autocast over fp32 parameters" in log, log[-3000:]
        # DDP: fp32 weights, autocast runs the matmul in bf16.
        assert probes == {"weight torch.float32 input torch.float32 output torch.bfloat16"}
    for r in records:  # the documented bf16 tolerance (2e-2); measured ~1e-4 here
        assert r["grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=2e-2), r
    m = VERIFY_OK.search(log)
    assert float(m.group(1)) < 2e-3 and float(m.group(2)) < 2e-2, m.group(0)


# ---- --compile ----------------------------------------------------------------------------------
@pytest.mark.dist
@pytest.mark.slow  # dynamo on 4 ranks (~45 s on 2 shared cores)
def test_compile_composes_with_tp_checkpointing_and_fsdp(fsdp_tp) -> None:
    """Each layer compiled after checkpointing, before FSDP, on the fsdp x tp plan; --verify.
    Dynamo and AOTAutograd run for real; the backend is aot_eager (no code generation: inductor
    takes minutes on 2 shared cores, see the slow test below)."""
    out_dir, _ = fsdp_tp
    rc, log = _run(
        out_dir, "--steps", "2", "--compile", "--verify", AUTOPAR_TEST_COMPILE_BACKEND="aot_eager"
    )
    _verified(rc, log, 2)


@pytest.mark.dist
@pytest.mark.slow  # inductor generates and builds C++ for each layer: minutes on 2 cores
def test_compile_with_inductor_on_cpu(tmp_path: Path) -> None:
    """Inductor (C++ code generation on CPU, g++) on an fsdp=2 plan of examples/mlp.py with a
    checkpointed block, under torchrun, --verify."""
    plan = forced_plan(
        str(ROOT / "examples" / "mlp.py"),
        2,
        {"fsdp": 2},
        {},
        layers=BLOCKS,
        seq_len=None,
        checkpointing={"blocks.1": "full"},
    )
    out_dir = write_outputs(plan, tmp_path / "out")
    rc, log = run_bounded(
        ["bash", "launch.sh", "--steps", "2", "--compile", "--verify"], out_dir, 600
    )
    _verified(rc, log, 2)


# ---- pure ---------------------------------------------------------------------------------------
def test_lr_factor_linear_and_constant() -> None:
    f = runtime().lr_factor
    assert [f("linear", 1, 5, s) for s in range(1, 6)] == [1.0, 1.0, 0.75, 0.5, 0.25]
    assert [f("constant", 4, 8, s) for s in range(1, 7)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert [f("cosine", 0, 2, s) for s in (1, 2)] == [1.0, pytest.approx(0.5)]


def test_weight_decay_reaches_the_optimizers() -> None:
    import argparse

    import torch

    params = [torch.nn.Parameter(torch.ones(2))]
    args = argparse.Namespace(optimizer="adamw", lr=0.1, weight_decay=0.25)
    assert runtime().build_optimizer(params, args).param_groups[0]["weight_decay"] == 0.25
    args.optimizer = "sgd"
    assert runtime().build_optimizer(params, args).param_groups[0]["weight_decay"] == 0.25
    args.weight_decay = None  # torch's defaults
    assert runtime().build_optimizer(params, args).param_groups[0]["weight_decay"] == 0
    args.optimizer = "adamw"
    assert runtime().build_optimizer(params, args).param_groups[0]["weight_decay"] == 0.01


@pytest.mark.bad_input
@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (("--max-grad-norm", "0"), "error: --max-grad-norm 0.0 must be a finite number > 0"),
        (("--warmup-steps", "-1"), "error: --warmup-steps -1 must be >= 0"),
        (("--weight-decay", "-0.1"), "error: --weight-decay -0.1 must be a finite number >= 0"),
    ],
)
def test_bad_loop_flags_are_one_error_line(flags, error, capsys) -> None:
    """In process (rt.check_flags, as train.py calls it through check_launch): one line, exit
    2. tests/test_launchers.py runs a mistyped flag through launch.sh, and more ranges."""
    rt = runtime()
    c = rt.Constants(**constants(forced_plan(GPT, 1, {}, {}, layers=BLOCKS)))
    with pytest.raises(SystemExit) as exit_:
        rt.check_flags(c, rt.parse_args(c, "train.py", ["--steps", "2", *flags]))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith(error) and err.count("\n") == 1, err


@pytest.mark.dist
def test_ddp_logs_every_kth_step_with_the_verified_norm(tmp_path: Path) -> None:
    """DDP on 2 ranks, --log-every 2 over 3 steps: lines for steps 2 and 3 (the last) only, each
    with the total gradient norm, which each rank sums over its part of the replicated
    gradients (loop._part_of), equal to the reference's, and the peak memory read before the
    optimizer step (from the second step on) over both ranks."""
    plan = forced_plan(GPT, 2, {"dp": 2}, {}, layers=BLOCKS, optimizer="sgd")
    out_dir = write_outputs(plan, tmp_path / "out")
    rc, log = _run(out_dir, "--steps", "3", "--log-every", "2", "--verify")
    assert rc == 0 and VERIFY_OK.search(log), log[-4000:]
    records = _steps(log)
    assert [r["step"] for r in records] == [2, 3], log[-4000:]
    for r in records:
        assert r["grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-5), r
        assert r["grad_norm"] > 0 and r["peak_memory_bytes"] > 0, r


def test_finish_step_norms_only_where_read_and_clips_as_torch() -> None:
    """finish_step in one process (--verify's reference path): a step nobody reads the norm of
    (not logged, no clipping, no --verify) computes none and still steps the optimizer; a
    logged one returns torch's total norm; with --max-grad-norm the parameters after the step
    are those of torch's clip_grad_norm_ then the same optimizer step."""
    import argparse

    import torch

    rt = runtime()
    c = rt.Constants(**constants(forced_plan(GPT, 1, {}, {}, layers=BLOCKS)))

    def step(max_grad_norm, logged, verify=False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        loss = model(torch.randn(5, 4)).square().mean()
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        args = argparse.Namespace(max_grad_norm=max_grad_norm, verify=verify, profile_steps=0)
        figures = rt.finish_step(c, None, loss.detach(), [optimizer], args, logged, False)
        return model, grads, figures

    model, grads, (loss, norm, peak) = step(None, logged=False)
    assert norm is None and peak is None and math.isfinite(loss)
    assert all(p.grad is None for p in model.parameters())  # stepped and zeroed
    total = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()
    for logged, verify in ((True, False), (False, True)):
        assert step(None, logged, verify)[2][1] == pytest.approx(total, rel=1e-6)
    clipped, grads, (_, norm, _) = step(total / 4, logged=False)
    assert norm == pytest.approx(total, rel=1e-6)  # the norm before clipping
    torch.manual_seed(0)
    expected = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    for p, g in zip(expected.parameters(), grads):
        p.grad = g
    torch.nn.utils.clip_grad_norm_(expected.parameters(), total / 4)
    torch.optim.SGD(expected.parameters(), lr=0.5).step()
    for got, want in zip(clipped.parameters(), expected.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_json_lines_go_out_in_one_write(monkeypatch) -> None:
    """Rank 0's JSON lines (a step's, an eval's) leave in one write with their newline: under
    PYTHONUNBUFFERED (set on this machine, and in many container images) print() writes the
    line and its newline apart, and the profiler's C++ log once landed between them
    (tests/test_profiling.py read '{"step": 2, ...}USDT:... profiler_start')."""
    from autopar.codegen.runtime.autopar_runtime import common, loop

    writes: list[str] = []

    class Stream:
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            writes.append("<flush>")

    monkeypatch.setattr(loop.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(common.sys, "stdout", Stream())
    c = types.SimpleNamespace(GLOBAL_BATCH=4, SEQ_LEN=8, MODEL_FLOPS=None, PEAK_FLOPS=None,
                              WORLD_SIZE=2)  # fmt: skip
    loop.log_step(c, 3, 1.5, 0.25, 1024, lr=1e-3, grad_norm=0.5)
    line, flush = writes
    assert flush == "<flush>" and line.endswith("}\n") and line.count("\n") == 1
    assert json.loads(line)["step"] == 3
