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
    # the step time implied by the published figure, and ours, within 25%
    assert abs(row["error"]) < 0.25, row


def test_megatron_flop_formula():
    """Narayanan et al. eq. 3 for GPT-3 175B at batch 1536, checked against the paper's own
    estimate (Sec. 5.1): 300B tokens on 1024 A100s at 140 TFLOP/s per GPU take 34 days."""
    run = published_runs.RUNS["megatron-175b"]
    step_s = published_runs.step_flops(run) / (1024 * run.published_tflops * 1e12)
    steps = 300e9 / (run.global_batch * run.seq_len)
    assert steps * step_s / 86400 == pytest.approx(34, rel=0.05)
