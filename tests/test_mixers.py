"""Pipeline cuts of models built from torch's own transformer layers and of scan-style token
mixers (issue 28, item 7; models: tests/models/mixers.py).

Each is a plain stack of layers. The mixers (a running mean by ``torch.cumsum``, a recurrence
written as a python loop over the sequence) cut at every layer boundary, plan at pp=2 and run
verified under torchrun. ``nn.TransformerEncoder`` / ``nn.TransformerDecoder`` called with a
causal mask *and* the ``is_causal`` hint cannot be cut: ``nn.MultiheadAttention`` leaves the
mask unread under the hint, torch.export drops it from the layer's call, and the layer called
without it refuses the hint (``RuntimeError: Need attn_mask if specifying the is_causal hint``,
which the emitted script used to report as the reason). The plan refuses that in one line that
names the layer, the torch class and the change (``is_causal=False`` with the mask); with that
change the same models cut, plan at pp=2 and verify.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from autopar.ir import trace
from autopar.planner.search import PlanningError
from test_models_pp import _pp_plan, _run_verified

from autopar._cuts import cuts

MODELS = Path(__file__).resolve().parent / "models"
sys.path.insert(0, str(MODELS))
import mixers  # noqa: E402

CUT = ("cumsum", "loop", "loop_inplace", "encoder_mask", "encoder_decoder_mask")
HINTED = {
    "encoder": ("encoder.layers.0", "torch.nn.TransformerEncoderLayer"),
    "encoder_decoder": ("decoder.layers.0", "torch.nn.TransformerDecoderLayer"),
}


def _cuts(kind: str):
    with torch.device("meta"):
        model = getattr(mixers, f"build_{kind}")()
    graph = trace(model.train(), (torch.zeros(2, 8, dtype=torch.long, device="meta"),))
    return graph, cuts(graph)


# the default tier: one mixer, one torch encoder; the others in the slow tier
FAST = ("loop", "encoder_mask")


@pytest.mark.parametrize(
    "kind", [k if k in FAST else pytest.param(k, marks=pytest.mark.slow) for k in CUT]
)
def test_mixers_and_unhinted_torch_layers_cut_at_every_layer_boundary(kind: str) -> None:
    graph, c = _cuts(kind)
    layers = [layer.fqn for layer in graph.layers]
    assert len(layers) >= 4, layers
    assert c.refused is None and not c.why, c
    assert c.allowed == frozenset(range(1, len(layers))), (layers, c)


@pytest.mark.parametrize(
    "kind", ["encoder", pytest.param("encoder_decoder", marks=pytest.mark.slow)]
)
def test_torch_layers_with_the_causal_hint_are_refused_with_the_change_to_make(kind: str):
    layer, cls = HINTED[kind]
    with pytest.raises(PlanningError) as info:
        _pp_plan(f"{MODELS / 'mixers.py'}:build_{kind}", seq_len=8)
    message = str(info.value)
    assert "\n" not in message
    assert f"layer {layer} ({cls}) is called with a mask that no op reads" in message, message
    assert "is_causal=False" in message and "--mesh pp=1" in message, message
    assert "RuntimeError" not in message and "storage_offset" not in message, message


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("kind", CUT)
def test_mixers_and_unhinted_torch_layers_verify_at_pp2(kind: str, tmp_path: Path) -> None:
    plan = _pp_plan(f"{MODELS / 'mixers.py'}:build_{kind}", seq_len=8)
    assert plan.mesh.pp == 2 and len(plan.stages) == 2, plan.stages
    _run_verified(plan, tmp_path)
