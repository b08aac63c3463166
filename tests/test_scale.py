"""Tier 2: the planner at real scale on meta (no weights, no process group)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import pipeline_sweep  # noqa: E402


@pytest.fixture(scope="module")
def gpt3():
    return pipeline_sweep.setup()


def test_gpt3_175b_free_plan_uses_tp_fits_and_beats_forced_plans(gpt3):
    # With sequence parallelism and gradient reduction hidden only behind a pipeline's last
    # microbatch (both this session), dp2 x fsdp64 x tp8 with 3 accumulation steps (16.88 s)
    # edges out pp2 x dp2 x fsdp32 x tp8 (17.00 s): `python benchmarks/pipeline_sweep.py`.
    graph, cluster, training, model = gpt3
    assert 170e9 < graph.num_params < 180e9
    free, rows = pipeline_sweep.sweep(graph, cluster, training, model, [1, 2, 8], [1, 8])
    assert free.mesh.tp > 1, free.mesh
    assert free.predicted.peak_memory_bytes < 80e9
    assert free.predicted.peak_memory_bytes <= cluster.device.memory_bytes
    forced = [plan for _, _, plan, _ in rows if plan is not None]
    assert len(forced) >= 4
    for plan in forced:
        assert free.predicted.step_time_s <= plan.predicted.step_time_s * (1 + 1e-9), plan.mesh
    # the stages cover the 100 layers once, in order, and respect the schedule's rules
    assert [f for stage in free.stages for f in stage] == free.layers
    assert free.schedule.num_microbatches >= free.mesh.pp


@pytest.mark.parametrize(
    ("shape", "cluster", "expect"),
    [
        # 70B (80 layers, d 8192) on one 8-GPU node, 175B (96 layers, d 12288) on one GPU
        (("80", "8192", "64", "128256"), "8xA100-80GB", "16 x A100-80GB"),
        (("96", "12288", "96", "50257"), "A100-80GB", "x A100-80GB"),
    ],
)
def test_too_big_is_refused_with_what_would_fit(
    shape, cluster, expect, tmp_path, monkeypatch, capsys
):
    from autopar.cli import main

    for key, value in zip(("GPT_LAYERS", "GPT_DIM", "GPT_HEADS", "GPT_VOCAB"), shape):
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("GPT_MAX_SEQ", "2048")
    out = tmp_path / "out"
    gpt = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")
    code = main([gpt, "--cluster", cluster, "--global-batch", "64", "--seq-len", "2048",
                 "--dtype", "bf16", "--out", str(out)])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith("error: no plan fits"), err
    assert "too many" in err and expect in err and "Traceback" not in err
    assert not out.exists()


def test_cpu_offload_is_the_last_resort(monkeypatch, capsys):
    """A 40B GPT (56 layers, d 7680) on one 8 x A100-80GB node: its parameters, gradients and
    AdamW state (~80 GB per GPU sharded 8 ways) do not fit on the devices with any mesh, but fit
    in host memory: the plan offloads them (FSDP2), says so, and its device memory fits."""
    import json

    from autopar.cli import main

    for key, value in {"GPT_LAYERS": "56", "GPT_DIM": "7680", "GPT_HEADS": "48",
                       "GPT_VOCAB": "32000", "GPT_MAX_SEQ": "2048"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    gpt = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")
    code = main([gpt, "--cluster", "8xA100-80GB", "--global-batch", "8", "--seq-len", "2048",
                 "--dtype", "bf16", "--json"])  # fmt: skip
    assert code == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["offload"] is True and plan["mesh"]["fsdp"] > 1
    assert any("offloaded to host memory" in n for n in plan["notes"])
    mem = plan["predicted"]["memory_breakdown_bytes"]
    assert mem["params"] == mem["grads"] == mem["optimizer"] == 0
    assert plan["predicted"]["peak_memory_bytes"] <= 80e9
