"""Context parallelism (mesh axis cp): planning, refusals, and the emitted program's numerics.

cp splits every sample's sequence over cp ranks (head-tail chunks for causal load balance);
attention all-gathers keys and values over the cp group (planner.plan.ContextParallel,
autopar_runtime's Context parallel section). Plan-level tests need no process group; the
torchrun cases compare the emitted script with the single-process model (--verify).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _plans import GPT, MLP, ROOT, run_bounded, tiered
from autopar.codegen import write_outputs
from autopar.planner.plan import PlanError

from autopar import Plan

BIN = Path(sys.executable).parent
TIMEOUT_S = 240
VERIFY_OK = re.compile(r"^verify: ok max_loss_diff=(\S+) max_param_diff=(\S+)$", re.MULTILINE)
LITERAL = str(ROOT / "tests" / "models" / "nanogpt_literal.py")


def _plan(model: str = GPT, cluster: str = "cpu:2", **kw) -> Plan:
    from autopar.api import plan_model_file
    from autopar.model_file import load_model_file

    return plan_model_file(load_model_file(model), cluster, **kw)


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [str(BIN / "plan"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_pinned_cp_plan_charges_tokens_over_cp_kv_traffic_and_gathered_kv():
    cp = _plan(global_batch=2, seq_len=64, mesh="cp=2")
    ref = _plan(global_batch=2, seq_len=64, mesh="fsdp=2")  # the same tokens per rank
    assert (cp.mesh.cp, cp.mesh.fsdp, cp.mesh.dp) == (2, 1, 1)
    assert cp.context_parallel is not None and cp.context_parallel.shard_at == "blocks.0"
    assert ref.context_parallel is None and "context_parallel" not in json.loads(ref.to_json())
    raw = json.loads(cp.to_json())
    assert raw["mesh"]["cp"] == 2 and raw["context_parallel"]["load_balance"] == "head-tail"
    assert Plan.from_json(cp.to_json()) == cp
    # parameters sharded over cp like fsdp=2; 64 tokens per rank either way, so the
    # activations differ by the gathered keys/values only: half of 4 layers' K and V (2 samples,
    # 64 tokens, dim 64, fp32), 2 x 64 x 64 x 4 bytes x 2 (K, V) x 4 layers / 2 = 128 KiB
    a, b = cp.predicted.memory_breakdown_bytes, ref.predicted.memory_breakdown_bytes
    assert (a.params, a.grads, a.optimizer) == (b.params, b.grads, b.optimizer)
    assert a.activations - b.activations == pytest.approx(2 * 64 * 64 * 4 * 2 * 4 / 2, abs=2)
    t = cp.predicted.time_breakdown_s
    assert t.cp_comm > 0 and ref.predicted.time_breakdown_s.cp_comm == 0
    assert t.total == pytest.approx(cp.predicted.step_time_s)
    assert "cp_comm" in t.parts() and "cp_comm" not in ref.predicted.time_breakdown_s.parts()
    summary = cp.summary()
    assert "cp=2" in summary and "context parallel" in summary and "head-tail" in summary
    assert "context parallel" not in ref.summary()


def test_free_search_picks_cp_for_a_long_sequence_on_gpus(monkeypatch):
    """One sample of 64k tokens on 8 H100s: no data parallelism is possible, and splitting the
    sequence beats splitting the layers (tp) or the model (pp)."""
    for k, v in dict(LAYERS=4, DIM=1024, HEADS=8, VOCAB=32000, MAX_SEQ=65536).items():
        monkeypatch.setenv(f"GPT_{k}", str(v))
    plan = _plan(cluster="8xH100", global_batch=1, seq_len=65536, dtype="bf16")
    assert plan.mesh.cp > 1 and plan.mesh.pp == 1, plan.summary()
    assert plan.predicted.peak_memory_bytes <= plan.cluster.device.memory_bytes
    assert plan.context_parallel is not None
    # it won on time against meshes without cp (scored or pruned by their lower bound)
    assert any(a.mesh.cp == 1 and a.lost_by in ("slower", "pruned") for a in plan.alternatives)


@pytest.mark.slow
def test_llama3_8b_shape_at_128k_tokens_plans_cp_and_explains_it():
    env = dict(GPT_LAYERS="32", GPT_DIM="4096", GPT_HEADS="32", GPT_VOCAB="128256")
    env["GPT_MAX_SEQ"] = "131072"
    r = _cli(GPT, "--cluster", "8xH100", "--global-batch", "1", "--seq-len", "131072",
             "--dtype", "bf16", "--explain", "--why-not", "cp=1", env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    mesh = re.search(r"^mesh\s+(\S+)", r.stdout, re.MULTILINE).group(1)
    assert "cp=" in mesh and "cp=1" not in mesh, r.stdout[:2000]
    assert "cp_comm" in r.stdout and "why not cp=1?" in r.stdout


@pytest.mark.slow
def test_hf_llama3_8b_at_128k_tokens_fits_with_cp():
    """The HF model itself (its eager causal mask: SDPA is_causal, nothing of s^2 size charged)."""
    r = _cli("hf:llama3-8b", "--cluster", "8xH100", "--global-batch", "8", "--seq-len", "131072",
             "--dtype", "bf16", "--explain")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    mesh = re.search(r"^mesh\s+(\S+)", r.stdout, re.MULTILINE).group(1)
    assert "cp=" in mesh and "cp=1" not in mesh, r.stdout[:2000]
    used, total = re.search(
        r"^memory / rank\s+([\d.]+) GiB of ([\d.]+) GiB", r.stdout, re.M
    ).groups()
    assert float(used) <= float(total)


@pytest.mark.parametrize(
    ("model", "kw", "match"),
    [
        (GPT, {"seq_len": 30, "mesh": "cp=2"}, "not divisible by 2 x cp = 4"),
        (LITERAL, {"seq_len": 32, "mesh": "cp=2"}, "explicit softmax"),
        (MLP, {"mesh": "cp=2"}, "--seq-len"),
        (GPT, {"seq_len": 32, "mesh": "cp=2,pp=2", "cluster": "cpu:4"}, "pipeline"),
    ],
    ids=["seq-not-divisible", "explicit-softmax", "no-sequence", "with-pp"],
)
def test_cp_refusals(model, kw, match):
    """One line each (the CLI prints a PlanningError as its one error line, exit 2)."""
    from autopar.planner.request import PlanningError

    with pytest.raises(PlanningError, match=match) as info:
        _plan(model, global_batch=2, **kw)
    assert "\n" not in str(info.value) and str(info.value).startswith("--mesh cp=2")


MASKED = """
import torch
import torch.nn.functional as F
from torch import nn


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 50)
        self.register_buffer("mask", torch.ones(64, 64, dtype=torch.bool).tril())

    def forward(self, idx):
        t = idx.shape[1]
        q, k, v = self.qkv(self.emb(idx)).view(idx.shape[0], t, 3, 2, 8).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=self.mask[:t, :t]
        )
        return self.out(y.transpose(1, 2).reshape(idx.shape[0], t, 16))


def build_model():
    return Masked()
"""


def test_a_mask_of_the_models_own_is_refused(tmp_path):
    """A mask tensor the model passes (here a causal buffer) is a custom mask to the chosen
    form; only a HuggingFace model's traced causal mask, absent in eager HF, is not."""
    from autopar.planner.request import PlanningError

    (tmp_path / "masked.py").write_text(MASKED)
    with pytest.raises(PlanningError, match="explicit mask"):
        _plan(str(tmp_path / "masked.py"), global_batch=2, seq_len=32, mesh="cp=2")


def test_hand_edited_plan_keeps_cp_and_its_form_together():
    raw = json.loads(_plan(global_batch=2, seq_len=64, mesh="cp=2").to_json())
    no_form = dict(raw)
    del no_form["context_parallel"]
    with pytest.raises(PlanError, match="context_parallel is missing"):
        Plan.from_json(json.dumps(no_form))
    bad = json.loads(json.dumps(raw))
    bad["context_parallel"]["shard_at"] = "blocks.9"
    with pytest.raises(PlanError, match="not a planned layer"):
        Plan.from_json(json.dumps(bad))


def _run_cp(tmp_path: Path, model: str, world: int, mesh: str, **plan_kw) -> tuple[int, str]:
    plan = _plan(model, f"cpu:{world}", global_batch=4, seq_len=64, mesh=mesh, **plan_kw)
    assert plan.mesh.cp == 2
    out = write_outputs(plan, tmp_path / "out")
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(world), "train.py"]
    return run_bounded(
        [*cmd, "--steps", "3", "--verify", "--optimizer", "sgd"],
        out,
        TIMEOUT_S,
        DIST_TIMEOUT_S="120",
    )


TINY_LLAMA = "hf:tiny-llama"  # RoPE's cos/sin reach each decoder layer as one nested argument
DIST_CASES = {
    "cp2": (GPT, 2, "cp=2", {}),
    "fsdp2-cp2-ckpt": (GPT, 4, "fsdp=2,cp=2", {"checkpoint": "full"}),
    "dp2-cp2": (GPT, 4, "dp=2,cp=2", {}),
    "hf-llama-cp2": (TINY_LLAMA, 2, "cp=2", {}),
    "cp2-tp2": (GPT, 4, "cp=2,tp=2", {}),  # attention on the local heads of each TP rank
}


@pytest.mark.dist
@pytest.mark.parametrize(
    "case", tiered(DIST_CASES, slow={"fsdp2-cp2-ckpt", "dp2-cp2", "hf-llama-cp2", "cp2-tp2"})
)
def test_emitted_cp_program_trains_like_one_process(tmp_path, case):
    model, world, mesh, kw = DIST_CASES[case]
    rc, out = _run_cp(tmp_path, model, world, mesh, **kw)
    assert rc == 0, out[-4000:]
    m = VERIFY_OK.search(out)
    assert m, out[-4000:]
    loss_diff, param_diff = float(m.group(1)), float(m.group(2))
    assert loss_diff <= 1e-5 and param_diff <= 1e-5, m.group(0)
    steps = [json.loads(x) for x in out.splitlines() if x.startswith('{"step"')]
    assert [s["step"] for s in steps] == [1, 2, 3]
    # every rank trained on half of each sample's tokens: the logged throughput counts them all
    assert all(s["tokens_per_s"] > 0 for s in steps)


@pytest.mark.parametrize("v_dim", [16, 24])  # 24: a value head dim of its own (MLA)
def test_attention_moves_keys_and_values_in_one_collective_each_way(monkeypatch, v_dim):
    """What the cost model charges per attention layer (planner.rank_memory._cp_layer): one
    all-gather of keys and values together, one reduce-scatter of their gradients. Two fake
    ranks whose other rank holds the same tensors: the gathered keys are this rank's twice,
    and each rank's gradient share is the sum of both, twice one rank's own."""
    from types import SimpleNamespace

    import torch
    from autopar.codegen.runtime.autopar_runtime import context_parallel as cpm

    calls = []

    def all_gather(parts, x, group=None):
        calls.append(("all_gather", tuple(x.shape)))
        for part in parts:
            part.copy_(x)

    def reduce_scatter_tensor(out, flat, group=None):
        calls.append(("reduce_scatter_tensor", tuple(flat.shape)))
        out.copy_(2 * flat.chunk(2)[0])

    def refused(*a, **k):
        raise AssertionError("the list form runs one all-reduce per rank on gloo")

    fake = SimpleNamespace(all_gather=all_gather, reduce_scatter_tensor=reduce_scatter_tensor,
                           reduce_scatter=refused, get_rank=lambda g=None: 0,
                           get_world_size=lambda g=None: 2)  # fmt: skip
    monkeypatch.setattr(cpm, "dist", fake)
    mesh = SimpleNamespace(get_group=lambda: None, size=lambda: 2, get_local_rank=lambda: 0)
    cp = cpm.ContextParallel(SimpleNamespace(SEQ_LEN=32), mesh)
    b, h, s = 2, 3, 16  # this rank's 16 of 32 positions
    q, k = (torch.randn(b, h, s, 16, requires_grad=True) for _ in range(2))
    v = torch.randn(b, h, s, v_dim, requires_grad=True)
    out = cp.attention(q, k, v, is_causal=True)
    assert out.shape == (b, h, s, v_dim)
    out.square().sum().backward()
    assert calls == [("all_gather", (b, h, s, 16 + v_dim)),
                     ("reduce_scatter_tensor", (2 * b * h * s * (16 + v_dim),))]  # fmt: skip
    # by hand: the other rank's copy is a constant here, and its gradient (its queries are this
    # rank's) is this rank's again: the reduce-scatter's sum is twice this rank's own
    k2, v2 = (t.detach().clone().requires_grad_() for t in (k, v))
    q2 = q.detach().clone().requires_grad_()
    kk, vv = (cp._in_order(torch.cat([t, t.detach()], 2)) for t in (k2, v2))
    from torch.nn.attention.bias import causal_lower_right

    outs = [torch.nn.functional.scaled_dot_product_attention(
        q2[:, :, i * 8 : (i + 1) * 8], kk[:, :, :end], vv[:, :, :end],
        attn_mask=causal_lower_right(8, end)) for i, end in enumerate((8, 32))]  # fmt: skip
    ref = torch.cat(outs, 2)
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(q.grad, q2.grad)
    torch.testing.assert_close(k.grad, 2 * k2.grad)
    torch.testing.assert_close(v.grad, 2 * v2.grad)


def test_plan_apply_points_cp_plans_to_the_emitted_script():
    from autopar.codegen.apply import apply

    plan = _plan(global_batch=2, seq_len=64, mesh="cp=2")
    with pytest.raises(ValueError, match="context parallelism.*train.py"):
        apply(plan, object())  # refused before the model is looked at
