"""--init-from: a DCP checkpoint or HF safetensors read into the sharded model, names and dtypes
checked first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .common import InputError
from .tensor_parallel import from_storage, storage_form
from .trust import SafeLoadPlanner, SafeReader, trusted_dir_problem

__all__ = [
    "init_source",
    "saved_tensors",
    "saved_shapes",
    "check_dtypes",
    "tied_groups",
    "Stacked",
    "legacy_layout",
    "match_names",
    "load_weights",
    "load_reference_weights",
    "load_init",
]


# --init-from PATH loads the model's weights before step 1 (not the optimizer: a fresh run from
# pretrained weights): a DCP checkpoint of any plan (a directory with .metadata: a step_<N>/ of
# --checkpoint-dir, or that directory itself for its latest complete step, or any DCP save of a
# model state dict) or a HuggingFace directory of *.safetensors (HuggingFaceStorageReader). Each
# rank reads only the parts of its shards. Names are checked on the unsharded model (on meta)
# before any collective: a checkpoint name may differ from the model's by a leading "model."
# (a base model's checkpoint in a model with a head, or the reverse); a tied weight (an LM head
# sharing the embedding) is loaded through whichever of its names the checkpoint has. A DCP
# source is trusted input (see Trusted input: this user's, read without running code); the
# checkpoint's dtypes must be floating where the model's are (an integer tensor is refused, a
# float of another precision is cast and said so).
def init_source(path: str | Path) -> tuple[str, Path]:
    """("dcp" | "hf", directory) of an --init-from path. Safetensors (no code) are preferred
    where a directory holds both; a DCP source is trusted input, checked as --checkpoint-dir is
    (trusted_dir_problem), the directory given and the step read alike."""
    path = Path(path)
    if not path.is_dir():
        raise InputError(f"--init-from {path}: no such directory (a DCP or HF safetensors one)")
    if any(path.glob("*.safetensors")):
        return "hf", path
    source = path if (path / ".metadata").is_file() else None
    steps = [
        p
        for p in path.glob("step_*")
        if p.name[5:].isdigit() and (p / "COMPLETE").is_file() and (p / ".metadata").is_file()
    ]
    if source is None and steps:
        source = max(steps, key=lambda p: int(p.name[5:]))
    if source is None:
        raise InputError(
            f"--init-from {path} holds neither a DCP checkpoint (.metadata) nor *.safetensors files"
        )
    for directory in dict.fromkeys((path, source)):
        why = trusted_dir_problem(directory)
        if why:
            raise InputError(f"--init-from {why}")
    return "dcp", source


def _storage_reader(kind: str, path: Path):
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    return HuggingFaceStorageReader(str(path)) if kind == "hf" else SafeReader(str(path))


def saved_tensors(kind: str, path: Path) -> dict:
    """Name -> (shape, dtype) of every tensor in the checkpoint (headers only)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = _storage_reader(kind, path).read_metadata()
    except Exception as e:  # a damaged file: safetensors and pickle raise many kinds
        raise InputError(f"--init-from {path}: cannot read it ({type(e).__name__}: {e})") from None
    return {
        name: (tuple(md.size), md.properties.dtype)
        for name, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }


def saved_shapes(kind: str, path: Path) -> dict:
    """Name -> shape of every tensor in the checkpoint (headers only)."""
    return {name: shape for name, (shape, _) in saved_tensors(kind, path).items()}


def check_dtypes(model: nn.Module, mapping: dict, saved: dict, path: Path) -> str:
    """The checkpoint's dtypes against the model's, for each tensor loaded by name (``mapping``
    from match_names, ``saved`` from saved_tensors): an integer or bool tensor into a floating
    one (or the reverse) is refused, since a cast would load ids or counts as weights; a float
    of another precision is cast, and the returned line says which (empty: none)."""
    state = model.state_dict()
    refused, cast = [], {}
    for name, source in mapping.items():
        if not isinstance(source, str) or source not in saved or name not in state:
            continue
        mine, theirs = state[name].dtype, saved[source][1]
        if mine == theirs:
            continue
        if (
            mine.is_floating_point != theirs.is_floating_point
            or mine.is_complex != theirs.is_complex
        ):
            refused.append(f"{source} ({str(theirs)[6:]}, the model's {str(mine)[6:]})")
        else:
            cast.setdefault(f"{str(theirs)[6:]} to {str(mine)[6:]}", []).append(source)
    if refused:
        raise InputError(
            f"--init-from {path} holds {_few(refused)}: an integer tensor is no weight of a "
            "floating one (nothing loaded): convert the checkpoint to the model's dtype"
        )
    return "; ".join(f"cast {len(v)} tensors from {k}" for k, v in sorted(cast.items()))


def tied_groups(model: nn.Module) -> list[list[str]]:
    """The model's state-dict names, grouped by the tensor they name (a tied weight: several)."""
    groups: dict = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return list(groups.values())


def _few(names: Iterable[str]) -> str:
    names = sorted(names)
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


# A HuggingFace model whose checkpoints come in an older layout (transformers 5 keeps Mixtral's
# and Qwen3-MoE's experts stacked, gate_up_proj [E, 2 I, H], while save_pretrained and the Hub
# write one tensor per expert, block_sparse_moe.experts.3.w1.weight) is read through
# transformers' own conversion rules for the model (get_model_conversion_mapping): renamings,
# and converters that stack one tensor per expert (MergeModulelist) and join several of them
# (Concatenate); a stacked tensor is built whole on each rank from its per-expert tensors
# (read with safetensors) and each rank keeps its shard. Other operations are not applied
# (their tensors stay unmatched: the usual error line).
@dataclasses.dataclass(frozen=True)
class Stacked:
    """A model tensor built from per-expert checkpoint tensors: ``sources[j][e]`` is expert
    e's tensor of the rule's j-th source; each list is stacked (dim ``stack``), then the
    stacks are concatenated (dim ``concat``; None: one source)."""

    sources: tuple
    stack: int
    concat: int | None

    def build(self, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        parts = [torch.stack([read(n) for n in names], self.stack) for names in self.sources]
        return parts[0] if self.concat is None else torch.cat(parts, self.concat)


def _conversion_rules(model: nn.Module) -> tuple[list, list]:
    """(renamings [(regex, replacement)], converters [(source regexes, target, stack,
    concat)]) of transformers' checkpoint conversion for ``model``; none for other models."""
    if not type(model).__module__.startswith("transformers."):
        return [], []
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping

        rules = get_model_conversion_mapping(model)
    except Exception:  # an older transformers, or a model it has no rules for
        return [], []
    renames, converters = [], []
    for rule in rules:
        sources = list(getattr(rule, "_original_source_patterns", rule.source_patterns))
        targets = list(getattr(rule, "_original_target_patterns", rule.target_patterns))
        if not hasattr(rule, "operations"):
            with contextlib.suppress(re.error):
                renames += [(re.compile(src), targets[0]) for src in sources if len(targets) == 1]
            continue
        # only stacking (and joining the stacks), never a Concatenate over shards or any
        # other operation
        ops = [(type(op).__name__, getattr(op, "dim", None)) for op in rule.operations]
        plain = all(getattr(op, "num_shards_attribute", None) is None for op in rule.operations)
        names = [name for name, _ in ops]
        stacks = names in (["MergeModulelist"], ["MergeModulelist", "Concatenate"])
        if not stacks or not plain or len(targets) != 1:
            continue
        regexes = [re.compile(re.escape(src).replace(r"\*", r"(\d+)") + "$") for src in sources]
        concat = ops[1][1] if len(ops) == 2 else None
        converters.append((regexes, targets[0], ops[0][1], concat))
    return renames, converters


def legacy_layout(model: nn.Module, saved: dict) -> tuple[dict, dict]:
    """(``saved`` in the model's layout: name -> shape, {such name: its checkpoint name, or
    the Stacked recipe}) under transformers' conversion rules (above)."""
    renames, converters = _conversion_rules(model)
    own = set(model.state_dict())
    layout, origin, groups = {}, {}, {}
    for key, shape in saved.items():
        name = key
        if name not in own:
            for regex, target in renames:
                name = regex.sub(target, name, count=1)
        for regexes, target, stack, concat in converters:
            hits = [(j, m) for j, rx in enumerate(regexes) if (m := rx.search(name))]
            if hits:
                j, m = hits[0]
                group = groups.setdefault(name[: m.start()] + target, (stack, concat, {}))
                group[2].setdefault(j, {})[int(m.group(1))] = (key, shape)
                break
        else:
            layout[name], origin[name] = shape, key
    for name, (stack, concat, by_source) in groups.items():
        sources = []
        for j in sorted(by_source):
            experts = by_source[j]
            if sorted(experts) != list(range(len(experts))):
                break  # a gap in the expert numbers: leave it unmatched
            sources.append([experts[e] for e in range(len(experts))])
        else:
            meta = [
                torch.stack([torch.empty(s, device="meta") for _, s in experts], stack)
                for experts in sources
            ]
            whole = meta[0] if concat is None else torch.cat(meta, concat)
            layout[name] = tuple(whole.shape)
            names = tuple(tuple(key for key, _ in experts) for experts in sources)
            origin[name] = Stacked(names, stack, concat)
    return layout, origin


def _read_safetensors(path: Path):
    """A reader of single tensors (by name) from a directory of *.safetensors files."""
    from safetensors import safe_open

    where = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            where.update(dict.fromkeys(f.keys(), file))

    def read(name: str) -> torch.Tensor:
        with safe_open(str(where[name]), "pt") as f:
            return f.get_tensor(name)

    return read


def match_names(model: nn.Module, saved: dict, path: Path) -> dict:
    """Model name -> checkpoint name for every tensor of the unsharded ``model`` (meta is fine)
    in ``saved`` (name -> shape); InputError naming the first few missing, unexpected or
    wrong-shaped names. A --checkpoint-dir step holds the model under "model.". A tensor of
    a HuggingFace checkpoint in an older layout maps to its checkpoint name or a Stacked
    recipe (legacy_layout)."""
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    origin = {}
    if not set(shapes) <= set(saved) and "step" not in saved:
        layout, origin = legacy_layout(model, saved)
        if sum(k in layout for k in shapes) > sum(k in saved for k in shapes):
            saved = layout
        else:
            origin = {}
    if "step" in saved and any(k.startswith("model.") for k in saved):  # see training_state
        saved = {k[6:]: v for k, v in saved.items() if k.startswith("model.")}
        outer = "model."  # keys as training_state nests them
    else:
        outer = ""
    # A checkpoint of the base model (or of the model with a head, into the base) names tensors
    # without (with) the base model's attribute: HF's base_model_prefix ("model", "transformer").
    base = (getattr(model, "base_model_prefix", "") or "model") + "."
    candidates = [lambda k: k, lambda k: k.removeprefix(base), lambda k: base + k]
    rename = max(candidates, key=lambda f: sum(f(k) in saved for k in shapes))
    mapping, missing, wrong = {}, [], []
    for group in tied_groups(model):
        present = [k for k in group if rename(k) in saved]
        if not present:
            missing.append(group[0])
        for k in present:
            if saved[rename(k)] != shapes[k]:
                wrong.append(f"{rename(k)} {list(saved[rename(k)])} != {list(shapes[k])}")
            mapping[k] = outer + rename(k)
    # buffers the model does not save (older HF checkpoints hold attention masks) are no surprise
    transient = {
        rename(f"{name}.{buffer}".lstrip("."))
        for name, module in model.named_modules()
        for buffer in module._non_persistent_buffers_set
    }
    unexpected = set(saved) - transient - {m[len(outer) :] for m in mapping.values()}
    problems = []
    if missing:
        problems.append(f"missing {_few(missing)}")
    if unexpected:
        problems.append(f"unexpected {_few(unexpected)}")
    if wrong:
        problems.append(f"wrong shape {_few(wrong)}")
    if problems:
        raise InputError(
            f"--init-from {path} does not fit the model: {'; '.join(problems)} (nothing loaded)"
        )
    return {k: origin.get(v, v) for k, v in mapping.items()}


def load_weights(kind: str, path: Path, mapping: dict, modules: list[nn.Module]) -> None:
    """Load the checkpoint into the (sharded) ``modules`` (this rank's: one, or its pipeline
    stages), each rank reading only its shards."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    states = [get_model_state_dict(m) for m in modules]
    plain = {k: v for k, v in mapping.items() if isinstance(v, str)}
    wanted = {plain[k]: v for state in states for k, v in state.items() if k in plain}
    if wanted:
        pairs = storage_form(wanted)
        dcp.load(wanted, storage_reader=_storage_reader(kind, path), planner=SafeLoadPlanner())
        from_storage(pairs)
    loaded = {k: wanted[plain[k]] for state in states for k in state if k in plain}
    read = _read_safetensors(path) if len(plain) < len(mapping) else None
    for state in states:  # tensors built from per-expert ones: whole, then this rank's shard
        for k, v in state.items():
            if k in mapping and k not in plain:
                full = mapping[k].build(read).to(v.device, v.dtype)
                if isinstance(v, DTensor):
                    full = distribute_tensor(full, v.device_mesh, v.placements, src_data_rank=None)
                loaded[k] = full
    for module, state in zip(modules, states):
        mine = {k: loaded[k] for k in state if k in loaded}
        set_model_state_dict(module, mine, options=StateDictOptions(strict=False))


def load_reference_weights(kind: str, path: Path, mapping: dict, model: nn.Module) -> None:
    """Load the whole checkpoint into the unsharded ``model`` (--verify's reference), in this
    process alone."""
    state = model.state_dict()
    plain = {k: v for k, v in mapping.items() if isinstance(v, str)}
    wanted = {plain[k]: v for k, v in state.items() if k in plain}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(
            wanted,
            storage_reader=_storage_reader(kind, path),
            planner=SafeLoadPlanner(),
            no_dist=True,
        )
    loaded = {k: wanted[plain[k]] for k in state if k in plain}
    read = _read_safetensors(path) if len(plain) < len(mapping) else None
    for k in state:
        if k in mapping and k not in plain:
            loaded[k] = mapping[k].build(read).to(state[k].device, state[k].dtype)
    model.load_state_dict(loaded, strict=False)


def load_init(
    init: tuple | None, modules: list[nn.Module], reference: nn.Module | None = None
) -> None:
    """--init-from into this rank's (sharded) modules, and into --verify's reference."""
    if init is None:
        return
    kind, path, mapping, cast = init
    load_weights(kind, path, mapping, modules)
    if reference is not None:
        load_reference_weights(kind, path, mapping, reference)
    if dist.get_rank() == 0:
        note = f"; {cast}" if cast else ""
        print(f"init: loaded {len(mapping)} tensors from {path} ({kind}){note}", flush=True)
