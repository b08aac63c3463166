"""``--report PATH.html``: one self-contained page with three inline SVG figures, rendered by a
real browser (headless Chromium) to a screenshot that is not blank.

Chromium is Debian's ``chromium``. Where it is absent the set-up installs it with apt-get when
running as root and AUTOPAR_INSTALL_CHROMIUM is not "0"; otherwise the rendering test skips and
says why.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from _plans import GPT

from autopar.api import plan_model_file
from autopar.cli import main
from autopar.model_file import load_model_file

pytest.importorskip("matplotlib", reason="the report needs the viz extra (matplotlib)")

ARGS = [GPT, "--cluster", "cpu:4", "--global-batch", "8", "--seq-len", "64"]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("report") / "plan.html"
    assert main([*ARGS, "--mesh", "pp=2", "--report", str(path), "--why-not", "dp=4", "-q"]) == 0
    return path


def test_report_is_one_self_contained_page_with_three_figures(report):
    text = report.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>")
    assert len(re.findall(r"<svg\b", text)) == 3
    for fig in ("timeline", "memory", "alternatives"):
        assert f'<figure id="{fig}">' in text
    # nothing to fetch: no scripts, stylesheets, images or links by URL
    assert "<script" not in text and "<link" not in text and "<img" not in text
    assert not re.search(r"""(src|href)\s*=\s*["'](https?:|//)""", text)
    assert "@import" not in text and not re.search(r"url\((?!#)", text)  # url(#id) is local
    # the plan in words, the explanation, the why-not diff
    for words in ("The plan in words", "why it lost", "why not dp=4?", "Approximate"):
        assert words in text


def test_report_from_the_api_and_a_one_rank_timeline(tmp_path):
    plan = plan_model_file(load_model_file(GPT), "cpu:2", global_batch=4, seq_len=16, mesh="dp=2")
    path = plan.report(tmp_path / "sub" / "r.html")
    text = path.read_text()
    assert len(re.findall(r"<svg\b", text)) == 3 and "One step" in text


def test_report_without_matplotlib_is_one_error_line(monkeypatch, capsys, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name)
    )
    assert main([*ARGS, "--report", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --report draws its figures with matplotlib")
    assert not (tmp_path / "r.html").exists()


def _chromium() -> str | None:
    found = shutil.which("chromium")
    if found:
        return found
    if os.environ.get("AUTOPAR_INSTALL_CHROMIUM", "1") == "0" or os.geteuid() != 0:
        return None
    if shutil.which("apt-get") is None:
        return None
    install = ["apt-get", "install", "-y", "-q", "chromium"]
    if subprocess.run(install, capture_output=True, timeout=600).returncode != 0:
        # a fresh machine has no package lists yet
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, timeout=600)
        subprocess.run(install, capture_output=True, timeout=600)
    return shutil.which("chromium")


def test_report_renders_in_headless_chromium(report, tmp_path):
    chromium = _chromium()
    if chromium is None:
        pytest.skip(
            "no `chromium` on PATH (Debian: apt-get install -y chromium; the test installs it "
            "itself when run as root unless AUTOPAR_INSTALL_CHROMIUM=0)"
        )
    shot = tmp_path / "shot.png"
    cmd = [
        chromium, "--headless", "--no-sandbox", "--disable-gpu",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}",
        "--window-size=1200,1600", report.as_uri(),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert shot.is_file(), proc.stderr[-3000:]
    from matplotlib.image import imread

    pixels = imread(str(shot))
    assert pixels.shape[0] == 1600 and pixels.shape[1] == 1200
    rgb = (pixels[..., :3] * 255).round().astype("uint8").reshape(-1, 3)
    colors = {tuple(c) for c in rgb[:: max(1, len(rgb) // 200_000)]}
    not_white = (rgb.min(axis=1) < 235).mean()
    # a blank page is one colour; text and the timeline's coloured blocks give hundreds
    assert len(colors) > 50, len(colors)
    assert not_white > 0.02, not_white
    # the timeline's forward blue (#4878d0) is on screen: the SVG figures were drawn
    blue = ((abs(rgb.astype(int) - (0x48, 0x78, 0xD0))).sum(axis=1) < 30).mean()
    assert blue > 0.001, blue
