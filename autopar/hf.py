"""``hf:<config.json | built-in name>``: a HuggingFace transformers model as a model file.

The model is built from its config with ``AutoModelForCausalLM.from_config`` (decoder-only
models) or ``AutoModelForMaskedLM.from_config`` (BERT-style), never downloaded: the config is a
local JSON file, or one of the built-in names of :data:`BUILTINS` (``examples/hf/<name>.json``).
``transformers`` is the optional extra ``hf``.

Which head: the config's ``architectures`` decide (``...ForMaskedLM`` -> masked LM, ``...ForCausalLM``
/ ``...LMHeadModel`` -> causal LM, ``...ForConditionalGeneration`` of an encoder-decoder model_type
-> seq2seq LM); without them, an encoder-decoder ``model_type`` (T5, BART, ...: transformers'
``AutoModelForSeq2SeqLM`` knows it) whose config does not say ``is_decoder: true`` is a seq2seq LM,
a ``model_type`` transformers knows only as a masked LM, or a BERT-style one whose config says
``is_decoder: false``, is a masked LM and every other one a causal LM.

Batches and loss, one definition that the planner and the emitted script both run (the
runtime's ``autopar_runtime.hf_model``, :func:`runtime_hf_model`):

- causal LM: forward ``(input_ids,)``; the target is the ids shifted by one (a sample is
  ``seq_len + 1`` random tokens: inputs ``[:-1]``, target ``[1:]``), autopar's convention for
  token models, not HF's ``labels`` (which shifts inside the model);
- masked LM: forward ``(input_ids,)`` with ``max(1, round(0.15 * seq_len))`` positions of every
  sample replaced by the mask token; the target (HF's ``labels``) holds the original ids there
  and -100 elsewhere. Every sample masks the same number of positions, so the mean over
  data-parallel slices and microbatches is the full batch's mean.
- seq2seq LM (T5, BART): keyword inputs ``{"input_ids": source, "decoder_input_ids": decoder}``
  (``forward(**inputs)``); a sample is ``seq_len`` random source tokens and a decoder sequence of
  ``seq_len + 1`` tokens starting with the config's ``decoder_start_token_id`` (T5: the pad
  token): ``decoder_input_ids`` its ``[:-1]``, the target its ``[1:]`` (the decoder targets
  shifted by one, what HF's ``labels`` shift into inside the model). Pipelines are refused at
  plan time (a pipeline stage takes positional tensors only).
- loss: cross-entropy of the logits against the target, ``ignore_index=-100``, mean over the
  counted tokens: computed outside the model, so a sharded run and the reference compute the
  same thing and a pipeline's last stage needs only the logits. A mixture of experts whose config
  sets ``output_router_logits`` adds ``router_aux_loss_coef`` times the model's ``aux_loss``, as
  transformers trains it.

Attention runs with ``attn_implementation="sdpa"`` (``"eager"`` for the architectures that have
no SDPA path in transformers: Gemma 2, whose logit soft-capping SDPA cannot do, BLOOM, whose
ALiBi bias it does not take; the emitted script makes the same choice) and the model in fp32 (the planner casts to
the compute dtype itself). Grouped-query attention uses SDPA's own ``enable_gqa``
(``TRANSFORMERS_SDPA_FORCE_GQA=1``, set by the runtime's build, here and in the emitted script) instead of HF's
``repeat_kv``, whose ``expand``/``reshape`` carry the key/value head count as literal sizes in the
traced graph: the planner cannot tell those from a hard-coded head count, so it would never shard
attention by heads; with ``enable_gqa`` the graph has none, and q, k and v shard alike on heads.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import nn

from autopar.ir import PositionTable
from autopar.model_file import ModelFile, ModelFileError

PREFIX = "hf:"
EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "hf"
BUILTINS = (
    "llama2-13b",
    "llama3-8b",
    "llama3-70b",
    "llama3-405b",
    "gpt2",
    "bert-base",
    "tiny-llama",
    "tiny-gpt2",
    "tiny-bert",
)
CAUSAL_LM, MASKED_LM, SEQ2SEQ_LM = "causal-lm", "masked-lm", "seq2seq-lm"
MASK_FRACTION = 0.15


class HFError(ModelFileError):
    """A bad ``hf:`` spec or config; one line saying how to fix it."""


def is_hf_spec(spec: str) -> bool:
    return spec.startswith(PREFIX)


def resolve_hf_spec(spec: str) -> str:
    """``hf:NAME`` or ``hf:path/config.json`` -> ``hf:<absolute path of the config>``."""
    name = spec[len(PREFIX) :]
    if name in BUILTINS:
        path = EXAMPLES / f"{name}.json"
    else:
        path = Path(name).expanduser()
    if not name or not path.is_file():
        raise HFError(
            f"model {spec!r}: {name!r} is neither a built-in HF config "
            f"({', '.join(BUILTINS)}) nor a config.json file: pass hf:<name> or "
            "hf:path/to/config.json"
        )
    return PREFIX + str(path.resolve())


def load_config(spec: str) -> dict[str, Any]:
    """The config dict of an ``hf:`` spec (built-in name or file)."""
    path = resolve_hf_spec(spec)[len(PREFIX) :]
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFError(f"HF config {path!r} is not readable JSON ({e}): pass a config.json") from e
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise HFError(
            f'HF config {path!r} has no "model_type": pass a transformers config.json '
            '(e.g. {"model_type": "llama", ...})'
        )
    check_counts(config, path)
    return config


COUNT_KEY = re.compile(r"^(num|n)_|_(size|layers|heads|dim|positions|experts|embd|inner|ctx)$")
"""config keys that hold a count or a size (``num_hidden_layers``, ``n_layer``, ``hidden_size``,
``head_dim``, ``num_local_experts``...)."""
DEFINING = (
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_size",
    "intermediate_size",
    "vocab_size",
)
"""the counts that define a transformer, by transformers' own names (each family's spelling,
GPT-2's ``n_layer`` or ``n_embd``, maps to them through its config's ``attribute_map``)."""


def check_counts(config: dict[str, Any], path: str) -> None:
    """Refuse an HF config whose counts no model has, before any model is built: a count or size
    (:data:`COUNT_KEY`, top-level keys) below zero, or one of the :data:`DEFINING` counts below
    one. transformers
    builds most such configs without a word (``n_layer: -2`` is a model of no layers, which then
    plans) or fails deep inside a module. A negative value the family's own default config holds
    is that family's "unset" (DeBERTa's ``max_relative_positions: -1``) and passes, as does a
    zero where the family allows none of it (no shared experts). Every count >= 1 passes
    whatever the family: transformers is imported only where one is below (its config class
    names the aliases and the defaults)."""
    low = [
        key
        for key, value in config.items()
        if COUNT_KEY.search(key) and isinstance(value, int) and not isinstance(value, bool)
        if value < 1
    ]
    if not low:
        return
    family = _config_class(config["model_type"])
    canonical = {v: k for k, v in getattr(family, "attribute_map", {}).items()}
    for key in low:
        value = config[key]
        name = canonical.get(key, key)
        least = 1 if name in DEFINING else 0
        if value >= least or (value < 0 and _default(family, key) < 0):
            continue
        rule = "a positive integer" if least else "an integer >= 0"
        default = _default(family, key)
        usual = f" ({config['model_type']}'s default is {default})" if default >= least else ""
        alias = f", transformers' {name}," if name != key else ""
        raise HFError(
            f"HF config {path!r}: {key} {value} is not a count a model can have ({key}{alias} "
            f"must be {rule}): set {key} to {rule} in the config{usual}"
        )


def _config_class(model_type: str) -> type | None:
    """transformers' config class of ``model_type``, or None (no transformers, an unknown type:
    both refused later with their own line)."""
    try:
        from transformers import CONFIG_MAPPING

        return CONFIG_MAPPING[model_type]
    except (ImportError, KeyError):
        return None


def _default(family: type | None, key: str) -> int:
    """The family's default count ``key`` (its config built with no arguments), 0 where it has
    none."""
    if family is None:
        return 0
    try:
        value = getattr(family(), key, None)
    except (TypeError, ValueError):  # a config class that needs arguments: no default
        return 0
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _transformers() -> types.ModuleType:
    try:
        import transformers
    except ImportError:
        raise HFError(
            "hf: models need the transformers package: pip install 'autopar[hf]' "
            "(or pip install transformers)"
        ) from None
    return transformers


def task_of(config: dict[str, Any]) -> str:
    """``causal-lm``, ``masked-lm`` or ``seq2seq-lm`` (see the module docstring)."""
    auto = _transformers().models.auto.modeling_auto
    model_type = config["model_type"]
    seq2seq = model_type in auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES
    for arch in config.get("architectures") or ():
        if arch.endswith("ForMaskedLM"):
            return MASKED_LM
        if arch.endswith(("ForCausalLM", "LMHeadModel")):
            return CAUSAL_LM
        if arch.endswith("ForConditionalGeneration") and seq2seq:
            return SEQ2SEQ_LM
    if seq2seq and not config.get("is_decoder", False):
        return SEQ2SEQ_LM
    masked = model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
    causal = model_type in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if masked and (not causal or not config.get("is_decoder", False)):
        return MASKED_LM
    return CAUSAL_LM


def runtime_hf_model() -> types.ModuleType:
    """The emitted runtime's ``autopar_runtime.hf_model``: the one definition of how an HF model
    is built, batched and scored, which the emitted program runs and the planner plans. Loaded
    alone (it needs torch and transformers only), not with the whole runtime package."""
    name = "autopar_runtime.hf_model"
    home = importlib.util.find_spec("autopar.codegen")
    assert home is not None and home.submodule_search_locations
    path = Path(home.submodule_search_locations[0]) / "runtime" / "autopar_runtime" / "hf_model.py"
    module = sys.modules.get(name)
    if module is not None and getattr(module, "__file__", None) == str(path):
        return module
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules.setdefault(name, module)
    return module


def model_parts(config: dict[str, Any]) -> types.SimpleNamespace:
    """The runtime's HF model file of ``config`` (:func:`runtime_hf_model`), with the head
    :func:`task_of` picks; a config transformers cannot build is an HFError."""
    transformers = _transformers()
    try:
        return runtime_hf_model().hf_model_parts(
            config, task_of(config), factory_of(config), MASK_FRACTION
        )
    except (ValueError, TypeError) as e:
        raise HFError(
            f"transformers {transformers.__version__} cannot build a config of model_type "
            f"{config['model_type']!r} ({_reason(e)}): check the config"
        ) from e


def build_model(config: dict[str, Any], parts: types.SimpleNamespace | None = None) -> nn.Module:
    """The model of ``config`` (fp32, sdpa attention, training mode), on the current device."""
    parts = parts or model_parts(config)
    try:
        return getattr(parts, factory_of(config))()
    except ValueError as e:
        auto = {MASKED_LM: "AutoModelForMaskedLM", SEQ2SEQ_LM: "AutoModelForSeq2SeqLM"}
        raise HFError(
            f"transformers {_transformers().__version__} cannot build "
            f"{auto.get(task_of(config), 'AutoModelForCausalLM')} for model_type "
            f"{config['model_type']!r} ({_reason(e)}): plan a causal or masked LM config"
        ) from e


def _reason(e: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message, cut at a word (a URL stays whole) when long."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", 0, limit)
    return text[: cut if cut > 0 else limit].rstrip(" ,;:") + " ..."


def make_batch(
    config: dict[str, Any],
    batch_size: int,
    seq_len: int | None,
    parts: types.SimpleNamespace | None = None,
):
    """((input_ids,), target), or keyword inputs for a seq2seq LM: see the module docstring."""
    if seq_len is None:
        raise HFError("hf: models need a sequence length: pass --seq-len N")
    return (parts or model_parts(config)).make_batch(batch_size, seq_len)


def aux_loss_coef(config: dict[str, Any]) -> float | None:
    """The weight of a mixture of experts' load-balancing loss in the training loss, as
    transformers trains it: ``router_aux_loss_coef`` where the config sets
    ``output_router_logits`` (the model then returns ``aux_loss``), else None."""
    if not config.get("output_router_logits"):
        return None
    kwargs = {k: v for k, v in config.items() if k not in ("model_type", "torch_dtype", "dtype")}
    hf_config = _transformers().AutoConfig.for_model(config["model_type"], **kwargs)
    coef = getattr(hf_config, "router_aux_loss_coef", None)  # the family's default when unset
    return None if coef is None else float(coef)


def pipeline_refusal(mf) -> str | None:
    """Why the HF model of model file ``mf`` cannot be cut into pipeline stages, or None (also
    for a model file that is not HF). A mixture of experts that outputs router logits trains its
    load-balancing loss from every layer's router logits (:func:`aux_loss_coef`), which the
    stages do not pass on: the last stage has only the hidden states."""
    config = getattr(getattr(mf, "module", None), "CONFIG", None)
    if not isinstance(config, dict) or not str(mf.path).startswith("hf:"):
        return None
    if aux_loss_coef(config) is not None:
        return (
            "the config sets output_router_logits, so the training loss adds the experts' "
            "load-balancing loss over every layer's router logits, which pipeline stages do not "
            "pass on: plan without pipeline parallelism (--mesh pp=1), or set "
            "output_router_logits to false"
        )
    return None


def position_tables(model: nn.Module) -> tuple[PositionTable, ...]:
    """The position table of an HF model, as its config sizes it: an embedding of the config's
    ``max_position_embeddings`` rows (GPT-2's ``n_positions``, through the config's
    ``attribute_map``), other than the token embedding, plus the row offset transformers gives
    the family: a module ``offset`` (OPT and BART start at row 2, their table is that much
    larger), or the rows up to its ``padding_idx`` (RoBERTa: positions start past the padding
    row). Empty for any other model.

    Read from the built model (on meta) before any trace, because the graph does not always show
    it: BERT takes its positions from a buffer, whose values a meta model does not hold, and at
    a sequence past the table its trace fails first, on a slice of that buffer. Families with
    no table, whose positions are computed (RoPE: Llama, Mistral, Qwen...; ALiBi: BLOOM;
    relative: T5), run past ``max_position_embeddings`` in transformers as well (rotary
    frequencies are a function of the position) and are not refused for it."""
    pretrained = getattr(sys.modules.get("transformers"), "PreTrainedModel", None)
    if pretrained is None or not isinstance(model, pretrained):
        return ()
    limit = getattr(model.config, "max_position_embeddings", None)
    if not isinstance(limit, int) or isinstance(limit, bool):
        return ()
    setting = type(model.config).attribute_map.get(
        "max_position_embeddings", "max_position_embeddings"
    )
    try:
        tokens = model.get_input_embeddings()
    except NotImplementedError:  # a model without token embeddings
        tokens = None
    tables = []
    for fqn, module in model.named_modules():
        if not isinstance(module, nn.Embedding) or module is tokens:
            continue
        offset = getattr(module, "offset", 0)
        first = offset if module.padding_idx is None else max(offset, module.padding_idx + 1)
        if isinstance(offset, int) and module.num_embeddings == limit + offset:
            tables.append(PositionTable(fqn, module.num_embeddings, first, setting, limit))
    return tuple(tables)


def factory_of(config: dict[str, Any]) -> str:
    """The plan's ``model.factory`` for an HF model: its head, ``causal_lm``, ``masked_lm`` or
    ``seq2seq_lm``."""
    return task_of(config).replace("-", "_")


def hf_model_file(spec: str):
    """An ``hf:`` spec as an :class:`autopar.model_file.ModelFile`: file = ``hf:<config path>``,
    factory = the head (:func:`factory_of`)."""
    path = resolve_hf_spec(spec)
    config = load_config(path)
    parts = model_parts(config)
    module = types.ModuleType(f"_autopar_hf_{os.path.basename(path)}")
    module.CONFIG = config
    return ModelFile(
        path=path,
        factory=factory_of(config),
        build=lambda: build_model(config, parts),
        make_batch=lambda batch_size, seq_len=None: make_batch(config, batch_size, seq_len, parts),
        loss_fn=parts.loss_fn,
        module=module,
    )


# Arguments that make an HF model build an explicit mask in eager mode as well.
_MASK_INPUTS = ("attention_mask", "position_ids", "cache_position", "past_key_values")


@contextlib.contextmanager
def masks_as_in_eager(model: nn.Module, kwargs: dict) -> Iterator[None]:
    """Trace an HF model's attention as its eager forward runs it, for the planner's trace.

    Eager, a model fed only ``input_ids`` (all that autopar's batches hold) gets no mask: the
    masking code finds no padding and no packed sequences and lets SDPA run ``is_causal=True``,
    which keeps O(s) memory. Under ``torch.export`` the same code cannot look at values, so it
    builds the whole ``(b, 1, s, s)`` causal mask instead (transformers' masking_utils: an
    "exporting" check and a packed-sequence check on the position ids), which the memory model
    would then charge: 96 GiB per two samples at 131072 tokens for a Llama layer. Both checks are
    answered here as eager answers them for such inputs. A model given any of ``_MASK_INPUTS``
    (or no HF model at all) is traced untouched."""
    masking = sys.modules.get("transformers.masking_utils")
    pretrained = getattr(sys.modules.get("transformers"), "PreTrainedModel", None)
    if (
        masking is None
        or pretrained is None
        or not isinstance(model, pretrained)
        or any(kwargs.get(k) is not None for k in _MASK_INPUTS)
    ):
        yield
        return
    saved = masking.is_torchdynamo_exporting, masking.find_packed_sequence_indices
    masking.is_torchdynamo_exporting = lambda: False
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.is_torchdynamo_exporting, masking.find_packed_sequence_indices = saved
