"""Sequence parallelism (Megatron-LM / Korthikanti et al. 2022): norms recognised from the traced
graph whatever their class, chosen by the TP ILP with the sequence split at a layer boundary, the
all-gather before the colwise linears and the reduce-scatter after the rowwise ones; the memory
model divides what those regions save by tp; the emitted script runs it (``--verify``) with the
norms' inputs really sequence-sharded DTensors.

On 2 CPU cores the cost model never picks sequence parallelism (DTensor dispatch costs more than
the tiny collectives save), so the runs take the styles the same ILP picks for the same graph
with an H100's costs at a large batch (what it would plan on GPUs), emitted for ``cpu:N``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from _plans import APPLY_EPILOGUE, GPT, run_bounded
from autopar.codegen import write_outputs
from autopar.cost_model import parse_cluster
from autopar.ir.trace import trace
from autopar.planner import ilp
from autopar.planner.norms import norm_modules, scatter_layers
from autopar.planner.request import module_kinds
from test_codegen_dist import VERIFY_OK
from test_planner import _gpt, _graph, _meta
from torch import nn

from autopar import Plan
from autopar.api import _trace_plan_model, plan_model_file
from autopar.model_file import load_model_file

TIMEOUT_S = 300
BIN = Path(sys.executable).parent
SP_STYLES = ("sequence_parallel", "sequence_parallel_local", "sequence_parallel_gather")


# -- recognising norms -------------------------------------------------------------------------


class MyRMSNorm(nn.Module):
    """HF's LlamaRMSNorm, written out: upcast, mean of squares over the hidden dim, rsqrt."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


class SeqNorm(nn.Module):
    """Not a norm for sequence parallelism: it normalises over the sequence dim."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x - x.mean(1, keepdim=True))


class Net(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.rms = nn.RMSNorm(dim)
        self.mine = MyRMSNorm(dim)
        self.seq = SeqNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.seq(self.mine(self.rms(self.ln(x)))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_are_recognised_from_the_graph_not_by_class(dtype):
    graph = trace(_meta(Net).train(), (torch.empty(2, 8, 32, device="meta"),), dtype=dtype)
    assert set(norm_modules(graph)) == {"ln", "rms", "mine"}


@pytest.mark.slow  # ~11 s: the ILP test below covers the same recognition in the default tier
def test_hf_llama_rmsnorm_is_a_norm_and_the_first_decoder_layer_takes_the_split():
    pytest.importorskip("transformers")
    plan = plan_model_file(load_model_file("hf:tiny-llama"), "cpu:2", global_batch=4, seq_len=16)
    graph = _trace_plan_model(plan, None)
    norms = norm_modules(graph)
    assert {f"model.layers.{i}.{n}" for i in range(2) for n in ("input_layernorm", "post_attention_layernorm")} | {"model.norm"} == set(norms)  # fmt: skip
    assert set(scatter_layers(graph).values()) == {"model.layers.0"}
    kinds = plan.module_kinds
    assert kinds["model.layers.0.input_layernorm"] == "norm" and kinds["model.layers.0"] == "layer"
    # the plan's kinds come from the search's collapsed graph: the same as from the graph
    assert kinds == module_kinds(graph)
    collapsed = ilp.collapse(graph)
    assert collapsed.norm_modules == set(norms) and collapsed.scatter_modules == {"model.layers.0"}


# -- the ILP and the memory model --------------------------------------------------------------


def _h100(tp: int, scale: float = 1.0, shard_all: bool = False) -> ilp.CostInputs:
    c = parse_cluster("8xH100")
    return ilp.CostInputs(
        tp=tp,
        batch_scale=scale,
        device=c.device,
        dtype="bf16",
        tp_link=c.intra_node,
        grad_sync_s_per_byte=1e-11,
        shard_all=shard_all,
    )


def _gpt_graph(layers: int = 2, seq: int = 2048):
    model = _gpt(dim=4096, heads=32, layers=layers, vocab=32000, max_seq=seq)
    idx = torch.zeros(2, seq, dtype=torch.long, device="meta")
    return trace(model.train(), (idx,), dtype=torch.bfloat16)


def test_ilp_picks_megatron_sequence_parallelism_on_gpt():
    graph = _gpt_graph()
    sol = ilp.solve(graph, _h100(8))
    s = sol.styles
    assert s["blocks.0"] == "sequence_scatter", s  # the embeddings' sum split at the first block
    for i in range(2):
        p = f"blocks.{i}."
        # q, k and v share one all-gather (Megatron's g), not one each
        assert s[p + "ln1"] == "sequence_parallel_gather", s
        for name in ("attn.q", "attn.k", "attn.v"):
            assert s[p + name] == "colwise", s  # they read the gathered DTensor
        assert s[p + "ln2"] in SP_STYLES, s  # one reader: gathering in either module costs alike
        assert s[p + "mlp.up"] in ("colwise", "colwise_from_seq"), s
        assert s[p + "attn.o"] == s[p + "mlp.down"] == "rowwise_to_seq", s
    assert s["ln_f"] in SP_STYLES, s


def test_sequence_parallel_divides_the_norm_and_residual_activations_by_tp():
    """Per block, the ILP's activation figure under SP equals the no-SP figure less (1 - 1/tp)
    of what the norms and the residual adds save (the layers' own measurement), and the all-
    gathered inputs of the colwise linears stay whole (torch keeps the gathered DTensor)."""
    graph = _gpt_graph()
    tp = 8
    sp = ilp.solve(graph, _h100(tp))
    no_sp = _without_sp(graph, tp)
    assert not any(v in SP_STYLES for v in no_sp.styles.values()), no_sp.styles
    block = graph.layer("blocks.0")
    norms = norm_modules(graph)
    in_sp = [
        graph.node(n)
        for n in block.nodes
        if any(n in norms[f].nodes for f in ("blocks.0.ln1", "blocks.0.ln2"))
        or graph.node(n).op == "aten.add.Tensor"
    ]
    region = sum(n.saved_bytes for n in in_sp)
    assert region > 0
    expected = no_sp.activation_bytes["blocks.0"] - region * (1 - 1 / tp)
    assert sp.activation_bytes["blocks.0"] == pytest.approx(expected, rel=1e-9)


def _without_sp(graph, tp: int) -> ilp.TPSolution:
    """The ILP with every norm held replicated and no sequence split (the plan before SP)."""
    solver = ilp.Solver(graph, tp)
    for name, ts in solver.transitions.items():
        keep = [i for i, t in enumerate(ts) if t.style not in SP_STYLES and not t.scatter]
        solver.transitions[name] = [ts[i] for i in keep]
        solver.sync_bytes[name] = [solver.sync_bytes[name][i] for i in keep]
    return solver.solve(_h100(tp))


def test_ilp_picks_sequence_parallelism_for_hf_llama_rmsnorm():
    pytest.importorskip("transformers")
    plan = plan_model_file(load_model_file("hf:tiny-llama"), "cpu:2", global_batch=4, seq_len=16)
    graph = _trace_plan_model(plan, None)
    s = ilp.solve(graph, _h100(2, 4096.0)).styles
    assert s["model.layers.0"] == "sequence_scatter", s
    for i in range(2):
        for n in ("input_layernorm", "post_attention_layernorm"):
            assert s[f"model.layers.{i}.{n}"] in SP_STYLES, s
        for n in ("self_attn.o_proj", "mlp.down_proj"):
            assert s[f"model.layers.{i}.{n}"] == "rowwise_to_seq", s
    assert s["model.norm"] in SP_STYLES, s


def test_brute_force_agrees_with_sequence_parallel_choices():
    """A pre-norm MLP block stack whose input comes from a linear: the split point, the norms'
    four styles and the linears' all enumerated."""

    class Block(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(d)
            self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(self.ln(x))))

    class Stack(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.inp = nn.Linear(d, d)
            self.blocks = nn.ModuleList(Block(d) for _ in range(2))
            self.out = nn.Linear(d, 8)

        def forward(self, x):
            x = self.inp(x)
            for b in self.blocks:
                x = b(x)
            return self.out(x)

    graph = _graph(_meta(Stack, 1024), 2, 1024, 1024)
    k = _h100(2, 16.0)
    sol = ilp.solve(graph, k)
    best_ns, styles = ilp.brute_force(graph, k)
    assert sol.objective_ns == best_ns, (sol.styles, styles)
    assert sol.styles.get("blocks.0") == "sequence_scatter", sol.styles


# -- emitted runs ------------------------------------------------------------------------------


def _sp_plan(spec: str, cluster: str, mesh: dict[str, int], optimizer: str) -> Plan:
    """The plan for ``cluster`` with the TP styles the ILP picks for this graph on H100 costs."""
    plan = plan_model_file(
        load_model_file(spec), cluster, global_batch=8, seq_len=16, mesh=mesh, optimizer=optimizer
    )
    graph = _trace_plan_model(plan, None)
    styles = ilp.solve(graph, _h100(mesh["tp"], 4096.0, shard_all=True)).styles
    plan = Plan.from_json(plan.model_copy(update={"tensor_parallel": styles}).to_json())
    norms = [f for f, k in (plan.module_kinds or {}).items() if k == "norm"]
    assert norms and all(plan.tensor_parallel[f] in SP_STYLES for f in norms), plan.tensor_parallel
    assert "sequence_scatter" in plan.tensor_parallel.values()
    return plan


def _verify(plan: Plan, tmp_path: Path, optimizer: str) -> None:
    out = write_outputs(plan, tmp_path / "out")
    rc, text = run_bounded(
        ["bash", "launch.sh", "--steps", "2", "--optimizer", optimizer, "--verify"],
        out,
        TIMEOUT_S,
        DIST_TIMEOUT_S="120",
    )
    assert rc == 0, text[-4000:]
    m = VERIFY_OK.search(text)
    assert m, text[-4000:]
    tol = 1e-5 if optimizer == "sgd" else 2e-3  # AdamW amplifies 1e-8 gradient noise
    assert float(m.group(1)) <= 1e-5 and float(m.group(2)) <= tol, m.group(0)


HF_LLAMA = "hf:tiny-llama"
RUNS = {
    "gpt-tp2-sgd": (GPT, "cpu:2", {"tp": 2}, "sgd"),
    "gpt-tp2-fsdp2-adamw": (GPT, "cpu:4", {"tp": 2, "fsdp": 2}, "adamw"),
    "gpt-tp2-adamw": (GPT, "cpu:2", {"tp": 2}, "adamw"),
    "llama-tp2-sgd": (HF_LLAMA, "cpu:2", {"tp": 2}, "sgd"),
    "llama-tp2-fsdp2-sgd": (HF_LLAMA, "cpu:4", {"tp": 2, "fsdp": 2}, "sgd"),
    "llama-tp2-fsdp2-adamw": (HF_LLAMA, "cpu:4", {"tp": 2, "fsdp": 2}, "adamw"),
}
# the default tier runs the first (one torchrun launch); the others are in the slow tier
RUN_PARAMS = [
    pytest.param(case, marks=() if i == 0 else pytest.mark.slow) for i, case in enumerate(RUNS)
]


@pytest.mark.dist
@pytest.mark.parametrize("case", RUN_PARAMS)
def test_sequence_parallel_script_verifies(case, tmp_path: Path) -> None:
    spec, cluster, mesh, optimizer = RUNS[case]
    if spec.startswith("hf:"):
        pytest.importorskip("transformers")
    _verify(_sp_plan(spec, cluster, mesh, optimizer), tmp_path, optimizer)


SHOW_NORM_INPUTS = (
    """
import importlib.util, json, os, sys
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from autopar import Plan

plan = Plan.load(sys.argv[1])
if plan.model.file.startswith("hf:"):
    from autopar.hf import build_model, load_config, make_batch
    config = load_config(plan.model.file)
    build = lambda: build_model(config)
    batch = lambda: make_batch(config, 4, 16)
else:
    spec = importlib.util.spec_from_file_location("user_model", plan.model.file)
    user_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(user_model)
    build, batch = user_model.build_model, lambda: user_model.make_batch(4, 16)
torch.manual_seed(0)
model = plan.apply(build())
inner = getattr(model, "module", model)
rows = {}

def hook(fqn):
    def record(mod, args, out):
        x = args[0]
        rows[fqn] = {
            "input": type(x).__name__,
            "seq_shard": [p.is_shard(1) for p in x.placements] if isinstance(x, DTensor) else [],
            "local_seq": (x.to_local() if isinstance(x, DTensor) else x).shape[1],
            "weight_replicated": [p.is_replicate() for p in mod.weight.placements],
        }
    return record

for fqn, style in plan.tensor_parallel.items():
    if style.startswith("sequence_parallel"):
        inner.get_submodule(fqn).register_forward_hook(hook(fqn))
torch.manual_seed(1)
(args, target) = batch()
model(*args)
if dist.get_rank() == 0:
    print("NORMS " + json.dumps(rows), flush=True)
"""
    + APPLY_EPILOGUE
)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("spec", [GPT, HF_LLAMA])
def test_norm_inputs_are_sequence_sharded_dtensors(spec, tmp_path: Path) -> None:
    """plan.apply on tp=2 x fsdp=2: every norm the plan styles sees a DTensor split along the
    sequence (8 of 16 positions per rank) and holds a replicated weight."""
    if spec.startswith("hf:"):
        pytest.importorskip("transformers")
    plan = _sp_plan(spec, "cpu:4", {"tp": 2, "fsdp": 2}, "sgd")
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    script = tmp_path / "show_norms.py"
    script.write_text(SHOW_NORM_INPUTS)
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "4"]
    rc, text = run_bounded([*torchrun, str(script), str(path)], tmp_path, TIMEOUT_S)
    assert rc == 0, text[-4000:]
    line = next(x for x in text.splitlines() if x.startswith("NORMS "))
    rows = json.loads(line[len("NORMS ") :])
    styled = [f for f, s in plan.tensor_parallel.items() if s in SP_STYLES]
    assert set(rows) == set(styled) and len(styled) >= 5
    for fqn, row in rows.items():
        assert row["input"] == "DTensor" and row["seq_shard"] == [True], (fqn, row)
        assert row["local_seq"] == 8, (fqn, row)
        # replicated on the tp mesh dim (the last; a root FSDP unit's weight is also still
        # sharded on fsdp when the hook sees it)
        assert row["weight_replicated"][-1] is True, (fqn, row)
