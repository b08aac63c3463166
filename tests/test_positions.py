"""Plans that cannot run, refused at plan time (issue 25, class 8): a sequence past the model's
position table (found in the traced graph by ``ir._positions``, or stated by an HF config,
``autopar.hf.position_tables``; the rule is ``planner.request.position_rule``), and an ``hf:``
config with counts no model has (``autopar.hf.check_counts``). The CLI's view of the same cases
is in test_bad_inputs.py."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from autopar.ir import PositionTable
from autopar.ir.trace import trace
from autopar.planner.request import PlanningError, position_rule
from torch import nn

from autopar import auto_parallelize, plan_model_file
from autopar.errors import UserError

pytestmark = pytest.mark.bad_input

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "gpt.py"
HF = ROOT / "examples" / "hf"
needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="hf: models need the extra 'hf'"
)


class Lookups(nn.Module):
    """One embedding per way a forward computes its indices."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(32, 8)  # token ids: an input, not positions
        self.pos = nn.Embedding(16, 8)  # arange(T): positions from 0
        self.opt_like = nn.Embedding(18, 8)  # cumsum(ones) - 1 + 2, per sample: from 2
        self.queries = nn.Embedding(4, 8)  # arange(4) whatever T is: not positions
        self.buffered = nn.Embedding(16, 8)  # a slice of a buffer: no values on meta
        self.register_buffer("position_ids", torch.arange(16).unsqueeze(0), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        mask = torch.ones(b, t, device=idx.device)
        x = x + self.opt_like((torch.cumsum(mask, dim=1) * mask - 1).long() + 2)
        x = x + self.queries(torch.arange(4, device=idx.device)).sum(0)
        return x + self.buffered(self.position_ids[:, :t])


def test_the_trace_finds_the_tables_indexed_by_position():
    with torch.device("meta"):
        model = Lookups()
    graph = trace(model, (torch.zeros(2, 12, dtype=torch.long, device="meta"),))
    assert graph.positions == (
        PositionTable(fqn="pos", rows=16, first=0),
        PositionTable(fqn="opt_like", rows=18, first=2),
    )
    assert [t.max_seq_len for t in graph.positions] == [16, 16]


def test_the_rule_is_the_table_s_last_row():
    tables = (PositionTable("pos", 16, 0), PositionTable("wpe", 66, 2, "n_positions", 64))
    assert position_rule(tables, 16) is None
    assert position_rule(tables, None) is None
    why = position_rule(tables, 17)
    for word in ("--seq-len 17", "'pos'", "16 rows", "--seq-len <= 16", "larger table"):
        assert word in why, (word, why)
    why = position_rule(tables[1:], 70)
    for word in ("'wpe'", "66 rows", "rows 2..65", "--seq-len <= 64", "set n_positions >= 70"):
        assert word in why, (word, why)


def _gpt_module():
    spec = importlib.util.spec_from_file_location("autopar_test_gpt", GPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_api_refuses_a_sequence_past_the_table():
    """examples/gpt.py has 256 positions: the API refuses 257 with the planner's error type,
    also where the example inputs are shorter than the planned sequence."""
    gpt = _gpt_module()
    with torch.device("meta"):
        model = gpt.build_model()
    kwargs = {"global_batch": 4, "model_file": str(GPT)}
    with pytest.raises(PlanningError, match=r"'pos_emb'.*--seq-len <= 256"):
        auto_parallelize(model, "cpu:2", seq_len=257, **kwargs)
    short = (torch.zeros(2, 16, dtype=torch.long),)
    with pytest.raises(PlanningError, match=r"--seq-len 300: .*'pos_emb'"):
        auto_parallelize(model, "cpu:2", seq_len=300, example_inputs=short, **kwargs)


def _write_config(tmp_path: Path, base: str | dict, **edits) -> str:
    config = json.loads((HF / f"{base}.json").read_text()) if isinstance(base, str) else base
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**config, **edits}))
    return f"hf:{path}"


OPT = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "vocab_size": 256,
    "hidden_size": 64,
    "word_embed_proj_dim": 64,
    "num_hidden_layers": 2,
    "ffn_dim": 128,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
ROBERTA = {
    "architectures": ["RobertaForMaskedLM"],
    "model_type": "roberta",
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "max_position_embeddings": 66,
    "pad_token_id": 1,
    "tie_word_embeddings": False,
}


@needs_transformers
@pytest.mark.parametrize(
    ("base", "table"),
    [
        ("tiny-gpt2", ("transformer.wpe", 64, 0)),
        ("tiny-bert", ("bert.embeddings.position_embeddings", 64, 0)),
        (OPT, ("model.decoder.embed_positions", 66, 2)),
        (ROBERTA, ("roberta.embeddings.position_embeddings", 66, 2)),
        ("tiny-llama", None),
    ],
    ids=["gpt2", "bert", "opt", "roberta", "llama"],
)
def test_hf_tables_end_where_transformers_fails(base, table, tmp_path):
    """The limit an HF config states is the one transformers enforces on real tensors: a
    forward at the table's longest sequence runs, one token more fails. A RoPE model (Llama)
    has no table and runs past ``max_position_embeddings``: not refused."""
    from autopar.hf import build_model, load_config, position_tables

    torch.manual_seed(0)
    model = build_model(load_config(_write_config(tmp_path, base)))
    tables = position_tables(model)
    assert [(t.fqn, t.rows, t.first) for t in tables] == ([table] if table else [])
    longest = tables[0].max_seq_len if tables else 4 * model.config.max_position_embeddings
    with torch.no_grad():
        model(input_ids=torch.randint(2, 200, (1, longest)))
        if tables:
            with pytest.raises((IndexError, RuntimeError)):
                model(input_ids=torch.randint(2, 200, (1, longest + 1)))


@needs_transformers
def test_hf_plans_are_refused_before_the_trace(tmp_path):
    """BERT's trace fails past its table (on a slice of its position buffer): the config's limit
    refuses the plan first, through plan_model_file and auto_parallelize alike."""
    from autopar.hf import build_model, load_config
    from autopar.model_file import load_model_file

    with pytest.raises(PlanningError, match=r"--seq-len <= 64, or set max_position_embeddings"):
        plan_model_file(load_model_file("hf:tiny-bert"), "cpu:2", global_batch=4, seq_len=65)
    with torch.device("meta"):
        model = build_model(load_config("hf:tiny-gpt2"))
    with pytest.raises(PlanningError, match=r"'transformer.wpe'.*set n_positions >= 65"):
        auto_parallelize(model, "cpu:2", global_batch=4, seq_len=65, model_file="hf:tiny-gpt2")


@needs_transformers
@pytest.mark.parametrize(
    ("base", "edit", "words"),
    [
        ("tiny-gpt2", {"n_layer": -2}, ["n_layer -2", "num_hidden_layers", "positive integer"]),
        ("tiny-llama", {"num_attention_heads": 0}, ["num_attention_heads 0", "positive"]),
        ("tiny-llama", {"num_key_value_heads": -1}, ["num_key_value_heads -1"]),
        ("tiny-bert", {"vocab_size": 0}, ["vocab_size 0", "positive integer"]),
        ("tiny-gpt2", {"n_embd": -64}, ["n_embd -64", "hidden_size"]),
        ("tiny-bert", {"intermediate_size": -1}, ["intermediate_size -1"]),
        ("tiny-bert", {"type_vocab_size": -2}, ["type_vocab_size -2", "integer >= 0"]),
        ("tiny-llama", {"head_dim": -16}, ["head_dim -16", "integer >= 0"]),
    ],
)
def test_hf_configs_with_impossible_counts_are_refused(base, edit, words, tmp_path):
    """Each refused by load_config, before a model is built, with the project's error type: the
    CLI (``plan hf:...``) and the Python API (``load_model_file("hf:...")``) alike."""
    from autopar.hf import HFError
    from autopar.model_file import load_model_file

    spec = _write_config(tmp_path, base, **edit)
    with pytest.raises(HFError) as caught:
        load_model_file(spec)
    assert isinstance(caught.value, UserError)
    message = str(caught.value)
    assert "\n" not in message and "set " in message
    for word in words:
        assert word in message, (word, message)


@needs_transformers
def test_counts_a_family_allows_still_load(tmp_path):
    """Zero where a count may be zero (BERT without token types), a family's own negative
    default (DeBERTa's max_relative_positions -1), and every built-in config."""
    from autopar.hf import load_config

    load_config(_write_config(tmp_path, "tiny-bert", type_vocab_size=0))
    load_config(_write_config(tmp_path, {"model_type": "deberta-v2"}, max_relative_positions=-1))
    for path in sorted(HF.glob("*.json")):
        load_config(f"hf:{path}")
