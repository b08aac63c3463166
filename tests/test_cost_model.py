"""Tier 1 (pure): the device catalog, cluster parsing and the cost formulas."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from autopar.cost_model import (
    DEVICE_NAMES,
    ClusterSpecError,
    Link,
    adamw_step_time_s,
    axis_link,
    collective_time_s,
    compute_time_s,
    device,
    memory_per_rank,
    parse_cluster,
)
from autopar.cost_model.catalog import usable_cpu_count
from autopar.cost_model.precision import (
    AUTOCAST_BF16,
    FP32,
    FSDP2_BF16,
    MEGATRON_BF16,
    precision,
    uses_fsdp2,
)
from autopar.planner.request import enumerate_meshes

RAM = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
LINK = Link(name="test", bandwidth_bytes_per_s=1e11, latency_s=1e-5)


# -- catalog ------------------------------------------------------------------------------------


def test_catalog_follows_the_json_and_keeps_sources():
    h100 = device("H100")
    assert h100.peak_flops == {"bf16": 989e12, "fp32": 494.7e12}
    assert h100.vector_flops["fp32"] == 67e12
    assert h100.memory_bytes == 80 * 10**9
    assert h100.memory_bandwidth_bytes_per_s == 3350e9
    assert device("A100-40GB").memory_bytes == 40 * 10**9
    assert device("A100-80GB").memory_bandwidth_bytes_per_s == 2039e9
    assert device("H200").memory_bytes == 141 * 10**9
    for name in DEVICE_NAMES:
        assert device(name).source, name
    assert "glk_h100" in h100.source and "hpctech_h100" in h100.source


@pytest.mark.parametrize(
    "alias, name",
    [("h100", "H100"), ("H100-SXM", "H100"), ("a100-80gb", "A100-80GB"), ("h200", "H200")],
)
def test_aliases_are_case_insensitive(alias, name):
    assert device(alias).name == name


@pytest.mark.parametrize("name", ["a100", "A100", "tpu-v5", "h100-pcie"])
def test_unknown_or_ambiguous_device(name):
    with pytest.raises(ClusterSpecError) as err:
        device(name)
    assert name in str(err.value) and "\n" not in str(err.value)


def test_a100_asks_for_memory_size():
    with pytest.raises(ClusterSpecError, match="A100-40GB or A100-80GB"):
        device("a100")


def test_cpu_device_shares_ram_and_cores():
    one, many = device("cpu"), device("cpu", processes_per_node=4 * usable_cpu_count())
    assert one.memory_bytes == RAM
    assert many.memory_bytes == RAM // (4 * usable_cpu_count())
    assert many.peak_flops["fp32"] == pytest.approx(one.peak_flops["fp32"] / 4)
    assert one.kind == "cpu" and one.tp_op_overhead_s > one.op_overhead_s > 0


# -- parse_cluster ------------------------------------------------------------------------------


def test_cpu_cluster():
    cluster = parse_cluster("cpu:2")
    assert (cluster.world_size, cluster.num_nodes, cluster.devices_per_node) == (2, 1, 2)
    assert cluster.backend == "gloo"
    assert cluster.device.memory_bytes == RAM // 2
    assert cluster.intra_node == cluster.inter_node


def test_gloo_link_reproduces_the_measurements():
    link = parse_cluster("cpu:2").intra_node
    if usable_cpu_count() < 2:
        pytest.skip("2 processes are oversubscribed on one core: the link is scaled")
    assert collective_time_s("all_reduce", 1024, 2, link) == pytest.approx(0.39e-3, rel=0.01)
    big = collective_time_s("all_reduce", 16 * 2**20, 2, link)
    assert big == pytest.approx(7.8e-3, rel=0.01)


@pytest.mark.parametrize(
    "spec, world, nodes, name, memory",
    [
        ("8xH100", 8, 1, "H100", 80e9),
        ("4x8xA100-80GB", 32, 4, "A100-80GB", 80e9),
        ("H100", 1, 1, "H100", 80e9),
        ("2x8xh200", 16, 2, "H200", 141e9),
        ("8xA100-40GB", 8, 1, "A100-40GB", 40e9),
    ],
)
def test_gpu_clusters(spec, world, nodes, name, memory):
    cluster = parse_cluster(spec)
    assert (cluster.world_size, cluster.num_nodes, cluster.device.name) == (world, nodes, name)
    assert cluster.device.memory_bytes == memory
    assert cluster.backend == "nccl"
    assert cluster.intra_node.name == "nvlink" and cluster.inter_node.name == "infiniband"
    assert cluster.intra_node.bandwidth_bytes_per_s > cluster.inter_node.bandwidth_bytes_per_s


def test_h100_links_follow_the_nccl_figures():
    cluster = parse_cluster("2x8xH100")
    assert cluster.intra_node.bandwidth_bytes_per_s == 370e9
    assert cluster.inter_node.bandwidth_bytes_per_s == 46e9
    assert "nccl212" in cluster.intra_node.source and "nccl290" in cluster.inter_node.source


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_json_file_with_catalog_device(tmp_path):
    spec = _write(
        tmp_path, "c.json", json.dumps({"device": "h100", "num_nodes": 2, "devices_per_node": 4})
    )
    cluster = parse_cluster(spec)
    assert (cluster.world_size, cluster.spec, cluster.backend) == (8, spec, "nccl")
    assert cluster.intra_node == parse_cluster("8xH100").intra_node


def test_toml_file_with_full_device_and_links(tmp_path):
    text = """
num_nodes = 1
devices_per_node = 4
backend = "nccl"
[device]
name = "MyGPU"
kind = "gpu"
memory_bytes = 24_000_000_000
peak_flops = { bf16 = 1e14, fp32 = 5e13 }
memory_bandwidth_bytes_per_s = 1e12
matmul_efficiency = 0.7
memory_efficiency = 0.8
op_overhead_s = 5e-6
[intra_node]
name = "pcie"
bandwidth_bytes_per_s = 2e10
latency_s = 1e-5
[inter_node]
name = "eth"
bandwidth_bytes_per_s = 1e9
latency_s = 5e-5
"""
    cluster = parse_cluster(_write(tmp_path, "c.toml", text))
    assert cluster.world_size == 4 and cluster.device.memory_bytes == 24 * 10**9
    assert axis_link(cluster, [("dp", 2), ("tp", 2)], "dp").name == "pcie"


def test_cpu_file(tmp_path):
    cluster = parse_cluster(_write(tmp_path, "c.json", '{"device": "cpu", "devices_per_node": 2}'))
    assert cluster.world_size == 2 and cluster.backend == "gloo"
    assert cluster.intra_node == parse_cluster("cpu:2").intra_node


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("cpu:0", "'0'"),
        ("cpu:two", "'two'"),
        ("0xH100", "'0'"),
        ("2x0xH100", "'0'"),
        ("8xTPU", "'TPU'"),
        ("a100", "A100-40GB or A100-80GB"),
        ("8xcpu", "8xcpu"),
        ("missing.json", "missing.json"),
        ("cluster.yaml", "cluster.yaml"),
    ],
)
def test_bad_specs(spec, needle):
    with pytest.raises(ClusterSpecError) as err:
        parse_cluster(spec)
    message = str(err.value)
    assert needle in message and "\n" not in message


@pytest.mark.parametrize(
    "name, text, needles",
    [
        (
            "neg.json",
            '{"device": "H100", "devices_per_node": 8, "intra_node": '
            '{"name": "x", "bandwidth_bytes_per_s": -1, "latency_s": 0}}',
            ["intra_node.bandwidth_bytes_per_s", "-1"],
        ),
        ("bad.json", '{"device": "H100",\n "devices_per_node": 8,,}', ["line 2"]),
        ("bad.toml", 'device = "H100"\ndevices_per_node = = 8\n', ["line 2"]),
        ("extra.json", '{"device": "H100", "devices_per_node": 8, "gpus": 8}', ["gpus", "allowed"]),
        ("zero.json", '{"device": "H100", "devices_per_node": 0}', ["devices_per_node", "0"]),
        ("dev.json", '{"device": "A100", "devices_per_node": 8}', ["A100-40GB or A100-80GB"]),
        ("backend.json", '{"device": "cpu", "devices_per_node": 2, "backend": "nccl"}', ["gloo"]),
        ("list.json", "[1, 2]", ["list"]),
        (
            "nolinks.json",
            '{"devices_per_node": 2, "device": {"name": "X", "kind": "gpu", '
            '"memory_bytes": 1, "peak_flops": {"bf16": 1}, "memory_bandwidth_bytes_per_s": 1, '
            '"matmul_efficiency": 1, "memory_efficiency": 1, "op_overhead_s": 0}}',
            ["intra_node and inter_node"],
        ),
        (
            "baddev.json",
            '{"devices_per_node": 2, "device": {"name": "X", "kind": "tpu"}}',
            ["device.kind"],
        ),
    ],
)
def test_bad_files(tmp_path, name, text, needles):
    with pytest.raises(ClusterSpecError) as err:
        parse_cluster(_write(tmp_path, name, text))
    message = str(err.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


# -- compute ------------------------------------------------------------------------------------


def test_roofline_compute_bound_memory_bound_and_overheads():
    h100 = device("H100")
    flops, small_bytes = 1e15, 1e6
    expected = flops / (989e12 * h100.matmul_efficiency) + h100.op_overhead_s
    assert compute_time_s(flops, small_bytes, h100, "bf16", matmul=True) == pytest.approx(expected)
    big_bytes = 1e12
    expected = big_bytes / (3350e9 * h100.memory_efficiency) + 3 * h100.op_overhead_s
    got = compute_time_s(1e6, big_bytes, h100, "bf16", matmul=False, num_ops=3)
    assert got == pytest.approx(expected)
    with_tp = compute_time_s(1e6, big_bytes, h100, "bf16", matmul=False, num_ops=3, tp_ops=2)
    assert with_tp - got == pytest.approx(2 * h100.tp_op_overhead_s)


def test_non_matmul_uses_the_vector_peak():
    h100 = device("H100")
    t = compute_time_s(1e12, 0, h100, "bf16", matmul=False, num_ops=0)
    assert t == pytest.approx(1e12 / (67e12 * h100.matmul_efficiency))
    assert compute_time_s(1e12, 0, h100, "fp32", matmul=True, num_ops=0) == pytest.approx(
        1e12 / (494.7e12 * h100.matmul_efficiency)
    )


# -- collectives and links ----------------------------------------------------------------------


def test_collective_ring_factors():
    alpha, gb = LINK.latency_s, 1e9
    assert collective_time_s("all_reduce", gb, 8, LINK) == pytest.approx(
        2 * 7 / 8 * gb / 1e11 + 14 * alpha
    )
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        assert collective_time_s(kind, gb, 8, LINK) == pytest.approx(7 / 8 * gb / 1e11 + 7 * alpha)
    assert collective_time_s("send_recv", gb, 2, LINK) == pytest.approx(gb / 1e11 + alpha)
    assert collective_time_s("broadcast", gb, 4, LINK) == pytest.approx(gb / 1e11 + 3 * alpha)
    assert collective_time_s("all_reduce", gb, 1, LINK) == 0.0


def test_axis_link():
    cluster = parse_cluster("8x8xH100")
    axes = [("dp", 8), ("tp", 8)]
    assert axis_link(cluster, axes, "tp") is cluster.intra_node
    assert axis_link(cluster, axes, "dp") is cluster.inter_node
    axes = [("pp", 2), ("dp", 4), ("fsdp", 2), ("tp", 4)]
    assert axis_link(cluster, axes, "fsdp") is cluster.intra_node
    assert axis_link(cluster, axes, "dp") is cluster.inter_node
    assert axis_link(cluster, [("dp", 64), ("fsdp", 1), ("tp", 1)], "fsdp") is cluster.intra_node
    # span 3 does not divide 8: some groups straddle two nodes
    assert axis_link(parse_cluster("2x8xH100"), [("dp", 3)], "dp") == cluster.inter_node
    with pytest.raises(ValueError, match="'cp'"):
        axis_link(cluster, axes, "cp")


# -- memory and optimizer -----------------------------------------------------------------------


def test_memory_fp32_adamw():
    mem = memory_per_rank(
        param_numel=1e9, precision=FP32, shard_factor=8, activation_bytes=10.5, buffer_bytes=7
    )
    # 125e6 local params: params 4 B, grads 4 B, AdamW m and v 8 B, no master copy
    assert (mem.params, mem.grads, mem.optimizer) == (500_000_000, 500_000_000, 1_000_000_000)
    assert (mem.activations, mem.buffers, mem.total) == (11, 7, 2_000_000_018)


def test_memory_bf16_regimes_and_sgd():
    """autopar's bf16 script keeps fp32 parameters, gradients and AdamW state (FSDP2's
    MixedPrecisionPolicy or autocast); Megatron keeps bf16 parameters, fp32 main gradients and
    an fp32 master copy beside AdamW's moments."""
    for regime in (FSDP2_BF16, AUTOCAST_BF16):
        mem = memory_per_rank(
            param_numel=1e9, precision=regime, shard_factor=8, activation_bytes=0, buffer_bytes=0
        )
        assert (mem.params, mem.grads, mem.optimizer) == (500_000_000, 500_000_000, 1e9)
    mem = memory_per_rank(
        param_numel=1e9, precision=MEGATRON_BF16, shard_factor=8, activation_bytes=0,
        buffer_bytes=0,
    )  # fmt: skip
    assert (mem.params, mem.grads, mem.optimizer) == (250_000_000, 500_000_000, 1_500_000_000)
    sgd = memory_per_rank(
        param_numel=3,
        precision=MEGATRON_BF16,
        shard_factor=2,
        activation_bytes=0,
        buffer_bytes=0,
        optimizer="sgd",
    )
    # 1.5 params: 2 B bf16 params, 4 B fp32 main grads, 4 B master, each rounded up
    assert (sgd.params, sgd.grads, sgd.optimizer) == (3, 6, 6)


def test_memory_frozen_parameters_have_no_grads_or_state():
    """A frozen parameter is held, never differentiated nor stepped."""
    all_trainable = memory_per_rank(
        param_numel=1e6, precision=FP32, shard_factor=1, activation_bytes=0, buffer_bytes=0
    )
    half = memory_per_rank(
        param_numel=1e6, trainable_numel=4e5, precision=FP32, shard_factor=1,
        activation_bytes=0, buffer_bytes=0,
    )  # fmt: skip
    assert half.params == all_trainable.params == 4_000_000
    assert (half.grads, half.optimizer) == (1_600_000, 3_200_000)
    assert all_trainable.total - half.total == 6e5 * (4 + 8)


def test_precision_regime_follows_the_emitted_script():
    """fp32 everywhere; bf16 through FSDP2's MixedPrecisionPolicy exactly where the script uses
    FSDP2 (fsdp > 1, or dp > 1 with TP or a pipeline), else autocast; megatron for the
    published runs."""
    from autopar.planner.plan import Mesh

    assert precision("fp32", Mesh(fsdp=8)) is FP32
    assert precision("bf16", Mesh(fsdp=2)) is FSDP2_BF16
    assert precision("bf16", Mesh(dp=2, tp=2)) is FSDP2_BF16  # HSDP, shard group of one
    assert precision("bf16", Mesh(dp=2, pp=2)) is FSDP2_BF16
    assert precision("bf16", Mesh(dp=8)) is AUTOCAST_BF16  # DDP
    assert precision("bf16", Mesh(tp=8)) is AUTOCAST_BF16
    assert precision("bf16", Mesh(pp=8)) is AUTOCAST_BF16
    assert precision("bf16", Mesh(dp=8), "megatron") is MEGATRON_BF16
    # Megatron replicates TP / pipeline models without FSDP and reduces its main grads in place
    assert not MEGATRON_BF16.wraps_in_fsdp(Mesh(dp=2, tp=2)) and MEGATRON_BF16.bucket == 0
    assert MEGATRON_BF16.wraps_in_fsdp(Mesh(fsdp=2, tp=2))
    assert FSDP2_BF16.wraps_in_fsdp(Mesh(dp=2, tp=2)) and AUTOCAST_BF16.bucket == 4
    # FSDP2 bf16: params gathered in bf16, gradients reduce-scattered in fp32
    assert (FSDP2_BF16.gather, FSDP2_BF16.reduce, FSDP2_BF16.unsharded_grad) == (2, 4, 2)
    # a unit of 1000 trainable params: max(2 gathered + bf16 grads, 1 gathered + bf16 grads +
    # the fp32 reduce-scatter input) = max(4000 + 2000, 2000 + 2000 + 4000)
    assert FSDP2_BF16.fsdp_unit_bytes(1000, 1000) == 8000
    assert FP32.fsdp_unit_bytes(1000, 1000) == 12000
    assert FP32.fsdp_unit_bytes(1000, 0) == 8000  # frozen: gathered, no gradients
    # AdamW step traffic: 28 B with fp32 params; Megatron reads fp32 main grads, writes bf16 too
    assert FP32.adamw_step_bytes == FSDP2_BF16.adamw_step_bytes == 28
    assert MEGATRON_BF16.adamw_step_bytes == 30


def test_uses_fsdp2_is_the_emitted_scripts_rule():
    """The cost model's FSDP2 rule (which precision regime, which buffers) is what the script
    runs: emit states planner.rules.data_parallel (built on it) as DATA_PARALLEL, and the
    runtime wraps in fully_shard exactly where that says "fsdp2", on every mesh of up to 16
    ranks (tests/test_emit_constants.py: the runtime follows DATA_PARALLEL, not the mesh)."""
    from types import SimpleNamespace

    from autopar.codegen.runtime.autopar_runtime import uses_fsdp
    from autopar.planner.rules import data_parallel

    for world in range(1, 17):
        for mesh in enumerate_meshes(world, world, {}):
            constants = SimpleNamespace(DATA_PARALLEL=data_parallel(mesh))
            assert uses_fsdp2(mesh) == uses_fsdp(constants), mesh


def test_replicas_that_fsdp2_holds_pay_fsdp2s_traffic_not_ddps():
    """dp > 1 with tp, pp or ep (fsdp = 1) runs as FSDP2 HSDP with a shard group of one: an
    all-reduce over dp per unit and FSDP2's work per tensor, its parameters all DTensors (the
    optimizer's dispatch); plain dp stays DDP's buckets, and Megatron's replicas too. Measured:
    calibrate's "moe ep" (dp=2, ep=2) went from -47.5% to -1.1% with this rule (README)."""
    from autopar.cost_model.step import dp_traffic_s, holds_dtensor
    from autopar.planner.plan import Mesh

    cluster = parse_cluster("cpu:4")
    device = cluster.device.model_copy(
        update={
            "fsdp_tensor_overhead_s": 1e-4,
            "ddp_comm_scale": 1.5,
            "ddp_tensor_overhead_s": 3e-5,
        }
    )
    cluster = cluster.model_copy(update={"device": device})
    numel, units, tensors = 1e6, 5, 12

    def traffic(mesh, regime=FP32):
        axes = [(a, getattr(mesh, a)) for a in ("pp", "dp", "fsdp", "tp")]
        return dp_traffic_s(cluster, mesh, axes, regime, numel, numel, units, tensors), axes

    for mesh in (Mesh(dp=2, tp=2), Mesh(dp=2, pp=2), Mesh(dp=2, ep=2)):
        got, axes = traffic(mesh)
        link = axis_link(cluster, axes, "dp")
        one = collective_time_s("all_reduce", numel * 4 / units, 2, link)
        assert got == pytest.approx(units * one + tensors * 1e-4), mesh
        assert holds_dtensor("blocks.0.norm", False, fsdp2=FP32.wraps_in_fsdp(mesh), tp=mesh.tp,
                             ep=mesh.ep, styles=())  # fmt: skip
    got, axes = traffic(Mesh(dp=4))  # DDP: one 25 MB bucket holds the 4 MB of gradients
    link = axis_link(cluster, axes, "dp")
    # and DDP's own work per tensor (hooks, bucket copies)
    assert got == pytest.approx(1.5 * collective_time_s("all_reduce", numel * 4, 4, link)
                                + tensors * 3e-5)  # fmt: skip
    assert not holds_dtensor("blocks.0.norm", False, fsdp2=False, tp=1, ep=1, styles=())
    got, axes = traffic(Mesh(dp=2, tp=2), MEGATRON_BF16)  # Megatron: DDP over the replicas
    link = axis_link(cluster, axes, "dp")
    assert got == pytest.approx(1.5 * collective_time_s("all_reduce", numel * 4, 2, link)
                                + tensors * 3e-5)  # fmt: skip


def test_adamw_step_time():
    h100 = device("H100")
    expected = 1e9 * 28 / (3350e9 * h100.memory_efficiency) + 100 * h100.op_overhead_s
    assert adamw_step_time_s(1e9, h100, num_tensors=100) == pytest.approx(expected)
    cpu = device("cpu")
    assert adamw_step_time_s(0, cpu, num_tensors=3) == pytest.approx(30 * cpu.op_overhead_s)


# -- replay: a plan's figures come from its JSON --------------------------------------------------


@pytest.mark.parametrize(
    "cluster, kwargs",
    [
        ("cpu:4", dict(mesh="pp=2", schedule="1f1b", checkpoint="full")),  # pipeline runtime
        # HSDP traffic, per-tensor FSDP overhead, accumulation steps (pinned without a pipeline)
        ("cpu:4", dict(mesh="fsdp=2,dp=2", microbatches=2)),
        ("8xH100", dict(mesh="pp=2,dp=4", dtype="bf16")),  # GPU reserve, DDP buckets, overlap
    ],
)
def test_replaying_a_saved_plan_reproduces_its_figures(monkeypatch, cluster, kwargs):
    """Plan, save to JSON, then on a 'different machine' (os reports other core counts) load
    the plan and replay its cluster and choices through the cost model: the same figures, to
    the bit. A different host_cpus in the cluster does change a cpu pipeline's prediction, so
    the figure reads the plan's machine facts, not the machine it runs on."""
    from autopar.planner.search import replay

    from autopar import Plan
    from autopar.api import _trace_plan_model, plan_model_file
    from autopar.model_file import load_model_file

    gpt = str(Path(__file__).resolve().parent.parent / "examples" / "gpt.py")
    saved = plan_model_file(load_model_file(gpt), cluster, global_batch=8, seq_len=64, **kwargs)
    text = saved.to_json()
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    loaded = Plan.from_json(text)
    graph = _trace_plan_model(loaded, None)
    again = replay(graph, loaded)
    assert again.predicted == loaded.predicted
    assert again.mesh == loaded.mesh
    assert loaded.schedule.num_microbatches == kwargs.get("microbatches", 1) or loaded.mesh.pp > 1
    assert (again.stages, again.schedule, again.checkpointing) == (
        loaded.stages,
        loaded.schedule,
        loaded.checkpointing,
    )
    if loaded.cluster.device.kind == "cpu" and loaded.mesh.pp > 1:
        assert loaded.cluster.device.host_cpus not in (None, 64)  # parsed before the patch
        crowded = loaded.model_copy(
            update={
                "cluster": loaded.cluster.model_copy(
                    update={"device": loaded.cluster.device.model_copy(update={"host_cpus": 1})}
                )
            }
        )
        slower = replay(graph, crowded)
        assert slower.predicted.step_time_s > loaded.predicted.step_time_s
