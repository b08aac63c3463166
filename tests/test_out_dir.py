"""``--out DIR`` never loses what a user has: only the files autopar wrote there are replaced (each
atomically), everything else in DIR stays, a symbolic link is followed, a relative path is fixed
before the model file runs, and an unwritable ``--report`` stops the run before DIR is written."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from autopar.codegen import emit, write_outputs
from autopar.codegen.write import MANIFEST, OutputConflict

from autopar.cli import main

ROOT = Path(__file__).resolve().parents[1]
MLP = str(ROOT / "examples" / "mlp.py")


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """plan.json of one real planning run (the MLP example on cpu:2)."""
    out = tmp_path_factory.mktemp("saved") / "out"
    assert main([MLP, "--cluster", "cpu:2", "--global-batch", "4", "--out", str(out), "-q"]) == 0
    return out / "plan.json"


def _user_files(folder: Path) -> dict[str, bytes]:
    """A user's directory: notes, a copy of the model file, a checkpoint of an earlier run."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes.txt").write_text("my notes")
    shutil.copy(MLP, folder / "mlp.py")
    step = folder / "ckpt" / "step_7"
    step.mkdir(parents=True)
    (step / "__0_0.distcp").write_bytes(b"\x00weights")
    (step / "COMPLETE").write_text("")
    return _snapshot(folder)


def test_out_keeps_user_files_and_checkpoints(saved, tmp_path, capsys):
    out = tmp_path / "run"
    before = _user_files(out)
    code, _, stderr = _run(["--plan", str(saved), "--out", str(out), "-q"], capsys)
    assert code == 0, stderr
    after = _snapshot(out)
    assert {k: after[k] for k in before} == before  # every user file, byte for byte
    written = json.loads((out / MANIFEST).read_text())["files"]
    assert set(written) == set(emit(type_of_plan(saved)))
    assert set(after) == set(before) | set(written) | {MANIFEST}
    # a second run replaces only its own files and still keeps the user's
    code, _, stderr = _run(["--plan", str(saved), "--out", str(out), "-q"], capsys)
    assert code == 0, stderr
    assert {k: _snapshot(out)[k] for k in before} == before
    assert not [p.name for p in out.iterdir() if ".tmp-" in p.name]


def type_of_plan(path: Path):
    from autopar import Plan

    return Plan.load(path)


def test_out_dot_next_to_the_model_file(tmp_path, capsys, monkeypatch):
    """``--out .`` in the folder that holds the model file: the model file stays."""
    shutil.copy(MLP, tmp_path / "mlp.py")
    (tmp_path / "data.csv").write_text("1,2,3\n")
    monkeypatch.chdir(tmp_path)
    code, _, stderr = _run(
        ["mlp.py", "--cluster", "cpu:2", "--global-batch", "4", "--out", ".", "-q"], capsys
    )
    assert code == 0, stderr
    assert (tmp_path / "mlp.py").read_text() == Path(MLP).read_text()
    assert (tmp_path / "data.csv").read_text() == "1,2,3\n"
    assert (tmp_path / "train.py").is_file() and (tmp_path / MANIFEST).is_file()


@pytest.mark.parametrize("whose", ["user", "edited"])
def test_a_file_autopar_did_not_write_is_refused(whose, saved, tmp_path, capsys):
    out = tmp_path / "run"
    if whose == "user":
        out.mkdir()
        (out / "train.py").write_text("# my own training script\n")
    else:
        assert _run(["--plan", str(saved), "--out", str(out), "-q"], capsys)[0] == 0
        with (out / "train.py").open("a") as f:
            f.write("# a hand edit\n")
    before = _snapshot(out)
    code, stdout, stderr = _run(["--plan", str(saved), "--out", str(out)], capsys)
    assert code == 2 and stdout == ""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    why = "autopar did not write" if whose == "user" else "was edited since"
    assert "train.py" in lines[0] and why in lines[0] and "move train.py away" in lines[0]
    assert _snapshot(out) == before  # nothing written, nothing replaced


def test_stale_outputs_go_and_edited_ones_stay(saved, tmp_path):
    plan = type_of_plan(saved)
    out = tmp_path / "run"
    write_outputs(plan, out, extra={"report.md": "# one\n", "old.md": "# two\n"})
    (out / "old.md").write_text("# edited by the user\n")
    write_outputs(plan, out)
    assert not (out / "report.md").exists()  # autopar's, no longer emitted: removed
    assert (out / "old.md").read_text() == "# edited by the user\n"  # changed: kept
    assert "old.md" in json.loads((out / MANIFEST).read_text())["files"]


def test_a_manifest_never_names_a_path_outside(saved, tmp_path):
    """A hand-made manifest naming ``../victim`` or a folder cannot make autopar delete it."""
    out = tmp_path / "run"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    (out / "sub").mkdir()
    (out / "sub" / "f").write_text("keep")
    fake = {"files": {"../victim.txt": "0" * 64, "sub": "0" * 64, "sub/f": "0" * 64}}
    (out / MANIFEST).write_text(json.dumps(fake))
    write_outputs(type_of_plan(saved), out)
    assert victim.read_text() == "keep" and (out / "sub" / "f").read_text() == "keep"


def test_a_failed_write_changes_nothing(saved, tmp_path):
    plan = type_of_plan(saved)
    out = tmp_path / "run"
    write_outputs(plan, out, extra={"report.md": "# report\n"})
    before = _snapshot(out)
    bad = plan.model_copy(update={"mesh": plan.mesh.model_copy(update={"dp": 1, "pp": 2})})
    with pytest.raises(ValueError, match="pipeline parallelism"):
        write_outputs(bad, out)
    with pytest.raises(ValueError, match="plain file name"):
        write_outputs(plan, out, extra={"../escape.txt": ""})
    with pytest.raises(UnicodeEncodeError):  # a lone surrogate cannot be written as UTF-8
        write_outputs(plan, out, extra={"notes.txt": "\ud800"})
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert os.access(out / "launch.sh", os.X_OK)


def test_symlinked_out_is_followed_never_replaced(saved, tmp_path, capsys):
    real = tmp_path / "real"
    before = _user_files(real)
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    code, _, stderr = _run(["--plan", str(saved), "--out", str(link), "-q"], capsys)
    assert code == 0, stderr
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert (real / "train.py").is_file()
    assert {k: _snapshot(real)[k] for k in before} == before
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    code, _, stderr = _run(["--plan", str(saved), "--out", str(dangling)], capsys)
    assert code == 2 and "symbolic link" in stderr and len(stderr.strip().splitlines()) == 1
    assert dangling.is_symlink() and not (tmp_path / "nowhere").exists()


def test_relative_out_is_resolved_before_the_model_file_runs(tmp_path, capsys, monkeypatch):
    """A model file that changes the working directory does not move ``--out`` (or --report)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    model = tmp_path / "wanders.py"
    model.write_text(Path(MLP).read_text() + f"\nimport os\n\nos.chdir({str(elsewhere)!r})\n")
    monkeypatch.chdir(tmp_path)
    code, _, stderr = _run(
        ["wanders.py", "--cluster", "cpu:2", "--global-batch", "4", "--out", "out", "-q"], capsys
    )
    assert code == 0, stderr
    assert (tmp_path / "out" / "train.py").is_file()
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize("where", ["under a file", "unwritable folder", "a directory"])
def test_unwritable_report_fails_before_out_is_written(where, saved, tmp_path, capsys):
    (tmp_path / "afile").write_text("keep")
    (tmp_path / "adir").mkdir()
    report = {
        "under a file": tmp_path / "afile" / "report.html",
        "unwritable folder": Path("/proc/autopar-report.html"),  # takes no new files, even as root
        "a directory": tmp_path / "adir",
    }[where]
    out = tmp_path / "out"
    code, _, stderr = _run(
        ["--plan", str(saved), "--out", str(out), "--report", str(report)], capsys
    )
    if code == 2 and "matplotlib" in stderr:
        pytest.skip("the viz extra is not installed")
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --report"), stderr
    assert not out.exists()
    assert (tmp_path / "afile").read_text() == "keep"


def test_write_outputs_raises_a_user_error_for_a_foreign_file(saved, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "plan.json").write_text("{}")
    with pytest.raises(OutputConflict, match="plan.json, which autopar did not write"):
        write_outputs(type_of_plan(saved), out)
    assert (out / "plan.json").read_text() == "{}"
    assert sorted(p.name for p in out.iterdir()) == ["plan.json"]


def test_a_file_with_the_very_bytes_autopar_writes_is_replaceable(saved, tmp_path):
    """plan.save(dir) then plan.emit(dir): plan.json holds exactly what emit writes, so nothing
    is lost by replacing it; a plan.json with other bytes is still refused."""
    from autopar import Plan

    plan = Plan.load(saved)
    plan.save(tmp_path / "a")
    plan.emit(tmp_path / "a")
    assert (tmp_path / "a" / "train.py").is_file()
    other = tmp_path / "b"
    other.mkdir()
    (other / "plan.json").write_text(plan.to_json())  # no trailing newline: other bytes
    with pytest.raises(OutputConflict):
        write_outputs(plan, other)
