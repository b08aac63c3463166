"""A model input that a pipeline stage after the first reads (a dual tower's token ids, a
decoder's input ids) crosses the stages as an integer tensor.

torch 2.13's PipelineStage infers its inputs' shapes with a first forward that runs each stage
after the first on tensors made from the metadata its predecessor sent (``torch.empty``): the
text tower of tests/models/clip_contrastive.py at pp=2 looked up uninitialized token ids and
rank 1 died with ``IndexError: index out of range in self`` before any p2p of values. The
emitted program's stages (``autopar_runtime.pipeline``) fill those tensors with zeros, an index
every embedding holds.

Each case trains 3 SGD steps at pp=2 under --verify (each fails without the fix):
- the CLIP model (one microbatch, GPipe: its contrastive loss couples the samples of a batch);
- two towers with a per-sample loss at 1F1B, 2 microbatches, where the second tower reads
  ``ids`` after the first tower, and where the first stage reads both inputs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _plans import run_bounded, tiered
from autopar.codegen import write_outputs

from autopar.api import plan_model_file
from autopar.model_file import load_model_file

CLIP = str(Path(__file__).resolve().parent / "models" / "clip_contrastive.py")
TIMEOUT_S = 300
VERIFY_OK = re.compile(r"^verify: ok max_loss_diff=(\S+) max_param_diff=(\S+)$", re.MULTILINE)

# Two towers and a per-sample loss; ``{image_call}`` decides whether the image tower (stage 0)
# reads ``ids`` too. A vocabulary of 16: uninitialized int64 entries fall outside it.
TOWERS = """
import torch
from torch import nn

PIXELS, VOCAB, SEQ, DIM = 12, 16, 4, 8


class ImageTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(PIXELS, DIM), nn.Linear(DIM, DIM)

    def forward(self, pixels, ids=None):
        x = torch.relu(self.fc1(pixels))
        if ids is not None:
            x = x + ids.float().mean(dim=1, keepdim=True) / VOCAB
        return self.fc2(x)


class TextTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, ids, image):
        return self.fc(self.embed(ids).mean(dim=1) + image)


class Towers(nn.Module):
    def __init__(self):
        super().__init__()
        self.image = ImageTower()
        self.text = TextTower()

    def forward(self, pixels, ids):
        image = {image_call}
        return self.text(ids, image)


def build_model():
    return Towers()


def make_batch(batch_size, seq_len=None):
    pixels = torch.randn(batch_size, PIXELS)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ))
    return (pixels, ids), torch.randn(batch_size, DIM)


def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output, target)
"""

CASES = {
    "clip": None,
    "text_reads_ids_later": "self.image(pixels)",
    "both_stages_read_ids": "self.image(pixels, ids)",
}


@pytest.mark.dist
@pytest.mark.parametrize(
    "name", tiered(CASES, slow={"clip", "both_stages_read_ids"})
)  # ~6-19 s each
def test_a_later_stage_reads_a_model_input(name, tmp_path: Path) -> None:
    """pp=2, stages [['image'], ['text']]: 3 SGD steps with --verify match one process."""
    if CASES[name] is None:
        path, options = CLIP, {"microbatches": 1, "schedule": "gpipe"}
    else:
        path, options = tmp_path / "towers.py", {"microbatches": 2, "schedule": "1f1b"}
        path.write_text(TOWERS.replace("{image_call}", CASES[name]))
    plan = plan_model_file(
        load_model_file(str(path)),
        "cpu:2",
        global_batch=8,
        mesh={"pp": 2},
        optimizer="sgd",
        **options,
    )
    assert [list(s) for s in plan.stages] == [["image"], ["text"]], plan.stages
    rc, text = run_bounded(
        ["bash", "launch.sh", "--steps", "3", "--verify", "--optimizer", "sgd"],
        write_outputs(plan, tmp_path / "out"),
        TIMEOUT_S,
        DIST_TIMEOUT_S="120",
    )
    assert rc == 0 and "IndexError" not in text, text[-4000:]
    m = VERIFY_OK.search(text)
    assert m and float(m.group(1)) <= 1e-5 and float(m.group(2)) <= 1e-5, text[-4000:]
