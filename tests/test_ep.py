"""Expert parallelism, emitted and verified: each MoE block's stacked experts split over ep ranks,
tokens dispatched to them and back by all-to-all on the ep group (gloo on CPU).

Each case plans a model with ``--mesh ep=..`` through the real planner, emits the script and
runs it under ``torchrun --standalone`` with ``--verify`` (the single-process model, same
routing, trained beside it). Besides the verdict, the script's report says which experts each
rank held (the local stacked weights' shapes: E/ep experts) and how many routes crossed ranks.
A wrong dispatch (a test-only knob sends each route one ep rank too far) must give FAILED.

Checkpoints under ep: each stacked expert weight is a DTensor of all E experts (Shard(0) over
ep), so a DCP checkpoint stores every expert once. A run killed after step 3 resumes from its
step-2 checkpoint under ep=2 and logs the uninterrupted run's losses bitwise; a checkpoint saved
under ep=2 loads under ep=1 and one saved under ep=1 loads under ep=2 with every tensor
exactly the saved one (read back through --save-hf, which writes whole expert tensors), and
transformers' from_pretrained loads what --save-hf wrote; --init-from of it verifies at ep=2.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from _plans import run_bounded
from autopar.codegen import write_outputs
from test_moe import TINY_MIXTRAL, TINY_QWEN3_MOE  # the tiny HF MoE configs, in one place

from autopar.model_file import load_model_file

ROOT = Path(__file__).resolve().parent.parent
MOE_STACKED = str(ROOT / "tests" / "models" / "moe_stacked.py")
MOE_TOP2 = str(ROOT / "tests" / "models" / "moe_top2.py")
SEQ = 16
TIMEOUT_S = 300
VERIFY_OK = re.compile(r"^verify: ok max_loss_diff=(\S+) max_param_diff=(\S+)$", re.MULTILINE)
HELD = re.compile(r"^expert parallel: rank (\d+) holds experts (\d+)-(\d+) of (\d+): (.*)$", re.M)
SENT = re.compile(r"^expert parallel: (\d+) of (\d+) routes sent to another ep rank", re.M)
ADAMW = ("--optimizer", "adamw", "--lr", "0.01")
RESUMED = re.compile(r"^checkpoint: resumed from step (\d+) \((.*)\)$", re.MULTILINE)
SAVED = re.compile(r"^checkpoint: saved step (\d+) to ", re.MULTILINE)


def _hf(tmp: Path, config: dict) -> str:
    path = tmp / f"{config['model_type']}.json"
    path.write_text(json.dumps(config))
    return f"hf:{path}"


def _plan(spec: str, world: int, mesh: str, batch: int = 8):
    from autopar.api import plan_model_file

    return plan_model_file(
        load_model_file(spec), f"cpu:{world}", global_batch=batch, seq_len=SEQ, mesh=mesh,
        optimizer="sgd",
    )  # fmt: skip


def _run(plan, tmp_path: Path, *args: str, **env: str) -> tuple[int, str]:
    out = write_outputs(plan, tmp_path / "out")
    cmd = ["torchrun", "--standalone", f"--nproc-per-node={plan.world_size}", "train.py", *args]
    return run_bounded(cmd, out, TIMEOUT_S, DIST_TIMEOUT_S="120", **env)


def _launch(plan, work: Path, *args: str, **env: str) -> tuple[int, str]:
    """launch.sh (torchrun with restarts when there is a --checkpoint-dir)."""
    out = write_outputs(plan, work / "out")
    return run_bounded(["bash", "launch.sh", *args], out, TIMEOUT_S, DIST_TIMEOUT_S="120", **env)


def _checkpoint_model(path: Path) -> dict:
    """The model tensors of a DCP checkpoint step folder, whole, read in this process."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, path.parent / f"{path.name}.pt")
    state = torch.load(path.parent / f"{path.name}.pt", weights_only=False)
    (path.parent / f"{path.name}.pt").unlink()
    return state["model"]


def _hf_tensors(directory: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    assert files and (directory / "model.safetensors.index.json").is_file(), list(
        directory.iterdir()
    )
    return {k: v for f in files for k, v in load_file(f).items()}


def _same(a: dict, b: dict) -> None:
    """The same names, shapes and values, bit for bit."""
    import torch

    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].shape == b[name].shape and torch.equal(a[name], b[name]), name


def _check(plan, rc: int, out: str, ep: int) -> None:
    """The verdict, and the report: each rank held E/ep experts (ep ranks of a group different
    ones, every expert held), and routes crossed ranks."""
    assert rc == 0, out[-4000:]
    m = VERIFY_OK.search(out)
    assert m, out[-4000:]
    assert float(m.group(1)) <= 1e-4 and float(m.group(2)) <= 1e-5, m.group(0)
    held = HELD.findall(out)
    assert len(held) == plan.world_size, out[-3000:]
    num = plan.expert_parallel.num_experts
    firsts = set()
    for _, first, last, total, shapes in held:
        assert int(total) == num and int(last) - int(first) + 1 == num // ep
        firsts.add(int(first))
        # every local stacked weight has num/ep experts (first dim)
        dims = [int(d) for d in re.findall(r"\((\d+),", shapes)]
        assert dims and all(d == num // ep for d in dims), shapes
    assert firsts == {i * num // ep for i in range(ep)}
    sent = SENT.search(out)
    assert sent and 0 < int(sent.group(1)) < int(sent.group(2)), out[-2000:]


@pytest.fixture(scope="module")
def stacked_ep2():
    """The hand-written stacked-experts MoE planned with --mesh ep=2 on cpu:2 (shared)."""
    return _plan(MOE_STACKED, 2, "ep=2")


@pytest.fixture(scope="module")
def stacked_ep2_killed(stacked_ep2, tmp_path_factory) -> tuple[int, str, Path]:
    """4 AdamW steps at ep=2 with a checkpoint every 2, rank 1 killed after step 3 on the
    first attempt: torchrun restarts the group and it resumes from step 2."""
    work = tmp_path_factory.mktemp("ep2_killed")
    ckpt = work / "ckpt"
    args = ["--steps", "4", "--checkpoint-every", "2", "--checkpoint-dir", str(ckpt), *ADAMW]
    rc, out = _launch(
        stacked_ep2, work, *args, AUTOPAR_TEST_KILL_AT_STEP="3", AUTOPAR_TEST_KILL_RANK="1"
    )
    return rc, out, ckpt


# -- plan-level (no torchrun) --------------------------------------------------------------------
def test_ep_with_a_pipeline_plans(tmp_path: Path) -> None:
    """pp x ep: the stages keep each layer a module, so the experts of a stage's layers split
    like any others; the plan-time cut check runs HF's grouped experts on meta."""
    plan = _plan(_hf(tmp_path, TINY_MIXTRAL), 4, "pp=2,ep=2,fsdp=2")
    assert (plan.mesh.pp, plan.mesh.ep, plan.mesh.fsdp) == (2, 2, 2) and len(plan.stages) == 2
    script = write_outputs(plan, tmp_path / "out").joinpath("train.py").read_text()
    assert "rt.apply_expert_parallel(" in script


def test_ep_script_states_the_split(stacked_ep2, tmp_path: Path) -> None:
    """The emitted script names the experts modules it splits, and shards with FSDP2 (the
    experts are FSDP2 units of their own), never DDP."""
    plan = stacked_ep2
    script = write_outputs(plan, tmp_path / "out").joinpath("train.py").read_text()
    assert '"experts": ["blocks.0.moe.experts", "blocks.1.moe.experts"]' in script
    assert "rt.apply_expert_parallel(PLAN, model, mesh)" in script
    assert "apply_ddp" not in script and len(script.splitlines()) <= 400
    from autopar.cost_model.precision import uses_fsdp2

    assert plan.mesh.fsdp == 1 and uses_fsdp2(plan.mesh)  # charged as what runs: FSDP2
    with pytest.raises(ValueError, match="without expert parallelism; this one has ep=2"):
        plan.apply(load_model_file(MOE_STACKED).build())


def _tiny_hf(config: dict, seed: int):
    import torch
    import transformers

    kwargs = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(config["model_type"], **kwargs)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@pytest.mark.parametrize("config", [TINY_MIXTRAL, TINY_QWEN3_MOE], ids=["mixtral", "qwen3_moe"])
def test_per_expert_hf_checkpoints_load_stacked(config: dict, tmp_path: Path) -> None:
    """save_pretrained writes one tensor per expert (Mixtral's block_sparse_moe.experts.3.w1,
    Qwen3-MoE's mlp.experts.3.gate_proj); the model holds them stacked (gate_up_proj [E, 2 I,
    H]). --init-from's name check maps them through transformers' conversion rules and the
    load builds every stacked tensor: the model equals from_pretrained's, bit for bit."""
    import torch
    import transformers
    from autopar.codegen.apply import runtime

    rt = runtime()
    _tiny_hf(config, seed=1).save_pretrained(tmp_path / "hf")
    kind, path = rt.init_source(tmp_path / "hf")
    assert not any("experts.gate_up_proj" in k for k in rt.saved_shapes(kind, path))
    model = _tiny_hf(config, seed=2)
    mapping = rt.match_names(model, rt.saved_shapes(kind, path), path)
    stacked = mapping["model.layers.0.mlp.experts.gate_up_proj"]
    assert isinstance(stacked, rt.Stacked) and len(stacked.sources) == 2
    rt.load_reference_weights(kind, path, mapping, model)
    original = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    _same(model.state_dict(), original.state_dict())
    # an expert missing from the checkpoint: the usual one error line, nothing loaded
    (tmp_path / "odd").mkdir()
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    del tensors[next(k for k in tensors if ".experts.1." in k)]
    save_file(tensors, tmp_path / "odd" / "model.safetensors")
    with pytest.raises(rt.InputError, match="does not fit the model: missing") as e:
        rt.match_names(model, rt.saved_shapes("hf", tmp_path / "odd"), tmp_path / "odd")
    assert "\n" not in str(e.value)


# -- emitted and run -----------------------------------------------------------------------------
@pytest.mark.dist
def test_ep2_hand_written_top2_verifies(stacked_ep2, tmp_path: Path) -> None:
    """ep=2 at world 2 on the hand-written top-2 MoE (stacked experts): --verify holds, each
    rank holds 2 of the 4 experts, routes cross ranks."""
    plan = stacked_ep2
    assert plan.mesh.ep == 2
    rc, out = _run(plan, tmp_path, "--steps", "3", "--verify")
    _check(plan, rc, out, 2)


def _steps(out: str) -> dict[int, tuple[float, float]]:
    """step -> (loss, grad_norm) of the step lines in ``out``, which must name each step once."""
    records = [json.loads(line) for line in out.splitlines() if line.startswith('{"step"')]
    assert len(records) == len({r["step"] for r in records}), out[-3000:]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in records}


def _killed_curve(killed) -> dict[int, tuple[float, float]]:
    """The killed run's (loss, grad_norm) per step: steps 1-3 from the first attempt, step 4
    from the restart."""
    rc, out, ckpt = killed
    assert rc == 0 and "exitcode: -9" in out, out[-6000:]
    before, after = out.split("checkpoint: resumed from step 2", 1)
    return _steps(before) | {4: _steps(after)[4]}


@pytest.mark.dist
def test_ep2_killed_run_resumes_bitwise(stacked_ep2_killed) -> None:
    """Save and load under ep=2 (AdamW): rank 1 killed after step 3 (step 2 saved), the group
    restarts and resumes from step 2; step 3 logs the first attempt's loss and gradient norm
    bit for bit (each rank's experts, their AdamW moments and everything else came back
    exactly), and steps 2 and 4 are saved."""
    rc, out, ckpt = stacked_ep2_killed
    assert rc == 0 and "exitcode: -9" in out, out[-6000:]  # torchrun saw the SIGKILL
    assert RESUMED.findall(out) == [("2", str(ckpt / "step_2"))], out[-6000:]
    before, after = out.split("checkpoint: resumed from step 2", 1)
    assert list(_steps(before)) == [1, 2, 3] and SAVED.findall(before) == ["2"], before[-4000:]
    assert list(_steps(after)) == [3, 4] and SAVED.findall(after) == ["4"], after[-4000:]
    assert _steps(after)[3] == _steps(before)[3]
    assert _steps(before)[3] != _steps(before)[2]  # the weights moved: a real comparison
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_2", "step_4"]
    assert "rank 1 holds experts 2-3 of 4" in after, after[-3000:]


@pytest.mark.slow
@pytest.mark.dist
def test_wrong_dispatch_fails_verify(stacked_ep2, tmp_path: Path) -> None:
    """Each route sent one ep rank too far (AUTOPAR_TEST_EP_SHIFT=1, the tests' harness): a
    wrong expert runs it, and --verify says FAILED (exit 1)."""
    plan = stacked_ep2
    rc, out = _run(plan, tmp_path, "--steps", "2", "--verify", AUTOPAR_TEST_EP_SHIFT="1")
    assert rc == 1 and "verify: FAILED" in out and "verify: ok" not in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.dist
def test_mixtral_ep2_fsdp2_world4_verifies(tmp_path: Path) -> None:
    """Tiny HF Mixtral (MixtralExperts: stacked gate_up_proj/down_proj), ep=2 with fsdp=2 at
    world 4: experts sharded by FSDP2 over the 2 ranks holding the same experts."""
    plan = _plan(_hf(tmp_path, TINY_MIXTRAL), 4, "ep=2,fsdp=2,dp=2")
    assert (plan.mesh.ep, plan.mesh.fsdp, plan.mesh.dp) == (2, 2, 2)
    rc, out = _run(plan, tmp_path, "--steps", "3", "--verify")
    _check(plan, rc, out, 2)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("model", ["mixtral", "stacked"])
def test_ep2_with_pp2_verifies(tmp_path: Path, model: str) -> None:
    """pp=2 x ep=2 at world 4 (1F1B, 2 microbatches), tiny HF Mixtral with fsdp=2 and the
    hand-written stacked MoE with dp=2: each rank holds half the experts of its stage's
    layers. The hand-written model's load-balancing loss is a statistic over its batch, so
    the reference runs the same pieces (reference_pieces)."""
    spec, mesh = {
        "mixtral": (_hf(tmp_path, TINY_MIXTRAL), "pp=2,ep=2,fsdp=2"),
        "stacked": (MOE_STACKED, "pp=2,ep=2,dp=2"),
    }[model]
    plan = _plan(spec, 4, mesh)
    assert (plan.mesh.pp, plan.mesh.ep) == (2, 2)
    rc, out = _run(plan, tmp_path, "--steps", "3", "--verify")
    _check(plan, rc, out, 2)


@pytest.mark.slow
@pytest.mark.dist
def test_qwen3_moe_ep2_verifies(tmp_path: Path) -> None:
    """Tiny HF Qwen3-MoE (8 experts, top-2), ep=2 at world 2."""
    plan = _plan(_hf(tmp_path, TINY_QWEN3_MOE), 2, "ep=2")
    rc, out = _run(plan, tmp_path, "--steps", "3", "--verify")
    _check(plan, rc, out, 2)


def _resume(plan, work: Path, source: Path, steps: int) -> tuple[int, str, Path]:
    """``plan`` resumes from a copy of the checkpoint ``source`` (a step folder) up to
    ``steps`` (AdamW), with --save-hf; returns rc, output and the checkpoint directory."""
    ckpt = work / "ckpt"
    ckpt.mkdir(parents=True)
    shutil.copytree(source, ckpt / source.name)
    args = ("--steps", str(steps), "--checkpoint-dir", str(ckpt), "--save-hf", str(work / "hf"))
    rc, out = _launch(plan, work, *args, *ADAMW)
    assert rc == 0, out[-4000:]
    assert RESUMED.findall(out) == [(source.name[5:], str(ckpt / source.name))], out[-4000:]
    return rc, out, ckpt


@pytest.mark.slow
@pytest.mark.dist
def test_ep_checkpoint_loads_under_ep1_and_back(stacked_ep2_killed, tmp_path: Path) -> None:
    """ep=2 -> ep=1 -> ep=2 through DCP's resharding: ep=1 (dp=2) loads the ep=2 step-4
    checkpoint exactly (its --save-hf, no step trained, is the checkpoint's model bit for bit);
    ep=1 resumes ep=2's step 2 and trains steps 3-4 on the ep=2 run's curve (the tolerances
    of test_checkpoint's loads under another plan: 1e-5 relative for the first step after the
    load, 1e-4 after), and ep=2 loads that ep=1 step-4 checkpoint exactly."""
    _, _, ep2_ckpt = stacked_ep2_killed
    reference = {step: loss for step, (loss, _) in _killed_curve(stacked_ep2_killed).items()}
    ep1 = _plan(MOE_STACKED, 2, "dp=2,ep=1")
    assert ep1.mesh.ep == 1 and ep1.mesh.dp == 2
    _, out, _ = _resume(ep1, tmp_path / "ep1_load", ep2_ckpt / "step_4", 4)
    assert _steps(out) == {}, out[-3000:]  # nothing left to train: loaded, then saved as HF
    _same(_hf_tensors(tmp_path / "ep1_load" / "hf"), _checkpoint_model(ep2_ckpt / "step_4"))
    _, out, ep1_ckpt = _resume(ep1, tmp_path / "ep1_train", ep2_ckpt / "step_2", 4)
    losses = {step: loss for step, (loss, _) in _steps(out).items()}
    assert list(losses) == [3, 4] and SAVED.findall(out) == ["4"], out[-3000:]
    for step, loss in losses.items():
        tol = 1e-5 if step == 3 else 1e-4
        assert abs(loss - reference[step]) <= tol * (1 + abs(reference[step])), (step, loss)
    ep2 = _plan(MOE_STACKED, 2, "ep=2")
    _, out, _ = _resume(ep2, tmp_path / "ep2_load", ep1_ckpt / "step_4", 4)
    assert "expert parallel: rank 1 holds experts 2-3 of 4" in out, out[-3000:]
    _same(_hf_tensors(tmp_path / "ep2_load" / "hf"), _checkpoint_model(ep1_ckpt / "step_4"))


@pytest.mark.slow
@pytest.mark.dist
def test_mixtral_ep_checkpoint_save_hf_and_init_from(tmp_path: Path) -> None:
    """Tiny HF Mixtral at fsdp=4 x ep=2 (world 4: each expert tensor a 2-D DTensor, FSDP2 over
    the 2 ranks holding the same experts): 3 AdamW steps, checkpoints 2 and 3, --save-hf.
    transformers' from_pretrained loads the --save-hf directory with every tensor (whole
    expert stacks included) the step-3 checkpoint's, bit for bit; dp=2 x ep=2 (world 2)
    resumes step 2 and logs step 3's loss within 1e-5; --init-from of the --save-hf
    directory at dp=2 x ep=2 loads every tensor and --verify holds; and --init-from of a
    save_pretrained directory (one tensor per expert) at dp=2 x ep=2 loads exactly."""
    import torch
    import transformers

    spec = _hf(tmp_path, TINY_MIXTRAL)
    big = _plan(spec, 4, "fsdp=4,ep=2")
    assert (big.mesh.fsdp, big.mesh.ep, big.world_size) == (4, 2, 4)
    ckpt, hf = tmp_path / "ckpt", tmp_path / "hf"
    args = ["--steps", "3", "--checkpoint-every", "2", "--checkpoint-dir", str(ckpt)]
    rc, out = _launch(big, tmp_path / "big", *args, "--save-hf", str(hf), *ADAMW)
    assert rc == 0 and SAVED.findall(out) == ["2", "3"], out[-4000:]
    assert "rank 3 holds experts 2-3 of 4" in out, out[-3000:]
    saved = _checkpoint_model(ckpt / "step_3")
    assert tuple(saved["model.layers.0.mlp.experts.gate_up_proj"].shape) == (4, 192, 64)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    _same({k: v.detach() for k, v in loaded.state_dict().items()}, saved)
    reference = _steps(out)[3][0]
    small = _plan(spec, 2, "dp=2,ep=2")
    assert (small.mesh.dp, small.mesh.ep, small.world_size) == (2, 2, 2)
    _, out, _ = _resume(small, tmp_path / "small", ckpt / "step_2", 3)
    assert list(_steps(out)) == [3], out[-3000:]
    assert abs(_steps(out)[3][0] - reference) <= 1e-5 * (1 + abs(reference)), out[-3000:]
    rc, out = _run(small, tmp_path / "init", "--steps", "2", "--verify", "--init-from", str(hf))
    _check(small, rc, out, 2)
    assert f"init: loaded {len(saved)} tensors from {hf} (hf)" in out, out[-3000:]
    # save_pretrained's layout (one tensor per expert) into ep=2, through one step at lr 0 and
    # --save-hf (stacked): from_pretrained reads back the very weights it saved
    _tiny_hf(TINY_MIXTRAL, seed=3).save_pretrained(tmp_path / "pretrained")
    args = ["--steps", "1", "--lr", "0", "--init-from", str(tmp_path / "pretrained")]
    rc, out = _run(small, tmp_path / "legacy", *args, "--save-hf", str(tmp_path / "hf2"))
    assert rc == 0 and "init: loaded 21 tensors" in out, out[-3000:]
    written = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf2", dtype=torch.float32
    )
    original = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "pretrained", dtype=torch.float32
    )
    _same(written.state_dict(), original.state_dict())
