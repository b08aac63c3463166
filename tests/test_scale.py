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


def test_gpt3_175b_free_plan_uses_pp_and_tp_fits_and_beats_forced_plans(gpt3):
    graph, cluster, training, model = gpt3
    assert 170e9 < graph.num_params < 180e9
    free, rows = pipeline_sweep.sweep(graph, cluster, training, model, [1, 2, 8], [1, 8])
    assert free.mesh.pp > 1 and free.mesh.tp > 1, free.mesh
    assert free.predicted.peak_memory_bytes < 80e9
    assert free.predicted.peak_memory_bytes <= cluster.device.memory_bytes
    forced = [plan for _, _, plan, _ in rows if plan is not None]
    assert len(forced) >= 4
    for plan in forced:
        assert free.predicted.step_time_s <= plan.predicted.step_time_s * (1 + 1e-9), plan.mesh
    # the stages cover the 100 layers once, in order, and respect the schedule's rules
    assert [f for stage in free.stages for f in stage] == free.layers
    assert free.schedule.num_microbatches >= free.mesh.pp
