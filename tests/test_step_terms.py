"""Step terms the emitted loop pays beyond the layers (issue 27 item 3): the gradient norm every
logged step computes, AdamW's per-op cost apart from a forward op's, and the DTensor dispatch
of TP-styled parameters in the optimizer step; and the profile fit that measures the per-op
costs apart."""

from __future__ import annotations

import math

import pytest
from autopar.cost_model import device
from autopar.cost_model import step as cost
from autopar.cost_model.cluster import parse_cluster
from autopar.cost_model.estimate import ADAMW_OPS_PER_TENSOR, adamw_step_time_s, collective_time_s
from autopar.cost_model.precision import FP32
from autopar.cost_model.profile_bench import MLP_WIDTH, OPT_TENSOR_SHAPE, OPT_TENSORS
from autopar.cost_model.profile_data import Sample
from autopar.cost_model.profile_fit import _fit_overhead, _planner_op_counts
from autopar.planner.rules import data_parallel

from autopar.api import plan_model_file
from autopar.model_file import build_on_meta, load_model_file

MLP = "examples/mlp.py"


def test_adamw_prices_its_ops_apart_and_dtensors_only_where_they_are():
    cpu = device("cpu").model_copy(
        update={"op_overhead_s": 16e-6, "optimizer_op_s": 4e-6, "dtensor_optimizer_op_s": 30e-6}
    )
    per = ADAMW_OPS_PER_TENSOR["cpu"]
    bandwidth = cpu.memory_bandwidth_bytes_per_s * cpu.memory_efficiency
    plain = adamw_step_time_s(1e6, cpu, num_tensors=10)
    assert plain == pytest.approx(1e6 * 28 / bandwidth + 10 * per * 4e-6)
    # 3 of the 10 tensors are DTensors: only their ops pay the dispatch
    mixed = adamw_step_time_s(1e6, cpu, num_tensors=10, dtensor_tensors=3)
    assert mixed - plain == pytest.approx(3 * per * 30e-6)
    # without a measured optimizer op, an op costs op_overhead_s (older profiles, catalog)
    older = cpu.model_copy(update={"optimizer_op_s": None})
    assert adamw_step_time_s(0, older, num_tensors=2) == pytest.approx(2 * per * 16e-6)


def test_the_gradient_norm_reads_the_gradients_and_all_reduces_the_totals():
    one, two = parse_cluster("cpu:1"), parse_cluster("cpu:2")
    dev = two.device
    op = dev.op_overhead_s if dev.optimizer_op_s is None else dev.optimizer_op_s
    read = 4e6 / (dev.memory_bandwidth_bytes_per_s * dev.memory_efficiency)
    assert cost.grad_norm_s(one, 4e6, 12) == pytest.approx(read + 12 * op)
    totals = collective_time_s("all_reduce", 16, 2, two.intra_node)
    assert totals > 0
    assert cost.grad_norm_s(two, 4e6, 12) == pytest.approx(read + 12 * op + totals)
    # the loop waits on the totals: a profiled device's per-call cost of a blocking collective
    waited = two.model_copy(update={"device": dev.model_copy(
        update={"tp_collective_overhead_s": 1e-3})})  # fmt: skip
    assert cost.grad_norm_s(waited, 4e6, 12) == pytest.approx(read + 12 * op + totals + 1e-3)


def test_a_tp_plan_charges_dtensor_dispatch_to_the_styled_modules_tensors_only():
    """The pinned tp=2 MLP: its optimizer term is AdamW on the rank's local parameters, the
    styled modules' tensors (and only those) priced as DTensors; the grad-norm term is the
    loop's norm over the same tensors; both are parts of the predicted step."""
    mf = load_model_file(MLP)
    plan = plan_model_file(mf, "cpu:2", global_batch=64, mesh={"tp": 2})
    styled = plan.tensor_parallel
    assert styled and plan.mesh.tp == 2
    model = build_on_meta(mf)
    modules = dict(model.named_modules())
    tensors = [(fqn, p) for fqn, m in modules.items() for p in m.parameters(recurse=False)]
    dtensors = sum(1 for fqn, _ in tensors if fqn in styled)
    assert 0 < dtensors < len(tensors)  # the head and the projection stay plain
    local = sum(p.numel() / (2 if fqn in styled and styled[fqn] != "sequence_parallel" else 1)
                for fqn, p in tensors)  # fmt: skip
    cluster = parse_cluster("cpu:2")
    t = plan.predicted.time_breakdown_s
    want = cost.optimizer_s(cluster.device, "adamw", local, len(tensors), dtensors, FP32)
    assert t.optimizer == pytest.approx(want, rel=1e-9)
    assert t.optimizer > cost.optimizer_s(cluster.device, "adamw", local, len(tensors), 0, FP32)
    norm = cost.grad_norm_s(cluster, local * FP32.grad, len(tensors))
    assert t.grad_norm == pytest.approx(norm, rel=1e-9)
    assert math.isclose(t.total, plan.predicted.step_time_s, rel_tol=1e-12)
    assert t.parts()["grad_norm"] == t.grad_norm


def _samples(node_op: float, opt_op: float, bandwidth: float) -> list[Sample]:
    """The overhead benchmark's samples of a machine whose forward/backward op costs
    ``node_op`` and AdamW op ``opt_op`` (each step also pays the optimizer)."""
    out = []
    for depth in (1, 6):
        nodes, params, _ = _planner_op_counts(depth)
        fb = 3 * nodes * node_op
        opt = 10 * params * opt_op
        out.append(
            Sample(bench="train_step", op="mlp_fb", shape=[depth, MLP_WIDTH], time_s=fb, reps=3)
        )
        out.append(Sample(bench="train_step", op="mlp", shape=[depth, MLP_WIDTH],
                          time_s=fb + opt, reps=3))  # fmt: skip
    numel = OPT_TENSORS * math.prod(OPT_TENSOR_SHAPE)
    out.append(Sample(bench="train_step", op="adamw", shape=[OPT_TENSORS],
                      time_s=numel * 28 / bandwidth + 10 * OPT_TENSORS * opt_op, reps=3))  # fmt: skip
    return out


def test_the_profile_fits_forward_ops_and_optimizer_ops_apart():
    bandwidth = 5e10
    samples = _samples(16e-6, 4e-6, bandwidth)
    fit = _fit_overhead(samples, bandwidth)
    assert fit is not None
    assert fit.op_overhead_s == pytest.approx(16e-6, rel=1e-6)
    assert fit.optimizer_op_s == pytest.approx(4e-6, rel=1e-6)
    # a GPU's AdamW is charged one op per tensor (foreach kernels): the same step, 10x per op
    gpu = _fit_overhead(samples, bandwidth, adamw_ops=1)
    assert gpu is not None and gpu.optimizer_op_s == pytest.approx(40e-6, rel=1e-6)
    # an older profile (whole steps only): one slope over both kinds of op, no optimizer_op_s
    older = [s for s in samples if s.op != "mlp_fb"]
    fit = _fit_overhead(older, bandwidth)
    assert fit is not None and fit.optimizer_op_s is None
    assert 4e-6 < fit.op_overhead_s < 16e-6


def test_an_ep_plan_charges_dtensor_dispatch_to_every_tensor_fsdp2_holds():
    """tests/models/moe.py at ep=2 (dp=2): the experts' parameters are DTensors over the
    expert-parallel ranks (each rank holds half the experts), and the program replicates the rest
    over dp with FSDP2 (``DATA_PARALLEL = "fsdp2"``: runtime ``apply_data_parallel`` wraps every
    unit), so every trainable parameter is a DTensor and every optimizer op pays the dispatch."""
    mf = load_model_file("tests/models/moe.py")
    plan = plan_model_file(mf, "cpu:2", global_batch=8, seq_len=64, mesh={"ep": 2})
    assert plan.mesh.ep == 2 and plan.mesh.tp == 1 and plan.mesh.fsdp == 1
    model = build_on_meta(mf)
    params = dict(model.named_parameters())
    experts = {n for n in params if ".experts." in n}
    assert experts and len(experts) < len(params)
    local = sum(p.numel() / (2 if n in experts else 1) for n, p in params.items())
    cluster = parse_cluster("cpu:2")
    assert data_parallel(plan.mesh) == "fsdp2"
    want = cost.optimizer_s(cluster.device, "adamw", local, len(params), len(params), FP32)
    assert plan.predicted.time_breakdown_s.optimizer == pytest.approx(want, rel=1e-9)


def test_the_profile_measures_the_checkpoint_and_pipeline_runtime_costs():
    """Samples of a machine whose checkpointed layer costs ``ckpt`` beyond its recompute and
    whose pipeline runtime ``action`` per action (4 processes on 2 cores: twice that per action
    as measured, stored per process-and-core): the fit recovers both, and a pipeline plan on the
    profiled cluster is charged them, where the kind's assumption stood before."""
    from autopar.cost_model.profile_fit import _fit_runtime_overheads
    from autopar.cost_model.spec import Link

    ckpt, action, tau, fwd_op = 0.4e-3, 0.9e-3, 0.5e-3, 0.1e-3
    link = Link(name="t", bandwidth_bytes_per_s=1e9, latency_s=2e-4)
    samples = []
    for depth in (1, 6):
        fb = tau * depth
        for op, t in (("mlp_fb", fb), ("mlp_fwd", fwd_op * depth),
                      ("mlp_fb_ckpt", fb + fwd_op * depth + ckpt * depth + 1e-4)):  # fmt: skip
            samples.append(Sample(bench="train_step", op=op, shape=[depth, 16], time_s=t, reps=3))
    crowd = 2
    for m in (2, 8):
        p2p = 2 * (2e-4 + 16 * 8 * 4 / 1e9)
        t = (m + 1) * tau + p2p + 2 * (m + 1) * action * crowd
        samples.append(Sample(bench="pipeline", op="1f1b", shape=[m, 16, 8], group_size=2,
                              time_s=t, reps=3))  # fmt: skip
    dev = parse_cluster("cpu:2").device.model_copy(update={"host_cpus": 2})
    got = _fit_runtime_overheads(samples, dev, link, world=4)
    assert got["checkpoint_layer_s"] == pytest.approx(ckpt, rel=1e-6)
    assert got["pipeline_action_s"] == pytest.approx(action, rel=1e-6)
    # no pipeline or checkpoint samples (an older profile): nothing fitted, the kind's figure
    assert _fit_runtime_overheads(samples[:2], dev, link, world=4) == {}
    cluster = parse_cluster("cpu:2")
    here = cost.host_crowd(cluster.device, 2)  # this host's cores: 1 on 2 cores or more
    assert cost.checkpoint_overhead_s(cluster.device) == cost.CKPT_WRAPPER_S["cpu"]
    assert cost.pipeline_runtime_s(cluster, 10) == pytest.approx(
        10 * cost.PP_ACTION_S["cpu"] * here)  # fmt: skip
    measured = cluster.model_copy(update={"device": cluster.device.model_copy(update=got)})
    assert cost.checkpoint_overhead_s(measured.device) == pytest.approx(ckpt)
    assert cost.pipeline_runtime_s(measured, 10) == pytest.approx(10 * action * here)
    # the planner's pipeline step carries the measured runtime charge (mlp, pp=2, 1F1B, m=4:
    # 2 (m + p - 1) = 10 actions on the critical path)
    pins = dict(global_batch=64, mesh={"pp": 2}, schedule="1f1b", microbatches=4,
                checkpoint="none")  # fmt: skip
    base = plan_model_file(load_model_file(MLP), cluster, **pins).predicted
    slow = measured.model_copy(update={"device": measured.device.model_copy(
        update={"pipeline_action_s": action + 1e-3})})  # fmt: skip
    more = plan_model_file(load_model_file(MLP), slow, **pins).predicted
    assert more.step_time_s - base.step_time_s == pytest.approx(
        10 * (action + 1e-3 - cost.PP_ACTION_S["cpu"]) * here, rel=1e-6)  # fmt: skip
