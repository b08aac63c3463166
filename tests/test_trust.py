"""Nothing a user has is lost, and nothing a user is given runs code (issue 25, classes 1, 2, 3
and 7, and int32 weights): --save-hf writes into a temporary sibling and replaces only its own
files; it is checked (symlink, writable, apart from --checkpoint-dir and --init-from) before
step 1; a save that fails at the end says how to export again; DCP metadata and values are read
without running code; a full disk during a checkpoint save is one line with the earlier
checkpoints intact; integer tensors never load into float weights.

The runtime's functions run in this process on a one-rank gloo group (as train.py calls them);
one launch per class runs the emitted script for real. A full disk is a real one: a small tmpfs
mounted for the test (root is needed, as CI and the developers' machines have; elsewhere those
cases skip)."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import pickle
import re
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _plans import GPT, forced_plan, run_bounded
from autopar.codegen import write_outputs
from autopar.codegen.apply import runtime

rt = runtime()
export = importlib.import_module("autopar_runtime.export")  # save_hf's module: its lookups
pytestmark = [pytest.mark.bad_input, pytest.mark.filterwarnings("ignore::UserWarning")]

BLOCKS = [f"blocks.{i}" for i in range(4)]


class Payload:
    """A pickle that runs ``touch <path>`` when unpickled: the attack a crafted checkpoint makes."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@pytest.fixture
def group():
    """A one-rank gloo group in this process (what train.py's collectives run on)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@contextlib.contextmanager
def tmpfs(path: Path, size: str, *options: str):
    """A real small (or read-only) filesystem at ``path``, unmounted afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    opts = ",".join([f"size={size}", *options])
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], check=False)
    if done.returncode != 0:
        pytest.skip("mounting a tmpfs needs root (a full or read-only disk is simulated by one)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _files(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def _linear(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))


def _load_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out |= load_file(file)
    return out


# ---- 1. --save-hf replaces only its own files ---------------------------------------------------
def test_save_hf_keeps_the_users_files_and_replaces_only_its_own(group, tmp_path, monkeypatch):
    target = tmp_path / "export"
    two_files = rt.hf_file_index
    monkeypatch.setattr(export, "hf_file_index", lambda sizes: two_files(sizes, limit=64 * 64 * 4))
    rt.save_hf(target, [_linear(1)], None)
    first = sorted(p.name for p in target.iterdir())
    assert first == [
        "autopar-save-hf.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    marker = json.loads((target / rt.SAVE_HF_MARKER).read_text())
    assert sorted(marker["files"]) == first
    (target / "tokenizer.json").write_text('{"user": "tokenizer"}')
    (target / "notes").mkdir()
    (target / "notes" / "README").write_text("mine")
    monkeypatch.setattr(export, "hf_file_index", two_files)  # now one file: the second is stale
    model = _linear(2)
    rt.save_hf(target, [model], None)
    assert sorted(p.name for p in target.iterdir()) == [
        "autopar-save-hf.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
        "notes",
        "tokenizer.json",
    ]
    assert (target / "tokenizer.json").read_text() == '{"user": "tokenizer"}'
    assert (target / "notes" / "README").read_text() == "mine"
    saved = _load_safetensors(target)
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    assert not list(tmp_path.glob(".export.save-hf-*"))  # the temporary sibling is gone


def test_save_hf_is_checked_before_step_1(tmp_path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    cases = [
        ((link,), {}, "is a symlink (to "),
        ((tmp_path / "ckpt",), {"checkpoint-dir": tmp_path / "ckpt"}, "is --checkpoint-dir"),
        ((tmp_path / "ckpt" / "hf",), {"checkpoint-dir": tmp_path / "ckpt"}, "lies inside"),
        ((tmp_path,), {"checkpoint-dir": tmp_path / "ckpt"}, "holds --checkpoint-dir"),
        ((real,), {"init-from": str(real)}, f"--save-hf {real} is --init-from {real}"),
    ]
    for args, others, match in cases:
        with pytest.raises(rt.InputError, match=re.escape(match)):
            rt.check_save_hf(*args, **others)
    rt.check_save_hf(tmp_path / "new" / "deep", **{"checkpoint-dir": tmp_path / "ckpt"})
    assert real.is_dir() and not list(real.iterdir()) and not (tmp_path / "new").exists()


def test_save_hf_under_a_read_only_directory_is_refused(tmp_path) -> None:
    with tmpfs(tmp_path / "ro", "1m", "ro") as ro:
        for target in (ro / "export", ro / "a" / "b"):
            with pytest.raises(rt.InputError, match="cannot write in .*Read-only file system"):
                rt.check_save_hf(target)


def test_save_hf_on_a_full_disk_leaves_the_directory_as_it_was(group, tmp_path, capsys):
    with tmpfs(tmp_path / "disk", "96k") as disk:
        target = disk / "export"
        rt.save_hf(target, [_linear(1)], None)  # 17 KiB: fits
        (target / "tokenizer.json").write_text("mine")
        before = _files(target)
        big = torch.nn.Linear(256, 256)  # 257 KiB: does not
        with pytest.raises(SystemExit) as stop:
            rt.save_hf(target, [big], None, checkpoint_dir=tmp_path / "ckpt", steps=7)
        assert stop.value.code == 2
        (error,) = _error_lines(capsys.readouterr().err)
        assert error.startswith(f"error: --save-hf {target}: writing the weights failed (")
        assert "the disk is full: " in error and f"{target} is as it was" in error
        assert f"--checkpoint-dir {tmp_path / 'ckpt'} (step 7)" in error and "--steps 7" in error
        assert _files(target) == before
        assert sorted(p.name for p in disk.iterdir()) == ["export"]  # no temporary sibling left


# ---- 3. checkpoints are read without running code -------------------------------------------
def _dcp_save(state: dict, path: Path) -> None:
    dcp.save(state, checkpoint_id=path, no_dist=True)


def test_crafted_dcp_metadata_is_refused_without_running_it(tmp_path) -> None:
    source = tmp_path / "init"
    _dcp_save({"weight": torch.ones(2, 2)}, source)
    assert rt.saved_shapes(*rt.init_source(source)) == {"weight": (2, 2)}
    ran = tmp_path / "payload-ran"
    (source / ".metadata").write_bytes(pickle.dumps(Payload(ran)))
    with pytest.raises(rt.InputError, match=r"cannot read it \(UnpicklingError: it names posix"):
        rt.saved_shapes(*rt.init_source(source))
    assert not ran.exists()
    # the same bytes through DCP's own reader run the payload: the test would see it
    with contextlib.suppress(Exception):
        dcp.FileSystemReader(source).read_metadata()
    assert ran.exists()


def test_crafted_dcp_values_are_read_with_weights_only(tmp_path) -> None:
    source = tmp_path / "ckpt"
    ran = tmp_path / "payload-ran"
    _dcp_save({"w": torch.ones(2), "lr": Payload(ran)}, source)  # a non-tensor value: pickled
    assert not ran.exists()
    state = {"w": torch.zeros(2), "lr": 0.0}
    with pytest.raises(dcp.CheckpointException) as caught:
        dcp.load(
            state, storage_reader=rt.SafeReader(source), planner=rt.SafeLoadPlanner(), no_dist=True
        )
    assert (
        importlib.import_module("autopar_runtime.checkpoint")
        ._why(caught.value)
        .startswith("rank 0: UnpicklingError: Weights only load failed")
    )
    assert not ran.exists()
    plain = {"w": torch.ones(2), "lr": 0.5, "betas": (0.9, 0.95)}  # what optimizers hold
    _dcp_save(plain, tmp_path / "plain")
    state = {"w": torch.zeros(2), "lr": 0.0, "betas": (0.0, 0.0)}
    dcp.load(state, storage_reader=rt.SafeReader(tmp_path / "plain"),
             planner=rt.SafeLoadPlanner(), no_dist=True)  # fmt: skip
    assert (
        state["lr"] == 0.5 and state["betas"] == (0.9, 0.95) and torch.equal(state["w"], plain["w"])
    )


def test_resume_skips_a_crafted_checkpoint_without_running_it(group, tmp_path, capsys) -> None:
    ckpt = tmp_path / "ckpt"
    ran = tmp_path / "payload-ran"
    (ckpt / "step_3").mkdir(parents=True)
    (ckpt / "step_3" / "COMPLETE").write_text("{}")
    (ckpt / "step_3" / ".metadata").write_bytes(pickle.dumps(Payload(ran)))
    model = _linear(0)
    with pytest.raises(SystemExit):
        rt.resume(ckpt, [(model, torch.optim.SGD(model.parameters()))], torch.device("cpu"))
    assert not ran.exists()
    err = capsys.readouterr().err
    assert "is unreadable (UnpicklingError: it names posix.system" in err, err


def test_dcp_init_from_is_trusted_input(tmp_path) -> None:
    source = tmp_path / "init"
    _dcp_save({"weight": torch.ones(2, 2)}, source)
    source.chmod(0o777)
    with pytest.raises(rt.InputError, match="--init-from .* is world-writable"):
        rt.init_source(source)
    source.chmod(0o755)
    os.chown(source, 65534, 65534)  # nobody's (the tests run as root, as CI does)
    with pytest.raises(rt.InputError, match="belongs to another user"):
        rt.init_source(source)
    os.chown(source, os.getuid(), os.getgid())
    assert rt.init_source(source) == ("dcp", source)
    from safetensors.torch import save_file

    save_file({"weight": torch.ones(2, 2)}, source / "model.safetensors")
    assert rt.init_source(source) == ("hf", source)  # safetensors (no code) first


# ---- int32 safetensors ------------------------------------------------------------------------
def test_integer_weights_are_refused_and_casts_are_said(tmp_path) -> None:
    from safetensors.torch import save_file

    model = torch.nn.Linear(4, 4)
    save_file({"weight": torch.ones(4, 4, dtype=torch.int32), "bias": torch.ones(4)},
              tmp_path / "model.safetensors")  # fmt: skip
    saved = rt.saved_tensors("hf", tmp_path)
    mapping = rt.match_names(model, {k: s for k, (s, _) in saved.items()}, tmp_path)
    with pytest.raises(rt.InputError, match=r"holds weight \(int32, the model's float32\)"):
        rt.check_dtypes(model, mapping, saved, tmp_path)
    save_file({"weight": torch.ones(4, 4, dtype=torch.bfloat16), "bias": torch.ones(4)},
              tmp_path / "model.safetensors")  # fmt: skip
    saved = rt.saved_tensors("hf", tmp_path)
    assert (
        rt.check_dtypes(model, mapping, saved, tmp_path)
        == "cast 1 tensors from bfloat16 to float32"
    )


# ---- 7. checkpoint faults ---------------------------------------------------------------------
def _constants() -> rt.Constants:
    return rt.Constants(MODEL_FILE=GPT, FACTORY="build_model", MESH={"pp": 1, "dp": 1, "fsdp": 1,
                        "tp": 1}, WORLD_SIZE=1, CLUSTER="cpu:1", RANKS_PER_NODE=1,
                        BACKEND="gloo", GLOBAL_BATCH=2, SEQ_LEN=None, DTYPE="fp32",
                        OPTIMIZER="sgd", LR=0.1)  # fmt: skip


def test_a_full_disk_during_a_save_keeps_the_earlier_checkpoints(group, tmp_path, capsys):
    with tmpfs(tmp_path / "disk", "160k") as disk:
        model = _linear(0)  # 17 KiB of weights
        parts = [(model, torch.optim.SGD(model.parameters()))]
        rt.save_checkpoint(_constants(), disk, 1, parts, torch.device("cpu"))
        before = _files(disk / "step_1")
        big = torch.nn.Linear(256, 256)
        parts = [(big, torch.optim.SGD(big.parameters()))]
        with pytest.raises(SystemExit) as stop:
            rt.save_checkpoint(_constants(), disk, 2, parts, torch.device("cpu"))
        assert stop.value.code == 2
        (error,) = _error_lines(capsys.readouterr().err)
        assert error.startswith(f"error: step 2: saving the checkpoint to {disk} failed (")
        assert "the disk is full: " in error and "step_1, ...) are kept" in error
        assert sorted(p.name for p in disk.iterdir()) == ["step_1"]
        assert _files(disk / "step_1") == before


def test_a_symlinked_save_in_progress_is_refused(tmp_path, capsys) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious").write_text("mine")
    (ckpt / ".tmp-step_3").symlink_to(elsewhere)
    with pytest.raises(SystemExit) as stop:
        rt.check_checkpoint_dir(ckpt)
    assert stop.value.code == 2
    (error,) = _error_lines(capsys.readouterr().err)
    assert ".tmp-step_3, a symlink where autopar keeps a save in progress" in error
    assert (elsewhere / "precious").read_text() == "mine"


# ---- The emitted script, for real ------------------------------------------------------------
@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    plan = forced_plan(GPT, 2, {"fsdp": 2}, {}, layers=BLOCKS, optimizer="sgd", lr=0.05)
    return write_outputs(plan, tmp_path_factory.mktemp("trust") / "out")


def _run(out: Path, *args: str) -> tuple[int, str]:
    return run_bounded(["bash", "launch.sh", *args], out, 150, DIST_TIMEOUT_S="60")


def _steps(log: str) -> list[int]:
    return [json.loads(line)["step"] for line in log.splitlines() if line.startswith('{"step"')]


@pytest.mark.dist
def test_save_hf_and_checkpoints_survive_runs_and_a_full_disk(out, tmp_path) -> None:
    """A second run into an earlier --save-hf keeps the user's tokenizer; a --checkpoint-dir
    inside --save-hf is refused before step 1; a disk that fills while the checkpoint is saved
    is one line, no restart, the earlier checkpoint intact; a --save-hf that fails at the end
    names the command that exports again, and that command does (no step trained)."""
    export, ckpt = tmp_path / "export", tmp_path / "ckpt"
    rc, log = _run(out, "--steps", "1", "--checkpoint-dir", str(ckpt), "--save-hf", str(export))
    assert rc == 0, log[-3000:]
    (export / "tokenizer.json").write_text("mine")
    rc, log = _run(out, "--steps", "1", "--checkpoint-dir", str(export / "ckpt"),
                   "--save-hf", str(export))  # fmt: skip
    assert rc == 2 and not _steps(log), log[-3000:]
    (error,) = _error_lines(log)
    assert f"--save-hf {export} holds --checkpoint-dir {export / 'ckpt'}" in error, error
    assert (export / "tokenizer.json").read_text() == "mine" and not (export / "ckpt").exists()

    with tmpfs(tmp_path / "disk", "100k") as disk:  # the model's checkpoint is ~150 KiB
        rc, log = _run(out, "--steps", "2", "--checkpoint-dir", str(disk / "ckpt"))
        assert rc == 2 and log.count("data: no --data given") == 1, log[-3000:]  # no restart
        (error,) = _error_lines(log)
        assert "step 2: saving the checkpoint" in error and "the disk is full" in error, error
        assert sorted(p.name for p in (disk / "ckpt").iterdir()) == []  # nothing half-written

        rc, log = _run(out, "--steps", "2", "--checkpoint-dir", str(ckpt),
                       "--save-hf", str(disk / "export"))  # fmt: skip
        assert rc == 2 and _steps(log) == [2], log[-3000:]
        (error,) = _error_lines(log)
        assert "writing the weights failed" in error and "--steps 2" in error, error
        assert sorted(p.name for p in disk.iterdir()) == ["ckpt"]
    rc, log = _run(out, "--steps", "2", "--checkpoint-dir", str(ckpt), "--save-hf", str(export))
    assert rc == 0 and _steps(log) == [] and "resumed from step 2" in log, log[-3000:]
    assert (export / "tokenizer.json").read_text() == "mine"
    assert len(_load_safetensors(export)) > 0
