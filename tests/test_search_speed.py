"""The search's pruning is exact: branch and bound (meshes scored likeliest first, each pruned once
its lower bound loses; schedule x microbatch candidates skipped once their floor exceeds the best
step found) chooses the plan that scoring every mesh in full chooses."""

from __future__ import annotations

import pytest
from _plans import GPT, tiered
from autopar.cost_model import parse_cluster
from autopar.planner.plan import Training
from autopar.planner.search import search

from autopar.model_file import load_model_file
from autopar.session import PlanningSession, saved_for_of

# (name, model spec, env of the GPT example, cluster, global batch, seq len, dtype)
CASES = {
    "gpt-8x8xH100": (GPT, dict(GPT_LAYERS=12, GPT_DIM=2048, GPT_HEADS=16), "8x8xH100", 64, 2048,
                     "bf16"),
    "gpt1b-4xA100-40": (GPT, dict(GPT_LAYERS=24, GPT_DIM=2048, GPT_HEADS=16), "4xA100-40GB", 32,
                        2048, "fp32"),
    "gpt-cpu4": (GPT, {}, "cpu:4", 8, 64, "fp32"),
    "tiny-llama-2x8xH100": ("hf:tiny-llama", {}, "2x8xH100", 64, 256, "bf16"),
    "gpt-32x8xH100": (GPT, dict(GPT_LAYERS=32, GPT_DIM=4096, GPT_HEADS=32), "32x8xH100", 512,
                      4096, "bf16"),
}  # fmt: skip


def _both(monkeypatch, name: str):
    spec, env, cluster_spec, batch, seq, dtype = CASES[name]
    for key, value in {"GPT_VOCAB": "50257", "GPT_MAX_SEQ": str(seq), **env}.items():
        monkeypatch.setenv(key, str(value))
    cluster = parse_cluster(cluster_spec)
    front = PlanningSession().front(load_model_file(spec), seq, dtype, saved_for_of(cluster))
    training = Training(global_batch=batch, seq_len=seq, dtype=dtype)
    stats: dict[str, int] = {}
    plans = [
        search(
            front.graph,
            cluster,
            training,
            model=front.ref,
            cuts=front.cuts,
            prune=prune,
            stats=stats if prune else None,
        )  # fmt: skip
        for prune in (True, False)
    ]
    return plans, stats


@pytest.mark.parametrize(
    "name", tiered(CASES, {"gpt-8x8xH100", "tiny-llama-2x8xH100", "gpt-32x8xH100"})
)
def test_pruned_search_chooses_the_plan_of_the_full_search(monkeypatch, name):
    (pruned, full), stats = _both(monkeypatch, name)
    for field in ("mesh", "stages", "schedule", "tensor_parallel", "checkpointing", "offload"):
        assert getattr(pruned, field) == getattr(full, field), field
    assert pruned.predicted == full.predicted
    assert stats["meshes"] > 1  # a search, not a pinned mesh
    if name != "gpt-cpu4":
        assert stats["pruned"] > 0  # the bound did prune: the comparison means something


def test_one_rank_of_tp_needs_no_ilp_solve(monkeypatch):
    """At tp=1 every module is whole whatever its style, so the ILP offers replicate alone and
    no CP-SAT solve runs (it once offered colwise_gather and the like, and solved to tell
    choices apart that shard nothing)."""
    for key, value in {"GPT_VOCAB": "50257", "GPT_MAX_SEQ": "1024"}.items():
        monkeypatch.setenv(key, value)
    cluster = parse_cluster("8xH100")
    front = PlanningSession().front(load_model_file(GPT), 1024, "bf16", saved_for_of(cluster))
    stats: dict[str, int] = {}
    plan = search(
        front.graph, cluster, Training(global_batch=64, seq_len=1024, dtype="bf16"),
        model=front.ref, cuts=front.cuts, pins={"tp": 1}, stats=stats,
    )  # fmt: skip
    assert plan.mesh.tp == 1 and not plan.tensor_parallel
    assert stats["ilp_solves"] == 0
