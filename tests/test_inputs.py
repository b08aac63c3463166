"""Models as people write them: inputs and outputs of any pytree shape, dropout, and the API
called with real example inputs.

- A forward taking a dict (``forward(batch)``) or keyword inputs (make_batch returns a dict:
  ``forward(**inputs)``), returning a dict or ``(logits, aux_loss)``: planned, and the emitted
  script moves and slices every tensor of the batch (data-parallel ranks, accumulation
  microbatches) and hands loss_fn the output as the forward returns it. Pipeline plans of such
  models are refused at plan time with one line.
- Dropout: ``--verify`` runs the sharded run and the reference with dropout off and says so;
  training keeps it, each data-parallel rank with its own masks and TP peers with the same.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _plans import VERIFY_DROPOUT, run_bounded, verify_dropout_off
from autopar.codegen import write_outputs
from autopar.codegen.apply import runtime
from autopar.planner.request import PlanningError

from autopar.api import plan_model_file
from autopar.model_file import ModelFileError, load_model_file

MODELS = Path(__file__).resolve().parent / "models"
DICT_MODEL = str(MODELS / "dict_inputs.py")
BIN = Path(sys.executable).parent
TIMEOUT_S = 300

KWARGS_MODEL = """
import torch
import torch.nn.functional as F
from torch import nn


class KwNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))
        self.gate = nn.Linear(32, 1)
        self.head = nn.Linear(32, 64)

    def forward(self, input_ids, attention_mask=None, scale=1.0):
        x = self.emb(input_ids) * scale
        if attention_mask is not None:
            x = x * attention_mask.unsqueeze(-1)
        for block in self.blocks:
            x = x + torch.relu(block(x))
        return self.head(x), self.gate(x).pow(2).mean()


def build_model():
    return KwNet()


def make_batch(batch_size, seq_len=8):
    ids = torch.randint(0, 64, (batch_size, seq_len + 1))
    mask = (torch.rand(batch_size, seq_len) > 0.2).float()
    return {"input_ids": ids[:, :-1], "attention_mask": mask, "scale": 0.5}, ids[:, 1:]
"""
KWARGS_LOSS = """

def loss_fn(output, target):
    logits, aux = output
    return F.cross_entropy(logits.flatten(0, -2), target.flatten()) + aux
"""


def _plan(spec: str, mesh, cluster: str = "cpu:2", **kw):
    return plan_model_file(
        load_model_file(spec), cluster, global_batch=8, seq_len=16, mesh=mesh, optimizer="sgd",
        **kw,
    )  # fmt: skip


# -- the contract, at plan time ----------------------------------------------------------------


def test_dict_and_keyword_models_plan_and_refuse_pipelines_in_one_line(tmp_path: Path) -> None:
    kwargs_file = tmp_path / "kw.py"
    kwargs_file.write_text(KWARGS_MODEL + KWARGS_LOSS)
    lines = []
    for spec in (DICT_MODEL, str(kwargs_file)):
        with pytest.raises(PlanningError) as e:
            _plan(spec, {"pp": 2})
        lines.append(str(e.value))
        assert "\n" not in lines[-1] and "pipeline stages pass tensors" in lines[-1], lines[-1]
    plan = _plan(DICT_MODEL, None)  # the free search never picks a pipeline for it
    assert plan.mesh.pp == 1 and "blocks.1" in plan.layers, plan
    assert "takes a dict argument" in lines[0], lines[0]
    assert "takes keyword inputs (input_ids, attention_mask, scale)" in lines[1], lines[1]
    # --why-not pp=2 answers with the same rule, a verdict, not a pipeline plan
    from autopar.api import why_not

    w = why_not(plan, "pp=2")
    assert w.forced is None and "pipeline stages pass tensors" in w.verdict, w.verdict


def test_several_outputs_need_a_loss_fn_and_every_tensor_the_batch_dim(tmp_path: Path) -> None:
    no_loss = tmp_path / "no_loss.py"
    no_loss.write_text(KWARGS_MODEL)
    with pytest.raises(ModelFileError) as e:  # a UserError: the CLI's one line and exit 2
        _plan(str(no_loss), {"dp": 2})
    line = str(e.value)
    assert "\n" not in line and "returns 2 tensors" in line, line
    assert "define loss_fn(output, target)" in line, line
    shared = tmp_path / "shared.py"
    shared.write_text(
        KWARGS_MODEL.replace('"attention_mask": mask', '"attention_mask": mask[:1]') + KWARGS_LOSS
    )
    with pytest.raises(ModelFileError) as e:
        _plan(str(shared), None)
    line = str(e.value)
    assert "\n" not in line and "inputs['attention_mask'] of shape (1, 16)" in line, line
    assert "batch size (2) as its first dim" in line, line


# -- the runtime's batch helpers (what the emitted script runs) ----------------------------------


def test_runtime_moves_slices_and_splits_batches_leaf_by_leaf() -> None:
    rt = runtime()
    ids = torch.arange(24).reshape(8, 3)
    batch = (({"ids": ids, "pair": [ids * 2, None], "scale": 0.5, "t": torch.tensor(3.0)},), ids)

    class Consts:
        GLOBAL_BATCH, data_parallel, BATCH_SHARES = 8, 4, None

    (inputs,), target = rt.local_slice(Consts, batch, 2)
    assert torch.equal(inputs["ids"], ids[4:6]) and torch.equal(inputs["pair"][0], ids[4:6] * 2)
    assert inputs["pair"][1] is None and inputs["scale"] == 0.5 and inputs["t"].item() == 3.0
    assert torch.equal(target, ids[4:6])
    pieces = rt.batch_split(batch, 2)
    assert [p[0][0]["ids"].shape[0] for p in pieces] == [4, 4]
    assert torch.equal(torch.cat([p[1] for p in pieces]), ids)
    assert rt.device_of(batch) == torch.device("cpu") and rt.device_of((None,)).type == "cpu"
    # keyword inputs call forward(**inputs); positional ones forward(*inputs)
    assert rt.call(lambda a, b=0: a + b, {"a": 1, "b": 2}) == 3 and rt.call(lambda a: a, (5,)) == 5
    # make_dataset samples of dicts collate into one dict batch
    items = [({"ids": ids[i], "m": ids[i] > 3}, ids[i]) for i in range(3)]
    stacked, targets = rt.collate(items)
    assert torch.equal(stacked["ids"], ids[:3]) and torch.equal(targets, ids[:3])
    assert isinstance(rt.collate([((ids[0], ids[1]), ids[0])])[0], tuple)
    # the default loss takes a single-tensor output in any container; several need loss_fn
    logits = torch.randn(2, 3, 5)
    target5 = torch.randint(0, 5, (2, 3))
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target5.flatten())
    assert torch.equal(rt.default_loss({"logits": logits, "cache": None}, target5), expected)


def test_dropout_off_turns_off_every_kind_of_dropout_and_nothing_else() -> None:
    rt = runtime()
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    q = k = v = torch.randn(1, 2, 4, 8)
    off = rt.DropoutOff()
    with off:
        assert torch.equal(torch.nn.Dropout(0.5).train()(x), x)
        assert torch.equal(torch.nn.functional.dropout(x, p=0.3, training=True), x)
        assert torch.equal(torch.dropout(x, 0.3, True), x)
        assert torch.equal(
            torch.nn.Dropout2d(0.5).train()(x[None, :, :, None]), x[None, :, :, None]
        )
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.9)
        b = torch.nn.functional.scaled_dot_product_attention(q, k, v, None, 0.9)
        torch.nn.functional.dropout(x, p=0.0, training=True)  # p=0: not counted
        y = torch.nn.functional.gelu(x)  # other ops run as they are
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert torch.equal(a, reference) and torch.equal(b, reference)
    assert torch.equal(y, torch.nn.functional.gelu(x)) and off.seen == 6
    assert not torch.equal(torch.nn.functional.dropout(x, p=0.5, training=True), x)  # outside
    seeds = {rt.step_seed(0, step, r) for step in (1, 2) for r in (0, 1)}
    assert len(seeds) == 4  # per step and per data-parallel rank


# -- the emitted program -----------------------------------------------------------------------


@pytest.mark.dist
def test_dict_model_with_dropout_verifies_under_fsdp_accumulation_checkpointing(
    tmp_path: Path,
) -> None:
    """The one default-tier launch: a dict in, a dict out, dropout everywhere; fsdp=2 with two
    accumulation microbatches per step (every leaf sliced per rank and per microbatch), every
    layer checkpointed (its recomputation in backward runs with dropout off too)."""
    plan = _plan(DICT_MODEL, {"fsdp": 2}, microbatches=2, checkpoint="full")
    assert plan.schedule.num_microbatches == 2
    assert {plan.checkpointing[f"blocks.{i}"] for i in range(2)} == {"full"}, plan.checkpointing
    verify_dropout_off(plan, tmp_path / "out", TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("mesh", [{"tp": 2}, {"dp": 2}])
def test_dict_model_verifies_under_tp_and_dp(mesh, tmp_path: Path) -> None:
    plan = _plan(DICT_MODEL, mesh)
    if "tp" in mesh:  # attention and MLP really sharded
        styles = plan.tensor_parallel
        assert {styles[f"blocks.0.attn.{p}"] for p in "qkv"} == {"colwise"}, styles
        assert styles["blocks.0.attn.o"] == styles["blocks.0.down"] == "rowwise", styles
    verify_dropout_off(plan, tmp_path / "out", TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.dist
def test_keyword_model_with_tuple_output_verifies_under_dp(tmp_path: Path) -> None:
    model = tmp_path / "kw.py"
    model.write_text(KWARGS_MODEL + KWARGS_LOSS)
    out = write_outputs(_plan(str(model), {"dp": 2}), tmp_path / "out")
    rc, text = run_bounded(
        ["bash", "launch.sh", "--steps", "3", "--verify", "--optimizer", "sgd"], out, TIMEOUT_S,
        DIST_TIMEOUT_S="120",
    )  # fmt: skip
    assert rc == 0, text[-4000:]
    m = re.search(r"^verify: ok max_loss_diff=(\S+) max_param_diff=(\S+)$", text, re.MULTILINE)
    assert m and float(m.group(1)) <= 1e-5 and float(m.group(2)) <= 1e-5, text[-4000:]


@pytest.mark.slow
@pytest.mark.dist
def test_training_dropout_masks_differ_across_dp_ranks_and_agree_across_tp_peers(
    tmp_path: Path,
) -> None:
    """dp=2 x tp=2, every sample of the batch the same (DICT_SAME_ROWS) and the same weights on
    every rank: the loss each rank computes differs between data-parallel ranks only through
    their dropout masks, and must be the same on the two TP peers of a replica."""
    plan = _plan(DICT_MODEL, {"dp": 2, "tp": 2}, cluster="cpu:4")
    out = write_outputs(plan, tmp_path / "out")
    log = tmp_path / "losses.txt"
    rc, text = run_bounded(
        ["bash", "launch.sh", "--steps", "1", "--optimizer", "sgd"], out, TIMEOUT_S,
        DIST_TIMEOUT_S="120", DICT_SAME_ROWS="1", DICT_LOSS_LOG=str(log),
    )  # fmt: skip
    assert rc == 0, text[-4000:]
    lines = [line.split() for line in log.read_text().splitlines()]
    first = {int(rank): float(loss) for rank, loss in lines}
    assert sorted(first) == [0, 1, 2, 3], lines  # one loss per rank and step
    # mesh (dp, tp): ranks 0, 1 are replica 0's TP peers, ranks 2, 3 replica 1's
    assert abs(first[0] - first[1]) < 1e-6 and abs(first[2] - first[3]) < 1e-6, first
    assert abs(first[0] - first[2]) > 1e-4, first  # dp ranks: different masks
    # and the same run without dropout gives every rank one loss (the data is the same)
    env = {"DICT_SAME_ROWS": "1", "DICT_LOSS_LOG": str(tmp_path / "off.txt")}
    rc, text = run_bounded(
        ["bash", "launch.sh", "--steps", "1", "--optimizer", "sgd", "--verify"], out, TIMEOUT_S,
        DIST_TIMEOUT_S="120", **env,
    )  # fmt: skip
    assert rc == 0 and VERIFY_DROPOUT.search(text), text[-4000:]
    off = [float(x.split()[1]) for x in (tmp_path / "off.txt").read_text().splitlines()]
    assert max(off) - min(off) < 1e-5, off


def test_api_with_real_example_inputs_for_a_meta_model() -> None:
    sys.path.insert(0, str(MODELS))
    try:
        import dict_inputs
    finally:
        sys.path.remove(str(MODELS))
    from autopar import auto_parallelize

    with torch.device("meta"):
        model = dict_inputs.build_model()
    (batch,), _ = dict_inputs.make_batch(4, 16)  # real CPU tensors
    assert not batch["input_ids"].is_meta
    plan = auto_parallelize(
        model, "cpu:2", global_batch=8, seq_len=16, example_inputs=(batch,), mesh="fsdp=2",
        model_file=DICT_MODEL,
    )  # fmt: skip
    assert plan.mesh.fsdp == 2 and "blocks.0" in plan.layers
    assert os.path.samefile(plan.model.file, DICT_MODEL)


SCRIPT = """
import torch
from torch import nn

import autopar
from autopar.api import ScriptModelError


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


with torch.device("meta"):
    model = Net()
try:
    autopar.auto_parallelize(model, "cpu:2", global_batch=4, example_inputs=(torch.randn(2, 8),))
except ScriptModelError as e:
    print("REFUSED", e)
"""


def test_a_model_class_in_the_running_script_is_refused_in_one_line(tmp_path: Path) -> None:
    script = tmp_path / "train_mine.py"
    script.write_text(SCRIPT)
    r = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("REFUSED"))
    assert "model class Net is defined in the running script" in line, line
    assert str(script) in line and "put the model class" in line, line
