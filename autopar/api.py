"""The Python API: ``auto_parallelize(model, cluster, ...) -> Plan``."""

from __future__ import annotations

import inspect
import os
import sys
import time
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from autopar._cuts import cuts as pipeline_cuts
from autopar._plan import Plan
from autopar.cost_model import Cluster, parse_cluster
from autopar.hf import masks_as_in_eager
from autopar.hf import pipeline_refusal as hf_pipeline_refusal
from autopar.hf import position_tables as hf_position_tables
from autopar.ir import Graph
from autopar.ir.coupling import Coupling, graph_coupling, loss_coupling, takes_gather
from autopar.ir.trace import trace as _trace_graph
from autopar.model_file import (
    DEFAULT_FACTORY,
    ModelFile,
    ModelFileError,
    build_on_meta,
    call_args,
    example_inputs,
    is_flat,
    resolve_model_spec,
    too_deep,
)
from autopar.planner.explain import WhyNot
from autopar.planner.explain import why_not as _why_not_diff
from autopar.planner.plan import NO_FILE, ModelRef, Training, is_fqn
from autopar.planner.request import batch_coupling_rule, check_training, position_rule
from autopar.planner.search import (
    NothingFitsError,
    Options,
    PlanningError,
    parse_mesh,
    search,
    static_floor_bytes,
)
from autopar.planner.stages import Cuts

# The planner traces a small batch and scales per-sample costs to the real one; 2 keeps the batch
# dim distinguishable from size-1 broadcast dims (and BatchNorm happy in training mode).
TRACE_BATCH = 2

Progress = Callable[[str], None]
"""Called with a short status line as planning proceeds (the CLI draws it on a terminal)."""


class PlanningSession:
    """Traced graphs a caller keeps across planning calls. Pass one to ``auto_parallelize`` /
    ``plan_model_file`` and to ``why_not``: a why-not question on a plan of the same model,
    fresh or loaded from JSON, then reuses the traced graph instead of re-tracing the model
    file. Without one, ``why_not`` re-traces; either way it answers the same. Plans stay data
    (equal after a JSON round trip); the graph lives here, as long as the caller holds it."""

    def __init__(self) -> None:
        self._graphs: dict[tuple, Graph] = {}

    @staticmethod
    def _key(plan: Plan) -> tuple:
        t = plan.training
        return (plan.model.model_dump_json(), t.seq_len, t.dtype, plan.cluster.device.kind)

    def remember(self, plan: Plan, graph: Graph) -> None:
        self._graphs[self._key(plan)] = graph

    def graph(self, plan: Plan) -> Graph | None:
        """The graph ``plan`` was searched on, if this session traced it."""
        graph = self._graphs.get(self._key(plan))
        if graph is None or [layer.fqn for layer in graph.layers] != plan.layers:
            return None
        return graph


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
    ``factory``). ``progress`` is called with status lines while tracing and searching.

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
    check_hf_positions(model, seq_len)
    if example_inputs is None:
        example_inputs = _token_ids(model, seq_len)
    example_inputs = _on_model_device(model, example_inputs)
    pins = pipeline_pins(example_inputs, pins)
    if progress is not None:
        progress("tracing the model on meta")
    args, kwargs = call_args(example_inputs)
    graph = trace(model, args, kwargs, seq_len=seq_len, **_trace_options(cluster, dtype))
    if model_file is not None and model_file.startswith("hf:"):  # an HF config (autopar.hf)
        file, hf_factory = resolve_model_spec(model_file)
        ref = ModelRef(file=file, factory=hf_factory)
    else:
        file = os.path.abspath(model_file) if model_file else _defining_file(model)
        ref = ModelRef(file=file, factory=factory)
    options = Options(schedule=schedule, microbatches=microbatches, checkpoint=checkpoint)
    return _search(graph, cluster, training, ref, pins, options, start, progress, session)


def plan_model_file(
    mf: ModelFile,
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
    """Plan a loaded model file (what the ``plan`` CLI does): built on meta, never allocated.
    ``sync_batchnorm`` (--sync-batchnorm): the program syncs batch norms' statistics over the
    data-parallel ranks; the plan's ``batch_coupling`` says what couples the batch."""
    start = time.perf_counter()
    training = check_training(global_batch, seq_len, dtype, optimizer)  # the CLI's own check
    cluster = parse_cluster(cluster) if isinstance(cluster, str) else cluster
    pins = parse_mesh(mesh) if isinstance(mesh, str) else dict(mesh or {})
    if progress is not None:
        progress("building and tracing the model on meta")
    model = build_on_meta(mf)
    check_trainable(model, mf.path)
    check_hf_positions(model, seq_len)
    inputs, _ = example_inputs(mf, model, _trace_batch(seq_len), seq_len)
    pins = pipeline_pins(inputs, pins, mf.path, hf_pipeline_refusal(mf))
    try:
        graph = trace(model, *call_args(inputs), seq_len=seq_len, **_trace_options(cluster, dtype))
    except RecursionError:
        raise too_deep(mf.path) from None
    check_loss_fn(graph, mf)
    ref = ModelRef(file=mf.path, factory=mf.factory)
    options = Options(schedule=schedule, microbatches=microbatches, checkpoint=checkpoint)
    coupling = (_loss_coupling(mf, model, seq_len), sync_batchnorm, takes_gather(mf.loss_fn))
    return _search(graph, cluster, training, ref, pins, options, start, progress, session, coupling)


def _loss_coupling(mf: ModelFile, model: nn.Module, seq_len: int | None) -> tuple[Coupling, ...]:
    """The batch couplings of the file's loss_fn (``ir.loss_coupling``), run on meta at a batch
    of 7 samples (11 where the sequence is 7 long: the batch dim must be told apart). The
    default losses (cross-entropy, MSE) are means over samples, and an HF model's is the
    token cross-entropy: nothing to find. A forward that does not run eagerly on meta (a
    data-dependent shape, such as a MoE's per-expert token count), or a loss that reads values
    (.item()), leaves the loss unread."""
    if mf.loss_fn is None or not mf.path.endswith(".py"):  # an hf: config
        return ()
    batch = 11 if seq_len == 7 else 7
    try:
        inputs, target = example_inputs(mf, model, batch, seq_len)
        args, kwargs = call_args(inputs)
        with torch.no_grad():
            output = model(*args, **kwargs)
    except Exception:  # noqa: BLE001 (the trace ran this forward; only eager meta failed)
        return ()
    try:
        return loss_coupling(mf.loss_fn, output, target, batch)
    except Exception:  # noqa: BLE001 (a loss reading values, e.g. logging .item(), on meta)
        return ()


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
    alike: the model file is re-traced (imported), unless ``session`` already holds its graph.
    Pins that admit no plan are a verdict, not an error; pins that do not parse raise
    PlanningError."""
    pins = parse_mesh(mesh) if isinstance(mesh, str) else dict(mesh)
    text = ",".join(f"{k}={v}" for k, v in pins.items())
    if not pins:
        raise PlanningError("--why-not needs at least one axis, e.g. --why-not tp=2")
    if pins.get("pp", 1) > 1:  # the rules `plan` applies before any search (pipeline_pins)
        try:
            _plan_model_pipeline_pins(plan, pins)
        except PlanningError as e:
            return _why_not_diff(plan, text, None, str(e))
    graph = session.graph(plan) if session is not None else None
    if graph is None:
        graph = _trace_plan_model(plan, progress)
        if session is not None:
            session.remember(plan, graph)
    if progress is not None:
        progress(f"why not {text}: searching with those pins")
    try:
        forced = search(
            graph, plan.cluster, plan.training, model=plan.model, pins=pins, options=Options(),
            progress=progress, cuts=pipeline_cuts(graph),
        )  # fmt: skip
    except PlanningError as e:
        return _why_not_diff(plan, text, None, str(e))
    return _why_not_diff(plan, text, forced)


def _plan_model_file(plan: Plan):
    from autopar.model_file import load_model_file

    ref = plan.model
    if not ref.has_file:
        raise PlanningError(
            f"the plan's model has no file ({ref.file}), so it cannot be traced again: pass "
            "session= (the PlanningSession it was planned with, which holds its graph), or plan "
            "it from a model file (model_file='model.py')"
        )
    return load_model_file(ref.file if ref.file.startswith("hf:") else f"{ref.file}:{ref.factory}")


def _plan_model_pipeline_pins(plan: Plan, pins: dict[str, int]) -> dict[str, int]:
    """:func:`pipeline_pins` for the plan's model file (built on meta, not traced)."""
    mf = _plan_model_file(plan)
    t = plan.training
    inputs, _ = example_inputs(mf, build_on_meta(mf), _trace_batch(t.seq_len), t.seq_len)
    return pipeline_pins(inputs, pins, mf.path, hf_pipeline_refusal(mf))


def _trace_plan_model(plan: Plan, progress: Progress | None) -> Graph:
    """The graph of the plan's model file (or HF config), built and traced on meta."""
    if progress is not None:
        progress("building and tracing the model on meta")
    mf = _plan_model_file(plan)
    t = plan.training
    model = build_on_meta(mf)
    inputs, _ = example_inputs(mf, model, _trace_batch(t.seq_len), t.seq_len)
    args, kwargs = call_args(inputs)
    return trace(model, args, kwargs, seq_len=t.seq_len, **_trace_options(plan.cluster, t.dtype))


def _search(
    graph: Graph,
    cluster: Cluster,
    training: Training,
    ref: ModelRef,
    pins: dict[str, int],
    options: Options,
    start: float,
    progress: Progress | None = None,
    session: PlanningSession | None = None,
    coupling: tuple[tuple[Coupling, ...], bool, bool] = ((), False, False),
) -> Plan:
    """The search, and the plan's answer to the batch couplings: the graph's, plus
    ``coupling`` = (the loss_fn's couplings, --sync-batchnorm, whether loss_fn takes gather)."""
    bad = next((fqn for fqn in graph.modules if not is_fqn(fqn)), None)
    if bad is not None:
        raise PlanningError(
            f"module {bad!r} has a name a plan cannot hold (module names must be letters, "
            "digits, '_' or '-'): rename that submodule (e.g. the ModuleDict key)"
        )

    # where the script can cut the model (autopar._cuts): decided once, before the one search
    cuts = pipeline_cuts(graph) if pins.get("pp") != 1 else None
    try:
        plan = search(
            graph, cluster, training, model=ref, pins=pins, options=options, progress=progress,
            cuts=cuts,
        )  # fmt: skip
    except NothingFitsError as e:
        if progress is not None:
            progress("nothing fits: looking for a cluster or batch that does")
        hint = what_would_fit(graph, cluster, training, ref, pins, options, cuts)
        raise NothingFitsError(f"{e}; {hint}", e.overflow_bytes) from None
    loss_couplings, sync_batchnorm, loss_gathers = coupling
    answer = batch_coupling_rule(
        graph_coupling(graph) + loss_couplings, plan.mesh, plan.schedule, plan.training,
        sync_batchnorm, loss_gathers,
    )  # fmt: skip
    update = {"planning_time_s": time.perf_counter() - start, "batch_coupling": answer}
    plan = Plan.of(plan.model_copy(update=update))
    if session is not None:
        session.remember(plan, graph)
    return plan


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
                hints.append(f"it fits on {bigger.world_size} x {cluster.device.name} "
                             f"(--cluster {bigger.spec})")  # fmt: skip
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


def check_trainable(model: nn.Module, where: str | None = None) -> None:
    """A model to train must have a parameter that takes gradients."""
    if any(p.requires_grad for p in model.parameters()):
        return
    what = f"the model of {where!r}" if where else f"model {type(model).__name__}"
    has = "no parameters" if next(model.parameters(), None) is None else "only frozen parameters"
    raise PlanningError(
        f"{what} has {has} (requires_grad=False everywhere): there is nothing to train, so "
        "nothing to parallelize; give a model with trainable parameters"
    )


def check_hf_positions(model: nn.Module, seq_len: int | None) -> None:
    """An HF model's position table (:func:`autopar.hf.position_tables`) must hold ``seq_len``
    tokens; checked before the trace, which for BERT fails past the table with a message about
    a buffer. Tables the trace finds are checked by the search (``planner.request``)."""
    why = position_rule(hf_position_tables(model), seq_len)
    if why is not None:
        raise PlanningError(why)


def pipeline_pins(
    inputs, pins: dict[str, int], where: str | None = None, refusal: str | None = None
) -> dict[str, int]:
    """``pins`` with pp=1 where the forward's inputs are not positional tensors alone (a dict,
    keyword inputs, a nested list): a pipeline stage receives and sends tensors only; or where
    the model file says why it cannot be pipelined (``refusal``, e.g.
    :func:`autopar.hf.pipeline_refusal`). Pinning pp > 1 for such a model is one error line."""
    if refusal is not None:
        if pins.get("pp", 1) > 1:
            raise PlanningError(f"pp={pins['pp']}: {refusal}")
        return {**pins, "pp": 1}
    if is_flat(inputs):
        return pins
    if pins.get("pp", 1) > 1:
        if isinstance(inputs, dict):
            what = f"keyword inputs ({', '.join(inputs)})"
        else:
            kinds = [type(x).__name__ for x in inputs if not isinstance(x, torch.Tensor)]
            what = f"a {kinds[0]} argument"
        raise PlanningError(
            f"pp={pins['pp']}: the model{f' of {where!r}' if where else ''} takes {what}, "
            "and pipeline stages pass tensors only: plan without pipeline "
            "parallelism (--mesh pp=1), or make the forward take tensors as positional arguments"
        )
    return {**pins, "pp": 1}


def check_loss_fn(graph: Graph, mf: ModelFile) -> None:
    """A forward that returns several tensors (a dict, (logits, aux_loss)) needs the model
    file's loss_fn: the default loss takes one tensor."""
    output = next((n for n in graph.nodes if n.kind == "output"), None)
    tensors = 0 if output is None else sum(o is not None for o in output.outputs)
    if mf.loss_fn is None and tensors > 1:
        raise ModelFileError(
            f"the model of {mf.path!r} returns {tensors} tensors (a dict or tuple) and the file "
            "defines no loss_fn: define loss_fn(output, target), which gets the output as the "
            "forward returns it"
        )


def _on_model_device(model: nn.Module, inputs):
    """Example inputs on the model's device: real tensors given for a model on meta (the usual
    call: a model built under torch.device("meta"), inputs from a real batch) go to meta, where
    only their shapes and dtypes matter."""
    from torch.utils import _pytree as pytree

    if not isinstance(inputs, tuple | list | dict):
        inputs = (inputs,)  # a single tensor as the one argument
    inputs = tuple(inputs) if isinstance(inputs, list) else inputs
    if not any(p.is_meta for p in model.parameters()):
        return inputs
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), inputs)


class ScriptModelError(PlanningError):
    """The model's class lives in the running script (``__main__``), which every rank of the
    emitted program would import, and run, again."""


def check_importable(model: nn.Module, model_file: str | None) -> None:
    """The emitted train.py imports the model file on every rank: a model class defined in the
    running script (``__main__``), with no other model_file, would make every rank run that
    script again. One line saying so, before anything is planned."""
    cls = type(model)
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None)
    if cls.__module__ != "__main__" or script is None:
        return
    script = os.path.abspath(script)
    if model_file is not None and os.path.abspath(model_file) != script:
        return
    raise ScriptModelError(
        f"model class {cls.__name__} is defined in the running script {script!r}, which the "
        "emitted train.py would import (and so run again) on every rank: put the model class "
        "and a build_model() in a module (e.g. model.py), import it from your script, and pass "
        "model_file='model.py'"
    )


def trace(model: nn.Module, args: tuple, kwargs: dict, **options) -> Graph:
    """The model's graph (autopar.ir.trace) as the emitted script runs it: an HF model's masks as
    its eager forward builds them (autopar.hf.masks_as_in_eager)."""
    with masks_as_in_eager(model, kwargs):
        return _trace_graph(model, args, kwargs, **options)


def _trace_options(cluster: Cluster, dtype: str) -> dict:
    """Trace at the compute dtype, measuring what the cluster's kernels save for backward."""
    return {
        "dtype": torch.bfloat16 if dtype == "bf16" else torch.float32,
        "saved_for": "cpu" if cluster.device.kind == "cpu" else "cuda",
    }


def _trace_batch(seq_len: int | None) -> int:
    return TRACE_BATCH + 1 if seq_len == TRACE_BATCH else TRACE_BATCH


def _token_ids(model: nn.Module, seq_len: int | None) -> tuple[torch.Tensor]:
    if seq_len is None:
        raise PlanningError(
            "no example_inputs and no seq_len: pass example_inputs=(forward args,) or, for a "
            "model that takes token ids, seq_len=N"
        )
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    return (torch.zeros(_trace_batch(seq_len), seq_len, dtype=torch.long, device=device),)


def _defining_file(model: nn.Module) -> str:
    """The absolute path of the file defining the model's class; for a class no file defines
    (a notebook cell, ``python -c``), ``NO_FILE: module.Class``: the plan is made, and emitting
    it says a file is needed."""
    cls = type(model)
    try:
        return os.path.abspath(inspect.getfile(cls))
    except (TypeError, OSError):
        return f"{NO_FILE}: {cls.__module__}.{cls.__qualname__}"
