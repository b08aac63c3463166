"""The datasheet cost model against published large-scale runs (benchmarks/published_runs.py):
Megatron-LM's GPT-3 175B on 1024 A100s (140 TFLOP/s per GPU) and its 1T GPT on 3072 A100s (163),
planned with the published mesh pinned. The Llama 3 405B runs are printed by the benchmark; the
model predicts them ~45-50% slow (README: known gaps), so they are not asserted here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import published_runs  # noqa: E402


@pytest.mark.parametrize("name", ["megatron-175b", "megatron-1t"])
def test_megatron_runs_within_25_percent(name, monkeypatch):
    for var in ("GPT_LAYERS", "GPT_DIM", "GPT_HEADS", "GPT_VOCAB", "GPT_MAX_SEQ"):
        monkeypatch.setenv(var, "0")  # plan_run sets them: monkeypatch restores them after
    row = published_runs.evaluate(name)
    run = published_runs.RUNS[name]
    assert row["mesh"] == ",".join(f"{k}={v}" for k, v in sorted(
        run.mesh.items(), key=lambda kv: ["pp", "dp", "fsdp", "tp"].index(kv[0])))  # fmt: skip
    assert row["published_tflops"] == run.published_tflops
    # the step time implied by the published figure, and ours, within 25%
    assert abs(row["error"]) < 0.25, row
    assert row["predicted_step_s"] == pytest.approx(
        row["published_step_s"] * run.published_tflops / row["predicted_tflops"], rel=1e-9
    )


def test_megatron_flop_formula():
    """Narayanan et al. eq. 3 for GPT-3 175B at batch 1536: 96 B s l h^2 (1 + s/6h + V/16lh)."""
    run = published_runs.RUNS["megatron-175b"]
    f = published_runs.step_flops(run, 0)
    assert f == pytest.approx(
        96 * 1536 * 2048 * 96 * 12288**2 * (1 + 2048 / 73728 + 51200 / 18874368)
    )
    assert 4.5e18 < f < 5.0e18
