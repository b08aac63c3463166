"""Context parallelism and positions computed inside attention (issue 28, item 4).

A cp rank sees only its chunks of each sequence from the first attention layer on; a model that
makes positions there out of the length it sees (``torch.arange(t)``, rotary tables sliced
``self.cos[:t]``) would rotate every rank's tokens by the wrong positions and train wrong. Such
models are refused cp at plan time, with the line that makes the positions; positions made
before the first attention layer (a GPT's position embedding, HF Llama's rotary embedding, a
root-level rotary table) keep cp.
"""

from __future__ import annotations

import pytest
from _plans import ROOT
from autopar.planner.search import PlanningError

from autopar.api import plan_model_file
from autopar.model_file import load_model_file

MODELS = ROOT / "tests" / "models"


def _plan(spec: str, mesh: dict[str, int] | None):
    return plan_model_file(
        load_model_file(spec), "cpu:2", global_batch=4, seq_len=16, mesh=mesh, optimizer="sgd"
    )


@pytest.mark.parametrize(
    ("factory", "source"),
    [
        ("build_arange", "positions = torch.arange(t, device=x.device)"),
        ("build_sliced", "self.cos[:t]"),
    ],
)
def test_positions_from_the_local_length_refuse_cp(factory: str, source: str) -> None:
    with pytest.raises(PlanningError) as info:
        _plan(f"{MODELS / 'rope_local.py'}:{factory}", {"cp": 2})
    text = str(info.value)
    assert "layers.0 computes positions from the sequence length it sees" in text, text
    assert source in text and "rope_local.py:" in text, text
    assert "before the first attention layer" in text and "\n" not in text, text
    # unpinned, the search leaves cp out and plans the rest
    assert _plan(f"{MODELS / 'rope_local.py'}:{factory}", None).mesh.cp == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec", [str(MODELS / "llama_rope.py"), str(ROOT / "examples" / "gpt.py"), "hf:tiny-llama"]
)
def test_positions_made_before_attention_keep_cp(spec: str) -> None:
    assert _plan(spec, {"cp": 2}).mesh.cp == 2
