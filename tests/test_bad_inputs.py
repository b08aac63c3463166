"""The bad-input corpus, through the real ``plan`` CLI: every case exits 2 with exactly one stderr
line starting ``error:`` that names the value, the rule and the fix, shows no traceback (``--debug``
does), and leaves nothing behind: no new ``--out`` directory (nor its missing parents), and an
existing ``--out`` with an old plan untouched. Also plan files: ``--plan`` re-emits a saved plan
without searching, and a plan JSON never executes what it holds."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from autopar import Plan
from autopar.cli import main

pytestmark = [pytest.mark.filterwarnings("ignore:a warning:UserWarning"), pytest.mark.bad_input]

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples" / "gpt.py")
MLP = str(ROOT / "examples" / "mlp.py")

_TINY = """
import torch
from torch import nn

def build_model():
    return nn.Linear(8, 8)
"""

MODEL_FILES = {
    "unimportable.py": "import torch\nimport no_such_module_xyz\n\ndef build_model():\n    pass\n",
    "syntax_error.py": "def build_model(:\n    pass\n",
    "no_factory.py": "import torch\n",
    "factory_raises.py": "def build_model():\n    raise RuntimeError('boom in the factory')\n",
    "not_a_module.py": "def build_model():\n    return {'layers': 4}\n",
    "exits.py": "import sys\n\nsys.exit(3)\n",
    "batch_not_tuple.py": _TINY
    + "\ndef make_batch(batch_size, seq_len=None):\n    return torch.zeros(batch_size, 8)\n",
    "batch_three.py": _TINY
    + "\ndef make_batch(batch_size, seq_len=None):\n    x = torch.zeros(batch_size, 8)\n"
    "    return (x,), x, x\n",
    "batch_raises.py": _TINY
    + "\ndef make_batch(batch_size, seq_len=None):\n    raise KeyError('no data here')\n",
    "batch_bad_shape.py": _TINY + "\ndef make_batch(batch_size, seq_len=None):\n"
    "    return (torch.zeros(batch_size, 5),), torch.zeros(batch_size, 8)\n",
    "data_dependent.py": textwrap.dedent(
        """
        import torch
        from torch import nn

        class Gate(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 8)

            def forward(self, x):
                if x.sum() > 0:
                    return self.lin(x)
                return x

        def build_model():
            return Gate()

        def make_batch(batch_size, seq_len=None):
            return (torch.zeros(batch_size, 8),), torch.zeros(batch_size, 8)
        """
    ),
    "forward_fails.py": _TINY.replace("nn.Linear(8, 8)", "nn.Sequential(nn.Linear(8, 8))")
    + "\ndef make_batch(batch_size, seq_len=None):\n"
    "    return (torch.zeros(batch_size, 3, 5),), torch.zeros(batch_size, 8)\n",
    "space_in_name.py": _TINY.replace(
        "nn.Linear(8, 8)", 'nn.ModuleDict({"layer-1": nn.Linear(8, 8), "layer 2": nn.Linear(8, 8)})'
    )
    + "\n\nclass Stack(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
    "        self.blocks = build_model()\n\n    def forward(self, x):\n"
    "        for b in self.blocks.values():\n            x = b(x)\n        return x\n"
    "\n\ndef make_batch(batch_size, seq_len=None):\n"
    "    return (torch.zeros(batch_size, 8),), torch.zeros(batch_size, 8)\n"
    "\n\ndef build_stack():\n    return Stack()\n",
    "frozen.py": _TINY.replace(
        "return nn.Linear(8, 8)", "return nn.Linear(8, 8).requires_grad_(False)"
    )
    + "\ndef make_batch(batch_size, seq_len=None):\n"
    "    return (torch.zeros(batch_size, 8),), torch.zeros(batch_size, 8)\n",
    "no_params.py": _TINY.replace("nn.Linear(8, 8)", "nn.ReLU()")
    + "\ndef make_batch(batch_size, seq_len=None):\n"
    "    return (torch.zeros(batch_size, 8),), torch.zeros(batch_size, 8)\n",
    "deep.py": _TINY.replace(
        "    return nn.Linear(8, 8)",
        "    m = nn.Linear(8, 8)\n    for _ in range(3000):\n        m = nn.Sequential(m)\n"
        "    return m",
    )
    + "\ndef make_batch(batch_size, seq_len=None):\n"
    "    return (torch.zeros(batch_size, 8),), torch.zeros(batch_size, 8)\n",
    "recurses.py": "def f(n):\n    return n if n >= 3000 else f(n + 1)\n\n\nf(0)\n",
    "noisy_then_fails.py": "import sys, warnings\n\nprint('hello from the model file')\n"
    "print('to stderr', file=sys.stderr)\nwarnings.warn('a warning')\n\n"
    "def build_model():\n    raise ValueError('after the noise')\n",
}


def _device_file(memory_bytes: int = 80 * 2**30, peak_flops: str = "1e13") -> str:
    """A cluster file with a full device spec (JSON text: Infinity and NaN spelled as JSON)."""
    raw = {
        "device": {
            "name": "X1",
            "kind": "gpu",
            "memory_bytes": memory_bytes,
            "peak_flops": {"fp32": "FLOPS"},
            "memory_bandwidth_bytes_per_s": 1e12,
            "matmul_efficiency": 0.5,
            "memory_efficiency": 0.5,
            "op_overhead_s": 1e-5,
        },
        "devices_per_node": 2,
        "intra_node": {"name": "nv", "bandwidth_bytes_per_s": 1e11, "latency_s": 1e-6},
        "inter_node": {"name": "ib", "bandwidth_bytes_per_s": 1e10, "latency_s": 1e-5},
    }
    return json.dumps(raw).replace('"FLOPS"', peak_flops)


def _profile_file(broken: str) -> str:
    """H100's datasheet profile as JSON text, its first field of ``broken``'s key replaced."""
    import re

    from autopar.cost_model.profile import datasheet_profile

    text = datasheet_profile("H100").model_dump_json()
    key = broken.split(":")[0]
    return re.sub(re.escape(key) + r": *[^,}]+", broken, text, count=1)


CLUSTER_FILES = {
    "negative_bw.json": json.dumps(
        {
            "device": "H100",
            "devices_per_node": 8,
            "intra_node": {"name": "nvlink", "bandwidth_bytes_per_s": -5, "latency_s": 1e-6},
        }
    ),
    "malformed.json": '{"device": "H100", ',
    "malformed.toml": 'device = "H100\ndevices_per_node = 8\n',
    "unknown_key.json": '{"device": "H100", "devices_per_node": 8, "gpus": 3}',
    "zero_devices.toml": 'device = "H100"\ndevices_per_node = 0\n',
    "bool_devices.json": '{"device": "H100", "devices_per_node": true}',
    "unknown_device.json": '{"device": "B999", "devices_per_node": 8}',
    "top_list.json": "[1, 2]",
    "infinite_bw.toml": 'device = "H100"\ndevices_per_node = 8\n[intra_node]\nname = "nv"\n'
    "bandwidth_bytes_per_s = inf\nlatency_s = 1e-6\n",
    "binary.json": "\udcff",  # written as a lone 0xff byte below
    # values that would overflow the cost model, duplicate keys, a backend the device cannot use
    "tiny_bw.json": json.dumps(
        {
            "device": "H100",
            "devices_per_node": 8,
            "intra_node": {"name": "nv", "bandwidth_bytes_per_s": 1e-300, "latency_s": 1e-6},
        }
    ),
    "huge_memory.json": _device_file(memory_bytes=10**400),
    "infinite_flops.json": _device_file(peak_flops="Infinity"),
    "nan_flops.json": _device_file(peak_flops="NaN"),
    "duplicate_key.json": '{"device": "H100", "devices_per_node": 8, "devices_per_node": 2}',
    "gpu_gloo.json": '{"device": "H100", "devices_per_node": 8, "backend": "gloo"}',
    # profiles: the datasheet profile of H100 with one value broken
    "profile_tiny_bw.json": _profile_file('"bandwidth_bytes_per_s": 1e-300'),
    "profile_nan_flops.json": _profile_file('"fp32": NaN'),
    "profile_huge_memory.json": _profile_file(f'"memory_bytes": {10**400}'),
    "profile_duplicate_key.json": _profile_file('"name": "x", "name": "y"'),
}


def _hf_config(base: str, **edits) -> str:
    """A built-in HF config (examples/hf) as JSON text, with ``edits``."""
    return json.dumps(
        {**json.loads((ROOT / "examples" / "hf" / f"{base}.json").read_text()), **edits}
    )


HF_CONFIGS = {
    "negative_layers.json": _hf_config("tiny-gpt2", n_layer=-2),
    "zero_heads.json": _hf_config("tiny-llama", num_attention_heads=0),
}


def _write_files(where: Path) -> None:
    for name, text in {**MODEL_FILES, **CLUSTER_FILES, **HF_CONFIGS}.items():
        if name == "binary.json":
            (where / name).write_bytes(b"\xff\xfe{")
        else:
            (where / name).write_text(text)


# (id, argv, words the error line must contain: the value, the rule, the fix)
CASES = [
    # the model file
    ("missing model file", ["missing.py"], ["missing.py", "does not exist", "pass the path"]),
    ("model is a directory", ["."], ["is not a file", "pass the path"]),
    ("not a .py file", ["negative_bw.json"], ["negative_bw.json", "not a .py file"]),
    (
        "unimportable",
        ["unimportable.py"],
        ["unimportable.py", "No module named 'no_such_module_xyz'", "unimportable.py:2", "fix"],
    ),
    ("syntax error", ["syntax_error.py"], ["syntax_error.py", "syntax error at line 1", "fix"]),
    ("no factory", ["no_factory.py"], ["'build_model' is not defined", "define build_model()"]),
    ("unknown factory", ["no_factory.py:make_it"], ["'make_it' is not defined", "define"]),
    ("bad factory name", ["no_factory.py:1-x"], ["'1-x'", "function name", "build_model"]),
    (
        "factory raises",
        ["factory_raises.py"],
        ["RuntimeError: boom in the factory", "factory_raises.py:2", "make build_model()"],
    ),
    (
        "factory returns a dict",
        ["not_a_module.py"],
        ["returned dict", "not a torch.nn.Module", "return the model instance"],
    ),
    ("model file exits", ["exits.py"], ["exits.py", "SystemExit: 3", "fix the import"]),
    (
        "make_batch returns a tensor",
        ["batch_not_tuple.py"],
        ["returned a Tensor", "((forward args...), target)"],
    ),
    ("make_batch returns 3 items", ["batch_three.py"], ["returned a tuple of 3", "return (("]),
    (
        "make_batch raises",
        ["batch_raises.py"],
        ["make_batch(2, 16)", "KeyError", "batch_raises.py:9", "shapes only"],
    ),
    (
        "batch shape the model rejects",
        ["batch_bad_shape.py"],
        ["cannot be traced", "[2, 5] X [8, 8]", "matching shapes"],
    ),
    (
        "forward fails in a submodule",
        ["forward_fails.py"],
        ["cannot be traced", "make forward run on meta tensors"],
    ),
    (
        "data-dependent control flow",
        ["data_dependent.py"],
        ["data_dependent.py:11", "data-dependent control flow", "shapes or config only"],
    ),
    ("noise before the error", ["noisy_then_fails.py"], ["ValueError: after the noise"]),
    (
        "no trainable parameters",
        ["frozen.py"],
        ["frozen.py", "only frozen parameters", "give a model with trainable parameters"],
    ),
    ("no parameters at all", ["no_params.py"], ["no_params.py", "has no parameters"]),
    (
        "3000 nested modules",
        ["deep.py"],
        ["deep.py", "deeper than Python's recursion limit", "nn.ModuleList"],
    ),
    ("recursion 3000 deep at import", ["recurses.py"], ["recurses.py", "RecursionError"]),
    (
        "module name a plan cannot hold",
        ["space_in_name.py:build_stack"],
        ["'blocks.layer 2'", "letters, digits", "rename that submodule"],
    ),
    # the cluster
    ("unknown device", [GPT, "--cluster", "8xB999"], ["'B999'", "catalog knows H100", "use one"]),
    ("zero GPUs", [GPT, "--cluster", "0xH100"], ["'0xH100'", "integers >= 1", "e.g. 8xH100"]),
    ("zero nodes", [GPT, "--cluster", "0x8xH100"], ["'0x8xH100'", "integers >= 1"]),
    ("fractional GPUs", [GPT, "--cluster", "1.5xH100"], ["'1.5'", "integers >= 1"]),
    ("cpu:0", [GPT, "--cluster", "cpu:0"], ["'cpu:0'", "N >= 1", "e.g. cpu:2"]),
    ("cpu:-1", [GPT, "--cluster", "cpu:-1"], ["'cpu:-1'", "N >= 1", "e.g. cpu:2"]),
    ("cpu:abc", [GPT, "--cluster", "cpu:abc"], ["'abc'", "N >= 1"]),
    ("empty cluster", [GPT, "--cluster", ""], ["cluster spec ''", "is not one of", "cpu:N"]),
    ("huge cluster", [GPT, "--cluster", "2048x1024xH100"], ["2097152 devices", "check"]),
    (
        "negative bandwidth",
        [GPT, "--cluster", "negative_bw.json"],
        ["intra_node.bandwidth_bytes_per_s", "greater than or equal to 1", "got -5", "fix that"],
    ),
    ("malformed JSON", [GPT, "--cluster", "malformed.json"], ["malformed JSON at line 1", "fix"]),
    ("malformed TOML", [GPT, "--cluster", "malformed.toml"], ["malformed TOML", "fix the file"]),
    ("missing cluster file", [GPT, "--cluster", "nope.toml"], ["'nope.toml' not found", "give"]),
    (
        "unknown cluster key",
        [GPT, "--cluster", "unknown_key.json"],
        ["gpus", "Extra inputs are not permitted", "allowed keys: device"],
    ),
    (
        "zero devices in a file",
        [GPT, "--cluster", "zero_devices.toml"],
        ["devices_per_node", "greater than 0", "got 0"],
    ),
    ("boolean count", [GPT, "--cluster", "bool_devices.json"], ["devices_per_node", "got True"]),
    ("unknown device in a file", [GPT, "--cluster", "unknown_device.json"], ["'B999'", "catalog"]),
    (
        "infinite bandwidth",
        [GPT, "--cluster", "infinite_bw.toml"],
        ["intra_node.bandwidth_bytes_per_s", "inf is not a finite number"],
    ),
    ("cluster file is a list", [GPT, "--cluster", "top_list.json"], ["top level", "got list"]),
    ("cluster file not UTF-8", [GPT, "--cluster", "binary.json"], ["binary.json", "not UTF-8"]),
    (
        "1e-300 bandwidth",
        [GPT, "--cluster", "tiny_bw.json"],
        ["intra_node.bandwidth_bytes_per_s", "greater than or equal to 1", "1e-300"],
    ),
    (
        "10**400 bytes of memory",
        [GPT, "--cluster", "huge_memory.json"],
        ["device.memory_bytes", "less than or equal to", "(401 characters)"],
    ),
    (
        "infinite FLOP/s",
        [GPT, "--cluster", "infinite_flops.json"],
        ["device.peak_flops.fp32", "inf is not a finite number"],
    ),
    (
        "NaN FLOP/s",
        [GPT, "--cluster", "nan_flops.json"],
        ["peak_flops.fp32", "nan is not a finite"],
    ),
    (
        "duplicate JSON key",
        [GPT, "--cluster", "duplicate_key.json"],
        ["'devices_per_node' appears twice", "keep one"],
    ),
    (
        "gloo on GPUs",
        [GPT, "--cluster", "gpu_gloo.json"],
        ["backend", "'gloo'", "gpu device 'H100'", "nccl"],
    ),
    (
        "profile: 1e-300 bandwidth",
        [GPT, "--profile", "profile_tiny_bw.json"],
        ["profile_tiny_bw.json", "'intra_node.bandwidth_bytes_per_s'", "greater than or equal"],
    ),
    (
        "profile: NaN FLOP/s",
        [GPT, "--profile", "profile_nan_flops.json"],
        ["'device.peak_flops.fp32'", "finite number"],
    ),
    (
        "profile: 10**400 bytes",
        [GPT, "--profile", "profile_huge_memory.json"],
        ["'device.memory_bytes'", "less than or equal to"],
    ),
    (
        "profile: duplicate key",
        [GPT, "--profile", "profile_duplicate_key.json"],
        ["profile_duplicate_key.json", "names 'name' twice", "regenerate"],
    ),
    # the mesh
    ("mesh does not parse", [GPT, "--mesh", "tp:2"], ["'tp:2'", "AXIS=N", "--mesh tp=2,fsdp=2"]),
    ("mesh unknown axis", [GPT, "--mesh", "xp=2"], ["'xp=2'", "one of pp, dp, fsdp, cp, ep, tp"]),
    ("mesh zero degree", [GPT, "--mesh", "tp=0"], ["'tp=0'", "N >= 1"]),
    ("mesh axis twice", [GPT, "--mesh", "tp=2,tp=2"], ["sets tp twice", "give each axis once"]),
    (
        "mesh does not divide the world",
        [GPT, "--mesh", "tp=3"],
        ["tp=3", "does not divide the world size 4", "pin degrees whose product divides 4"],
    ),
    (
        "full mesh is not the world",
        [GPT, "--mesh", "pp=1,dp=1,fsdp=1,cp=1,tp=2"],
        ["multiplies to 2", "cpu:4 has 4 devices", "product is 4"],
    ),
    (
        "batch not divisible by pinned dp",
        [GPT, "--mesh", "dp=4", "--global-batch", "6"],
        ["global batch 6", "data-parallel size 4", "e.g. --global-batch 8"],
    ),
    (
        "batch not divisible by pinned dp x fsdp",
        [GPT, "--mesh", "dp=2,fsdp=2", "--global-batch", "10"],
        ["global batch 10", "data-parallel size 4", "multiple of 4"],
    ),
    (
        "tp does not divide the heads",
        [GPT, "--cluster", "cpu:3", "--mesh", "tp=3"],
        ["tp=3", "4 attention heads", "choose tp"],
    ),
    # training flags
    ("zero seq len", [GPT, "--seq-len", "0"], ["--seq-len 0", ">= 1", "e.g. --seq-len"]),
    ("negative seq len", [GPT, "--seq-len", "-3"], ["--seq-len -3", ">= 1"]),
    ("zero batch", [GPT, "--global-batch", "0"], ["--global-batch 0", ">= 1", "e.g."]),
    ("negative batch", [GPT, "--global-batch", "-8"], ["--global-batch -8", ">= 1"]),
    ("batch not a number", [GPT, "--global-batch", "eight"], ["'eight'", "invalid int"]),
    ("unknown dtype", [GPT, "--dtype", "fp8"], ["'fp8'", "one of fp32, bf16", "--dtype"]),
    ("unknown optimizer", [GPT, "--optimizer", "lion"], ["'lion'", "choose from"]),
    ("no model and no plan", ["--cluster", "cpu:2"], ["MODEL is required", "--plan"]),
    ("no cluster", [GPT, "--cluster", None], ["--cluster is required", "e.g."]),
]


_needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="hf: models need the extra 'hf'"
)

# plans that cannot run (issue 25, class 8): a sequence past the position table, an hf: config
# with counts no model has (the detection itself: tests/test_positions.py)
CANNOT_RUN = [
    pytest.param(
        "seq len past the position table",
        [GPT, "--seq-len", "300"],
        ["--seq-len 300", "'pos_emb'", "256 rows", "--seq-len <= 256", "larger table"],
        id="seq len past the position table",
    ),
    pytest.param(
        "seq len past GPT-2's n_positions",
        ["hf:tiny-gpt2", "--seq-len", "65"],
        ["--seq-len 65", "'transformer.wpe'", "64 rows", "--seq-len <= 64", "n_positions >= 65"],
        id="seq len past GPT-2's n_positions",
        marks=_needs_transformers,
    ),
    pytest.param(
        "seq len past BERT's max_position_embeddings",
        ["hf:tiny-bert", "--seq-len", "65"],
        ["'bert.embeddings.position_embeddings'", "--seq-len <= 64", "max_position_embeddings"],
        id="seq len past BERT's max_position_embeddings",
        marks=_needs_transformers,
    ),
    pytest.param(
        "hf: negative layer count",
        ["hf:negative_layers.json"],
        ["negative_layers.json", "n_layer -2", "positive integer", "set n_layer"],
        id="hf: negative layer count",
        marks=_needs_transformers,
    ),
    pytest.param(
        "hf: zero attention heads",
        ["hf:zero_heads.json"],
        ["num_attention_heads 0", "positive integer", "set num_attention_heads"],
        id="hf: zero attention heads",
        marks=_needs_transformers,
    ),
]


def _argv(case_argv: list) -> list[str]:
    """The case's arguments plus defaults for the flags it leaves out (``FLAG, None``: none)."""
    argv = [
        a
        for i, a in enumerate(case_argv)
        if a is not None and (i + 1 == len(case_argv) or case_argv[i + 1] is not None)
    ]
    defaults = {"--cluster": "cpu:4", "--global-batch": "8", "--seq-len": "16"}
    for flag, value in defaults.items():
        if flag not in case_argv:
            argv += [flag, value]
    return argv


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def _assert_one_error_line(code, stderr: str, words: list[str], case: str) -> str:
    assert code == 2, (case, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (case, stderr)
    assert "Traceback" not in stderr
    for word in words:
        assert word in lines[0], (case, word, lines[0])
    return lines[0]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write_files(tmp_path)
    return tmp_path


@pytest.mark.parametrize(("case", "argv", "words"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_error_line_and_loses_nothing(case, argv, words, workdir, capsys):
    # --out under parents that do not exist: none of them may appear
    fresh = workdir / "new" / "deeper" / "out"
    code, stdout, stderr = _run(_argv(argv) + ["--out", str(fresh)], capsys)
    _assert_one_error_line(code, stderr, words, case)
    assert not (workdir / "new").exists()
    assert "hello from the model file" not in stdout

    # --out holding an earlier run's outputs: they survive the failed run, byte for byte
    old = workdir / "old"
    old.mkdir()
    files = {"plan.json": '{"version": 1}\n', "train.py": "print('old')\n", "notes.txt": "mine"}
    for name, text in files.items():
        (old / name).write_text(text)
    code, _, stderr = _run(_argv(argv) + ["--out", str(old), "--json"], capsys)
    _assert_one_error_line(code, stderr, words, case)
    assert {p.name: p.read_text() for p in old.iterdir()} == files
    assert sorted(p.name for p in workdir.iterdir() if p.name.startswith(".")) == []


@pytest.mark.bad_input
@pytest.mark.parametrize(("case", "argv", "words"), CANNOT_RUN)
def test_a_plan_that_cannot_run_is_refused(case, argv, words, workdir, capsys):
    """The same outcome as every case above: one line, exit 2, nothing written or lost."""
    test_bad_input_is_one_error_line_and_loses_nothing(case, argv, words, workdir, capsys)


@pytest.mark.parametrize(
    "argv",
    [["factory_raises.py"], ["data_dependent.py"], [GPT, "--cluster", "cpu:0"]],
    ids=["factory", "trace", "cluster"],
)
def test_debug_shows_the_traceback_and_the_same_error(argv, workdir, capsys):
    code, _, stderr = _run(_argv(argv) + ["--debug"], capsys)
    assert code == 2
    assert "Traceback (most recent call last)" in stderr
    assert stderr.strip().splitlines()[-1].startswith("error: ")


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["data_dependent.py"], ["data-dependent control flow", "data_dependent.py:11"]),
        (["batch_bad_shape.py"], ["cannot be traced", "[2, 5] X [8, 8]"]),
        ([GPT, "--cluster", "cpu:0"], ["'cpu:0'", "N >= 1"]),
        (["noisy_then_fails.py"], ["ValueError: after the noise"]),
    ],
    ids=["data-dependent", "bad-shape", "cpu:0", "prints-and-warns"],
)
def test_a_fresh_process_prints_one_line(argv, words, workdir):
    """``python -m autopar`` as a user runs it: torch's log handlers write to the real stderr
    here (fake-tensor errors, symbolic-shape warnings), and still only one line comes out."""
    out = workdir / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "autopar", *_argv(argv), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=workdir,
        # the test's own plan cache (tests/conftest.py): never the user's, never another run's
        env={
            "PYTHONPATH": str(ROOT),
            "PATH": "/usr/bin:/bin",
            "AUTOPAR_CACHE_DIR": os.environ["AUTOPAR_CACHE_DIR"],
        },
    )
    _assert_one_error_line(proc.returncode, proc.stderr, words, str(argv))
    assert proc.stdout == "" and not out.exists()


def test_out_that_is_a_file_or_under_a_file(workdir, capsys):
    (workdir / "afile").write_text("keep")
    for out in ["afile", "afile/sub"]:
        code, _, stderr = _run(_argv([GPT]) + ["--out", out], capsys)
        _assert_one_error_line(code, stderr, ["afile", "directory"], out)
    assert (workdir / "afile").read_text() == "keep"


def test_model_output_is_held_back_on_success(workdir, capsys):
    """What the model file prints goes to stderr after a successful run, never into --json."""
    (workdir / "chatty.py").write_text(
        Path(MLP).read_text() + "\nprint('hello from the model file')\n"
    )
    code, stdout, stderr = _run(
        ["chatty.py", "--cluster", "cpu:2", "--global-batch", "4", "--json"], capsys
    )
    assert code == 0
    json.loads(stdout)
    assert "hello from the model file" in stderr


# -- model files that exit, hang, write to fd 1 or are interrupted; bugs stay bugs -------------


def _python_m_autopar(argv: list[str], cwd: Path, timeout: float = 180, **kw):
    return subprocess.Popen(
        [sys.executable, "-m", "autopar", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        # the test's own plan cache (tests/conftest.py): never the user's, never another run's
        env={
            "PYTHONPATH": str(ROOT),
            "PATH": "/usr/bin:/bin",
            "AUTOPAR_CACHE_DIR": os.environ["AUTOPAR_CACHE_DIR"],
        },
        **kw,
    )


_WITH_BATCH = _TINY + (
    "\ndef make_batch(batch_size, seq_len=None):\n"
    "    return (torch.zeros(batch_size, 8),), torch.zeros(batch_size, 8)\n"
)
PROCESS_FAULTS = {
    "os._exit(0) at import": (
        "import os\n\nos._exit(0)\n",
        ["called os._exit(0)", "do not exit from the model file"],
    ),
    "os._exit(0) in build_model": (
        _WITH_BATCH.replace("    return nn.Linear(8, 8)", "    import os\n    os._exit(0)"),
        ["called os._exit(0)"],
    ),
    "sys.exit(0) in build_model": (
        _WITH_BATCH.replace("    return nn.Linear(8, 8)", "    import sys\n    sys.exit(0)"),
        ["build_model()", "SystemExit: 0"],
    ),
    "a non-daemon thread": (
        "import threading, time\n"
        + _WITH_BATCH
        + "\nthreading.Thread(target=time.sleep, args=(600,), name='poller').start()\n",
        ["started thread 'poller'", "daemon=True"],
    ),
}


# os._exit in build_model is caught as os._exit at import is (the same guard, ~8 s a process):
# the slow tier runs it
_FAULT_PARAMS = [
    pytest.param(
        case, id=case, marks=pytest.mark.slow if case == "os._exit(0) in build_model" else ()
    )
    for case in PROCESS_FAULTS
]


@pytest.mark.parametrize("case", _FAULT_PARAMS)
def test_a_model_file_cannot_exit_or_hang_the_planner(case, tmp_path):
    """In a real process: one error line and exit 2, never exit 0 with nothing written or a
    process a leftover thread keeps alive; run twice (one plan cache), the second run refuses
    alike (a refused model file leaves no cache entry that would skip its import)."""
    text, words = PROCESS_FAULTS[case]
    (tmp_path / "model.py").write_text(text)
    out = tmp_path / "out"
    argv = ["model.py", "--cluster", "cpu:2", "--global-batch", "4", "--out", str(out), "--json"]
    for _ in range(2):
        proc = _python_m_autopar(argv, tmp_path)
        try:
            stdout, stderr = proc.communicate(timeout=180)
        finally:
            proc.kill()
        _assert_one_error_line(proc.returncode, stderr, words, case)
        assert stdout == "" and not out.exists()


def test_a_huge_global_batch_answers_at_once(tmp_path):
    """--global-batch 10**12 is one line within seconds (the search is linear in the batch),
    from the CLI and from the API."""
    argv = [GPT, "--cluster", "cpu:4", "--global-batch", str(10**12), "--seq-len", "16"]
    proc = _python_m_autopar(argv, tmp_path)
    try:
        _, stderr = proc.communicate(timeout=90)
    finally:
        proc.kill()
    words = ["--global-batch 1000000000000", "up to 1048576 samples", "smaller global batch"]
    _assert_one_error_line(proc.returncode, stderr, words, "10**12")

    import torch
    from autopar.planner.search import PlanningError
    from torch import nn

    from autopar.api import auto_parallelize

    with torch.device("meta"):
        model = nn.Linear(8, 8)
    start = time.perf_counter()
    with pytest.raises(PlanningError, match="up to 1048576 samples"):
        auto_parallelize(
            model,
            "cpu:2",
            global_batch=10**12,
            example_inputs=(torch.zeros(2, 8, device="meta"),),
            model_file=MLP,
        )
    assert time.perf_counter() - start < 30


def test_writes_to_fd_1_never_reach_json(tmp_path):
    """What a model file (or C code) writes to file descriptor 1 goes to stderr; stdout is one
    JSON document."""
    (tmp_path / "model.py").write_text(
        "import os\n"
        + _WITH_BATCH.replace(
            "    return nn.Linear(8, 8)",
            "    os.write(1, b'from build\\n')\n    return nn.Linear(8, 8)",
        )
        + "\nos.write(1, b'from import\\n')\n"
    )
    proc = _python_m_autopar(
        ["model.py", "--cluster", "cpu:2", "--global-batch", "4", "--json"], tmp_path
    )
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr
    assert json.loads(stdout)["mesh"]  # the whole of stdout is the plan
    assert "from import" in stderr and "from build" in stderr


def test_ctrl_c_is_one_line_and_exit_130(tmp_path):
    started = tmp_path / "started"
    (tmp_path / "model.py").write_text(
        f"import pathlib, time\n\npathlib.Path({str(started)!r}).write_text('x')\ntime.sleep(120)\n"
    )
    out = tmp_path / "out"
    argv = ["model.py", "--cluster", "cpu:2", "--global-batch", "4", "--out", str(out)]
    proc = _python_m_autopar(argv, tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not started.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert stderr.strip().splitlines() == ["error: interrupted (Ctrl-C): nothing was written"]
    assert stdout == "" and not out.exists()


def test_bugs_stay_bugs(workdir, capsys, monkeypatch):
    """Only autopar's user-error type is exit 2; any other exception (a ValueError included)
    is a bug: exit 1 with its traceback."""
    import autopar.api
    from autopar.errors import UserError

    def bug(*args, **kwargs):
        raise ValueError("an internal invariant broke")

    monkeypatch.setattr(autopar.api, "plan_model_file", bug)
    code, stdout, stderr = _run(_argv([MLP]), capsys)
    assert code == 1 and stdout == ""
    assert "Traceback (most recent call last)" in stderr
    assert "ValueError: an internal invariant broke" in stderr and "internal error" in stderr

    def user_error(*args, **kwargs):
        raise UserError("value 3 breaks the rule: do this instead")

    monkeypatch.setattr(autopar.api, "plan_model_file", user_error)
    code, _, stderr = _run(_argv([MLP]), capsys)
    _assert_one_error_line(code, stderr, ["value 3 breaks the rule"], "user error")


def test_every_user_facing_error_is_a_user_error():
    from autopar.codegen.write import OutputConflict
    from autopar.cost_model import ClusterSpecError
    from autopar.cost_model.profile import ProfileError
    from autopar.ir import TraceError
    from autopar.planner.plan import PlanError
    from autopar.planner.search import NothingFitsError, PlanningError

    from autopar.errors import UserError
    from autopar.hf import HFError
    from autopar.model_file import ModelFileError

    for cls in (
        ClusterSpecError, ProfileError, TraceError, ModelFileError, HFError, PlanError,
        PlanningError, NothingFitsError, OutputConflict,
    ):  # fmt: skip
        assert issubclass(cls, UserError), cls


# -- plan files ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """The outputs of one real planning run (GPT on cpu:2)."""
    out = tmp_path_factory.mktemp("saved") / "out"
    code = main(
        [
            GPT,
            "--cluster",
            "cpu:2",
            "--global-batch",
            "4",
            "--seq-len",
            "16",
            "--out",
            str(out),
            "-q",
        ]
    )
    assert code == 0
    return out


def _edited(saved: Path, where: Path, edit) -> Path:
    raw = json.loads((saved / "plan.json").read_text())
    edit(raw)
    path = where / "edited.json"
    path.write_text(raw if isinstance(raw, str) else json.dumps(raw))
    return path


def test_plan_reemits_the_same_files_without_searching(saved, tmp_path, capsys, monkeypatch):
    import autopar.api

    def no_search(*a, **k):
        raise AssertionError("--plan must not search")

    monkeypatch.setattr(autopar.api, "plan_model_file", no_search)
    out = tmp_path / "again"
    code, _, _ = _run(["--plan", str(saved / "plan.json"), "--out", str(out), "-q"], capsys)
    assert code == 0
    for name in ("plan.json", "train.py", "launch.sh"):
        assert (out / name).read_text() == (saved / name).read_text(), name
    # a directory holding plan.json works too, and --json prints the same plan
    code, stdout, _ = _run(["--plan", str(saved), "--json"], capsys)
    assert code == 0 and Plan.from_json(stdout) == Plan.load(saved / "plan.json")


def test_plan_hand_edited_and_model_moved(saved, tmp_path, capsys):
    def edit(raw):
        raw["training"]["lr"] = 0.0123
        raw["notes"] = ["edited by hand"]

    plan = _edited(saved, tmp_path, edit)
    moved = tmp_path / "copy_of_gpt.py"
    moved.write_text(Path(GPT).read_text())
    out = tmp_path / "out"
    code, _, stderr = _run([str(moved), "--plan", str(plan), "--out", str(out), "-q"], capsys)
    assert code == 0, stderr
    train = (out / "train.py").read_text()
    assert "LR = 0.0123" in train and f"MODEL_FILE = {str(moved)!r}".replace("'", '"') in train
    assert json.loads((out / "plan.json").read_text())["model"]["file"] == str(moved)


def _set(path: str, value):
    def edit(raw):
        *parents, last = path.split(".")
        node = raw
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        node[last] = value

    return edit


def _tp2(tensor_parallel: dict, module_attrs: dict | None = None):
    """Edit: a tp=2 mesh on the plan's 2 devices, with these styles and attributes."""

    def edit(raw):
        raw["mesh"] = {"pp": 1, "dp": 1, "fsdp": 1, "tp": 2}
        raw["tensor_parallel"] = tensor_parallel
        raw["module_attrs"] = module_attrs or {}

    return edit


_ATTN = {"blocks.0.attn.q": "colwise", "blocks.0.attn.o": "rowwise"}

PLAN_CASES = [
    (
        "TP style without a tp axis",
        _set("tensor_parallel", {"head": "colwise"}),
        None,
        ["tensor_parallel is set but mesh.tp is 1", "need tp > 1"],
    ),
    (
        "TP style on the root module",
        _tp2({"": "colwise"}),
        None,
        ["styles the root module ''", "leaf modules"],
    ),
    (
        "TP style on a module holding a styled one",
        _tp2({"blocks.0.attn": "colwise", **_ATTN}),
        None,
        ["'blocks.0.attn'", "a module inside it", "leaf module"],
    ),
    (
        "module_attrs names a dunder",
        _tp2(_ATTN, {"blocks.0.attn": {"__class__": 1}}),
        None,
        ["'module_attrs.blocks.0.attn.__class__.[key]'", "dunder", "not a count"],
    ),
    (
        "module_attrs names a method",
        _tp2(_ATTN, {"blocks.0.attn": {"forward": 2}}),
        None,
        ["'forward'", "nn.Module attribute"],
    ),
    (
        "module_attrs on a module without TP",
        _tp2(_ATTN, {"blocks.1.attn": {"n_head": 2}}),
        None,
        ["'blocks.1.attn'", "holds no tensor-parallel module"],
    ),
    ("module_attrs count of 0", _tp2(_ATTN, {"blocks.0.attn": {"n_head": 0}}), None, ["n_head"]),
    (
        "NUL in a note",
        _set("notes", ["ok", "a\x00b"]),
        None,
        ["notes.1", "'\\x00'", "single lines"],
    ),
    (
        "newline in the cluster spec",
        _set("cluster.spec", "cpu:2\nrm -rf ~"),
        None,
        ["cluster.spec", "'\\n'", "control character"],
    ),
    ("escape in a key", _set("cluster.device.peak_flops", {"fp32\x1b": 1e9}), None, ["'\\x1b'"]),
    (
        "world beyond the --cluster cap",
        lambda raw: (
            _set("cluster.num_nodes", 2**20)(raw),
            _set("mesh", {"pp": 1, "dp": 2**21, "fsdp": 1, "tp": 1})(raw),
        ),
        None,
        ["2097152 devices", "more than the 1048576"],
    ),
    (
        "model file missing",
        _set("model.file", "/nonexistent/model.py"),
        None,
        ["model.file '/nonexistent/model.py'", "does not exist", "pass the model file"],
    ),
    (
        "duplicate key",
        lambda raw: None,
        '{"version": 1, "version": 1}',
        ["names 'version' twice", "regenerate"],
    ),
    ("corrupt JSON", lambda raw: None, '{"version": 1, "mesh": ', ["not valid JSON", "regenerate"]),
    ("wrong type", lambda raw: None, "[1, 2, 3]", ["is a list", "'version'", "regenerate"]),
    ("no version", lambda raw: raw.pop("version"), None, ["no 'version' key", "regenerate"]),
    ("future version", _set("version", 2), None, ["version 2 is not supported", "regenerate"]),
    ("version as text", _set("version", "1"), None, ["version '1' is not supported"]),
    ("mesh degree as text", _set("mesh.tp", "two"), None, ["'mesh.tp'", "valid integer", "fix"]),
    ("negative batch", _set("training.global_batch", -4), None, ["'training.global_batch'"]),
    (
        "unknown TP style",
        _set("tensor_parallel", {"head": "diagonal"}),
        None,
        ["'tensor_parallel.head'"],
    ),
    ("unknown key", _set("extra", 1), None, ["'extra'", "Extra inputs are not permitted"]),
    (
        "infinite step time",
        _set("predicted.step_time_s", float("inf")),
        None,
        ["'predicted.step_time_s'", "finite number"],
    ),
    (
        "code as a layer FQN",
        _set("layers", ["__import__('os').system('touch PWNED')"]),
        None,
        ["'layers.0'", "not a module FQN", "letters, digits"],
    ),
    (
        "code as a TP key",
        _set("tensor_parallel", {"x; import os": "colwise"}),
        None,
        ["not a module FQN"],
    ),
    (
        "code as the factory",
        _set("model.factory", "build_model()#"),
        None,
        ["'model.factory'", "not a Python identifier"],
    ),
    (
        "mesh is not the cluster",
        _set("mesh", {"pp": 1, "dp": 4, "fsdp": 1, "tp": 1}),
        None,
        ["multiplies to 4", "cluster cpu:2 has 2 devices", "product is 2"],
    ),
    (
        "batch not divisible",
        lambda raw: (
            _set("mesh", {"pp": 1, "dp": 2, "fsdp": 1, "tp": 1})(raw),
            _set("training.global_batch", 3)(raw),
        ),
        None,
        ["global batch 3", "data-parallel size 2", "multiple of 2"],
    ),
]


@pytest.mark.parametrize(
    ("case", "edit", "text", "words"), PLAN_CASES, ids=[c[0] for c in PLAN_CASES]
)
def test_bad_plan_is_one_error_line(case, edit, text, words, saved, tmp_path, capsys):
    if text is None:
        path = _edited(saved, tmp_path, edit)
    else:
        path = tmp_path / "bad.json"
        path.write_text(text)
    out = tmp_path / "missing" / "out"
    code, _, stderr = _run(["--plan", str(path), "--out", str(out)], capsys)
    _assert_one_error_line(code, stderr, words, case)
    assert not (tmp_path / "missing").exists() and not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--plan", "nope.json"], ["'nope.json' does not exist", "pass the plan.json"]),
        (["--plan", "empty"], ["directory without plan.json"]),
        (["--plan", "plan.json", "--cluster", "cpu:4"], ["fixes --cluster", "drop it"]),
        (
            ["--plan", "plan.json", "--mesh", "tp=2", "--dtype", "bf16"],
            ["--dtype, --mesh", "drop them"],
        ),
        (["missing.py", "--plan", "plan.json"], ["missing.py", "does not exist"]),
    ],
    ids=["missing", "directory", "search flag", "two search flags", "missing model override"],
)
def test_plan_flag_misuse(argv, words, saved, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan.json").write_text((saved / "plan.json").read_text())
    (tmp_path / "empty").mkdir()
    code, _, stderr = _run(argv, capsys)
    _assert_one_error_line(code, stderr, words, str(argv))


def test_plan_strings_are_never_code(saved, tmp_path, capsys, monkeypatch):
    """Python-looking payloads in every free-text field of a plan are only ever strings: the
    emitted train.py parses, compiles and lints, holds them only as string constants, and nothing
    runs them (the marker file never appears)."""
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "PWNED"
    payload = f"__import__('os').system('touch {marker}')"
    breakout = f'"""{payload}"""\\'  # newlines are refused (test_plan_control_characters)
    model = tmp_path / f"{payload}.py"
    model.parent.mkdir(parents=True, exist_ok=True)
    model.write_text(Path(GPT).read_text())

    def edit(raw):
        raw["model"]["file"] = str(model)
        raw["cluster"]["spec"] = breakout
        raw["cluster"]["device"]["name"] = breakout + "'"
        raw["cluster"]["device"]["source"] = payload
        raw["notes"] = [payload, breakout]
        for alt in raw["alternatives"]:
            alt["why"] = breakout

    plan = _edited(saved, tmp_path, edit)
    out = tmp_path / "out"
    code, stdout, stderr = _run(["--plan", str(plan), "--out", str(out)], capsys)
    assert code == 0, stderr
    assert payload in stdout  # the summary prints the notes as text
    train = (out / "train.py").read_text()
    tree = ast.parse(train)
    compile(tree, "train.py", "exec")
    calls = {
        n.func.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    }
    assert "__import__" not in calls
    strings = [
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]
    assert any(payload in s for s in strings)
    lint = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "--no-cache",
            "--isolated",
            "--quiet",
            str(out / "train.py"),
        ],
        capture_output=True,
        text=True,
    )
    assert lint.returncode in (0, 1), lint.stderr  # findings are fine; crashing is not
    assert subprocess.run(["bash", "-n", str(out / "launch.sh")]).returncode == 0
    assert json.loads((out / "plan.json").read_text())["notes"] == [payload, breakout]
    assert not marker.exists()


def test_module_names_torch_allows_still_plan():
    """ModuleDict keys like ``layer-1`` are legal torch names: they plan and round-trip."""
    import torch
    from torch import nn

    from autopar.api import auto_parallelize

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleDict({"layer-1": nn.Linear(8, 8), "2nd": nn.Linear(8, 8)})

        def forward(self, x):
            for block in self.blocks.values():
                x = block(x)
            return x

    with torch.device("meta"):
        model = Stack()
    inputs = (torch.zeros(2, 8, device="meta"),)
    plan = auto_parallelize(model, "cpu:2", global_batch=4, example_inputs=inputs, model_file=MLP)
    assert "blocks.layer-1" in plan.layers and Plan.from_json(plan.to_json()) == plan


# -- TP styles only on module kinds that take them (plan.json's module_kinds) ---------------------

KIND_CASES = [
    (
        "colwise on a norm",
        {**_ATTN, "blocks.0.ln1": "colwise"},
        ["'colwise'", "'blocks.0.ln1'", "a norm (module_kinds)", "takes only sequence_parallel"],
    ),
    (
        "rowwise on an embedding",
        {**_ATTN, "tok_emb": "rowwise"},
        ["'rowwise'", "'tok_emb'", "an embedding", "rowwise_from_replicate", "change the style"],
    ),
    (
        "sequence_parallel on a Linear",
        {**_ATTN, "head": "sequence_parallel"},
        ["'sequence_parallel'", "'head'", "a linear", "colwise"],
    ),
    (
        "style on a module that is no Linear, Embedding or norm",
        {"blocks.0.mlp": "colwise"},
        ["'blocks.0.mlp'", "does not list", "Linear, Embedding or norm", "remove the entry"],
    ),
]


@pytest.mark.parametrize(("case", "styles", "words"), KIND_CASES, ids=[c[0] for c in KIND_CASES])
def test_plan_tp_style_on_a_kind_that_does_not_take_it(case, styles, words, saved, tmp_path,
                                                       capsys):  # fmt: skip
    """A hand-edited plan.json styling a module whose recorded kind does not take that style is
    one line and exit 2, checked from plan.json alone (the model is never imported)."""
    assert json.loads((saved / "plan.json").read_text())["module_kinds"]["blocks.0.ln1"] == "norm"
    path = _edited(saved, tmp_path, _tp2(styles))
    out = tmp_path / "out"
    code, _, stderr = _run(["--plan", str(path), "--out", str(out)], capsys)
    _assert_one_error_line(code, stderr, words, case)
    assert not out.exists()


def test_plan_without_module_kinds_still_loads(saved, tmp_path, capsys):
    """Plans written before module_kinds existed load and re-emit as before (their styles get
    the structural checks only); the same styles with the kinds recorded pass too."""
    for drop in (True, False):

        def edit(raw, drop=drop):
            _tp2(_ATTN)(raw)
            if drop:
                raw.pop("module_kinds")

        path = _edited(saved, tmp_path, edit)
        out = tmp_path / f"out-{drop}"
        code, _, stderr = _run(["--plan", str(path), "--out", str(out), "-q"], capsys)
        assert code == 0, stderr
        written = json.loads((out / "plan.json").read_text()).get("module_kinds")
        assert (written is None) == drop, written
