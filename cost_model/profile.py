"""Profiling: microbenchmarks under torchrun (:mod:`cost_model.profile_bench`), their
least-squares fit (:mod:`cost_model.profile_fit`), the versioned profile JSON
(:mod:`cost_model.profile_data`); this module runs them and re-exports their public names.

    plan profile --cluster cpu:2 --out profile.json [--quick]
    python -m autopar.cost_model.profile --cluster cpu:2 --out profile.json [--quick]

``main`` launches ``torchrun --standalone --nproc-per-node N`` on this module's worker (gloo on
CPU; nccl and one GPU per rank on a GPU node: one node is profiled, ``devices_per_node`` ranks).
Every rank runs every benchmark at the same time, so a CPU cluster with more processes than cores
is measured oversubscribed, as its training runs will be. The worker times (median of repeats,
averaged over the ranks; the reference block's ``train_step`` paced instead: every repeat starts
on all ranks together and counts as long as its slowest rank took, as a step that ends in a
collective does):

- ``matmul``: ``torch.mm`` over square and transformer-like shapes, fp32 and bf16;
- ``elementwise``: ``torch.add(x, y, out=z)`` from 4 KB to 64 MB (memory-bound);
- ``sdpa``: ``scaled_dot_product_attention`` forward over sequence lengths and head dims;
- ``eager_op``: one tiny ``add`` (the framework's dispatch floor);
- ``train_step``: forward + backward + AdamW of a tiny residual MLP at two depths, plain and with
  its linears tensor-parallel (``ColwiseParallel`` / ``RowwiseParallel``) on a 1-rank TP mesh
  (DTensor dispatch without communication), and its forward + backward tensor-parallel over
  every rank (with its collectives);
- collectives ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all`` over every group
  size > 1 dividing the world (groups of consecutive ranks, all groups at once) and ``send_recv``
  between rank pairs, 1 KB .. 256 MB of full tensor (the ``num_bytes`` that
  :func:`cost_model.estimate.collective_time_s` takes), fp32.

The parent fits (:mod:`cost_model.fit`, relative least squares, parameters >= 0):

- matmul per dtype and sdpa: ``t = overhead + flops / flops_per_s``;
- memory: ``t = overhead + bytes / bytes_per_s``;
- per-op overhead as the planner counts ops: the step time of the MLP against
  ``3 * (compute nodes of its traced graph) + 10 * (parameter tensors)`` (the ILP charges three
  ops per forward node, forward and backward; torch's for-loop AdamW ten per tensor), over the two
  depths; then ``compute_scale``, the per-op overhead of a transformer's ops and the per-row
  cost of narrow rows together from the reference block's forward + backward at two depths,
  at its width, at a narrow width and at that width with one sample, ``t = compute_scale *
  roofline + op_overhead_s * ops + op_row_s * rows + c`` (``profile_fit._fit_compute_scale``;
  the block's per-op cost replaces the MLP's, whose Linear and ReLU cost less per op than
  layer norms, attention and views); the DTensor overhead likewise against
  ``15 * (styled linear calls)`` (the ILP's count
  per styled call) from the TP'd minus the plain step; what each TP collective costs beyond
  its fitted time (``tp_collective_overhead_s``) from the TP over every rank minus the one-rank
  TP, its all-reduces taken out, per all-reduce (the slope over the depths);
- per collective kind and group size: ``t = alpha + bytes / beta``; per link class, the ring
  model the planner uses, ``t = latency * steps(kind, n) + factor(kind, n) * bytes / busbw``
  over every kind and size, and per kind the ratio of its measured time to that ring figure.

The profile keeps the raw samples, the fitted parameters and the fit residuals; ``load_profile``
validates it and checks ``version``; ``apply_profile`` returns a Cluster with the fitted
DeviceSpec and Links. Quick sweep on 2 CPU processes: 10-25 s measured; the full sweep (up to
256 MB collectives, 1024^2 matmuls on CPU) has not been timed yet (estimated a few minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from autopar.cost_model.profile_bench import (
    _worker_main,
    group_sizes,
    reference_block,
    tiny_mlp,
)
from autopar.cost_model.profile_data import (
    PROFILE_VERSION,
    CollectiveFit,
    Fit,
    Fits,
    OverheadFit,
    Profile,
    ProfileError,
    Sample,
    apply_profile,
    datasheet_profile,
    load_profile,
    parse_profile,
)
from autopar.cost_model.profile_fit import build_profile, fit_samples
from autopar.cost_model.spec import Cluster, ClusterSpecError

__all__ = [
    "PROFILE_VERSION",
    "CollectiveFit",
    "Fit",
    "Fits",
    "HostLoad",
    "OverheadFit",
    "Profile",
    "ProfileError",
    "Sample",
    "apply_profile",
    "build_profile",
    "datasheet_profile",
    "fit_samples",
    "group_sizes",
    "load_profile",
    "main",
    "parse_profile",
    "reference_block",
    "run_profile",
    "tiny_mlp",
]


class HostLoad:
    """The host's CPU spent on other work than this process and its children over a ``with``
    block, in cores averaged over the block's wall time (``other_cores``; None where the
    kernel's counters cannot be read, e.g. off Linux). The host's busy time comes from
    ``/proc/stat`` (every CPU's user, nice, system, irq, softirq and steal time), this process's
    own from ``getrusage``: itself and its children waited for (torchrun waits for its workers,
    so a profile's ranks count as its own)."""

    def __init__(self) -> None:
        self.other_cores: float | None = None

    def __enter__(self) -> HostLoad:
        self._start = (_host_busy_s(), _own_cpu_s(), time.perf_counter())
        return self

    def __exit__(self, *exc) -> None:
        busy0, own0, t0 = self._start
        busy1, own1, t1 = _host_busy_s(), _own_cpu_s(), time.perf_counter()
        if busy0 is not None and busy1 is not None and t1 > t0:
            self.other_cores = max(0.0, (busy1 - busy0) - (own1 - own0)) / (t1 - t0)


def _host_busy_s() -> float | None:
    """Seconds every CPU of the host has spent busy since boot (``/proc/stat``), or None."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 8:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, *rest = (int(x) for x in fields[1:])
    steal = rest[0] if rest else 0
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds of this process and of its children waited for."""
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def run_profile(cluster_spec: str, *, quick: bool = False, timeout_s: float = 1800) -> Profile:
    """Profile ``cluster_spec`` (one node: ``devices_per_node`` ranks under torchrun). The
    profile records how busy the host was with other work meanwhile (``host_busy_cores``)."""
    from autopar.cost_model.cluster import parse_cluster

    cluster = parse_cluster(cluster_spec)
    nproc = cluster.devices_per_node
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="autopar-profile-") as tmp:
        out = Path(tmp) / "samples.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "autopar.cost_model.profile",
            "--worker",
            str(out),
        ] + (["--quick"] if quick else [])
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "DIST_TIMEOUT_S": "300"}
        if cluster.device.kind == "cpu":
            env.setdefault("OMP_NUM_THREADS", "1")
        with HostLoad() as load:
            proc = subprocess.run(
                cmd, stdout=subprocess.PIPE, stderr=None, text=True, timeout=timeout_s, env=env
            )
        if proc.returncode != 0 or not out.exists():
            raise ProfileError(
                f"profiling {cluster_spec} failed (torchrun exit {proc.returncode}): see the "
                "messages above"
            )
        raw = json.loads(out.read_text())
    profile = build_profile(raw, cluster, quick=quick, elapsed_s=time.perf_counter() - start)
    return profile.model_copy(update={"host_busy_cores": load.other_cores})


def main(argv: list[str] | None = None) -> int:
    """``plan profile --cluster SPEC --out profile.json [--quick]``; exit 0, or 2 with one
    ``error:`` line."""
    p = argparse.ArgumentParser(prog="plan profile", description="Profile a cluster's devices.")
    p.add_argument("--cluster", default=None, help="cpu:N, or a GPU node such as 8xH100")
    p.add_argument("--out", default=None, help="where to write the profile JSON")
    p.add_argument("--quick", action="store_true", help="a reduced sweep (~1 min on cpu:2)")
    p.add_argument("--datasheet", action="store_true", help="write the datasheet profile")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return _worker_main(args.worker, args.quick)
    try:
        if not args.cluster or not args.out:
            raise ProfileError("plan profile needs --cluster SPEC and --out FILE.json")
        from autopar.cost_model.cluster import parse_cluster

        cluster = parse_cluster(args.cluster)
        if args.datasheet:
            profile = datasheet_profile(cluster.device.name)
        else:
            if cluster.device.kind == "gpu":
                _require_gpus(cluster)
            profile = run_profile(args.cluster, quick=args.quick)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(profile.model_dump_json(indent=1))
        tmp.replace(out)
    except (ProfileError, ClusterSpecError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(profile.summary(), file=sys.stderr)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _require_gpus(cluster: Cluster) -> None:
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < cluster.devices_per_node:
        raise ProfileError(
            f"--cluster {cluster.spec} needs {cluster.devices_per_node} GPUs on this node, found "
            f"{have}: profile on a node of the cluster, or use --datasheet"
        )


if __name__ == "__main__":
    sys.exit(main())
