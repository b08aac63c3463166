"""Faults the emitted script must survive without losing what the user has (issue 12): a
diverging run, an unreadable newest checkpoint, two runs on one checkpoint directory, another
model's checkpoint, a plan naming modules the model lacks, and unusable checkpoint directories.
Each test runs the emitted script for real (examples/gpt.py, fsdp=2 on 2 gloo ranks, SGD)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
from pathlib import Path

import pytest
from _plans import GPT, forced_plan, megatron_gpt, run_bounded
from autopar.codegen import write_outputs

pytestmark = [pytest.mark.dist, pytest.mark.bad_input]

BLOCKS = [f"blocks.{i}" for i in range(4)]
COMPLETE = "COMPLETE"
RESUMED = re.compile(r"^checkpoint: resumed from step (\d+) ", re.MULTILINE)


def _run(out: Path, *args: str, **env: str) -> tuple[int, str]:
    """launch.sh as a user runs it: with --checkpoint-dir torchrun restarts a crashed group up
    to 3 times, but a user error stops every rank at once, and launch.sh exits 2."""
    env = {"DIST_TIMEOUT_S": "60", **env}
    return run_bounded(["bash", "launch.sh", *args], out, 150, **env)


def _errors(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("error:")]


def _restarted(log: str) -> bool:
    """Whether torchrun started the script more than once (rank 0 says at each start that it
    trains on synthetic batches; torchrun logs its restarts only at INFO level)."""
    return log.count("data: no --data given") > 1


def _warnings(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("warning: checkpoint")]


def _steps(log: str) -> list[dict]:
    return [json.loads(line) for line in log.splitlines() if line.startswith('{"step"')]


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    plan = forced_plan(GPT, 2, {"fsdp": 2}, {}, layers=BLOCKS, optimizer="sgd", lr=0.05)
    return write_outputs(plan, tmp_path_factory.mktemp("faults") / "out")


@pytest.fixture(scope="module")
def four_steps(out, tmp_path_factory) -> Path:
    """One launch shared by the tests that start from a run's checkpoints (each copies them):
    4 steps saving steps 2 and 4."""
    ckpt = tmp_path_factory.mktemp("four_steps") / "ckpt"
    rc, log = _run(out, "--steps", "4", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2")
    assert rc == 0, log[-3000:]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_2", "step_4"]
    return ckpt


def test_nan_stops_at_the_first_non_finite_step_and_saves_nothing_of_it(out, tmp_path):
    ckpt = tmp_path / "ckpt"
    rc, log = _run(out, "--steps", "6", "--lr", "1e30", "--checkpoint-dir", str(ckpt),
                   "--checkpoint-every", "1")  # fmt: skip
    assert rc == 2 and not _restarted(log), log[-3000:]
    (error,) = _errors(log)
    m = re.match(r"error: step (\d+): the (loss|parameters)", error)
    assert m, error
    bad_step = int(m.group(1))
    assert all(r["loss"] is not None for r in _steps(log)), log[-3000:]
    saved = sorted(int(p.name.removeprefix("step_")) for p in ckpt.glob("step_*"))
    assert all(s < bad_step for s in saved), (saved, error)
    # --verify is never ok on a diverged run either.
    rc, log = _run(out, "--steps", "6", "--lr", "1e30", "--verify")
    assert rc != 0 and "verify: ok" not in log and _errors(log), log[-3000:]


def _truncate(path: Path) -> bytes:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return data[: len(data) // 2]


def test_unreadable_newest_checkpoint_falls_back_to_the_previous_one(out, four_steps, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(four_steps, ckpt)
    # step_4: one shard truncated (DCP fails on the rank reading it; the ranks must agree);
    # step_9: its .metadata truncated; step_0011 is not step 11.
    shard = _truncate(ckpt / "step_4" / "__1_0.distcp")
    (ckpt / "step_9").mkdir()
    (ckpt / "step_9" / "COMPLETE").write_text("{}")
    shutil.copy(ckpt / "step_4" / ".metadata", ckpt / "step_9" / ".metadata")
    _truncate(ckpt / "step_9" / ".metadata")
    shutil.copytree(ckpt / "step_2", ckpt / "step_0011")
    rc, log = _run(out, "--steps", "4", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2")
    assert rc == 0, log[-3000:]
    warnings = _warnings(log)
    assert [w.split()[2] for w in warnings[:2]] == [str(ckpt / "step_9"), str(ckpt / "step_4")]
    assert all("is unreadable (" in w for w in warnings[:2]), warnings
    assert re.search(r"is unreadable \(rank \d: \w+Error\b", warnings[1]), warnings
    assert "step_0011" not in log
    assert RESUMED.findall(log) == ["2"], log[-3000:]
    assert [r["step"] for r in _steps(log)] == [3, 4]
    # The new step 4 took the unreadable one's place; that one is kept aside, byte for byte.
    assert warnings[2:] == [f"warning: checkpoint {ckpt / 'step_4'} (unreadable) is kept as "
                            "step_4.unreadable"], warnings  # fmt: skip
    assert (ckpt / "step_4.unreadable" / "__1_0.distcp").read_bytes() == shard
    assert (ckpt / "step_4" / COMPLETE).is_file() and (ckpt / "step_9" / COMPLETE).is_file()


def test_no_readable_checkpoint_is_one_line_and_no_restart(out, tmp_path):
    """Every complete checkpoint unreadable: one error line naming the directory, exit 2 at
    once under launch.sh's default 3 restarts, and every file left in place."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "step_3").mkdir(parents=True)
    (ckpt / "step_3" / "COMPLETE").write_text("{}")  # only the marker
    (ckpt / "step_1").mkdir()
    (ckpt / "step_1" / "COMPLETE").write_text("{}")
    (ckpt / "step_1" / ".metadata").write_bytes(b"\x80\x04not a pickle")  # corrupt
    before = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*"))
    rc, log = _run(out, "--steps", "2", "--checkpoint-dir", str(ckpt))
    assert rc == 2 and not _restarted(log), log[-3000:]
    (error,) = _errors(log)
    assert error.startswith(f"error: no checkpoint in --checkpoint-dir {ckpt} reads back "), error
    assert "step_3 (" in error and "step_1 (" in error and "nothing was deleted" in error, error
    assert len(_warnings(log)) == 2 and not _steps(log), log[-3000:]
    assert sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*")) == before  # no lock left


def test_a_live_runs_lock_refuses_a_second_run_and_a_dead_ones_is_taken_over(out, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    lock = ckpt / ".autopar-lock"
    # A live holder: this test's own process, on this host, under another torchrun run.
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "run_id": "x"}))
    rc, log = _run(out, "--steps", "1", "--checkpoint-dir", str(ckpt))
    assert rc == 2 and not _restarted(log), log[-3000:]
    (error,) = _errors(log)
    assert "is in use by another training" in error and f"pid {os.getpid()}" in error, error
    assert not list(ckpt.glob("step_*"))
    # A dead holder (no such pid): its lock is taken over, and released at the end.
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": 2**22 + 7, "run_id": "x"}))
    rc, log = _run(out, "--steps", "1", "--checkpoint-dir", str(ckpt))
    assert rc == 0, log[-3000:]
    assert (ckpt / "step_1" / "COMPLETE").is_file() and not lock.exists()


def test_a_checkpoint_of_another_model_is_one_line(out, four_steps, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(four_steps / "step_2", ckpt / "step_2")
    rc, log = _run(out, "--steps", "3", "--checkpoint-dir", str(ckpt), GPT_DIM="32")
    assert rc == 2 and not _restarted(log), log[-3000:]
    (error,) = _errors(log)
    assert re.match(r"error: the checkpoint .*step_2 is of another model: \S+ has shape ", error)
    assert not RESUMED.search(log) and not _steps(log)
    rc, log = _run(out, "--steps", "3", "--checkpoint-dir", str(ckpt), GPT_LAYERS="3")
    (error,) = _errors(log)
    assert "blocks.3." in error and "which this model lacks" in error, error


def test_unusable_checkpoint_dirs_are_one_line_before_step_1(out, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("user data")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    for path, expected in ((a_file, "is not a directory"), (shared, "is world-writable")):
        rc, log = _run(out, "--steps", "1", "--checkpoint-dir", str(path))
        assert rc == 2 and not _restarted(log), log[-3000:]
        (error,) = _errors(log)
        assert expected in error and not _steps(log), error
    assert a_file.read_text() == "user data"


def test_a_tp_module_missing_from_the_model_is_one_line(tmp_path):
    styles = {**megatron_gpt(), "blocks.9.attn.q": "colwise"}
    plan = forced_plan(GPT, 2, {"tp": 2}, styles, layers=BLOCKS, optimizer="sgd")
    out = write_outputs(plan, tmp_path / "out")
    rc, log = _run(out, "--steps", "1")
    assert rc == 2 and not _restarted(log), log[-3000:]
    assert _errors(log) == [
        "error: the plan's tensor-parallel module 'blocks.9.attn.q' is not in the model built "
        "by gpt.py:build_model() (the model changed since planning?): re-plan it"
    ], log[-3000:]


def test_all_finite_sees_one_non_finite_value_in_any_parameter():
    """What save_checkpoint asks before publishing weights (one rank, an in-process store)."""
    import torch
    import torch.distributed as dist
    from autopar.codegen.apply import runtime

    rt = runtime()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert rt.all_finite([(model, None)])
        with torch.no_grad():
            model[1].bias[1] = float("nan")
        assert not rt.all_finite([(model, None)])
        with torch.no_grad():
            model[1].bias[1] = float("inf")
        assert not rt.all_finite([(model, None)])
    finally:
        dist.destroy_process_group()
