"""``print(plan)``: the plan's readable summary table, and the row helpers the explanation
shares (sizes, the data-parallel, pipeline, context-, expert-parallel and mixed-cluster rows)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.cost_model import Cluster
from autopar.planner import schedules
from autopar.planner.rules import data_parallel

if TYPE_CHECKING:
    from autopar.planner.plan import Mesh, Plan

__all__ = ["summary", "mixed_rows"]


def _size(num_bytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes:.0f} B"


def _dp_words(mesh: Mesh) -> str:
    if mesh.cp > 1:  # parameters sharded over fsdp x cp (torchtitan's dp_shard_cp)
        shards = f"FSDP2 over fsdp {mesh.fsdp} x cp {mesh.cp} = {mesh.fsdp * mesh.cp} shards"
        return shards if mesh.dp == 1 else f"HSDP: {mesh.dp} replicas x {shards}"
    if mesh.data_parallel == 1:
        return "none"
    if mesh.fsdp == 1:  # DDP; with TP, PP or EP the script replicates with FSDP2 (HSDP)
        if data_parallel(mesh) == "ddp":
            return f"DDP over {mesh.dp} replicas"
        return f"FSDP2 replicated over {mesh.dp}"
    if mesh.dp == 1:
        return f"FSDP2 over {mesh.fsdp} shards"
    return f"HSDP: {mesh.dp} replicas x {mesh.fsdp} shards"


def _cp_axis(mesh: Mesh) -> str:
    return f" cp={mesh.cp}" if mesh.cp > 1 else ""


def _cp_rows(plan: Plan) -> list[tuple[str, str]]:
    """The summary's context-parallel row (cp > 1 only: other plans read as before)."""
    cp = plan.context_parallel
    if plan.mesh.cp == 1 or cp is None:
        return []
    seq = plan.training.seq_len or 0
    return [
        (
            "context parallel",
            f"sequence {seq} split {plan.mesh.cp} ways ({seq // plan.mesh.cp} tokens per rank, "
            f"{cp.load_balance} chunks) from {cp.shard_at}; attention: {cp.form}",
        )
    ]


def _ep_axis(mesh: Mesh) -> str:
    return f" ep={mesh.ep}" if mesh.ep > 1 else ""


def _devices(cluster: Cluster, world: int) -> str:
    """``16 x H100``, or a mixed cluster's groups: ``8 x H100 + 8 x A100-80GB``."""
    if not cluster.groups:
        return f"{world} x {cluster.device.name}"
    return " + ".join(f"{g.devices} x {g.device.name}" for g in cluster.groups)


def mixed_rows(plan: Plan) -> list[tuple[str, str]]:
    """The summary's rows for a cluster of several kinds of nodes: each group's speed, what
    the plan gives it, and what treating the cluster as uniform would predict."""
    mixed = plan.mixed_cluster
    if mixed is None:
        return []
    speeds = ", ".join(
        f"{g.device.name} x{g.devices} at {1 / k:.2f}x, {_size(g.device.memory_bytes)}"
        for g, k in zip(plan.cluster.groups, mixed.group_time_scales, strict=True)
    )
    uses = []
    if mixed.pipeline_groups is not None:
        sizes = [len(stage) for stage in plan.stages]
        per_rank = [0] * plan.mesh.pp
        for j, n in enumerate(sizes):
            per_rank[schedules.stage_rank(plan.schedule.name, plan.mesh.pp, j)] += n
        order = " -> ".join(str(g) for g in dict.fromkeys(mixed.pipeline_groups))
        uses.append(
            f"pipeline over groups {order}: ranks on groups "
            + ", ".join(str(g) for g in mixed.pipeline_groups)
            + " with "
            + ", ".join(str(n) for n in per_rank)
            + " layers, each within its group's memory"
        )
    if mixed.batch_shares is not None:
        uses.append("batch shares " + ", ".join(str(x) for x in mixed.batch_shares))
    rows = [("mixed cluster", f"{speeds}; {'; '.join(uses) or 'every group at the slowest speed'}")]
    if len(mixed.pipeline_orders) > 1:
        ranked = sorted(mixed.pipeline_orders, key=lambda o: (o.step_time_s is None, o.step_time_s))
        words = [
            " -> ".join(map(str, o.groups))
            + (f" {o.step_time_s * 1e3:.3f} ms" if o.step_time_s is not None else " lost")
            for o in ranked[:4]
        ]
        more = f" (+{len(ranked) - 4} more)" if len(ranked) > 4 else ""
        rows.append(("group orders", f"{len(ranked)} tried: " + ", ".join(words) + more))
    if mixed.uniform_step_time_s is None:
        rows.append(
            (
                "treated as uniform",
                "no plan fits (the slowest group's speed and the smallest group's memory "
                "everywhere)",
            )
        )
    else:
        gain = mixed.uniform_step_time_s / max(plan.predicted.step_time_s, 1e-30)
        rows.append(
            (
                "treated as uniform",
                f"{mixed.uniform_step_time_s * 1e3:.3f} ms a step (the slowest group's speed "
                f"everywhere): this plan is {gain:.2f}x that",
            )
        )
    return rows


def _ep_rows(plan: Plan) -> list[tuple[str, str]]:
    """The summary's expert-parallel row (ep > 1 only: other plans read as before)."""
    ep = plan.expert_parallel
    if ep is None:
        return []
    return [
        (
            "expert parallel",
            f"{len(ep.blocks)} MoE blocks, {ep.num_experts // plan.mesh.ep} of {ep.num_experts} "
            f"experts per rank (top-{ep.top_k}); all-to-all {ep.all_to_all_s * 1e3:.3f} ms/step "
            f"at {ep.imbalance:g}x imbalance; expert state {_size(ep.expert_bytes_per_rank)}"
            f"/rank (ep=1: {_size(ep.expert_bytes_at_ep1)})",
        )
    ]


def _pp_words(plan: Plan) -> str:
    if plan.mesh.pp == 1:
        ckpt = sum(1 for v in plan.checkpointing.values() if v == "full")
        return f"none; {ckpt} layers checkpointed" if ckpt else "none"
    s = plan.schedule
    sizes = "/".join(str(len(stage)) for stage in plan.stages)
    ckpt = sum(1 for v in plan.checkpointing.values() if v == "full")
    return (
        f"{s.name}, {s.num_microbatches} microbatches, {len(plan.stages)} stages "
        f"({s.stages_per_rank} per rank; layers {sizes}), {ckpt} layers checkpointed"
    )


def summary(self: Plan) -> str:
    """A readable table: mesh, predicted step time, throughput, memory, planning time."""
    p = self.predicted
    mem = p.memory_breakdown_bytes
    capacity = self.rank_capacity_bytes
    cap, whose = capacity[0], ""
    ranks = self.predicted.rank_memory_bytes
    if len(set(capacity)) > 1 and len(ranks) == len(capacity):  # a mixed cluster's pipeline
        fullest = max(range(len(ranks)), key=lambda r: ranks[r].total)
        cap, whose = capacity[fullest], f" on pipeline rank {fullest}'s group"
    rate = (
        f"{p.tokens_per_s:,.0f} tokens/s" if p.tokens_per_s else f"{p.samples_per_s:,.1f} samples/s"
    )
    n_tp = len(self.tensor_parallel)
    rows = [
        ("model", f"{self.model.file}:{self.model.factory}"),
        ("cluster", f"{self.cluster.spec} ({_devices(self.cluster, self.world_size)})"),
        (
            "mesh",
            f"{self.mesh.short()}  (pp={self.mesh.pp} dp={self.mesh.dp} "
            f"fsdp={self.mesh.fsdp}{_cp_axis(self.mesh)}{_ep_axis(self.mesh)} tp={self.mesh.tp})",
        ),
        ("data parallel", _dp_words(self.mesh)),
        *_cp_rows(self),
        *_ep_rows(self),
        *mixed_rows(self),
        ("tensor parallel", f"{n_tp} modules sharded" if n_tp else "none"),
        ("pipeline", _pp_words(self)),
        ("step time", f"{p.step_time_s * 1e3:.3f} ms (predicted)"),
        ("throughput", f"{rate}, MFU {p.mfu:.1%}"),
        (
            "memory / rank",
            f"{_size(mem.total)} of {_size(cap)}{whose} (params {_size(mem.params)}, grads "
            f"{_size(mem.grads)}, optimizer {_size(mem.optimizer)}, activations "
            f"{_size(mem.activations)}, buffers {_size(mem.buffers)})",
        ),
        ("planning time", f"{self.planning_time_s:.2f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines += [f"note: {note}" for note in self.notes]
    if self.batch_coupling is not None:
        lines += [f"warning: {line}" for line in self.batch_coupling.warnings]
    if self.alternatives:
        shown = self.alternatives[:5]
        meshes = [a.mesh.short() for a in shown]
        steps = [f"{a.step_time_s * 1e3:.3f} ms" if a.step_time_s else "-" for a in shown]
        w_mesh = max(len(x) for x in [*meshes, "alternative"])
        w_step = max(len(x) for x in [*steps, "step"])
        lines.append(f"{'alternative':<{w_mesh}}  {'step':>{w_step}}  why it lost")
        for a, mesh_text, step in zip(shown, meshes, steps):
            lines.append(f"{mesh_text:<{w_mesh}}  {step:>{w_step}}  {a.why}")
        if len(self.alternatives) > len(shown):
            lines.append(f"(+{len(self.alternatives) - len(shown)} more: plan ... --explain)")
    return "\n".join(lines)
