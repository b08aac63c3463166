"""What a checkpointed layer holds under tensor parallelism (planner/score.py: _held_share).

A checkpointed block keeps only its input for the recompute. Under sequence parallelism the
residual stream between blocks is split along the sequence over the TP group (the script's
``sequence_scatter`` / ``rowwise_to_seq``; torchtitan's and Megatron-LM's layout), so each rank
holds 1/tp of that input, not all of it. The memory model charged it whole: torchtitan's Llama
3.1 70B run (FSDP 32 x TP 8, 16 sequences of 8192 tokens per rank, every layer checkpointed,
benchmarks/published_runs.py's tt-70b-256 row) came out at 8x its held inputs and did not fit.
"""

from __future__ import annotations

import pytest
from _plans import ROOT

from autopar.api import plan_model_file
from autopar.model_file import load_model_file

SEQ, DIM, BATCH, TP = 2048, 1024, 8, 8


def _plan(monkeypatch: pytest.MonkeyPatch, layers: int, mesh: str):
    monkeypatch.setenv("GPT_LAYERS", str(layers))
    monkeypatch.setenv("GPT_DIM", str(DIM))
    monkeypatch.setenv("GPT_HEADS", "16")
    monkeypatch.setenv("GPT_VOCAB", "256")
    monkeypatch.setenv("GPT_MAX_SEQ", str(SEQ))
    return plan_model_file(
        load_model_file(str(ROOT / "examples" / "gpt.py")),
        "1x8xH100",
        global_batch=BATCH,
        seq_len=SEQ,
        dtype="bf16",
        mesh=mesh,
        checkpoint="full",
        microbatches=1,
    )


def _static(plan) -> int:
    m = plan.predicted.memory_breakdown_bytes
    return m.params + m.grads + m.optimizer


def _held_per_layer(monkeypatch: pytest.MonkeyPatch, mesh: str) -> float:
    """Activation memory per added checkpointed block: 8 blocks minus 4, over 4."""
    four, eight = (_plan(monkeypatch, n, mesh) for n in (4, 8))
    for plan in (four, eight):
        assert plan.mesh.short() == mesh and all(
            plan.checkpointing[f"blocks.{i}"] == "full" for i in range(4)
        )
    # the activations the stage holds into the backward: its memory less its static state (the
    # rank's peak may be the optimizer step's moment instead: cost_model.peak)
    acts = [p.predicted.stages[0].memory_bytes - _static(p) for p in (four, eight)]
    return (acts[1] - acts[0]) / 4, eight


def test_a_checkpointed_block_holds_its_sequence_shard_under_sequence_parallelism(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tokens = BATCH * SEQ * DIM  # hidden-state elements of the whole microbatch
    # TP alone trains under torch.autocast over fp32 parameters: the residual stream is fp32
    per_layer, plan = _held_per_layer(monkeypatch, f"tp={TP}")
    styles = set(plan.tensor_parallel.values())
    assert {"sequence_scatter", "rowwise_to_seq"} <= styles, styles  # the stream is split
    assert per_layer == tokens * 4 / TP
    # without tensor parallelism the block holds the whole input (global batch 8 on one rank),
    # in bf16 (FSDP2's bf16 parameters)
    whole, _ = _held_per_layer(monkeypatch, "fsdp=8")
    assert whole == tokens * 2 / 8
