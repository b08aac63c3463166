"""``plan --refit RUN/profile.json`` (issue 27, item 2): the fit, the fitted profile, the CLI.

Default tier, in process, no torchrun: a plan of examples/gpt.py is made by the CLI, and a run
profile around it is written with times made from the cost model's own features at known
coefficients (what ``train.py --profile-steps`` writes, every sum exact); the refit recovers
those coefficients, changes only what the profile informs (a data-parallel run moves no
tensor-parallel, DTensor, pipeline or other collective's coefficient), writes a cluster profile
``--profile`` takes, and refuses bad input in one line with exit 2. The slow tier runs the real
loop (benchmarks/refit.py): plan A (dp=2) runs with ``--profile-steps``, the refit from it alone
predicts plans B-E (fsdp=2, tp=2, pp=2, dp=2 with checkpointing), which run too, better.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from autopar.cost_model import parse_cluster
from autopar.cost_model.measured import parse_measured
from autopar.cost_model.profile_data import load_profile
from autopar.cost_model.refit import (
    CollectiveRow,
    LayerRow,
    OptimizerRow,
    RunRows,
    changed,
    fit_runs,
    rows_of,
)

from autopar import Plan
from autopar.api import _trace_plan_model
from autopar.cli import main
from autopar.refit_cli import _base_profile, run_facts

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples" / "gpt.py")
TRAINING = ["--cluster", "cpu:2", "--global-batch", "8", "--seq-len", "32"]
SCALE, PER_OP = 4.0, 30e-6  # the "true" coefficients of the synthetic runs
OPT_PER_OP = 4e-6  # an AdamW op on a plain tensor: cheaper than a forward op with autograd
ALPHA, BYTES_PER_S = 2e-3, 5e7


def _benchmark(name: str, monkeypatch=None):
    """benchmarks/NAME.py loaded as a module (registered while the test runs, where
    ``monkeypatch`` is given: a module's dataclasses look it up)."""
    spec = importlib.util.spec_from_file_location(
        f"bench_{name}", ROOT / "benchmarks" / f"{name}.py"
    )
    bench = importlib.util.module_from_spec(spec)
    if monkeypatch is not None:
        monkeypatch.setitem(sys.modules, spec.name, bench)
    spec.loader.exec_module(bench)
    return bench


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def dp_plan(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("refit") / "A"
    assert main([GPT, *TRAINING, "--mesh", "dp=2", "--checkpoint", "none", "--out", str(out),
                 "--quiet"]) == 0  # fmt: skip
    return out


def _truth(run: RunRows) -> dict[str, float]:
    """Each layer's forward at the true coefficients (a data-parallel run's rows are its
    layers' forward: the planner's forward share of the features)."""
    return {r.fqn: SCALE * r.roofline_s + PER_OP * r.ops for r in run.layers}


def _collective_time(num_bytes: float) -> float:
    return ALPHA + num_bytes / BYTES_PER_S


def _document(
    plan_dir: Path, layer_s: dict[str, float] | None = None, optimizer_s: float = 4e-3
) -> dict:
    """A run profile of the plan in ``plan_dir`` (2 ranks), as train.py writes it: layer times
    ``layer_s`` forward (default 1 ms each; backward twice that), DDP all-reduces of two sizes
    and the gradient norm's scalar per step."""
    plan = json.loads((plan_dir / "plan.json").read_text())
    fwd = {f: (layer_s or {}).get(f, 1e-3) for f in plan["layers"]}
    layers = {f: {"forward_s": t, "backward_s": 2 * t} for f, t in fwd.items()}
    inside = sum(v["forward_s"] + v["backward_s"] for v in layers.values())
    terms = {"data_wait_s": 1e-4, "forward_other_s": 1e-3, "backward_other_s": 2e-3,
             "pipeline_s": 0.0, "grad_norm_s": 5e-4, "optimizer_s": optimizer_s, "other_s": 0.0}  # fmt: skip
    step_s = inside + sum(terms.values())
    mean = {"step_s": step_s, "logged_step_time_s": step_s - 1e-4, **terms, "layers": layers}
    memory = {"source": "cpu_allocations", "peak_bytes": 100, "params_bytes": 10,
              "grads_bytes": 10, "optimizer_bytes": 20, "activations_bytes": 55,
              "buffers_bytes": 5, "measured": [], "derived": []}  # fmt: skip
    colls = [{"kind": "all_reduce", "group": "dp", "group_size": 2, "message_bytes": b,
              "num_calls": 1.0, "time_s": _collective_time(b)} for b in (100_000, 1_000_000)]  # fmt: skip
    # the gradient norm's scalar: its record holds the ranks' skew, far above the link's latency
    colls.append({**colls[0], "message_bytes": 16, "time_s": 10 * ALPHA})
    ranks = [{"rank": r, "mesh_coords": {"dp": r}, "mean": mean,
              "steps": [{**mean, "step": 3, "memory": memory}], "memory": memory,
              "collectives": colls} for r in range(2)]  # fmt: skip
    return {
        "kind": "autopar-profile", "schema": 1,
        "autopar_version": importlib.metadata.version("autopar"), "torch_version": "2.13.0",
        "cluster": "cpu:2", "world_size": 2, "backend": "gloo", "device_type": "cpu",
        "clock": "perf_counter", "mesh": plan["mesh"], "plan_sha256": "0" * 64, "plan": plan,
        "warmup_steps": 2, "profiled_steps": [3], "collectives_source": "test",
        "layers": plan["layers"], "ranks": ranks,
    }  # fmt: skip


def _rows(plan_dir: Path, doc: dict) -> RunRows:
    plan = Plan.from_json((plan_dir / "plan.json").read_text())
    graph = _trace_plan_model(plan, None)
    base = _base_profile(parse_cluster("cpu:2"), None)
    return rows_of(parse_measured(json.dumps(doc)), graph, run_facts(plan, "A"), base.device)


@pytest.fixture(scope="module")
def true_run(dp_plan: Path, tmp_path_factory) -> Path:
    """A run profile whose layers took exactly what the true coefficients say."""
    run = _rows(dp_plan, _document(dp_plan))
    optimizer = run.optimizer.traffic_s + OPT_PER_OP * run.optimizer.ops
    path = tmp_path_factory.mktemp("run") / "profile.json"
    path.write_text(json.dumps(_document(dp_plan, _truth(run), optimizer)))
    return path


def test_the_fit_recovers_known_rates(dp_plan: Path, true_run: Path) -> None:
    doc = json.loads(true_run.read_text())
    run = _rows(dp_plan, doc)
    assert {r.fqn for r in run.layers} == set(doc["layers"])
    # layers differ in their mix of roofline and ops: both coefficients are identified
    ratios = {round(r.roofline_s / r.ops, 12) for r in run.layers}
    assert len(ratios) >= 3
    assert run.optimizer is not None and run.optimizer.dtensor_ops == 0
    base = _base_profile(parse_cluster("cpu:2"), None)
    result = fit_runs(base, parse_cluster("cpu:2"), [run])
    dev = result.profile.device
    assert dev.compute_scale == pytest.approx(SCALE, rel=1e-6)
    assert dev.op_overhead_s == pytest.approx(PER_OP, rel=1e-6)
    # the optimizer's ops are fitted apart from the layers' (their own coefficient)
    assert dev.optimizer_op_s == pytest.approx(OPT_PER_OP, rel=1e-6)
    # the curve from the two buckets: the norm's scalar (its skew) is no point of it
    (cost,) = result.profile.intra_node.measured
    assert (cost.kind, cost.group_size) == ("all_reduce", 2)
    assert cost.alpha_s == pytest.approx(ALPHA, rel=1e-6)
    assert cost.bytes_per_s == pytest.approx(BYTES_PER_S, rel=1e-6)
    assert result.residuals["compute"] < 1e-9


def test_a_dp_profile_changes_only_what_it_informs(dp_plan: Path, true_run: Path) -> None:
    run = _rows(dp_plan, json.loads(true_run.read_text()))
    base = _base_profile(parse_cluster("cpu:2"), None)
    result = fit_runs(base, parse_cluster("cpu:2"), [run])
    moved = changed(base, result.profile)
    informed = {"device.compute_scale", "device.op_overhead_s", "device.optimizer_op_s",
                "device.ddp_comm_scale", "link.all_reduce[2]"}  # fmt: skip
    assert moved == informed
    dev, old = result.profile.device, base.device
    assert (dev.tp_op_overhead_s, dev.dtensor_optimizer_op_s, dev.fsdp_tensor_overhead_s) == (
        old.tp_op_overhead_s, old.dtensor_optimizer_op_s, old.fsdp_tensor_overhead_s)  # fmt: skip
    link, old_link = result.profile.intra_node, base.intra_node
    assert (link.latency_s, link.bandwidth_bytes_per_s) == (
        old_link.latency_s,
        old_link.bandwidth_bytes_per_s,
    )  # send/recv, ring model: untouched


def test_tensor_parallel_and_dtensor_rows_move_their_own_coefficients() -> None:
    """Synthetic rows: TP'd layers fit tp_op_overhead_s (their TP collectives taken out);
    an FSDP run's optimizer fits dtensor_optimizer_op_s; plain rows fit compute."""
    base = _base_profile(parse_cluster("cpu:2"), None)
    plain = [LayerRow("r", f"l{i}", SCALE * roof + PER_OP * ops, roof, ops, 0.0)
             for i, (roof, ops) in enumerate([(1e-3, 30), (5e-3, 60), (2e-4, 90)])]  # fmt: skip
    tp_per_op, tp_comm = 80e-6, 3e-3
    styled = [LayerRow("t", "b0", SCALE * 2e-3 + PER_OP * 40 + tp_per_op * 60 + tp_comm, 2e-3,
                       40, 60)]  # fmt: skip
    dt_per_op = 50e-6
    opt = OptimizerRow("f", 1e-3 + 100 * (PER_OP + dt_per_op), 1e-3, 100, 100)
    coll = CollectiveRow("t", "all_reduce", "tp", 2, 4096, 1e-3, 8)
    runs = [RunRows("r", tuple(plain), None, (), 0.0),
            RunRows("t", tuple(styled), None, (coll,), tp_comm),
            RunRows("f", (), opt, (), 0.0)]  # fmt: skip
    dev = fit_runs(base, parse_cluster("cpu:2"), runs).profile.device
    assert dev.compute_scale == pytest.approx(SCALE, rel=1e-6)
    assert dev.tp_op_overhead_s == pytest.approx(tp_per_op, rel=1e-6)
    assert dev.dtensor_optimizer_op_s == pytest.approx(dt_per_op, rel=1e-6)


def test_rows_measured_at_zero_seconds_inform_nothing() -> None:
    """A layer or a collective call a profile records at 0 s (JSON allows it) is left out of
    the fits, which come out as without it; with it in, the refit stopped with a
    ZeroDivisionError (compute) or a ValueError (an all-reduce curve from two sizes)."""
    base = _base_profile(parse_cluster("cpu:2"), None)
    plain = [LayerRow("r", f"l{i}", SCALE * roof + PER_OP * ops, roof, ops, 0.0)
             for i, (roof, ops) in enumerate([(1e-3, 30), (5e-3, 60), (2e-4, 90)])]  # fmt: skip
    calls = [CollectiveRow("r", "all_reduce", "dp", 2, b, 2e-4 + b / 1e9, 1) for b in (4e3, 4e6)]
    zero_layer = LayerRow("r", "idle", 0.0, 1e-3, 30, 0.0)
    zero_call = CollectiveRow("r", "all_reduce", "dp", 2, 4e5, 0.0, 1)

    def fitted(layers, collectives):
        run = RunRows("r", tuple(layers), None, tuple(collectives), 0.0)
        return fit_runs(base, parse_cluster("cpu:2"), [run]).profile

    clean, noisy = fitted(plain, calls), fitted([*plain, zero_layer], [*calls, zero_call])
    assert noisy.device.compute_scale == pytest.approx(SCALE, rel=1e-6)
    assert noisy.device == clean.device and noisy.intra_node == clean.intra_node
    only_zero = fitted([zero_layer], [zero_call])  # nothing informed: the base kept
    assert only_zero.device.compute_scale == base.device.compute_scale
    assert only_zero.intra_node.measured == base.intra_node.measured


def test_plan_refit_writes_a_profile_and_explains(dp_plan: Path, true_run: Path, tmp_path,
                                                  capsys) -> None:  # fmt: skip
    fitted = tmp_path / "fitted.json"
    code, out, err = _cli([GPT, *TRAINING, "--mesh", "fsdp=2", "--refit", str(true_run),
                           "--refit-out", str(fitted), "--explain"], capsys)  # fmt: skip
    assert code == 0, err
    profile = load_profile(fitted)  # the versioned cluster profile format
    assert profile.source == "refit"
    assert profile.device.compute_scale == pytest.approx(SCALE, rel=1e-3)
    assert "refit:" in out and "device.compute_scale" in out
    assert "before" in out and "after" in out and "step_time" in out
    assert "note: cost model: refit profile" in out
    # the fitted profile names the cluster next time; a second refit replaces autopar's own file
    code, out, err = _cli([GPT, *TRAINING, "--profile", str(fitted), "--json"], capsys)
    assert code == 0, err and json.loads(out)["version"] == 1
    code, _, err = _cli([GPT, *TRAINING, "--refit", str(true_run), "--refit-out", str(fitted),
                         "--quiet"], capsys)  # fmt: skip
    assert code == 0, err
    # default: beside the first run profile
    code, _, err = _cli([GPT, *TRAINING, "--refit", str(true_run), "--quiet"], capsys)
    assert code == 0, err and (true_run.parent / "refit-profile.json").is_file()


def _refused(argv: list[str], capsys, *words: str) -> None:
    code, _, err = _cli(argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:"), err
    assert all(w in lines[0] for w in words), lines[0]


def test_plan_refit_refuses_bad_input(dp_plan: Path, true_run: Path, tmp_path, capsys) -> None:
    doc = json.loads(true_run.read_text())
    refit = [GPT, *TRAINING, "--refit"]
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    _refused([*refit, str(bad)], capsys, "not valid JSON")
    pickle = tmp_path / "pickle.json"
    pickle.write_bytes(b"\x80\x04\x95")
    _refused([*refit, str(pickle)], capsys, "profile")
    for key, value, word in [("cluster", "cpu:4", "cluster"),
                             ("autopar_version", "0.0.0", "autopar 0.0.0")]:  # fmt: skip
        other = tmp_path / f"{key}.json"
        other.write_text(json.dumps({**doc, key: value}))
        _refused([*refit, str(other), "--refit-out", str(tmp_path / "x.json")], capsys, word)
    model = tmp_path / "model.json"
    model.write_text(json.dumps({**doc, "plan": {**doc["plan"], "model": {"file": "/m/other.py",
                                                                         "factory": "build_model"}}}))  # fmt: skip
    _refused([*refit, str(model), "--refit-out", str(tmp_path / "x.json")], capsys, "model")
    foreign = tmp_path / "mine.json"
    foreign.write_text('{"a user": "file"}')
    _refused([*refit, str(true_run), "--refit-out", str(foreign)], capsys, "not a cluster profile")
    assert foreign.read_text() == '{"a user": "file"}'
    _refused(["--plan", str(dp_plan), "--refit", str(true_run)], capsys, "--refit")


@pytest.mark.slow
def test_a_refit_from_one_run_improves_the_other_plans(tmp_path) -> None:
    """Run A (dp=2), refit from it alone, run B-E: the median |error| of B-E drops."""
    bench = _benchmark("refit")
    res = bench.run_loop(tmp_path, steps=7, profile_steps=4)
    assert res["median_abs_err_after"] < res["median_abs_err_before"], res
    improved = [r for name, r in res["plans"].items() if name != res["refit_from"]
                and abs(r["after_err"]) < abs(r["before_err"])]  # fmt: skip
    assert len(improved) >= 3, res


def test_ddp_refit_keeps_ddps_per_tensor_work_apart() -> None:
    """A DDP run's backward beyond its compute is DDP's own per-tensor work (the profile's
    ``ddp_tensor_overhead_s``) plus its all-reduce: the refit scales the all-reduce by what is
    left after the per-tensor work; where less was added than that work alone, the all-reduce
    goes to its floor and the per-tensor figure to what was added."""
    from autopar.cost_model.estimate import collective_time_s
    from autopar.cost_model.refit import CollectiveRow, LayerRow, RunRows, _fit_ddp
    from autopar.cost_model.spec import MIN_SCALE

    cluster = parse_cluster("cpu:2")
    dev = cluster.device.model_copy(
        update={"compute_scale": 1.0, "op_overhead_s": 0.0, "ddp_tensor_overhead_s": 1e-4}
    )
    link = cluster.intra_node
    grad_bytes, tensors = 4e6, 50
    traffic = collective_time_s("all_reduce", grad_bytes, 2, link)

    def run(added_s: float) -> RunRows:
        backward = (LayerRow("A", "blocks.0", 0.010 + added_s, 0.010, 0.0, 0.0),)
        collectives = (CollectiveRow("A", "all_reduce", "dp", 2, grad_bytes, 0.0, 1.0),)
        return RunRows("A", (), None, collectives, 0.0, ddp=True, backward=backward,
                       param_tensors=tensors)  # fmt: skip

    got = _fit_ddp([run(tensors * 1e-4 + 1.5 * traffic)], dev, link)
    assert got == {"ddp_comm_scale": pytest.approx(1.5)}
    got = _fit_ddp([run(0.6 * tensors * 1e-4)], dev, link)
    assert got["ddp_comm_scale"] == MIN_SCALE
    assert got["ddp_tensor_overhead_s"] == pytest.approx(0.6e-4)


def test_the_refit_benchmark_measures_the_unprofiled_steps(tmp_path) -> None:
    """benchmarks/refit.py --plain-steps K: a plan is measured by the median logged step of
    the K steps after its profiled ones (rank 0's JSON lines), not the profiled steps."""
    bench = _benchmark("refit")
    lines = [json.dumps({"step": s, "loss": 1.0, "step_time_s": 0.1 * s}) for s in range(1, 9)]
    (tmp_path / "train.log").write_text("\n".join(["starting", *lines, '{"eval_loss": 2.0}']))
    assert bench.plain_step_times(tmp_path, 5) == pytest.approx([0.6, 0.7, 0.8])
    assert bench.plain_step_times(tmp_path, 8) == []


@pytest.mark.slow
def test_gpu_check_runs_its_whole_loop_on_cpu(tmp_path) -> None:
    """benchmarks/gpu_check.sh (issue 27 item 5), its CPU dry run: plan three cases, run each
    with --profile-steps, refit from the first and predict all three again. Nothing here needs
    a GPU, so the script a lent GPU would run first is held working."""
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "GPU_CHECK_DIR": str(tmp_path), "GPU_CHECK_CLUSTER": "cpu:1",
           "GPU_CHECK_SIZE": "small", "GPU_CHECK_STEPS": "7", "GPU_CHECK_PROFILE_STEPS": "3",
           "PYTHON": sys.executable, "PYTHON_AUTOPAR": sys.executable,
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}  # fmt: skip
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for case in ("free", "ckpt-full", "accum4"):
        assert (tmp_path / case / "profile.json").is_file()
        row = next(line.split() for line in out.splitlines() if line.startswith(case + " "))
        assert float(row[2]) > 0  # its measured step, seconds
    fitted = load_profile(tmp_path / "refit-profile.json")
    assert fitted.source == "refit"
    assert "median |error| of the other plans" in out and "device.compute_scale" in out


@pytest.mark.slow
def test_calibrate_refits_from_one_case_and_predicts_the_others(tmp_path, capsys,
                                                                monkeypatch) -> None:  # fmt: skip
    """benchmarks/calibrate.py --refit-from NAME: the named case's plan runs once more with
    --profile-steps, the cost model is refitted from that run alone (plan --refit's fit) over
    the profile the plans were made with, and every plan is predicted again with it."""
    bench = _benchmark("calibrate", monkeypatch)
    code = bench.main(["--cluster", "cpu:2", "--catalog", "--only", "gpt ddp,gpt ddp accum 2",
                       "--steps", "6", "--refit-from", "gpt ddp", "--keep", str(tmp_path),
                       "--json"])  # fmt: skip
    assert code == 0
    res = json.loads(capsys.readouterr().out)
    refit = res["refit"]
    assert refit["from"] == "gpt ddp" and set(refit["predicted_s"]) == {
        "gpt ddp",
        "gpt ddp accum 2",
    }
    # from the catalog's figures, the run moves what it informs (the host's speed)
    assert "device.compute_scale" in refit["changes"]
    before = {r["name"]: r["predicted_s"] for r in res["plans"]}
    assert all(refit["predicted_s"][n] != before[n] for n in before)
    assert load_profile(tmp_path / "refit-profile.json").source == "refit"
    assert refit["median_abs_error_others"] is not None


def test_runs_whose_layers_wait_on_collectives_give_no_compute_rows(tmp_path) -> None:
    """A layer's measured time fits compute only where no collective waits inside it: under
    cp the parameters are FSDP2-sharded over cp (all-gathers in every forward) and the
    attention gathers keys and values, so a cp run gives no compute row; under ep a layer with
    MoE blocks holds their all-to-alls, so only the MoE run's other layers give rows (forward
    only: gradients are averaged in backward)."""
    moe = str(ROOT / "tests" / "models" / "moe.py")
    got = {}
    for name, model, mesh in [("cp", GPT, "cp=2"), ("ep", moe, "ep=2")]:
        out = tmp_path / name
        assert main([model, *TRAINING, "--mesh", mesh, "--checkpoint", "none", "--out",
                     str(out), "--quiet"]) == 0  # fmt: skip
        plan = Plan.from_json((out / "plan.json").read_text())
        doc = _document(out)
        doc["mesh"].pop("ep", None)  # the program's mesh: ep is carved out of dp
        got[name] = (_rows(out, doc), _trace_plan_model(plan, None))
    assert got["cp"][0].layers == ()
    run, graph = got["ep"]
    with_moe = {x.fqn for x in graph.layers if graph.moes_in(x.fqn)}
    assert with_moe and {r.fqn for r in run.layers} == {x.fqn for x in graph.layers} - with_moe
    assert all(r.measured_s == pytest.approx(1e-3) for r in run.layers)  # forward only


def test_the_profiles_per_row_cost_is_kept_and_taken_out_of_the_fit(dp_plan: Path) -> None:
    """A profile's ``op_row_s`` (what narrow rows cost per op) is kept by a refit: each layer's
    row cost at it is taken out of what the layer measured before compute_scale and
    op_overhead_s are fitted, which come out as the truth; the refitted profile still has it."""
    from autopar.cost_model.estimate import op_rows

    plan = Plan.from_json((dp_plan / "plan.json").read_text())
    graph = _trace_plan_model(plan, None)
    base = _base_profile(parse_cluster("cpu:2"), None)
    per_row = 50e-9
    base = base.model_copy(update={"device": base.device.model_copy(update={"op_row_s": per_row})})
    scale = 8 / (2 * graph.batch_size)  # the run's local batch over the traced one
    computed = {x.fqn: [graph.node(n) for n in x.nodes if graph.node(n).kind == "compute"
                        and graph.node(n).out is not None] for x in graph.layers}  # fmt: skip
    rows = {f: 3 * sum(op_rows(graph, n, scale) for n in nodes) for f, nodes in computed.items()}
    plain = rows_of(parse_measured(json.dumps(_document(dp_plan))), graph, run_facts(plan, "A"),
                    base.device)  # fmt: skip
    assert plain.layers
    truth = {r.fqn: SCALE * r.roofline_s + PER_OP * r.ops + r.fixed_s for r in plain.layers}
    for r in plain.layers:  # a data-parallel run's rows are forward: a share of each feature
        k = r.ops / (3 * len(computed[r.fqn]))
        assert r.fixed_s == pytest.approx(k * per_row * rows[r.fqn], rel=1e-9) and r.fixed_s > 0
    run = rows_of(parse_measured(json.dumps(_document(dp_plan, truth))), graph,
                  run_facts(plan, "A"), base.device)  # fmt: skip
    dev = fit_runs(base, parse_cluster("cpu:2"), [run]).profile.device
    assert dev.compute_scale == pytest.approx(SCALE, rel=1e-6)
    assert dev.op_overhead_s == pytest.approx(PER_OP, rel=1e-6)
    assert dev.op_row_s == per_row
