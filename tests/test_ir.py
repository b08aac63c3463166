"""Tier 1 (pure): the model-file contract, tracing to the IR, FLOPs, parameters and layers."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from autopar.ir import Ref, TraceError, trace
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from autopar.model_file import ModelFileError, build_on_meta, example_inputs, load_model_file

GPT_FILE = Path(__file__).resolve().parents[1] / "examples" / "gpt.py"
MLP_FILE = Path(__file__).resolve().parents[1] / "examples" / "mlp.py"
B, T = 2, 16


@pytest.fixture(scope="module")
def gpt():
    """(model file, model on meta, graph) for examples/gpt.py at batch B, seq T."""
    mf = load_model_file(str(GPT_FILE))
    model = build_on_meta(mf)
    args, _ = example_inputs(mf, model, B, T)
    return mf, model, trace(model, args)


def write(tmp_path: Path, text: str, name: str = "model.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def line_of(path: str, needle: str) -> int:
    return next(
        i for i, line in enumerate(Path(path).read_text().splitlines(), 1) if needle in line
    )


# --- model files ------------------------------------------------------------------------------


def test_load_gpt_model_file():
    mf = load_model_file(f"{GPT_FILE}:build_model")
    assert mf.path == str(GPT_FILE)
    assert mf.factory == "build_model"
    assert mf.make_batch is not None and mf.loss_fn is None
    assert mf.module.__name__.startswith("_autopar_model_gpt_")
    model = build_on_meta(mf)
    assert model.training
    assert all(p.is_meta for p in model.parameters())
    (idx,), target = example_inputs(mf, model, 3, 8)
    assert idx.is_meta and target.is_meta
    assert idx.shape == target.shape == (3, 8)


def test_named_factory_and_sibling_import(tmp_path):
    write(tmp_path, "WIDTH = 6\n", name="sizes.py")
    path = write(
        tmp_path,
        """
        from torch import nn
        from sizes import WIDTH

        def tiny():
            return nn.Linear(WIDTH, 2)
        """,
    )
    mf = load_model_file(f"{path}:tiny")
    assert mf.factory == "tiny"
    assert build_on_meta(mf).in_features == 6


def test_default_batch_is_token_ids(tmp_path):
    path = write(
        tmp_path, "from torch import nn\ndef build_model():\n    return nn.Embedding(9, 4)\n"
    )
    mf = load_model_file(path)
    model = build_on_meta(mf)
    (ids,), target = example_inputs(mf, model, 2, 5)
    assert ids.dtype == torch.int64 and ids.shape == (2, 5) and target.shape == (2, 5)
    with pytest.raises(ModelFileError, match="define make_batch.*or pass --seq-len"):
        example_inputs(mf, model, 2, None)


BAD_FILES = {
    "syntax": ("def build_model(:\n    pass\n", "line 1"),
    "import": ("import torch\nraise KeyError('boom')\n", "KeyError: 'boom'"),
    "no_factory": ("def other():\n    pass\n", "'build_model' is not defined"),
    "factory_raises": (
        "def build_model():\n    x = 1\n    return x / 0\n",
        "ZeroDivisionError: division by zero at model.py:3 (return x / 0)",
    ),
    "not_module": ("def build_model():\n    return 42\n", "returned int, not a torch.nn.Module"),
    "bad_batch": (
        "from torch import nn\ndef build_model():\n    return nn.Linear(2, 2)\n"
        "def make_batch(b, s=None):\n    return [1, 2, 3]\n",
        "make_batch() in",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_model_files(tmp_path, case):
    text, expected = BAD_FILES[case]
    path = write(tmp_path, text)
    with pytest.raises(ModelFileError) as err:
        mf = load_model_file(path)
        example_inputs(mf, build_on_meta(mf), 2, 4)
    msg = str(err.value)
    assert "\n" not in msg
    assert expected in msg
    assert path in msg


def test_missing_and_non_python_files(tmp_path):
    missing = str(tmp_path / "nope.py")
    with pytest.raises(ModelFileError, match="does not exist: pass the path") as err:
        load_model_file(missing)
    assert missing in str(err.value)
    txt = tmp_path / "model.txt"
    txt.write_text("x = 1\n")
    with pytest.raises(ModelFileError, match=r"model\.txt' is not a \.py file"):
        load_model_file(str(txt))


# --- the GPT example ---------------------------------------------------------------------------


def test_gpt_layers(gpt):
    mf, _, g = gpt
    blocks = [f"blocks.{i}" for i in range(mf.module.LAYERS)]
    assert [layer.fqn for layer in g.layers] == ["tok_emb", "pos_emb", *blocks, "ln_f", "head"]
    assert all(layer.is_module for layer in g.layers)
    assert g.batch_size == B and g.seq_len == T
    assert g.root_type.endswith(".GPT")
    sigs = {layer.fqn: layer.signature for layer in g.layers}
    assert len({sigs[b] for b in blocks}) == 1
    others = [sigs[f] for f in ("tok_emb", "pos_emb", "ln_f", "head")]
    assert len(set(others)) == 4 and sigs["blocks.0"] not in others
    assert g.distinct_layers()[sigs["blocks.0"]] == blocks
    # root-level ops join a neighbouring layer: arange the following one, the add the preceding
    assert g.layer("tok_emb").nodes == ("arange", "embedding")
    assert g.layer("pos_emb").nodes == ("embedding_1", "add")


def test_gpt_params(gpt):
    _, model, g = gpt
    for layer in g.layers:
        params = list(model.get_submodule(layer.fqn).parameters())
        assert layer.param_numel == sum(p.numel() for p in params)
        assert layer.param_bytes == 4 * layer.param_numel
    assert g.num_params == sum(p.numel() for p in model.parameters())
    params = [n for n in g.nodes if n.kind == "param"]
    assert [n.params[0] for n in params] == [name for name, _ in model.named_parameters()]
    assert g.modules["blocks.0.attn"].int_attrs == {"n_head": 4, "head_dim": 16}
    assert g.modules["blocks.0.attn.q"].params["weight"].shape == (64, 64)
    assert g.modules["blocks"].children == tuple(f"blocks.{i}" for i in range(len(model.blocks)))


def test_gpt_q_linear(gpt):
    mf, _, g = gpt
    dim = mf.module.DIM
    (q,) = [n for n in g.nodes if n.kind == "compute" and "blocks.0.attn.q.weight" in n.params]
    assert q.op == "aten.linear.default"
    assert q.module_stack == ("blocks.0", "blocks.0.attn", "blocks.0.attn.q")
    assert q.module_type == "torch.nn.modules.linear.Linear"
    assert q.layer == "blocks.0"
    assert q.params == ("blocks.0.attn.q.weight", "blocks.0.attn.q.bias")
    assert q.fwd_flops == 2 * B * T * dim * dim
    assert q.bwd_flops == 2 * q.fwd_flops
    assert q.out.shape == (B, T, dim) and q.out.dtype == "float32"
    assert q.source == "gpt.py:40: q = self.q(x).view(b, t, -1, self.head_dim).transpose(1, 2)"
    (view,) = [g.node(u) for u in g.users[q.name]]
    assert view.op == "aten.view.default" and view.args == (Ref(q.name), (B, T, -1, 16))
    assert view.fwd_flops == 0


def test_gpt_sdpa_flops_match_flop_counter(gpt):
    _, _, g = gpt
    sdpa = next(n for n in g.nodes if n.op == "aten.scaled_dot_product_attention.default")
    q, k, v = (torch.empty(g.node(r.name).out.shape, device="meta") for r in sdpa.args[:3])
    with FlopCounterMode(display=False) as counter:
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert sdpa.fwd_flops == counter.get_total_flops() > 0
    assert sdpa.bwd_flops * 2 == 5 * sdpa.fwd_flops


def test_gpt_matmul_flops_match_flop_counter(gpt):
    _, model, g = gpt
    with FlopCounterMode(display=False) as counter:
        model(torch.zeros(B, T, dtype=torch.long, device="meta"))
    matmuls = ("aten.linear.default", "aten.scaled_dot_product_attention.default")
    assert sum(n.fwd_flops for n in g.nodes if n.op in matmuls) == counter.get_total_flops()
    assert g.fwd_flops == sum(layer.fwd_flops for layer in g.layers)


def test_gpt_activation_bytes_skip_views(gpt):
    _, _, g = gpt
    head = g.layer("head")
    assert head.activation_bytes == g.node(head.nodes[0]).out.num_bytes
    block = g.layer("blocks.0")
    views = {"aten.view.default", "aten.transpose.int"}
    expected = sum(g.node(n).out.num_bytes for n in block.nodes if g.node(n).op not in views)
    assert block.activation_bytes == expected


def test_ir_holds_no_torch_objects(gpt):
    _, _, g = gpt
    plain = (Ref, str, int, float, bool, type(None))

    def check(value):
        if isinstance(value, tuple):
            for v in value:
                check(v)
        else:
            assert isinstance(value, plain), value

    for n in g.nodes:
        check(n.args)
        check(n.kwargs)
    assert dict(g.node("arange").kwargs)["device"] == "meta"
    assert [n.kind for n in g.nodes][-1] == "output"
    assert g.to_networkx().number_of_nodes() == len(g.nodes)


# --- other models ------------------------------------------------------------------------------


def meta(factory, *shape, dtype=torch.float32):
    with torch.device("meta"):
        return factory(), torch.zeros(*shape, dtype=dtype)


def test_sequential_mlp_layers():
    model, x = meta(
        lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4), nn.ReLU()), 3, 4
    )
    g = trace(model, (x,))
    assert [(la.fqn, la.nodes, la.param_numel) for la in g.layers] == [
        ("0", ("linear",), 40),
        ("1", ("relu",), 0),
        ("2", ("linear_1",), 36),
        ("3", ("relu_1",), 0),
    ]
    assert g.batch_size == 3 and g.seq_len is None
    assert g.node("linear").fwd_flops == 2 * 3 * 4 * 8
    assert g.node("relu").fwd_flops == g.node("relu").bwd_flops == 3 * 8


def test_model_without_children_is_one_layer():
    model, x = meta(lambda: nn.Linear(4, 4), 3, 4)
    (layer,) = trace(model, (x,), seq_len=7).layers
    assert (layer.fqn, layer.is_module, layer.param_numel) == ("", True, 20)


def test_blocks_with_repeated_inner_linears_stay_layers():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))

        def forward(self, x):
            return x + self.mlp(x)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(3))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    model, x = meta(Net, 2, 8)
    g = trace(model, (x,))
    assert [la.fqn for la in g.layers] == ["blocks.0", "blocks.1", "blocks.2"]
    assert len(g.distinct_layers()) == 1


def test_weight_tying_counts_params_once():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 8)
            self.ln = nn.LayerNorm(8)
            self.head = nn.Linear(8, 50, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, idx):
            return self.head(self.ln(self.emb(idx)))

    model, idx = meta(Tied, 2, 5, dtype=torch.int64)
    g = trace(model, (idx,))
    assert g.num_params == sum(p.numel() for p in model.parameters()) == 50 * 8 + 16
    assert g.layer("emb").param_numel == 400 and g.layer("head").param_numel == 0
    linear = next(n for n in g.nodes if n.op == "aten.linear.default")
    assert linear.params == ("emb.weight",) and linear.layer == "head"
    assert g.modules["head"].params["weight"].shape == (50, 8)
    param_nodes = [n for n in g.nodes if n.kind == "param"]
    assert [n.params for n in param_nodes] == [("emb.weight",), ("ln.weight",), ("ln.bias",)]
    assert next(n for n in g.nodes if n.op == "aten.embedding.default").params == ("emb.weight",)
    assert g.seq_len == 5


def test_mlp_example():
    mf = load_model_file(str(MLP_FILE))
    model = build_on_meta(mf)
    args, _ = example_inputs(mf, model, 4, None)
    g = trace(model, args)
    blocks = [f"blocks.{i}" for i in range(mf.module.BLOCKS)]
    assert [la.fqn for la in g.layers] == ["proj", *blocks, "norm", "head"]
    assert g.batch_size == 4 and g.seq_len is None
    assert g.num_params == sum(p.numel() for p in model.parameters())


def test_matmul_like_flops_match_flop_counter():
    class Mix(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.depthwise = nn.Conv2d(8, 8, 3, groups=8)
            self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
            self.w = nn.Parameter(torch.empty(6, 5))

        def forward(self, x, y):
            h = self.up(self.depthwise(self.conv(x)))
            a = torch.matmul(y, self.w)
            b = torch.einsum("bij,jk->bik", y, self.w)
            c = torch.bmm(y, y.transpose(1, 2))
            d = torch.addmm(self.w[0], y[0], self.w)
            return h.sum() + a.sum() + b.sum() + c.sum() + d.sum()

    with torch.device("meta"):
        model, x, y = Mix(), torch.zeros(2, 3, 10, 10), torch.zeros(4, 7, 6)
    with FlopCounterMode(display=False) as counter:
        model(x, y)
    g = trace(model, (x, y))
    matmuls = [n for n in g.nodes if n.kind == "compute" and not n.op.startswith("aten.sum")]
    matmuls = [n for n in matmuls if n.fwd_flops and n.op != "aten.add.Tensor"]
    assert len(matmuls) == 7
    assert sum(n.fwd_flops for n in matmuls) == counter.get_total_flops()
    # backward: one product per operand that needs a gradient (the inputs x and y need none)
    real = Mix()
    with torch.no_grad():
        for param in real.parameters():
            param.normal_()
    loss = real(torch.randn(2, 3, 10, 10), torch.randn(4, 7, 6))
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    products = [n for n in matmuls if "conv" not in n.op]  # the counter's conv backward differs
    assert sum(n.bwd_flops for n in products) == counts["aten.mm"] + counts["aten.bmm"]
    ratios = [n.bwd_flops / n.fwd_flops for n in matmuls]
    assert ratios == [1, 2, 2, 1, 1, 0, 1], ratios  # conv on x: the weight's gradient only


def test_hf_llama_layers():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    g = trace(model.train(), (torch.zeros(2, 16, dtype=torch.int64, device="meta"),))
    assert [la.fqn for la in g.layers] == [
        "model.embed_tokens",
        "model.rotary_emb",
        "model.layers.0",
        "model.layers.1",
        "model.norm",
        "lm_head",
    ]
    assert g.layer("model.layers.0").signature == g.layer("model.layers.1").signature
    assert g.num_params == sum(p.numel() for p in model.parameters())
    sdpa = next(n for n in g.nodes if n.op == "aten.scaled_dot_product_attention.default")
    assert sdpa.module_fqn == "model.layers.0.self_attn"
    assert sdpa.fwd_flops == 2 * 2 * 4 * 16 * 16 * (16 + 16)  # grouped kv heads broadcast to q's


def test_trace_restores_eval_mode():
    model, x = meta(lambda: nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)), 2, 4)
    model.eval()
    g = trace(model, (x,))
    assert any(n.op.startswith("aten.dropout") for n in g.nodes)  # traced in training mode
    assert not any(m.training for m in model.modules())


def test_data_dependent_forward_names_module_and_line(tmp_path):
    path = write(
        tmp_path,
        """
        from torch import nn

        class Gate(nn.Module):
            def __init__(self):
                super().__init__()
                self.proj = nn.Linear(4, 4)

            def forward(self, x):
                y = self.proj(x)
                if y.sum() > 0:
                    return y
                return -y

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = nn.ModuleList([nn.Linear(4, 4), Gate()])

            def forward(self, x):
                for block in self.blocks:
                    x = block(x)
                return x

        def build_model():
            return Net()
        """,
    )
    model = build_on_meta(load_model_file(path))
    with pytest.raises(TraceError) as err:
        trace(model, (torch.zeros(2, 4, device="meta"),))
    msg = str(err.value)
    line = line_of(path, "if y.sum() > 0:")
    assert "\n" not in msg
    assert f"at blocks.1 (model.py:{line}: if y.sum() > 0:)" in msg
    assert "data-dependent control flow" in msg


def test_data_dependent_shape_names_node_and_line(tmp_path):
    path = write(
        tmp_path,
        """
        from torch import nn

        class Mask(nn.Module):
            def __init__(self):
                super().__init__()
                self.proj = nn.Linear(4, 4)

            def forward(self, x):
                y = self.proj(x)
                return y[y > 0]

        def build_model():
            return Mask()
        """,
    )
    model = build_on_meta(load_model_file(path))
    with pytest.raises(TraceError) as err:
        trace(model, (torch.zeros(2, 4, device="meta"),))
    line = line_of(path, "return y[y > 0]")
    assert f"at the root module (model.py:{line}: return y[y > 0]): node index" in str(err.value)
    assert "data-dependent shape" in str(err.value)


def test_shape_error_names_the_line():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x.view(5, -1))

    model, x = meta(Bad, 3, 4)
    with pytest.raises(TraceError, match=r"test_ir\.py:\d+: return self\.lin\(x\.view\(5, -1\)\)"):
        trace(model, (x,))


def test_trace_70b_gpt_on_meta():
    gpt_module = load_model_file(str(GPT_FILE)).module
    with torch.device("meta"):
        model = gpt_module.GPT(vocab=128256, dim=8192, n_head=64, n_layer=80, max_seq=2048)
    start = time.perf_counter()
    g = trace(model.train(), (torch.zeros(1, 2048, dtype=torch.int64, device="meta"),))
    assert time.perf_counter() - start < 60
    assert all(p.is_meta for p in model.parameters())
    assert len(g.layers) == 84 and len(g.distinct_layers()) == 5
    assert g.num_params == sum(p.numel() for p in model.parameters())
    q = g.node("linear")
    assert q.fwd_flops == 2 * 2048 * 8192 * 8192
