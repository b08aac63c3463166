"""The Python API: ``auto_parallelize(model, cluster, ...) -> Plan``, ``plan_model_file``,
``why_not``. Each reads the front end (build on meta, example inputs, checks, trace, cuts) from a
:class:`autopar.session.PlanningSession` and runs one search on it."""

from __future__ import annotations

import time
from typing import Literal

from torch import nn

from autopar._plan import Plan
from autopar.collect import full_collections_deferred
from autopar.cost_model import Cluster, parse_cluster
from autopar.ir import Graph
from autopar.ir.coupling import graph_coupling
from autopar.model_file import DEFAULT_FACTORY, ModelFile
from autopar.planner.explain import WhyNot
from autopar.planner.explain import why_not as _why_not_diff
from autopar.planner.plan import ModelRef, Training, is_fqn
from autopar.planner.request import batch_coupling_rule, check_training
from autopar.planner.search import (
    NothingFitsError,
    Options,
    PlanningError,
    parse_mesh,
    search,
    static_floor_bytes,
)
from autopar.planner.stages import Cuts
from autopar.session import (
    TRACE_BATCH,
    Front,
    PlanningSession,
    Progress,
    ScriptModelError,
    check_importable,
    check_trainable,
    model_ref,
    on_model_device,
    saved_for_of,
    token_ids,
    trace,
)

__all__ = [
    "PlanningSession",
    "ScriptModelError",
    "TRACE_BATCH",
    "auto_parallelize",
    "check_trainable",
    "plan_model_file",
    "trace",
    "what_would_fit",
    "why_not",
]


@full_collections_deferred()
def auto_parallelize(
    model: nn.Module,
    cluster: Cluster | str,
    *,
    global_batch: int,
    seq_len: int | None = None,
    dtype: Literal["fp32", "bf16"] = "fp32",
    mesh: dict[str, int] | str | None = None,
    example_inputs: tuple | dict | None = None,
    model_file: str | None = None,
    factory: str = DEFAULT_FACTORY,
    optimizer: Literal["adamw", "sgd"] = "adamw",
    schedule: str | None = None,
    microbatches: int | None = None,
    checkpoint: Literal["auto", "none", "full"] = "auto",
    progress: Progress | None = None,
    session: PlanningSession | None = None,
) -> Plan:
    """Plan how to train ``model`` on ``cluster``.

    ``model`` may live on meta (no weights allocated) or hold real weights; ``example_inputs`` are
    its forward args (a tuple, or one tensor) or keyword args (a dict) at any batch size, needed
    unless the model takes token ids (then ``seq_len`` suffices): real tensors for a model on
    meta are moved to meta (only shapes and dtypes count). A model whose class is defined in
    the running script (``__main__``) raises ScriptModelError: the emitted script would import
    that script again on every rank. ``mesh`` pins axes (``{"tp": 2}`` or ``"tp=2"``); the rest is
    searched; ``schedule`` / ``microbatches`` pin the pipeline schedule and microbatch count
    (when pp > 1), ``checkpoint`` forces activation checkpointing on every layer ("full"), off
    ("none"), or lets the planner choose per layer ("auto"). ``model_file`` is the file the
    emitted script imports (default: the file defining the model's class, which must define
    ``factory``). ``progress`` is called with status lines while tracing and searching;
    ``session`` keeps the traced graph for ``why_not`` and later plans.

    The plan explains itself (``plan.explain()``, ``plan.why_not("tp=2")``), draws a report
    (``plan.report("plan.html")``), writes the script (``plan.emit(dir)``) and, under torchrun,
    parallelizes a model in-process (``plan.apply(model)``).
    """
    start = time.perf_counter()
    training = check_training(global_batch, seq_len, dtype, optimizer)  # the CLI's own check
    cluster = parse_cluster(cluster) if isinstance(cluster, str) else cluster
    pins = parse_mesh(mesh) if isinstance(mesh, str) else dict(mesh or {})
    check_trainable(model, model_file)
    check_importable(model, model_file)
    if example_inputs is None:
        example_inputs = token_ids(model, seq_len)
    inputs = on_model_device(model, example_inputs)
    ref = model_ref(model, model_file, factory)
    session = session if session is not None else PlanningSession()
    front = session.front_of_module(
        model, inputs, ref, seq_len, dtype, saved_for_of(cluster), progress
    )
    options = Options(schedule=schedule, microbatches=microbatches, checkpoint=checkpoint)
    return _search(front, cluster, training, pins, options, start, progress)


@full_collections_deferred()
def plan_model_file(
    mf: ModelFile | str,
    cluster: Cluster | str,
    *,
    global_batch: int,
    seq_len: int | None = None,
    dtype: Literal["fp32", "bf16"] = "fp32",
    mesh: dict[str, int] | str | None = None,
    optimizer: Literal["adamw", "sgd"] = "adamw",
    schedule: str | None = None,
    microbatches: int | None = None,
    checkpoint: Literal["auto", "none", "full"] = "auto",
    progress: Progress | None = None,
    session: PlanningSession | None = None,
    sync_batchnorm: bool = False,
) -> Plan:
    """Plan a model file (what the ``plan`` CLI does): ``mf`` loaded, or its spec
    (``path.py[:factory]``, ``hf:...``), which a session with a plan cache may not need to
    import at all. Built on meta, never allocated. ``sync_batchnorm`` (--sync-batchnorm): the
    program syncs batch norms' statistics over the data-parallel ranks; the plan's
    ``batch_coupling`` says what couples the batch."""
    start = time.perf_counter()
    training = check_training(global_batch, seq_len, dtype, optimizer)  # the CLI's own check
    cluster = parse_cluster(cluster) if isinstance(cluster, str) else cluster
    pins = parse_mesh(mesh) if isinstance(mesh, str) else dict(mesh or {})
    session = session if session is not None else PlanningSession()
    front = session.front(mf, seq_len, dtype, saved_for_of(cluster), progress)
    options = Options(schedule=schedule, microbatches=microbatches, checkpoint=checkpoint)
    try:
        return _search(front, cluster, training, pins, options, start, progress, sync_batchnorm)
    finally:
        session.keep_answers(front)


@full_collections_deferred()
def why_not(
    plan: Plan,
    mesh: dict[str, int] | str,
    *,
    session: PlanningSession | None = None,
    progress: Progress | None = None,
) -> WhyNot:
    """Search again with ``mesh`` pinned (e.g. ``"tp=8,pp=2"``; the other axes stay free, with
    default schedule/microbatch/checkpoint options) on the plan's own cluster and training, and
    diff the result against ``plan``. A fresh plan and the same plan loaded from JSON answer
    alike: the model file is traced again (imported), unless ``session`` already holds its
    graph (or its plan cache does). Pins that admit no plan are a verdict, not an error; pins
    that do not parse raise PlanningError."""
    pins = parse_mesh(mesh) if isinstance(mesh, str) else dict(mesh)
    text = ",".join(f"{k}={v}" for k, v in pins.items())
    if not pins:
        raise PlanningError("--why-not needs at least one axis, e.g. --why-not tp=2")
    session = session if session is not None else PlanningSession()
    front = session.front_of_plan(plan, progress)
    try:
        pins = front.pins(pins)  # the rules `plan` applies before any search
    except PlanningError as e:
        return _why_not_diff(plan, text, None, str(e))
    if progress is not None:
        progress(f"why not {text}: searching with those pins")
    try:
        forced = search(
            front.graph, plan.cluster, plan.training, model=plan.model, pins=pins,
            options=Options(), progress=progress, cuts=front.cuts, optima=front.optima,
        )  # fmt: skip
    except PlanningError as e:
        return _why_not_diff(plan, text, None, str(e))
    finally:
        session.keep_answers(front)
    return _why_not_diff(plan, text, forced)


def _trace_plan_model(plan: Plan, progress: Progress | None) -> Graph:
    """The graph of the plan's model file (or HF config), built and traced on meta."""
    return PlanningSession().front_of_plan(plan, progress).graph


def _search(
    front: Front,
    cluster: Cluster,
    training: Training,
    pins: dict[str, int],
    options: Options,
    start: float,
    progress: Progress | None = None,
    sync_batchnorm: bool = False,
) -> Plan:
    """The search, and the plan's answer to the batch couplings: the graph's and the
    loss_fn's (``front``), and ``sync_batchnorm`` (--sync-batchnorm)."""
    graph, ref = front.graph, front.ref
    bad = next((fqn for fqn in graph.modules if not is_fqn(fqn)), None)
    if bad is not None:
        raise PlanningError(
            f"module {bad!r} has a name a plan cannot hold (module names must be letters, "
            "digits, '_' or '-'): rename that submodule (e.g. the ModuleDict key)"
        )
    pins = front.pins(pins)
    # where the script can cut the model (autopar._cuts): decided once, before the one search
    cuts = front.cuts if pins.get("pp") != 1 else None
    try:
        plan = search(
            graph, cluster, training, model=ref, pins=pins, options=options, progress=progress,
            cuts=cuts, optima=front.optima,
        )  # fmt: skip
    except NothingFitsError as e:
        if progress is not None:
            progress("nothing fits: looking for a cluster or batch that does")
        hint = what_would_fit(graph, cluster, training, ref, pins, options, cuts)
        raise NothingFitsError(f"{e}; {hint}", e.overflow_bytes) from None
    answer = batch_coupling_rule(
        graph_coupling(graph) + front.loss_couplings, plan.mesh, plan.schedule, plan.training,
        sync_batchnorm, front.loss_gathers,
    )  # fmt: skip
    update = {
        "planning_time_s": time.perf_counter() - start,
        "batch_coupling": answer,
    }
    return plan.model_copy(update=update)


def what_would_fit(
    graph: Graph,
    cluster: Cluster,
    training: Training,
    ref: ModelRef,
    pins: dict[str, int],
    options: Options | None = None,
    cuts: Cuts | None = None,
) -> str:
    """What would fit when nothing does: the fewest devices of this type (nodes doubled), and
    the largest global batch on this cluster (halved)."""
    hints = []
    if cluster.device.kind == "gpu":
        for bigger in _bigger_clusters(cluster):
            floor = static_floor_bytes(graph, training, bigger.world_size)
            if floor > bigger.device.memory_bytes:
                continue
            if _fits(graph, bigger, training, ref, pins, options, cuts):
                what = "devices" if cluster.heterogeneous else f"x {cluster.device.name}"
                hints.append(f"it fits on {bigger.world_size} {what} (--cluster {bigger.spec})")
                break
    batch = training.global_batch // 2
    floor = static_floor_bytes(graph, training, cluster.world_size)
    while batch >= 1 and floor <= cluster.device.memory_bytes:
        smaller = training.model_copy(update={"global_batch": batch})
        if _fits(graph, cluster, smaller, ref, pins, options, cuts):
            hints.append(f"on {cluster.spec} a global batch of {batch} fits (--global-batch "
                         f"{batch})")  # fmt: skip
            break
        batch //= 2
    if floor > cluster.device.memory_bytes:
        hints.append(
            f"no global batch fits on {cluster.spec}: parameters, gradients and optimizer state "
            f"alone need {floor / 1e9:.1f} GB per device even sharded over all "
            f"{cluster.world_size}"
        )
    return "; ".join(hints) or "no larger cluster (up to 1024 nodes) or smaller batch fits"


def _bigger_clusters(cluster: Cluster):
    if cluster.heterogeneous:  # every group's nodes doubled: the same mix, twice the size
        k = 2
        while cluster.num_nodes * k <= 1024:
            groups = tuple(
                g.model_copy(update={"num_nodes": g.num_nodes * k, "devices": g.devices * k})
                for g in cluster.groups
            )
            spec = "+".join(
                f"{g.num_nodes}x{cluster.devices_per_node}x{g.device.name}" for g in groups
            )
            yield Cluster.model_validate(
                cluster.model_dump() | {"num_nodes": cluster.num_nodes * k, "groups": groups,
                                        "spec": spec}
            )  # fmt: skip
            k *= 2
        return
    per_node = cluster.devices_per_node
    name = cluster.device.name
    if cluster.num_nodes == 1 and per_node < 8:
        for n in (2, 4, 8):
            if n > per_node:
                yield cluster.model_copy(update={"devices_per_node": n, "spec": f"{n}x{name}"})
        per_node = 8
    nodes = max(1, cluster.num_nodes)
    while nodes < 1024:
        nodes *= 2
        yield cluster.model_copy(
            update={
                "num_nodes": nodes,
                "devices_per_node": per_node,
                "spec": f"{nodes}x{per_node}x{name}",
            }  # fmt: skip
        )


def _fits(graph, cluster, training, ref, pins, options, cuts=None) -> bool:
    try:
        search(graph, cluster, training, model=ref, pins=pins, options=options, cuts=cuts)
    except PlanningError:
        return False
    return True
