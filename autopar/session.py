"""The planning session: the front end (model file or HF config -> model on meta -> example
inputs -> checks -> traced graph -> pipeline cuts), run once per model and trace, and held.

A :class:`PlanningSession` is an object the caller holds. Every search of one model at one
sequence length, dtype and device kind reads the :class:`Front` it holds: planning again for
another cluster size, batch or pin, and ``why_not`` / ``report`` on a plan the session made (or
the same plan loaded from JSON) never trace again. With a :class:`autopar.cache.PlanCache`, a
front traced from a model file is also stored on disk (the graph as IR JSON, the checks'
verdicts), so the next session, in another process, reads it instead of importing, building
and tracing: neither transformers nor the model file is imported on a hit.

The checks run before the trace (a model with nothing to train, an HF position table shorter
than the sequence) or right after it (a forward of several outputs with no ``loss_fn``); a front
is held only once they pass, so a cached front has passed them. What the search needs of them
later is kept as data: :attr:`Front.pipeline_refusal`, why the model cannot be cut into
pipeline stages (pp is then pinned to 1).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from autopar._cuts import cuts as pipeline_cuts
from autopar.cache import PlanCache, answers_key, entry_key
from autopar.cost_model import Cluster
from autopar.hf import masks_as_in_eager, resolve_hf_spec
from autopar.hf import pipeline_refusal as hf_pipeline_refusal
from autopar.hf import position_tables as hf_position_tables
from autopar.ir import Graph, serial
from autopar.ir.coupling import Coupling, loss_coupling, takes_gather
from autopar.ir.trace import trace as _trace_graph
from autopar.model_file import (
    DEFAULT_FACTORY,
    ModelFile,
    ModelFileError,
    build_on_meta,
    call_args,
    check_threads,
    example_inputs,
    is_flat,
    load_model_file,
    resolve_model_spec,
    too_deep,
)
from autopar.planner.plan import NO_FILE, ModelRef, Plan
from autopar.planner.request import position_rule
from autopar.planner.search import PlanningError
from autopar.planner.stages import Cuts

__all__ = ["Front", "PlanningSession", "ScriptModelError", "TRACE_BATCH", "trace"]

# The planner traces a small batch and scales per-sample costs to the real one; 2 keeps the batch
# dim distinguishable from size-1 broadcast dims (and BatchNorm happy in training mode).
TRACE_BATCH = 2

Progress = Callable[[str], None]
"""Called with a short status line as planning proceeds (the CLI draws it on a terminal)."""


@dataclass
class Front:
    """What the front end made of one model at one trace: the graph and the checks' verdicts."""

    ref: ModelRef
    """the model as a plan names it (file and factory)."""
    graph: Graph
    pipeline_refusal: str | None
    """why the model cannot be cut into pipeline stages (pinning pp > 1 is then an error and
    pp is pinned to 1), or None."""
    source: str = "traced"
    """``traced`` here, or ``cache`` (read from the plan cache)."""
    optima: dict[int, dict] = field(default_factory=dict, repr=False)
    """tp -> the intra-layer ILP's proven optima on this graph (``planner.ilp.Solver``), shared
    by every search of this front and kept in the plan cache."""
    answers_key: str | None = field(default=None, repr=False)
    """the plan cache's key of :attr:`optima` (None: not cached)."""
    _stored: int = field(default=0, repr=False)
    """how many optima the cache holds."""
    _cuts: Cuts | None = field(default=None, repr=False)
    loss_couplings: tuple[Coupling, ...] = ()
    """where the model file's loss_fn mixes the samples of a batch (``ir.loss_coupling``)."""
    loss_gathers: bool = False
    """the loss_fn takes ``gather`` (a contrastive loss over the global batch)."""

    @property
    def cuts(self) -> Cuts:
        """Where the script can cut the model into stages (autopar._cuts), decided once."""
        if self._cuts is None:
            self._cuts = pipeline_cuts(self.graph)
        return self._cuts

    def pins(self, pins: dict[str, int]) -> dict[str, int]:
        """``pins`` with pp=1 where the model cannot be pipelined; pp > 1 pinned there is one
        error line saying why."""
        if self.pipeline_refusal is None:
            return pins
        if pins.get("pp", 1) > 1:
            raise PlanningError(f"pp={pins['pp']}: {self.pipeline_refusal}")
        return {**pins, "pp": 1}


class PlanningSession:
    """The front ends a caller keeps across planning calls (module docstring). Pass one to
    ``auto_parallelize`` / ``plan_model_file`` and to ``why_not``; ``cache`` (default: none)
    stores and reads fronts traced from model files on disk (``PlanCache.default()``: the
    user's cache directory). ``traces`` counts the traces this session ran."""

    def __init__(self, cache: PlanCache | None = None) -> None:
        self.cache = cache
        self.traces = 0
        self._fronts: dict[tuple, Front] = {}

    # -- model files and HF configs --------------------------------------------------------

    def front(
        self,
        model: str | ModelFile,
        seq_len: int | None,
        dtype: str,
        saved_for: str,
        progress: Progress | None = None,
    ) -> Front:
        """The front of ``model`` (``path.py[:factory]``, ``hf:...`` or a loaded model file)
        traced at ``seq_len`` and ``dtype`` for ``saved_for`` kernels: held, cached, or
        traced now."""
        mf = model if isinstance(model, ModelFile) else None
        if mf is not None:
            file, factory = mf.path, mf.factory
        elif model.startswith("hf:"):
            file, factory = resolve_hf_spec(model), None
        else:
            file, factory = resolve_model_spec(model)
        options = _trace_key(seq_len, dtype, saved_for)
        held = _held_key(file, factory, options)
        if held in self._fronts:
            return self._fronts[held]
        key = None
        if self.cache is not None:
            key = entry_key(file, held[1] or "", options)
            front = _read_front(self.cache.read(key), file)
            if front is not None:
                self._fronts[held] = front
                self._read_answers(front, key)
                return front
        threads = set(threading.enumerate())
        if mf is None:
            if progress is not None:
                progress(f"importing {model}")
            mf = load_model_file(model)
        front = self._trace_file(mf, seq_len, dtype, saved_for, progress)
        check_threads(threads, model if isinstance(model, str) else mf.path)  # before caching it
        self._fronts[held] = front
        if key is not None and self.cache is not None and _write_front(self.cache, key, front):
            self._read_answers(front, key)  # an earlier session's, where its graph entry broke
        return front

    def _read_answers(self, front: Front, key: str) -> None:
        assert self.cache is not None
        front.answers_key = answers_key(key)
        front.optima = _decode_optima(self.cache.read(front.answers_key))
        front._stored = _count(front.optima)

    def keep_answers(self, front: Front) -> None:
        """Store the ILP answers the searches of ``front`` found since it was read, where it
        has a cache entry (called after each search)."""
        count = _count(front.optima)
        if self.cache is None or front.answers_key is None or count == front._stored:
            return
        if self.cache.write(front.answers_key, _encode_optima(front.optima)):
            front._stored = count

    def _trace_file(
        self, mf: ModelFile, seq_len: int | None, dtype: str, saved_for: str, progress
    ) -> Front:
        if progress is not None:
            progress("building and tracing the model on meta")
        model = build_on_meta(mf)
        check_trainable(model, mf.path)
        check_hf_positions(model, seq_len)
        inputs, _ = example_inputs(mf, model, trace_batch(seq_len), seq_len)
        refusal = hf_pipeline_refusal(mf) or _unflat(inputs, mf.path)
        self.traces += 1
        try:
            graph = trace(
                model, *call_args(inputs), seq_len=seq_len, **_trace_options(dtype, saved_for)
            )
        except RecursionError:
            raise too_deep(mf.path) from None
        check_loss_fn(graph, mf)
        front = Front(ModelRef(file=mf.path, factory=mf.factory), graph, refusal)
        front.loss_couplings = _loss_coupling(mf, model, seq_len)
        front.loss_gathers = takes_gather(mf.loss_fn)
        return front

    # -- a model object ------------------------------------------------------------------------

    def front_of_module(
        self,
        model: nn.Module,
        inputs,
        ref: ModelRef,
        seq_len: int | None,
        dtype: str,
        saved_for: str,
        progress: Progress | None = None,
    ) -> Front:
        """The front of a model object with its example inputs (``auto_parallelize``); held
        under the plan's model ref, never cached on disk (the object, not a file, is what was
        traced)."""
        check_trainable(model, ref.file if ref.has_file else None)
        check_hf_positions(model, seq_len)
        if progress is not None:
            progress("tracing the model on meta")
        self.traces += 1
        graph = trace(
            model, *call_args(inputs), seq_len=seq_len, **_trace_options(dtype, saved_for)
        )
        front = Front(ref, graph, _unflat(inputs))
        self._fronts[_held_key(ref.file, ref.factory, _trace_key(seq_len, dtype, saved_for))] = (
            front
        )
        return front

    # -- a plan's model --------------------------------------------------------------------------

    def front_of_plan(self, plan: Plan, progress: Progress | None = None) -> Front:
        """The front a plan was searched on: held (this session planned or traced it), cached,
        or traced again from the plan's model file."""
        t = plan.training
        saved_for = saved_for_of(plan.cluster)
        options = _trace_key(t.seq_len, t.dtype, saved_for)
        held = self._fronts.get(_held_key(plan.model.file, plan.model.factory, options))
        if held is not None and [x.fqn for x in held.graph.layers] == plan.layers:
            return held
        ref = plan.model
        if not ref.has_file:
            raise PlanningError(
                f"the plan's model has no file ({ref.file}), so it cannot be traced again: pass "
                "session= (the PlanningSession it was planned with, which holds its graph), or "
                "plan it from a model file (model_file='model.py')"
            )
        spec = ref.file if ref.file.startswith("hf:") else f"{ref.file}:{ref.factory}"
        return self.front(spec, t.seq_len, t.dtype, saved_for, progress)

    def graph(self, plan: Plan) -> Graph:
        """The graph ``plan`` was searched on (:meth:`front_of_plan`)."""
        return self.front_of_plan(plan).graph

    def why_not(self, plan: Plan, mesh: str | dict[str, int], progress: Progress | None = None):
        """:func:`autopar.api.why_not` on this session's graph."""
        from autopar.api import why_not

        return why_not(plan, mesh, session=self, progress=progress)

    def report(self, plan: Plan, path, why_not: str | dict[str, int] | None = None):
        """:func:`autopar._plan.report` with a why-not answered on this session's graph."""
        from autopar._plan import report

        return report(plan, path, why_not, session=self)


def _trace_key(seq_len: int | None, dtype: str, saved_for: str) -> dict:
    """What a trace of one model depends on besides the model (JSON values)."""
    return {"seq_len": seq_len, "dtype": dtype, "saved_for": saved_for,
            "batch": trace_batch(seq_len)}  # fmt: skip


def _held_key(file: str, factory: str | None, options: dict) -> tuple:
    """A session's key of a front: the model (an HF config decides its own head) and trace."""
    hf = file.startswith("hf:")
    return (file, None if hf else factory, json.dumps(options, sort_keys=True))


def _read_front(body: dict | None, file: str) -> Front | None:
    """The front a cache entry holds, or None where it holds no readable one."""
    if body is None:
        return None
    try:
        graph = serial.loads(body["graph"])
        ref = ModelRef(file=file, factory=body["factory"])
        refusal = body["pipeline_refusal"]
        couplings = tuple(Coupling(**c) for c in body["loss_couplings"])
        gathers = body["loss_gathers"]
    except (serial.SerialError, KeyError, TypeError, ValueError):
        return None
    if refusal is not None and not isinstance(refusal, str):
        return None
    if not isinstance(gathers, bool) or not all(_plain(c) for c in couplings):
        return None
    front = Front(ref, graph, refusal, source="cache")
    front.loss_couplings, front.loss_gathers = couplings, gathers
    front._cuts = _read_cuts(body.get("cuts"))  # None (an older entry): decided when read
    return front


def _read_cuts(value) -> Cuts | None:
    """The pipeline cuts a cache entry holds (:func:`_write_front`), or None where it holds no
    readable ones (then :attr:`Front.cuts` decides them from the graph again)."""
    if not isinstance(value, dict) or set(value) != {"allowed", "why", "refused"}:
        return None
    allowed, why, refused = value["allowed"], value["why"], value["refused"]
    if not (isinstance(allowed, list) and all(type(b) is int for b in allowed)):
        return None
    if not isinstance(why, list) or not all(
        isinstance(w, list) and len(w) == 2 and type(w[0]) is int and isinstance(w[1], str)
        for w in why
    ):
        return None
    if refused is not None and not isinstance(refused, str):
        return None
    return Cuts(frozenset(allowed), tuple((b, text) for b, text in why), refused)


def _plain(c: Coupling) -> bool:
    """A coupling read from a cache entry holds strings only (a hand-edited entry: ignored)."""
    return all(isinstance(v, str | None) for v in dataclasses.astuple(c))


def _write_front(cache: PlanCache, key: str, front: Front) -> bool:
    try:
        text = serial.dumps(front.graph)
    except serial.SerialError:  # a value the IR encoding does not hold: not cached
        return False
    body = {"factory": front.ref.factory, "pipeline_refusal": front.pipeline_refusal,
            "loss_couplings": [dataclasses.asdict(c) for c in front.loss_couplings],
            "loss_gathers": front.loss_gathers, "graph": text,
            "cuts": {"allowed": sorted(front.cuts.allowed),
                     "why": [list(w) for w in front.cuts.why], "refused": front.cuts.refused}}  # fmt: skip
    return cache.write(key, body)


def _count(optima: dict[int, dict]) -> int:
    return sum(len(known) for per_tp in optima.values() for known in per_tp.values())


def _encode_optima(optima: dict[int, dict]) -> dict:
    """The ILP's optima as JSON: per tp, [cost key, [[rate, [[node, index], ...]], ...]]."""
    return {
        "optima": {
            str(tp): [
                [list(key), [[rate, [list(p) for p in pick]] for rate, pick in known]]
                for key, known in per_tp.items()
            ]
            for tp, per_tp in optima.items()
        }
    }


def _decode_optima(body: dict | None) -> dict[int, dict]:
    """What :func:`_encode_optima` wrote, or nothing where the entry is not that (the solver
    then checks each answer against its own graph)."""
    try:
        return {
            int(tp): {
                tuple(key): [
                    (float(rate), tuple((str(n), int(i)) for n, i in pick)) for rate, pick in known
                ]
                for key, known in per_tp
            }
            for tp, per_tp in body["optima"].items()  # type: ignore[index]
        }
    except (KeyError, TypeError, ValueError, AttributeError):
        return {}


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


# -- the front end's checks ---------------------------------------------------------------------


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


def _unflat(inputs, where: str | None = None) -> str | None:
    """Why a model taking ``inputs`` cannot be pipelined (a stage receives and sends tensors
    only: a dict, keyword inputs, a nested list cannot pass), or None."""
    if is_flat(inputs):
        return None
    if isinstance(inputs, dict):
        what = f"keyword inputs ({', '.join(inputs)})"
    else:
        kinds = [type(x).__name__ for x in inputs if not isinstance(x, torch.Tensor)]
        what = f"a {kinds[0]} argument"
    return (
        f"the model{f' of {where!r}' if where else ''} takes {what}, and pipeline stages pass "
        "tensors only: plan without pipeline parallelism (--mesh pp=1), or make the forward "
        "take tensors as positional arguments"
    )


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


def on_model_device(model: nn.Module, inputs):
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


def token_ids(model: nn.Module, seq_len: int | None) -> tuple[torch.Tensor]:
    """Example token ids for a model that takes them (no example inputs given)."""
    if seq_len is None:
        raise PlanningError(
            "no example_inputs and no seq_len: pass example_inputs=(forward args,) or, for a "
            "model that takes token ids, seq_len=N"
        )
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    return (torch.zeros(trace_batch(seq_len), seq_len, dtype=torch.long, device=device),)


def model_ref(model: nn.Module, model_file: str | None, factory: str = DEFAULT_FACTORY) -> ModelRef:
    """The plan's model of a model object: ``model_file`` (a path or ``hf:`` spec) with
    ``factory``, else the file defining the model's class."""
    if model_file is not None and model_file.startswith("hf:"):  # an HF config (autopar.hf)
        file, hf_factory = resolve_model_spec(model_file)
        return ModelRef(file=file, factory=hf_factory)
    file = os.path.abspath(model_file) if model_file else _defining_file(model)
    return ModelRef(file=file, factory=factory)


def _defining_file(model: nn.Module) -> str:
    """The absolute path of the file defining the model's class; for a class no file defines
    (a notebook cell, ``python -c``), ``NO_FILE: module.Class``: the plan is made, and emitting
    it says a file is needed."""
    cls = type(model)
    try:
        return os.path.abspath(inspect.getfile(cls))
    except (TypeError, OSError):
        return f"{NO_FILE}: {cls.__module__}.{cls.__qualname__}"


# -- the trace -----------------------------------------------------------------------------------


def trace(model: nn.Module, args: tuple, kwargs: dict, **options) -> Graph:
    """The model's graph (autopar.ir.trace) as the emitted script runs it: an HF model's masks as
    its eager forward builds them (autopar.hf.masks_as_in_eager)."""
    with masks_as_in_eager(model, kwargs):
        return _trace_graph(model, args, kwargs, **options)


def saved_for_of(cluster: Cluster) -> str:
    """The device type whose kernels the saved-bytes measurement follows."""
    return "cpu" if cluster.device.kind == "cpu" else "cuda"


def _trace_options(dtype: str, saved_for: str) -> dict:
    """Trace at the compute dtype, measuring what the cluster's kernels save for backward."""
    return {"dtype": torch.bfloat16 if dtype == "bf16" else torch.float32, "saved_for": saved_for}


def trace_options(cluster: Cluster, dtype: str) -> dict:
    """The trace's options for planning at ``dtype`` on ``cluster``."""
    return _trace_options(dtype, saved_for_of(cluster))


def trace_batch(seq_len: int | None) -> int:
    """The batch the planner traces: :data:`TRACE_BATCH`, one more where it equals seq_len."""
    return TRACE_BATCH + 1 if seq_len == TRACE_BATCH else TRACE_BATCH
