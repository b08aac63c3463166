"""Turn a Plan into files: ``train.py``, the ``autopar_runtime/`` package, ``plan.json`` and
``launch.sh``.

``autopar_runtime/`` is ``runtime/autopar_runtime/`` copied verbatim, one module per concern:
the torch-only machinery (launch checks, parallelisms, stage cutting, the loop, checkpoints,
weights, verification) that ``train.py`` imports and ``Plan.apply`` loads; it takes the plan's
constants as arguments.

``train.py`` is ``templates/train.py`` (a real Python file that ruff checks) with two kinds of
edits, both mechanical:

- the ``# __CONSTANTS__`` line becomes the plan's constants block: the runtime's ``Constants``
  fields (the one list of them: names, order, each group's comment) that the plan states, each
  ``NAME = value`` with the value as a Python literal, built here from ints, floats, strings,
  lists and dicts (strings through ``repr``), so nothing from the plan is ever pasted in as
  code. The values are the planner's answers (``DATA_PARALLEL``: ``planner.rules.data_parallel``;
  ``SCHEDULE_CLASS`` and ``RANK_STAGES``: the schedule table), so the runtime decides nothing
  again;
- blocks between ``# [if NAME]`` and ``# [end NAME]`` lines are kept only when the plan uses
  that feature (``tp``, ``checkpoint``, ``fully_shard``, ``ddp``, ``pp`` and its complement
  ``no_pp``), so a DDP script carries no tensor-parallel code and only a pipeline script carries
  the stage-cutting code.

``emit`` is pure; ``codegen.write.write_outputs`` is the one function that touches the disk.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
import json
import re
import sys
import textwrap
import types
from pathlib import Path

from autopar.codegen.launch import launch_command, launch_files, nodes_of
from autopar.planner import schedules
from autopar.planner.groups import pipeline_blocks
from autopar.planner.plan import Plan
from autopar.planner.rules import data_parallel
from autopar.planner.schedules import SCHEDULES, stages_rule

__all__ = ["PLANS_FOLDER", "constants", "constants_block", "emit", "runtime"]

_TEMPLATE = Path(__file__).parent / "templates" / "train.py"
RUNTIME_PACKAGE = "autopar_runtime"
"""The runtime package's folder beside ``train.py``: the one folder ``emit`` writes into."""
RUNTIME = Path(__file__).parent / "runtime" / RUNTIME_PACKAGE
_LINE_LENGTH = 100
_MARKER = re.compile(r"^\s*# \[(if|end) (\w+)\]\s*$")
_CONSTANTS = "# __CONSTANTS__\n"
PLANS_FOLDER = "plans"
"""An elastic output's folder of per-node-count programs: ``plans/<K>nodes.py`` and ``.json``."""


def emit(plan: Plan, elastic: dict[int, Plan] | None = None) -> dict[str, str]:
    """The files of a plan: file name -> content (``train.py``, ``autopar_runtime/<module>.py``
    for each module of the runtime package, ``plan.json``, ``launch.sh``, ``launch.slurm``).

    ``elastic`` (``plan --elastic MIN:MAX``: node count -> plan, ``plan`` the largest's): also
    ``plans/<K>nodes.py`` and ``plans/<K>nodes.json``, the program and plan for each node count
    K (``train.py`` and ``plan.json`` are the largest's, byte for byte); every program states
    ``ELASTIC_PLANS`` and the launchers start torchrun's elastic agent (``--nnodes MIN:MAX``)."""
    if elastic is not None:
        return _emit_elastic(plan, elastic)
    return {
        "train.py": _script(plan),
        **runtime_files(),
        "plan.json": plan.to_json() + "\n",
        **launch_files(plan),
    }


def _script(plan: Plan, elastic_plans: dict[str, str] | None = None) -> str:
    """``train.py`` for ``plan``; ``elastic_plans``: ELASTIC_PLANS (node count -> program)."""
    _check_supported(plan)
    nodes = None
    if elastic_plans:
        nodes = (min(map(int, elastic_plans)), max(map(int, elastic_plans)))
    command = launch_command(plan, nodes)
    script = _TEMPLATE.read_text()
    script = _keep_features(script, _features(plan) | {"elastic": bool(elastic_plans)})
    assert script.count(_CONSTANTS) == 1, "the template holds one constants line"
    values = constants(plan) | ({"ELASTIC_PLANS": elastic_plans} if elastic_plans else {})
    values = {
        f.name: values[f.name] for f in dataclasses.fields(runtime().Constants) if f.name in values
    }
    script = script.replace(_CONSTANTS, constants_block(values), 1)
    script = script.replace("__SUMMARY__", _docstring_text(_summary(plan)), 1)
    script = script.replace("__COMMAND__", _docstring_text(command), 1)
    return script


def _emit_elastic(plan: Plan, plans: dict[int, Plan]) -> dict[str, str]:
    """The files of an elastic plan set (see :func:`emit`)."""
    low, high = min(plans), max(plans)
    assert plans[high] == plan, "train.py and plan.json are the largest node count's"
    per_node = nodes_of(plan)[1]
    for nodes, p in plans.items():
        assert nodes_of(p) == (nodes, per_node), f"the plan for {nodes} nodes has another world"
    table = {str(k): f"{PLANS_FOLDER}/{k}nodes.py" for k in sorted(plans)}
    files = {}
    for nodes in sorted(plans):
        files[f"{PLANS_FOLDER}/{nodes}nodes.py"] = _script(plans[nodes], table)
        files[f"{PLANS_FOLDER}/{nodes}nodes.json"] = plans[nodes].to_json() + "\n"
    return {
        "train.py": files[f"{PLANS_FOLDER}/{high}nodes.py"],
        **runtime_files(),
        "plan.json": files[f"{PLANS_FOLDER}/{high}nodes.json"],
        **files,
        **launch_files(plan, (low, high)),
    }


def runtime_files() -> dict[str, str]:
    """The runtime package as emitted: ``autopar_runtime/<module>.py`` -> its text."""
    return {
        f"{RUNTIME_PACKAGE}/{path.name}": path.read_text() for path in sorted(RUNTIME.glob("*.py"))
    }


@functools.cache
def runtime() -> types.ModuleType:
    """The ``autopar_runtime`` package every emitted ``train.py`` imports (loaded once), under
    its own name: fx and pickling look its modules up by name (``autopar_runtime.stages``)."""
    name = RUNTIME_PACKAGE
    init = RUNTIME / "__init__.py"
    module = sys.modules.get(name)
    if module is not None and getattr(module, "__file__", None) == str(init):
        return module
    # another copy (an emitted one imported from its folder): drop it and its modules, so the
    # package's relative imports load this one's
    for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[loaded]
    spec = importlib.util.spec_from_file_location(
        name, init, submodule_search_locations=[str(RUNTIME)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _check_supported(plan: Plan) -> None:
    mesh, schedule = plan.mesh, plan.schedule
    if mesh.pp > 1:
        # The script checks the microbatch rules itself (exit 2 before launch), so that a plan
        # forced by hand still emits; here only what makes no pipeline at all.
        if schedule.name == "none":
            raise ValueError(
                f"the plan has pipeline parallelism (pp={mesh.pp}) but no schedule: give it one "
                f"of {', '.join(SCHEDULES)}"
            )
        why = stages_rule(schedule.name, schedule.stages_per_rank)  # the schedule table's
        if why is not None:
            raise ValueError(why)
        if len(plan.stages) != mesh.pp * schedule.stages_per_rank:
            raise ValueError(
                f"the plan has {len(plan.stages)} stages for pp={mesh.pp} x "
                f"stages_per_rank={schedule.stages_per_rank}: they must be equal"
            )
        if not all(plan.stages):
            raise ValueError("a pipeline stage of the plan holds no layer")
    refusal = plan.mesh_refusal()  # the mesh rules (planner.rules), the schedule's included
    if refusal is not None:
        raise ValueError(f"mesh {mesh.short()}: {refusal.line()}")
    if plan.offload and not _features(plan)["fully_shard"]:
        raise ValueError(
            "the plan offloads to CPU but shards nothing with FSDP2 (CPU offload is an FSDP2 "
            "policy): give it fsdp > 1, or set offload to false"
        )
    if _is_hf(plan):
        _hf_config(plan)  # readable now, not when the script starts
        _hf_task(plan)


def _features(plan: Plan) -> dict[str, bool]:
    mesh = plan.mesh
    pp = mesh.pp > 1
    kind = data_parallel(mesh)
    return {
        "tp": mesh.tp > 1 and bool(plan.tensor_parallel),
        "checkpoint": any(mode == "full" for mode in plan.checkpointing.values()),
        "fully_shard": kind == "fsdp2",
        "ddp": kind == "ddp",
        "pp": pp,
        "no_pp": not pp,
        "hf": _is_hf(plan),
        "user_file": not _is_hf(plan),
        "hf_pp": _is_hf(plan) and pp,
        "accumulate": not pp and plan.schedule.num_microbatches > 1,
        "cp": mesh.cp > 1,
        "ep": mesh.ep > 1,
        "sync_batchnorm": plan.batch_coupling is not None and plan.batch_coupling.sync_batchnorm,
    }


# -- HuggingFace models (hf:<config.json>) -------------------------------------------------------
# The script embeds the config (HF_CONFIG) and builds the model with transformers' from_config:
# it depends on torch and transformers, not on the config file or autopar.
def _is_hf(plan: Plan) -> bool:
    return plan.model.file.startswith("hf:")


def _hf_config(plan: Plan) -> dict:
    path = Path(plan.model.file[len("hf:") :])
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(
            f"the plan's HF config {str(path)!r} cannot be read ({e}): re-plan the model, or "
            "restore the config file"
        ) from e
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(f"the plan's HF config {str(path)!r} has no model_type: re-plan it")
    return config


def _hf_task(plan: Plan) -> str:
    """The head the planner built: the plan's factory, causal_lm, masked_lm or seq2seq_lm
    (autopar.hf)."""
    if plan.model.factory not in ("causal_lm", "masked_lm", "seq2seq_lm"):
        raise ValueError(
            f"the plan's HF model has factory {plan.model.factory!r}, not causal_lm, masked_lm "
            "or seq2seq_lm: re-plan it"
        )
    return plan.model.factory.replace("_", "-")


def _mesh(mesh) -> dict[str, int]:
    """MESH as train.py states it: cp only where it splits (other scripts read as before)."""
    axes = ("pp", "dp", "fsdp", "cp", "tp") if mesh.cp > 1 else ("pp", "dp", "fsdp", "tp")
    return {axis: getattr(mesh, axis) for axis in axes}


def constants(plan: Plan) -> dict[str, object]:
    """The plan's constants as ``train.py`` states them (name -> value), in the order of the
    runtime's ``Constants`` (their one list); the fields of features the plan does not use are
    left out (the runtime's defaults)."""
    values = _values(plan)
    fields = dataclasses.fields(runtime().Constants)
    unknown = values.keys() - {f.name for f in fields}
    assert not unknown, f"constants {sorted(unknown)} are not fields of autopar_runtime.Constants"
    required = [f.name for f in fields if f.default is f.default_factory is dataclasses.MISSING]
    missing = [name for name in required if name not in values]
    assert not missing, f"emit gives no value to the Constants fields {missing}"
    return {f.name: values[f.name] for f in fields if f.name in values}


def _values(plan: Plan) -> dict[str, object]:
    """The value of each constant the plan states: the planner's answers, not its rules."""
    mesh, training = plan.mesh, plan.training
    features = _features(plan)
    values = {
        "MODEL_FILE": plan.model.file if _is_hf(plan) else str(Path(plan.model.file).absolute()),
        "FACTORY": plan.model.factory,
        "MESH": _mesh(mesh),
        "WORLD_SIZE": plan.world_size,
        "DATA_PARALLEL": data_parallel(mesh),
        "CLUSTER": plan.cluster.spec,
        "RANKS_PER_NODE": nodes_of(plan)[1],
        "BACKEND": plan.cluster.backend,
        "GLOBAL_BATCH": training.global_batch,
        "SEQ_LEN": training.seq_len,
        "DTYPE": training.dtype,
        "OPTIMIZER": training.optimizer,
        "LR": training.lr,
        "TP_PLAN": dict(plan.tensor_parallel) if features["tp"] else {},
        "MODULE_ATTRS": {k: dict(v) for k, v in plan.module_attrs.items()}
        if features["tp"]
        else {},
        "CHECKPOINT": [fqn for fqn, mode in plan.checkpointing.items() if mode == "full"],
        "LAYERS": [fqn for fqn in plan.layers if fqn],
        "OFFLOAD": plan.offload,
        "MODEL_FLOPS": _model_flops(plan),
        "PEAK_FLOPS": _peak_flops_per_rank(plan),
        "AUTOPAR_VERSION": _autopar_version(),
    }
    if features["hf"]:
        config = _hf_config(plan)
        mask_fraction = runtime().Constants.MASK_FRACTION  # stated, for the user to change
        values |= {"HF_CONFIG": config, "HF_TASK": _hf_task(plan), "MASK_FRACTION": mask_fraction}
    if features["pp"]:
        schedule = plan.schedule
        values |= {
            "STAGES": [list(stage) for stage in plan.stages],
            "SCHEDULE": schedule.name,
            "SCHEDULE_CLASS": schedules.rule(schedule.name).torch_class,
            "MICROBATCHES": schedule.num_microbatches,
            "STAGES_PER_RANK": schedule.stages_per_rank,
            "RANK_STAGES": schedules.rank_stages(schedule.name, mesh.pp, schedule.stages_per_rank),
        }
    if features["fully_shard"] and plan.fsdp_root:
        values["FSDP_ROOT"] = list(plan.fsdp_root)
    if features["cp"]:
        assert plan.context_parallel is not None  # Plan's validator holds them together
        values["CONTEXT_PARALLEL"] = plan.context_parallel.model_dump()
    if features["ep"]:
        assert plan.expert_parallel is not None  # Plan's validator holds them together
        values["EXPERT_PARALLEL"] = {
            "ep": mesh.ep,
            "num_experts": plan.expert_parallel.num_experts,
            "experts": [fqn for fqns in plan.expert_parallel.blocks.values() for fqn in fqns],
        }
    if features["accumulate"]:
        values["ACCUMULATION_STEPS"] = plan.schedule.num_microbatches
    mixed = plan.mixed_cluster
    if mixed is not None and mixed.batch_shares is not None:
        values["BATCH_SHARES"] = list(mixed.batch_shares)
    if mixed is not None and mixed.pipeline_groups is not None:
        blocks = pipeline_blocks(plan.cluster, mesh, mixed.pipeline_groups)
        if blocks != sorted(blocks):  # rank order is the mesh's own
            values["PIPELINE_BLOCKS"] = blocks
    values.update(_coupling_values(plan))
    return values


def _coupling_values(plan: Plan) -> dict[str, object]:
    """A batch-coupled model's constants, stated where they differ from the runtime's
    defaults; a plan from before ``batch_coupling`` with experts keeps --verify on slices."""
    bc = plan.batch_coupling
    if bc is None:
        return {"VERIFY_REFERENCE": "rank slices"} if plan.expert_parallel is not None else {}
    values: dict[str, object] = {}
    if bc.sync_batchnorm:
        values["SYNC_BATCHNORM"] = True
    if bc.gather_loss:
        values["GATHER_LOSS"] = True
    if bc.verify_reference != "global batch":
        values["VERIFY_REFERENCE"] = bc.verify_reference
    return values


def constants_block(values: dict[str, object]) -> str:
    """train.py's constants block: each of ``values`` (:func:`constants`) as ``NAME = value``
    under the comment of its group (the ``Constants`` field's doc)."""
    lines: list[str] = []
    previous = None  # the field before, stated or not
    for field in dataclasses.fields(runtime().Constants):
        name, doc = field.name, field.metadata["doc"]
        if name in values:
            # a field without a comment is stated under its group's, so after the field before
            assert doc or previous in values, f"{name} would be stated under another's comment"
            if doc:
                lines += textwrap.wrap(
                    doc, _LINE_LENGTH, initial_indent="# ", subsequent_indent="# ",
                    break_long_words=False, break_on_hyphens=False,
                )  # fmt: skip
            lines.append(f"{name} = {_literal(values[name], indent=0, prefix=len(name) + 3)}")
        previous = name
    return "\n".join(lines) + "\n"


def _autopar_version() -> str:
    """This autopar's version (the installed distribution's), for the profile's provenance."""
    try:
        return importlib.metadata.version("autopar")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _model_flops(plan: Plan) -> float | None:
    """The model's forward + backward FLOPs for one global batch, as the planner counted them
    (planner.search: Predicted.mfu = FLOPs / (step time x the cluster's total peak FLOP/s));
    None for a plan without predictions (made by hand)."""
    predicted = plan.predicted
    peak = plan.cluster.total_peak_flops(plan.training.dtype)
    if not (predicted.mfu > 0 and predicted.step_time_s > 0 and peak):
        return None
    return float(f"{predicted.mfu * predicted.step_time_s * peak:.6g}")


def _peak_flops_per_rank(plan: Plan) -> float | None:
    """PEAK_FLOPS: the mean peak FLOP/s of a rank (on a mixed cluster, each group's devices
    weighted by their count), so that the run's MFU divides by the cluster's total peak."""
    peak = plan.cluster.total_peak_flops(plan.training.dtype)
    return None if peak is None else float(f"{peak / plan.cluster.world_size:.6g}")


def _keep_features(script: str, features: dict[str, bool]) -> str:
    """Drop ``# [if NAME]`` ... ``# [end NAME]`` blocks of unused features, and the markers."""
    out: list[str] = []
    skipping: list[str] = []
    for line in script.splitlines(keepends=True):
        m = _MARKER.match(line)
        if m is None:
            if not skipping:
                out.append(line)
            continue
        kind, name = m.groups()
        assert name in features, f"template marker for unknown feature {name!r}"
        if kind == "if" and not features[name]:
            skipping.append(name)
        elif kind == "end" and skipping and skipping[-1] == name:
            skipping.pop()
    assert not skipping, f"template block {skipping[-1]!r} is not closed"
    # Dropped blocks can leave three blank lines where two belong (ruff format's rule).
    return re.sub(r"\n{4,}", "\n\n\n", _join_import_group("".join(out)))


def _join_import_group(script: str) -> str:
    """Drop the blank lines that markers needed between imports of one section (isort's rule:
    the standard library, then third-party packages, each a block without blank lines)."""
    lines = script.split("\n")
    out: list[str] = []
    last_section = None  # isort section of the last import statement seen

    def section(line: str) -> str | None:
        m = re.match(r"(?:from|import) (\w+)", line)
        if m is None:
            return None
        return "stdlib" if m.group(1) in sys.stdlib_module_names else "third-party"

    for i, line in enumerate(lines):
        if section(line):
            last_section = section(line)
        elif line == "" and last_section and i + 1 < len(lines):
            if section(lines[i + 1]) == last_section:
                continue
        elif line and not line.startswith((" ", ")")):
            last_section = None
        out.append(line)
    return "\n".join(out)


def _literal(value: object, indent: int, prefix: int = 0) -> str:
    """``value`` as Python source, laid out as ruff format would (one item a line if long)."""
    flat = _flat_literal(value)
    if not isinstance(value, (dict, list)) or indent + prefix + len(flat) <= _LINE_LENGTH:
        return flat
    pad = " " * (indent + 4)
    if isinstance(value, dict):
        items = [
            f"{pad}{_flat_literal(k)}: {_literal(v, indent + 4, len(_flat_literal(k)) + 3)},"
            for k, v in value.items()
        ]
        return "{\n" + "\n".join(items) + "\n" + " " * indent + "}"
    items = [f"{pad}{_literal(v, indent + 4, 1)}," for v in value]
    return "[\n" + "\n".join(items) + "\n" + " " * indent + "]"


def _flat_literal(value: object) -> str:
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, str):
        text = repr(value)
        # ruff format prefers double quotes; repr picks single ones unless the text has a '.
        if text.startswith("'") and '"' not in value:
            text = '"' + text[1:-1] + '"'
        return text
    if isinstance(value, dict):
        assert all(isinstance(k, str) for k in value), "plan dict keys are strings"
        return (
            "{"
            + ", ".join(f"{_flat_literal(k)}: {_flat_literal(v)}" for k, v in value.items())
            + "}"
        )
    if isinstance(value, list):
        return "[" + ", ".join(_flat_literal(v) for v in value) + "]"
    raise TypeError(f"no Python literal for {type(value).__name__}")


def _docstring_text(text: str) -> str:
    """Text that cannot end the docstring or start an escape sequence."""
    return text.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')


def _summary(plan: Plan) -> str:
    mesh, training, cluster = plan.mesh, plan.training, plan.cluster
    model = Path(plan.model.file).name
    title = f"Train {model} on {plan.world_size} rank(s) with the autopar plan {mesh.short()}."
    what = f"{plan.model.factory}() from {model}"
    if _is_hf(plan):  # torch and transformers build it from the config embedded below
        what = f"the HuggingFace {plan.model.factory} of {model} (HF_CONFIG, needs transformers)"
    parts = [
        f"The model is {what}; the cluster {cluster.spec} "
        f"({cluster.backend}); the mesh pp={mesh.pp} x dp={mesh.dp} x fsdp={mesh.fsdp} x "
        f"tp={mesh.tp}."
    ]
    if mesh.pp > 1:
        schedule = plan.schedule
        parts.append(
            f"Pipeline: {len(plan.stages)} stages over {mesh.pp} ranks "
            f"({schedule.stages_per_rank} per rank), schedule {schedule.name}, "
            f"{schedule.num_microbatches} microbatches; each stage runs its slice of the traced "
            "forward (split_into_stages; --show-stages prints their code)."
        )
    if mesh.tp > 1 and plan.tensor_parallel:
        styles: dict[str, int] = {}
        for style in plan.tensor_parallel.values():
            styles[style] = styles.get(style, 0) + 1
        counts = ", ".join(f"{n} {style}" for style, n in styles.items())
        parts.append(
            f"Tensor parallel over {mesh.tp} ranks on {len(plan.tensor_parallel)} modules ({counts})."
        )
    elif mesh.tp > 1:
        parts.append(f"The tp={mesh.tp} axis shards no module: its ranks repeat the same work.")
    if mesh.fsdp > 1:
        hsdp = f", replicated {mesh.dp} times (HSDP)" if mesh.dp > 1 else ""
        parts.append(
            f"FSDP2 shards parameters, gradients and optimizer state over {mesh.fsdp} ranks{hsdp}."
        )
    elif mesh.dp > 1:
        parts.append(f"Data parallel over {mesh.dp} replicas.")
    checkpointed = sum(mode == "full" for mode in plan.checkpointing.values())
    if checkpointed:
        parts.append(f"Activation checkpointing on {checkpointed} of {len(plan.layers)} layers.")
    tokens = f" x {training.seq_len} tokens" if training.seq_len else ""
    parts.append(
        f"Global batch {training.global_batch}{tokens}, {training.dtype}, "
        f"{training.optimizer} lr {training.lr:g}."
    )
    predicted = plan.predicted
    if predicted.step_time_s > 0:
        parts.append(
            f"Predicted: {predicted.step_time_s:.3g} s a step, "
            f"{predicted.peak_memory_bytes / 2**20:.1f} MiB peak memory per rank."
        )
    return title + "\n\n" + textwrap.fill(" ".join(parts), width=_LINE_LENGTH - 4)
