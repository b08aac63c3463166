"""The HuggingFace model as a model file: built from its config, batched and scored, the one
definition that the emitted program runs and the planner plans (autopar's ``hf:`` models call
it too).

Built with ``from_config`` (fp32, sdpa attention, no cache, no download); ``eager`` attention for
the architectures that have no SDPA path in transformers (Gemma 2, BLOOM). Grouped-query
attention runs through SDPA's ``enable_gqa`` (``TRANSFORMERS_SDPA_FORCE_GQA=1``), as planned.

Batches: a causal LM reads input_ids and predicts the next token (the target is the ids shifted
by one); a seq2seq LM (T5, BART) reads input_ids and decoder_input_ids as keyword inputs,
decoder_input_ids being a decoder sequence that starts with the decoder start token and the
target the same sequence shifted by one; a masked LM reads input_ids with ``mask_fraction`` of
each sample's positions (the same count in every sample) replaced by the mask token, and its
target holds the original ids there and -100 elsewhere. Loss: cross-entropy of the logits,
ignoring -100, computed here (not by the model), the same for the sharded run and the --verify
reference; plus ``router_aux_loss_coef`` times the model's ``aux_loss`` for a mixture of
experts whose config sets ``output_router_logits`` (as transformers trains it).
"""

from __future__ import annotations

import os
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["transformers_config", "build_hf_model", "hf_model_parts"]

_MASKED_LM, _SEQ2SEQ_LM = "masked-lm", "seq2seq-lm"
_IGNORE_INDEX = -100
_GQA_ENV = "TRANSFORMERS_SDPA_FORCE_GQA"
_SDPA_MISSING = "does not support an attention implementation through torch.nn.functional.scaled"
"""transformers' refusal of ``attn_implementation="sdpa"`` for an architecture without it."""


def transformers_config(config: dict[str, Any]) -> Any:
    """transformers' config object of the config dict ``config`` (no cache); raises
    transformers' ValueError or TypeError for a config it cannot build."""
    import transformers

    kwargs = {k: v for k, v in config.items() if k not in ("model_type", "torch_dtype", "dtype")}
    built = transformers.AutoConfig.for_model(config["model_type"], **kwargs)
    built.use_cache = False
    return built


def build_hf_model(built: Any, task: str) -> nn.Module:
    """The model of the transformers config ``built`` with the head of ``task`` (fp32, sdpa
    attention, or eager where the architecture has no SDPA), in training mode, on the current
    device."""
    import transformers

    # Grouped-query attention through SDPA's enable_gqa (read at every forward; planned so).
    os.environ.setdefault(_GQA_ENV, "1")
    auto = {
        _MASKED_LM: transformers.AutoModelForMaskedLM,
        _SEQ2SEQ_LM: transformers.AutoModelForSeq2SeqLM,
    }.get(task, transformers.AutoModelForCausalLM)
    try:
        return auto.from_config(built, attn_implementation="sdpa", dtype=torch.float32).train()
    except ValueError as e:  # no SDPA in the architecture (Gemma 2, BLOOM): eager, as it ships
        if _SDPA_MISSING not in str(e):
            raise
        return auto.from_config(built, attn_implementation="eager", dtype=torch.float32).train()


def hf_model_parts(
    config: dict[str, Any], task: str, factory: str, mask_fraction: float = 0.15
) -> types.SimpleNamespace:
    """The model file of the HF config dict ``config``: ``<factory>()`` (the model), ``make_batch
    (batch_size, seq_len)``, ``loss_fn(output, target)``, ``hf`` (True) and ``config`` (the
    transformers config); see the module docstring."""
    built = transformers_config(config)
    vocab = int(built.vocab_size)
    mask_id = config.get("mask_token_id")
    if not isinstance(mask_id, int):  # BERT's [MASK] where the vocab has it
        mask_id = 103 if vocab > 103 else vocab - 1
    start_id = next(
        (config[k] for k in ("decoder_start_token_id", "pad_token_id")
         if isinstance(config.get(k), int)),
        0,
    )  # fmt: skip

    def make_batch(batch_size: int, seq_len: int):
        if task == _SEQ2SEQ_LM:  # keyword inputs; the decoder reads its targets shifted by one
            source = torch.randint(0, vocab, (batch_size, seq_len))
            decoder = torch.randint(0, vocab, (batch_size, seq_len + 1))
            decoder[:, 0] = start_id
            return {"input_ids": source, "decoder_input_ids": decoder[:, :-1]}, decoder[:, 1:]
        if task != _MASKED_LM:
            ids = torch.randint(0, vocab, (batch_size, seq_len + 1))
            return (ids[:, :-1],), ids[:, 1:]
        ids = torch.randint(0, vocab, (batch_size, seq_len))
        count = max(1, round(mask_fraction * seq_len))
        where = torch.rand(batch_size, seq_len).argsort(dim=1)[:, :count]
        labels = torch.full_like(ids, _IGNORE_INDEX).scatter(1, where, ids.gather(1, where))
        return (ids.scatter(1, where, mask_id),), labels

    coef = getattr(built, "router_aux_loss_coef", None)
    routed = getattr(built, "output_router_logits", False) and coef is not None
    aux_coef = float(coef) if routed else None

    def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
        logits = output if isinstance(output, torch.Tensor) else output["logits"]  # pp: tensor
        loss = F.cross_entropy(
            logits.flatten(0, -2).float(), target.flatten(), ignore_index=_IGNORE_INDEX
        )
        aux = None if isinstance(output, torch.Tensor) else output.get("aux_loss")
        if aux_coef is not None and aux is not None:
            loss = loss + aux_coef * aux.float()
        return loss

    def build_model() -> nn.Module:
        return build_hf_model(built, task)

    # the factory names the head (causal_lm, masked_lm, seq2seq_lm): called like a model file's
    return types.SimpleNamespace(
        **{factory: build_model}, make_batch=make_batch, loss_fn=loss_fn, hf=True, config=built
    )
