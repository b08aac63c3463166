"""planner.sat writes CP-SAT models as ortools' cp_model writes them (the same proto, so the
same solve), without importing cp_model (which imports pandas)."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import torch
from autopar.ir.trace import trace
from autopar.planner import ilp, sat
from ortools.sat.python import cp_model


def _as_cp_model(model: sat.Model) -> cp_model.CpModel:
    """The same model written with cp_model's own API, constraint by constraint."""
    m = cp_model.CpModel()
    xs = [m.new_bool_var(v.name) for v in model.proto.variables]
    for c in model.proto.constraints:
        if c.has_exactly_one():
            m.add_exactly_one(xs[i] for i in c.exactly_one.literals)
        else:
            assert c.has_linear(), c
            lin = c.linear
            assert lin.domain[0] == lin.domain[1]
            expr = cp_model.LinearExpr.weighted_sum([xs[i] for i in lin.vars], list(lin.coeffs))
            m.add(expr == lin.domain[0])
    return m


def test_a_random_model_is_cp_models_proto_and_solves_alike() -> None:
    for seed in range(20):
        rng = random.Random(seed)
        ours, theirs = sat.Model(), cp_model.CpModel()
        n = rng.randint(3, 12)
        xs = [ours.bool_var(f"v{i}") for i in range(n)]
        ys = [theirs.new_bool_var(f"v{i}") for i in range(n)]
        for _ in range(rng.randint(1, 6)):
            group = rng.sample(range(n), rng.randint(1, n))
            ours.exactly_one(xs[i] for i in group)
            theirs.add_exactly_one(ys[i] for i in group)
            # x_a == sum of some others, terms repeated and zero-weighted as a builder may
            a, rest = group[0], rng.sample(range(n), rng.randint(0, n - 1))
            weights = [rng.choice([-1, 0, 1, 2]) for _ in rest]
            ours.equal([(xs[a], 1), *((xs[i], -w) for i, w in zip(rest, weights))], 0)
            theirs.add(ys[a] == cp_model.LinearExpr.weighted_sum([ys[i] for i in rest], weights))
        coeffs = [rng.randint(-5, 20) for _ in range(n)]
        maximize = seed % 2 == 1
        if maximize:
            ours.maximize(zip(xs, coeffs))
            theirs.maximize(cp_model.LinearExpr.weighted_sum(ys, coeffs))
        else:
            ours.minimize(zip(xs, coeffs))
            theirs.minimize(cp_model.LinearExpr.weighted_sum(ys, coeffs))
        assert str(ours.proto) == str(theirs.proto), seed
        result = sat.solve(ours, 10.0)
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 1
        status = solver.solve(theirs)
        assert result.status == solver.status_name(status)
        if result.solved:
            assert result.objective == solver.objective_value
            assert list(result.values) == [solver.value(y) for y in ys]


def test_the_ilps_model_is_cp_models_proto() -> None:
    """The TP ILP of traced attention blocks (DTensor blocks, grouped kv heads, a fused qkv),
    its constraints and the pinned-tp probe, rebuilt constraint by constraint with cp_model:
    the same proto."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "models"))
    import heads  # noqa: PLC0415

    for kind, tp in (("nanogpt", 2), ("llama", 2), ("fused", 4)):
        with torch.device("meta"):
            model = heads.GPT(kind, 64, 4, max_seq=heads.MAX_SEQ)
        graph = trace(model.train(), (torch.zeros(2, 16, dtype=torch.long, device="meta"),))
        solver = ilp.Solver(graph, tp)
        base, _ = solver._cp()
        assert len(base.proto.constraints) > 50
        assert str(base.proto) == str(_as_cp_model(base).proto)
        probe = base.clone()
        probe.maximize(solver._sharded_count())
        rebuilt = _as_cp_model(base)
        xs = [rebuilt.get_bool_var_from_proto_index(i) for i in probe.proto.objective.vars]
        rebuilt.maximize(
            cp_model.LinearExpr.weighted_sum(xs, [-c for c in probe.proto.objective.coeffs])
        )
        assert str(probe.proto) == str(rebuilt.proto)


def test_planning_with_tp_imports_neither_cp_model_nor_pandas() -> None:
    code = (
        "import sys\n"
        "from autopar.api import plan_model_file\n"
        "from autopar.model_file import load_model_file\n"
        "s = {}\n"
        "plan = plan_model_file(load_model_file('examples/gpt.py'), '8xH100', global_batch=16,"
        " seq_len=256, mesh='tp=4', progress=None)\n"
        "print(plan.mesh.tp, 'ortools.sat.python.cp_model' in sys.modules, 'pandas' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["4", "False", "False"], out.stdout
