"""A run's measurements: the ``profile.json`` that ``train.py --profile-steps N`` writes
(``autopar_runtime/profiling.py``), loaded and checked, and set against the prediction of the
plan it ran, term by term: the start of ``plan --refit`` (issue 27, item 2).

Loading is JSON only (never pickle): the ``kind`` and ``schema`` are checked before anything
else, then every field (units in the key names: ``_s`` seconds, ``_bytes`` bytes; every number
finite and non-negative), then the sums the runtime guarantees (each step's terms add up to its
time, each memory split to its peak). Any problem is one line, :class:`MeasuredProfileError`.
:func:`check_belongs` refuses a profile of another model, cluster or autopar version; a profile
of another plan of the same model on the same cluster is what a refit learns from.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Literal

from autopar.cost_model.versioned import DuplicateKeyError, unique_keys
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveInt,
    ValidationError,
    model_validator,
)

from autopar.errors import UserError

__all__ = [
    "MEASURED_SCHEMA",
    "MeasuredProfileError",
    "MeasuredProfile",
    "TermComparison",
    "load_measured",
    "parse_measured",
    "check_belongs",
    "compare_terms",
]

MEASURED_SCHEMA = 1
_KIND = "autopar-profile"
_SUM_TOLERANCE = 1e-6  # relative: the runtime's terms partition each step's time exactly
_REGENERATE = "profile the run again (train.py --profile-steps N)"


class MeasuredProfileError(UserError):
    """A profile.json that cannot be used; the message is one line: what, why, the fix."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class LayerTimes(_Frozen):
    forward_s: NonNegativeFloat
    backward_s: NonNegativeFloat


class StepTerms(_Frozen):
    """One rank's step, or its mean over the profiled steps: disjoint terms that sum to
    ``step_s`` (``logged_step_time_s``: the step line's time, without the data wait)."""

    step_s: NonNegativeFloat
    logged_step_time_s: NonNegativeFloat
    data_wait_s: NonNegativeFloat
    forward_other_s: NonNegativeFloat
    backward_other_s: NonNegativeFloat
    pipeline_s: NonNegativeFloat
    grad_norm_s: NonNegativeFloat
    optimizer_s: NonNegativeFloat
    other_s: NonNegativeFloat
    layers: dict[str, LayerTimes]

    def terms(self) -> dict[str, float]:
        """The disjoint terms (layers as ``<fqn>.forward_s`` / ``<fqn>.backward_s``)."""
        out = {k: v for k, v in self if k.endswith("_s") and k not in _TOTALS}
        for fqn, t in self.layers.items():
            out |= {f"{fqn}.forward_s": t.forward_s, f"{fqn}.backward_s": t.backward_s}
        return out

    @model_validator(mode="after")
    def _sums(self) -> StepTerms:
        total = sum(self.terms().values())
        if abs(total - self.step_s) > _SUM_TOLERANCE * max(self.step_s, 1e-9):
            raise ValueError(f"its terms sum to {total:.9g} s, not its step_s {self.step_s:.9g} s")
        return self


_TOTALS = ("step_s", "logged_step_time_s")


class Memory(_Frozen):
    """One rank's memory at its step's peak, split as the cost model splits it."""

    source: Literal["cuda_allocator", "cpu_allocations"]
    peak_bytes: NonNegativeInt
    params_bytes: NonNegativeInt
    grads_bytes: NonNegativeInt
    optimizer_bytes: NonNegativeInt
    activations_bytes: NonNegativeInt
    buffers_bytes: NonNegativeInt
    peak_rss_bytes: NonNegativeInt | None = None
    runtime_rss_bytes: NonNegativeInt | None = None
    measured: list[str]
    derived: list[str]

    @model_validator(mode="after")
    def _sums(self) -> Memory:
        parts = (self.params_bytes, self.grads_bytes, self.optimizer_bytes,
                 self.activations_bytes, self.buffers_bytes)  # fmt: skip
        if sum(parts) != self.peak_bytes:
            raise ValueError(f"its parts sum to {sum(parts)} bytes, not its peak_bytes")
        return self


class Step(StepTerms):
    step: PositiveInt
    memory: Memory


class Collective(_Frozen):
    """Per step (mean over the profiled steps): ``num_calls`` of one kind on one group, each
    moving ``message_bytes``, taking ``time_s`` in all (overlapping compute: not a term of the
    sum)."""

    kind: str
    group: str | None
    group_size: PositiveInt | None
    message_bytes: NonNegativeInt
    num_calls: NonNegativeFloat
    time_s: NonNegativeFloat


class Rank(_Frozen):
    rank: NonNegativeInt
    mesh_coords: dict[str, NonNegativeInt]
    mean: StepTerms
    steps: list[Step]
    memory: Memory
    collectives: list[Collective] | None


class MeasuredProfile(_Frozen):
    """profile.json, schema 1 (see autopar_runtime/profiling.py)."""

    kind: Literal["autopar-profile"]
    schema_: Literal[1] = Field(alias="schema")
    autopar_version: str | None
    torch_version: str
    cluster: str
    world_size: PositiveInt
    backend: str
    device_type: str
    clock: Literal["perf_counter", "cuda_event"]
    mesh: dict[str, PositiveInt]
    plan_sha256: str | None
    plan: dict[str, Any] | None
    warmup_steps: NonNegativeInt
    profiled_steps: list[PositiveInt]
    collectives_source: str | None
    layers: list[str]
    ranks: list[Rank]

    @model_validator(mode="after")
    def _every_rank(self) -> MeasuredProfile:
        if [r.rank for r in self.ranks] != list(range(self.world_size)):
            raise ValueError(
                f"it holds ranks {[r.rank for r in self.ranks]}, not 0 .. {self.world_size - 1}"
            )
        if math.prod(self.mesh.values()) != self.world_size:
            raise ValueError(f"its mesh {self.mesh} is not {self.world_size} ranks")
        return self


def load_measured(path: str | Path) -> MeasuredProfile:
    """Read and check a profile.json; one line on any problem."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise MeasuredProfileError(
            f"cannot read profile {str(path)!r} ({e}): {_REGENERATE}"
        ) from None
    return parse_measured(text, name=str(path))


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def parse_measured(text: str, name: str = "profile.json") -> MeasuredProfile:
    """Validate ``text`` as a profile: kind and schema first, then every field and sum."""
    where = f"profile {name!r}"
    try:
        raw = json.loads(text, object_pairs_hook=unique_keys, parse_constant=_refuse_constant)
    except DuplicateKeyError as e:
        raise MeasuredProfileError(
            f"{where} names {e.key!r} twice in one object: {_REGENERATE}"
        ) from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, NaN / Infinity
        raise MeasuredProfileError(f"{where} is not valid JSON ({e}): {_REGENERATE}") from None
    if not isinstance(raw, dict) or raw.get("kind") != _KIND:
        cluster = isinstance(raw, dict) and "version" in raw  # `plan profile`'s, not a run's
        what = (
            "a cluster profile (plan profile)"
            if cluster
            else f'no run\'s profile (no "kind": "{_KIND}")'
        )
        raise MeasuredProfileError(f"{where} is {what}: {_REGENERATE}")
    if type(raw.get("schema")) is not int or raw["schema"] != MEASURED_SCHEMA:
        raise MeasuredProfileError(
            f"{where} has schema {raw.get('schema')!r}; this autopar reads schema "
            f"{MEASURED_SCHEMA}: {_REGENERATE} with a program this autopar emits"
        )
    try:
        return MeasuredProfile.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        field = f"field {loc!r}" if loc else "content"
        raise MeasuredProfileError(f"{where} {field} is invalid: {msg}; {_REGENERATE}") from None


def check_belongs(
    profile: MeasuredProfile,
    *,
    model: dict[str, str],
    cluster: str,
    autopar_version: str,
    name: str = "profile.json",
) -> None:
    """Refuse (one line) a profile of another model (``{"file", "factory"}`` as plan.json
    states it), cluster spec or autopar version: its figures would fit the wrong machine or
    program. Another plan of this model on this cluster is fine: that is what a refit uses."""
    where = f"profile {name!r}"
    if profile.plan is None:
        raise MeasuredProfileError(
            f"{where} names no plan (plan.json was not beside train.py): profile a program "
            "that `plan --out DIR` emitted"
        )
    ran = profile.plan.get("model", {})
    if (ran.get("file"), ran.get("factory", "build_model")) != (
        model.get("file"),
        model.get("factory", "build_model"),
    ):
        raise MeasuredProfileError(
            f"{where} is of model {ran.get('file')}:{ran.get('factory')}, not "
            f"{model.get('file')}:{model.get('factory')}: give a profile of this model"
        )
    if profile.cluster != cluster:
        raise MeasuredProfileError(
            f"{where} was measured on cluster {profile.cluster!r}, not {cluster!r}: profile "
            "a run on this cluster, or plan for that one"
        )
    if profile.autopar_version != autopar_version:
        raise MeasuredProfileError(
            f"{where} is of a program autopar {profile.autopar_version} emitted, this is "
            f"autopar {autopar_version}: emit the plan again and profile that run"
        )


@dataclasses.dataclass(frozen=True)
class TermComparison:
    """One term of the prediction against the run: ``measured`` and ``predicted`` in ``unit``
    (``s`` per step, ``bytes`` per rank); ``predicted`` None where the plan has no such term."""

    term: str
    unit: Literal["s", "bytes"]
    measured: float
    predicted: float | None
    note: str = ""

    @property
    def ratio(self) -> float | None:
        """measured / predicted (None where nothing was predicted)."""
        if not self.predicted:
            return None
        return self.measured / self.predicted


def compare_terms(profile: MeasuredProfile) -> list[TermComparison]:
    """The plan's prediction (in the profile: the plan that ran) against what ran, per term.
    Time terms take the slowest rank's mean step (it sets the step time); memory the largest
    rank's figure per kind; compute is the layers' forward and backward plus the work outside
    them; stage rows divide a stage's layers by the microbatches the prediction is per."""
    predicted = (profile.plan or {}).get("predicted") or {}
    time = predicted.get("time_breakdown_s") or {}
    means = [r.mean for r in profile.ranks]

    def slowest(f) -> float:
        return max(f(m) for m in means)

    def compute(m: StepTerms) -> float:
        layers = sum(t.forward_s + t.backward_s for t in m.layers.values())
        return layers + m.forward_other_s + m.backward_other_s

    rows = [
        TermComparison("step_time", "s", slowest(lambda m: m.step_s - m.data_wait_s),
                       predicted.get("step_time_s"), "the step without the data wait"),
        TermComparison("compute", "s", slowest(compute), time.get("compute"),
                       "measured: exposed collective waits inside layers included"),
        TermComparison("bubble", "s", slowest(lambda m: m.pipeline_s), time.get("bubble"),
                       "measured: the schedule's time outside the layers (send/recv too)"),
        TermComparison("optimizer", "s", slowest(lambda m: m.optimizer_s), time.get("optimizer")),
        TermComparison("grad_norm", "s", slowest(lambda m: m.grad_norm_s), time.get("grad_norm"),
                       "measured: the totals' wait for the slowest rank included"),
        TermComparison("data_wait", "s", slowest(lambda m: m.data_wait_s), None),
    ]  # fmt: skip
    for kind in ("tp", "dp", "pp", "cp", "ep"):
        spent = [
            sum(c.time_s for c in r.collectives or [] if c.group in _AXES[kind])
            for r in profile.ranks
        ]
        if any(spent) or time.get(f"{kind}_comm"):
            rows.append(TermComparison(f"{kind}_comm", "s", max(spent), time.get(f"{kind}_comm"),
                                       "measured: all collective time, overlapped or not"))  # fmt: skip
    rows += _stage_rows(profile, predicted)
    memory = predicted.get("memory_breakdown_bytes") or {}
    for kind in ("params", "grads", "optimizer", "activations", "buffers"):
        most = max(getattr(r.memory, f"{kind}_bytes") for r in profile.ranks)
        derived = f"{kind}_bytes" in profile.ranks[0].memory.derived
        rows.append(TermComparison(f"memory.{kind}", "bytes", most, memory.get(kind),
                                   "derived" if derived else "measured"))  # fmt: skip
    peak = max(r.memory.peak_bytes for r in profile.ranks)
    rows.append(TermComparison("memory.peak", "bytes", peak, predicted.get("peak_memory_bytes")))
    return rows


_AXES = {"tp": ("tp",), "dp": ("dp", "fsdp", "world"), "pp": ("pp",), "cp": ("cp",), "ep": ("ep",)}


def _stage_rows(profile: MeasuredProfile, predicted: dict) -> list[TermComparison]:
    plan = profile.plan or {}
    stages, schedule = plan.get("stages") or [], plan.get("schedule") or {}
    microbatches = schedule.get("num_microbatches", 1)
    rows = []
    guesses = predicted.get("stages") or []
    for j, stage in enumerate(stages):
        fqns = [f for f in stage if f]  # the root ("") is no planned layer
        guess = guesses[j] if j < len(guesses) else {}
        held = [r.mean for r in profile.ranks if fqns and all(f in r.mean.layers for f in fqns)]
        if not held:
            continue
        for part in ("forward", "backward"):
            spent = max(sum(getattr(m.layers[f], f"{part}_s") for f in fqns) for m in held)
            key = "fwd_s" if part == "forward" else "bwd_s"
            rows.append(TermComparison(f"stage{j}.{part}", "s", spent / microbatches,
                                       guess.get(key), "per microbatch"))  # fmt: skip
    return rows
