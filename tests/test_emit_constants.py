"""The plan's constants: one list (the runtime's ``Constants``), the planner's answers in it.

``emit`` writes train.py's constants block from ``Constants``' fields (names, order, each group's
comment) with the plan's values, and the runtime executes those values (``DATA_PARALLEL``,
``SCHEDULE_CLASS``, ``RANK_STAGES``) without deciding them again from the mesh or the schedule's
name: the tests below give it answers that contradict the mesh and check that it follows them.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import sys
from pathlib import Path

import pytest
from _plans import GPT, forced_plan, gpt_layers, run_bounded, split_layers
from autopar.codegen.emit import constants, emit, runtime
from autopar.cost_model.precision import uses_fsdp2
from autopar.planner import schedules
from autopar.planner.request import enumerate_meshes
from autopar.planner.rules import data_parallel

emit_module = importlib.import_module("autopar.codegen.emit")  # the package exports emit()
rt = runtime()  # the emitted autopar_runtime package, imported as train.py imports it


def _pp_plan(schedule: str, microbatches: int, stages_per_rank: int, mesh: dict | None = None):
    mesh = mesh or {"pp": 2}
    world = 1
    for degree in mesh.values():
        world *= degree
    return forced_plan(
        GPT,
        world,
        mesh,
        {},
        layers=gpt_layers(),
        stages=split_layers(gpt_layers(), mesh["pp"] * stages_per_rank),
        schedule={
            "name": schedule,
            "num_microbatches": microbatches,
            "stages_per_rank": stages_per_rank,
        },
    )


def _stated(script: str) -> list[str]:
    """The module-level names train.py assigns before ``PLAN``, in order."""
    names = []
    for node in ast.parse(script).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id == "PLAN":
                break
            names.append(node.targets[0].id)
    return names


def _namespace(script: str) -> dict:
    """train.py's constants block, run (it is literals only)."""
    block = script[: script.index("PLAN = rt.Constants")]
    tree = ast.parse(block)
    tree.body = [n for n in tree.body if isinstance(n, ast.Assign)]
    namespace: dict = {}
    exec(compile(tree, "train.py", "exec"), namespace)
    return namespace


PLANS = {
    "ddp": lambda: forced_plan(GPT, 2, {"dp": 2}, {}, layers=gpt_layers()),
    "fsdp-ckpt": lambda: forced_plan(
        GPT, 2, {"fsdp": 2}, {}, layers=gpt_layers(), checkpointing={"blocks.1": "full"}
    ),
    "pp-zbv": lambda: _pp_plan("zbv", 4, 2),
    "pp-interleaved-dp": lambda: _pp_plan("interleaved-1f1b", 4, 2, {"pp": 2, "dp": 2}),
}


@pytest.mark.parametrize("name", PLANS)
def test_the_constants_block_is_constants_fields_in_order(name: str) -> None:
    """train.py states exactly ``emit.constants`` (Constants' fields, in their order), each
    group under its field's comment, and reads back to the same Constants."""
    plan = PLANS[name]()
    values = constants(plan)
    fields = [f.name for f in dataclasses.fields(rt.Constants)]
    assert list(values) == [f for f in fields if f in values]
    script = emit(plan)["train.py"]
    assert _stated(script) == list(values)
    assert rt.Constants.from_namespace(_namespace(script)) == rt.Constants(**values)
    for field in dataclasses.fields(rt.Constants):
        if field.name in values and field.metadata["doc"]:
            first_words = " ".join(field.metadata["doc"].split()[:4])
            assert f"# {first_words}" in script, field.name


def test_a_new_constants_field_reaches_train_py_with_its_comment(monkeypatch) -> None:
    """Adding a constant is one field of Constants plus its value in emit: the block, its
    order and its comment follow; a field without a value is caught."""

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Extended(rt.Constants):
        NEW_ANSWER: int = dataclasses.field(
            default=0, metadata={"doc": "An answer the planner gives from now on."}
        )

    plan = PLANS["ddp"]()
    values = emit_module._values

    monkeypatch.setattr(rt, "Constants", Extended)
    monkeypatch.setattr(emit_module, "_values", lambda p: {**values(p), "NEW_ANSWER": 7})
    script = emit(plan)["train.py"]
    assert _stated(script)[-1] == "NEW_ANSWER"
    assert "# An answer the planner gives from now on.\nNEW_ANSWER = 7\n" in script
    assert Extended.from_namespace(_namespace(script)).NEW_ANSWER == 7

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Required(rt.Constants):
        NEEDED: int = dataclasses.field(metadata={"doc": "A constant every plan states."})

    monkeypatch.setattr(rt, "Constants", Required)
    monkeypatch.setattr(emit_module, "_values", values)
    with pytest.raises(AssertionError, match="NEEDED"):
        emit(plan)


def test_emit_states_the_planners_answers() -> None:
    """DATA_PARALLEL is planner.rules.data_parallel's; SCHEDULE_CLASS and RANK_STAGES are the
    schedule table's, every stage on the rank the table places it."""
    for world in range(1, 9):
        for mesh in enumerate_meshes(world, world, {}):
            kind = data_parallel(mesh)
            assert (kind == "fsdp2") == uses_fsdp2(mesh), mesh
            assert kind != "ddp" or mesh.dp > 1, mesh
    assert constants(PLANS["ddp"]())["DATA_PARALLEL"] == "ddp"
    assert constants(PLANS["fsdp-ckpt"]())["DATA_PARALLEL"] == "fsdp2"
    # pipeline replicas: FSDP2 (DDP inside a stage breaks)
    assert constants(PLANS["pp-interleaved-dp"]())["DATA_PARALLEL"] == "fsdp2"
    for name, v, m in [("gpipe", 1, 2), ("1f1b", 1, 2), ("interleaved-1f1b", 2, 4), ("zbv", 2, 4),
                       ("dualpipev", 2, 4)]:  # fmt: skip
        values = constants(_pp_plan(name, m, v))
        assert values["SCHEDULE_CLASS"] == schedules.RULES[name].torch_class
        ranks = values["RANK_STAGES"]
        assert sorted(j for held in ranks for j in held) == list(range(2 * v)), name
        assert all(
            schedules.stage_rank(name, 2, j) == r for r, held in enumerate(ranks) for j in held
        )
    assert constants(_pp_plan("zbv", 4, 2))["RANK_STAGES"] == [[0, 3], [1, 2]]
    assert constants(_pp_plan("interleaved-1f1b", 4, 2))["RANK_STAGES"] == [[0, 2], [1, 3]]


def _c(**update) -> object:
    base = {"MODEL_FILE": GPT, "FACTORY": "build_model", "WORLD_SIZE": 4, "CLUSTER": "cpu:4",
            "RANKS_PER_NODE": 4, "BACKEND": "gloo", "GLOBAL_BATCH": 8, "SEQ_LEN": 16,
            "DTYPE": "bf16", "OPTIMIZER": "adamw", "LR": 1e-3, "LAYERS": gpt_layers()}  # fmt: skip
    return rt.Constants(**(base | update))


def test_the_runtimes_precision_follows_data_parallel_not_the_mesh() -> None:
    """FSDP2's MixedPrecisionPolicy or autocast: DATA_PARALLEL decides, whatever the mesh."""
    for world in (1, 2, 4, 8):
        for mesh in enumerate_meshes(world, world, {}):
            for kind in ("fsdp2", "ddp", "none"):
                c = _c(MESH=emit_module._mesh(mesh), DATA_PARALLEL=kind)
                assert rt.uses_fsdp(c) == rt.mixed_precision_policy(c) == (kind == "fsdp2")
                assert rt.autocast(c, "cpu")._enabled == (kind != "fsdp2"), (mesh, kind)


# On a fake 4-rank process group (no peers), in its own process: what apply_data_parallel +
# apply_ddp make of DATA_PARALLEL on meshes that say otherwise, and the schedule build_schedule
# makes of SCHEDULE_CLASS and RANK_STAGES where SCHEDULE names another.
FAKE_GROUP = """
import json, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel
from torch.testing._internal.distributed.fake_pg import FakeStore
from autopar.codegen.emit import runtime

rt = runtime()
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
cases = json.loads(sys.argv[1])
out = {}
for name, (mesh, update) in cases.items():
    c = rt.Constants(**update, MESH=mesh, MODEL_FILE="m.py", FACTORY="f", WORLD_SIZE=4,
                     CLUSTER="cpu:4", RANKS_PER_NODE=4, BACKEND="gloo", GLOBAL_BATCH=8,
                     SEQ_LEN=None, DTYPE="fp32", OPTIMIZER="sgd", LR=0.1, LAYERS=["0", "1"])
    device_mesh = init_device_mesh("cpu", tuple(mesh.values()), mesh_dim_names=tuple(mesh))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    if c.STAGES:
        local = {j: torch.nn.Linear(4, 4) for j in rt.stage_ids_of(c, 1)}
        schedule = rt.build_schedule(c, local, device_mesh, torch.device("cpu"), lambda o, t: o.sum())
        out[name] = [type(schedule).__name__, rt.stage_ids_of(c, 1)]
        continue
    model = rt.apply_ddp(c, rt.apply_data_parallel(c, model, device_mesh), device_mesh)
    out[name] = (
        "fsdp2" if isinstance(model, FSDPModule) else
        "ddp" if isinstance(model, DistributedDataParallel) else "none"
    )
print("OUT " + json.dumps(out), flush=True)
dist.destroy_process_group()
"""


def test_the_runtime_executes_the_answers_it_is_given(tmp_path: Path) -> None:
    """apply_data_parallel/apply_ddp wrap as DATA_PARALLEL says, and build_schedule builds
    SCHEDULE_CLASS over RANK_STAGES, on meshes and schedule names that would say otherwise: a
    decision re-derived from MESH or SCHEDULE in the runtime fails here."""
    dp = {"pp": 1, "dp": 4, "fsdp": 1, "tp": 1}
    fsdp = {"pp": 1, "dp": 1, "fsdp": 4, "tp": 1}
    pp_dp = {"pp": 2, "dp": 2, "fsdp": 1, "tp": 1}
    stages = [["a"], ["b"], ["c"], ["d"]]
    cases = {
        "dp-as-fsdp2": (dp, {"DATA_PARALLEL": "fsdp2"}),
        "dp-as-none": (dp, {"DATA_PARALLEL": "none"}),
        "fsdp-as-ddp": (fsdp, {"DATA_PARALLEL": "ddp"}),
        "fsdp-as-none": (fsdp, {"DATA_PARALLEL": "none"}),
        "pp-dp-as-ddp": (pp_dp, {"DATA_PARALLEL": "ddp"}),
        "pp-dp-as-fsdp2": (pp_dp, {"DATA_PARALLEL": "fsdp2"}),
        "zbv-named-runs-interleaved": (
            pp_dp,
            {
                "STAGES": stages,
                "SCHEDULE": "zbv",
                "SCHEDULE_CLASS": "ScheduleInterleaved1F1B",
                "MICROBATCHES": 4,
                "STAGES_PER_RANK": 2,
                "RANK_STAGES": [[0, 2], [1, 3]],
            },
        ),  # fmt: skip
        "1f1b-named-runs-gpipe": (
            pp_dp,
            {
                "STAGES": stages[:2],
                "SCHEDULE": "1f1b",
                "SCHEDULE_CLASS": "ScheduleGPipe",
                "MICROBATCHES": 2,
                "RANK_STAGES": [[0], [1]],
            },
        ),  # fmt: skip
    }
    script = tmp_path / "fake_group.py"
    script.write_text(FAKE_GROUP)
    rc, text = run_bounded([sys.executable, str(script), json.dumps(cases)], tmp_path, 180)
    assert rc == 0, text[-4000:]
    out = json.loads(next(x for x in text.splitlines() if x.startswith("OUT "))[4:])
    assert out == {
        "dp-as-fsdp2": "fsdp2",
        "dp-as-none": "none",
        "fsdp-as-ddp": "ddp",
        "fsdp-as-none": "none",
        "pp-dp-as-ddp": "ddp",
        "pp-dp-as-fsdp2": "fsdp2",
        "zbv-named-runs-interleaved": ["ScheduleInterleaved1F1B", [1, 3]],
        "1f1b-named-runs-gpipe": ["ScheduleGPipe", [1]],
    }


SHARED_INPUT = """
import sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore
from autopar.codegen.emit import runtime

tp = runtime().tensor_parallel
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
mesh = init_device_mesh("cpu", (2,))
x = torch.randn(2, 4, 8, requires_grad=True) * 1.0  # an activation: not a leaf
args = ((Shard(1),), (Replicate(),), torch.nn.Linear(8, 8), (x,), mesh)
other = tp.shared_input((Replicate(),), (Replicate(),), *args[2:])
q, k = tp.shared_input(*args), tp.shared_input(*args)
with torch.no_grad():
    x.mul_(2.0)  # the held DTensor is an all-gather of the old values
v = tp.shared_input(*args)
print("OUT", q is k, other is not q, v is not q, flush=True)
dist.destroy_process_group()
"""


def test_siblings_share_one_prepared_input_until_it_changes_in_place(tmp_path: Path) -> None:
    """``tensor_parallel.shared_input`` (what Colwise hands each column-parallel call): the
    calls reading one tensor with one layout get one DTensor (one collective for all); another
    layout gets its own; after the tensor changes in place the next call prepares it anew,
    never the stale copy."""
    script = tmp_path / "shared_input.py"
    script.write_text(SHARED_INPUT)
    rc, text = run_bounded([sys.executable, str(script)], tmp_path, 120)
    assert rc == 0, text[-4000:]
    assert next(x for x in text.splitlines() if x.startswith("OUT ")) == "OUT True True True"
