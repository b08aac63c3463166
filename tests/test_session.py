"""The planning session (issue 26, item 4): one object owns the front end and holds the traced
graph; plans from it, and why-not and report on them, never trace again. One Plan type: what
``from autopar import Plan`` names is the planner's data class, with the actions attached."""

from __future__ import annotations

import pytest
from _plans import MLP
from autopar.planner import plan as planner_plan

import autopar
from autopar.api import plan_model_file, why_not
from autopar.session import PlanningSession


def test_one_session_traces_once_for_plans_and_why_not() -> None:
    session = PlanningSession()
    plan = plan_model_file(MLP, "cpu:2", global_batch=8, session=session)
    bigger = plan_model_file(MLP, "cpu:4", global_batch=16, mesh="dp=2", session=session)
    assert session.traces == 1 and bigger.mesh.dp == 2
    loaded = autopar.Plan.from_json(plan.to_json())  # a plan from JSON: the same model
    answers = [why_not(plan, "fsdp=2", session=session), loaded.why_not("fsdp=2", session=session)]
    assert answers[0].text == answers[1].text and answers[0].forced.mesh.fsdp == 2
    assert session.traces == 1
    without = PlanningSession()
    why_not(loaded, "fsdp=2", session=without)  # a session that never saw it traces
    assert without.traces == 1


@pytest.mark.slow
def test_a_report_with_why_not_reuses_the_sessions_graph(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    session = PlanningSession()
    plan = plan_model_file(MLP, "cpu:2", global_batch=8, session=session)
    report = session.report(plan, tmp_path / "report.html", why_not="fsdp=2")
    assert "Why not fsdp=2?" in report.read_text()
    assert session.traces == 1


def test_there_is_one_plan_type_and_loaded_plans_act_alike(tmp_path) -> None:
    assert autopar.Plan is planner_plan.Plan
    plan = plan_model_file(MLP, "cpu:2", global_batch=8)
    loaded = planner_plan.Plan.load(plan.save(tmp_path))
    assert type(plan) is type(loaded) is planner_plan.Plan and loaded == plan
    for action in ("explain", "why_not", "report", "apply", "local_batch", "emit", "save"):
        assert callable(getattr(loaded, action)), action
    assert loaded.emit(tmp_path / "out").joinpath("train.py").is_file()
    assert loaded.explain() == plan.explain()
