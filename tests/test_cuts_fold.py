"""The pipeline cut check on the folded model (autopar._cuts): a run of identical blocks is
checked with its first two blocks, cut at the images of the plan's boundaries; a refusal, or a
folded forward that does not run, sends the check to the whole model, so what it refuses is
what the whole model refuses."""

from __future__ import annotations

import torch
from autopar.ir._fold import find_folds
from torch import nn

from autopar._cuts import StageCutter, folded_stages

DIM, VOCAB, SEQ = 16, 32, 8


class Block(nn.Module):
    calls = 0  # forwards of blocks 2.. (the ones the folded check must not run)

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.index >= 2:
            Block.calls += 1
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    """embed, 8 identical blocks (a ModuleList the trace folds), head; ``by_count``: the
    forward indexes the blocks by a configured count (it cannot run with two of them);
    ``tied``: the head shares the embedding's weight."""

    def __init__(self, by_count: bool = False, tied: bool = False) -> None:
        super().__init__()
        self.n_layers, self.by_count = 8, by_count
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(i) for i in range(self.n_layers))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        blocks = [self.blocks[i] for i in range(self.n_layers)] if self.by_count else self.blocks
        for block in blocks:
            h = block(h)
        return self.head(h)


LAYERS = ["embed", *(f"blocks.{i}" for i in range(8)), "head"]


def _split(*bounds: int) -> list[list[str]]:
    edges = [0, *bounds, len(LAYERS)]
    return [LAYERS[a:b] for a, b in zip(edges, edges[1:])]


def _cutter(model: nn.Module, fold: bool = True) -> StageCutter:
    return StageCutter(model, (torch.zeros(2, SEQ, dtype=torch.long, device="meta"),), fold=fold)


def _meta(**kw) -> Net:
    with torch.device("meta"):
        return Net(**kw)


def test_boundaries_inside_a_run_stand_as_the_boundary_between_its_first_two_blocks() -> None:
    folds = find_folds(_meta())
    assert [(f.fqn, f.start, f.count) for f in folds] == [("blocks", 0, 8)]
    few = ["embed", "blocks.0", "blocks.1", "head"]
    # pp=4: embed+blocks.0-1 | blocks.2-4 | blocks.5-7 | head
    assert folded_stages(LAYERS, _split(3, 6, 9), folds) == (
        few,
        [["embed", "blocks.0"], ["blocks.1"], ["head"]],
    )
    # cuts before the run's first block and after its last stay where they are
    assert folded_stages(LAYERS, _split(1, 9), folds) == (
        few,
        [["embed"], ["blocks.0", "blocks.1"], ["head"]],
    )
    assert folded_stages(LAYERS, _split(2), folds) == (
        few,
        [["embed", "blocks.0"], ["blocks.1", "head"]],
    )
    assert folded_stages(LAYERS[:3], [LAYERS[:2], LAYERS[2:3]], folds) is None  # nothing folds
    assert folded_stages(LAYERS, [LAYERS[:2], LAYERS[3:]], folds) is None  # not the layers


def test_a_plan_that_cuts_is_checked_on_two_blocks() -> None:
    model = _meta()
    stages = _split(3, 6, 9)
    Block.calls = 0
    cutter = _cutter(model)
    assert cutter.check(LAYERS, stages) is None
    assert Block.calls == 0 and cutter._program is None  # the whole model never ran
    assert len(model.blocks) == 8  # restored
    assert _cutter(model, fold=False).check(LAYERS, stages) is None
    assert Block.calls > 0


def test_a_forward_that_needs_every_block_is_checked_whole() -> None:
    model = _meta(by_count=True)
    cutter = _cutter(model)
    assert cutter.check(LAYERS, _split(3, 6, 9)) is None
    assert cutter._program is not None  # the folded forward failed: the whole model decided


def test_what_the_whole_model_refuses_is_refused() -> None:
    """embed and head share a weight: any cut between them is refused, with the whole model's
    words (the folded check refuses too and hands over)."""
    model = _meta(tied=True)
    for stages in (_split(5), _split(1, 9)):
        why = _cutter(model).check(LAYERS, stages)
        assert why is not None and why == _cutter(model, fold=False).check(LAYERS, stages)
        assert "head.weight is tied to embed.weight" in why
