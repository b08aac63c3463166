"""Faults in the emitted script: DCP checkpoints, torchrun restarts, and the world check.

The checkpoint tests train examples/gpt.py (4 blocks, global batch 8, seq 16, AdamW, fp32 on
gloo) for 8 steps with ``--checkpoint-every 2``. Two uninterrupted runs (FSDP fsdp=2, and a
pipeline pp=2 with 1F1B) are the references, computed once per module.

The kill-a-rank tests inject the fault from the tests' harness (tests/harness/sitecustomize.py,
``AUTOPAR_TEST_KILL_AT_STEP=5``, ``AUTOPAR_TEST_KILL_RANK``; the script ships no test hook): on
torchrun's first attempt, after step 5 is logged (step 4 was the last checkpoint), that rank
SIGKILLs itself; torchrun restarts the group (launch.sh passes ``--max-restarts`` when there is
a ``--checkpoint-dir``) and the script resumes from step 4.
The log is rank 0's stdout of both attempts, one after the other: the first attempt logs steps
1..5 and saves steps 2 and 4, then the one line ``checkpoint: resumed from step 4`` supersedes
every step line after the checkpoint (step 5 here), and the second attempt logs steps 5..8 once
each and saves steps 6 and 8. The losses after the restart must equal the reference's bitwise:
the restored parameters and optimizer state are the saved bytes, the batch of step N is drawn
from a seed that depends only on N, and the computation (fp32, OMP_NUM_THREADS=1, the same
plan, gloo's fixed reduction order) is deterministic, so there is no reason for any difference.

Loading under another plan (DCP resharding: FSDP -> TP, pipeline -> DDP -> one rank) changes the
reduction order, so those losses match the reference within the tolerances --verify uses for
AdamW (train.py: tolerances): 1e-5 for the first step after the load, which runs the restored
weights forward before any update under the new plan, then 1e-4.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _plans import (
    GPT,
    cpu_cluster,
    forced_plan,
    gpt_layers,
    megatron_gpt,
    run_bounded,
    split_layers,
)
from autopar.codegen import emit, write_outputs

TIMEOUT_S = 150
BLOCKS = [f"blocks.{i}" for i in range(4)]
RESUMED = re.compile(r"^checkpoint: resumed from step (\d+) \((.*)\)$", re.MULTILINE)
SAVED = re.compile(r"^checkpoint: saved step (\d+) to ", re.MULTILINE)


def _run(cmd: list[str], cwd: Path, **env: str) -> tuple[int, str]:
    """Run ``cmd`` bounded by TIMEOUT_S (its process group killed on timeout); rc and output."""
    return run_bounded(cmd, cwd, TIMEOUT_S, **{"DIST_TIMEOUT_S": "60", **env})


def _losses(out: str) -> dict[int, float]:
    """step -> loss of the step lines in ``out``, which must name each step once."""
    records = [json.loads(line) for line in out.splitlines() if line.startswith('{"step"')]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), f"a step logged twice: {steps}"
    return {r["step"]: r["loss"] for r in records}


def _fsdp_plan():
    return forced_plan(GPT, 2, {"fsdp": 2}, {}, layers=BLOCKS)


def _pp_plan():
    layers = gpt_layers()
    return forced_plan(
        GPT,
        2,
        {"pp": 2},
        {},
        layers=layers,
        stages=split_layers(layers, 2),
        schedule={"name": "1f1b", "num_microbatches": 2, "stages_per_rank": 1},
    )


def _train(plan, work: Path, ckpt: Path, *args: str, **env: str) -> tuple[int, str]:
    out_dir = write_outputs(plan, work / "out")
    return _run(["bash", "launch.sh", "--checkpoint-dir", str(ckpt), *args], out_dir, **env)


def _reference(plan, work: Path) -> tuple[dict[int, float], Path]:
    ckpt = work / "ckpt"
    rc, out = _train(plan, work, ckpt, "--steps", "8", "--checkpoint-every", "2")
    assert rc == 0, out[-4000:]
    assert [int(s) for s in SAVED.findall(out)] == [2, 4, 6, 8], out[-4000:]
    assert not RESUMED.search(out), out[-4000:]
    losses = _losses(out)
    assert list(losses) == list(range(1, 9)), out[-4000:]
    return losses, ckpt


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory) -> tuple[dict[int, float], Path]:
    return _reference(_fsdp_plan(), tmp_path_factory.mktemp("fsdp_reference"))


@pytest.fixture(scope="module")
def pp_reference(tmp_path_factory) -> tuple[dict[int, float], Path]:
    return _reference(_pp_plan(), tmp_path_factory.mktemp("pp_reference"))


def _check_killed_run_resumes_bitwise(plan, kill_rank: int, reference, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    rc, out = _train(
        plan,
        tmp_path,
        ckpt,
        *("--steps", "8", "--checkpoint-every", "2"),
        AUTOPAR_TEST_KILL_AT_STEP="5",
        AUTOPAR_TEST_KILL_RANK=str(kill_rank),
    )
    assert rc == 0, out[-6000:]
    assert "exitcode: -9" in out, out[-6000:]  # torchrun saw the SIGKILL and restarted
    resumed = RESUMED.findall(out)
    assert resumed == [("4", str(ckpt / "step_4"))], out[-6000:]
    before, after = out.split("checkpoint: resumed from step 4", 1)
    # The first attempt: steps 1..5, checkpoints 2 and 4; step 5 is superseded by the resume.
    assert list(_losses(before)) == [1, 2, 3, 4, 5], before[-4000:]
    assert [int(s) for s in SAVED.findall(before)] == [2, 4], before[-4000:]
    # After the restart: each of steps 5..8 exactly once, bitwise the uninterrupted losses.
    losses_after = _losses(after)
    assert list(losses_after) == [5, 6, 7, 8], after[-4000:]
    assert [int(s) for s in SAVED.findall(after)] == [6, 8], after[-4000:]
    ref_losses = reference[0]
    assert losses_after == {step: ref_losses[step] for step in (5, 6, 7, 8)}
    assert _losses(before) == {step: ref_losses[step] for step in (1, 2, 3, 4, 5)}
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_2", "step_4", "step_6", "step_8"]


@pytest.mark.dist
def test_fsdp_run_with_a_killed_rank_resumes_bitwise(fsdp_reference, tmp_path: Path) -> None:
    _check_killed_run_resumes_bitwise(_fsdp_plan(), 1, fsdp_reference, tmp_path)


# the kill, restart and bitwise resume are the FSDP test's above; a pipeline's checkpoint is
# saved and loaded by test_pipeline_checkpoint_loads_under_ddp_then_one_rank (~38 s: slow tier)
@pytest.mark.slow
@pytest.mark.dist
def test_pipeline_run_with_a_killed_rank_resumes_bitwise(pp_reference, tmp_path: Path) -> None:
    # Rank 0, which logs, holds the first stage: the last stage's rank 1 outlives it.
    _check_killed_run_resumes_bitwise(_pp_plan(), 0, pp_reference, tmp_path)


def _check_close(losses: dict[int, float], reference: dict[int, float], first: int) -> None:
    for step, loss in losses.items():
        tol = 1e-5 if step == first else 1e-4
        assert abs(loss - reference[step]) <= tol * (1 + abs(reference[step])), (step, loss)


@pytest.mark.dist
def test_fsdp_checkpoint_loads_under_tp_and_skips_incomplete_ones(
    fsdp_reference, tmp_path: Path
) -> None:
    ref_losses, ref_ckpt = fsdp_reference
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for name in ("step_2", "step_4"):
        shutil.copytree(ref_ckpt / name, ckpt / name)
    # What a death mid-save leaves: all of step 6's files but no marker (a copy interrupted,
    # say), and a temporary folder with a partial file; and a folder that is no checkpoint.
    shutil.copytree(ref_ckpt / "step_6", ckpt / "step_6")
    (ckpt / "step_6" / "COMPLETE").unlink()
    (ckpt / ".tmp-step_8").mkdir()
    (ckpt / ".tmp-step_8" / "__0_0.distcp").write_bytes(b"partial")
    (ckpt / "step_latest").mkdir()
    attrs = {f"{b}.attn": {"n_head": 2} for b in BLOCKS}
    tp = forced_plan(GPT, 2, {"tp": 2}, megatron_gpt(), layers=BLOCKS, module_attrs=attrs)
    rc, out = _train(tp, tmp_path, ckpt, "--steps", "6", "--checkpoint-every", "2")
    assert rc == 0, out[-4000:]
    assert RESUMED.findall(out) == [("4", str(ckpt / "step_4"))], out[-4000:]
    losses = _losses(out)
    assert list(losses) == [5, 6], out[-4000:]
    _check_close(losses, ref_losses, first=5)
    # The stale temporary folder is gone; step 6 was saved again, whole, under the TP plan,
    # and the incomplete copy is kept aside, never deleted.
    assert sorted(p.name for p in ckpt.iterdir()) == [
        *("step_2", "step_4", "step_6", "step_6.incomplete", "step_latest")
    ]
    assert "warning: checkpoint " in out and "(incomplete) is kept as step_6.incomplete" in out
    marker = json.loads((ckpt / "step_6" / "COMPLETE").read_text())
    assert marker == {"step": 6, "world_size": 2, "mesh": {"pp": 1, "dp": 1, "fsdp": 1, "tp": 2}}


@pytest.mark.dist
def test_pipeline_checkpoint_loads_under_ddp_then_one_rank(pp_reference, tmp_path: Path) -> None:
    ref_losses, ref_ckpt = pp_reference
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copytree(ref_ckpt / "step_4", ckpt / "step_4")
    ddp = forced_plan(GPT, 2, {"dp": 2}, {}, layers=BLOCKS)
    rc, out = _train(ddp, tmp_path / "ddp", ckpt, "--steps", "6", "--checkpoint-every", "2")
    assert rc == 0, out[-4000:]
    assert RESUMED.findall(out) == [("4", str(ckpt / "step_4"))], out[-4000:]
    losses = _losses(out)
    assert list(losses) == [5, 6], out[-4000:]
    _check_close(losses, ref_losses, first=5)
    # The DDP checkpoint of step 6 (each parameter saved once) on a single process.
    one = forced_plan(GPT, 1, {}, {}, layers=BLOCKS)
    rc, out = _train(one, tmp_path / "one", ckpt, "--steps", "8")
    assert rc == 0, out[-4000:]
    assert RESUMED.findall(out) == [("6", str(ckpt / "step_6"))], out[-4000:]
    losses = _losses(out)
    assert list(losses) == [7, 8], out[-4000:]
    _check_close(losses, ref_losses, first=7)
    assert [int(s) for s in SAVED.findall(out)] == [8]  # no --checkpoint-every: the last step


# ---- The world check ------------------------------------------------------------------------


def _run_ranks(out_dir: Path, world: int, local_world: int, *args: str) -> list:
    """Every rank of the script by hand, as torchrun would start them, at once: each must stop
    by itself before any collective (a rank that waited for another would time out here)."""
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(local_world),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "train.py", *args],
                cwd=out_dir,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    results = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=120)
            results.append((proc.returncode, err))
        except subprocess.TimeoutExpired:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
            pytest.fail("a rank did not stop by itself")
    return results


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def _two_nodes_of_one(plan):
    return plan.model_copy(
        update={
            "cluster": cpu_cluster(2).model_copy(update={"num_nodes": 2, "devices_per_node": 1})
        }
    )


WORLD_MISMATCHES = {
    # name -> (plan, world, ranks on this node, the error line)
    "world size": (
        _fsdp_plan,
        3,
        3,
        "error: this plan needs 2 ranks, launched with 3: run `torchrun --nproc-per-node 2 "
        "train.py` (see launch.sh)",
    ),
    "ranks per node": (
        lambda: _two_nodes_of_one(_fsdp_plan()),
        2,
        2,
        "error: this plan runs 1 ranks per node (cluster cpu:2), launched with 2 on this node: "
        "use launch.sh, or plan for this cluster",
    ),
}


@pytest.mark.parametrize("case", list(WORLD_MISMATCHES))
def test_world_mismatch_is_one_error_line_and_exit_2_on_every_rank(
    case: str, tmp_path: Path
) -> None:
    make_plan, world, local_world, error = WORLD_MISMATCHES[case]
    out_dir = write_outputs(make_plan(), tmp_path / "out")
    results = _run_ranks(out_dir, world, local_world, "--steps", "2")
    assert [rc for rc, _ in results] == [2] * world, results
    assert _error_lines(results[0][1]) == [error], results[0][1]
    assert all(_error_lines(err) == [] for _, err in results[1:]), results


def test_gpu_plan_on_a_machine_without_cuda_is_an_error(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from autopar.cost_model import parse_cluster

    plan = _fsdp_plan().model_copy(update={"cluster": parse_cluster("2xH100")})
    out_dir = write_outputs(plan, tmp_path / "out")
    assert 'BACKEND = "nccl"' in (out_dir / "train.py").read_text()
    results = _run_ranks(out_dir, 2, 2, "--steps", "2")
    assert [rc for rc, _ in results] == [2, 2], results
    (line,) = _error_lines(results[0][1])
    assert line.startswith("error: this plan is for CUDA GPUs with nccl (cluster 2xH100), but"), (
        line
    )
    assert "plan for this machine (--cluster cpu:N)" in line
    assert _error_lines(results[1][1]) == []


@pytest.mark.parametrize(
    "args, error",
    [
        (
            ["--checkpoint-every", "2"],
            "error: --checkpoint-every 2 needs --checkpoint-dir, and K >= 1",
        ),
        (
            ["--checkpoint-dir", "c", "--checkpoint-every", "0"],
            "error: --checkpoint-every 0 needs --checkpoint-dir, and K >= 1",
        ),
        (
            ["--checkpoint-dir", "c", "--verify"],
            "error: --verify compares with a run from step 1 and cannot resume: drop "
            "--checkpoint-dir or --verify",
        ),
    ],
)
def test_bad_checkpoint_flags_are_one_error_line(args, error, tmp_path: Path) -> None:
    out_dir = write_outputs(forced_plan(GPT, 1, {}, {}, layers=BLOCKS), tmp_path / "out")
    rc, out = _run([sys.executable, "train.py", *args], out_dir)
    assert rc == 2 and _error_lines(out) == [error], out
    assert not (out_dir / "c").exists()


def test_launch_sh_restarts_only_with_a_checkpoint_dir(tmp_path: Path) -> None:
    launch = emit(_fsdp_plan())["launch.sh"]
    assert (
        'torchrun --max-restarts "${MAX_RESTARTS:-$restarts}" --standalone '
        '--nproc-per-node 2 "$here/train.py" "$@" &'
    ) in launch
    script = tmp_path / "launch.sh"
    script.write_text(launch)
    # A stand-in torchrun: prints its arguments, records a user error in AUTOPAR_ERROR_FILE
    # when FAKE_USER_ERROR is set (as train.py's ranks do), and exits FAKE_RC.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(
        "#!/usr/bin/env bash\n"
        'echo "torchrun $*"\n'
        'echo "error file: $AUTOPAR_ERROR_FILE"\n'
        'if [ -n "${FAKE_USER_ERROR:-}" ]; then echo "rank 0: bad" >> "$AUTOPAR_ERROR_FILE"; fi\n'
        'exit "${FAKE_RC:-0}"\n'
    )
    (bin_dir / "torchrun").chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k != "MAX_RESTARTS"}
    base["PATH"] = f"{bin_dir}{os.pathsep}{base['PATH']}"

    def run(args, **env):
        result = subprocess.run(
            ["bash", str(script), *args],
            env={**base, **env},
            capture_output=True,
            text=True,
            timeout=30,
        )
        error_file = result.stdout.split("error file: ", 1)[1].split()[0]
        assert not Path(error_file).exists()  # removed on the way out
        return result

    for args, env, restarts in [
        ([], {}, "0"),
        (["--checkpoint-dir", "c"], {}, "3"),
        (["--checkpoint-dir=c"], {}, "3"),
        (["--checkpoint-dir", "c"], {"MAX_RESTARTS": "7"}, "7"),
        ([], {"MAX_RESTARTS": "1"}, "1"),
    ]:
        result = run(args, **env)
        assert result.stdout.startswith(f"torchrun --max-restarts {restarts} "), result
        assert result.returncode == 0, result
    # A user error recorded by the ranks (which then end cleanly): exit 2, not torchrun's 0.
    assert run(["--checkpoint-dir", "c"], FAKE_USER_ERROR="1").returncode == 2
    # A crash torchrun gave up on: its own exit code.
    assert run(["--checkpoint-dir", "c"], FAKE_RC="1").returncode == 1
    one_rank = emit(forced_plan(GPT, 1, {}, {}, layers=BLOCKS))["launch.sh"]
    assert "max-restarts" not in one_rank  # plain python: nothing restarts it
