"""Fuzzing with hypothesis (bounded: a few dozen examples each, no deadline, well under 90 s).

Random GPT and MLP shapes built on meta, random clusters, batches, dtypes and mesh pins go through
the real search (``auto_parallelize``). The planner either returns a plan that is valid in every
way a plan can be checked without running it, or refuses with a one-line ``PlanningError``;
anything else is a bug. The parsers of what users type (cluster specs, ``--mesh``, plan JSON) raise
only their one-line user error on arbitrary text.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from autopar.cost_model import ClusterSpecError, parse_cluster
from autopar.planner.plan import PlanError
from autopar.planner.search import PlanningError, parse_mesh
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from autopar import Plan
from autopar.api import auto_parallelize

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from gpt import GPT  # noqa: E402
from mlp import ResidualMLP  # noqa: E402

# AUTOPAR_FUZZ_EXAMPLES=500 hunts deeper, with fresh random examples each run; by default the
# same few dozen run every time, so CI stays deterministic and fast.
_DEEP = int(os.environ.get("AUTOPAR_FUZZ_EXAMPLES", "0"))

SEARCH = settings(
    max_examples=_DEEP or 30,
    deadline=None,
    derandomize=not _DEEP,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@st.composite
def clusters(draw) -> str:
    kind = draw(st.sampled_from(["cpu", "gpus", "nodes"]))
    if kind == "cpu":
        return f"cpu:{draw(st.integers(1, 8))}"
    device = draw(st.sampled_from(["H100", "H200", "A100-80GB", "A100-40GB"]))
    if kind == "gpus":
        return f"{draw(st.integers(1, 8))}x{device}"
    return f"{draw(st.integers(1, 4))}x{draw(st.sampled_from([1, 2, 4, 8]))}x{device}"


@st.composite
def gpt_shapes(draw) -> dict:
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]))
    head_dim = draw(st.sampled_from([8, 16, 32, 64, 128]))
    seq = draw(st.integers(1, 512))
    return dict(
        vocab=draw(st.integers(2, 60000)),
        dim=heads * head_dim,
        n_head=heads,
        n_layer=draw(st.integers(1, 4)),
        max_seq=seq + draw(st.integers(0, 64)),
        seq_len=seq,
    )


@st.composite
def mlp_shapes(draw) -> dict:
    return dict(
        in_features=draw(st.integers(1, 256)),
        width=draw(st.integers(1, 1024)),
        num_blocks=draw(st.integers(1, 4)),
        classes=draw(st.integers(2, 1000)),
    )


def _world(spec: str) -> int:
    return parse_cluster(spec).world_size


@st.composite
def setups(draw, shapes) -> dict:
    shape = draw(shapes)
    cluster = draw(clusters())
    world = _world(cluster)
    batch = draw(st.one_of(st.integers(1, 64), st.integers(1, 16).map(lambda k, w=world: k * w)))
    pins = {}
    if draw(st.booleans()):
        axis = draw(st.sampled_from(["pp", "dp", "fsdp", "tp"]))
        pins[axis] = draw(st.sampled_from([d for d in range(1, world + 1) if world % d == 0]))
    return dict(
        shape=shape,
        cluster=cluster,
        global_batch=batch,
        dtype=draw(st.sampled_from(["fp32", "bf16"])),
        optimizer=draw(st.sampled_from(["adamw", "sgd"])),
        mesh=pins,
    )


def _plan_or_refusal(model, setup: dict, **kwargs) -> Plan | None:
    try:
        return auto_parallelize(
            model,
            setup["cluster"],
            global_batch=setup["global_batch"],
            dtype=setup["dtype"],
            optimizer=setup["optimizer"],
            mesh=setup["mesh"],
            **kwargs,
        )
    except PlanningError as e:  # a user error: one line, saying what to change
        text = str(e)
        assert text and "\n" not in text and ":" in text, text
        event(f"refused: {text.split(':')[0]}")
        return None


def check_plan(plan: Plan, model: torch.nn.Module, setup: dict) -> None:
    """Everything a valid plan promises (ARCHITECTURE.md: plan JSON, the search)."""
    event(f"planned pp={plan.mesh.pp} tp={plan.mesh.tp} dp*fsdp={plan.mesh.data_parallel > 1}")
    cluster = parse_cluster(setup["cluster"])
    mesh, training, pred = plan.mesh, plan.training, plan.predicted
    # degrees
    world = mesh.pp * mesh.dp * mesh.fsdp * mesh.cp * mesh.tp  # ep is carved out of dp x fsdp
    assert world == cluster.world_size == plan.world_size
    assert mesh.data_parallel % mesh.ep == 0, mesh
    for axis, value in setup["mesh"].items():
        assert getattr(mesh, axis) == value, (axis, mesh)
    assert mesh.tp <= cluster.devices_per_node, "TP stays within a node"
    heads = {m.n_head for m in model.modules() if hasattr(m, "n_head")}
    assert all(h % mesh.tp == 0 for h in heads), (heads, mesh.tp)
    assert training.global_batch == setup["global_batch"]
    assert training.global_batch % (mesh.dp * mesh.fsdp) == 0
    # memory
    assert pred.peak_memory_bytes <= cluster.device.memory_bytes
    assert pred.memory_breakdown_bytes.total == pred.peak_memory_bytes
    # time
    t = pred.time_breakdown_s
    parts = t.compute + t.exposed_comm + t.bubble + t.optimizer + t.grad_norm
    assert math.isclose(parts, pred.step_time_s, rel_tol=1e-9, abs_tol=1e-15), (parts, pred)
    assert pred.step_time_s > 0 and math.isfinite(pred.step_time_s)
    assert 0 <= pred.mfu <= 1.0, pred.mfu
    # layers and stages: every layer once, in order, in pp * stages_per_rank stages
    names = dict(model.named_modules())
    assert len(set(plan.layers)) == len(plan.layers)
    assert all(fqn in names for fqn in plan.layers)
    assert [fqn for stage in plan.stages for fqn in stage] == plan.layers
    assert all(plan.stages), "no empty stage"
    assert len(plan.stages) == mesh.pp * plan.schedule.stages_per_rank
    if mesh.pp == 1:
        assert plan.schedule.name == "none" and len(plan.stages) == 1
    else:
        assert plan.schedule.name != "none"
        local = training.global_batch // (mesh.dp * mesh.fsdp)
        assert local % plan.schedule.num_microbatches == 0, (local, plan.schedule)
        if plan.schedule.name in ("1f1b", "dualpipev", "zbv", "interleaved-1f1b"):
            assert plan.schedule.num_microbatches >= mesh.pp, plan.schedule
    # module names
    assert all(fqn in names for fqn in plan.tensor_parallel), plan.tensor_parallel
    if mesh.tp == 1:
        assert not plan.tensor_parallel
    for fqn, attrs in plan.module_attrs.items():
        assert fqn in names and all(hasattr(names[fqn], a) for a in attrs), (fqn, attrs)
    assert set(plan.checkpointing) <= set(plan.layers)
    # alternatives and the JSON round trip
    for alt in plan.alternatives:
        m = alt.mesh
        assert m.pp * m.dp * m.fsdp * m.cp * m.tp == cluster.world_size, m
        assert alt.mesh != mesh or alt.why
    assert Plan.from_json(plan.to_json()) == plan
    assert json.loads(plan.to_json())["version"] == 1


@SEARCH
@given(setup=setups(gpt_shapes()))
def test_fuzz_gpt_search_gives_valid_plans(setup):
    shape = dict(setup["shape"])
    seq_len = shape.pop("seq_len")
    with torch.device("meta"):
        model = GPT(**shape)
    plan = _plan_or_refusal(model, setup, seq_len=seq_len, model_file=str(ROOT / "examples/gpt.py"))
    if plan is not None:
        assert plan.training.seq_len == seq_len
        assert plan.predicted.tokens_per_s is not None
        check_plan(plan, model, setup)


@settings(SEARCH, max_examples=_DEEP or 20)
@given(setup=setups(mlp_shapes()), batch=st.integers(1, 5))
def test_fuzz_mlp_search_gives_valid_plans(setup, batch):
    shape = setup["shape"]
    with torch.device("meta"):
        model = ResidualMLP(**shape)
    inputs = (torch.zeros(batch, shape["in_features"], device="meta"),)
    plan = _plan_or_refusal(
        model, setup, example_inputs=inputs, model_file=str(ROOT / "examples/mlp.py")
    )
    if plan is not None:
        check_plan(plan, model, setup)


# -- parsers of user text ------------------------------------------------------------------------

_TEXT = st.one_of(
    st.text(max_size=40),
    st.from_regex(r"(cpu:|[0-9x.\-+ ]{0,8})[A-Za-z0-9\-:. ]{0,12}(\.json|\.toml)?", fullmatch=True),
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(spec=_TEXT)
def test_fuzz_cluster_specs_fail_only_as_one_line(spec):
    try:
        cluster = parse_cluster(spec)
    except ClusterSpecError as e:
        assert str(e) and "\n" not in str(e)
    else:
        assert 1 <= cluster.world_size <= 2**20


@settings(max_examples=300, deadline=None, derandomize=True)
@given(text=st.one_of(st.text(max_size=30), st.from_regex(r"([a-z]{1,5}=-?[0-9]{0,3},?){0,5}")))
def test_fuzz_mesh_flags_fail_only_as_one_line(text):
    try:
        pins = parse_mesh(text)
    except PlanningError as e:
        assert str(e) and "\n" not in str(e)
    else:
        assert set(pins) <= {"pp", "dp", "fsdp", "tp"} and all(v >= 1 for v in pins.values())


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.sampled_from([math.inf, -math.inf, math.nan, 0.0, -1, 1, 2**64])
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


@pytest.fixture(scope="module")
def plan_json() -> dict:
    with torch.device("meta"):
        model = GPT(vocab=64, dim=32, n_head=4, n_layer=2, max_seq=16)
    plan = auto_parallelize(
        model, "cpu:4", global_batch=8, seq_len=16, model_file=str(ROOT / "examples/gpt.py")
    )
    return json.loads(plan.to_json())


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(data=st.data())
def test_fuzz_plan_json_loads_or_fails_as_plan_error(plan_json, data):
    """A saved plan with one value replaced by arbitrary JSON (or arbitrary text) either loads
    as a valid Plan that round-trips or raises PlanError with one line; never anything else."""
    raw = json.loads(json.dumps(plan_json))
    if data.draw(st.booleans()):
        text = data.draw(st.text(max_size=60))
    else:
        paths = [p for p in _paths(raw) if p]
        path = data.draw(st.sampled_from(paths))
        node = raw
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = data.draw(_JSON)
        text = json.dumps(raw)
    try:
        plan = Plan.from_json(text)
    except PlanError as e:
        assert str(e) and "\n" not in str(e)
    else:
        assert Plan.from_json(plan.to_json()) == plan
