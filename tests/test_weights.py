"""--init-from and --save-hf: checkpoint names against the model's, HF safetensors and DCP
sources, and (under torchrun) a tiny HF Llama loaded into TP, FSDP and pipeline plans and
written back out.

Unit tests import the runtime module directly; a tiny Llama (hidden 64, 2 layers, vocab 128) is
saved with ``save_pretrained`` in a temporary directory.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="HF weights need the extra 'hf'")

from _plans import run_bounded  # noqa: E402
from autopar.codegen import write_outputs  # noqa: E402
from autopar.codegen.apply import runtime  # noqa: E402
from test_codegen_dist import VERIFY_OK  # noqa: E402
from test_hf import _ilp_styles  # noqa: E402

from autopar.api import plan_model_file  # noqa: E402
from autopar.model_file import load_model_file  # noqa: E402

rt = runtime()  # the emitted autopar_runtime package, imported as train.py imports it

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=64,
)


def _llama(tie: bool = False, seed: int = 0, **changes):
    config = transformers.LlamaConfig(**{**TINY, **changes}, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """Tiny Llamas saved with save_pretrained: untied, tied, and a tied one's base model."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, tie in (("untied", False), ("tied", True)):
        model = _llama(tie=tie, seed=1)
        model.save_pretrained(root / name)
        out[name] = root / name
    _llama(tie=True, seed=2).model.save_pretrained(root / "base")
    out["base"] = root / "base"
    return out


def test_hf_names_match_and_load_exactly(saved) -> None:
    for name in ("untied", "tied"):
        kind, path = rt.init_source(saved[name])
        assert kind == "hf"
        model = _llama(tie=name == "tied")
        mapping = rt.match_names(model, rt.saved_shapes(kind, path), path)
        assert (
            mapping["model.layers.1.mlp.down_proj.weight"] == "model.layers.1.mlp.down_proj.weight"
        )
        rt.load_reference_weights(kind, path, mapping, model)
        original = transformers.AutoModelForCausalLM.from_pretrained(path)
        for key, tensor in original.state_dict().items():
            assert torch.equal(model.state_dict()[key], tensor), key
        if name == "tied":  # lm_head is the embedding: loaded through the one saved name
            assert "lm_head.weight" not in rt.saved_shapes(kind, path)
            assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_base_model_checkpoint_maps_without_its_prefix(saved) -> None:
    model = _llama(tie=True)
    kind, path = rt.init_source(saved["base"])
    mapping = rt.match_names(model, rt.saved_shapes(kind, path), path)
    assert mapping["model.norm.weight"] == "norm.weight"
    rt.load_reference_weights(kind, path, mapping, model)
    base = transformers.AutoModel.from_pretrained(path)
    assert torch.equal(
        model.model.layers[0].self_attn.q_proj.weight, base.layers[0].self_attn.q_proj.weight
    )
    assert torch.equal(model.lm_head.weight, base.embed_tokens.weight)


@pytest.mark.parametrize(
    "model_kw, source, match",
    [
        (
            {"intermediate_size": 96},
            "untied",
            r"wrong shape model\.layers\.0\.mlp\.down_proj\.weight \[64, 128\] != \[64, 96\]",
        ),
        (
            {"num_hidden_layers": 1},
            "untied",
            r"unexpected model\.layers\.1\.input_layernorm\.weight",
        ),
        ({"num_hidden_layers": 3}, "untied", r"missing model\.layers\.2\.input_layernorm\.weight"),
        ({}, "base", r"missing lm_head\.weight"),  # untied head, base checkpoint
    ],
)
def test_mismatch_is_one_line_naming_the_first_few(saved, model_kw, source, match) -> None:
    model = _llama(**model_kw)
    kind, path = rt.init_source(saved[source])
    with pytest.raises(rt.InputError, match=match) as info:
        rt.match_names(model, rt.saved_shapes(kind, path), path)
    assert "\n" not in str(info.value) and "nothing loaded" in str(info.value)


def test_dcp_training_checkpoint_loads_its_model_part(tmp_path: Path) -> None:
    """A --checkpoint-dir (step_N/ with COMPLETE; keys model.* next to optimizer.* and step):
    the directory itself picks its latest complete step."""
    import torch.distributed.checkpoint as dcp

    trained = _llama(seed=3)
    for step, scale in ((2, 1.0), (4, 2.0), (6, 3.0)):
        state = {
            "model": {k: v * scale for k, v in trained.state_dict().items()},
            "optimizer": {},  # plain SGD keeps no state
            "step": torch.tensor(step),
        }
        dcp.save(state, checkpoint_id=tmp_path / f"step_{step}", no_dist=True)
        if step < 6:  # step 6 never completed
            (tmp_path / f"step_{step}" / "COMPLETE").write_text("{}")
    kind, path = rt.init_source(tmp_path)
    assert (kind, path) == ("dcp", tmp_path / "step_4")
    model = _llama(seed=4)
    mapping = rt.match_names(model, rt.saved_shapes(kind, path), path)
    assert mapping["lm_head.weight"] == "model.lm_head.weight"
    rt.load_reference_weights(kind, path, mapping, model)
    for key, tensor in trained.state_dict().items():
        assert torch.equal(model.state_dict()[key], tensor * 2.0), key


def test_bad_sources_and_save_dirs(tmp_path: Path) -> None:
    with pytest.raises(rt.InputError, match="no such directory"):
        rt.init_source(tmp_path / "nope")
    with pytest.raises(rt.InputError, match="neither a DCP checkpoint"):
        rt.init_source(tmp_path)
    (tmp_path / "mine.txt").write_text("user file")
    with pytest.raises(rt.InputError, match="was not written by --save-hf"):
        rt.check_save_hf(tmp_path)
    rt.check_save_hf(tmp_path / "new")  # absent: fine
    done = tmp_path / "done"
    done.mkdir()
    (done / rt.SAVE_HF_MARKER).write_text(json.dumps({}))
    rt.check_save_hf(done)  # an earlier --save-hf's: replaced


# ---- The emitted script under torchrun (gloo) ---------------------------------------------------
TIMEOUT_S = 200
INIT = re.compile(r"^init: loaded (\d+) tensors from (\S+) \((hf|dcp)\)$", re.MULTILINE)


def _hf_plan(config: Path, mesh: str):
    """The tiny Llama of ``config`` planned for cpu:2 with ``mesh`` pinned (as tests/test_hf.py
    does: at this size TP takes the ILP's styles under H100 costs)."""
    plan = plan_model_file(
        load_model_file(f"hf:{config}"),
        "cpu:2",
        global_batch=4,
        seq_len=16,
        mesh=mesh,
        optimizer="sgd",
    )
    if mesh == "tp=2":
        styles, attrs = _ilp_styles(str(config))
        assert styles, "the ILP shards nothing"
        plan = plan.model_copy(update={"tensor_parallel": styles, "module_attrs": attrs})
    return plan


def _launch(out_dir: Path, *args: str) -> tuple[int, str]:
    return run_bounded(
        ["bash", "launch.sh", "--steps", "1", "--optimizer", "sgd", "--lr", "0", *args],
        out_dir,
        TIMEOUT_S,
        DIST_TIMEOUT_S="60",
    )


@pytest.fixture(scope="module")
def llama_runs(tmp_path_factory) -> dict:
    """A tiny Llama saved with save_pretrained, loaded with --init-from by three plans, one
    step at lr 0 each, saved with --save-hf: TP=2 from the HF directory (--verify), FSDP=2 from
    it too (also saving a DCP checkpoint), and a 2-stage pipeline from that DCP checkpoint
    (--verify)."""
    root = tmp_path_factory.mktemp("llama")
    _llama(seed=1).save_pretrained(root / "hf")
    runs = {}
    sources = {"tp": root / "hf", "fsdp": root / "hf", "pp": root / "ckpt"}
    for name in ("tp", "fsdp", "pp"):
        out_dir = write_outputs(_hf_plan(root / "hf" / "config.json", f"{name}=2"), root / name)
        args = ["--init-from", str(sources[name]), "--save-hf", str(root / f"saved_{name}")]
        args += ["--checkpoint-dir", str(root / "ckpt")] if name == "fsdp" else ["--verify"]
        runs[name] = (*_launch(out_dir, *args), root / f"saved_{name}", out_dir)
    return {"root": root, "runs": runs}


def _first_loss(out: str) -> float:
    line = next(line for line in out.splitlines() if line.startswith('{"step": 1,'))
    return json.loads(line)["loss"]


@pytest.mark.dist
@pytest.mark.parametrize("name", ["tp", "fsdp", "pp"])
def test_init_from_and_save_hf_round_trip(llama_runs, name: str) -> None:
    rc, out, saved_dir, _ = llama_runs["runs"][name]
    assert rc == 0, out[-4000:]
    count, _, kind = INIT.search(out).groups()
    assert (int(count), kind) == (21, "dcp" if name == "pp" else "hf"), out[-4000:]
    if name != "fsdp":
        assert VERIFY_OK.search(out), out[-4000:]
    # the same weights and batch as the TP run: the same first loss (a random init would differ)
    loss, tp_loss = (_first_loss(llama_runs["runs"][n][1]) for n in (name, "tp"))
    assert abs(loss - tp_loss) < 1e-5, (loss, tp_loss)
    original = transformers.AutoModelForCausalLM.from_pretrained(llama_runs["root"] / "hf")
    written = transformers.AutoModelForCausalLM.from_pretrained(saved_dir)
    expected = original.state_dict()
    assert set(written.state_dict()) == set(expected)
    for key, tensor in written.state_dict().items():
        assert torch.equal(tensor, expected[key]), key
    assert sorted(p.name for p in saved_dir.iterdir()) == [
        "autopar-save-hf.json",
        "config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]


# covered by test_mismatch_is_one_line_naming_the_first_few (the same error, in process) and
# test_faults.py::test_a_checkpoint_of_another_model_is_one_line (a user error under torchrun)
@pytest.mark.slow
@pytest.mark.dist
def test_mismatched_checkpoint_is_one_error_line(llama_runs) -> None:
    root = llama_runs["root"]
    _llama(num_hidden_layers=3).save_pretrained(root / "three_layers")
    rc, out = _launch(llama_runs["runs"]["tp"][3], "--init-from", str(root / "three_layers"))
    assert rc != 0, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out[-3000:]
    assert "unexpected model.layers.2." in errors[0] and "nothing loaded" in errors[0]
    assert not INIT.search(out)


def test_hf_file_index_splits_in_order_under_the_limit() -> None:
    sizes = [("a", 4), ("b", 4), ("a", 4), ("c", 3), ("d", 9), ("e", 1)]
    assert rt.hf_file_index(sizes, limit=8) == {"a": 1, "b": 1, "c": 2, "d": 3, "e": 4}
    assert set(rt.hf_file_index(sizes).values()) == {1}  # 5 GiB by default


def test_gpt2_base_checkpoint_and_unsaved_buffers(tmp_path: Path) -> None:
    """GPT-2's base model (keys h.0..., as on the hub) into GPT2LMHeadModel (base_model_prefix
    "transformer", tied head); a Llama checkpoint that also holds rotary inv_freq (a buffer the
    model does not save) loads, one with a tensor the model lacks does not."""
    from safetensors.torch import save_file

    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64)
    torch.manual_seed(5)
    source = transformers.AutoModelForCausalLM.from_config(config)
    source.transformer.save_pretrained(tmp_path / "gpt2")
    model = transformers.AutoModelForCausalLM.from_config(config)
    kind, path = rt.init_source(tmp_path / "gpt2")
    mapping = rt.match_names(model, rt.saved_shapes(kind, path), path)
    assert mapping["transformer.h.1.mlp.c_fc.weight"] == "h.1.mlp.c_fc.weight"
    rt.load_reference_weights(kind, path, mapping, model)
    assert torch.equal(model.lm_head.weight, source.transformer.wte.weight)

    llama = _llama(seed=6)
    tensors = {k: v.contiguous() for k, v in llama.state_dict().items()}
    inv_freq = llama.model.rotary_emb.inv_freq
    for name, extra in (("old", "model.rotary_emb.inv_freq"), ("odd", "model.extra.weight")):
        (tmp_path / name).mkdir()
        save_file({**tensors, extra: inv_freq.clone()}, tmp_path / name / "model.safetensors")
    assert rt.match_names(llama, rt.saved_shapes("hf", tmp_path / "old"), "old")
    with pytest.raises(rt.InputError, match="unexpected model.extra.weight"):
        rt.match_names(llama, rt.saved_shapes("hf", tmp_path / "odd"), "odd")
