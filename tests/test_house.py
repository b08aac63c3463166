"""Tier 1 (pure): the house rules of the code base (issue 26).

- no library file exceeds 800 lines (split by job when one grows past it);
- each rule has one home, so the API and the CLI refuse the same bad input in the same words:
  the training arguments (``planner.request.check_training``), the mesh rules
  (``planner.rules.mesh_rule``: pins, ``--plan`` loading and ``emit``), and the schedule facts
  (``planner.schedules``: the CLI's choices, the plan's schedule names, emit's refusals).
"""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
from autopar.codegen import emit
from autopar.planner import schedules
from autopar.planner.plan import Mesh, Plan, Schedule
from autopar.planner.rules import MeshFacts, mesh_rule

from autopar.api import plan_model_file
from autopar.cli import main
from autopar.errors import UserError
from autopar.model_file import load_model_file

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples" / "gpt.py")
LIBRARY = ("ir", "cost_model", "planner", "codegen", "autopar")
MAX_LINES = 800


def test_no_library_file_exceeds_800_lines() -> None:
    long = {}
    for package in LIBRARY:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel.parts[:2] == ("codegen", "runtime"):  # the emitted runtime: its own limits
                continue
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > MAX_LINES:
                long[str(rel)] = lines
    assert not long, (
        f"library files over {MAX_LINES} lines: {long}; split each by job (one module per "
        "concern), re-exporting names other packages import"
    )


def _cli_error(argv: list[str], capsys) -> str:
    """The one ``error:`` line of a CLI run that must fail with exit 2."""
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _api_error(**kw) -> str:
    with pytest.raises(UserError) as info:
        plan_model_file(load_model_file(GPT), kw.pop("cluster", "cpu:4"), **kw)
    return f"error: {info.value}"


TRAINING_CASES = [
    ({"global_batch": 0}, ["--global-batch", "0"]),
    ({"global_batch": -8}, ["--global-batch", "-8"]),
    ({"global_batch": 2**21}, ["--global-batch", str(2**21)]),
    ({"seq_len": 0}, ["--seq-len", "0"]),
    ({"dtype": "fp8"}, ["--dtype", "fp8"]),
]


@pytest.mark.parametrize("api, cli", TRAINING_CASES, ids=lambda x: str(x))
def test_training_arguments_are_refused_alike_by_api_and_cli(api, cli, capsys) -> None:
    """``check_training`` is the one check: the same line, before the model is traced."""
    kw = {"global_batch": 8, "seq_len": 16, **api}
    argv = [GPT, "--cluster", "cpu:4", "--global-batch", "8", "--seq-len", "16", *cli]
    line = _cli_error(argv, capsys)
    assert line == _api_error(**kw)
    assert cli[0] in line and cli[1] in line, line


MESH_CASES = [
    ("tp=3", "cpu:4", 8, ["tp=3", "does not divide the world size 4", "product divides 4"]),
    ("dp=4", "cpu:4", 6, ["dp=4", "global batch 6", "data-parallel size 4", "--global-batch 8"]),
    ("pp=1,dp=1,fsdp=1,cp=1,tp=2", "cpu:4", 8, ["multiplies to 2", "cpu:4 has 4 devices"]),
]


@pytest.mark.parametrize("mesh, cluster, batch, words", MESH_CASES)
def test_pinned_mesh_rules_are_refused_alike_by_api_and_cli(
    mesh, cluster, batch, words, capsys
) -> None:
    """``mesh_rule`` on the pins: the CLI before tracing, the API's search, the same line."""
    argv = [GPT, "--cluster", cluster, "--global-batch", str(batch), "--seq-len", "16"]
    line = _cli_error([*argv, "--mesh", mesh], capsys)
    assert line == _api_error(cluster=cluster, global_batch=batch, seq_len=16, mesh=mesh)
    assert line.startswith("error: --mesh ") and all(w in line for w in words), line


def _plan(mesh: dict[str, int], **update) -> Plan:
    from _plans import forced_plan, gpt_layers

    world = Mesh(**mesh).world_size
    plan = forced_plan(GPT, world, mesh, {}, layers=gpt_layers())
    return plan.model_copy(update=update)


def test_a_hand_edited_plan_is_refused_alike_by_plan_loading_and_emit(tmp_path, capsys) -> None:
    """``--plan`` and ``emit`` read the plan's mesh rules from one place (Plan.mesh_refusal)."""
    training = _plan({"dp": 2}).training.model_copy(update={"global_batch": 7})
    plan = _plan({"dp": 2}, training=training)
    with pytest.raises(ValueError) as info:
        emit(plan)
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    line = _cli_error([GPT, "--plan", str(path), "--out", str(tmp_path / "out")], capsys)
    assert line == f"error: --plan {str(path)!r}: {info.value}"
    assert "global batch 7 is not divisible by the data-parallel size 2" in line, line
    assert not (tmp_path / "out").exists()


def test_the_schedule_table_is_the_one_source_of_schedule_names_and_rules() -> None:
    from autopar.cli import build_parser

    action = next(a for a in build_parser()._actions if a.dest == "schedule")
    assert tuple(action.choices) == schedules.SCHEDULES
    names = typing.get_args(Schedule.model_fields["name"].annotation)
    assert names == ("none", *schedules.SCHEDULES)
    # emit refuses a V-shaped schedule with data parallelism in the table's words
    for name, rule in schedules.RULES.items():
        mesh = {"pp": 2, "dp": 1, "fsdp": 2, "cp": 1, "ep": 1, "tp": 1}
        refusal = mesh_rule(mesh, MeshFacts(schedule=name))
        why = schedules.data_parallel_rule(name, 2)
        assert (refusal is None) == rule.data_parallel == (why is None), name
        assert refusal is None or refusal.why == why


def test_enumeration_and_validation_read_the_same_rule() -> None:
    """A mesh the enumeration drops is one ``mesh_rule`` refuses by structure; one it lists as
    ruled out is one it refuses by the training setup, with the words the search shows."""
    from autopar.planner.request import candidate_meshes

    facts = MeshFacts(
        world_size=8,
        devices_per_node=4,
        global_batch=6,
        num_layers=2,
        heads=(6,),
        cp_model_why="the model has no F.scaled_dot_product_attention call",
        expert_counts=(),
    )
    listed = candidate_meshes(facts, {})
    for mesh in listed:
        refusal = mesh_rule(mesh, facts)
        assert refusal is None or refusal.listed, (mesh, refusal)
    assert all(m.tp <= 4 and m.pp <= 2 and m.cp == 1 and m.ep == 1 for m in listed)
    ruled = {m.short(): str(mesh_rule(m, facts).why) for m in listed if mesh_rule(m, facts)}
    assert ruled["dp=4,tp=2"] == "global batch 6 is not divisible by the data-parallel size 4"
    assert ruled["dp=2,tp=4"] == "tp=4 does not divide the 6 attention heads"
    assert mesh_rule({"tp": 8}, facts).line() == (
        "tp=8 spans nodes (4 devices per node): tensor parallelism stays within a node; lower tp"
    )
