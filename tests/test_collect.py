"""Planning defers CPython's full collections (autopar.collect): the planning entry points run
without them and give the caller's thresholds back, also when planning fails."""

from __future__ import annotations

import gc

import pytest
from _plans import MLP

from autopar import collect
from autopar.api import plan_model_file
from autopar.cli import main
from autopar.session import PlanningSession


def test_a_plan_runs_without_full_collections_and_restores_the_thresholds() -> None:
    before = gc.get_threshold()
    seen = []
    plan_model_file(MLP, "cpu:2", global_batch=8, session=PlanningSession(),
                    progress=lambda line: seen.append(gc.get_threshold()))  # fmt: skip
    assert seen, "planning reports its progress"
    assert all(t[:2] == before[:2] and t[2] == collect._DEFERRED for t in seen), seen
    assert gc.get_threshold() == before


def test_the_plan_command_defers_them_and_a_failure_restores_them(tmp_path, monkeypatch):
    before = gc.get_threshold()
    seen = []
    import autopar.api

    def failing(*args, **kwargs):
        seen.append(gc.get_threshold())
        raise RuntimeError("a bug while planning")

    monkeypatch.setattr(autopar.api, "plan_model_file", failing)
    code = main([MLP, "--cluster", "cpu:2", "--global-batch", "8", "--out", str(tmp_path / "o")])
    assert code == 1 and seen and seen[0][2] == collect._DEFERRED
    assert gc.get_threshold() == before


def test_deferrals_nest() -> None:
    before = gc.get_threshold()
    with collect.full_collections_deferred():
        with pytest.raises(ValueError), collect.full_collections_deferred():
            raise ValueError
        assert gc.get_threshold()[2] == collect._DEFERRED
    assert gc.get_threshold() == before
